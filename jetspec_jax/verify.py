"""One-pass tree verification and lossless acceptance (docs/methods.md §2).

The target runs once over all tree nodes: node ``j`` sits at position ``P + depth[j]``, is written
to cache slot ``P + j``, and attends to every committed slot ``< P`` plus its ancestors-or-self in
the tree. Its logits and taps are then those of the linear sequence along its path (up to float
rounding: the sums run in another order, docs/design.md §5).

Acceptance walks from the root:

* greedy: follow the child whose token equals the target's argmax at the parent;
* sampled (``T > 0``): draw one target sample at every node (after temperature / top-k / top-p),
  follow the child equal to the parent's sample, and stop where none is; the sample at the last
  node is the bonus. Each committed token is an exact target sample given its prefix, so the
  output distribution is the target's (sample-and-match, docs/methods.md §2; *not*
  ``min(1, p/q)``, which is invalid for deterministic top-k drafts).
"""

import contextlib
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import kv_cache as kv_lib
from jetspec_jax import tree as tree_lib
from jetspec_jax.models import decoder
from jetspec_jax.typing import Array, Bool, Float, Int


class Verified(NamedTuple):
  logits: Float[Array, 'B M V']  # target logits per node (the target's compute dtype)
  features: Array | None  # [B, M, n_taps * D] taps per node
  cache: kv_lib.KVCache  # tree K/V written at slots P .. P+M-1


class Accepted(NamedTuple):
  path: Int[Array, 'B path']  # node indices root-first; entries past num_accepted are 0
  num_accepted: Int[Array, ' B']  # accepted draft nodes (root not counted)
  bonus: Int[Array, ' B']  # the target's token after the last accepted node


def verify_tree(
  target: decoder.Target,
  cache: kv_lib.KVCache,
  tree: tree_lib.Tree,
  anc: Bool[Array, 'B M M'],
  taps: tuple[int, ...] = (),
) -> Verified:
  """Runs the target once over a batch of trees (leading axis ``B`` on every tree field)."""
  start = cache.lengths
  m = tree.tokens.shape[-1]
  positions = start[:, None] + tree.depths
  slots = start[:, None] + jnp.arange(m, dtype=jnp.int32)[None]
  mask = decoder.TailMask(start, anc)
  out = target.forward(tree.tokens, cache, positions=positions, slots=slots, mask=mask, taps=taps)
  # The compute dtype's logits: argmax needs no float32 copy of every node's [V] row (sampling
  # casts what it uses).
  logits = target.lm_logits(out.hidden)
  return Verified(logits, out.taps, out.cache)


def process_logits(
  logits: Float[Array, '... V'], temperature: float, top_k: int = 0, top_p: float = 1.0
) -> Float[Array, '... V']:
  """Temperature, then top-k, then top-p (nucleus) filtering; filtered entries are -inf."""
  logits = logits.astype(jnp.float32) / temperature
  if top_k > 0:
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1.0:
    # One sort of the values: keep a token if the mass strictly above it in the sorted order is
    # < top_p (the top token always stays); the kept set is a prefix, so it is everything at or
    # above the smallest kept logit (ties at that value are all kept).
    sorted_logits = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    num_kept = jnp.sum((jnp.cumsum(probs, axis=-1) - probs) < top_p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_logits, jnp.maximum(num_kept, 1) - 1, axis=-1)
    logits = jnp.where(logits >= threshold, logits, -jnp.inf)
  return logits


