"""Draft trees on device: best-first construction from per-depth top-W candidates
(docs/methods.md §1).

A :class:`Tree` is a set of fixed-size arrays of length ``budget`` (a static shape); entries at or
past ``num_nodes`` are padding. Node 0 is the root (the anchor, depth 0); nodes are in creation
order, so every parent precedes its children. Five-node example (``W = 2``, depth-1 candidates
``a, b``, depth-2 candidates ``c, d``)::

  index   0  1  2  3  4            (root)  0
  token   r  a  b  c  d                   / \\
  parent -1  0  0  1  1                 a 1  2 b
  depth   0  1  1  2  2                 / \\
                                     c 3  4 d

  ancestor-or-self mask (row = node, column = node it may attend to):
       0 1 2 3 4
    0  x . . . .
    1  x x . . .
    2  x . x . .
    3  x x . x .
    4  x x . . x
"""

import functools

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax.typing import Array, Bool, Float, Int


@flax.struct.dataclass
class Tree:
  """A draft tree as fixed-size arrays (padding past ``num_nodes``).

  Attributes:
    tokens: ``int32[M]`` node tokens (``tokens[0]`` is the anchor); padding 0.
    parents: ``int32[M]`` parent index, -1 for the root and for padding.
    depths: ``int32[M]`` depth (root 0); padding 0.
    scores: ``float32[M]`` cumulative draft log-probability; padding -inf.
    num_nodes: ``int32[]`` real nodes.
  """

  tokens: Int[Array, ' M']
  parents: Int[Array, ' M']
  depths: Int[Array, ' M']
  scores: Float[Array, ' M']
  num_nodes: Int[Array, '']

  @property
  def size(self) -> int:
    return self.tokens.shape[-1]

  def valid(self) -> Bool[Array, ' M']:
    return jnp.arange(self.size) < self.num_nodes

  def ancestor_mask(self, max_depth: int | None = None) -> Bool[Array, 'M M']:
    """``anc[i, j]``: node ``j`` is node ``i`` or one of its ancestors (see module docstring).

    Args:
      max_depth: an upper bound on the tree depth (defaults to ``M - 1``); the mask takes
        ``max_depth + 1`` parent-pointer steps.
    """
    return ancestor_mask(self.parents, self.size - 1 if max_depth is None else max_depth)


def ancestor_mask(parents: Int[Array, ' M'], max_depth: int) -> Bool[Array, 'M M']:
  """Ancestor-or-self mask from a parent array (root and padding: parent -1)."""
  m = parents.shape[0]
  rows = jnp.arange(m)

  def step(_, carry):
    anc, node = carry
    anc = anc.at[rows, node].set(True)
    parent = parents[node]
    return anc, jnp.where(parent >= 0, parent, node)

  anc, _ = jax.lax.fori_loop(0, max_depth + 1, step, (jnp.zeros((m, m), bool), rows))
  return anc


