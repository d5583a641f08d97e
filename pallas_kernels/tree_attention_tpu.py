"""Tree attention on TPU (Mosaic): the semantics and signature of
:func:`pallas_kernels.tree_attention.tree_attention`, laid out for TPU tiling.

What differs from the Triton kernel, and why:

* **The cache is streamed, never loaded whole.** The grid is ``(sequence, row block, prefix
  tile)``; the prefix-tile axis is a sequential reduction (``'arbitrary'``) whose BlockSpec brings
  one ``[block_k, K * H]`` tile of the cache from HBM per step (Pallas double-buffers it). The
  committed length is a scalar-prefetch operand, so the tile index map clamps to the last live
  tile: steps past the prefix name the tile already in VMEM (no copy) and skip their compute, so
  only the ``ceil(prefix_len / block_k)`` live tiles are read. An online softmax (float32, in VMEM
  scratch) runs over them; the tree (or causal) tail is folded in at the last step.
* **TPU tiling without a layout change.** The cache keeps the library's ``[B, S, K, H]`` layout;
  the kernel views it as ``[B, S, K * H]`` (a free reshape), so a tile's minor dimension is the
  whole ``K * H`` row and its second-minor ``block_k`` is a multiple of 8: legal for any head
  count and head dim. Every K/V head is handled inside the program, each K/V tile read once for
  all heads; the ``G`` query heads that share a K/V head are packed into the rows
  (``block_q * G'`` rows, ``G'`` = ``G`` rounded up to a power of two, so a multiple of 8 for
  every head layout), as in the Triton kernel.
* **Tail masks** come from the same bit-packed ancestor rows (tree mode, whole tail in one tile:
  trees are at most a few hundred nodes) or from positions (causal mode, tail tiles up to the row
  block's last node, for chunked prefill).

On CPU the kernel runs in TPU interpret mode (``interpret=pltpu.InterpretParams()``), which
checks TPU semantics (scalar prefetch, VMEM scratch, the grid's order) without a TPU;
``jax.export(..., platforms=['tpu'])`` lowers it to a Mosaic custom call anywhere.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import tree_attention as gpu_kernel

MASK_VALUE = gpu_kernel.MASK_VALUE
SUBLANES = 8  # a TPU vreg is [8 sublanes, 128 lanes]


def _div(a, b):
  """``a // b`` for non-negative integers (truncating division: no sign fix-up to lower)."""
  return jax.lax.div(a, jnp.asarray(b, jnp.int32))


def _cdiv(a, b):
  return _div(a + (b - 1), b)


