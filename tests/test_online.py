"""Online adaptation (jetspec_jax/online.py): the output stays the target's while the head
learns, updates that hurt are rolled back, and the adapter's state survives a save and a
restore (and a damaged checkpoint is refused)."""

import dataclasses
import json

import jax
import numpy as np
import pytest

import jetspec_jax as js
from jetspec_jax import online, rounds
from tests.conftest import VOCAB
from tests.test_decoding import assert_chi_square, exact_distribution

CONFIG = online.OnlineConfig(
  update_every=2,
  steps=3,
  batch_size=2,
  num_anchors=4,
  lr=1e-2,
  max_len=48,
  holdout_every=0,
  gamma=0.0,
)


def head_for(target, seed=3):
  return js.testing.random_draft_head(target, block_size=4, seed=seed)


def stream(n, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(0, VOCAB, int(rng.integers(3, 12))) for _ in range(n)]


def ar(target, prompt, n):
  return js.generate(target, None, prompt, method=js.methods.AR(), max_new_tokens=n).tokens


def test_greedy_outputs_equal_ar_while_the_head_changes(target):
  adapter = online.Adapter(target, head_for(target), js.methods.Tree(budget=8, width=3), CONFIG)
  start = jax.tree.map(np.asarray, adapter.head.params)
  prompts = stream(6)
  for p in prompts:
    out = adapter.generate(p, max_new_tokens=12)
    np.testing.assert_array_equal(out.tokens, ar(target, p, 12))
  batch = adapter.generate(prompts[:2] + stream(2, seed=1), max_new_tokens=10)  # batched
  for p, out in zip(prompts[:2] + stream(2, seed=1), batch, strict=True):
    np.testing.assert_array_equal(out.tokens, ar(target, p, 10))
  assert adapter.served == 10 and len(adapter.updates) == 5
  assert all(u['kept'] for u in adapter.updates)  # no held-out slice: every update is kept
  moved = jax.tree.map(
    lambda a, b: float(np.abs(np.asarray(a) - b).max()), adapter.head.params, start
  )
  assert max(jax.tree.leaves(moved)) > 0  # the head did change between prompts


def test_the_head_learns_what_it_serves_and_a_harmful_update_is_rolled_back(target):
  config = dataclasses.replace(CONFIG, holdout_every=3, update_every=3, steps=10, lr=3e-2)
  adapter = online.Adapter(target, head_for(target), js.methods.Tree(budget=8, width=3), config)
  prompts = stream(2, seed=4)
  for i in range(18):  # the same two prompts, again and again
    adapter.generate(prompts[i % 2], max_new_tokens=16)
  first, last = adapter.updates[0], adapter.updates[-1]
  assert first['heldout_tau_before'] is not None
  best = max(u['heldout_tau_after'] for u in adapter.updates if u['kept'])
  assert best > first['heldout_tau_before'] + 0.2, adapter.updates
  # A learning rate that wrecks the head: its update lowers the held-out tau and is rolled back.
  wrecking = online.Adapter(
    target, adapter.head, adapter.method, dataclasses.replace(config, lr=50.0)
  )
  good = jax.tree.map(np.asarray, adapter.head.params)
  for i in range(3):
    wrecking.generate(prompts[i % 2], max_new_tokens=16)
  (update,) = wrecking.updates
  assert not update['kept'] and update['heldout_tau_after'] < update['heldout_tau_before']
  same = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), wrecking.head.params, good)
  assert all(jax.tree.leaves(same))
  assert last['served'] == 18


def test_cached_features_train_as_the_target_forward_does(target):
  """features='cache' (one target forward per served sequence, stored in float16 as offline
  training stores them) and 'recompute' (the forward in every step) take the same steps, up to
  that rounding."""
  losses = []
  for mode in ('cache', 'recompute'):
    adapter = online.Adapter(
      target, head_for(target), js.methods.Chain(), dataclasses.replace(CONFIG, features=mode)
    )
    for p in stream(4, seed=2):
      adapter.observe(p, ar(target, p, 10))
    losses.append([u['loss'] for u in adapter.updates])
  assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=2e-3)


