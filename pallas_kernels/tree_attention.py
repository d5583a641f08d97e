"""Tree attention for one-pass verification: cached prefix + tree tail, GQA, online softmax.

Query row ``t`` (a tree node, or a prefill / decode token) of sequence ``b`` attends to

* every cached key at slot ``< prefix_len[b]`` (the committed prefix), and
* in the *tail* (the ``T`` new tokens' own keys), to key ``j`` iff ``j`` is ``t`` or one of its
  ancestors (tree mode: bit-packed ancestor rows), or iff ``j <= t`` (causal mode: chunked
  prefill; decode is ``T = 1``).

Five-node tree example (parents ``[-1, 0, 0, 1, 1]``), prefix length 3, ``x`` = attended::

          prefix   |  tail 0 1 2 3 4
  node 0  x x x    |       x . . . .
  node 1  x x x    |       x x . . .
  node 2  x x x    |       x . x . .
  node 3  x x x    |       x x . x .
  node 4  x x x    |       x x . . x

Bit-packed rows: bit ``j % 32`` of word ``j // 32`` of row ``t`` is ``anc[t, j]``; node 3's row is
the word ``0b01011``.

Kernel layout (one program per (sequence, kv head, block of ``block_q`` tail rows)): the ``G``
query heads that share a K/V head are packed into the rows (``block_q * G'`` rows), so each K/V
tile is read once for all of them. ``G'`` is ``G`` rounded up to a power of two (3 query heads
per K/V head, as SmolLM2-135M has, pack as 4 with one zero head), so a row block is a power of two
(Triton) and a multiple of 8 (Mosaic) for every head layout. A flash-style online softmax in
float32 runs over prefix tiles (only the ``ceil(prefix_len / block_k)`` tiles that hold valid
keys are visited; the last one is masked), then over tail tiles up to the block's last row (nodes
are topologically ordered, so no row attends to a later tail key).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from jaxtyping import Array, Bool, Float, Int

MASK_VALUE = -0.7 * float(
  np.finfo(np.float32).max
)  # the one masked-score value (library and kernels)


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes. ``block_tail`` must be a multiple of 32 (one ancestor word per 32 keys).

  ``block_q`` is in tree nodes (a row block holds ``block_q * G`` query rows); see
  :func:`choose_block_sizes` for the defaults, which depend on ``T``, ``G`` and the head dim.
  """

  block_q: int = 16
  block_k: int = 64
  block_tail: int = 32

  def __post_init__(self):
    for name in ('block_q', 'block_k', 'block_tail'):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f'{name}={value} must be a positive power of two')
    if self.block_tail % 32:
      raise ValueError(f'block_tail={self.block_tail} must be a multiple of 32')


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


MIN_ROWS = 16  # the smallest matmul tile Triton takes


