"""DSpark: lossless rounds (greedy == AR, T > 0 == the target's distribution), the prefix
scheduler's early stop (the paper's Appendix A), the Markov stage, calibration, I/O, training."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax as js
from experiments.tasks import dspark_calibration as calibrate_head
from jetspec_jax import decoding, rounds
from jetspec_jax.methods import dspark
from jetspec_jax.models import draft_head as dh
from jetspec_jax.training import data as data_lib
from jetspec_jax.training import dspark_calibration, head_step, head_sums
from jetspec_jax.training import loop as loop_lib
from jetspec_jax.training import shards as shards_lib
from tests.conftest import VOCAB
from tests.test_decoding import assert_chi_square, exact_distribution


def bigram_head(target, sequences, block_size, seed=3):
  """A random DSpark head whose Markov bias predicts each token's most frequent successor in
  ``sequences`` (one-hot ``W1``, so ``W1[x] W2`` is row ``x`` of ``W2``): a tiny target's greedy
  text loops, so such a head's drafts are often accepted and commits get exercised."""
  succ = np.zeros((VOCAB, VOCAB))
  for seq in sequences:
    np.add.at(succ, (seq[:-1], seq[1:]), 1)
  best = (succ == succ.max(1, keepdims=True)) & (succ.max(1, keepdims=True) > 0)
  head = js.testing.random_draft_head(target, block_size=block_size, seed=seed, markov_rank=VOCAB)
  markov = dict(embed=jnp.eye(VOCAB), proj=jnp.asarray(30.0 * best, jnp.float32))
  return head.replace(params=dict(head.params, markov=markov))


@pytest.fixture(scope='module')
def heads(target, prompts, ar_outputs):
  text = [np.concatenate([p, a]) for p, a in zip(prompts, ar_outputs)]
  return {bs: bigram_head(target, text, bs) for bs in (3, 6)}


@pytest.mark.parametrize(
  'block_size, verify_length, threshold',
  [(3, 'threshold', 0.0), (6, 'threshold', 0.0), (6, 'threshold', 0.4), (3, 'threshold', 0.9)],
)
def test_greedy_dspark_equals_autoregressive(
  target, heads, prompts, ar_outputs, block_size, verify_length, threshold
):
  """Any head, block size and threshold; three rows of different lengths in one batch."""
  head = heads[block_size]
  outs = js.generate(
    target,
    head,
    prompts,
    max_new_tokens=30,
    method=js.methods.DSpark(verify_length=verify_length, threshold=threshold),
  )
  accepted = 0
  for out, want in zip(outs, ar_outputs):
    np.testing.assert_array_equal(out.tokens, want)
    accepted += int((out.stats.tau - 1).sum())
  if threshold < 0.9:
    assert accepted > 0, 'no draft was ever accepted: the commit path went untested'


def test_greedy_scheduler_equals_autoregressive(target, heads, prompts, ar_outputs):
  """The prefix scheduler, with a table that makes it truncate (wide verifies cost more) and
  with the table ``generate`` profiles on this device, is lossless too."""
  head = heads[6]
  padded, lengths, capacity = decoding._prepare_prompts(target, prompts, 30, extra=16)
  sps = jnp.asarray(1.0 / (1.0 + 0.15 * np.arange(7)), jnp.float32)  # width 1..7
  out, n, taus, _, _ = rounds.speculative_loop(
    target,
    head,
    padded,
    lengths,
    jax.random.key(0),
    sps,
    capacity=capacity,
    max_new_tokens=30,
    sampling=rounds.Sampling(),
    round_fn=js.methods.DSpark('scheduler'),
  )
  for i, want in enumerate(ar_outputs):
    np.testing.assert_array_equal(np.asarray(out[i, : len(want)]), want)
  assert int(np.asarray(taus).max()) > 1
  profiled = js.generate(
    target, head, prompts, max_new_tokens=30, method=js.methods.DSpark(verify_length='scheduler')
  )
  for o, want in zip(profiled, ar_outputs):
    np.testing.assert_array_equal(o.tokens, want)


def test_eos_stops_like_autoregressive(target, heads, prompts, ar_outputs):
  prompt, free = prompts[1], ar_outputs[1]
  eos = int(free[7])
  want = free[: int(np.flatnonzero(free == eos)[0]) + 1]
  out = js.generate(
    target, heads[6], prompt, max_new_tokens=30, method=js.methods.DSpark(threshold=0.0), eos_id=eos
  )
  np.testing.assert_array_equal(out.tokens, want)


