"""Guards on the head-training pipeline (issue: heads that accept), and its throughput options.

* the training forward equals the inference path for every head kind, at several anchors;
* a synthetic task whose answer sits only in the last visible context row is learned to >= 0.95
  at every depth, and fails at depth bs-1 when the features are shifted by one row;
* the target-argmax labels, the reduced draft vocabulary (training, lossless drafting, the
  EAGLE-3 ``d2t``/``t2d`` layout), mixed-precision matmuls and held-out metrics in the log.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax as js
from jetspec_jax.models import draft_head as dh
from jetspec_jax.models import head_io, hf_io, matmul
from jetspec_jax.training import blocks as blocks_lib
from jetspec_jax.training import data as data_lib
from jetspec_jax.training import features as features_lib
from jetspec_jax.training import head_step, head_sums, losses
from jetspec_jax.training import loop as loop_lib
from jetspec_jax.training import shards as shards_lib
from tests.conftest import VOCAB

TAPS = (0, 1, 2)
ALPHABET = 8  # the synthetic task's tokens


def random_head(target, kind: str, block_size: int = 5):
  return dh.random_draft_head(
    target,
    block_size=block_size,
    causal=kind != 'dflash',
    num_layers=2,
    target_layer_ids=TAPS,
    markov_rank=4 if kind == 'dspark' else 0,
    refine=kind == 'jetspecpp',
    seed=3,
  )


@pytest.mark.parametrize('kind', ['jetspec', 'dflash', 'dspark', 'jetspecpp'])
def test_training_forward_equals_inference_for_every_head_kind(target, kind):
  """At anchors 3, 11 and 19 of one sequence, the scores the loss sees (one forward over all
  blocks, context K/V shared) equal those ``propose`` drafts with from the same context."""
  head = random_head(target, kind)
  seq_len = 26
  tokens = jnp.asarray(js.testing.random_ids(4, (seq_len,), VOCAB))
  hidden, feats = head_sums.target_pass(target, tokens[None], TAPS)
  anchors = jnp.array([3, 11, 19], jnp.int32)
  span = head.cfg.block_size + int(kind == 'dspark')
  blk = blocks_lib.blocks_at(
    anchors,
    jnp.ones((3,), bool),
    tokens,
    jnp.ones((seq_len,), jnp.int32),
    jnp.int32(seq_len),
    span,
    head.cfg.mask_token_id,
  )
  if kind == 'dspark':  # the DSpark head's inputs are the first bs slots
    _, blk = head_sums.dspark_blocks(
      jax.random.key(0), tokens, jnp.ones((seq_len,)), jnp.int32(seq_len), head.cfg, 3
    )
    blk = blk._replace(tokens=blk.tokens.at[:, 0].set(tokens[anchors]))
    blk = blk._replace(
      positions=anchors[:, None] + jnp.arange(head.cfg.block_size)[None],
      context_mask=jnp.arange(seq_len)[None, None, :] < anchors[:, None, None],
    )
    blk = blk._replace(context_mask=jnp.broadcast_to(blk.context_mask, (3, 5, seq_len)))
  out = head_sums.head_block_outputs(head.params, head.cfg, target, feats[0], blk)
  trained = dh.vocab_logits(target, out if kind == 'dspark' else out[:, 1:])
  for k, a in enumerate(np.asarray(anchors)):
    drafted = head.propose(target, feats[0, :a], tokens[a])
    np.testing.assert_allclose(np.asarray(trained[k]), np.asarray(drafted), atol=2e-4)
  del hidden


def test_training_forward_equals_inference_with_a_draft_vocabulary(target):
  """A reduced draft vocabulary: the loss scores the ids in it; drafting gives the same scores
  at those ids and probability 0 elsewhere."""
  vocab = jnp.array([0, 2, 3, 5, 8, 13, 16], jnp.int32)
  head = random_head(target, 'jetspec').replace(draft_vocab=vocab)
  tokens = jnp.asarray(js.testing.random_ids(5, (20,), VOCAB))
  _, feats = head_sums.target_pass(target, tokens[None], TAPS)
  blk = blocks_lib.blocks_at(
    jnp.array([9]),
    jnp.array([True]),
    tokens,
    jnp.ones((20,)),
    jnp.int32(20),
    5,
    head.cfg.mask_token_id,
  )
  out = head_sums.head_block_outputs(head.params, head.cfg, target, feats[0], blk)
  reduced = dh.vocab_logits(target, out[0, 1:], vocab)
  drafted = head.propose(target, feats[0, :9], tokens[9])
  np.testing.assert_allclose(np.asarray(drafted[:, vocab]), np.asarray(reduced), atol=2e-4)
  outside = np.setdiff1d(np.arange(VOCAB), np.asarray(vocab))
  assert np.all(np.asarray(jax.nn.softmax(drafted, -1))[:, outside] == 0)


def lookahead_batch(rng, batch: int, seq_len: int, block_size: int, width: int, shift: int = 0):
  """Random tokens whose feature row ``j`` holds one-hot codes of ``x_{j+1} .. x_{j+bs}``
  (the last context row a block may read holds all its answers); ``shift`` moves every row
  down by that many positions (a planted misalignment: the row a block may read then lacks the
  deepest answer)."""
  # Tokens 1..8: the bs codes of a row (bs * 8 dims) pass the head's fc (-> hidden_size = 44)
  # without loss, so the task is learnable exactly.
  tokens = rng.integers(1, 1 + ALPHABET, (batch, seq_len + block_size + 1)).astype(np.int32)
  feats = np.zeros((batch, seq_len, width), np.float32)
  for k in range(block_size):
    ahead = tokens[:, 1 + k : 1 + k + seq_len]
    feats[np.arange(batch)[:, None], np.arange(seq_len)[None], k * ALPHABET + ahead - 1] = 4.0
  if shift:
    feats = np.concatenate([np.zeros_like(feats[:, :shift]), feats[:, :-shift]], axis=1)
  return dict(
    tokens=tokens[:, :seq_len],
    loss_mask=np.pad(np.ones((batch, seq_len - 1), np.int32), ((0, 0), (1, 0))),  # a >= 1
    lengths=np.full((batch,), seq_len, np.int32),
    index=np.arange(batch, dtype=np.int32),
    features=feats,
  )


def train_lookahead(target, shift: int, steps: int = 400):
  cfg = dh.config_for_target(target.cfg, num_layers=1, block_size=4, target_layer_ids=TAPS)
  width = (len(TAPS) + 1) * target.cfg.hidden_size  # taps, then the final hidden state
  optimizer = loop_lib.make_optimizer(lr=1e-2, steps=steps, warmup_steps=10)
  settings = head_sums.StepSettings(num_anchors=8, loss='ce', loss_chunk=8, remat=False)
  step = head_step.make_train_step(target, cfg, optimizer, settings, js.sharding.make_mesh(1))
  state = loop_lib.init_state(dh.init_head_params(cfg, jax.random.key(0)), optimizer)
  rng = np.random.default_rng(0)
  for i in range(steps):  # fresh sequences every step: learned, not memorised
    batch = lookahead_batch(rng, 8, 24, cfg.block_size, width, shift)
    state, metrics = step(state, batch, jax.random.key(i))
  evaluate = head_step.make_heldout_eval(
    target, cfg, lookahead_batch(rng, 16, 24, cfg.block_size, width, shift), settings
  )
  return evaluate(state.params)


def test_synthetic_lookahead_is_learned_and_a_one_row_shift_breaks_it(target):
  aligned = train_lookahead(target, shift=0)
  assert np.all(aligned['heldout_accuracy'] >= 0.95), aligned
  shifted = train_lookahead(target, shift=1)
  # The deepest answer is no longer in any visible row: chance is 1/8.
  assert shifted['heldout_accuracy'][-1] < 0.3, shifted
  assert aligned['heldout_expected_tau'] > shifted['heldout_expected_tau'] + 0.5


def test_block_losses_ignore_labels_outside_the_draft_vocabulary(target):
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(2, 4, target.cfg.hidden_size)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, VOCAB, (2, 4)), jnp.int32)
  valid = jnp.ones((2, 4), bool).at[:, 0].set(False)
  kw = dict(lm_head=target.lm_logits, weights=jnp.ones((4,)), chunk=2, loss='ce')
  full = losses.block_losses(hidden, hidden, targets, valid, jnp.ones((2,), bool), **kw)
  outside = targets.at[0, 2].set(-1)
  part = losses.block_losses(hidden, hidden, outside, valid, jnp.ones((2,), bool), **kw)
  logp = jax.nn.log_softmax(target.lm_logits(hidden[0, 2]))
  np.testing.assert_allclose(float(full.loss - part.loss), -float(logp[targets[0, 2]]), rtol=1e-5)
  assert float(full.weight - part.weight) == 1.0
  np.testing.assert_array_equal(part.count, full.count)  # still counted: never right


def test_draft_vocabulary_covers_and_rounds():
  counts = np.zeros(1000)
  counts[:10] = 100
  counts[10:400] = 1
  vocab = dh.draft_vocabulary(counts, 0.7, multiple=8)
  assert len(vocab) == 8 * -(-10 // 8) and np.all(np.diff(vocab) > 0)
  assert counts[dh.draft_vocabulary(counts, 0.99, multiple=1)].sum() >= 0.99 * counts.sum()
  with pytest.raises(ValueError, match='coverage'):
    dh.draft_vocabulary(counts, 1.5)
  # A continued head's own ids stay, even unseen in the new data; frequent ones are added
  own = np.array([999, 500, 3])
  grown = dh.draft_vocabulary(counts, 0.7, multiple=8, include=own)
  assert set(own) <= set(grown) and set(range(10)) <= set(grown)
  assert len(grown) == 16 and np.all(np.diff(grown) > 0)
  with pytest.raises(ValueError, match='include'):
    dh.draft_vocabulary(counts, 0.7, include=[1000])


@pytest.mark.parametrize('method', [js.methods.Tree(), js.methods.DSpark()])
def test_a_draft_vocabulary_head_stays_lossless(target, prompts, ar_outputs, method):
  vocab = jnp.arange(0, VOCAB, 2, dtype=jnp.int32)  # half the ids can never be drafted
  head = random_head(target, method.head_kinds[0])
  head = head.replace(draft_vocab=vocab)
  for prompt, want in zip(prompts, ar_outputs):
    out = js.generate(target, head, prompt, max_new_tokens=30, method=method)
    np.testing.assert_array_equal(out.tokens, want)


def test_draft_vocabulary_round_trips_in_the_eagle3_layout(target, tmp_path):
  vocab = np.array([1, 4, 5, 9, 16], np.int32)
  head = random_head(target, 'jetspec').replace(draft_vocab=jnp.asarray(vocab))
  head_io.save_draft_head(head, tmp_path / 'h')
  tensors = hf_io.read_tensors(tmp_path / 'h')
  np.testing.assert_array_equal(tensors['d2t'], vocab - np.arange(5))
  assert tensors['t2d'].dtype == bool and np.flatnonzero(tensors['t2d']).tolist() == vocab.tolist()
  loaded = head_io.load_draft_head(tmp_path / 'h', target)
  np.testing.assert_array_equal(loaded.draft_vocab, vocab)
  bad = dict(tensors, d2t=tensors['d2t'][::-1].copy())
  hf_io.write_tensors(bad, tmp_path / 'h')
  with pytest.raises(hf_io.CheckpointError, match='d2t'):
    head_io.load_draft_head(tmp_path / 'h', target)


def test_mixed_precision_matmul_and_its_gradients():
  x = jax.random.normal(jax.random.key(0), (3, 5, 12))
  w = jax.random.normal(jax.random.key(1), (12, 4, 7))

  def loss(fn):
    return lambda x, w: jnp.sum(jnp.sin(fn(x, w)))

  mixed = loss(lambda x, w: matmul.matmul(x, w, 1, jnp.bfloat16))
  exact = loss(lambda x, w: jnp.einsum('abk,kcd->abcd', x, w))
  out = matmul.matmul(x, w, 1, jnp.bfloat16)
  want = jnp.einsum('abk,kcd->abcd', x, w)
  assert out.dtype == jnp.float32
  assert 0 < float(jnp.abs(out - want).max()) < 3e-2 * float(jnp.abs(want).max())
  for got, want in zip(jax.grad(mixed, (0, 1))(x, w), jax.grad(exact, (0, 1))(x, w)):
    assert got.dtype == jnp.float32
    err = float(jnp.abs(got - want).max() / jnp.abs(want).max())
    assert 1e-5 < err < 3e-2  # bfloat16 inputs: close, but not the float32 result


def test_bf16_compute_target_is_close_to_float32(target):
  """Mixed-precision matmuls in the target: close to float32, not equal. (Greedy decoding in
  this mode is not bit-identical between the 1-row decode and the multi-row verify: bfloat16
  rounding turns near-ties into different tokens, so it is an option, not the default.)"""
  mixed = target.with_compute_dtype('bfloat16')
  ids = jnp.asarray(js.testing.random_ids(2, (1, 12), VOCAB))
  got, want = mixed.forward_logits(ids), target.forward_logits(ids)
  assert 0 < float(jnp.abs(got - want).max()) < 5e-2
  with pytest.raises(ValueError, match='compute_dtype must be a float dtype name'):
    target.with_compute_dtype('not-a-dtype')


def test_bf16_weight_target_keeps_float32_activations(target):
  """``with_weight_dtype``: bfloat16 weight matrices, float32 norms, activations, cache and
  features; close to the float32 target."""
  narrow = target.with_weight_dtype('bfloat16')
  assert narrow.params['embed_tokens']['embedding'].dtype == jnp.bfloat16
  dtypes = {p.dtype for p in jax.tree.leaves(narrow.params) if p.ndim == 1}
  assert dtypes == {jnp.dtype(jnp.float32)}
  assert narrow.dtype == jnp.float32 and narrow.make_cache(1, 4).dtype == jnp.float32
  ids = jnp.asarray(js.testing.random_ids(2, (1, 12), VOCAB))
  assert narrow.embed(ids).dtype == jnp.float32
  out = narrow.forward(ids, narrow.make_cache(1, 12), taps=(0,))
  assert out.hidden.dtype == out.taps.dtype == jnp.float32
  got, want = narrow.forward_logits(ids), target.forward_logits(ids)
  assert got.dtype == jnp.float32
  assert 0 < float(jnp.abs(got - want).max()) < 5e-2
  assert target.with_weight_dtype('float32').compute_dtype is None
  with pytest.raises(ValueError, match='compute_dtype must be a float dtype name'):
    target.with_weight_dtype('int8')
  # Split inputs: the same bfloat16 weights, nearer the float32 target than rounded inputs.
  split = target.with_weight_dtype('bfloat16', split_inputs=True)
  assert split.compute_dtype == matmul.SPLIT
  exact_inputs = target.replace(params=narrow.params, activation_dtype='float32')  # f32 dots
  ref = exact_inputs.forward_logits(ids)
  split_err = float(jnp.abs(split.forward_logits(ids) - ref).max())
  assert split_err < 0.1 * float(jnp.abs(got - ref).max())
  with pytest.raises(ValueError, match='split_inputs takes bfloat16'):
    target.with_weight_dtype('float16', split_inputs=True)


def test_prefill_compute_mode_is_the_prompt_forward_only(target, prompts):
  """``with_prefill_compute_dtype``: the prompt's forward runs as the rounded-input target's
  (same cache, same first logits), decode steps and verifies as the split-input target's; a
  greedy tree then equals this target's AR, which reads the same prefill."""
  split = target.with_weight_dtype('bfloat16', split_inputs=True)
  mixed = split.with_prefill_compute_dtype('bfloat16')
  rounded = target.with_weight_dtype('bfloat16')
  assert mixed.for_prefill().compute_dtype == 'bfloat16' and split.for_prefill() is split
  ids = jnp.asarray(prompts[2][None])
  lens = jnp.asarray([ids.shape[1]], jnp.int32)
  run = lambda t: js.rounds.prefill(t, ids, lens, 32)
  (cache, logits, _), (want_cache, want_logits, _) = run(mixed), run(rounded)
  np.testing.assert_array_equal(logits, want_logits)
  for got, want in zip(cache.k, want_cache.k, strict=True):
    np.testing.assert_array_equal(got, want)
  assert not np.array_equal(logits, run(split)[1])
  head = random_head(mixed, 'jetspec')
  for prompt in prompts:
    ar = js.generate(mixed, None, prompt, max_new_tokens=20, method=js.methods.AR())
    tree = js.generate(mixed, head, prompt, max_new_tokens=20, method=js.methods.Tree())
    np.testing.assert_array_equal(tree.tokens, ar.tokens)
  with pytest.raises(ValueError, match='compute_dtype must be a float dtype name'):
    split.with_prefill_compute_dtype('int8')


