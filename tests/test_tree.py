"""Tree construction: exact reference semantics of accum_logp and best_first, caps, ancestor
masks."""

import functools
import heapq
import itertools

import jax
import numpy as np
import pytest

import jetspec_jax as js
from jetspec_jax import tree as tree_lib


def heap_reference(ids, lps, budget, caps=None, anchor=0):
  """A direct transcription of docs/methods.md §1 with a binary heap and an insertion counter."""
  d_max, w = ids.shape
  caps = [w] * d_max if caps is None else list(caps)
  nodes = [(anchor, -1, 0, 0.0)]  # (token, parent, depth, score)
  counter = itertools.count()
  heap = [(-0.0, next(counter), 0)]
  while heap and len(nodes) < budget:
    _, _, v = heapq.heappop(heap)
    _, _, depth, score = nodes[v]
    if depth == d_max:
      continue
    for r in range(min(caps[depth], w, budget - len(nodes))):
      nodes.append((int(ids[depth, r]), v, depth + 1, score + float(lps[depth, r])))
      heapq.heappush(heap, (-nodes[-1][3], next(counter), len(nodes) - 1))
  return nodes


def as_lists(tree):
  n = int(tree.num_nodes)
  return list(
    zip(
      np.asarray(tree.tokens)[:n].tolist(),
      np.asarray(tree.parents)[:n].tolist(),
      np.asarray(tree.depths)[:n].tolist(),
      np.asarray(tree.scores)[:n].tolist(),
    )
  )


def assert_same(tree, ref):
  got = as_lists(tree)
  assert [g[:3] for g in got] == [r[:3] for r in ref]
  np.testing.assert_allclose([g[3] for g in got], [r[3] for r in ref], rtol=1e-6, atol=1e-6)


build = jax.jit(tree_lib.accum_logp, static_argnames='budget')


def test_docstring_example():
  """The five-node example of the module docstring."""
  ids = np.array([[1, 2], [3, 4]])
  lps = np.log(np.array([[0.6, 0.3], [0.5, 0.4]], np.float32))
  tree = build(ids, lps, budget=5, anchor=9)
  assert np.asarray(tree.tokens).tolist() == [9, 1, 2, 3, 4]
  assert np.asarray(tree.parents).tolist() == [-1, 0, 0, 1, 1]
  assert np.asarray(tree.depths).tolist() == [0, 1, 1, 2, 2]
  anc = np.asarray(tree.ancestor_mask())
  want = np.array(
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 0, 1]], bool
  )
  np.testing.assert_array_equal(anc, want)


def test_budget_one_is_the_root():
  tree = build(np.array([[5, 6]]), np.log(np.array([[0.7, 0.2]], np.float32)), budget=1, anchor=3)
  assert int(tree.num_nodes) == 1 and int(tree.tokens[0]) == 3 and int(tree.parents[0]) == -1


def test_partial_last_expansion():
  """Budget 4 with W=3: the root's 3 children fill it; budget 6: the best child gets 2 of 3."""
  ids = np.array([[10, 11, 12], [20, 21, 22]])
  lps = np.log(np.array([[0.5, 0.3, 0.1], [0.6, 0.3, 0.05]], np.float32))
  tree = build(ids, lps, budget=6)
  assert as_lists(tree)[4][:3] == (20, 1, 2) and as_lists(tree)[5][:3] == (21, 1, 2)
  assert int(tree.num_nodes) == 6


def test_ties_break_first_in_first_out():
  """Equal scores: the earlier-created node is expanded first."""
  ids = np.array([[1, 2], [3, 4], [5, 6]])
  lps = np.array([[-1.0, -1.0], [-0.5, -0.5], [-0.1, -0.1]], np.float32)
  tree = build(ids, lps, budget=5)
  # Root -> (1, 2) tie at -1.0: node 1 (token 1) is expanded first.
  assert as_lists(tree)[3][:3] == (3, 1, 2) and as_lists(tree)[4][:3] == (4, 1, 2)
  assert_same(tree, heap_reference(ids, lps, 5))


