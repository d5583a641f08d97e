"""JetSpec++: lossless rounds (greedy == AR with guesses that hit and miss, T > 0 == the
target's distribution), MASK inputs == JetSpec exactly, training on refine and noisy-context
blocks (no leakage, the progressive schedule, the consistency term, exact resume),
released-layout I/O and errors."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax as js
from jetspec_jax import decoding, rounds
from jetspec_jax.methods import jetspecpp
from jetspec_jax.models import draft_head as dh
from jetspec_jax.training import blocks as blocks_lib
from jetspec_jax.training import data as data_lib
from jetspec_jax.training import head_step, head_sums
from jetspec_jax.training import loop as loop_lib
from jetspec_jax.training import shards as shards_lib
from tests.conftest import VOCAB
from tests.test_decoding import assert_chi_square, exact_distribution


@pytest.fixture(scope='module')
def heads(target):
  return {
    bs: js.testing.random_draft_head(target, block_size=bs, seed=2, refine=True) for bs in (3, 6)
  }


@pytest.mark.parametrize(
  'block_size, budget, width, recycle, refine_passes',
  [(6, 12, 3, True, 0), (3, 4, 2, True, 1), (6, 6, 1, True, 0), (6, 12, 3, False, 1)],
)
def test_greedy_jetspecpp_equals_autoregressive(
  target, heads, prompts, ar_outputs, block_size, budget, width, recycle, refine_passes
):
  """Block sizes, budgets, widths, with and without recycled guesses and in-round passes; three
  rows of different lengths in one batch. Recycled guesses both hit (equal the committed token)
  and miss in these runs, so both paths are exercised."""
  outs = js.generate(
    target,
    heads[block_size],
    prompts,
    max_new_tokens=30,
    method=js.methods.JetSpecPP(
      budget=budget, width=width, recycle=recycle, refine_passes=refine_passes
    ),
  )
  totals = dict.fromkeys(jetspecpp.STAT_NAMES, 0)
  for out, want in zip(outs, ar_outputs):
    np.testing.assert_array_equal(out.tokens, want)
    for k, v in out.stats.round_stats.items():
      totals[k] += v
  if recycle:
    assert totals['guess_correct'] > 0, totals  # a guess hit
    assert totals['guess_checked'] > totals['guess_correct'], totals  # and a guess missed
    assert totals['guessed'] >= totals['guess_checked']
  else:
    assert totals == dict.fromkeys(jetspecpp.STAT_NAMES, 0)


def test_eos_stops_like_autoregressive(target, heads, prompts, ar_outputs):
  eos = int(ar_outputs[1][7])
  want = js.generate(
    target, None, prompts[1], max_new_tokens=30, method=js.methods.AR(), eos_id=eos
  )
  got = js.generate(
    target, heads[6], prompts[1], max_new_tokens=30, method=js.methods.JetSpecPP(), eos_id=eos
  )
  np.testing.assert_array_equal(got.tokens, want.tokens)
  assert got.tokens[-1] == eos


def test_mask_inputs_reproduce_jetspec_exactly(target, heads, prompts):
  """With no guess in any slot the JetSpec++ head is a JetSpec head: the same logits bit for
  bit, and ``recycle=False`` decodes exactly as a ``Tree`` of the same shape with the same
  backbone."""
  head = heads[6]
  plain = dh.DraftHead(
    cfg=dataclasses.replace(head.cfg, refine=False), params=dh.backbone_params(head.params)
  )
  assert plain.cfg.kind == 'jetspec'
  width = plain.cfg.num_taps * plain.cfg.hidden_size
  features = jnp.asarray(np.random.default_rng(0).normal(size=(9, width)), jnp.float32)
  cache = head.extend_context(head.make_cache(1, 16), features[None], jnp.array([9]))
  anchor = jnp.array([4], jnp.int32)
  none = jnp.full((1, head.cfg.max_depth), jetspecpp.NO_GUESS, jnp.int32)
  want = plain.propose_cached(target, cache, anchor)
  np.testing.assert_array_equal(head.propose_cached(target, cache, anchor, none), want)
  np.testing.assert_array_equal(head.propose_cached(target, cache, anchor), want)
  guessed = head.propose_cached(target, cache, anchor, jnp.arange(5, dtype=jnp.int32)[None])
  assert not np.allclose(guessed, want)  # guesses do reach the logits
  tree = js.generate(target, plain, prompts, max_new_tokens=24, method=js.methods.Tree(12, 3))
  jpp_method = js.methods.JetSpecPP(budget=12, width=3, recycle=False)
  jpp = js.generate(target, head, prompts, max_new_tokens=24, method=jpp_method)
  for a, b in zip(tree, jpp):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.stats.tau, b.stats.tau)


def test_realign_moves_guesses_to_their_positions():
  guesses = jnp.array([[10, 11, 12, 13]], jnp.int32)  # positions 5..8 (last anchor at 4)
  got = jetspecpp.realign(guesses, jnp.array([2]))  # anchor 6: slots at 7, 8, 9, 10
  np.testing.assert_array_equal(got, [[12, 13, -1, -1]])
  got = jetspecpp.realign(guesses, jnp.array([0]))  # anchor 4 (no round yet): slots at 5..8
  np.testing.assert_array_equal(got, guesses)
  got = jetspecpp.realign(guesses, jnp.array([4]))  # anchor 8: past the old draft
  np.testing.assert_array_equal(got, [[-1, -1, -1, -1]])


@pytest.mark.parametrize('refine_passes', [0, 1])
def test_sampled_jetspecpp_matches_target_distribution(refine_passes):
  """T > 0 over several rounds (block 3: at most 3 tokens a round) and two rows of different
  prompt lengths: each row's 4-token sequence follows the target's distribution and the rows
  are independent, while recycled guesses change the trees from round to round."""
  target = js.testing.tiny_target(5, vocab_size=5)
  target = target.replace(params=jax.tree.map(lambda p: p * 1.5, target.params))
  head = js.testing.random_draft_head(target, block_size=3, seed=6, refine=True)
  rows = [np.array([1, 3, 0, 2]), np.array([4, 1])]
  padded, lengths, capacity = decoding._prepare_prompts(target, rows, 4, extra=16)
  loop = functools.partial(
    rounds.speculative_loop,
    capacity=capacity,
    max_new_tokens=4,
    sampling=rounds.Sampling(1.0),
    round_fn=js.methods.JetSpecPP(budget=5, width=2, refine_passes=refine_passes),
  )
  draw = jax.jit(jax.vmap(lambda k: loop(target, head, padded, lengths, k)))
  counts = np.zeros((2, 625))
  joint = np.zeros(25)
  guessed = 0
  for chunk in range(6):
    tokens, _, tau, num_rounds, stats = jax.device_get(
      draw(jax.random.split(jax.random.key(chunk), 2000))
    )
    guessed += int(stats['guessed'].sum())
    for r in range(2):
      codes = tokens[:, r, :4] @ np.array([125, 25, 5, 1])
      counts[r] += np.bincount(codes, minlength=625)
    joint += np.bincount(tokens[:, 0, 0] * 5 + tokens[:, 1, 0], minlength=25)
  assert guessed > 0, 'no round ever fed a recycled guess'
  for r, prompt in enumerate(rows):
    assert_chi_square(counts[r], exact_distribution(target, prompt, 4, 1.0, 0, 1.0))
  first = [exact_distribution(target, prompt, 1, 1.0, 0, 1.0) for prompt in rows]
  assert_chi_square(joint, np.outer(first[0], first[1]).reshape(-1))


def test_refine_blocks_hide_what_they_must(target):
  """A refine block follows its clean block by the simulated acceptance, holds the clean
  draft's guesses for its positions, and nothing at or after its first draft position (tokens
  or features) reaches its outputs."""
  cfg = dh.config_for_target(
    target.cfg, num_layers=1, block_size=5, target_layer_ids=(0, 2), refine=True
  )
  params = dh.init_head_params(cfg, jax.random.key(1))
  params['draft_embed'] = jnp.ones_like(params['draft_embed'])
  rng = np.random.default_rng(0)
  seq_len = 40
  tokens = jnp.asarray(rng.integers(0, VOCAB, seq_len), jnp.int32)
  loss_mask = jnp.ones((seq_len,), jnp.int32)
  features = jnp.asarray(rng.normal(size=(seq_len, 2 * target.cfg.hidden_size)), jnp.float32)
  clean = blocks_lib.blocks_at(
    jnp.array([3, 20], jnp.int32), jnp.array([True, True]), tokens, loss_mask, seq_len, 5, 0
  )
  # Guesses: block 0 gets its first two right (accept 2: next anchor 3 + 3 = 6), block 1 none.
  wrong = lambda i: (tokens[i] + 1) % VOCAB  # noqa: E731
  guesses = jnp.array([[tokens[4], tokens[5], wrong(6), 2], [wrong(21), 5, 6, 7]], jnp.int32)
  refine = blocks_lib.refine_blocks(clean, guesses, tokens, loss_mask, seq_len, 0)
  np.testing.assert_array_equal(refine.anchors, [6, 21])
  np.testing.assert_array_equal(refine.tokens[0], [tokens[6], 2, 0, 0, 0])  # old guess for 7
  np.testing.assert_array_equal(refine.guessed[0], [False, True, False, False, False])
  np.testing.assert_array_equal(refine.tokens[1], [tokens[21], 5, 6, 7, 0])
  np.testing.assert_array_equal(refine.targets[0], tokens[6:11])
  in_round = blocks_lib.refine_blocks(
    clean, guesses, tokens, loss_mask, seq_len, 0, jnp.array([True, False])
  )
  np.testing.assert_array_equal(in_round.anchors, [3, 21])
  np.testing.assert_array_equal(in_round.tokens[0, 1:], guesses[0])

  out = np.asarray(head_sums.head_block_outputs(params, cfg, target, features, refine))
  later = features.at[6:].add(3.0)
  changed_tokens = tokens.at[7:].set((tokens[7:] + 1) % VOCAB)
  changed = blocks_lib.refine_blocks(clean, guesses, changed_tokens, loss_mask, seq_len, 0)
  np.testing.assert_array_equal(changed.tokens[0], refine.tokens[0])
  got = np.asarray(head_sums.head_block_outputs(params, cfg, target, later, changed))
  np.testing.assert_allclose(got[0], out[0], atol=1e-6)
  assert not np.allclose(got[1], out[1])  # the later block does see those rows


def test_noisy_context_blocks_hide_what_they_must(target):
  """A noisy-context block holds true tokens then the clean draft in its run and MASK after;
  true-token slots have no loss; a slot with a loss sees no tap at or after the anchor and no
  token at or after its own position, yet does see the true tokens before it."""
  bs, seq_len = 6, 40
  cfg = dh.config_for_target(
    target.cfg, num_layers=1, block_size=bs, target_layer_ids=(0, 2), refine=True
  )
  params = dh.init_head_params(cfg, jax.random.key(1))
  params['draft_embed'] = jnp.ones_like(params['draft_embed'])
  rng = np.random.default_rng(1)
  tokens = jnp.asarray(rng.integers(1, VOCAB, seq_len), jnp.int32)
  loss_mask = jnp.ones((seq_len,), jnp.int32)
  features = jnp.asarray(rng.normal(size=(seq_len, 2 * target.cfg.hidden_size)), jnp.float32)
  anchors = jnp.array([4, 20], jnp.int32)
  clean = blocks_lib.blocks_at(anchors, jnp.array([True, True]), tokens, loss_mask, seq_len, bs, 0)
  guesses = jnp.asarray(rng.integers(1, VOCAB, (2, bs - 1)), jnp.int32)
  run, truth = jnp.array([4, 3], jnp.int32), jnp.array([2, 0], jnp.int32)
  noisy = blocks_lib.noisy_context_blocks(clean, guesses, run, truth)
  np.testing.assert_array_equal(
    noisy.tokens[0], [tokens[4], tokens[5], tokens[6], *guesses[0, 2:4], 0]
  )
  np.testing.assert_array_equal(noisy.tokens[1], [tokens[20], *guesses[1, :3], 0, 0])
  np.testing.assert_array_equal(noisy.guessed[0], [False, True, True, True, True, False])
  np.testing.assert_array_equal(noisy.valid[0], [False, False, False, True, True, True])
  np.testing.assert_array_equal(noisy.valid[1], clean.valid[1])
  np.testing.assert_array_equal(noisy.context_mask, clean.context_mask)

  out = np.asarray(head_sums.head_block_outputs(params, cfg, target, features, noisy))
  later = features.at[4:].add(3.0)
  for j in (3, 4, 5):  # the slots of block 0 with a loss
    changed_tokens = tokens.at[4 + j :].set(tokens[4 + j :] % (VOCAB - 1) + 1)
    changed_clean = blocks_lib.blocks_at(
      anchors, jnp.array([True, True]), changed_tokens, loss_mask, seq_len, bs, 0
    )
    changed = blocks_lib.noisy_context_blocks(changed_clean, guesses, run, truth)
    got = np.asarray(head_sums.head_block_outputs(params, cfg, target, later, changed))
    np.testing.assert_allclose(got[0, : j + 1], out[0, : j + 1], atol=1e-6)
  # ... and the true tokens in the run do reach the slots after them.
  earlier = tokens.at[5].set(tokens[5] % (VOCAB - 1) + 1)
  moved = blocks_lib.blocks_at(anchors, jnp.array([True, True]), earlier, loss_mask, seq_len, bs, 0)
  moved = blocks_lib.noisy_context_blocks(moved, guesses, run, truth)
  got = np.asarray(head_sums.head_block_outputs(params, cfg, target, features, moved))
  assert not np.allclose(got[0, 3], out[0, 3])


def test_progressive_noise_ramps_within_windows():
  """Runs in 1..bs-2; the own-draft share of block n is ((n + phase) % w + 1) / w for one phase:
  a ramp from easy to all-own-drafts, repeated every w blocks."""
  run, truth = blocks_lib.progressive_noise(jax.random.key(3), 64, 8, 4)
  run, truth = np.asarray(run), np.asarray(truth)
  assert run.min() == 1 and run.max() == 6
  n = np.arange(64)
  matches = [
    phase
    for phase in range(4)
    if np.array_equal(truth, np.round((1 - ((n + phase) % 4 + 1) / 4) * run).astype(int))
  ]
  assert len(matches) == 1
  assert (truth[(n + matches[0]) % 4 == 3] == 0).all() and (
    truth[(n + matches[0]) % 4 == 0] > 0
  ).all()


@pytest.fixture(scope='module')
def tiny_data(target, tmp_path_factory):
  path = tmp_path_factory.mktemp('jpp_data')
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, VOCAB, size=6) for _ in range(8)]
  data_lib.generate_dataset(
    target,
    prompts,
    path,
    max_len=40,
    max_new_tokens=30,
    shard_size=4,
    batch_size=4,
    progress=False,
    feature_taps=(0, 2),
  )
  return shards_lib.make_batches(shards_lib.TokenShards(path, max_len=40), 4, seed=0)


def test_training_learns_and_resumes_exactly(target, tiny_data, tmp_path):
  """The mixed clean + refine loss trains (``draft_embed`` included) and a killed run resumes
  to the same parameters as an uninterrupted one."""
  cfg = dh.config_for_target(
    target.cfg, num_layers=1, block_size=5, target_layer_ids=(0, 2), refine=True
  )
  optimizer = loop_lib.make_optimizer(lr=3e-3, steps=8, warmup_steps=2)
  settings = head_sums.StepSettings(num_anchors=8, loss='ce', loss_chunk=4, remat=False)

  def run(workdir, **kwargs):
    return head_step.fit(
      target,
      cfg,
      tiny_data,
      str(workdir),
      steps=8,
      optimizer=optimizer,
      settings=settings,
      log_every=2,
      checkpoint_every=2,
      **kwargs,
    )

  full, history = run(tmp_path / 'full')
  assert history[-1]['loss'] < history[0]['loss']
  assert float(jnp.abs(full.params['draft_embed']).sum()) > 0
  stopped, _ = run(tmp_path / 'resumed', stop_after=3)
  assert int(stopped.step) == 3
  resumed, _ = run(tmp_path / 'resumed')
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6),
    resumed.params,
    full.params,
  )


def test_consistency_term_adds_to_the_loss(target, tiny_data):
  """The JetSpec++ loss is the clean + second-block distillation plus the consistency weight
  times a non-negative KL that vanishes for no pair."""
  head = js.testing.random_draft_head(target, block_size=5, seed=4, refine=True)
  cfg, params = head.cfg, head.params
  batch = tiny_data[0]
  tokens = jnp.asarray(batch['tokens'][:1])
  hidden, features = head_sums.target_pass(target, tokens, cfg.target_layer_ids)

  def loss(weight):
    settings = head_sums.StepSettings(
      num_anchors=8, loss='ce', loss_chunk=4, remat=False, consistency_weight=weight
    )
    sums = head_sums.sequence_sums(
      params,
      cfg,
      target,
      jnp.asarray(batch['tokens'][0]),
      jnp.asarray(batch['loss_mask'][0]),
      jnp.asarray(batch['lengths'][0]),
      hidden[0],
      features[0],
      jax.random.key(0),
      settings,
    )
    return float(sums.loss)

  base, half, full = loss(0.0), loss(0.5), loss(1.0)
  assert full > half > base
  np.testing.assert_allclose(full - base, 2 * (half - base), rtol=1e-4)


def test_save_load_and_errors(target, heads, prompts, tmp_path):
  head = heads[3]
  js.save_draft_head(head, tmp_path)
  config = json.loads((tmp_path / 'config.json').read_text())
  assert config['dflash_config']['head_kind'] == 'jetspecpp'
  loaded = js.load_draft_head(tmp_path, target)
  assert loaded.cfg == head.cfg
  np.testing.assert_array_equal(loaded.params['draft_embed'], head.params['draft_embed'])
  jetspec = js.testing.random_draft_head(target, block_size=3, seed=1)
  with pytest.raises(ValueError, match='cannot run a jetspec head'):
    js.generate(target, jetspec, prompts[0], max_new_tokens=4, method=js.methods.JetSpecPP())
  with pytest.raises(ValueError, match='cannot run a jetspecpp head'):
    js.generate(target, head, prompts[0], max_new_tokens=4, method=js.methods.Tree())
  with pytest.raises(ValueError, match='refine_passes'):
    js.generate(
      target, head, prompts[0], max_new_tokens=4, method=js.methods.JetSpecPP(refine_passes=-1)
    )
  with pytest.raises(ValueError, match='only a jetspecpp head'):
    jetspec.propose_cached(
      target, jetspec.make_cache(1, 8), jnp.array([1]), jnp.zeros((1, 2), jnp.int32)
    )
  with pytest.raises(ValueError, match='causal'):
    dh.config_for_target(target.cfg, causal=False, refine=True)
  cfg_path = tmp_path / 'config.json'
  cfg_path.write_text(cfg_path.read_text().replace('"causal_head": true', '"causal_head": false'))
  with pytest.raises(js.CheckpointError, match='causal_head'):
    js.load_draft_head(tmp_path, target)
