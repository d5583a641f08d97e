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
* **The tail is streamed too.** After the prefix tiles the same grid axis visits the tail: the
  whole tree in one tile (tree mode: at most a few hundred nodes, masked by the same bit-packed
  ancestor rows), or ``[K, block_tail, H]`` tiles up to the row block's last node (causal mode,
  chunked prefill), so a 2048-token prefill chunk never holds its whole tail in VMEM.
* **VMEM is budgeted.** :func:`vmem_bytes` adds up what one program holds (double-buffered blocks,
  scratch, the score tiles) from the block sizes; that figure, with headroom, is the kernel's
  ``vmem_limit_bytes`` (a Qwen3-8B bf16 prefill chunk of 2048 tokens: ~5 MiB).

On CPU the kernel runs in TPU interpret mode (``interpret=pltpu.InterpretParams()``), which
checks TPU semantics (scalar prefetch, VMEM scratch, the grid's order) without a TPU;
``jax.export(..., platforms=['tpu'])`` lowers it to a Mosaic custom call anywhere.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Bool, Float, Int

from pallas_kernels import tree_attention as gpu_kernel

MASK_VALUE = gpu_kernel.MASK_VALUE
SUBLANES = 8  # a TPU vreg is [8 sublanes, 128 lanes]
CAUSAL_TAIL_TILE = 128  # tail keys per step in causal mode (chunked prefill)
VMEM_HEADROOM = 4 << 20  # on top of vmem_bytes: Mosaic's internal scratch and spills


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


def vmem_bytes(
  *,
  num_kv_heads: int,
  head_dim: int,
  rows: int,
  block_k: int,
  block_tail: int,
  padded: int,
  tree: bool,
  itemsize: int,
) -> int:
  """What one program holds in VMEM: its double-buffered blocks (queries, a K and a V cache tile,
  a K and a V tail tile, ancestor words, the output), its float32 scratch (running max and sum
  pad to 128 lanes) and its score-sized temporaries (scores, probabilities, mask)."""
  lanes = lambda n: -(-n // 128) * 128  # noqa: E731 - a row's minor dimension pads to 128 lanes
  kh, h = num_kv_heads, lanes(head_dim)
  blocks = (
    kh * rows * h * itemsize  # queries
    + 2 * block_k * lanes(num_kv_heads * head_dim) * itemsize  # K and V cache tiles
    + 2 * kh * block_tail * h * itemsize  # K and V tail tiles
    + (rows * lanes(padded // 32) * 4 if tree else 0)  # ancestor words
    + kh * rows * h * itemsize  # output
  )
  scratch = kh * rows * (128 + 128 + h) * 4
  scores = 3 * rows * lanes(max(block_k, block_tail)) * 4
  return 2 * blocks + scratch + scores


class Layout(NamedTuple):
  """How a call is tiled (all static): row blocks of ``block_q`` nodes x ``groups`` packed
  heads, prefix tiles of ``block_k`` slots, tail tiles of ``block_tail`` keys of ``padded``."""

  groups: int
  block_q: int
  rows: int
  num_row_blocks: int
  row_pad: int
  padded: int
  block_k: int
  block_tail: int
  vmem_bytes: int


def layout(
  t: int,
  num_heads: int,
  num_kv_heads: int,
  head_dim: int,
  capacity: int,
  *,
  tree: bool,
  block_k: int = 128,
  itemsize: int = 2,
) -> Layout:
  """The tiling of ``T`` new rows over a ``capacity``-slot cache, and its VMEM footprint."""
  groups = gpu_kernel.packed_groups(num_heads // num_kv_heads)  # padding heads included
  block_q = choose_block_q(t, groups)
  num_row_blocks = -(-t // block_q)
  row_pad = num_row_blocks * block_q
  padded = max(gpu_kernel._pow2_at_least(max(t, row_pad)), 32 if tree else CAUSAL_TAIL_TILE)
  block_tail = padded if tree else CAUSAL_TAIL_TILE
  bk = choose_block_k(capacity, block_k)
  rows = block_q * groups
  vmem = vmem_bytes(
    num_kv_heads=num_kv_heads,
    head_dim=head_dim,
    rows=rows,
    block_k=bk,
    block_tail=block_tail,
    padded=padded,
    tree=tree,
    itemsize=itemsize,
  )
  return Layout(groups, block_q, rows, num_row_blocks, row_pad, padded, bk, block_tail, vmem)


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
  block_tail,
  num_prefix_tiles,
  padded,
  tree,
):
  """One (sequence, row block) at step ``program_id(2)``: prefix tiles first, then tail tiles;
  all K/V heads inside."""
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

  @pl.when((tile < num_prefix_tiles) & (start < prefix_len))
  def _prefix():
    mask = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1) < prefix_len
    # Zero the values of slots past the prefix: 0 * NaN garbage would still poison acc.
    live = start + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0) < prefix_len
    for j in range(num_kv_heads):
      cols = slice(j * head_dim, (j + 1) * head_dim)
      v = vc_ref[:, cols]
      update(j, kc_ref[:, cols], jnp.where(live, v, jnp.zeros_like(v)), mask)

  # Tail node of each row (rows are node-major: row = node * groups + head).
  node = row_block * block_q + _div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), groups)
  first = (tile - num_prefix_tiles) * block_tail  # the tail tile's first key
  if tree:  # the whole tree is one tail tile

    @pl.when(tile == num_prefix_tiles)
    def _tree_tail():
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
    last_node = (row_block + 1) * block_q  # exclusive; no row attends to a later tail key

    @pl.when((tile >= num_prefix_tiles) & (first < last_node))
    def _causal_tail():
      keys = first + jax.lax.broadcasted_iota(jnp.int32, (1, block_tail), 1)
      for j in range(num_kv_heads):
        update(j, kt_ref[j], vt_ref[j], keys <= node)

  @pl.when(tile == pl.num_programs(2) - 1)
  def _write():
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
  tree = ancestors is not None
  lay = layout(t, n, kh, h, s, tree=tree, block_k=block_k, itemsize=q.dtype.itemsize)
  groups, block_q, rows, bk, block_tail = (
    lay.groups,
    lay.block_q,
    lay.rows,
    lay.block_k,
    lay.block_tail,
  )
  num_row_blocks, row_pad, padded = lay.num_row_blocks, lay.row_pad, lay.padded
  num_prefix_tiles = s // bk
  scale = h**-0.5 if scale is None else scale

  q_rows = gpu_kernel.pack_query_rows(q, row_pad, kh)  # [B, K, row_pad * G, H]; tails head-major
  tail_pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
  k_tail = jnp.pad(k_tail, tail_pad).transpose(0, 2, 1, 3)  # [B, K, padded, H]
  v_tail = jnp.pad(v_tail, tail_pad).transpose(0, 2, 1, 3)
  k_flat = k_cache.reshape(b, s, kh * h)  # free: the cache is never copied or transposed
  v_flat = v_cache.reshape(b, s, kh * h)
  # A finished sequence of a batch may keep growing past the capacity: never read beyond it.
  lengths = jnp.minimum(prefix_len, s).astype(jnp.int32)

  # Steps outside a block's live range name the tile already in VMEM (no copy, no compute).
  def cache_tile(i, r, tile, lens):
    last_live = jnp.maximum(_cdiv(lens[i], bk) - 1, 0)
    return (i, jnp.minimum(tile, last_live), 0)

  def tail_tile(i, r, tile, lens):
    last_needed = _cdiv((r + 1) * block_q, block_tail) - 1
    return (i, 0, jnp.clip(tile - num_prefix_tiles, 0, last_needed), 0)

  in_specs = [
    pl.BlockSpec((None, kh, rows, h), lambda i, r, tile, lens: (i, 0, r, 0)),
    pl.BlockSpec((None, bk, kh * h), cache_tile),
    pl.BlockSpec((None, bk, kh * h), cache_tile),
    pl.BlockSpec((None, kh, block_tail, h), tail_tile),
    pl.BlockSpec((None, kh, block_tail, h), tail_tile),
  ]
  args = [lengths, q_rows, k_flat, v_flat, k_tail, v_tail]
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
    block_tail=block_tail,
    num_prefix_tiles=num_prefix_tiles,
    padded=padded,
    tree=tree,
  )
  grid_spec = pltpu.PrefetchScalarGridSpec(
    num_scalar_prefetch=1,
    grid=(b, num_row_blocks, num_prefix_tiles + padded // block_tail),
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
    compiler_params=pltpu.CompilerParams(
      dimension_semantics=('parallel', 'parallel', 'arbitrary'),
      vmem_limit_bytes=lay.vmem_bytes + VMEM_HEADROOM,
    ),
    interpret=interpret,
    name='tree_attention_tpu',
  )(*args)
  return gpu_kernel.unpack_query_rows(out, t, n // kh)
