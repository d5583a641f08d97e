"""The causal parallel draft head: DFlash's architecture with a causal in-block mask
(docs/draft_head.md).

The head reads the fused target features of the committed context (the residual streams of the
tapped target layers, concatenated) and a block ``[anchor, MASK x (bs-1)]`` at absolute positions
``C .. C+bs-1`` (the anchor is committed token ``C``, which the target has not seen yet). One
forward returns per-depth logits: block row ``i`` predicts the token at position ``C+i`` (tree
depth ``i``); row 0 is discarded.

Per layer, the block's queries attend to keys/values from the context (``c = hidden_norm(fc(H))``,
the same projections and k-norm as the block, RoPE at the context positions; ``c`` is *not* passed
through ``input_layernorm``) and from the block itself (docs/draft_head.md §3). The mask is built
from explicit positions (never from cache state, docs/draft_head.md §4) and shared by every
layer:

  * context key at position ``j`` is visible to block slot ``i`` iff ``j < C`` (the anchor's
    position; strictly before it);
  * block key ``j`` is visible iff ``j <= i`` (``causal=True``, JetSpec) or always
    (``causal=False``, the DFlash baseline).

The head owns no embedding and no LM head: it uses the target's (frozen, MASK row included).

Context K/V are a pure function of (feature, position), so they are cached per layer, post-RoPE,
append-only (:class:`jetspec_jax.kv_cache.KVCache` reused): each round computes only the ``acc+1``
new context rows and the block (docs/draft_head.md §5).
"""

import functools
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import kv_cache as kv_lib
from jetspec_jax.models import decoder, matmul
from jetspec_jax.models.draft_head_config import (  # the config is part of this module's API
  DraftHeadConfig as DraftHeadConfig,
)
from jetspec_jax.models.draft_head_config import check_fits_target as check_fits_target
from jetspec_jax.models.draft_head_config import config_for_target as config_for_target
from jetspec_jax.models.draft_head_config import default_tap_layers as default_tap_layers
from jetspec_jax.models.draft_head_config import head_kind as head_kind
from jetspec_jax.typing import Array, Bool, Float, Int


class DraftLayer(nn.Module):
  """A pre-norm Qwen3 decoder layer whose attention also reads injected context K/V."""

  cfg: DraftHeadConfig
  dtype: Any = jnp.float32
  live_context: bool = False  # read only the live context tiles (inference)
  compute_dtype: Any = None  # bfloat16: mixed-precision projections (models/matmul.py)

  def setup(self):
    cfg = self.cfg
    dense = functools.partial(
      nn.DenseGeneral,
      use_bias=False,
      dtype=self.dtype,
      param_dtype=self.dtype,
      **matmul.dense_options(self.compute_dtype),
    )
    self.q_proj = dense((cfg.num_attention_heads, cfg.head_dim))
    self.k_proj = dense((cfg.num_key_value_heads, cfg.head_dim))
    self.v_proj = dense((cfg.num_key_value_heads, cfg.head_dim))
    self.o_proj = dense(cfg.hidden_size, axis=(-2, -1))
    self.q_norm = decoder.RMSNorm(cfg.rms_norm_eps, self.dtype)
    self.k_norm = decoder.RMSNorm(cfg.rms_norm_eps, self.dtype)
    self.input_layernorm = decoder.RMSNorm(cfg.rms_norm_eps, self.dtype)
    self.post_attention_layernorm = decoder.RMSNorm(cfg.rms_norm_eps, self.dtype)
    self.mlp = decoder.MLP(cfg.hidden_size, cfg.intermediate_size, self.dtype, self.compute_dtype)

  def keys_values(self, h, positions):
    k = decoder.rope(self.k_norm(self.k_proj(h)), positions, self.cfg.rope_theta)
    return k, self.v_proj(h)

  def context_kv(self, context: Float[Array, 'B R D'], positions: Int[Array, 'B R']):
    """Post-RoPE K/V of fused context rows (no input_layernorm on the context)."""
    return self.keys_values(context, positions)

  def __call__(self, x, positions, ctx_k, ctx_v, ctx_mask, blk_mask):
    """Block stream ``x [B, T, D]`` attending to context K/V and to its own block.

    Args:
      x: ``[B, T, D]`` block rows (``B`` sequences at inference, ``B`` blocks in training).
      positions: ``[B, T]`` absolute positions of the block rows.
      ctx_k, ctx_v: ``[C, S, K, H]`` context K/V, ``C == B`` or ``C == 1`` (one context shared
        by every block, as in training).
      ctx_mask: ``bool[B, T, S]`` visible context slots.
      blk_mask: ``bool[T, T]`` visible block keys (causal or full).
    """
    h = self.input_layernorm(x)
    q = decoder.rope(self.q_norm(self.q_proj(h)), positions, self.cfg.rope_theta)
    k, v = self.keys_values(h, positions)
    out = context_block_attention(
      q, ctx_k, ctx_v, k, v, ctx_mask, blk_mask, live_context=self.live_context
    )
    x = x + self.o_proj(out)
    return x + self.mlp(self.post_attention_layernorm(x))