def test_verify_length_is_respected(target, heads, prompts):
  """Only the admitted prefix can be accepted: threshold 0 verifies the whole block, threshold 1
  (survival is below 1) none, and then the round commits the target's token alone."""
  head = heads[6]
  padded, lengths, capacity = decoding._prepare_prompts(target, prompts[:1], 4, extra=16)
  state = rounds.start_rounds(
    target, head, padded, lengths, jax.random.key(0), capacity=capacity, sampling=rounds.Sampling()
  )
  one_round = jax.jit(lambda state, r: r(target, head, state, rounds.Sampling()), static_argnums=1)
  _, full = one_round(state, js.methods.DSpark('threshold', 0.0))
  assert int(full.verify_len[0]) == 6 and int(full.tau[0]) <= 7
  _, none = one_round(state, js.methods.DSpark('threshold', 1.0))
  assert int(none.verify_len[0]) == 0 and int(none.tau[0]) == 1


SAMPLED = [
  ('threshold', 1.0, 0, 1.0),
  ('scheduler', 0.8, 4, 0.9),
]


def token_dependent_confidence_head(target, block_size: int):
  """A random DSpark head whose confidence depends only and strongly on the previous token
  (``c_k = sigmoid(u . W1[x_{k-1}] + 0.5)``, spread over ~0.1-0.95), so verify lengths are
  often cut and differ between rows. A confidence computed from ``x_k`` instead (an
  anticipating stop, DSpark's Appendix A) then truncates by the drafted token itself and biases
  the output, which the chi-square test below detects (statistic ~700-1400 against a bound of
  ~170; measured with that mutation planted)."""
  head = js.testing.random_draft_head(target, block_size=block_size, seed=6, markov_rank=4)
  rng = np.random.default_rng(0)
  params = head.params
  d = target.cfg.hidden_size
  embed = jnp.asarray(rng.normal(size=params['markov']['embed'].shape), jnp.float32)
  kernel = jnp.zeros_like(params['confidence']['kernel']).at[d:].set(rng.normal(size=4) * 2.0)
  confidence = dict(kernel=kernel, bias=jnp.float32(0.5))
  return head.replace(
    params=dict(params, markov=dict(params['markov'], embed=embed), confidence=confidence)
  )


@pytest.mark.parametrize('verify_length, temperature, top_k, top_p', SAMPLED)
def test_sampled_dspark_matches_target_distribution(verify_length, temperature, top_k, top_p):
  """T > 0: min(1, p/q) acceptance with the residual, over several rounds (block 3, 4 tokens),
  two rows of different prompt lengths: each row's 4-token sequence follows the target's
  distribution and the rows are independent. The confidences depend on the drafted tokens, so
  verify lengths are often cut and differ between the rows (checked on the first round);
  planted bugs this test catches (measured): the confidence read from ``x_k`` instead of
  ``x_{k-1}``, the bonus after a rejection drawn from ``p`` instead of the residual."""
  target = js.testing.tiny_target(5, vocab_size=5)
  target = target.replace(params=jax.tree.map(lambda p: p * 1.5, target.params))
  head = token_dependent_confidence_head(target, block_size=3)
  rows = [np.array([1, 3, 0, 2]), np.array([4, 1])]
  padded, lengths, capacity = decoding._prepare_prompts(target, rows, 4, extra=16)
  sps = jnp.asarray([1.0, 0.9, 0.85, 0.8], jnp.float32)
  sampling = rounds.Sampling(temperature, top_k, top_p)
  round_fn = js.methods.DSpark(verify_length, 0.3)
  loop = functools.partial(
    rounds.speculative_loop,
    capacity=capacity,
    max_new_tokens=4,
    sampling=sampling,
    round_fn=round_fn,
  )

  def first_round_lengths(key):
    state = rounds.start_rounds(
      target, head, padded, lengths, key, capacity=capacity, sampling=sampling
    )
    return round_fn(target, head, state, sampling, sps)[1].verify_len

  first = np.asarray(
    jax.jit(jax.vmap(first_round_lengths))(jax.random.split(jax.random.key(9), 500))
  )
  gamma = head.cfg.max_depth
  assert np.mean(first < gamma) > 0.3, 'verify lengths were rarely cut: truncation went untested'
  assert np.mean(first[:, 0] != first[:, 1]) > 0.2, 'the rows were always cut alike'
  draw = jax.jit(jax.vmap(lambda k: loop(target, head, padded, lengths, k, sps)))
  counts = np.zeros((2, 625))
  joint = np.zeros(25)
  taus = []
  for chunk in range(6):
    keys = jax.random.split(jax.random.key(chunk), 2000)
    tokens, _, tau, num_rounds, _ = jax.device_get(draw(keys))
    taus.append(tau.sum() / num_rounds.sum())
    for r in range(2):
      codes = tokens[:, r, :4] @ np.array([125, 25, 5, 1])
      counts[r] += np.bincount(codes, minlength=625)
    joint += np.bincount(tokens[:, 0, 0] * 5 + tokens[:, 1, 0], minlength=25)
  assert np.mean(taus) > 1.1, 'drafts were rarely accepted: acceptance went untested'
  for r, prompt in enumerate(rows):
    assert_chi_square(counts[r], exact_distribution(target, prompt, 4, temperature, top_k, top_p))
  first = [exact_distribution(target, prompt, 1, temperature, top_k, top_p) for prompt in rows]
  assert_chi_square(joint, np.outer(first[0], first[1]).reshape(-1))