def choose_block_q(num_new: int, groups: int) -> int:
  """Tree nodes per row block: rows (``block_q * groups``) a multiple of 8, up to 128."""
  least = gpu_kernel._pow2_at_least(-(-SUBLANES // groups))
  most = max(least, 128 // groups)
  return min(max(least, gpu_kernel._pow2_at_least(num_new)), most)


def choose_block_k(capacity: int, block_k: int = 128) -> int:
  """Cache slots per prefix tile: a multiple of 8 dividing the capacity, else the whole cache."""
  tile = math.gcd(block_k, capacity)
  return tile if tile % SUBLANES == 0 else capacity


def _kernel(
  len_ref,
  q_ref,
  kc_ref,
  vc_ref,
  kt_ref,
  vt_ref,
  *rest,
  scale,
  num_kv_heads,
  head_dim,
  groups,
  block_q,
  block_k,
  padded,
  tree,
):
  """One (sequence, row block) at prefix tile ``program_id(2)``; all K/V heads inside."""
  if tree:
    bits_ref, o_ref, m_ref, l_ref, acc_ref = rest
  else:
    o_ref, m_ref, l_ref, acc_ref = rest
  seq, row_block, tile = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows = block_q * groups
  prefix_len = len_ref[seq]

  @pl.when(tile == 0)
  def _init():
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

  def update(j, k, v, mask):
    q = q_ref[j].astype(jnp.float32) * scale  # [rows, H]
    s = jax.lax.dot_general(
      q, k.astype(jnp.float32), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    s = jnp.where(mask, s, MASK_VALUE)
    m_prev = m_ref[j]  # [rows, 1]
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    alpha = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)
    l_ref[j] = l_ref[j] * alpha + jnp.sum(p, axis=1, keepdims=True)
    acc_ref[j] = acc_ref[j] * alpha + jnp.dot(
      p, v.astype(jnp.float32), preferred_element_type=jnp.float32
    )
    m_ref[j] = m_new

  start = tile * block_k

  @pl.when(start < prefix_len)
  def _prefix():
    mask = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1) < prefix_len
    # Zero the values of slots past the prefix: 0 * NaN garbage would still poison acc.
    live = start + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0) < prefix_len
    for j in range(num_kv_heads):
      cols = slice(j * head_dim, (j + 1) * head_dim)
      v = vc_ref[:, cols]
      update(j, kc_ref[:, cols], jnp.where(live, v, jnp.zeros_like(v)), mask)

  @pl.when(tile == pl.num_programs(2) - 1)
  def _tail_and_write():
    # Tail node of each row (rows are node-major: row = node * groups + head).
    node = row_block * block_q + _div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), groups)
    if tree:
      keys = jax.lax.broadcasted_iota(jnp.int32, (1, padded), 1)
      shift = keys & 31
      mask = jnp.zeros((rows, padded), jnp.bool_)
      for w in range(padded // 32):
        word = bits_ref[:, w : w + 1]  # [rows, 1] int32
        bit = jax.lax.shift_right_logical(word, shift) & 1
        mask = mask | ((jax.lax.shift_right_logical(keys, 5) == w) & (bit == 1))
      for j in range(num_kv_heads):
        update(j, kt_ref[j], vt_ref[j], mask)
    else:
      block_tail = min(128, padded)

      def tail_step(i, carry):
        first = pl.multiple_of(i * block_tail, block_tail)
        keys = first + jax.lax.broadcasted_iota(jnp.int32, (1, block_tail), 1)
        for j in range(num_kv_heads):
          k = kt_ref[j, pl.ds(first, block_tail), :]
          v = vt_ref[j, pl.ds(first, block_tail), :]
          update(j, k, v, keys <= node)
        return carry

      last_node = (row_block + 1) * block_q  # exclusive; no row attends to a later tail key
      jax.lax.fori_loop(0, _cdiv(last_node, block_tail), tail_step, 0)
    for j in range(num_kv_heads):
      o_ref[j] = (acc_ref[j] / l_ref[j]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=('scale', 'block_k', 'interpret'))
def tree_attention(
  q: Float[Array, 'B T N H'],
  k_tail: Float[Array, 'B T K H'],
  v_tail: Float[Array, 'B T K H'],
  k_cache: Float[Array, 'B S K H'],
  v_cache: Float[Array, 'B S K H'],
  prefix_len: Int[Array, ' B'],
  ancestors: Bool[Array, 'B T T'] | None = None,
  *,
  scale: float | None = None,
  block_k: int = 128,
  interpret=False,
) -> Float[Array, 'B T N H']:
  """Attention of ``T`` new rows over a cached prefix plus their own (tree or causal) tail.

  Arguments and result as :func:`pallas_kernels.tree_attention.tree_attention`; ``block_k`` is
  the prefix tile (cache slots); ``interpret``: ``False`` on a TPU, ``pltpu.InterpretParams()``
  (TPU interpret mode) or ``True`` elsewhere.
  """
  gpu_kernel.check_shapes(q, k_tail, v_tail, k_cache, v_cache, prefix_len, ancestors)
  b, t, n, h = q.shape
  _, s, kh, _ = k_cache.shape
  groups = gpu_kernel.packed_groups(n // kh)  # rows per node, padding heads included
  block_q = choose_block_q(t, groups)
  num_row_blocks = -(-t // block_q)
  row_pad = num_row_blocks * block_q
  rows = block_q * groups
  padded = max(gpu_kernel._pow2_at_least(max(t, row_pad)), 128 if ancestors is None else 32)
  bk = choose_block_k(s, block_k)
  scale = h**-0.5 if scale is None else scale

  q_rows = gpu_kernel.pack_query_rows(q, row_pad, kh)  # [B, K, row_pad * G, H]; tails head-major
  tail_pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
  k_tail = jnp.pad(k_tail, tail_pad).transpose(0, 2, 1, 3)  # [B, K, padded, H]
  v_tail = jnp.pad(v_tail, tail_pad).transpose(0, 2, 1, 3)
  k_flat = k_cache.reshape(b, s, kh * h)  # free: the cache is never copied or transposed
  v_flat = v_cache.reshape(b, s, kh * h)
  # A finished sequence of a batch may keep growing past the capacity: never read beyond it.
  lengths = jnp.minimum(prefix_len, s).astype(jnp.int32)

  def cache_tile(i, r, tile, lens):
    last_live = jnp.maximum(_cdiv(lens[i], bk) - 1, 0)
    return (i, jnp.minimum(tile, last_live), 0)

  in_specs = [
    pl.BlockSpec((None, kh, rows, h), lambda i, r, tile, lens: (i, 0, r, 0)),
    pl.BlockSpec((None, bk, kh * h), cache_tile),
    pl.BlockSpec((None, bk, kh * h), cache_tile),
    pl.BlockSpec((None, kh, padded, h), lambda i, r, tile, lens: (i, 0, 0, 0)),
    pl.BlockSpec((None, kh, padded, h), lambda i, r, tile, lens: (i, 0, 0, 0)),
  ]
  args = [lengths, q_rows, k_flat, v_flat, k_tail, v_tail]
  tree = ancestors is not None
  if tree:
    bits = gpu_kernel.pack_ancestors(ancestors, padded)
    bits = jax.lax.bitcast_convert_type(bits[:, :row_pad], jnp.int32)
    bits = jnp.repeat(bits, groups, axis=1)  # [B, row_pad * G, words]: one row per query row
    in_specs.append(pl.BlockSpec((None, rows, padded // 32), lambda i, r, tile, lens: (i, r, 0)))
    args.append(bits)
  kernel = functools.partial(
    _kernel,
    scale=scale,
    num_kv_heads=kh,
    head_dim=h,
    groups=groups,
    block_q=block_q,
    block_k=bk,
    padded=padded,
    tree=tree,
  )
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    grid=(b, num_row_blocks, s // bk),
    in_specs=in_specs,
    out_specs=pl.BlockSpec((None, kh, rows, h), lambda i, r, tile, lens: (i, 0, r, 0)),
    scratch_shapes=[
      pltpu.VMEM((kh, rows, 1), jnp.float32),  # running max
      pltpu.VMEM((kh, rows, 1), jnp.float32),  # running denominator
      pltpu.VMEM((kh, rows, h), jnp.float32),  # running output
    ],
  )
  out = pl.pallas_call(
    kernel,
    grid_spec=grid_spec,
    out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
    compiler_params=pltpu.CompilerParams(dimension_semantics=('parallel', 'parallel', 'arbitrary')),
    interpret=interpret,
    name='tree_attention_tpu',
  )(*args)
  return gpu_kernel.unpack_query_rows(out, t, n // kh)