def context_block_attention(
  q, ctx_k, ctx_v, blk_k, blk_v, ctx_mask, blk_mask, *, live_context: bool = False, tile: int = 256
):
  """One softmax over ``[context keys | block keys]`` (float32), GQA.

  ``q [B, T, N, H]``, ``ctx_k/v [C, S, K, H]`` with ``C in (1, B)``, ``blk_k/v [B, T, K, H]``,
  ``ctx_mask [B, T, S]``, ``blk_mask [T, T]``. A shared context (``C == 1``) is never repeated
  per block, so training with many blocks over one long context stays linear in both. With
  ``live_context`` (inference: a context cache at a static capacity) only the context tiles up
  to the last visible slot are read (an online softmax over ``tile``-slot tiles, as the target's
  attention); training keeps the dense, differentiable form.
  """
  b, t, n, hd = q.shape
  kh = blk_k.shape[2]
  q = q.reshape(b, t, kh, n // kh, hd)
  scale = hd**-0.5
  f32 = jnp.float32
  shared = ctx_k.shape[0] == 1
  ctx_scores = 'BTKGH,SKH->BKGTS' if shared else 'BTKGH,BSKH->BKGTS'
  ctx_values = 'BKGTS,SKH->BTKGH' if shared else 'BKGTS,BSKH->BTKGH'
  pick = (lambda x: x[0]) if shared else (lambda x: x)
  s_blk = jnp.einsum('BTKGH,BPKH->BKGTP', q, blk_k, preferred_element_type=f32)
  s_blk = jnp.where(blk_mask[None, None, None], s_blk * scale, decoder.MASK_VALUE)
  capacity = ctx_k.shape[1]
  if not live_context or capacity <= tile or capacity % tile:
    s_ctx = jnp.einsum(ctx_scores, q, pick(ctx_k), preferred_element_type=f32)
    s_ctx = jnp.where(ctx_mask[:, None, None], s_ctx * scale, decoder.MASK_VALUE)
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
    p_ctx, p_blk = probs[..., : s_ctx.shape[-1]], probs[..., s_ctx.shape[-1] :]
    out = jnp.einsum(ctx_values, p_ctx.astype(ctx_v.dtype), pick(ctx_v))
    out = out + jnp.einsum('BKGTP,BPKH->BTKGH', p_blk.astype(blk_v.dtype), blk_v)
    return out.reshape(b, t, n, hd)

  # Online softmax: the block's keys first (always visible), then the live context tiles.
  m = s_blk.max(axis=-1)
  p = jnp.exp(s_blk - m[..., None])
  denom = p.sum(axis=-1)
  acc = jnp.einsum('BKGTP,BPKH->BKGTH', p.astype(blk_v.dtype), blk_v, preferred_element_type=f32)
  tile_values = ctx_values.replace('->BTKGH', '->BKGTH')  # the running output stays [B,K,G,T,H]
  visible = jnp.any(ctx_mask, axis=(0, 1))
  live = jnp.max(jnp.where(visible, jnp.arange(capacity) + 1, 0))

  def body(i, carry):
    m, denom, acc, ctx_k, ctx_v = carry  # the cache rides in the carry: no copy into the loop
    start = i * tile
    kt = jax.lax.dynamic_slice_in_dim(ctx_k, start, tile, axis=1)
    vt = jax.lax.dynamic_slice_in_dim(ctx_v, start, tile, axis=1)
    mask = jax.lax.dynamic_slice_in_dim(ctx_mask, start, tile, axis=2)
    s = jnp.einsum(ctx_scores, q, pick(kt), preferred_element_type=f32)
    s = jnp.where(mask[:, None, None], s * scale, decoder.MASK_VALUE)
    pv = lambda p: jnp.einsum(tile_values, p.astype(vt.dtype), pick(vt), preferred_element_type=f32)
    return (*decoder.online_softmax_step(m, denom, acc, s, pv), ctx_k, ctx_v)

  num_tiles = (live + tile - 1) // tile
  _, denom, acc, _, _ = jax.lax.fori_loop(0, num_tiles, body, (m, denom, acc, ctx_k, ctx_v))
  out = (acc / denom[..., None]).astype(blk_v.dtype)  # [B, K, G, T, H]
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, hd)