def test_max_depth_nodes_are_not_expanded():
  """With D=2 and W=1 the tree is a 3-node chain, whatever the budget."""
  ids = np.array([[7], [8]])
  lps = np.array([[-0.1], [-0.2]], np.float32)
  tree = build(ids, lps, budget=10)
  assert int(tree.num_nodes) == 3
  assert np.asarray(tree.parents)[:3].tolist() == [-1, 0, 1]
  assert np.asarray(tree.parents)[3:].tolist() == [-1] * 7  # padding


@pytest.mark.parametrize('seed', range(6))
def test_matches_heap_reference_on_random_inputs(seed):
  rng = np.random.default_rng(seed)
  d, w = rng.integers(1, 8), rng.integers(1, 8)
  budget = int(rng.choice([1, 2, 7, 16, 64, 255]))
  ids = rng.integers(0, 1000, size=(d, w))
  lps = -np.sort(rng.exponential(2.0, size=(d, w)), axis=1).astype(np.float32)
  # Quantise so that ties actually occur.
  lps = np.round(lps * 2) / 2
  assert_same(build(ids, lps, budget=budget), heap_reference(ids, lps, budget))


@pytest.mark.parametrize('seed', range(4))
def test_tree_is_best_first_prefix_closed_set(seed):
  """The tree is prefix-closed and grown best-first by cumulative score.

  Children arrive a whole expansion (W of them) at a time, so the literal top-``budget`` set is
  not the reference semantics; what holds is that the *expanded* nodes are the top-scoring
  expandable nodes: no node left unexpanded (depth < D) scores above any expanded node, and
  scores never increase along a path.
  """
  rng = np.random.default_rng(100 + seed)
  d, w, budget = 5, 4, 40
  ids = np.arange(d * w).reshape(d, w)
  lps = -np.sort(rng.exponential(1.5, size=(d, w)), axis=1).astype(np.float32)
  nodes = as_lists(build(ids, lps, budget=budget))
  assert len(nodes) == budget
  expanded = {parent for _, parent, _, _ in nodes[1:]}
  lowest_expanded = min(nodes[v][3] for v in expanded)
  for v, (_, parent, depth, score) in enumerate(nodes):
    if v:
      assert 0 <= parent < v and score <= nodes[parent][3]
    if v not in expanded and depth < d:
      assert score <= lowest_expanded + 1e-6
  # The unexpanded frontier is exactly what the next expansion would draw from.
  frontier_best = max(nodes[v][3] for v in range(budget) if v not in expanded and nodes[v][2] < d)
  assert frontier_best <= lowest_expanded + 1e-6


def test_caps_builder_and_top2gap():
  rng = np.random.default_rng(7)
  ids = rng.integers(0, 50, size=(6, 5))
  lps = -np.sort(rng.exponential(1.0, size=(6, 5)), axis=1).astype(np.float32)
  lps[1, 0], lps[1, 1] = -0.01, -6.0  # a confident depth: large top-2 gap
  caps = np.asarray(tree_lib.top2gap_caps(lps, beta=2.0, gap0=1.0))
  assert caps[1] == 1 and caps.min() >= 1 and caps.max() <= 5
  gap = lps[:, 0] - lps[:, 1]
  want = np.maximum(1, np.round(5 / (1 + np.exp(2.0 * (gap - 1.0)))))
  np.testing.assert_array_equal(caps, want)
  tree = jax.jit(tree_lib.top2gap, static_argnames=('budget', 'beta', 'gap0'))(
    ids, lps, budget=30, beta=2.0, gap0=1.0
  )
  assert_same(tree, heap_reference(ids, lps, 30, caps=caps))
  full = tree_lib.build_with_caps(ids, lps, 30, np.full((6,), 5))
  assert_same(full, heap_reference(ids, lps, 30))


def all_paths(ids, lps):
  """Every path of per-depth ranks (depth 1..D, rank < W) with its cumulative score."""
  d_max, w = ids.shape
  return {
    ranks: float(sum(lps[d, r] for d, r in enumerate(ranks)))
    for depth in range(1, d_max + 1)
    for ranks in itertools.product(range(w), repeat=depth)
  }


