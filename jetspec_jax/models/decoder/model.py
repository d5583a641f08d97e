"""The decoder model, used functionally (``init_params``, ``forward``, ``lm_logits``), and
:class:`Target`, the target as one object (config + parameters)."""

from typing import Any, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import kv_cache as kv_lib
from jetspec_jax.models import matmul
from jetspec_jax.models.decoder.config import DecoderConfig
from jetspec_jax.models.decoder.layers import (
  ATTN_IMPLS,
  CausalSlots,
  DecoderLayer,
  DenseMask,
  RMSNorm,
  TailMask,
)
from jetspec_jax.typing import Array, Bool, Float, Int


class Decoder(nn.Module):
  """The Qwen3 / Qwen3-MoE decoder. Parameter names mirror Hugging Face's (see ``hf_io``)."""

  cfg: DecoderConfig
  dtype: Any = jnp.float32
  attn_impl: str = 'xla'
  compute_dtype: Any = None  # bfloat16: mixed-precision projections (models/matmul.py)
  # Where the residual stream [B, T, D] lives (e.g. batch over 'data'), held after every layer:
  # with FSDP-sharded weights, jit then gathers the weights rather than the batch.
  activation_sharding: Any = None

  def setup(self):
    cfg = self.cfg
    self.embed_tokens = nn.Embed(
      cfg.vocab_size,
      cfg.hidden_size,
      dtype=self.dtype,
      param_dtype=self.dtype,
      embedding_init=nn.initializers.normal(0.02),
    )
    self.layers = [
      DecoderLayer(cfg, i, self.dtype, self.attn_impl, self.compute_dtype)
      for i in range(cfg.num_hidden_layers)
    ]
    self.norm = RMSNorm(cfg.rms_norm_eps, self.dtype)
    if not cfg.tie_word_embeddings:
      self.lm_head = nn.Dense(
        cfg.vocab_size,
        use_bias=False,
        dtype=self.dtype,
        param_dtype=self.dtype,
        **matmul.dense_options(self.compute_dtype),
      )

  def __call__(self, tokens, positions, slots, mask, cache_k, cache_v, taps=()):
    def pin(x):
      if self.activation_sharding is None:
        return x
      return jax.lax.with_sharding_constraint(x, self.activation_sharding)

    x = pin(self.embed(tokens))
    new_k, new_v, tapped = [], [], {}
    for i, layer in enumerate(self.layers):
      x, k, v = layer(x, positions, slots, mask, cache_k[i], cache_v[i])
      x = pin(x)
      new_k.append(k)
      new_v.append(v)
      if i in taps:
        tapped[i] = x
    features = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
    return self.norm(x), tuple(new_k), tuple(new_v), features

  def embed(self, tokens):
    # Gather the rows, then cast them: nn.Embed would cast the whole [V, D] table to the
    # activation dtype on every call (with bfloat16 weights and float32 activations).
    return jnp.take(self.embed_tokens.embedding, tokens, axis=0).astype(self.dtype)

  def lm_logits(self, hidden):
    if self.cfg.tie_word_embeddings:
      if self.compute_dtype is not None:
        return matmul.matmul_rows(hidden, self.embed_tokens.embedding, self.compute_dtype)
      return self.embed_tokens.attend(hidden)
    return self.lm_head(hidden)

  def init_all(self, tokens, positions, slots, mask, cache_k, cache_v):
    """Touches every parameter (used by ``init``)."""
    hidden, *_ = self(tokens, positions, slots, mask, cache_k, cache_v)
    return self.lm_logits(hidden)


# Functional API.


class ForwardOutput(NamedTuple):
  """Result of :func:`forward`.

  Attributes:
    hidden: ``[B, T, D]`` final-normed hidden states (apply :func:`logits` for logits).
    cache: the cache with the new tokens' K/V written.
    taps: ``[B, T, len(taps) * D]`` residual streams after the tapped layers, or None.
  """

  hidden: Array
  cache: kv_lib.KVCache
  taps: Array | None


def make_cache(
  cfg: DecoderConfig, batch_size: int, capacity: int, dtype=jnp.float32
) -> kv_lib.KVCache:
  """An empty KV cache for ``cfg`` at a static ``capacity``."""
  return kv_lib.init_cache(
    num_layers=cfg.num_hidden_layers,
    batch_size=batch_size,
    capacity=capacity,
    num_kv_heads=cfg.num_key_value_heads,
    head_dim=cfg.head_dim,
    dtype=dtype,
  )