def max_expansions(budget: int, min_children: int) -> int:
  """Expansions that can add nodes: each adds ``>= min_children`` until the budget is full."""
  return -(-(budget - 1) // max(1, min_children))


def check_candidates(topk_ids, topk_logprobs, budget: int) -> None:
  """A tree builder's input errors: ``budget >= 1``, candidates ``[D, W]`` of equal shapes."""
  if budget < 1:
    raise ValueError(f'{budget=} must be >= 1 (the root counts)')
  if topk_ids.ndim != 2 or topk_ids.shape != topk_logprobs.shape:
    raise ValueError(
      f'topk_ids {topk_ids.shape} and topk_logprobs {topk_logprobs.shape} must both be [D, W]'
    )


def distinct_candidates(topk_ids, topk_logprobs):
  """Each depth's candidates with repeated tokens moved behind the distinct ones (rank order kept
  otherwise; a repeat scores -inf), and how many distinct tokens each depth has (``int32[D]``).

  Builders add a node's children from the front of its depth's row and never past the distinct
  count, so no parent gets two children with one token: acceptance follows at most one child
  (:func:`jetspec_jax.verify.accept` relies on it)."""
  width = topk_ids.shape[1]
  rank = jnp.arange(width)
  earlier = rank[None, :, None] > rank[None, None, :]  # [1, W(this), W(earlier)]
  repeat = jnp.any((topk_ids[:, :, None] == topk_ids[:, None, :]) & earlier, axis=-1)
  order = jnp.argsort(repeat, axis=1, stable=True)  # distinct first, in rank order
  ids = jnp.take_along_axis(topk_ids, order, axis=1)
  logprobs = jnp.take_along_axis(jnp.where(repeat, -jnp.inf, topk_logprobs), order, axis=1)
  return ids, logprobs, jnp.sum(~repeat, axis=1).astype(jnp.int32)


def root_tree(budget: int, anchor: int | Array) -> Tree:
  """A tree of ``budget`` slots holding only the root (``anchor``, depth 0, score 0)."""
  return Tree(
    tokens=jnp.zeros((budget,), jnp.int32).at[0].set(jnp.asarray(anchor, jnp.int32)),
    parents=jnp.full((budget,), -1, jnp.int32),
    depths=jnp.zeros((budget,), jnp.int32),
    scores=jnp.full((budget,), -jnp.inf, jnp.float32).at[0].set(0.0),
    num_nodes=jnp.int32(1),
  )


def build_with_caps(
  topk_ids: Int[Array, 'depth W'],
  topk_logprobs: Float[Array, 'depth W'],
  budget: int,
  caps: Int[Array, ' depth'],
  *,
  anchor: int | Array = 0,
  min_children: int = 1,
) -> Tree:
  """Best-first tree with at most ``caps[d]`` children per depth-``d`` parent (docs/methods.md §1).

  Repeatedly pops the unexpanded node with the highest cumulative score (ties: the earliest
  created, i.e. first-in-first-out) and appends its children in rank order,
  ``min(caps[depth], W, budget - num_nodes)`` of them, so the last expansion may be partial.
  Nodes at depth ``D`` are never expanded. Stops at ``budget`` nodes (the root counts) or when
  nothing is left to expand. Every parent at depth ``d`` gets the same candidates ``topk_ids[d]``
  (shared per-depth marginals).

  The loop has a static trip count (no data-dependent predicate, which an accelerator would copy
  to the host each iteration): max-depth nodes never enter the frontier (the reference pops them
  without effect, so skipping them changes nothing), hence every iteration that still has room
  adds ``>= min_children`` nodes (a lower bound on the non-zero caps) and
  :func:`max_expansions` iterations suffice; iterations past the end add nothing.

  Args:
    topk_ids: ``[D, W]`` candidate tokens; row ``d`` holds candidates for depth ``d + 1``.
    topk_logprobs: ``[D, W]`` their full-vocabulary log-probabilities, rank-sorted.
    budget: static number of node slots (root included), ``>= 1``.
    caps: ``[D]`` children per parent at each depth.
    anchor: the root token.
    min_children: a static lower bound on every non-zero ``min(caps[d], W)`` (sets the trip
      count; 1 is always safe).

  Returns:
    A :class:`Tree` of size ``budget``.
  """
  check_candidates(topk_ids, topk_logprobs, budget)
  max_depth, width = topk_ids.shape
  topk_ids, caps = jnp.asarray(topk_ids, jnp.int32), jnp.asarray(caps, jnp.int32)
  # Materialise the candidates once: without the barrier XLA may fuse their producer (the
  # full-vocabulary log-softmax + top-k) into every unrolled step that reads them.
  topk_ids, topk_logprobs, caps = jax.lax.optimization_barrier((topk_ids, topk_logprobs, caps))
  idx = jnp.arange(budget)
  tree = root_tree(budget, anchor)
  popped = jnp.zeros((budget,), bool)
  topk_ids, logprobs, distinct = distinct_candidates(
    topk_ids, jnp.asarray(topk_logprobs, jnp.float32)
  )
  caps = jnp.clip(caps, 0, distinct)

  def body(_, state):
    tree, popped = state
    # Nodes that cannot get children (max depth, or a zero cap) never enter the frontier.
    expandable = (tree.depths < max_depth) & (caps[jnp.minimum(tree.depths, max_depth - 1)] > 0)
    frontier = (idx < tree.num_nodes) & ~popped & expandable
    # argmax returns the first maximum: equal scores break ties by creation order (FIFO). A
    # frontier of -inf (or NaN) scores only must still pop a frontier node, never an expanded
    # one (index 0 would expand the root twice): scores rank first, frontier membership second.
    score = jnp.where(frontier & ~jnp.isnan(tree.scores), tree.scores, -jnp.inf)
    best = jnp.argmax(score)
    v = jnp.where(frontier[best], best, jnp.argmax(frontier))
    popped = popped.at[v].set(True)
    depth = tree.depths[v]
    row = jnp.minimum(depth, max_depth - 1)
    count = jnp.where(frontier[v], jnp.minimum(caps[row], budget - tree.num_nodes), 0)
    rank = jnp.arange(width)
    dst = jnp.where(rank < count, tree.num_nodes + rank, budget)  # out of range: dropped
    tree = tree.replace(
      tokens=tree.tokens.at[dst].set(topk_ids[row], mode='drop'),
      parents=tree.parents.at[dst].set(v.astype(jnp.int32), mode='drop'),
      depths=tree.depths.at[dst].set(depth + 1, mode='drop'),
      scores=tree.scores.at[dst].set(tree.scores[v] + logprobs[row], mode='drop'),
      num_nodes=tree.num_nodes + count,
    )
    return tree, popped

  steps = max_expansions(budget, min(min_children, width))
  tree, _ = jax.lax.fori_loop(0, steps, body, (tree, popped), unroll=steps <= 64)
  return tree


def accum_logp(
  topk_ids: Int[Array, 'depth W'],
  topk_logprobs: Float[Array, 'depth W'],
  budget: int,
  *,
  anchor: int | Array = 0,
) -> Tree:
  """The default tree (paper Algorithm 1): best-first on cumulative log-prob, all ``W`` children.

  ``budget`` counts the root: ``budget = 255`` gives the anchor plus 254 draft nodes.
  """
  width = topk_ids.shape[1]
  caps = jnp.full((topk_ids.shape[0],), width, jnp.int32)
  return build_with_caps(topk_ids, topk_logprobs, budget, caps, anchor=anchor, min_children=width)


def best_first(
  topk_ids: Int[Array, 'depth W'],
  topk_logprobs: Float[Array, 'depth W'],
  budget: int,
  *,
  anchor: int | Array = 0,
) -> Tree:
  """Node by node: each step adds the one child, over all nodes, of highest cumulative log-prob.

  A node's next child is its best unused candidate (the candidates are rank-sorted), so the
  ``budget - 1`` draft nodes are the ``budget - 1`` most probable paths' last nodes: the tree of
  largest expected accepted length when the depths' draft distributions are independent (a
  child's score never exceeds its parent's, so those nodes form a tree). :func:`accum_logp` adds
  all ``W`` children per expansion instead, which at a small budget spends it on width: 8 nodes
  with ``W = 7`` are the root and its 7 children, accepting at most one draft.
  """
  check_candidates(topk_ids, topk_logprobs, budget)
  max_depth, width = topk_ids.shape
  topk_ids = jnp.asarray(topk_ids, jnp.int32)
  logprobs = jnp.asarray(topk_logprobs, jnp.float32)
  topk_ids, logprobs = jax.lax.optimization_barrier((topk_ids, logprobs))
  topk_ids, logprobs, distinct = distinct_candidates(topk_ids, logprobs)
  tree = root_tree(budget, anchor)
  children = jnp.zeros((budget,), jnp.int32)  # children added so far = next candidate's rank

  def body(_, state):
    tree, children = state
    row, rank = jnp.minimum(tree.depths, max_depth - 1), jnp.minimum(children, width - 1)
    open_ = tree.valid() & (tree.depths < max_depth) & (children < distinct[row])
    # argmax returns the first maximum: equal scores break ties by creation order. An open node
    # wins over a closed one even when every open candidate scores -inf (or NaN).
    candidate = jnp.where(open_, tree.scores + logprobs[row, rank], -jnp.inf)
    candidate = jnp.where(jnp.isnan(candidate), -jnp.inf, candidate)
    best = jnp.argmax(candidate)
    v = jnp.where(open_[best], best, jnp.argmax(open_))
    add = open_[v]
    dst = jnp.where(add, tree.num_nodes, budget)  # out of range: dropped
    tree = tree.replace(
      tokens=tree.tokens.at[dst].set(topk_ids[row[v], rank[v]], mode='drop'),
      parents=tree.parents.at[dst].set(v.astype(jnp.int32), mode='drop'),
      depths=tree.depths.at[dst].set(tree.depths[v] + 1, mode='drop'),
      scores=tree.scores.at[dst].set(candidate[v], mode='drop'),
      num_nodes=tree.num_nodes + add.astype(jnp.int32),
    )
    return tree, children.at[v].add(add.astype(jnp.int32))

  steps = budget - 1
  tree, _ = jax.lax.fori_loop(0, steps, body, (tree, children), unroll=steps <= 64)
  return tree


def top2gap_caps(
  topk_logprobs: Float[Array, 'depth W'], *, beta: float = 1.0, gap0: float = 1.0
) -> Int[Array, ' depth']:
  """Per-depth fan-out ``max(1, round(W * sigmoid(-beta * (gap - gap0))))`` (docs/methods.md §1).

  ``gap = lp[d, 0] - lp[d, 1]``: confident depths collapse to a chain, uncertain ones fan out.
  """
  width = topk_logprobs.shape[1]
  if width < 2:
    return jnp.ones((topk_logprobs.shape[0],), jnp.int32)
  gap = topk_logprobs[:, 0] - topk_logprobs[:, 1]
  caps = jnp.round(width * jax.nn.sigmoid(-beta * (gap - gap0)))
  return jnp.maximum(1, caps).astype(jnp.int32)


def top2gap(
  topk_ids: Int[Array, 'depth W'],
  topk_logprobs: Float[Array, 'depth W'],
  budget: int,
  *,
  anchor: int | Array = 0,
  beta: float = 1.0,
  gap0: float = 1.0,
) -> Tree:
  """accum_logp with :func:`top2gap_caps` fan-out caps."""
  caps = top2gap_caps(topk_logprobs, beta=beta, gap0=gap0)
  return build_with_caps(topk_ids, topk_logprobs, budget, caps, anchor=anchor)


def pad(tree: Tree, extra: int) -> Tree:
  """``tree`` with ``extra`` more padding slots (room to add nodes; leading axes kept)."""
  widths = [(0, 0)] * (tree.tokens.ndim - 1) + [(0, extra)]
  return tree.replace(
    tokens=jnp.pad(tree.tokens, widths),
    parents=jnp.pad(tree.parents, widths, constant_values=-1),
    depths=jnp.pad(tree.depths, widths),
    scores=jnp.pad(tree.scores, widths, constant_values=-jnp.inf),
  )


def add_branch(
  tree: Tree, tokens: Int[Array, ' L'], count: Int[Array, '']
) -> tuple[Tree, Bool[Array, ' M']]:
  """Joins the chain ``tokens[:count]`` (from the root down) to ``tree``.

  The chain follows the tree while a node already holds its next token (an existing path it
  agrees with), then continues as new nodes appended after ``num_nodes``: a branch from the root
  where it agrees with nothing, an extension where it agrees with a path's start. Siblings stay
  distinct (a new node's token is not among its parent's children), so acceptance is unchanged.
  New nodes carry their parent's score (they have no draft probability). With room for fewer than
  ``count`` new nodes the chain is cut. Example: tree ``r -> a -> c`` and chain ``a d e``::

    before: 0 r, 1 a (parent 0), 2 c (parent 1)
    after:  ... 3 d (parent 1), 4 e (parent 3)        "a" was followed, "d e" appended

  Returns:
    (the tree, ``bool[M]``: which nodes the chain added).
  """
  m = tree.size
  idx = jnp.arange(m)
  added = jnp.zeros((m,), bool)

  def step(d, carry):
    tree, added, node, following, alive = carry
    live = alive & (d < count)
    hit = (idx < tree.num_nodes) & (tree.parents == node) & (tree.tokens == tokens[d])
    follow = live & following & jnp.any(hit)
    new = tree.num_nodes
    append = live & ~follow & (new < m)
    dst = jnp.where(append, new, m)  # out of range: dropped
    tree = tree.replace(
      tokens=tree.tokens.at[dst].set(tokens[d], mode='drop'),
      parents=tree.parents.at[dst].set(node, mode='drop'),
      depths=tree.depths.at[dst].set(tree.depths[node] + 1, mode='drop'),
      scores=tree.scores.at[dst].set(tree.scores[node], mode='drop'),
      num_nodes=new + append.astype(jnp.int32),
    )
    added = added.at[dst].set(True, mode='drop')
    node = jnp.where(follow, jnp.argmax(hit), jnp.where(append, new, node)).astype(jnp.int32)
    # Once appended, always appended; a chain that can neither follow nor append (no room) ends.
    return tree, added, node, follow, follow | append

  init = (tree, added, jnp.int32(0), jnp.bool_(True), jnp.bool_(True))
  tree, added, *_ = jax.lax.fori_loop(0, tokens.shape[0], step, init)
  return tree, added


TREE_BUILDERS = {'accum_logp': accum_logp, 'top2gap': top2gap, 'best_first': best_first}


@functools.partial(jax.jit, static_argnames=('width', 'normalize'))
def topk_per_depth(logits: Float[Array, '... depth V'], width: int, *, normalize: bool = True):
  """Full-vocabulary log-softmax in float32 (``normalize=False``: ``logits`` are log-probs
  already, used as they are), then rank-sorted top-``width`` per depth."""
  logprobs = logits.astype(jnp.float32)
  if normalize:
    logprobs = jax.nn.log_softmax(logprobs, axis=-1)
  values, ids = jax.lax.top_k(logprobs, width)
  return ids.astype(jnp.int32), values