@pytest.mark.parametrize('seed', range(6))
def test_best_first_holds_the_most_probable_paths(seed):
  """best_first's draft nodes are the ``budget - 1`` highest-scoring paths of the full tree of
  ``W**1 + ... + W**D`` paths (continuous scores: no ties), added in score order."""
  rng = np.random.default_rng(400 + seed)
  d, w = int(rng.integers(1, 5)), int(rng.integers(1, 5))
  budget = int(rng.integers(1, 1 + sum(w**k for k in range(1, d + 1)) + 3))
  ids = rng.permutation(1000)[: d * w].reshape(d, w)  # distinct per depth
  lps = -np.sort(rng.exponential(1.5, size=(d, w)), axis=1).astype(np.float32)
  tree = jax.jit(tree_lib.best_first, static_argnames='budget')(ids, lps, budget, anchor=5)
  nodes = as_lists(tree)
  paths = all_paths(ids, lps)
  want = sorted(paths, key=lambda r: -paths[r])[: budget - 1]
  got, ranks = [], {0: ()}
  for v, (token, parent, depth, score) in enumerate(nodes[1:], start=1):
    assert 0 <= parent < v and depth == len(ranks[parent]) + 1
    ranks[v] = ranks[parent] + (int(np.flatnonzero(ids[depth - 1] == token)[0]),)
    np.testing.assert_allclose(score, paths[ranks[v]], rtol=1e-5, atol=1e-5)
    got.append(ranks[v])
  assert nodes[0] == (5, -1, 0, 0.0) and got == want
  assert int(tree.num_nodes) == min(budget, 1 + len(paths))


def test_best_first_spends_a_small_budget_on_depth():
  """A confident top-1 per depth: 8 nodes make a chain of 7, where accum_logp (all W children
  per expansion) makes the root and its 7 children."""
  ids = np.arange(7 * 7).reshape(7, 7)
  lps = np.log(np.tile([[0.9, 0.04, 0.02, 0.01, 0.01, 0.01, 0.01]], (7, 1))).astype(np.float32)
  chain = tree_lib.best_first(ids, lps, 8)
  assert np.asarray(chain.depths).tolist() == list(range(8))
  assert np.asarray(build(ids, lps, budget=8).depths).tolist() == [0] + [1] * 7
  wide = np.asarray(tree_lib.best_first(ids, lps, 16).depths)
  assert wide.max() == 7 and (wide == 1).sum() > 1  # the budget past the chain buys siblings


@pytest.mark.parametrize('kind', ['random', 'chain', 'star'])
def test_ancestor_mask_matches_parent_walk(kind):
  tree = js.testing.random_tree(3, 23, kind=kind)
  anc = np.asarray(tree.ancestor_mask())
  parents = np.asarray(tree.parents)
  for i in range(23):
    want, j = {i}, i
    while parents[j] >= 0:
      j = parents[j]
      want.add(j)
    assert set(np.flatnonzero(anc[i])) == want


def test_bad_inputs():
  with pytest.raises(ValueError, match='budget=0 must be >= 1'):
    tree_lib.accum_logp(np.zeros((2, 2), np.int32), np.zeros((2, 2), np.float32), 0)
  with pytest.raises(ValueError, match='must both be'):
    tree_lib.accum_logp(np.zeros((2, 2), np.int32), np.zeros((2, 3), np.float32), 4)


@pytest.mark.parametrize('seed', range(8))
def test_static_trip_count_matches_reference_with_any_caps(seed):
  """The fixed-length builder gives the reference's tree for random caps (zeros included)."""
  rng = np.random.default_rng(300 + seed)
  d, w = int(rng.integers(1, 8)), int(rng.integers(1, 8))
  budget = int(rng.choice([1, 3, 16, 64, 255]))
  ids = rng.integers(0, 1000, size=(d, w))
  lps = np.round(-np.sort(rng.exponential(2.0, size=(d, w)), axis=1) * 2).astype(np.float32) / 2
  caps = rng.integers(0 if seed % 2 else 1, w + 2, size=(d,))
  tree = jax.jit(tree_lib.build_with_caps, static_argnames='budget')(ids, lps, budget, caps)
  assert_same(tree, heap_reference(ids, lps, budget, caps=caps))


@pytest.mark.parametrize('builder', sorted(tree_lib.TREE_BUILDERS))
def test_tree_build_has_no_data_dependent_loop(builder):
  """No ``while`` with a data-dependent predicate: a fixed trip count (scan or unrolled)."""
  ids, lps = np.zeros((15, 7), np.int32), np.zeros((15, 7), np.float32)
  fn = functools.partial(tree_lib.TREE_BUILDERS[builder], budget=255)
  jaxpr = str(jax.make_jaxpr(fn)(ids, lps))
  assert ' while[' not in jaxpr and 'while_loop' not in jaxpr
  assert tree_lib.max_expansions(255, 7) == 37 and tree_lib.max_expansions(1, 7) == 0


