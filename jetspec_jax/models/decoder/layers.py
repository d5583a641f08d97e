"""The decoder's layers: RMS norm, RoPE, attention (the live-tile online softmax and the Pallas
kernels), the dense MLP, the sparse MoE block and the decoder layer."""

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import kv_cache as kv_lib
from jetspec_jax.models import matmul
from jetspec_jax.models.decoder.config import DecoderConfig, RopeScaling
from jetspec_jax.typing import Array, Bool, Float, Int
from pallas_kernels import dispatch as kernel_dispatch
from pallas_kernels import tree_attention as tree_attention_kernel

ATTN_IMPLS = ('xla',) + kernel_dispatch.IMPLS  # 'pallas': the platform's kernel
MASK_VALUE = tree_attention_kernel.MASK_VALUE


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

  cfg: DecoderConfig
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

  cfg: DecoderConfig
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

  cfg: DecoderConfig
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
  cfg: DecoderConfig
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