class DraftHeadModule(nn.Module):
  """Parameters: ``fc``, ``hidden_norm``, ``layers_i``, ``norm`` (released layout names)."""

  cfg: DraftHeadConfig
  dtype: Any = jnp.float32
  live_context: bool = False
  compute_dtype: Any = None  # bfloat16: mixed-precision projections (models/matmul.py)

  def setup(self):
    cfg = self.cfg
    self.fc = nn.Dense(
      cfg.hidden_size,
      use_bias=False,
      dtype=self.dtype,
      param_dtype=self.dtype,
      **matmul.dense_options(self.compute_dtype),
    )
    self.hidden_norm = decoder.RMSNorm(cfg.rms_norm_eps, self.dtype)
    self.layers = [
      DraftLayer(cfg, self.dtype, self.live_context, self.compute_dtype)
      for _ in range(cfg.num_hidden_layers)
    ]
    self.norm = decoder.RMSNorm(cfg.rms_norm_eps, self.dtype)

  def context_kv(self, features, positions):
    """Per-layer K/V of context rows: ``c = hidden_norm(fc(features))`` (docs/draft_head.md §2)."""
    c = self.hidden_norm(self.fc(features.astype(self.dtype)))
    kvs = [layer.context_kv(c, positions) for layer in self.layers]
    return tuple(k for k, _ in kvs), tuple(v for _, v in kvs)

  def __call__(self, x, positions, ctx_k, ctx_v, ctx_mask, blk_mask):
    for i, layer in enumerate(self.layers):
      x = layer(x, positions, ctx_k[i], ctx_v[i], ctx_mask, blk_mask)
    return self.norm(x)

  def init_all(self, features, x, positions, ctx_mask, blk_mask):
    ctx_k, ctx_v = self.context_kv(features, positions)
    return self(x, positions, ctx_k, ctx_v, ctx_mask, blk_mask)


