"""At T > 0 every tree option keeps the target's distribution (docs/design.md §5): copy priors,
depth bonus, a reduced draft vocabulary (the case that once gave duplicate siblings), copy-seeded
heads, bfloat16x2 targets and copy branches under top-k / top-p. Chi-square over the first 3
generated tokens on a 5-token vocabulary, as tests/test_decoding.py does."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax as js
from jetspec_jax import decoding, rounds
from tests.test_decoding import assert_chi_square, exact_distribution

PROMPT = np.array([1, 3, 0, 2, 1, 3, 0, 2, 1, 3])  # repeats: copy candidates find matches


@functools.lru_cache(maxsize=1)
def sharp_target():
  target = js.testing.tiny_target(5, vocab_size=5)
  return target.replace(params=jax.tree.map(lambda p: p * 1.5, target.params))


def sample_counts(target, head, method, sampling, samples=4000, first_key=0) -> np.ndarray:
  prompt, plen, capacity = decoding._prepare_prompt(target, PROMPT, 3, extra=80)
  loop = functools.partial(
    rounds.speculative_loop,
    capacity=capacity,
    max_new_tokens=3,
    sampling=sampling,
    round_fn=method.make_round(target, head)[0],
  )
  draw = jax.jit(jax.vmap(lambda k: loop(target, head, prompt, plen, k)[0]))
  counts = np.zeros(125)
  for chunk in range(samples // 2000):
    keys = jax.random.split(jax.random.key(first_key + chunk), 2000)
    tokens = jax.device_get(draw(keys))[:, 0]
    counts += np.bincount(tokens[:, 0] * 25 + tokens[:, 1] * 5 + tokens[:, 2], minlength=125)
  return counts


def _head(target, **kwargs):
  return js.testing.random_draft_head(target, block_size=4, seed=6, **kwargs)


CASES = {
  'copy_prior': (
    lambda t: _head(t),
    js.methods.Tree(budget=12, width=3, copy_prior=(0.3, 0.6, 0.9, 0.9)),
    rounds.Sampling(1.0),
  ),
  'depth_bonus': (
    lambda t: _head(t),
    js.methods.Tree(budget=12, width=3, algorithm='best_first', depth_bonus=1.0),
    rounds.Sampling(1.0),
  ),
  # Two draft ids, width 3: off-vocabulary candidates score a masked value, two of them on a path
  # overflow to -inf (the planted duplicate-sibling case).
  'reduced_vocab': (
    lambda t: _head(t).replace(draft_vocab=jnp.array([1, 3], jnp.int32)),
    js.methods.Tree(budget=64, width=3, algorithm='accum_logp'),
    rounds.Sampling(1.0),
  ),
  'copy_seeded_head': (
    lambda t: _head(t, copy_seed=2),
    js.methods.Tree(budget=12, width=3, algorithm='best_first'),
    rounds.Sampling(1.0),
  ),
  'copy_len_top_k_top_p': (
    lambda t: _head(t),
    js.methods.Tree(budget=12, width=3, copy_len=3),
    rounds.Sampling(0.8, 3, 0.9),
  ),
  'chain_copy_len_top_p': (
    lambda t: _head(t),
    js.methods.Chain(copy_len=2),
    rounds.Sampling(1.2, 0, 0.8),
  ),
}


@pytest.mark.parametrize('case', sorted(CASES))
def test_sampled_option_matches_target(case):
  make_head, method, sampling = CASES[case]
  target = sharp_target()
  counts = sample_counts(target, make_head(target), method, sampling)
  probs = exact_distribution(
    target, PROMPT, 3, sampling.temperature, sampling.top_k, sampling.top_p
  )
  assert_chi_square(counts, probs)


def test_sampled_bfloat16x2_target_matches_its_own_distribution():
  """A bfloat16x2 target's speculative samples follow that target's own distribution."""
  target = sharp_target().with_weight_dtype('bfloat16', split_inputs=True)
  head = _head(sharp_target())
  counts = sample_counts(target, head, js.methods.Tree(budget=12, width=3), rounds.Sampling(1.0))
  assert_chi_square(counts, exact_distribution(target, PROMPT, 3, 1.0, 0, 1.0))
