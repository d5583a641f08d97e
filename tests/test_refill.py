"""Refilled-row greedy generation gives each prompt the target's own greedy response."""

import itertools

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


def test_a_stream_asks_follow_ups_made_from_finished_responses():
  """A generator that yields a follow-up prompt (a prompt + its own response + more) when a
  response ends, and None while it waits: each follow-up gets its own greedy response, drawn in
  order, and rows keep decoding the rest meanwhile."""
  target = testing.tiny_target(seed=3)
  vocab = target.cfg.vocab_size
  firsts = [testing.random_ids(10 + i, (4 + 5 * i,), vocab) for i in range(3)]
  queue, drawn = [], []

  def stream():
    for p in firsts:
      drawn.append(p)
      yield p
    while len(drawn) < 2 * len(firsts):
      if queue:
        drawn.append(queue.pop(0))
        yield drawn[-1]
      else:
        yield None

  def on_finished(f):
    if f.index < len(firsts):
      queue.append(np.concatenate([drawn[f.index], f.tokens, [7, 8]]).astype(np.int32))

  out = refill.generate(
    target,
    stream(),
    max_new_tokens=6,
    eos=[vocab - 1],
    rows=2,
    chunk=3,
    capacity=256,
    on_finished=on_finished,
  )
  assert sorted(f.index for f in out) == list(range(6))
  for f in out:
    expected = decoding.generate(
      target, None, drawn[f.index], method=methods.AR(), max_new_tokens=6, eos_id=[vocab - 1]
    ).tokens
    np.testing.assert_array_equal(f.tokens, expected)


def test_a_stream_needs_capacity_and_prompts_that_fit():
  target = testing.tiny_target()
  with pytest.raises(ValueError, match='capacity'):
    refill.generate(target, iter([np.arange(4)]), max_new_tokens=4, eos=[1])
  with pytest.raises(ValueError, match='does not fit'):
    refill.generate(
      target, iter([np.arange(200)]), max_new_tokens=4, eos=[1], capacity=refill.PROMPT_BUCKET
    )
  with pytest.raises(ValueError, match='nothing to ask'):
    refill.generate(target, itertools.repeat(None), max_new_tokens=4, eos=[1], capacity=256)


def test_a_sample_is_its_prompts_own_whatever_the_rows_chunk_or_order():
  """Sampled responses use keys of (the prompt's seed, the token's position): the same prompts
  in another order through other rows and chunks give the same samples; other seeds other ones."""
  target = testing.tiny_target(seed=3)
  vocab = target.cfg.vocab_size
  prompts = [testing.random_ids(20 + i, (3 + 4 * i,), vocab) for i in range(5)]
  kwargs = dict(max_new_tokens=10, eos=[vocab - 1], temperature=1.0, capacity=256)
  seeds = [101, 7, 55, 3, 19]
  one = refill.generate(target, iter(prompts), rows=2, chunk=3, seed_of=seeds.__getitem__, **kwargs)
  order = [3, 0, 4, 1, 2]
  two = refill.generate(
    target,
    iter([prompts[i] for i in order]),
    rows=3,
    chunk=5,
    seed_of=lambda k: seeds[order[k]],
    **kwargs,
  )
  first = {f.index: f.tokens for f in one}
  second = {order[f.index]: f.tokens for f in two}
  for i in range(len(prompts)):
    np.testing.assert_array_equal(first[i], second[i])
  greedy = {
    f.index: f.tokens for f in refill.generate(target, prompts, max_new_tokens=10, eos=[vocab - 1])
  }
  other = {
    f.index: f.tokens for f in refill.generate(target, iter(prompts), **kwargs)
  }  # seeds 0..4
  assert any(len(first[i]) != len(greedy[i]) or (first[i] != greedy[i]).any() for i in first)
  assert any(len(first[i]) != len(other[i]) or (first[i] != other[i]).any() for i in first)


def test_a_mixed_stream_gives_each_prompt_its_own_kind_of_answer():
  """A sampled stream whose ``greedy_of`` names some prompts: those get their greedy responses,
  the others the same samples as in a sampled stream alone."""
  target = testing.tiny_target(seed=3)
  vocab = target.cfg.vocab_size
  prompts = [testing.random_ids(40 + i, (3 + 5 * i,), vocab) for i in range(6)]
  kwargs = dict(max_new_tokens=10, eos=[vocab - 1], capacity=256)
  greedy = {f.index: f.tokens for f in refill.generate(target, iter(prompts), **kwargs)}
  sampled = {
    f.index: f.tokens
    for f in refill.generate(target, iter(prompts), temperature=1.0, rows=2, chunk=4, **kwargs)
  }
  mixed = {
    f.index: f.tokens
    for f in refill.generate(
      target,
      iter(prompts),
      temperature=1.0,
      rows=3,
      chunk=3,
      greedy_of=lambda i: i % 2 == 0,
      **kwargs,
    )
  }
  for i in range(len(prompts)):
    np.testing.assert_array_equal(mixed[i], (greedy if i % 2 == 0 else sampled)[i])
  assert any(len(greedy[i]) != len(sampled[i]) or (greedy[i] != sampled[i]).any() for i in greedy)