def _check_tree(tree, budget, max_depth):
  """Structural invariants: parents precede children, depths follow parents, no two children of
  one parent share a token."""
  n = int(tree.num_nodes)
  assert 1 <= n <= budget
  tokens, parents, depths = (np.asarray(x)[:n] for x in (tree.tokens, tree.parents, tree.depths))
  assert parents[0] == -1 and depths[0] == 0
  pairs = set()
  for j in range(1, n):
    assert 0 <= parents[j] < j
    assert depths[j] == depths[parents[j]] + 1 <= max_depth
    assert (parents[j], tokens[j]) not in pairs, f'duplicate sibling at node {j}'
    pairs.add((parents[j], tokens[j]))


def _adversarial_candidates(rng, depth, width, vocab):
  """Per-depth candidates as a builder may meet them: repeated ids in a row, -inf and NaN
  scores, huge negative ones that overflow to -inf along a path, all-equal ties."""
  ids = rng.integers(0, vocab, (depth, width))
  lps = np.sort(rng.normal(-2.0, 2.0, (depth, width)), axis=1)[:, ::-1].astype(np.float32)
  kind = rng.integers(0, 6)
  if kind == 1:
    lps[rng.random((depth, width)) < 0.5] = -np.inf
  elif kind == 2:
    lps[rng.random((depth, width)) < 0.3] = np.nan
  elif kind == 3:
    lps[:, 1:] = -0.7 * np.finfo(np.float32).max  # two on a path overflow to -inf
  elif kind == 4:
    lps[:] = -1.0
  elif kind == 5:
    lps[:] = -np.inf
  return ids.astype(np.int32), lps


@pytest.mark.parametrize('algorithm', sorted(tree_lib.TREE_BUILDERS))
def test_builders_never_duplicate_siblings(algorithm):
  """Property: over random and adversarial candidates every builder emits distinct (parent,
  token) pairs and a well-formed tree."""
  rng = np.random.default_rng(0)
  fn = jax.jit(tree_lib.TREE_BUILDERS[algorithm], static_argnames='budget')
  for depth, width, vocab, budget in [(3, 3, 2, 64), (4, 4, 3, 16), (5, 2, 50, 12), (2, 5, 4, 40)]:
    for _ in range(12):
      ids, lps = _adversarial_candidates(rng, depth, width, vocab)
      _check_tree(fn(ids, lps, budget=budget), budget, depth)


def test_all_neg_inf_frontier_pops_a_frontier_node():
  """Only two draft ids, width 3: the third candidate scores a masked value, two of them on a
  path overflow to -inf. accum_logp must not expand the root a second time."""
  ids = np.array([[1, 3, 0]] * 3, np.int32)
  masked = -0.7 * np.finfo(np.float32).max
  lps = np.array([[-0.5, -1.0, masked]] * 3, np.float32)
  tree = build(ids, lps, budget=64, anchor=7)
  _check_tree(tree, 64, 3)
  root_children = np.asarray(tree.parents)[: int(tree.num_nodes)] == 0
  assert root_children.sum() == 3


def test_accept_checks_distinct_siblings():
  """Under verify.checks a tree with two equal siblings is refused; a good one passes."""
  from jetspec_jax import verify

  good = build(np.array([[1, 2]]), np.log(np.array([[0.6, 0.3]], np.float32)), budget=3)
  bad = good.replace(tokens=good.tokens.at[2].set(1))
  batch = lambda t: jax.tree.map(lambda x: x[None], t)
  anc = tree_lib.ancestor_mask(good.parents, 1)[None]
  choices = np.zeros((1, 3), np.int32)
  with verify.checks():
    verify.accept(batch(good), anc, choices, max_depth=1)
    with pytest.raises(Exception, match='two children of one parent'):
      jax.block_until_ready(verify.accept(batch(bad), anc, choices, max_depth=1))
  assert bool(verify.distinct_siblings(batch(good))[0]) and not bool(
    verify.distinct_siblings(batch(bad))[0]
  )
