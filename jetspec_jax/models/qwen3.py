"""The target transformer in Flax Linen, used functionally: Qwen3, Qwen3-MoE and the Llama family.

One module with config switches covers the families (DESIGN.md §2): Qwen3 (per-head q/k RMSNorm,
no bias), Qwen3-MoE (sparse MLP blocks), Llama / SmolLM2 (no q/k norm, optional Llama-3 RoPE
scaling) and Qwen2 (q/k/v bias). ``Qwen3Config.model_type`` names the family for checkpoint I/O.

One forward serves three modes (DESIGN.md §5):

* **prefill** (causal): ``T`` prompt tokens written to slots ``0..T-1``;
* **decode**: one token written at its slot, attending to every earlier slot;
* **masked**: new tokens at explicit positions and slots, with an explicit boolean mask over the
  cache slots (committed prefix + the new tokens themselves). The tree verifier uses it.

The new tokens' K/V are first written into the cache at ``slots``; attention then reads only the
used part of the cache: an online softmax over the key tiles that hold a slot some query may see
(:func:`attention_live`), so memory stays linear in ``T``. Without an explicit mask, query ``t``
sees every slot ``<= slots[t]`` (causal; correct because committed slots are contiguous
positions).

The forward optionally returns the residual stream after each layer in ``taps`` (the "target
features" the draft head reads, spec §B.2), concatenated on the feature axis. A tap is the raw
residual (pre final norm) for every layer; note that Hugging Face's last ``hidden_states`` entry is
post final norm, so it differs for ``L = num_layers - 1`` only.
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import kv_cache as kv_lib
from jetspec_jax.models import matmul
from jetspec_jax.typing import Array, Bool, Float, Int
from pallas_kernels import dispatch as kernel_dispatch
from pallas_kernels import tree_attention as tree_attention_kernel

ATTN_IMPLS = ('xla',) + kernel_dispatch.IMPLS  # 'pallas': the platform's kernel
MASK_VALUE = tree_attention_kernel.MASK_VALUE


# Each family's Hugging Face ``architectures`` name (the ``model_type`` is the key).
HF_ARCHITECTURES = {
  'qwen3': 'Qwen3ForCausalLM',
  'qwen3_moe': 'Qwen3MoeForCausalLM',
  'llama': 'LlamaForCausalLM',
  'qwen2': 'Qwen2ForCausalLM',
}
MODEL_TYPES = tuple(HF_ARCHITECTURES)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama-3 RoPE frequency scaling (``rope_type: llama3`` in Hugging Face configs).

  Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are divided by
  ``factor``, shorter than ``original / high_freq_factor`` kept, and the band between is
  interpolated smoothly (Hugging Face's ``_compute_llama3_parameters``).
  """

  factor: float
  low_freq_factor: float
  high_freq_factor: float
  original_max_position_embeddings: int

  def __post_init__(self):
    if self.high_freq_factor <= self.low_freq_factor:
      raise ValueError(f'{self.high_freq_factor=} must exceed {self.low_freq_factor=}')


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
  """Architecture of a target transformer. Hashable: a static ``jit`` argument.

  ``num_experts == 0`` means dense. For MoE, layer ``i`` is sparse iff ``i`` is not in
  ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0`` (Hugging Face's rule).
  The Llama family is the same module with ``qk_norm=False`` (and ``attention_bias=True`` for
  Qwen2's q/k/v biases); ``model_type`` only decides how the config is written back to disk.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 40960
  # Qwen3-MoE.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = True
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  eos_token_id: int | None = None
  # Family switches (Qwen3 defaults).
  model_type: str = 'qwen3'
  qk_norm: bool = True
  attention_bias: bool = False
  rope_scaling: RopeScaling | None = None

  def __post_init__(self):
    if self.model_type not in MODEL_TYPES:
      raise ValueError(f'model_type must be one of {MODEL_TYPES}, got {self.model_type!r}')
    if (self.num_experts > 0) != (self.model_type == 'qwen3_moe'):
      raise ValueError(
        f"{self.num_experts=} needs model_type 'qwen3_moe' (and only it has experts)"
      )
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f'{self.num_attention_heads=} must be a multiple of {self.num_key_value_heads=}'
      )
    if self.head_dim % 2:
      raise ValueError(f'{self.head_dim=} must be even for rotary embeddings')
    if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
      raise ValueError(f'{self.num_experts_per_tok=} must be in [1, {self.num_experts=}]')

  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  @property
  def heads_per_kv(self) -> int:
    return self.num_attention_heads // self.num_key_value_heads

  def is_sparse_layer(self, i: int) -> bool:
    return self.is_moe and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0


def qwen3_0_6b() -> Qwen3Config:
  return Qwen3Config(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=True,
    eos_token_id=151645,
  )


def qwen3_8b() -> Qwen3Config:
  return Qwen3Config(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
    eos_token_id=151645,
  )


def qwen3_30b_a3b() -> Qwen3Config:
  return Qwen3Config(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    tie_word_embeddings=False,
    num_experts=128,
    num_experts_per_tok=8,
    moe_intermediate_size=768,
    norm_topk_prob=True,
    eos_token_id=151645,
    model_type='qwen3_moe',
  )


def smollm2_135m() -> Qwen3Config:
  """SmolLM2-135M(-Instruct): Llama architecture, 30 layers, 9 query / 3 KV heads, tied."""
  return Qwen3Config(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100_000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
    eos_token_id=2,
    model_type='llama',
    qk_norm=False,
  )


def tiny(**overrides) -> Qwen3Config:
  """A small dense config with odd, prime-ish sizes so shape bugs show (STYLE.md item 3)."""
  base = dict(
    vocab_size=257,
    hidden_size=44,
    intermediate_size=67,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=14,
    rope_theta=10_000.0,
    max_position_embeddings=512,
  )
  return Qwen3Config(**{**base, **overrides})


def tiny_moe(**overrides) -> Qwen3Config:
  """A small Qwen3-MoE config: 5 experts, top-2, one dense layer."""
  base = dict(
    num_experts=5,
    num_experts_per_tok=2,
    moe_intermediate_size=23,
    mlp_only_layers=(1,),
    model_type='qwen3_moe',
  )
  return tiny(**{**base, **overrides})


def tiny_llama(**overrides) -> Qwen3Config:
  """A small Llama-family config (no q/k norm, tied embeddings, Llama-3 RoPE scaling)."""
  base = dict(
    model_type='llama',
    qk_norm=False,
    tie_word_embeddings=True,
    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64),
  )
  return tiny(**{**base, **overrides})


# Every named config (real shapes and tiny test models), for binaries and configs to name.
PRESETS = {
  'qwen3_0_6b': qwen3_0_6b,
  'qwen3_8b': qwen3_8b,
  'qwen3_30b_a3b': qwen3_30b_a3b,
  'smollm2_135m': smollm2_135m,
  'tiny': tiny,
  'tiny_moe': tiny_moe,
  'tiny_llama': tiny_llama,
}


# Modules.


class RMSNorm(nn.Module):
  """RMS norm over the last axis, computed in float32 (as Hugging Face Qwen3)."""

  eps: float
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Array) -> Array:
    scale = self.param('scale', nn.initializers.ones, (x.shape[-1],), self.dtype)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return scale * y.astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
  """The ``head_dim / 2`` RoPE inverse frequencies (float32), with Llama-3 scaling if given."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling is None:
    return inv_freq.astype(np.float32)
  old = scaling.original_max_position_embeddings
  low_wavelen = old / scaling.low_freq_factor
  high_wavelen = old / scaling.high_freq_factor
  wavelen = 2 * np.pi / inv_freq
  scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
  smooth = (old / wavelen - scaling.low_freq_factor) / (
    scaling.high_freq_factor - scaling.low_freq_factor
  )
  smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