def init_head_params(cfg: DraftHeadConfig, key, dtype=jnp.float32) -> dict:
  """Random head parameters (Flax default initialisers)."""
  features = jnp.zeros((1, 1, cfg.num_taps * cfg.hidden_size), dtype)
  x = jnp.zeros((1, 1, cfg.hidden_size), dtype)
  positions = jnp.zeros((1, 1), jnp.int32)
  ctx_mask, blk_mask = jnp.ones((1, 1, 1), bool), jnp.ones((1, 1), bool)
  module = DraftHeadModule(cfg, dtype)
  backbone_key, markov_key = jax.random.split(key)
  params = module.init(
    backbone_key, features, x, positions, ctx_mask, blk_mask, method=DraftHeadModule.init_all
  )['params']
  if cfg.markov_rank:
    params = dict(params, **init_dspark_params(cfg, markov_key, dtype))
  if cfg.reads_guesses:  # zeros: an untrained head reads a guess as its plain embedding
    params = dict(params, draft_embed=jnp.zeros((cfg.hidden_size,), dtype))
  return params


def init_dspark_params(cfg: DraftHeadConfig, key, dtype=jnp.float32) -> dict:
  """The sequential stage and confidence head of a DSpark head.

  ``markov.embed [V, r]`` (``W1``), ``markov.proj [r, V]`` (``W2``; zeros, so an untrained head
  starts as its backbone), ``confidence.kernel [D + r]`` and ``confidence.bias []``.
  """
  r, v, d = cfg.markov_rank, cfg.vocab_size, cfg.hidden_size
  k1, k2 = jax.random.split(key)
  return dict(
    markov=dict(
      embed=(jax.random.normal(k1, (v, r)) * r**-0.5).astype(dtype),
      proj=jnp.zeros((r, v), dtype),
    ),
    confidence=dict(
      kernel=(jax.random.normal(k2, (d + r,)) * (d + r) ** -0.5).astype(dtype),
      bias=jnp.zeros((), dtype),
    ),
  )


def backbone_params(params: dict) -> dict:
  """The transformer part of a head's parameters (DSpark's and JetSpec++'s extras dropped)."""
  return {k: v for k, v in params.items() if k not in ('markov', 'confidence', 'draft_embed')}


def embed_block(
  cfg: DraftHeadConfig, params: dict, embed, tokens: Int[Array, '*B T'], guessed=None
) -> Array:
  """Block inputs: ``embed(tokens)``, plus ``draft_embed`` where ``guessed`` (slots holding a
  guessed token instead of MASK: JetSpec++ and copy-seeded heads). ``embed`` is the target's
  (frozen) embedding."""
  x = embed(tokens)
  if guessed is None:
    return x
  if not cfg.reads_guesses:
    raise ValueError(
      f'a {cfg.kind} head cannot read guessed tokens (only a jetspecpp head or a head with '
      'copy_seed > 0)'
    )
  return x + jnp.where(guessed[..., None], params['draft_embed'].astype(x.dtype), 0)


def fill_slots(
  block_tokens: Int[Array, '*B T'], guesses: Int[Array, '*B depth']
) -> tuple[Int[Array, '*B T'], Bool[Array, '*B T']]:
  """The block with its draft slots (``1 .. bs-1``) holding ``guesses`` where they are ``>= 0``
  (``-1``: the slot keeps its token, MASK), and which slots now hold a guess; the one definition
  drafting (:meth:`DraftHead.block_hidden`) and training blocks share."""
  pad = [(0, 0)] * (guesses.ndim - 1) + [(1, 0)]
  guessed = jnp.pad(guesses >= 0, pad)
  return jnp.where(guessed, jnp.pad(guesses, pad), block_tokens).astype(jnp.int32), guessed