@pytest.fixture(scope='module')
def shards(target, tmp_path_factory):
  path = tmp_path_factory.mktemp('shards')
  prompts = [js.testing.random_ids(20 + i, (5 + i,), VOCAB) for i in range(6)]
  kw = dict(max_len=30, max_new_tokens=20, shard_size=3, batch_size=3, progress=False)
  data_lib.generate_dataset(target, prompts[:3], path / 'greedy', **kw)
  data_lib.generate_dataset(target, prompts[3:], path / 'sampled', temperature=1.0, **kw)
  features = tmp_path_factory.mktemp('features')
  features_lib.compute_features(target, path, features, TAPS, batch_size=2, progress=False)
  return path, features


def test_target_argmax_labels(target, shards):
  """Labels are the target's greedy next token at every position: on greedy sequences the
  data's own tokens, on sampled ones what greedy drafting should predict there."""
  path, features = shards
  source = shards_lib.TokenShards(path, max_len=30, features_dir=features, target_labels=True)
  greedy_differs = 0
  for i in range(len(source)):
    item = source[i]
    n = int(item['lengths'])
    logits = target.forward_logits(jnp.asarray(item['tokens'][None, :n]))[0]
    want = np.asarray(jnp.argmax(logits, -1))[: n - 1]
    np.testing.assert_array_equal(item['labels'][1:n], want)
    response = item['loss_mask'][1:n] > 0
    same = item['labels'][1:n][response] == item['tokens'][1:n][response]
    if i < 3:
      assert same.all()  # greedy data: the label is the data's token
    else:
      greedy_differs += int((~same).sum())
  assert greedy_differs > 0  # sampled data: the labels are not the sampled tokens
  greedy = shards_lib.TokenShards(
    path, max_len=30, features_dir=features, target_labels=True, subdir='greedy'
  )
  np.testing.assert_array_equal(greedy[2]['labels'], source[2]['labels'])
  assert len(greedy) == 3
  with pytest.raises(FileNotFoundError, match='label'):
    shards_lib.TokenShards(path, max_len=30, target_labels=True)


