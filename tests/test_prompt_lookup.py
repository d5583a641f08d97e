"""Copy candidates (prompt lookup) in trees, chains and JetSpec++ trees: the suffix search against
a brute-force reference, the branch join, and the lossless invariants with the branch on (greedy
== AR with copied drafts accepted, T > 0 == the target's distribution)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax as js
from jetspec_jax import decoding, prompt_lookup, rounds
from jetspec_jax import tree as tree_lib
from jetspec_jax.training import copy_calibration
from tests.conftest import VOCAB
from tests.test_decoding import assert_chi_square, exact_distribution


def continuation_reference(history, last, max_ngram, length):
  """Longest suffix match (1..max_ngram tokens) ending before ``last``; then the most tokens
  after it (up to ``length``); then the latest."""
  for n in range(min(max_ngram, last + 1), 0, -1):
    suffix = list(history[last - n + 1 : last + 1])
    found = [
      (min(length, last - j), j)
      for j in range(n - 1, last)
      if list(history[j - n + 1 : j + 1]) == suffix
    ]
    if found:
      count, j = max(found)
      return list(history[j + 1 : j + 1 + count]), n
  return [], 0


@pytest.mark.parametrize('seed', range(4))
def test_continuation_matches_reference(seed):
  rng = np.random.default_rng(seed)
  lookup = jax.jit(
    functools.partial(prompt_lookup.continuation, max_ngram=3, length=5), static_argnums=()
  )
  for _ in range(40):
    history = rng.integers(0, 4, size=24).astype(np.int32)
    last = int(rng.integers(0, 24))
    tokens, count, ngram = jax.device_get(lookup(jnp.asarray(history), jnp.int32(last)))
    want, want_n = continuation_reference(history, last, 3, 5)
    assert int(ngram) == want_n and int(count) == len(want), (history, last)
    np.testing.assert_array_equal(tokens[: int(count)], want)


def test_docstring_example():
  history = jnp.array([0, 1, 2, 3, 9, 1, 2, 3], jnp.int32)  # a b c d x b c d
  tokens, count, ngram = prompt_lookup.continuation(history, jnp.int32(7), max_ngram=3, length=6)
  assert (int(count), int(ngram)) == (4, 3)
  np.testing.assert_array_equal(tokens[:4], [9, 1, 2, 3])


def test_add_branch_follows_then_appends():
  """Tree r -> {a, b}, a -> {c, d}; the chain ``a e f`` follows ``a`` and appends ``e f``."""
  ids = jnp.array([[5, 6], [7, 8]])
  tree = tree_lib.accum_logp(ids, jnp.log(jnp.array([[0.6, 0.3], [0.5, 0.4]])), 5, anchor=1)
  joined, added = tree_lib.add_branch(tree_lib.pad(tree, 3), jnp.array([5, 9, 4]), jnp.int32(3))
  assert int(joined.num_nodes) == 7
  np.testing.assert_array_equal(joined.tokens[:7], [1, 5, 6, 7, 8, 9, 4])
  np.testing.assert_array_equal(joined.parents[:7], [-1, 0, 0, 1, 1, 1, 5])
  np.testing.assert_array_equal(joined.depths[:7], [0, 1, 1, 2, 2, 2, 3])
  np.testing.assert_array_equal(added, [0, 0, 0, 0, 0, 1, 1, 0])
  # A chain the tree already holds adds nothing; a short count stops it; no room cuts it.
  same, added = tree_lib.add_branch(tree_lib.pad(tree, 3), jnp.array([5, 7, 4]), jnp.int32(2))
  assert int(same.num_nodes) == 5 and not added.any()
  cut, added = tree_lib.add_branch(tree_lib.pad(tree, 1), jnp.array([6, 2, 3]), jnp.int32(3))
  assert int(cut.num_nodes) == 6 and int(added.sum()) == 1 and int(cut.parents[5]) == 2


@pytest.mark.parametrize('seed', range(3))
def test_add_branch_keeps_a_valid_tree(seed):
  """Parents precede children, depths step by one, siblings stay distinct, and the chain's
  tokens are exactly one root path."""
  rng = np.random.default_rng(seed)
  logits = jnp.asarray(rng.normal(size=(4, VOCAB)), jnp.float32)
  ids, logprobs = tree_lib.topk_per_depth(logits, 3)
  tree = tree_lib.pad(tree_lib.accum_logp(ids, logprobs, 9, anchor=0), 4)
  chain = jnp.concatenate([ids[0, :1], jnp.asarray(rng.integers(0, VOCAB, size=3), jnp.int32)])
  joined, _ = tree_lib.add_branch(tree, chain, jnp.int32(4))
  n = int(joined.num_nodes)
  parents, tokens, depths = (
    np.asarray(x)[:n] for x in (joined.parents, joined.tokens, joined.depths)
  )
  for i in range(1, n):
    assert parents[i] < i and depths[i] == depths[parents[i]] + 1
  pairs = {(int(p), int(t)) for p, t in zip(parents[1:], tokens[1:])}
  assert len(pairs) == n - 1, 'two siblings hold the same token'
  node = 0
  for token in np.asarray(chain):
    kids = [i for i in range(n) if parents[i] == node and tokens[i] == token]
    assert len(kids) == 1
    node = kids[0]


@pytest.fixture(scope='module')
def heads(target):
  return {
    'causal': js.testing.random_draft_head(target, block_size=6, seed=1),
    'bidirectional': js.testing.random_draft_head(target, block_size=6, causal=False, seed=2),
    'jetspecpp': js.testing.random_draft_head(target, block_size=6, seed=3, refine=True),
  }


@pytest.mark.parametrize(
  'method, head',
  [
    (js.methods.Tree(budget=16, width=3, copy_len=4), 'causal'),
    (js.methods.Tree(budget=6, width=2, copy_len=5, copy_ngram=1), 'bidirectional'),
    (js.methods.Chain(copy_len=5), 'causal'),
    (js.methods.JetSpecPP(budget=12, width=3, copy_len=5), 'jetspecpp'),
  ],
)
def test_greedy_with_copy_equals_autoregressive(target, heads, prompts, ar_outputs, method, head):
  """Three rows of different lengths in one batch; the copy branch's drafts are accepted in
  these runs (tiny greedy targets repeat themselves), so its commits are exercised."""
  outs = js.generate(target, heads[head], prompts, max_new_tokens=30, method=method)
  copied = 0
  for out, want in zip(outs, ar_outputs):
    np.testing.assert_array_equal(out.tokens, want)
    assert out.stats.round_stats['copy_nodes'] >= out.stats.round_stats['copy_accepted']
    copied += out.stats.round_stats['copy_accepted']
  assert copied > 0, 'no copied draft was accepted: the branch went untested'


def test_copy_raises_tau_where_the_output_repeats(target, heads, ar_outputs, prompts):
  """The 23-token prompt's greedy output is one token repeated: copying alone (a budget that
  leaves the head only the root) accepts whole copied chains."""
  out = js.generate(
    target,
    heads['causal'],
    prompts[2],
    max_new_tokens=30,
    method=js.methods.Tree(budget=6, copy_len=5),
  )
  np.testing.assert_array_equal(out.tokens, ar_outputs[2])
  assert out.stats.tau.max() == 6 and out.stats.mean_tau > 1.5


def test_merge_into_logprobs_raises_only_the_continuation():
  """Each depth's copied token gets max(its log-prob, log prior[n - 1]) for a match of n tokens;
  every other entry, and a context without a match, stay as they were."""
  history = jnp.asarray([5, 6, 7, 1, 2, 5, 6, 7, 0, 0], jnp.int32)  # anchor 7 at index 7
  logprobs = jnp.log(jnp.full((3, 9), 1 / 9, jnp.float32)).at[1, 2].set(jnp.log(0.95))
  merged = prompt_lookup.merge_into_logprobs(logprobs, history, jnp.int32(7), (0.2, 0.4, 0.8))
  # "5 6 7" matched at index 2 (n = 3): the continuation is 1 2 5.
  want = logprobs.at[0, 1].set(jnp.log(0.8)).at[2, 5].set(jnp.log(0.8))  # depth 1 keeps 0.95
  np.testing.assert_allclose(merged, want, rtol=1e-6)
  alone = jnp.asarray([3, 4, 8, 0], jnp.int32)
  np.testing.assert_array_equal(
    prompt_lookup.merge_into_logprobs(logprobs, alone, jnp.int32(2), (0.2,)), logprobs
  )


def test_merged_copy_candidates_stay_lossless_and_raise_tau(target, heads, prompts, ar_outputs):
  """Copy candidates merged into the head's (``copy_prior``): greedy == AR on every prompt, and
  on the prompt whose output repeats, a tree of 6 nodes accepts more than without them."""
  merged = js.methods.Tree(budget=6, width=3, algorithm='best_first', copy_prior=(0.5, 0.9, 0.99))
  plain = js.methods.Tree(budget=6, width=3, algorithm='best_first')
  outs = js.generate(target, heads['causal'], prompts, max_new_tokens=30, method=merged)
  for out, want in zip(outs, ar_outputs):
    np.testing.assert_array_equal(out.tokens, want)
  without = js.generate(target, heads['causal'], prompts[2], max_new_tokens=30, method=plain)
  assert outs[2].stats.mean_tau > without.stats.mean_tau + 0.5
  with pytest.raises(ValueError, match='copy_len must be 0'):
    js.methods.Tree(budget=8, copy_len=2, copy_prior=(0.5,))
  with pytest.raises(ValueError, match=r'probabilities in \(0, 1\]'):
    js.methods.Tree(budget=8, copy_prior=(0.5, 1.5))


def test_sampled_with_copy_matches_target_distribution():
  """T = 1, two rows, several rounds, with a copy branch taking half the tree: each row's
  4-token sequence follows the target's distribution, and copied drafts were accepted."""
  target = js.testing.tiny_target(5, vocab_size=5)
  target = target.replace(params=jax.tree.map(lambda p: p * 1.5, target.params))
  head = js.testing.random_draft_head(target, block_size=3, seed=6)
  rows = [np.array([1, 3, 1, 3, 0, 2]), np.array([4, 1])]
  prompts, lengths, capacity = decoding._prepare_prompts(target, rows, 4, extra=16)
  settings = js.methods.Tree(budget=4, width=2, copy_len=2, copy_ngram=2)
  loop = functools.partial(
    rounds.speculative_loop,
    capacity=capacity,
    max_new_tokens=4,
    sampling=rounds.Sampling(1.0),
    round_fn=settings,
  )
  draw = jax.jit(jax.vmap(lambda k: loop(target, head, prompts, lengths, k)))
  counts = np.zeros((2, 625))
  copied = 0
  for chunk in range(5):
    keys = jax.random.split(jax.random.key(chunk), 2000)
    tokens, _, _, _, stats = jax.device_get(draw(keys))
    copied += int(stats['copy_accepted'].sum())
    for r in range(2):
      counts[r] += np.bincount(tokens[:, r, :4] @ np.array([125, 25, 5, 1]), minlength=625)
  assert copied > 1000
  for r, prompt in enumerate(rows):
    assert_chi_square(counts[r], exact_distribution(target, prompt, 4, 1.0, 0, 1.0))