@pytest.mark.parametrize('early_stop, want', [(False, 0.85), (True, 0.7)])
def test_scheduler_without_early_stop_is_biased(early_stop, want):
  """The paper's Appendix A: target (.7, .3), draft (.5, .5), and a confidence for token 2 that
  depends on the drafted token 1. Verifying a token only pays with the one after it, so a search
  over every prefix verifies ``x_1`` exactly when ``x_1 = 0`` (its ``c_2`` is high): P(first
  output = 0) = .5 * 1 + .5 * .7 = .85. The shipped scheduler stops at the first
  non-improvement, decides from ``c_1`` alone, and outputs the target's (.7, .3)."""
  sps = jnp.asarray([1.0, 0.6, 0.6])  # verify widths 1, 2, 3
  p = jnp.log(jnp.asarray([[[0.7, 0.3]] * 3]))  # [1, 3, 2]: the target at every node
  q = jnp.log(jnp.asarray([[[0.5, 0.5]] * 2]))  # [1, 2, 2]

  def first_token(key):
    draft_key, accept_key = jax.random.split(key)
    tokens = jax.random.categorical(draft_key, q).astype(jnp.int32)  # [1, 2]
    c2 = jnp.where(tokens[0, 0] == 0, 0.95, 0.05)
    confidence = jnp.stack([jnp.float32(0.6), c2])[None]
    lengths = dspark.schedule_lengths(confidence, sps, early_stop=early_stop)
    draft = dspark.Draft(tokens, q, confidence, confidence)
    n, bonus = dspark.accept_chain(draft, p, lengths, accept_key, rounds.Sampling(1.0))
    return jnp.where(n[0] >= 1, tokens[0, 0], bonus[0])

  firsts = jax.jit(jax.vmap(first_token))(jax.random.split(jax.random.key(0), 40_000))
  freq = float(jnp.mean(firsts == 0))
  assert abs(freq - want) < 0.01, freq


def test_scheduler_admits_by_survival_and_stops():
  conf = jnp.asarray([[0.9, 0.9, 0.2], [0.5, 0.9, 0.9]])
  flat = jnp.ones((4,))
  np.testing.assert_array_equal(dspark.schedule_lengths(conf, flat), [3, 3])  # free: take all
  costly = jnp.asarray([1.0, 0.7, 0.6, 0.5])
  # Order by survival: (0,1) .9, (0,2) .81, (1,1) .5, (1,2) .45, (1,3) .405, (0,3) .162.
  # tau * sps: 2 -> 2.9 * .7 = 2.03 -> 3.71 * .6 = 2.23 -> 4.21 * .6 = 2.53 -> 4.66 * .6 = 2.80
  # -> 5.065 * .5 = 2.53 (width 4; no improvement: stop).
  np.testing.assert_array_equal(dspark.schedule_lengths(conf, costly), [2, 2])
  np.testing.assert_array_equal(dspark.threshold_lengths(conf, 0.5), [2, 1])
  assert dspark.verify_widths(6) == (1, 2, 4, 7)
  np.testing.assert_array_equal(
    dspark.width_table([1, 2, 3, 4], (1, 2, 4, 7)), [1, 2, 3, 3, 4, 4, 4]
  )