def test_save_restore_resumes_the_same_stream_and_refuses_damage(target, tmp_path):
  config = dataclasses.replace(CONFIG, holdout_every=3)
  adapter = online.Adapter(target, head_for(target), js.methods.Tree(budget=8, width=3), config)
  prompts = stream(9, seed=5)
  for p in prompts[:5]:
    adapter.observe(p, ar(target, p, 8))
  adapter.save(tmp_path / 'a')
  restored = online.Adapter.restore(tmp_path / 'a', target, head_for(target, seed=9))
  assert restored.served == 5 and restored.updates == adapter.updates
  assert restored.method == adapter.method and restored.config == adapter.config
  for p in prompts[5:]:  # both continue the stream: the same updates, the same head
    out = ar(target, p, 8)
    adapter.observe(p, out)
    restored.observe(p, out)
  assert [u['loss'] for u in restored.updates] == pytest.approx(
    [u['loss'] for u in adapter.updates]
  )
  same = jax.tree.map(
    lambda a, b: np.allclose(a, b, atol=1e-6), restored.head.params, adapter.head.params
  )
  assert all(jax.tree.leaves(same))
  # Damage: a truncated buffer, a missing state, a head of another kind.
  with open(tmp_path / 'a' / online.BUFFER_FILE, 'r+b') as f:
    f.truncate(100)
  with pytest.raises(online.CheckpointError, match='checksum'):
    online.Adapter.restore(tmp_path / 'a', target, head_for(target))
  adapter.save(tmp_path / 'b')
  import shutil

  shutil.rmtree(tmp_path / 'b' / online.STATE_DIR)
  with pytest.raises(online.CheckpointError, match='missing'):
    online.Adapter.restore(tmp_path / 'b', target, head_for(target))


def test_a_sampled_stream_keeps_the_target_distribution():
  """Samples drawn while the head changes between them follow the target's distribution
  (chi-square over the first 3 tokens, the heads after 0 and 2 updates)."""
  from tests.test_sampled_options import PROMPT, sample_counts, sharp_target

  target = sharp_target()
  config = dataclasses.replace(CONFIG, update_every=1, steps=4, lr=5e-2, max_len=32)
  method = js.methods.Tree(budget=12, width=3)
  adapter = online.Adapter(
    target, js.testing.random_draft_head(target, block_size=4, seed=6), method, config
  )
  counts = sample_counts(target, adapter.head, method, rounds.Sampling(1.0), samples=2000)
  for seed in range(2):
    adapter.generate(PROMPT, max_new_tokens=8, temperature=1.0, seed=seed)
  assert len(adapter.updates) == 2 and adapter._loss() == 'fkl'
  counts += sample_counts(
    target, adapter.head, method, rounds.Sampling(1.0), samples=2000, first_key=1
  )
  assert_chi_square(counts, exact_distribution(target, PROMPT, 3, 1.0, 0, 1.0))


def test_bad_settings_are_refused(target):
  for bad in (dict(update_every=0), dict(sampled_loss='rkl'), dict(features='disk'), dict(lr=0)):
    with pytest.raises(ValueError):
      online.OnlineConfig(**bad)
  dspark = js.testing.random_draft_head(target, block_size=4, seed=1, markov_rank=4, causal=False)
  with pytest.raises(ValueError, match='online adaptation'):
    online.Adapter(target, dspark, js.methods.DSpark())
  with pytest.raises(ValueError, match='non-empty prompt'):
    online.Adapter(target, head_for(target)).observe([], [1, 2])


@pytest.mark.slow  # ~150 s on the real model: `make test-slow`
def test_online_streams_pipeline_on_smollm2(tmp_path):
  """The ``:tiny`` online-streams run end to end: responses, a stream adapted on its first half
  and walked on its second with both heads, real serving equal to AR, a result file."""
  from experiments.configs.evaluate import online_smollm2
  from experiments.tasks import online_streams

  try:
    js.model_cache.smollm2_135m_instruct_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  config = online_smollm2.get_config('tiny')
  for stage in online_streams.STAGES:
    getattr(online_streams, f'run_{stage}')(config, tmp_path)
  result = json.loads((tmp_path / 'results.json').read_text())
  (stream,) = result['streams']
  assert stream['adapted_on'] == 2 and len(stream['curve']) == 2 and stream['updates']
  assert all(r['frozen_tau'] >= 1 and r['adapted_tau'] >= 1 for r in stream['rows'])
  assert result['serve']['outputs_equal_to_ar'] == result['serve']['prompts']
  (bound,) = result['bounds']
  assert [r['trained_on'] for r in bound['rows']] == ['first half', 'second half']
  assert all(r['tau'] >= 1 and r['steps'] == 2 for r in bound['rows'])
  assert result['provenance']['weights_sha256']['head']