def choose_block_sizes(num_new: int, groups: int, head_dim: int) -> BlockSizes:
  """Tiles from the shapes: no row block of pure padding, K/V tiles sized by the head dim.

  A row block holds ``block_q`` nodes x ``groups`` heads; ``block_q`` is the smallest power of
  two giving ``MIN_ROWS`` rows, grown with ``T`` up to 64 rows (so a 1-token decode runs one row
  block, not two, and long verifies use fuller tiles). K/V tiles hold ``128`` slots for head
  dims up to 64 and ``64`` above (the same bytes per tile).
  """
  least = _pow2_at_least(max(1, -(-MIN_ROWS // groups)))
  most = max(least, 64 // groups)
  block_q = min(max(least, _pow2_at_least(num_new)), _pow2_at_least(most))
  return BlockSizes(block_q=block_q, block_k=128 if head_dim <= 64 else 64, block_tail=32)


def pack_ancestors(anc: jax.Array, padded: int) -> jax.Array:
  """Bit-packs ``bool[B, T, T]`` rows into ``uint32[B, padded, padded // 32]``."""
  b, t, _ = anc.shape
  anc = jnp.pad(anc, ((0, 0), (0, padded - t), (0, padded - t)))
  words = anc.reshape(b, padded, padded // 32, 32).astype(jnp.uint32)
  return jnp.sum(words << jnp.arange(32, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


def _kernel(
  len_ref,
  q_ref,
  kc_ref,
  vc_ref,
  kt_ref,
  vt_ref,
  *rest,
  scale,
  groups,
  block_q,
  block_k,
  block_tail,
  tree,
):
  """One (sequence, kv head, row block): rows = block_q nodes x groups heads."""
  if tree:
    bits_ref, o_ref = rest
  else:
    (o_ref,) = rest
  rows = block_q * groups
  row_block = pl.program_id(2)
  q = q_ref[...].astype(jnp.float32) * scale  # [rows, H]
  prefix_len = len_ref[()]
  m = jnp.full((rows,), MASK_VALUE, jnp.float32)
  denom = jnp.zeros((rows,), jnp.float32)
  acc = jnp.zeros(q.shape, jnp.float32)

  def update(carry, k, v, mask):
    m, denom, acc = carry
    s = jnp.dot(q, k.astype(jnp.float32).T, preferred_element_type=jnp.float32)
    s = jnp.where(mask, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new[:, None])
    denom = denom * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + jnp.dot(
      p, v.astype(jnp.float32), preferred_element_type=jnp.float32
    )
    return m_new, denom, acc

  def prefix_step(i, carry):
    start = i * block_k
    keys = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    k = kc_ref[pl.ds(start, block_k), :]
    v = vc_ref[pl.ds(start, block_k), :]
    # Zero the values of slots past the prefix too: 0 * NaN garbage would still poison acc.
    valid_rows = start + jax.lax.broadcasted_iota(jnp.int32, (block_k, 1), 0) < prefix_len
    v = jnp.where(valid_rows, v, jnp.zeros_like(v))
    return update(carry, k, v, keys < prefix_len)

  carry = jax.lax.fori_loop(0, pl.cdiv(prefix_len, block_k), prefix_step, (m, denom, acc))

  # Tail node of each row (rows are node-major: row = node * groups + head).
  node = row_block * block_q + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // groups

  def tail_step(i, carry):
    start = i * block_tail
    keys = start + jax.lax.broadcasted_iota(jnp.int32, (1, block_tail), 1)
    k = kt_ref[pl.ds(start, block_tail), :]
    v = vt_ref[pl.ds(start, block_tail), :]
    if tree:
      mask = jnp.zeros((rows, block_tail), jnp.bool_)
      shift = (keys % 32).astype(jnp.uint32)
      for w in range(block_tail // 32):
        word = bits_ref[:, pl.ds(start // 32 + w, 1)]  # [rows, 1]
        in_word = (keys // 32) == (start // 32 + w)
        mask = mask | (in_word & (((word >> shift) & 1) == 1))
    else:
      mask = keys <= node
    return update(carry, k, v, mask)

  last_node = (row_block + 1) * block_q  # exclusive; ancestors precede their nodes
  _, denom, acc = jax.lax.fori_loop(0, pl.cdiv(last_node, block_tail), tail_step, carry)
  o_ref[...] = (acc / denom[:, None]).astype(o_ref.dtype)


def packed_groups(groups: int) -> int:
  """Query heads per K/V head as packed into rows: ``G`` rounded up to a power of two."""
  return _pow2_at_least(groups)


def pack_query_rows(q: Float[Array, 'B T N H'], row_pad: int, num_kv_heads: int) -> Array:
  """``[B, K, row_pad * G', H]``: each K/V head's ``G`` query heads packed into rows, node-major
  (row = node * G' + head), heads zero-padded to ``G' = packed_groups(G)`` and nodes to
  ``row_pad``."""
  b, t, n, h = q.shape
  groups = n // num_kv_heads
  group_pad = packed_groups(groups)
  q = jnp.pad(q, ((0, 0), (0, row_pad - t), (0, 0), (0, 0)))
  q = q.reshape(b, row_pad, num_kv_heads, groups, h).transpose(0, 2, 1, 3, 4)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, 0), (0, group_pad - groups), (0, 0)))
  return q.reshape(b, num_kv_heads, row_pad * group_pad, h)


def unpack_query_rows(rows: Array, num_new: int, groups: int) -> Array:
  """The inverse of :func:`pack_query_rows`, padding nodes and heads dropped: ``[B, T, N, H]``."""
  b, kh, num_rows, h = rows.shape
  group_pad = packed_groups(groups)
  row_pad = num_rows // group_pad
  out = rows.reshape(b, kh, row_pad, group_pad, h)[:, :, :, :groups].transpose(0, 2, 1, 3, 4)
  return out.reshape(b, row_pad, kh * groups, h)[:, :num_new]


def check_shapes(q, k_tail, v_tail, k_cache, v_cache, prefix_len, ancestors) -> None:
  """Raises a ValueError naming the first argument whose shape does not fit the others."""
  b, t, n, h = q.shape
  _, s, kh, _ = k_cache.shape
  if k_tail.shape != (b, t, kh, h) or v_tail.shape != k_tail.shape:
    raise ValueError(f'k_tail/v_tail must be {(b, t, kh, h)}, got {k_tail.shape}, {v_tail.shape}')
  if k_cache.shape != (b, s, kh, h) or v_cache.shape != k_cache.shape:
    raise ValueError(
      f'k_cache/v_cache must be [B, S, K, H]={(b, s, kh, h)}, got {k_cache.shape}, {v_cache.shape}'
    )
  if n % kh:
    raise ValueError(f'{n=} query heads must be a multiple of {kh=} kv heads')
  if prefix_len.shape != (b,):
    raise ValueError(f'prefix_len must be int32[{b}], got {prefix_len.shape}')
  if ancestors is not None and ancestors.shape != (b, t, t):
    raise ValueError(f'ancestors must be bool[B, T, T]={(b, t, t)}, got {ancestors.shape}')


@functools.partial(jax.jit, static_argnames=('scale', 'block_sizes', 'interpret', 'debug'))
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
  block_sizes: BlockSizes | None = None,
  interpret: bool = False,
  debug: bool = False,
) -> Float[Array, 'B T N H']:
  """Attention of ``T`` new rows over a cached prefix plus their own (tree or causal) tail.

  Args:
    q: ``[B, T, N, H]`` post-RoPE queries.
    k_tail, v_tail: ``[B, T, K, H]`` the new rows' own keys (post-RoPE) and values.
    k_cache, v_cache: ``[B, S, K, H]`` the layer's cache; slots ``< prefix_len`` are read.
    prefix_len: ``int32[B]`` committed prefix length per sequence.
    ancestors: ``bool[B, T, T]`` ancestor-or-self relation (tree mode), or None for causal.
    scale: softmax scale, default ``H ** -0.5``.
    block_sizes: tile sizes; default :func:`choose_block_sizes` (from ``T``, ``G``, ``H``).
    interpret: run in the Pallas interpreter (CPU).
    debug: print the kernel's jaxpr.

  Returns:
    ``[B, T, N, H]`` in ``q``'s dtype.
  """
  check_shapes(q, k_tail, v_tail, k_cache, v_cache, prefix_len, ancestors)
  b, t, n, h = q.shape
  _, s, kh, _ = k_cache.shape
  groups = packed_groups(n // kh)  # rows per node, padding heads included
  bs = block_sizes or choose_block_sizes(t, groups, h)
  block_q = bs.block_q
  num_row_blocks = -(-t // block_q)  # only blocks that hold a real node
  row_pad = num_row_blocks * block_q
  padded = max(_pow2_at_least(max(t, row_pad)), 32)  # tail keys, ancestor words
  block_tail = min(bs.block_tail, padded)
  # The largest power of two <= block_k dividing the capacity (capacities are powers of two in
  # generate; odd ones still work, with small tiles).
  block_k = math.gcd(bs.block_k, s)
  scale = h**-0.5 if scale is None else scale

  pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
  q_rows = pack_query_rows(q, row_pad, kh)
  k_tail, v_tail = jnp.pad(k_tail, pad), jnp.pad(v_tail, pad)
  rows = block_q * groups
  grid = (b, kh, num_row_blocks)
  in_specs = [
    pl.BlockSpec((None,), lambda i, j, r: (i,)),
    pl.BlockSpec((None, None, rows, h), lambda i, j, r: (i, j, r, 0)),
    pl.BlockSpec((None, s, None, h), lambda i, j, r: (i, 0, j, 0)),
    pl.BlockSpec((None, s, None, h), lambda i, j, r: (i, 0, j, 0)),
    pl.BlockSpec((None, padded, None, h), lambda i, j, r: (i, 0, j, 0)),
    pl.BlockSpec((None, padded, None, h), lambda i, j, r: (i, 0, j, 0)),
  ]
  # A finished sequence of a batch may keep growing past the capacity: never read beyond it.
  args = [jnp.minimum(prefix_len, s).astype(jnp.int32), q_rows, k_cache, v_cache, k_tail, v_tail]
  tree = ancestors is not None
  if tree:
    bits = jnp.repeat(pack_ancestors(ancestors, padded), groups, axis=1)  # [B, rows_all, W]
    in_specs.append(pl.BlockSpec((None, rows, padded // 32), lambda i, j, r: (i, r, 0)))
    args.append(bits)
  kernel = functools.partial(
    _kernel,
    scale=scale,
    groups=groups,
    block_q=block_q,
    block_k=block_k,
    block_tail=block_tail,
    tree=tree,
  )
  out = pl.pallas_call(
    kernel,
    grid=grid,
    in_specs=in_specs,
    out_specs=pl.BlockSpec((None, None, rows, h), lambda i, j, r: (i, j, r, 0)),
    out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
    compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
    interpret=interpret,
    debug=debug,
    name='tree_attention',
  )(*args)
  return unpack_query_rows(out, t, n // kh)


def tree_attention_reference(
  q, k_tail, v_tail, k_cache, v_cache, prefix_len, ancestors=None, *, scale=None
):
  """Dense-mask jnp oracle with the same semantics (float32 softmax)."""
  b, t, n, h = q.shape
  s, kh = k_cache.shape[1], k_cache.shape[2]
  scale = h**-0.5 if scale is None else scale
  keys = jnp.concatenate([k_cache, k_tail], axis=1).astype(jnp.float32)
  values = jnp.concatenate([v_cache, v_tail], axis=1).astype(jnp.float32)
  if ancestors is None:
    ancestors = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  prefix = jnp.arange(s)[None, None, :] < prefix_len[:, None, None]
  mask = jnp.concatenate([jnp.broadcast_to(prefix, (b, t, s)), ancestors], axis=-1)
  qg = q.astype(jnp.float32).reshape(b, t, kh, n // kh, h)
  scores = jnp.einsum('BTKGH,BSKH->BKGTS', qg, keys) * scale
  scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
  out = jnp.einsum('BKGTS,BSKH->BTKGH', jax.nn.softmax(scores, axis=-1), values)
  return out.reshape(b, t, n, h).astype(q.dtype)