def test_markov_stage_matches_a_plain_loop(target, heads):
  """Token ``k``'s logits are ``U_k + W1[x_{k-1}] W2`` with ``x_{k-1}`` the token drafted
  before it (the anchor for ``k = 1``); greedy takes their argmax, sampling draws from them."""
  head = heads[6]
  hidden = jax.random.normal(jax.random.key(1), (2, 6, target.cfg.hidden_size))
  anchor = jnp.asarray([3, 11], jnp.int32)
  p = head.params
  for temperature in (0.0, 0.7):
    draft = dspark.draft_chain(head, target, hidden, anchor, jax.random.key(2), temperature)
    for b in range(2):
      prev = int(anchor[b])
      for k in range(6):
        u = np.asarray(target.lm_logits(hidden[b, k]), np.float64)
        bias = np.asarray(p['markov']['embed'][prev]) @ np.asarray(p['markov']['proj'])
        logits = u + bias
        if temperature:
          logits = logits / temperature
        np.testing.assert_allclose(np.asarray(draft.logits[b, k]), logits, rtol=1e-5, atol=1e-4)
        z = np.concatenate([np.asarray(hidden[b, k]), np.asarray(p['markov']['embed'][prev])])
        conf = 1 / (1 + np.exp(-(z @ np.asarray(p['confidence']['kernel']))))
        np.testing.assert_allclose(float(draft.confidence[b, k]), conf, rtol=1e-5)
        token = int(draft.tokens[b, k])
        if not temperature:
          assert token == int(np.argmax(logits))
        prev = token


def test_calibration_lowers_the_ece():
  """Logits three times too confident (outcomes drawn with probability sigmoid(l / 3)): the fitted
  temperatures come out near 3 and the held-out ECE of the survival drops."""
  rng = np.random.default_rng(0)
  logits = rng.normal(0.0, 4.0, (8000, 4)) + 2.0
  accepted = rng.random((8000, 4)) < 1 / (1 + np.exp(-logits / 3.0))
  valid = np.ones_like(accepted)
  fit, held = slice(0, 4000), slice(4000, None)
  temps = dspark_calibration.fit_temperatures(logits[fit], accepted[fit], valid[fit])
  assert np.all((temps > 2.0) & (temps < 4.5)), temps
  before = dspark_calibration.survival_ece(logits[held], accepted[held], valid[held], np.ones(4))
  after = dspark_calibration.survival_ece(logits[held], accepted[held], valid[held], temps)
  assert np.all(after < before / 2), (before, after)
  assert dspark_calibration.expected_calibration_error([0.2, 0.8], [0, 1]) == pytest.approx(0.2)


def test_calibration_records_and_round_trip(target, heads, tmp_path):
  """Records from greedy data mark exactly the drafted tokens equal to the data; a calibrated
  head saves and loads with its temperatures and drafts with them."""
  head = heads[3]
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, VOCAB, size=5) for _ in range(4)]
  data_lib.generate_dataset(
    target,
    prompts,
    tmp_path / 'data',
    max_len=40,
    max_new_tokens=30,
    shard_size=4,
    batch_size=4,
    progress=False,
    feature_taps=head.cfg.target_layer_ids,
  )
  source = shards_lib.TokenShards(tmp_path / 'data', max_len=40)
  logits, accepted, valid = dspark_calibration.calibration_records(head, target, source)
  assert logits.shape == accepted.shape == valid.shape == (4 * 16, 3)
  assert valid.sum() > 50 and accepted[valid].mean() > 0.2  # the bigram head drafts well
  temps = dspark_calibration.fit_temperatures(logits, accepted, valid)
  calibrated = head.replace(calibration=jnp.asarray(temps))
  js.save_draft_head(calibrated, tmp_path / 'head')
  loaded = js.load_draft_head(tmp_path / 'head', target)
  assert loaded.cfg == head.cfg and loaded.cfg.kind == 'dspark'
  np.testing.assert_array_equal(np.asarray(loaded.calibration), temps)
  jax.tree.map(np.testing.assert_array_equal, loaded.params, head.params)
  again, _, _ = dspark_calibration.calibration_records(loaded, target, source)
  np.testing.assert_allclose(again, logits, rtol=1e-5, atol=1e-5)  # raw logits, any calibration
  fitted, report = calibrate_head.calibrate(head, target, source, source, 16)
  assert fitted.shape == (3,) and len(report['ece_after']) == 3 and report['eval_blocks'] > 0