def init_from_target_layers(
  params: dict, cfg: DraftHeadConfig, target_params: dict, layer_ids: tuple[int, ...] = ()
) -> dict:
  """Head parameters whose layers start as copies of target layers (an option for training).

  Head layer ``i`` takes the weights of target layer ``layer_ids[i]`` (default: the target's
  last ``num_hidden_layers`` layers) wherever the shapes match (attention, MLP, norms; a Llama
  target has no q/k norms, so the head keeps its own), the final norm takes the target's, and
  ``fc`` starts by passing the deepest tap through (identity on its block, zeros elsewhere), so
  the untrained head reads the deepest tapped hidden state with the target's own last layers.
  Everything else keeps ``params``. The copies are new buffers, so a training step may donate
  the head's state while it reads the target's weights.
  """
  num_target = sum(k.startswith('layers_') for k in target_params)
  n = cfg.num_hidden_layers
  layer_ids = tuple(layer_ids) or tuple(range(num_target - n, num_target))
  if len(layer_ids) != n or not all(0 <= i < num_target for i in layer_ids):
    raise ValueError(f'need {n} target layer ids in [0, {num_target}), got {layer_ids}')
  out = jax.tree.map(lambda x: x, params)  # a shallow copy of every dict level

  def take(dst: dict, src: dict):
    for name, value in dst.items():
      if name not in src:
        continue
      if isinstance(value, dict):
        take(value, src[name])
      elif value.shape == src[name].shape:
        dst[name] = jnp.array(src[name], dtype=value.dtype, copy=True)  # never alias the target

  for i, layer in enumerate(layer_ids):
    src = dict(target_params[f'layers_{layer}'])
    src.update(src.pop('self_attn', {}))  # the head's attention weights sit at layer level
    take(out[f'layers_{i}'], src)
  take(out['norm'], target_params['norm'])
  d = cfg.hidden_size
  kernel = jnp.zeros_like(out['fc']['kernel'])
  out['fc'] = {'kernel': kernel.at[(cfg.num_taps - 1) * d :, :].set(jnp.eye(d, dtype=kernel.dtype))}
  return out


# The vocabulary projection.


def vocab_logits(
  target: decoder.Target,
  hidden: Float[Array, '... D'],
  draft_vocab: Int[Array, ' K'] | None = None,
  compute_dtype=None,
) -> Float[Array, '... K']:
  """float32 scores of ``hidden`` over the target's LM head, restricted to ``draft_vocab``
  (sorted token ids; the EAGLE-3 / FR-Spec reduced draft vocabulary) when given, with
  mixed-precision inputs when ``compute_dtype`` is set (:mod:`~jetspec_jax.models.matmul`)."""
  table = target.output_embedding()
  if draft_vocab is not None:
    table = table[draft_vocab]
  compute_dtype = matmul.resolve(compute_dtype)
  if compute_dtype is not None:
    return matmul.matmul(hidden, table.T, 1, compute_dtype)
  return jnp.einsum('...d,vd->...v', hidden.astype(table.dtype), table).astype(jnp.float32)


def scatter_to_vocab(logits: Float[Array, '... K'], draft_vocab, vocab_size: int) -> Array:
  """Reduced-vocabulary scores placed at their token ids of a ``vocab_size`` row; every other
  id gets ``MASK_VALUE`` (probability 0: never drafted, so verification is unchanged)."""
  full = jnp.full(logits.shape[:-1] + (vocab_size,), decoder.MASK_VALUE, logits.dtype)
  return full.at[..., draft_vocab].set(logits)