def sample_tokens(
  logits: Float[Array, '... V'], key, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> Int[Array, '...']:
  """Greedy argmax at ``temperature == 0``, else one sample per row of processed logits."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, process_logits(logits, temperature, top_k, top_p)).astype(
    jnp.int32
  )


# Debug checks of the invariants acceptance relies on: set JETSPEC_JAX_CHECKS=1, or trace inside
# ``with verify.checks():``. Read when a round is traced, so a compiled round keeps its setting.
_CHECKS = [os.environ.get('JETSPEC_JAX_CHECKS', '') not in ('', '0')]


@contextlib.contextmanager
def checks(enabled: bool = True):
  """Traces inside the block check acceptance's invariants on device (:func:`accept`)."""
  saved, _CHECKS[0] = _CHECKS[0], enabled
  try:
    yield
  finally:
    _CHECKS[0] = saved


class InvariantError(RuntimeError):
  pass


def distinct_siblings(tree: tree_lib.Tree) -> Bool[Array, ' B']:
  """Per tree of a batch: no two real nodes share a parent and a token."""
  m = tree.tokens.shape[-1]
  valid = jnp.arange(m)[None] < tree.num_nodes[:, None]
  same = (tree.parents[:, :, None] == tree.parents[:, None, :]) & (
    tree.tokens[:, :, None] == tree.tokens[:, None, :]
  )
  pair = valid[:, :, None] & valid[:, None, :] & ~jnp.eye(m, dtype=bool)[None]
  children = (tree.parents >= 0)[:, :, None]  # the root has no siblings
  return ~jnp.any(same & pair & children, axis=(1, 2))


def _raise_unless(ok) -> None:
  ok = np.asarray(ok)
  if not ok.all():
    raise InvariantError(
      f'tree rows {np.flatnonzero(~ok).tolist()} hold two children of one parent with one token: '
      'acceptance would follow only one of them and bias sampled output'
    )


def accept(
  tree: tree_lib.Tree, anc: Bool[Array, 'B M M'], choices: Int[Array, 'B M'], max_depth: int
) -> Accepted:
  """Longest root path whose every node's token equals its parent's choice.

  ``choices`` is the target's argmax (greedy) or its sample (sampled) at every node. Siblings
  have distinct tokens (every builder and :func:`jetspec_jax.tree.add_branch` guarantee it; under
  :func:`checks` a violation raises :class:`InvariantError`), so at most one child can match.

  Args:
    tree: trees with a leading batch axis.
    anc: ``[B, M, M]`` ancestor-or-self masks.
    choices: ``[B, M]`` the target's token at every node.
    max_depth: static bound on the tree depth (path length ``max_depth + 1``).
  """
  if _CHECKS[0]:
    jax.debug.callback(_raise_unless, distinct_siblings(tree))
  m = tree.tokens.shape[-1]
  valid = jnp.arange(m)[None] < tree.num_nodes[:, None]
  parent_choice = jnp.take_along_axis(choices, jnp.maximum(tree.parents, 0), axis=1)
  match = valid & (tree.tokens == parent_choice)
  match = match.at[:, 0].set(True)
  # A node is reachable iff it and all its ancestors match.
  reachable = ~jnp.any(anc & ~match[:, None, :], axis=-1)
  best = jnp.argmax(jnp.where(reachable, tree.depths, -1), axis=-1)
  num_accepted = jnp.take_along_axis(tree.depths, best[:, None], axis=1)[:, 0]
  bonus = jnp.take_along_axis(choices, best[:, None], axis=1)[:, 0]
  on_path = jnp.take_along_axis(anc, best[:, None, None], axis=1)[:, 0]  # [B, M]
  # Place each path node at its depth; other nodes are dropped (index max_depth + 1).
  dst = jnp.where(on_path, tree.depths, max_depth + 1)
  b = tree.tokens.shape[0]
  nodes = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), dst.shape)
  path = jnp.zeros((b, max_depth + 1), jnp.int32)
  path = path.at[jnp.arange(b)[:, None], dst].set(nodes, mode='drop')
  return Accepted(path, num_accepted.astype(jnp.int32), bonus.astype(jnp.int32))


def commit(cache: kv_lib.KVCache, start: Int[Array, ' B'], accepted: Accepted) -> kv_lib.KVCache:
  """Moves the accepted path's K/V rows to ``start .. start+acc`` (docs/methods.md §2)."""
  return kv_lib.commit_path(cache, start, accepted.path, accepted.num_accepted)


def gather_path(rows: Array, path: Int[Array, 'B path']) -> Array:
  """``rows[b, path[b]]`` for per-node arrays ``[B, M, ...]`` (taps of the accepted path)."""
  return jnp.take_along_axis(rows, path.reshape(path.shape + (1,) * (rows.ndim - 2)), axis=1)