def test_heldout_metrics_are_logged_beside_training_ones(target, shards, tmp_path):
  path, features = shards
  cfg = dh.config_for_target(target.cfg, num_layers=1, block_size=4, target_layer_ids=TAPS)
  source = shards_lib.TokenShards(path, max_len=30, features_dir=features, target_labels=True)
  items = [source[i] for i in range(3)]
  heldout = {k: np.stack([it[k] for it in items]) for k in items[0]}
  heldout['index'] = np.arange(3, dtype=np.int32)
  settings = head_sums.StepSettings(num_anchors=4, loss='ce', loss_chunk=4, remat=False)
  vocab = dh.draft_vocabulary(source.response_token_counts(VOCAB), 0.9, multiple=1)
  evaluate = head_step.make_heldout_eval(target, cfg, heldout, settings, vocab)
  head_step.fit(
    target,
    cfg,
    shards_lib.make_batches(source, 2, seed=0),
    str(tmp_path),
    steps=4,
    optimizer=loop_lib.make_optimizer(lr=1e-3, steps=4, warmup_steps=1),
    settings=settings,
    log_every=2,
    checkpoint_every=4,
    draft_vocab=vocab,
    evaluate=evaluate,
    eval_every=2,
  )
  records = [json.loads(x) for x in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in records] == [2, 4]
  for r in records:
    assert 0.0 <= r['heldout_accuracy/depth1'] <= 1.0 and r['heldout_expected_tau'] >= 1.0
    assert 'accuracy/depth3' in r and 'heldout_accuracy/depth3' in r