def rope(
  x: Float[Array, 'B T N H'],
  positions: Int[Array, 'B T'],
  theta: float,
  scaling: RopeScaling | None = None,
) -> Array:
  """Rotary embedding, Hugging Face's half-split ("rotate_half") layout, angles in float32."""
  half = x.shape[-1] // 2
  inv_freq = jnp.asarray(rope_inv_freq(x.shape[-1], theta, scaling))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, H/2]
  cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)
  sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class TailMask(NamedTuple):
  """A structured attention mask: committed prefix + the new tokens' own (tail) relation.

  New token ``t`` (written at slot ``prefix_len + t``) sees every slot ``< prefix_len`` and, among
  the new tokens, itself and its ancestors (``ancestors[b, t, j]``), or every ``j <= t`` when
  ``ancestors`` is None (causal: chunked prefill, decode). Both attention implementations take
  it; only the XLA path also takes an arbitrary dense mask.
  """

  prefix_len: Int[Array, ' B']
  ancestors: Bool[Array, 'B T T'] | None = None

  def to_dense(self, num_new: int, capacity: int) -> Bool[Array, 'B T S']:
    return self.block(num_new, 0, capacity)

  def block(self, num_new: int, col_start, cols: int) -> Bool[Array, 'B T C']:
    """Columns ``col_start .. col_start+cols`` (cache slots) of the dense ``[B, T, S]`` mask."""
    slots = col_start + jnp.arange(cols)[None, None, :]
    rel = slots - self.prefix_len[:, None, None]
    prefix = slots < self.prefix_len[:, None, None]
    if self.ancestors is None:
      tail = (rel >= 0) & (rel <= jnp.arange(num_new)[None, :, None])
    else:
      idx = jnp.broadcast_to(jnp.clip(rel, 0, num_new - 1), self.ancestors.shape[:2] + (cols,))
      tail = (rel >= 0) & (rel < num_new) & jnp.take_along_axis(self.ancestors, idx, axis=2)
    return prefix | tail

  def live_slots(self, num_new: int) -> Int[Array, '']:
    return jnp.max(self.prefix_len) + num_new