def test_bad_copy_settings(target, heads, prompts):
  with pytest.raises(ValueError, match='copy_len=6 must be in'):
    js.generate(target, heads['causal'], prompts[0], method=js.methods.Chain(copy_len=6))
  with pytest.raises(ValueError, match='leaves no node for the head'):
    js.generate(target, heads['causal'], prompts[0], method=js.methods.Tree(budget=4, copy_len=4))
  with pytest.raises(ValueError, match='copy_ngram=0'):
    js.generate(
      target, heads['causal'], prompts[0], method=js.methods.Tree(copy_len=2, copy_ngram=0)
    )
  with pytest.raises(ValueError, match='no node for the head'):
    js.methods.Tree(budget=3, width=2, copy_len=3)


def test_copy_baseline_metrics_by_hand():
  """The teacher-forced copy baseline (what a head's held-out metrics are compared with),
  worked out by hand: prompt ``7 1 2 3 4``, response ``9 1 2 3 4 9 1 2``, blocks of 4."""
  from jetspec_jax.training import copy_baseline

  tokens = np.asarray([[7, 1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 0, 0]])
  batch = dict(
    tokens=tokens,
    loss_mask=np.asarray([[0] * 5 + [1] * 8 + [0] * 2]),
    lengths=np.asarray([13]),
  )
  got = copy_baseline.copy_metrics(batch, block_size=4, max_ngram=3)
  # Anchors 5..11; anchor 5 (the first 9) has no earlier match, every other copy is right
  # until the sequence ends.
  assert got['anchors'] == 7
  np.testing.assert_allclose(got['accuracy'], [6 / 7, 5 / 6, 4 / 5])
  np.testing.assert_allclose(got['expected_tau'], 1 + (0 + 3 + 3 + 3 + 3 + 2 + 1) / 7)
  # Decoding visits anchors 5 (commits 1), 6 (3 drafts + 1) and 10 (the last 2 tokens): the
  # uniform average counts anchors 7-9, inside an accepted run, that decoding skips.
  np.testing.assert_allclose(got['walk_tau'], (1 + 4 + 2) / 3)
  labels = tokens.copy()
  labels[0, 7] = 5  # the target's argmax differs from the data at position 7
  got = copy_baseline.copy_metrics(dict(batch, labels=labels), block_size=4, max_ngram=3)
  np.testing.assert_allclose(got['accuracy'][0], 5 / 7)  # anchor 6 now misses
  np.testing.assert_allclose(got['expected_tau'], 1 + (0 + 0 + 3 + 3 + 3 + 2 + 1) / 7)