def test_wrong_methods_and_settings_are_errors(target, heads, prompts, tmp_path):
  jetspec = js.testing.random_draft_head(target, block_size=4, seed=1)
  with pytest.raises(ValueError, match='cannot run a jetspec head'):
    js.generate(target, jetspec, prompts[0], max_new_tokens=4, method=js.methods.DSpark())
  with pytest.raises(ValueError, match='cannot run a dspark head'):
    js.generate(target, heads[3], prompts[0], max_new_tokens=4, method=js.methods.Tree())
  with pytest.raises(ValueError, match='verify_length'):
    js.methods.DSpark(verify_length='x')
  with pytest.raises(ValueError, match='threshold'):
    js.methods.DSpark(threshold=1.5)
  with pytest.raises(ValueError, match='copy_len'):
    js.methods.from_config(dict(name='dspark', copy_len=4))
  with pytest.raises(ValueError, match='causal=False'):
    dh.config_for_target(target.cfg, causal=True, markov_rank=8)
  with pytest.raises(ValueError, match='must be ascending'):
    js.methods.DSpark(widths=(2, 1))
  prompt, plen, capacity = decoding._prepare_prompt(target, prompts[0], 4, extra=8)
  with pytest.raises(ValueError, match=r'must end at the whole chain, gamma \+ 1 = 4'):
    rounds.speculative_loop(
      target,
      heads[3],
      prompt,
      plen,
      jax.random.key(0),
      capacity=capacity,
      max_new_tokens=4,
      sampling=rounds.Sampling(),
      round_fn=js.methods.DSpark('threshold', 0.0, widths=(1, 2)),
    )
  js.save_draft_head(heads[3], tmp_path)
  cfg_path = tmp_path / 'config.json'
  cfg_path.write_text(cfg_path.read_text().replace('"dspark"', '"medusa"'))
  with pytest.raises(js.CheckpointError, match="unknown head_kind 'medusa'"):
    js.load_draft_head(tmp_path, target)


def test_training_step_learns(target, tmp_path):
  """The DSpark loss trains backbone, Markov stage and confidence: on a fixed batch the loss
  falls and chain accuracy rises; a JetSpec head refuses the DSpark loss."""
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, VOCAB, size=6) for _ in range(4)]
  cfg = dh.config_for_target(
    target.cfg, num_layers=1, block_size=4, causal=False, target_layer_ids=(0, 2), markov_rank=8
  )
  data_lib.generate_dataset(
    target,
    prompts,
    tmp_path,
    max_len=40,
    max_new_tokens=30,
    shard_size=4,
    batch_size=4,
    progress=False,
    feature_taps=cfg.target_layer_ids,
  )
  batch = shards_lib.make_batches(shards_lib.TokenShards(tmp_path, max_len=40), 4, seed=0)[0]
  optimizer = loop_lib.make_optimizer(lr=1e-2, steps=80, warmup_steps=5)
  settings = head_sums.StepSettings(num_anchors=8, loss='dspark', gamma=4.0, loss_chunk=8)
  step = head_step.make_train_step(target, cfg, optimizer, settings, js.sharding.make_mesh(1))
  params = dh.init_head_params(cfg, jax.random.key(0))
  state = loop_lib.init_state(params, optimizer)
  history = []
  for _ in range(80):
    state, metrics = step(state, batch, jax.random.key(5))
    history.append(jax.device_get(metrics))
  assert history[-1]['loss'] < history[0]['loss'] / 2, (history[0]['loss'], history[-1]['loss'])
  assert history[-1]['expected_tau'] > history[0]['expected_tau'] + 0.5
  assert np.abs(np.asarray(state.params['markov']['proj'])).max() > 0  # the Markov stage learned
  jetspec_cfg = dh.config_for_target(
    target.cfg, num_layers=1, block_size=4, target_layer_ids=(0, 2)
  )
  bad = head_step.make_train_step(
    target, jetspec_cfg, optimizer, settings, js.sharding.make_mesh(1)
  )
  with pytest.raises(ValueError, match='cannot train with'):
    bad(
      loop_lib.init_state(dh.init_head_params(jetspec_cfg, jax.random.key(0)), optimizer),
      batch,
      jax.random.key(5),
    )