class CausalSlots(NamedTuple):
  """Plain causal attention by slot: new token ``t`` sees every cache slot ``<= slots[b, t]``."""

  slots: Int[Array, 'B T']

  def block(self, num_new: int, col_start, cols: int) -> Bool[Array, 'B T C']:
    del num_new
    return col_start + jnp.arange(cols)[None, None, :] <= self.slots[:, :, None]

  def live_slots(self, num_new: int) -> Int[Array, '']:
    del num_new
    return jnp.max(self.slots) + 1  # padding rows (slot >= capacity) see every live slot


class DenseMask(NamedTuple):
  """An explicit ``[B, T, S]`` mask over the whole capacity."""

  mask: Bool[Array, 'B T S']

  def block(self, num_new: int, col_start, cols: int) -> Bool[Array, 'B T C']:
    del num_new
    return jax.lax.dynamic_slice_in_dim(self.mask, col_start, cols, axis=2)

  def live_slots(self, num_new: int) -> Int[Array, '']:
    del num_new
    return jnp.int32(self.mask.shape[-1])


def online_softmax_step(m, denom, acc, scores, weighted_values):
  """Folds one tile of masked float32 ``scores [..., T, C]`` into a running softmax.

  ``m``/``denom`` ``[..., T]`` are the running max and normaliser, ``acc [..., T, H]`` the
  unnormalised output; ``weighted_values(p)`` is ``p @ values`` of the tile.
  """
  m_new = jnp.maximum(m, scores.max(axis=-1))
  p = jnp.exp(scores - m_new[..., None])
  alpha = jnp.exp(m - m_new)
  return m_new, denom * alpha + p.sum(axis=-1), acc * alpha[..., None] + weighted_values(p)


