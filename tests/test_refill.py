"""Refilled-row greedy generation gives each prompt the target's own greedy response."""

import numpy as np
import pytest

from jetspec_jax import decoding, methods, testing
from jetspec_jax.evaluation import refill


def test_refilled_rows_give_each_prompt_its_greedy_response():
  """More prompts than rows, of different lengths, some stopping early: every response equals
  batch-of-one AR decoding of its prompt, and each is reported once."""
  target = testing.tiny_target(seed=3)
  vocab = target.cfg.vocab_size
  prompts = [testing.random_ids(i, (5 + 7 * i,), vocab) for i in range(7)]
  # A stop id that some greedy responses reach before the cap and some do not.
  reference = [
    decoding.generate(target, None, p, method=methods.AR(), max_new_tokens=12, eos_id=[vocab - 1])
    for p in prompts
  ]
  counts = np.bincount(np.concatenate([r.tokens for r in reference]), minlength=vocab)
  stop = int(np.argmax(counts))
  reference = [
    decoding.generate(target, None, p, method=methods.AR(), max_new_tokens=12, eos_id=stop).tokens
    for p in prompts
  ]
  assert any(len(r) < 12 for r in reference) and any(len(r) == 12 for r in reference)
  seen = []
  out = refill.generate(
    target, prompts, max_new_tokens=12, eos=[stop], rows=3, chunk=5, on_finished=seen.append
  )
  assert sorted(f.index for f in out) == list(range(len(prompts)))
  assert [f.index for f in seen] == [f.index for f in out]
  for f in out:
    np.testing.assert_array_equal(f.tokens, reference[f.index])
    assert f.seconds > 0


def test_refill_refuses_no_stop_ids():
  with pytest.raises(ValueError, match='stop ids'):
    refill.generate(testing.tiny_target(), [np.arange(4)], max_new_tokens=4, eos=[])
