"""The public table's tree walk equals real greedy decoding round by round (tiny target)."""

import numpy as np
import pytest

import jetspec_jax as js
from jetspec_jax.evaluation import tree_walk

VOCAB = 40


@pytest.fixture(scope='module')
def target():
  return js.testing.tiny_target(3, vocab_size=VOCAB)


def _heads(target):
  rand = js.testing.random_draft_head
  return {
    'jetspec': rand(target, block_size=5, seed=1, scale=3.0),
    'dflash': rand(target, block_size=5, seed=2, causal=False, scale=3.0),
    'seeded': rand(target, block_size=5, seed=3, copy_seed=2, scale=3.0),
    'jetspecpp': rand(target, block_size=5, seed=4, refine=True, copy_seed=2, scale=3.0),
    'dspark': rand(target, block_size=5, seed=5, markov_rank=4, scale=3.0),
    # Drafting with bfloat16-input projections (the public table's setting): walk and decoding
    # draft in the same precision.
    'jetspec_bf16': rand(target, block_size=5, seed=1, scale=3.0).with_compute_dtype('bfloat16'),
  }


METHODS = {
  'jetspec': [
    js.methods.Chain(),
    js.methods.Tree(budget=8, width=3, algorithm='best_first'),
    js.methods.Tree(budget=24, width=4, algorithm='accum_logp'),
    js.methods.Tree(budget=8, width=1, copy_len=4),  # the copy drafter alone
    js.methods.Tree(budget=12, width=3, copy_prior=(0.4, 0.8, 0.9)),
  ],
  'dflash': [js.methods.Chain(), js.methods.Tree(budget=16, width=3, algorithm='top2gap')],
  'seeded': [js.methods.Chain(copy_len=2), js.methods.Tree(budget=10, width=3, depth_bonus=0.5)],
  'jetspecpp': [js.methods.JetSpecPP(budget=10, width=3, recycle=False)],
  'jetspec_bf16': [js.methods.Chain(), js.methods.Tree(budget=16, width=4, algorithm='best_first')],
  'dspark': [js.methods.DSpark(threshold=0.0), js.methods.DSpark(threshold=0.4)],
}


@pytest.mark.parametrize('name', sorted(METHODS))
def test_walk_equals_decoding_round_by_round(target, name):
  head = _heads(target)[name]
  rng = np.random.default_rng(7)
  motif = rng.integers(0, VOCAB, 6)
  for seed, max_new in ((0, 30), (1, 45)):
    prompt = np.concatenate([rng.integers(0, VOCAB, 5 + seed), motif, motif[:3]]).astype(np.int32)
    ar = js.generate(target, None, prompt, method=js.methods.AR(), max_new_tokens=max_new)
    walked, facts = tree_walk.walks(target, head, prompt, ar.tokens, METHODS[name])
    assert facts['label_mismatches'] == 0
    for method, w in zip(METHODS[name], walked, strict=True):
      out = js.generate(target, head, prompt, method=method, max_new_tokens=max_new)
      np.testing.assert_array_equal(out.tokens, ar.tokens)
      assert w.rounds == out.stats.rounds, method
      # The last round may count drafts past the cut in decoding; every other round is equal.
      np.testing.assert_array_equal(w.committed[:-1], out.stats.tau[:-1], err_msg=str(method))
      assert w.committed[-1] <= out.stats.tau[-1]
      assert w.committed.sum() == len(ar.tokens) - 1


def test_walk_counts():
  w = tree_walk.walk(np.array([0, 0, 3, 9, 9, 1, 0, 0, 0]), start=2, end=7, max_accept=3)
  assert w.committed.tolist() == [4, 1, 1] and w.accepted.tolist() == [3, 0, 0]
  assert w.capped == 1 and w.histogram() == [2, 0, 0, 1] and w.tau == 2.0
  # The last round stops at the response's last token whatever it would accept.
  w = tree_walk.walk(np.array([0, 5, 5, 5, 5]), start=1, end=3, max_accept=5)
  assert w.committed.tolist() == [3] and w.capped == 0