def init_params(cfg: DecoderConfig, key, dtype=jnp.float32) -> dict:
  """Random parameters (Flax default initialisers; embeddings and router ~ N(0, 0.02))."""
  model = Decoder(cfg, dtype)
  tokens = jnp.zeros((1, 1), jnp.int32)
  cache = make_cache(cfg, 1, 1, dtype)
  mask = DenseMask(jnp.ones((1, 1, 1), bool))
  variables = model.init(
    key, tokens, tokens, tokens, mask, cache.k, cache.v, method=Decoder.init_all
  )
  return variables['params']


def forward(
  params: dict,
  tokens: Int[Array, 'B T'],
  cache: kv_lib.KVCache,
  *,
  cfg: DecoderConfig,
  positions: Int[Array, 'B T'] | None = None,
  slots: Int[Array, 'B T'] | None = None,
  mask: 'Bool[Array, "B T S"] | TailMask | None' = None,
  taps: tuple[int, ...] = (),
  attn_impl: str = 'xla',
  compute_dtype=None,
  activation_sharding=None,
) -> ForwardOutput:
  """One target forward in prefill, decode or masked mode (see module docstring).

  Args:
    params: the parameter pytree.
    tokens: ``int32[B, T]`` new tokens.
    cache: the KV cache; the new tokens' K/V are written at ``slots``.
    cfg: the architecture.
    positions: ``int32[B, T]`` RoPE positions; defaults to ``cache.lengths[:, None] + arange(T)``.
    slots: ``int32[B, T]`` cache slots to write; defaults to ``prefix_len + arange(T)`` with a
      :class:`TailMask`, else to ``positions``. Slots ``>= S`` are dropped (padding rows).
    mask: which cache slots (after the write) each new token attends to: a dense
      ``bool[B, T, S]`` (XLA path only), a :class:`TailMask`, or None for causal (query ``t``
      sees slots ``<= slots[t]``; on the Pallas path: ``TailMask(cache.lengths)``, which assumes
      the new tokens sit at slots ``lengths + t``).
    taps: layer ids whose output residual stream is returned, concatenated in this order.
    attn_impl: ``'xla'`` (dense-mask reference), ``'pallas'`` (the platform's tree-attention
      kernel: Triton on CUDA, Mosaic on TPU, interpreted on CPU) or ``'pallas_mosaic'`` (the
      Mosaic kernel; TPU interpret mode on CPU).
    compute_dtype: ``'bfloat16'``: the projections take bfloat16 inputs and accumulate in
      float32 (:mod:`~jetspec_jax.models.matmul`); None: in the parameters' dtype.
    activation_sharding: a sharding the residual stream ``[B, T, D]`` is held to after every
      layer (training: the batch over ``'data'`` while the weights are FSDP-sharded); None:
      left to ``jit``.

  Returns:
    A :class:`ForwardOutput`. ``cache.lengths`` becomes ``max(lengths, max(slots) + 1)`` over the
    slots that fit in the cache; callers that commit a tree set lengths explicitly.
  """
  validate_forward_args(cfg, tokens, cache, taps, attn_impl)
  b, t = tokens.shape
  if positions is None:
    positions = cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
  if slots is None:
    # A TailMask places the new tokens right after the prefix; otherwise slot == position.
    offsets = jnp.arange(t, dtype=jnp.int32)[None]
    slots = mask.prefix_len[:, None] + offsets if isinstance(mask, TailMask) else positions
  if attn_impl != 'xla':
    if mask is None:
      mask = TailMask(cache.lengths)
    elif not isinstance(mask, TailMask):
      raise ValueError(
        f'attn_impl={attn_impl!r} needs a TailMask (or None for causal), not a dense mask'
      )
  elif mask is None:
    mask = CausalSlots(slots)
  elif not isinstance(mask, TailMask):
    if mask.shape != (b, t, cache.capacity):
      raise ValueError(f'mask must have shape [B, T, S]={(b, t, cache.capacity)}, got {mask.shape}')
    mask = DenseMask(mask)
  model = Decoder(cfg, cache.dtype, attn_impl, matmul.resolve(compute_dtype), activation_sharding)
  hidden, new_k, new_v, features = model.apply(
    {'params': params}, tokens, positions, slots, mask, cache.k, cache.v, taps
  )
  written = jnp.where(slots < cache.capacity, slots + 1, 0).max(axis=1)
  lengths = jnp.maximum(cache.lengths, written).astype(jnp.int32)
  return ForwardOutput(hidden, kv_lib.KVCache(new_k, new_v, lengths), features)