def test_first_response_tokens_scores_the_start_of_each_answer():
  """``first_response_tokens(batch, n)`` keeps the first ``n`` response tokens scored: on the
  by-hand sequence above, n = 4 leaves anchors 5..7 and cuts draft slots past position 8."""
  from jetspec_jax.training import copy_baseline, run_config

  tokens = np.asarray([[7, 1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 0, 0]])
  mask = np.asarray([[0] * 5 + [1] * 8 + [0] * 2], np.int32)
  batch = dict(tokens=tokens, loss_mask=mask, lengths=np.asarray([13]))
  cut = run_config.first_response_tokens(batch, 4)
  np.testing.assert_array_equal(cut['loss_mask'], [[0] * 5 + [1] * 4 + [0] * 6])
  assert cut['loss_mask'].dtype == mask.dtype and batch['loss_mask'] is mask  # not in place
  got = copy_baseline.copy_metrics(cut, block_size=4, max_ngram=3)
  # Anchor 5 has no match (slots 6-8 wrong); anchor 6 copies 2 3 4, scored at positions 7, 8
  # only (both right); anchor 7 copies 3 4 9, scored at position 8 only (right).
  assert got['anchors'] == 3
  np.testing.assert_allclose(got['accuracy'], [2 / 3, 1 / 2, 0 / 1])
  np.testing.assert_allclose(got['expected_tau'], 1 + (0 + 2 + 1) / 3)
  # Decoding: anchor 5 commits position 6, anchor 6 the last two (7 and 8, its run capped there).
  np.testing.assert_allclose(got['walk_tau'], (1 + 2) / 2)
  whole = run_config.first_response_tokens(batch, 100)
  np.testing.assert_array_equal(whole['loss_mask'], mask)