def attention_live(
  q: Float[Array, 'B T N H'],
  k: Float[Array, 'B S K H'],
  v: Float[Array, 'B S K H'],
  mask: 'TailMask | CausalSlots | DenseMask',
  *,
  tile: int = 256,
) -> Array:
  """Attention over the used part of the cache only, with memory linear in ``T``.

  A flash-style online softmax (float32) over key tiles of ``tile`` slots, visiting only the
  ``ceil(live / tile)`` tiles that hold a slot some query may see (``mask.live_slots``): a decode
  step with 512 live slots in a 4096-slot cache reads 512 slots, with static shapes (no
  recompilation as the length grows), and scores are ``[B, N, T, tile]``, never ``[B, N, T, S]``
  (a long prefill stays linear in its length). Equals :func:`attention_xla` on the dense mask.
  """
  b, t, n, h = q.shape
  capacity, kh = k.shape[1], k.shape[2]
  tile = min(tile, capacity)
  if t >= capacity or capacity % tile:
    # Every slot is a query's own (a training forward, a full-cache prefill): nothing to skip,
    # and the dense path is differentiable (a loop with a data-dependent trip count is not).
    return attention_xla(q, k, v, mask.block(t, 0, capacity))
  q = q.reshape(b, t, kh, n // kh, h)
  live = jnp.minimum(mask.live_slots(t), capacity)
  num_tiles = (live + tile - 1) // tile
  f32 = jnp.float32

  def body(i, carry):
    m, denom, acc, k, v = carry  # the cache rides in the carry: no copy into the loop
    start = i * tile
    kt = jax.lax.dynamic_slice_in_dim(k, start, tile, axis=1)
    vt = jax.lax.dynamic_slice_in_dim(v, start, tile, axis=1)
    s = jnp.einsum('BTKGH,BSKH->BKGTS', q, kt, preferred_element_type=f32) * (h**-0.5)
    s = jnp.where(mask.block(t, start, tile)[:, None, None], s, MASK_VALUE)
    pv = lambda p: jnp.einsum(
      'BKGTS,BSKH->BKGTH', p.astype(vt.dtype), vt, preferred_element_type=f32
    )
    return (*online_softmax_step(m, denom, acc, s, pv), k, v)

  shape = (b, kh, n // kh, t)
  init = (jnp.full(shape, -jnp.inf, f32), jnp.zeros(shape, f32), jnp.zeros((*shape, h), f32), k, v)
  _, denom, acc, _, _ = jax.lax.fori_loop(0, num_tiles, body, init)
  out = (acc / denom[..., None]).astype(v.dtype)  # [B, K, G, T, H]
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, n, h)


def attention_xla(
  q: Float[Array, 'B T N H'],
  k: Float[Array, 'B S K H'],
  v: Float[Array, 'B S K H'],
  mask: Bool[Array, 'B T S'],
) -> Array:
  """Dense-mask GQA attention with a float32 softmax: the reference path."""
  b, t, n, h = q.shape
  kh = k.shape[2]
  q = q.reshape(b, t, kh, n // kh, h)
  scores = jnp.einsum('BTKGH,BSKH->BKGTS', q, k, preferred_element_type=jnp.float32)
  scores = scores * (h**-0.5)
  scores = jnp.where(mask[:, None, None], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  out = jnp.einsum('BKGTS,BSKH->BTKGH', probs, v)
  return out.reshape(b, t, n, h)


class Attention(nn.Module):
  """GQA attention with RoPE (and, per family, q/k RMSNorm or q/k/v bias); one layer's cache."""

  cfg: Qwen3Config
  dtype: Any = jnp.float32
  attn_impl: str = 'xla'
  compute_dtype: Any = None  # bfloat16: mixed-precision projections (models/matmul.py)

  @nn.compact
  def __call__(self, x, positions, slots, mask, cache_k, cache_v):
    cfg = self.cfg
    dense = functools.partial(
      nn.DenseGeneral,
      use_bias=False,
      dtype=self.dtype,
      param_dtype=self.dtype,
      **matmul.dense_options(self.compute_dtype),
    )
    qkv = functools.partial(dense, use_bias=cfg.attention_bias)
    q = qkv((cfg.num_attention_heads, cfg.head_dim), name='q_proj')(x)
    k = qkv((cfg.num_key_value_heads, cfg.head_dim), name='k_proj')(x)
    v = qkv((cfg.num_key_value_heads, cfg.head_dim), name='v_proj')(x)
    if cfg.qk_norm:
      q = RMSNorm(cfg.rms_norm_eps, self.dtype, name='q_norm')(q)
      k = RMSNorm(cfg.rms_norm_eps, self.dtype, name='k_norm')(k)
    q = rope(q, positions, cfg.rope_theta, cfg.rope_scaling)
    k = rope(k, positions, cfg.rope_theta, cfg.rope_scaling)
    cache_k = kv_lib.write_slots(cache_k, slots, k)
    cache_v = kv_lib.write_slots(cache_v, slots, v)
    if self.attn_impl != 'xla':
      # The kernel reads the prefix from the cache and the tail from k/v directly; which kernel
      # (Triton, Mosaic, interpreted) is decided per platform at lowering time.
      out = kernel_dispatch.tree_attention(
        q, k, v, cache_k, cache_v, mask.prefix_len, mask.ancestors, impl=self.attn_impl
      )
    else:
      out = attention_live(q, cache_k, cache_v, mask)
    out = dense(cfg.hidden_size, axis=(-2, -1), name='o_proj')(out)
    return out, cache_k, cache_v


class MLP(nn.Module):
  """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

  hidden_size: int
  intermediate_size: int
  dtype: Any = jnp.float32
  compute_dtype: Any = None  # bfloat16: mixed-precision projections (models/matmul.py)

  @nn.compact
  def __call__(self, x):
    dense = functools.partial(
      nn.Dense,
      use_bias=False,
      dtype=self.dtype,
      param_dtype=self.dtype,
      **matmul.dense_options(self.compute_dtype),
    )
    gate = dense(self.intermediate_size, name='gate_proj')(x)
    up = dense(self.intermediate_size, name='up_proj')(x)
    return dense(self.hidden_size, name='down_proj')(nn.silu(gate) * up)


class Experts(nn.Module):
  """``E`` SwiGLU experts as stacked weights, run as grouped (ragged) matmuls."""

  cfg: Qwen3Config
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(
    self, x: Float[Array, 'T D'], expert_ids: Int[Array, 'T k'], weights: Float[Array, 'T k']
  ) -> Float[Array, 'T D']:
    cfg = self.cfg
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    w_gate = self.param('gate_proj', init, (e, d, f), self.dtype)
    w_up = self.param('up_proj', init, (e, d, f), self.dtype)
    w_down = self.param('down_proj', init, (e, f, d), self.dtype)
    num_tokens, top_k = expert_ids.shape
    # Sort the (token, choice) pairs by expert so each expert's rows are contiguous; no token is
    # dropped (every pair is computed).
    flat_ids = expert_ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    group_sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)
    rows = x[order // top_k]
    hidden = nn.silu(jax.lax.ragged_dot(rows, w_gate, group_sizes)) * jax.lax.ragged_dot(
      rows, w_up, group_sizes
    )
    out_sorted = jax.lax.ragged_dot(hidden, w_down, group_sizes)
    out = jnp.zeros_like(out_sorted).at[order].set(out_sorted).reshape(num_tokens, top_k, d)
    return jnp.einsum('TkD,Tk->TD', out, weights.astype(out.dtype))


class SparseMoE(nn.Module):
  """Qwen3-MoE block: softmax router (float32), top-k, optional renormalisation, experts."""

  cfg: Qwen3Config
  dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x: Float[Array, 'B T D']) -> Float[Array, 'B T D']:
    cfg = self.cfg
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    router_logits = nn.Dense(
      cfg.num_experts, use_bias=False, dtype=self.dtype, param_dtype=self.dtype, name='gate'
    )(flat)
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, expert_ids = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights.astype(x.dtype)
    out = Experts(cfg, self.dtype, name='experts')(flat, expert_ids, weights)
    return out.reshape(b, t, d)


class DecoderLayer(nn.Module):
  cfg: Qwen3Config
  layer_idx: int
  dtype: Any = jnp.float32
  attn_impl: str = 'xla'
  compute_dtype: Any = None

  @nn.compact
  def __call__(self, x, positions, slots, mask, cache_k, cache_v):
    cfg = self.cfg
    attention = Attention(cfg, self.dtype, self.attn_impl, self.compute_dtype, name='self_attn')
    h, cache_k, cache_v = attention(
      RMSNorm(cfg.rms_norm_eps, self.dtype, name='input_layernorm')(x),
      positions,
      slots,
      mask,
      cache_k,
      cache_v,
    )
    x = x + h
    normed = RMSNorm(cfg.rms_norm_eps, self.dtype, name='post_attention_layernorm')(x)
    if cfg.is_sparse_layer(self.layer_idx):
      x = x + SparseMoE(cfg, self.dtype, name='mlp')(normed)
    else:
      mlp = MLP(cfg.hidden_size, cfg.intermediate_size, self.dtype, self.compute_dtype, name='mlp')
      x = x + mlp(normed)
    return x, cache_k, cache_v


class Qwen3(nn.Module):
  """The Qwen3 / Qwen3-MoE decoder. Parameter names mirror Hugging Face's (see ``hf_io``)."""

  cfg: Qwen3Config
  dtype: Any = jnp.float32
  attn_impl: str = 'xla'
  compute_dtype: Any = None  # bfloat16: mixed-precision projections (models/matmul.py)

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
    x = self.embed_tokens(tokens)
    new_k, new_v, tapped = [], [], {}
    for i, layer in enumerate(self.layers):
      x, k, v = layer(x, positions, slots, mask, cache_k[i], cache_v[i])
      new_k.append(k)
      new_v.append(v)
      if i in taps:
        tapped[i] = x
    features = jnp.concatenate([tapped[i] for i in taps], axis=-1) if taps else None
    return self.norm(x), tuple(new_k), tuple(new_v), features

  def embed(self, tokens):
    return self.embed_tokens(tokens)

  def lm_logits(self, hidden):
    if self.cfg.tie_word_embeddings:
      if self.compute_dtype is not None:
        table = self.embed_tokens.embedding
        return matmul.matmul(hidden, table.T, 1, self.compute_dtype)
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
  cfg: Qwen3Config, batch_size: int, capacity: int, dtype=jnp.float32
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


def init_params(cfg: Qwen3Config, key, dtype=jnp.float32) -> dict:
  """Random parameters (Flax default initialisers; embeddings and router ~ N(0, 0.02))."""
  model = Qwen3(cfg, dtype)
  tokens = jnp.zeros((1, 1), jnp.int32)
  cache = make_cache(cfg, 1, 1, dtype)
  mask = DenseMask(jnp.ones((1, 1, 1), bool))
  variables = model.init(key, tokens, tokens, tokens, mask, cache.k, cache.v, method=Qwen3.init_all)
  return variables['params']


def forward(
  params: dict,
  tokens: Int[Array, 'B T'],
  cache: kv_lib.KVCache,
  *,
  cfg: Qwen3Config,
  positions: Int[Array, 'B T'] | None = None,
  slots: Int[Array, 'B T'] | None = None,
  mask: 'Bool[Array, "B T S"] | TailMask | None' = None,
  taps: tuple[int, ...] = (),
  attn_impl: str = 'xla',
  compute_dtype=None,
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
  model = Qwen3(cfg, cache.dtype, attn_impl, matmul.resolve(compute_dtype))
  hidden, new_k, new_v, features = model.apply(
    {'params': params}, tokens, positions, slots, mask, cache.k, cache.v, taps
  )
  written = jnp.where(slots < cache.capacity, slots + 1, 0).max(axis=1)
  lengths = jnp.maximum(cache.lengths, written).astype(jnp.int32)
  return ForwardOutput(hidden, kv_lib.KVCache(new_k, new_v, lengths), features)


def lm_logits(
  params: dict, hidden: Float[Array, '... D'], *, cfg: Qwen3Config, compute_dtype=None
) -> Array:
  """Applies the LM head (or the tied embedding) to final-normed hidden states."""
  model = Qwen3(cfg, hidden.dtype, compute_dtype=matmul.resolve(compute_dtype))
  return model.apply({'params': params}, hidden, method=Qwen3.lm_logits)


def embed(params: dict, tokens: Int[Array, '...'], *, cfg: Qwen3Config) -> Array:
  """The target's token embedding (the draft head uses it for its block tokens)."""
  dtype = params['embed_tokens']['embedding'].dtype
  return Qwen3(cfg, dtype).apply({'params': params}, tokens, method=Qwen3.embed)


def validate_forward_args(cfg: Qwen3Config, tokens, cache: kv_lib.KVCache, taps, attn_impl):
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

  cfg: Qwen3Config = flax.struct.field(pytree_node=False)
  params: dict
  attn_impl: str = flax.struct.field(pytree_node=False, default='xla')
  # 'bfloat16': matmuls with bfloat16 inputs and float32 accumulation (models/matmul.py) over
  # float32 (or bfloat16) weights; None: plain matmuls in the parameters' dtype.
  compute_dtype: str | None = flax.struct.field(pytree_node=False, default=None)

  @property
  def dtype(self):
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
    return embed(self.params, tokens, cfg=self.cfg)

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