def lm_logits(
  params: dict, hidden: Float[Array, '... D'], *, cfg: DecoderConfig, compute_dtype=None
) -> Array:
  """Applies the LM head (or the tied embedding) to final-normed hidden states."""
  model = Decoder(cfg, hidden.dtype, compute_dtype=matmul.resolve(compute_dtype))
  return model.apply({'params': params}, hidden, method=Decoder.lm_logits)


def embed(params: dict, tokens: Int[Array, '...'], *, cfg: DecoderConfig, dtype=None) -> Array:
  """The target's token embedding (the draft head uses it for its block tokens), in ``dtype``
  (default: the embedding table's)."""
  dtype = dtype or params['embed_tokens']['embedding'].dtype
  return Decoder(cfg, dtype).apply({'params': params}, tokens, method=Decoder.embed)


def validate_forward_args(cfg: DecoderConfig, tokens, cache: kv_lib.KVCache, taps, attn_impl):
  """Static checks with errors that say what is wrong."""
  if attn_impl not in ATTN_IMPLS:
    raise ValueError(f'attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}')
  if tokens.ndim != 2:
    raise ValueError(f'token ids must be int[B, T], got shape {tokens.shape}')
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise TypeError(f'token ids must be an integer array, got dtype {tokens.dtype}')
  if tokens.shape[0] != cache.batch_size:
    raise ValueError(f'batch {tokens.shape[0]} does not match the cache batch {cache.batch_size}')
  if tokens.shape[1] > cache.capacity:
    raise ValueError(f'{tokens.shape[1]} new tokens exceed the cache capacity {cache.capacity}')
  if cache.num_layers != cfg.num_hidden_layers:
    raise ValueError(f'cache has {cache.num_layers} layers, model has {cfg.num_hidden_layers}')
  for layer in taps:
    if not 0 <= layer < cfg.num_hidden_layers:
      raise ValueError(f'tap layer {layer} is outside [0, {cfg.num_hidden_layers})')


def check_token_ids(token_ids, vocab_size: int) -> None:
  """Eager value checks on concrete token ids (skipped for tracers)."""
  if isinstance(token_ids, jax.core.Tracer):
    return
  ids = np.asarray(token_ids)
  if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
    raise ValueError(
      f'token ids must be in [0, {vocab_size}), got range [{ids.min()}, {ids.max()}]'
    )


# The target as one object.