def test_copy_calibration_counts_right_copies(tmp_path):
  """``copy_calibration`` on a shard whose response repeats its prompt: every 4-token match copies
  right (precision 1), and a planted wrong token after the repeat is counted wrong."""
  prompt = [3, 4, 5, 6, 7, 8, 9, 10]
  tokens = np.array([prompt + prompt + [2]], np.uint16)
  mask = np.zeros_like(tokens, np.uint8)
  mask[0, 8:] = 1
  np.savez(tmp_path / 'shard_00000.npz', tokens=tokens, loss_mask=mask, lengths=np.array([17]))
  result = copy_calibration.calibrate([tmp_path / 'shard_00000.npz'], max_ngram=4, depth=3)
  rows = {r['ngram']: r for r in result['rows']}
  assert result['anchors'] == 9  # positions 7..15 predict the response tokens 8..16
  # Anchors 11..15 have a 4-token match; the copy at 15 predicts 3 (what followed "7 8 9 10" in
  # the prompt) where the sequence has 2: the other 4 copy their next token right. Anchors 8,
  # 9, 10 match 1, 2, 3 tokens and copy right; 7 has no match.
  assert rows[4]['anchors'] == 5 and rows[4]['first_precision'] == pytest.approx(4 / 5)
  assert result['copy_prior'] == pytest.approx([1.0, 1.0, 1.0, 0.8])
  assert result['no_match'] == pytest.approx(1 / 9)


def test_copy_prior_is_always_a_valid_tree_setting():
  """Precision 0 floors at 0.01; a match length without anchors takes the nearest shorter
  length's prior (else the nearest longer one's); every result builds a Tree."""
  assert copy_calibration.copy_prior_from_precisions([0.0, 0.5, None, 0.904]) == [
    0.01,
    0.5,
    0.5,
    0.9,
  ]
  assert copy_calibration.copy_prior_from_precisions([None, None, 0.7]) == [0.7, 0.7, 0.7]
  js.methods.Tree(copy_prior=copy_calibration.copy_prior_from_precisions([0.0, None, 0.3]))
  with pytest.raises(ValueError, match='no anchor'):
    copy_calibration.copy_prior_from_precisions([None, None])
