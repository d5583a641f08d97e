"""On-device autoregressive generation against a naive full-recompute loop."""

import numpy as np
import pytest

import jetspec_jax as js


@pytest.fixture(scope='module')
def target():
  return js.testing.tiny_target(1)


def naive_greedy(target, prompt, n):
  seq = list(prompt)
  for _ in range(n):
    seq.append(int(np.asarray(target.forward_logits(np.array([seq])))[0, -1].argmax()))
  return np.array(seq[len(prompt) :])


@pytest.mark.parametrize('prompt_len', [1, 5, 17])
def test_greedy_ar_equals_full_recompute(target, prompt_len):
  prompt = js.testing.random_ids(prompt_len, (prompt_len,), target.cfg.vocab_size)
  out = js.generate(target, None, prompt, max_new_tokens=12, method=js.methods.AR())
  np.testing.assert_array_equal(out.tokens, naive_greedy(target, prompt, 12))
  assert out.stats.new_tokens == 12 and (out.stats.tau == 1).all() and out.stats.rounds == 11


def test_stops_at_eos(target):
  prompt = js.testing.random_ids(0, (6,), target.cfg.vocab_size)
  free = js.generate(target, None, prompt, max_new_tokens=12, method=js.methods.AR()).tokens
  eos = int(free[4])
  first = int(np.flatnonzero(free == eos)[0])
  stopping = js.Target(cfg=js.decoder.tiny(eos_token_id=eos), params=target.params)
  out = js.generate(stopping, None, prompt, max_new_tokens=12, method=js.methods.AR())
  np.testing.assert_array_equal(out.tokens, free[: first + 1])


def test_sampling_is_seeded(target):
  prompt = js.testing.random_ids(0, (6,), target.cfg.vocab_size)
  a = js.generate(
    target, None, prompt, max_new_tokens=10, temperature=1.0, seed=3, method=js.methods.AR()
  ).tokens
  b = js.generate(
    target, None, prompt, max_new_tokens=10, temperature=1.0, seed=3, method=js.methods.AR()
  ).tokens
  c = js.generate(
    target, None, prompt, max_new_tokens=10, temperature=1.0, seed=4, method=js.methods.AR()
  ).tokens
  np.testing.assert_array_equal(a, b)
  assert (a != c).any()


def test_bad_arguments(target):
  with pytest.raises(TypeError, match='method must be a method value'):
    js.generate(target, None, [1, 2], method='beam')
  with pytest.raises(ValueError, match="method name must be one of .* got 'beam'"):
    js.methods.from_config('beam')
  with pytest.raises(ValueError, match=r"'tree' has no setting \['beams'\]"):
    js.methods.from_config(dict(name='tree', beams=4))
  with pytest.raises(ValueError, match='1-D'):
    js.generate(target, None, np.array([[1, 2]]), method=js.methods.AR())
  with pytest.raises(ValueError, match='empty'):
    js.generate(target, None, [], method=js.methods.AR())
  with pytest.raises(ValueError, match='token ids must be in'):
    js.generate(target, None, [1, 999], method=js.methods.AR())
  with pytest.raises(ValueError, match='max_new_tokens'):
    js.generate(target, None, [1, 2], max_new_tokens=0, method=js.methods.AR())