@flax.struct.dataclass
class Target:
  """A frozen target LLM: architecture, parameters and attention implementation.

  A pytree (``cfg`` and ``attn_impl`` are static), so it can be passed into ``jit``.
  """

  cfg: DecoderConfig = flax.struct.field(pytree_node=False)
  params: dict
  attn_impl: str = flax.struct.field(pytree_node=False, default='xla')
  # 'bfloat16': matmuls with bfloat16 inputs and float32 accumulation (models/matmul.py) over
  # float32 (or bfloat16) weights; 'bfloat16x2': each input as two bfloat16 halves (matmul.SPLIT);
  # None: plain matmuls in the parameters' dtype.
  compute_dtype: str | None = flax.struct.field(pytree_node=False, default=None)
  # The dtype of activations and the KV cache; None: the parameters' dtype. Differs from it
  # only for weights stored narrower than the activations (:meth:`with_weight_dtype`).
  activation_dtype: str | None = flax.struct.field(pytree_node=False, default=None)
  # The prompt's forward (``rounds.prefill``) in another compute mode; None: ``compute_dtype``.
  # AR and every speculative method run the same prefill, so its precision cannot make their
  # outputs differ; only the decode and verify forwards must sum alike (:meth:`for_prefill`).
  prefill_compute_dtype: str | None = flax.struct.field(pytree_node=False, default=None)

  @property
  def dtype(self):
    """The activation (and KV cache, tapped feature) dtype."""
    if self.activation_dtype is not None:
      return jnp.dtype(self.activation_dtype)
    return self.params['embed_tokens']['embedding'].dtype

  def with_attn_impl(self, attn_impl: str) -> 'Target':
    if attn_impl not in ATTN_IMPLS:
      raise ValueError(f'attn_impl must be one of {ATTN_IMPLS}, got {attn_impl!r}')
    return self.replace(attn_impl=attn_impl)

  def make_cache(self, batch_size: int, capacity: int) -> kv_lib.KVCache:
    return make_cache(self.cfg, batch_size, capacity, self.dtype)

  def with_compute_dtype(self, compute_dtype: str | None) -> 'Target':
    """The same target with mixed-precision matmuls (``'bfloat16'``) or plain ones (None)."""
    matmul.resolve(compute_dtype)  # a bad name fails here
    return self.replace(compute_dtype=compute_dtype)

  def with_prefill_compute_dtype(self, compute_dtype: str | None) -> 'Target':
    """The same target whose prompt forward (prefill) runs in ``compute_dtype`` (``'float32'``,
    ``'bfloat16'``, ``'bfloat16x2'``; None: as every other forward). For a bfloat16x2 target,
    ``'bfloat16'`` rounds the prefill's inputs once, faster on a CPU with AMX (docs/benchmarks.md
    §2b), and greedy speculative decoding still equals this target's AR (up to float near-ties,
    docs/design.md §5), which reads the same prefill."""
    matmul.resolve(compute_dtype)  # a bad name fails here
    return self.replace(prefill_compute_dtype=compute_dtype)

  def for_prefill(self) -> 'Target':
    """The target that runs the prompt's forward (:meth:`with_prefill_compute_dtype`)."""
    if self.prefill_compute_dtype is None:
      return self
    return self.replace(compute_dtype=self.prefill_compute_dtype, prefill_compute_dtype=None)

  def with_weight_dtype(self, weight_dtype: str, *, split_inputs: bool = False) -> 'Target':
    """The same target with its weight matrices stored in ``weight_dtype`` (``'bfloat16'``:
    half the bytes each step reads) and the projections taking ``weight_dtype`` inputs with
    float32 accumulation; activations, the KV cache and the norm scales keep the current dtype.
    Close to the float32 target, not equal (greedy near-ties can flip).

    ``split_inputs`` (bfloat16 only): each projection's input is the sum of two bfloat16 halves
    (:data:`~jetspec_jax.models.matmul.SPLIT`) instead of one rounding, so that greedy
    speculative decoding of this target keeps equal to its AR on the measured prompts. Like the
    float32 target's, that equality holds up to float near-ties (docs/design.md §5); a verify's
    logits differ from a decode step's by ~1e-5 here against ~1e-6 in float32, so ties flip
    more often."""
    compute_dtype = matmul.resolve(weight_dtype)  # a bad name fails here; float32 -> None
    dtype = jnp.dtype(weight_dtype)
    if split_inputs and dtype != jnp.bfloat16:
      raise ValueError(f'split_inputs takes bfloat16 weights, got {weight_dtype!r}')
    params = jax.tree.map(lambda p: p.astype(dtype) if p.ndim >= 2 else p, self.params)
    if split_inputs:
      compute_dtype = matmul.SPLIT
    elif compute_dtype is not None:
      compute_dtype = dtype.name
    return self.replace(
      params=params, activation_dtype=jnp.dtype(self.dtype).name, compute_dtype=compute_dtype
    )

  def forward(self, tokens, cache, **kwargs) -> ForwardOutput:
    return forward(
      self.params,
      tokens,
      cache,
      cfg=self.cfg,
      attn_impl=self.attn_impl,
      compute_dtype=self.compute_dtype,
      **kwargs,
    )

  def lm_logits(self, hidden):
    """Vocabulary scores of final-normed hidden states (the LM head or the tied embedding)."""
    return lm_logits(self.params, hidden, cfg=self.cfg, compute_dtype=self.compute_dtype)

  def embed(self, tokens):
    return embed(self.params, tokens, cfg=self.cfg, dtype=self.dtype)

  def output_embedding(self) -> Float[Array, 'V D']:
    """The LM head as vocabulary rows ``[V, D]``: the tied embedding, or the head's kernel."""
    if self.cfg.tie_word_embeddings:
      return self.params['embed_tokens']['embedding']
    return self.params['lm_head']['kernel'].T

  def forward_logits(self, token_ids: Int[Array, 'B T']) -> Float[Array, 'B T V']:
    """Plain causal forward over ``token_ids`` from an empty cache; float32 logits."""
    token_ids = jnp.asarray(token_ids)
    check_token_ids(token_ids, self.cfg.vocab_size)
    if token_ids.ndim != 2:
      raise ValueError(
        f'token ids must be int[B, T], got shape {token_ids.shape}; add a batch axis with ids[None]'
      )
    if not jnp.issubdtype(token_ids.dtype, jnp.integer):
      raise TypeError(f'token ids must be an integer array, got dtype {token_ids.dtype}')
    return _full_logits(self, token_ids.astype(jnp.int32))


@jax.jit
def _full_logits(target: Target, token_ids):
  b, t = token_ids.shape
  out = target.forward(token_ids, target.make_cache(b, t))
  return target.lm_logits(out.hidden).astype(jnp.float32)


def count_params(params) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