def test_throughput_benchmark_variants():
  from experiments.tasks import training_throughput

  assert training_throughput.parse_variant('full') == (0.0, None)
  assert training_throughput.parse_variant('vocab99+bf16') == (0.99, 'bfloat16')
  assert training_throughput.parse_variant('vocab995') == (0.995, None)
  with pytest.raises(ValueError, match='unknown variant'):
    training_throughput.parse_variant('vocab')


def test_mixed_precision_matmul_rows_do_not_depend_on_the_row_count():
  """A decode step's one row and the same row inside a verify's 16 give the same bits
  (``matmul.MIN_ROWS`` padding); the tied-LM-head form equals the transposed product."""
  if 'amx_bf16' not in pathlib.Path('/proc/cpuinfo').read_text():
    pytest.skip('row invariance of the bfloat16 dot is a measured property of AMX CPUs')
  x = jax.random.normal(jax.random.key(0), (16, 576))
  w = jax.random.normal(jax.random.key(1), (576, 192))
  full = np.asarray(matmul.matmul(x, w, 1, jnp.bfloat16))
  for rows in (1, 2, 3, 9):
    got = np.asarray(matmul.matmul(x[:rows], w, 1, jnp.bfloat16))
    np.testing.assert_array_equal(got, full[:rows])
  split = np.asarray(matmul.matmul(x, w, 1, matmul.SPLIT))
  np.testing.assert_array_equal(np.asarray(matmul.matmul(x[:1], w, 1, matmul.SPLIT)), split[:1])
  exact = np.asarray(x @ w.astype(jnp.bfloat16).astype(jnp.float32))
  assert np.abs(split - exact).max() < 0.01 * np.abs(full - exact).max()
  table = jax.random.normal(jax.random.key(2), (300, 576))
  scores = matmul.matmul_rows(x[None, :2], table)
  assert scores.shape == (1, 2, 300) and scores.dtype == jnp.float32
  np.testing.assert_allclose(scores[0], matmul.matmul(x[:2], table.T, 1), rtol=1e-5, atol=1e-4)
  with pytest.raises(ValueError, match='cannot score'):
    matmul.matmul_rows(x[:, :5], table)