def draft_vocabulary(
  token_counts, coverage: float = 0.99, multiple: int = 128, include=None
) -> np.ndarray:
  """The most frequent token ids whose counts cover ``coverage`` of all tokens, sorted, their
  number rounded up to a ``multiple`` (matmul-friendly). ``token_counts [V]``: how often each id
  occurs in the target's own generated responses. ``include``: ids kept whatever their counts
  (a continued head's own vocabulary), the most frequent others added until the coverage."""
  counts = np.asarray(token_counts, np.float64)
  if not 0.0 < coverage <= 1.0:
    raise ValueError(f'coverage must be in (0, 1], got {coverage}')
  if counts.sum() <= 0:
    raise ValueError('token_counts is empty: no tokens to choose a draft vocabulary from')
  order = np.argsort(-counts, kind='stable')
  first = 0
  if include is not None:
    include = np.unique(np.asarray(include, np.int64))
    if len(include) and (include.min() < 0 or include.max() >= len(counts)):
      raise ValueError(f'include must hold token ids in [0, {len(counts)})')
    kept = np.isin(order, include)
    order = np.concatenate([order[kept], order[~kept]])
    first = len(include)
  covered = np.cumsum(counts[order]) / counts.sum()
  k = max(first, int(np.searchsorted(covered, coverage - 1e-12) + 1))
  k = min(len(counts), -(-k // multiple) * multiple)
  return np.sort(order[:k]).astype(np.int32)


# Masks.


def in_block_mask(cfg: DraftHeadConfig) -> Bool[Array, 'T T']:
  """Block key ``j`` visible to block query ``i``: ``j <= i`` (causal) or always (full)."""
  bs = cfg.block_size
  if cfg.causal:
    return jnp.arange(bs)[None, :] <= jnp.arange(bs)[:, None]
  return jnp.ones((bs, bs), bool)


def block_mask(
  cfg: DraftHeadConfig, anchor_pos: Int[Array, ' B'], capacity: int
) -> tuple[Bool[Array, 'B T S'], Bool[Array, 'T T']]:
  """Inference masks: context slots ``[B, bs, capacity]`` and in-block ``[bs, bs]``.

  Context slot ``j`` holds the context token at position ``j``; it is visible iff
  ``j < anchor_pos`` (strictly before the anchor). Built from positions only.

  Example, ``bs = 3``, causal, anchor at position 2, capacity 4 (``x`` visible)::

             ctx0 ctx1 ctx2 ctx3 | b0 b1 b2
      slot0   x    x    .    .   | x  .  .
      slot1   x    x    .    .   | x  x  .
      slot2   x    x    .    .   | x  x  x
  """
  ctx = jnp.arange(capacity)[None, None, :] < anchor_pos[:, None, None]
  ctx = jnp.broadcast_to(ctx, (anchor_pos.shape[0], cfg.block_size, capacity))
  return ctx, in_block_mask(cfg)


# The head as one object.


@flax.struct.dataclass
class DraftHead:
  """A draft head: its config and weights. It drafts with a target's embedding and LM head, so
  the target is passed to :meth:`propose_cached` / :meth:`propose` (it must fit:
  :func:`check_fits_target`).

  A pytree (``cfg`` static), so it can be passed into ``jit``.
  """

  cfg: DraftHeadConfig = flax.struct.field(pytree_node=False)
  params: dict
  # DSpark only: per-position temperatures of the confidence logits (``[bs]``, fitted by
  # sequential temperature scaling after training; None = uncalibrated, i.e. all ones).
  calibration: Array | None = None
  # A reduced draft vocabulary (sorted token ids ``[K]``, :func:`draft_vocabulary`): the head
  # scores only these ids; every other id has draft probability 0. None: the whole vocabulary.
  draft_vocab: Array | None = None
  # 'bfloat16': drafting's projections take bfloat16 inputs with float32 accumulation
  # (models/matmul.py); only draft scores change, so verification and the output do not.
  compute_dtype: str | None = flax.struct.field(pytree_node=False, default=None)

  @property
  def dtype(self):
    return self.params['fc']['kernel'].dtype

  def with_compute_dtype(self, compute_dtype: str | None) -> 'DraftHead':
    """The same head drafting with mixed-precision projections (``'bfloat16'``) or plain ones."""
    matmul.resolve(compute_dtype)  # a bad name fails here
    return self.replace(compute_dtype=compute_dtype)

  def vocab_logits(self, target: decoder.Target, hidden: Float[Array, '... D']) -> Array:
    """float32 draft scores ``[..., V]`` of head outputs over the target's LM head (ids outside
    :attr:`draft_vocab` get ``MASK_VALUE``)."""
    hidden = hidden.astype(target.dtype)
    if self.draft_vocab is None:
      return target.lm_logits(hidden).astype(jnp.float32)
    table = target.output_embedding()[self.draft_vocab]
    compute_dtype = matmul.resolve(self.compute_dtype)
    if compute_dtype is None and table.dtype != hidden.dtype:  # a bfloat16-weight target
      compute_dtype = table.dtype
    if compute_dtype is None:
      reduced = vocab_logits(target, hidden, self.draft_vocab)
    else:
      reduced = matmul.matmul_rows(hidden, table, compute_dtype)
    return scatter_to_vocab(reduced, self.draft_vocab, target.cfg.vocab_size)

  def make_cache(self, batch_size: int, capacity: int) -> kv_lib.KVCache:
    """An empty context K/V cache (one K/V per head layer)."""
    return kv_lib.init_cache(
      num_layers=self.cfg.num_hidden_layers,
      batch_size=batch_size,
      capacity=capacity,
      num_kv_heads=self.cfg.num_key_value_heads,
      head_dim=self.cfg.head_dim,
      dtype=self.dtype,
    )

  def extend_context(
    self,
    cache: kv_lib.KVCache,
    features: Float[Array, 'B R F'],
    num_new: Int[Array, ' B'],
  ) -> kv_lib.KVCache:
    """Appends the first ``num_new[b]`` rows of ``features`` at positions ``lengths[b] + i``."""
    r = features.shape[1]
    if features.shape[-1] != self.cfg.num_taps * self.cfg.hidden_size:
      raise ValueError(
        f'features have width {features.shape[-1]}, the head expects '
        f'{self.cfg.num_taps} taps x {self.cfg.hidden_size} = '
        f'{self.cfg.num_taps * self.cfg.hidden_size}'
      )
    offsets = jnp.arange(r, dtype=jnp.int32)[None]
    positions = cache.lengths[:, None] + offsets
    slots = jnp.where(offsets < num_new[:, None], positions, cache.capacity)
    module = DraftHeadModule(self.cfg, self.dtype, compute_dtype=matmul.resolve(self.compute_dtype))
    k, v = module.apply(
      {'params': backbone_params(self.params)},
      features,
      positions,
      method=DraftHeadModule.context_kv,
    )
    return kv_lib.KVCache(
      k=tuple(kv_lib.write_slots(buf, slots, new) for buf, new in zip(cache.k, k)),
      v=tuple(kv_lib.write_slots(buf, slots, new) for buf, new in zip(cache.v, v)),
      lengths=(cache.lengths + num_new).astype(jnp.int32),
    )

  def block_hidden(
    self,
    target: decoder.Target,
    cache: kv_lib.KVCache,
    anchor: Int[Array, ' B'],
    guesses: Int[Array, 'B depth'] | None = None,
  ) -> Float[Array, 'B T D']:
    """The final-normed outputs ``[B, bs, D]`` of the block ``[anchor, MASK, ...]`` anchored
    after the context (the anchor sits at position ``cache.lengths``, the first token without a
    feature row); the block's tokens are embedded by ``target``. A JetSpec++ or copy-seeded head
    may be given ``guesses [B, bs-1]``: the token guessed for each draft slot, ``-1`` for MASK."""
    cfg = self.cfg
    b, bs = anchor.shape[0], cfg.block_size
    ids = jnp.full((b, bs), cfg.mask_token_id, jnp.int32).at[:, 0].set(anchor)
    guessed = None
    if guesses is not None:
      ids, guessed = fill_slots(ids, guesses)
    x = embed_block(cfg, self.params, target.embed, ids, guessed).astype(self.dtype)
    anchor_pos = cache.lengths
    positions = anchor_pos[:, None] + jnp.arange(bs, dtype=jnp.int32)[None]
    ctx_mask, blk_mask = block_mask(cfg, anchor_pos, cache.capacity)
    compute_dtype = matmul.resolve(self.compute_dtype)
    module = DraftHeadModule(cfg, self.dtype, live_context=True, compute_dtype=compute_dtype)
    return module.apply(
      {'params': backbone_params(self.params)}, x, positions, cache.k, cache.v, ctx_mask, blk_mask
    )

  def propose_cached(
    self,
    target: decoder.Target,
    cache: kv_lib.KVCache,
    anchor: Int[Array, ' B'],
    guesses: Int[Array, 'B depth'] | None = None,
  ) -> Float[Array, 'B depth V']:
    """Per-depth logits ``[B, bs-1, V]`` (float32) for the block anchored after the context,
    scored by ``target``'s LM head (row ``i`` predicts depth ``i + 1``). A DSpark head's base
    logits ``U`` (no Markov bias) are ``[B, bs, V]``: its anchor slot predicts depth 1. A
    JetSpec++ head's slots may hold ``guesses`` (:meth:`block_hidden`)."""
    hidden = self.block_hidden(target, cache, anchor, guesses)
    if not self.cfg.markov_rank:
      hidden = hidden[:, 1:]
    return self.vocab_logits(target, hidden)

  def propose(
    self, target: decoder.Target, context_features: Float[Array, 'C F'], anchor: int | Array
  ) -> Float[Array, 'depth V']:
    """Per-depth logits ``[max_depth, V]`` from the whole context at once (no cache reuse;
    for a DSpark head, its base logits without the Markov bias).

    Args:
      target: the target the head drafts for (its embedding and LM head).
      context_features: fused taps ``[C, n_taps * D]`` of committed tokens ``0 .. C-1``.
      anchor: committed token ``C`` (the last one; it has no feature row).

    Returns:
      float32 logits ``[max_depth, V]``; row ``i`` predicts the token at depth ``i + 1``
      (position ``C + i + 1``).
    """
    features = jnp.asarray(context_features)
    if features.ndim != 2:
      raise ValueError(f'context_features must be [C, n_taps*D], got shape {features.shape}')
    c = features.shape[0]
    cache = self.make_cache(1, max(c, 1))
    cache = self.extend_context(cache, features[None], jnp.array([c], jnp.int32))
    return self.propose_cached(target, cache, jnp.asarray(anchor, jnp.int32).reshape(1))[0]


def random_draft_head(
  target: decoder.Target,
  *,
  block_size: int = 8,
  causal: bool = True,
  seed: int = 0,
  num_layers: int = 2,
  target_layer_ids: tuple[int, ...] | None = None,
  scale: float = 1.0,
  markov_rank: int = 0,
  refine: bool = False,
  copy_seed: int = 0,
) -> DraftHead:
  """A randomly initialised head that fits ``target`` (``scale`` multiplies the weights).

  With ``markov_rank`` a DSpark head (bidirectional) whose Markov bias is random too (a trained
  head's starts at zero), so tests see a bias that depends on the previous token. With
  ``refine`` (a JetSpec++ head) or ``copy_seed`` a head whose ``draft_embed`` is random too (a
  trained head's starts at 0).
  """
  cfg = config_for_target(
    target.cfg,
    num_layers=num_layers,
    block_size=block_size,
    causal=causal and not markov_rank,
    target_layer_ids=target_layer_ids,
    markov_rank=markov_rank,
    refine=refine,
    copy_seed=copy_seed,
  )
  params = init_head_params(cfg, jax.random.key(seed), target.dtype)
  if cfg.reads_guesses:
    draft_embed = jax.random.normal(jax.random.key(seed + 2), (cfg.hidden_size,))
    params['draft_embed'] = draft_embed.astype(target.dtype)
  if markov_rank:
    proj = jax.random.normal(jax.random.key(seed + 1), params['markov']['proj'].shape)
    params['markov'] = dict(params['markov'], proj=proj.astype(target.dtype))
  if scale != 1.0:
    params = jax.tree.map(lambda p: p * scale, params)
  return DraftHead(cfg=cfg, params=params)
