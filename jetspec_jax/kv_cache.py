"""The target's KV cache: an explicit pytree passed into and returned from every forward.

Layout: one K and one V array per layer, each ``[B, S, K, H]`` at a static capacity ``S``, holding
post-RoPE keys. ``lengths[B]`` counts the committed slots of each sequence. Slot ``s`` of a
committed sequence holds the token at absolute position ``s``; a tree verify writes its ``M`` nodes
to slots ``P .. P+M-1`` and :func:`commit_path` then moves the accepted path down to ``P .. P+acc``
(docs/methods.md §2), so the committed part stays contiguous.

Writes go to explicit slots; a slot ``>= S`` is dropped (that is how padding rows are written
nowhere).
"""

import dataclasses

import flax.struct
import jax.numpy as jnp

from jetspec_jax.typing import Array, Int


@flax.struct.dataclass
class KVCache:
  """Per-layer K/V at a static capacity plus per-sequence committed lengths.

  Attributes:
    k: tuple over layers of ``[B, S, K, H]`` post-RoPE keys.
    v: tuple over layers of ``[B, S, K, H]`` values.
    lengths: ``int32[B]`` committed slots per sequence.
  """

  k: tuple[Array, ...]
  v: tuple[Array, ...]
  lengths: Int[Array, ' B']

  @property
  def batch_size(self) -> int:
    return self.k[0].shape[0]

  @property
  def capacity(self) -> int:
    return self.k[0].shape[1]

  @property
  def num_layers(self) -> int:
    return len(self.k)

  @property
  def dtype(self):
    return self.k[0].dtype


def init_cache(
  *,
  num_layers: int,
  batch_size: int,
  capacity: int,
  num_kv_heads: int,
  head_dim: int,
  dtype=jnp.float32,
) -> KVCache:
  """An empty cache (all lengths zero)."""
  if capacity <= 0 or batch_size <= 0:
    raise ValueError(f'cache needs a positive size, got {batch_size=} {capacity=}')
  shape = (batch_size, capacity, num_kv_heads, head_dim)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
  return KVCache(
    k=zeros,
    v=tuple(jnp.zeros(shape, dtype) for _ in range(num_layers)),
    lengths=jnp.zeros((batch_size,), jnp.int32),
  )


def write_slots(buf: Array, slots: Int[Array, 'B T'], rows: Array) -> Array:
  """Writes ``rows[B, T, ...]`` into ``buf[B, S, ...]`` at ``slots``; slots ``>= S`` are dropped."""
  batch = jnp.arange(buf.shape[0])[:, None]
  return buf.at[batch, slots].set(rows.astype(buf.dtype), mode='drop')


def commit_path(
  cache: KVCache,
  start: Int[Array, ' B'],
  path: Int[Array, 'B path'],
  num_accepted: Int[Array, ' B'],
) -> KVCache:
  """Moves the accepted tree path into contiguous slots and sets the new lengths.

  Tree node ``j`` of sequence ``b`` was written at slot ``start[b] + j``. For ``i <= acc``
  (``acc = num_accepted[b]``), the row of node ``path[b, i]`` moves to slot ``start[b] + i``;
  the new length is ``start[b] + acc + 1``. Entries of ``path`` past ``acc`` are ignored (their
  rows land beyond the new length).

  Args:
    cache: the cache after the verify forward wrote the tree at ``start .. start+M-1``.
    start: ``int32[B]`` first tree slot (the committed length ``P`` before the round).
    path: ``int32[B, path]`` node indices of the accepted path, root (0) first, padded with any
      valid node index.
    num_accepted: ``int32[B]`` accepted draft nodes (the root not counted).

  Returns:
    The cache with the path committed.
  """
  src = start[:, None] + path
  dst = start[:, None] + jnp.arange(path.shape[1])[None]
  batch = jnp.arange(cache.batch_size)[:, None]

  def move(buf):
    return buf.at[batch, dst].set(buf[batch, src], mode='drop')

  return dataclasses.replace(
    cache,
    k=tuple(map(move, cache.k)),
    v=tuple(map(move, cache.v)),
    lengths=(start + num_accepted + 1).astype(jnp.int32),
  )
