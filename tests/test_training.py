"""Draft-head training: blocks and masks, losses, the data-parallel step, resume, end to end."""

import functools
import json
import logging as py_logging
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from absl import logging as absl_logging
from etils.epath import testing as etils_testing

import jetspec_jax as js
from experiments.configs.train import draft_tiny
from experiments.tasks import generate_data, heldout
from jetspec_jax.models import draft_head as dh
from jetspec_jax.training import blocks as blocks_lib
from jetspec_jax.training import (
  copy_baseline,
  head_step,
  head_sums,
  head_trainer,
  loop,
  losses,
  prompt_io,
  run_config,
  walk,
)
from jetspec_jax.training import data as data_lib
from jetspec_jax.training import features as features_lib
from jetspec_jax.training import loop as loop_lib
from jetspec_jax.training import shards as shards_lib

VOCAB = 97


@pytest.fixture(scope='module')
def target():
  return js.testing.tiny_target(0, vocab_size=VOCAB)


@pytest.fixture(scope='module')
def head_cfg(target):
  return dh.config_for_target(target.cfg, num_layers=1, block_size=6, target_layer_ids=(0, 2))


@pytest.fixture(scope='module')
def dataset(target, tmp_path_factory):
  path = tmp_path_factory.mktemp('data')
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, VOCAB, size=rng.integers(4, 10)) for _ in range(24)]
  data_lib.generate_dataset(
    target, prompts, path, max_len=40, max_new_tokens=30, shard_size=8, batch_size=8, progress=False
  )
  return path, prompts


def test_blocks_targets_and_validity():
  tokens = jnp.arange(10, 20)
  loss_mask = jnp.array([0, 0, 0, 1, 1, 1, 1, 1, 0, 0])  # response at 3..7, length 9
  blk = blocks_lib.make_blocks(
    jax.random.key(0),
    tokens,
    loss_mask,
    jnp.int32(9),
    num_anchors=8,
    block_size=4,
    mask_token_id=99,
  )
  keep = np.asarray(blk.keep)
  assert sorted(np.asarray(blk.anchors)[keep].tolist()) == [3, 4, 5, 6]  # a and a+1 in response
  assert keep.sum() == 4 and (np.asarray(blk.anchors)[~keep] == 0).all()
  for k in np.flatnonzero(keep):
    a = int(blk.anchors[k])
    assert np.asarray(blk.tokens[k]).tolist() == [10 + a, 99, 99, 99]
    assert np.asarray(blk.positions[k]).tolist() == [a, a + 1, a + 2, a + 3]
    # Slot i is valid iff 1 <= i and a + i <= 7 (last response token), cut at the first gap.
    want = [0] + [1 if a + i <= 7 else 0 for i in (1, 2, 3)]
    assert np.asarray(blk.valid[k]).astype(int).tolist() == want
    np.testing.assert_array_equal(
      np.asarray(blk.targets[k])[np.asarray(blk.valid[k])], 10 + a + np.flatnonzero(want)
    )
    ctx = np.asarray(blk.context_mask[k, 0])
    assert ctx[:a].all() and not ctx[a:].any()  # strictly before the anchor
  assert not np.asarray(blk.valid)[~keep].any() and not np.asarray(blk.context_mask)[~keep].any()


def test_anchor_sampling_is_uniform_without_replacement():
  loss_mask = jnp.ones((12,), jnp.int32)
  counts = np.zeros(12)
  for seed in range(400):
    anchors, keep = blocks_lib.sample_anchors(jax.random.key(seed), loss_mask, jnp.int32(12), 3)
    a = np.asarray(anchors)[np.asarray(keep)]
    assert len(set(a.tolist())) == 3 and (np.diff(a) > 0).all()
    counts[a] += 1
  assert counts[11] == 0  # a + 1 must exist
  assert counts[:11].min() > 0.6 * counts[:11].mean()


def test_no_leakage_from_later_context_or_other_blocks(target, head_cfg):
  """A block's outputs (hence its loss) ignore taps at positions >= its anchor and other blocks."""
  params = dh.init_head_params(head_cfg, jax.random.key(1))
  rng = np.random.default_rng(0)
  seq_len = 30
  tokens = jnp.asarray(rng.integers(0, VOCAB, seq_len), jnp.int32)
  loss_mask = jnp.ones((seq_len,), jnp.int32)
  features = jnp.asarray(rng.normal(size=(seq_len, 2 * target.cfg.hidden_size)), jnp.float32)
  blk = blocks_lib.make_blocks(
    jax.random.key(3),
    tokens,
    loss_mask,
    jnp.int32(seq_len),
    num_anchors=4,
    block_size=6,
    mask_token_id=head_cfg.mask_token_id,
  )
  out = np.asarray(head_sums.head_block_outputs(params, head_cfg, target, features, blk))
  anchors = np.asarray(blk.anchors)
  k = 1
  later = features.at[anchors[k] :].add(3.0)  # the anchor's own row and everything after
  changed = np.asarray(head_sums.head_block_outputs(params, head_cfg, target, later, blk))
  np.testing.assert_allclose(changed[k], out[k], atol=1e-6)
  assert not np.allclose(changed[-1], out[-1])  # a later block does see those rows
  other = blk._replace(tokens=blk.tokens.at[k + 1, 0].set((blk.tokens[k + 1, 0] + 1) % VOCAB))
  changed = np.asarray(head_sums.head_block_outputs(params, head_cfg, target, features, other))
  np.testing.assert_allclose(changed[k], out[k], atol=1e-6)
  assert not np.allclose(changed[k + 1], out[k + 1])


def test_losses_fkl_zero_at_teacher_and_ce_matches_formula(target):
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(4, 5, target.cfg.hidden_size)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, VOCAB, (4, 5)), jnp.int32)
  valid = jnp.ones((4, 5), bool).at[:, 0].set(False)
  keep = jnp.ones((4,), bool)
  kw = dict(lm_head=target.lm_logits, weights=jnp.ones((5,)), chunk=2)
  same = losses.block_losses(hidden, hidden, targets, valid, keep, loss='fkl', **kw)
  assert abs(float(same.loss)) < 1e-5 and int(same.count.sum()) == 16
  assert int(same.correct.sum()) == 16 and float(same.accepted) == 16.0
  ce = losses.block_losses(hidden, hidden, targets, valid, keep, loss='ce', **kw)
  logp = jax.nn.log_softmax(target.lm_logits(hidden), -1)
  want = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0][:, 1:].sum()
  np.testing.assert_allclose(float(ce.loss), float(want), rtol=1e-5)
  weights = blocks_lib.depth_weights(5, 2.0)
  np.testing.assert_allclose(
    np.asarray(weights), [1, 1, np.exp(-0.5), np.exp(-1), np.exp(-1.5)], rtol=1e-6
  )


def make_step_inputs(dataset, global_batch=4):
  source = shards_lib.TokenShards(dataset[0], max_len=40)
  return source, shards_lib.make_batches(source, global_batch, seed=0)


def test_overfits_a_fixed_batch(target, head_cfg, dataset):
  """Same batch, same anchors every step: the loss falls by a large factor, accuracy rises."""
  _, batches = make_step_inputs(dataset)
  batch = batches[0]
  optimizer = loop_lib.make_optimizer(lr=1e-2, steps=150, warmup_steps=5)
  settings = head_sums.StepSettings(num_anchors=8, loss='ce', loss_chunk=8)
  step = head_step.make_train_step(target, head_cfg, optimizer, settings, js.sharding.make_mesh(1))
  state = loop_lib.init_state(dh.init_head_params(head_cfg, jax.random.key(0)), optimizer)
  key = jax.random.key(5)
  history = []
  for _ in range(150):
    state, metrics = step(state, batch, key)
    history.append(jax.device_get(metrics))
  first, last = history[0], history[-1]
  assert last['loss'] < first['loss'] / 5, (first['loss'], last['loss'])
  assert last['accuracy'].mean() > first['accuracy'].mean() + 0.3
  assert last['expected_tau'] > first['expected_tau'] + 1.0


def run_training(target, head_cfg, batches, workdir, **kwargs):
  optimizer = loop_lib.make_optimizer(lr=3e-3, steps=12, warmup_steps=2)
  settings = head_sums.StepSettings(num_anchors=8, loss='fkl', loss_chunk=8)
  return head_step.fit(
    target,
    head_cfg,
    batches,
    str(workdir),
    steps=12,
    optimizer=optimizer,
    settings=settings,
    seed=0,
    log_every=4,
    checkpoint_every=4,
    **kwargs,
  )


def test_kill_and_resume_equals_uninterrupted(target, head_cfg, dataset, tmp_path):
  _, batches = make_step_inputs(dataset)
  full, _ = run_training(target, head_cfg, batches, tmp_path / 'full')
  stopped, _ = run_training(target, head_cfg, batches, tmp_path / 'resumed', stop_after=5)
  assert int(stopped.step) == 5
  resumed, _ = run_training(target, head_cfg, batches, tmp_path / 'resumed')
  assert int(resumed.step) == 12
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6),
    resumed.params,
    full.params,
  )
  lines = (tmp_path / 'resumed' / 'metrics.jsonl').read_text().splitlines()
  assert [json.loads(x)['step'] for x in lines] == [4, 5, 8, 12]
  assert list((tmp_path / 'full' / 'tensorboard').iterdir())


def test_nan_guard(target, head_cfg, dataset, tmp_path):
  _, batches = make_step_inputs(dataset)
  bad = jax.tree.map(lambda p: p * jnp.nan, dh.init_head_params(head_cfg, jax.random.key(0)))
  with pytest.raises(FloatingPointError, match='non-finite loss .* at step 0'):
    run_training(target, head_cfg, batches, tmp_path, init_params=bad)


def test_two_device_step_equals_single_device(dataset):
  """On 2 fake CPU devices the data-parallel, FSDP and tensor-parallel steps (the last with
  micro-batches and anchor chunks) equal the 1-device step on the same global batch."""
  script = f'''
import os
flags = os.environ.get("XLA_FLAGS", "")  # the suite flags, plus the devices
os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=2"
import jax, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
import jetspec_jax as js
from jetspec_jax.models import draft_head as dh
from jetspec_jax.training import shards as shards_lib, head_step, head_sums, loop as loop_lib
assert jax.device_count() == 2
target = js.testing.tiny_target(0, vocab_size={VOCAB})
cfg = dh.config_for_target(target.cfg, num_layers=1, block_size=6, target_layer_ids=(0, 2))
batches = shards_lib.make_batches(shards_lib.TokenShards("{dataset[0]}", max_len=40), 4, seed=0)
opt = loop_lib.make_optimizer(lr=3e-3, steps=10, warmup_steps=1)
settings = head_sums.StepSettings(num_anchors=8, loss="fkl", loss_chunk=8)
import dataclasses
results = []
# (data, model, fsdp, micro_batches, anchor_chunk): data parallel, FSDP, tensor parallel with
# accumulated micro-batches and chunked anchors; all compute the 1-device step.
for data, model, fsdp, micro, chunk in ((1, 1, False, 1, 0), (2, 1, False, 1, 0),
                                        (2, 1, True, 1, 0), (1, 2, False, 2, 4)):
  mesh = js.sharding.make_mesh(data, model)
  s = dataclasses.replace(settings, micro_batches=micro, anchor_chunk=chunk)
  step = head_step.make_train_step(target, cfg, opt, s, mesh, fsdp=fsdp)
  state = loop_lib.init_state(dh.init_head_params(cfg, jax.random.key(0)), opt)
  state = jax.device_put(state, step.state_shardings(state))
  for i in range(3):
    state, metrics = step(state, batches[i], jax.random.key(i))
    jax.block_until_ready(state)
  leaf = jax.tree.leaves(state.params)[0]
  results.append((jax.device_get(state.params), float(metrics["loss"]), leaf.sharding.spec))
(p1, l1, _), *others = results
for p2, l2, spec in others:
  assert abs(l1 - l2) < 1e-5, (l1, l2)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), p1, p2)
assert "data" in str(results[2][2]), results[2][2]  # FSDP split the head over 'data'
print("OK", [r[1] for r in results])
'''
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  out = subprocess.run(
    [sys.executable, '-c', script], capture_output=True, text=True, env=env, timeout=600
  )
  assert out.returncode == 0 and 'OK' in out.stdout, out.stderr[-3000:]


def test_data_generation_resumes(target, dataset, tmp_path):
  path, prompts = dataset
  shards = sorted(path.glob('shard_*.npz'))
  assert len(shards) == 3
  first = np.load(shards[0])
  assert first['tokens'].shape == (8, 40) and first['loss_mask'].dtype == np.uint8
  n = len(prompts[0])
  assert first['loss_mask'][0, :n].sum() == 0 and first['loss_mask'][0, n] == 1
  # The response is the target's own greedy continuation.
  want = js.generate(target, None, prompts[0], max_new_tokens=30, method=js.methods.AR()).tokens
  np.testing.assert_array_equal(first['tokens'][0, n : n + len(want)], want[: 40 - n])
  # Resume: only the missing shard is regenerated, identically.
  copy = tmp_path / 'copy'
  copy.mkdir()
  for s in shards[:2]:
    (copy / s.name).write_bytes(s.read_bytes())
  before = {s.name: (copy / s.name).stat().st_mtime_ns for s in shards[:2]}
  data_lib.generate_dataset(
    target, prompts, copy, max_len=40, max_new_tokens=30, shard_size=8, batch_size=8, progress=False
  )
  assert {s.name: (copy / s.name).stat().st_mtime_ns for s in shards[:2]} == before
  np.testing.assert_array_equal(
    np.load(copy / shards[2].name)['tokens'], np.load(shards[2])['tokens']
  )


def test_a_url_data_directory_and_export_go_through_epath(target, dataset, tmp_path, monkeypatch):
  """Shards, prompt files and the exported head at ``gs://`` URLs: the file system is mocked
  (etils.epath's test backend, ``gs://`` mapped to a local root), and nothing may be written
  where pathlib would put a mangled ``gs:/bucket`` (under the working directory)."""
  root = tmp_path / 'gcs'
  local = lambda p: str(p).replace('gs://', f'{root}/', 1)
  url = lambda p: str(p).replace(f'{root}/', 'gs://', 1)
  one = lambda fn, path, *a, **k: fn(local(path), *a, **k)
  two = lambda fn, src, dst, *a, **k: fn(local(src), local(dst), *a, **k)
  glob = lambda fn, pattern: [url(p) for p in fn(local(pattern))]

  def walk(fn, top, **kw):
    for where, dirs, files in fn(local(top), **kw):
      yield url(where), dirs, files

  calls = {n: one for n in ('open', 'exists', 'isdir', 'listdir', 'makedirs', 'mkdir', 'stat')}
  calls.update(remove=one, rmtree=one, rename=two, replace=two, copy=two, glob=glob, walk=walk)
  monkeypatch.chdir(tmp_path)
  path, prompts = dataset
  (root / 'bucket').mkdir(parents=True)
  lines = [json.dumps({'prompt_ids': [int(t) for t in p]}) for p in prompts[:4]]
  (root / 'bucket' / 'prompts.jsonl').write_text('\n'.join(lines))
  head = js.testing.random_draft_head(target, block_size=5, seed=2)
  with etils_testing.mock_epath(**calls):
    read = prompt_io.read_prompts_jsonl('gs://bucket/prompts.jsonl')
    written = data_lib.generate_dataset(
      target, read, 'gs://bucket/data/greedy', max_len=40, max_new_tokens=30, shard_size=2,
      batch_size=2, progress=False,
    )  # fmt: skip
    assert [str(p) for p in written] == [
      'gs://bucket/data/greedy/shard_00000.npz',
      'gs://bucket/data/greedy/shard_00001.npz',
    ]
    assert [str(p) for p in shards_lib.shard_paths('gs://bucket/data')] == [str(p) for p in written]
    source = shards_lib.TokenShards('gs://bucket/data', max_len=40)
    js.save_draft_head(head, 'gs://bucket/run/export')
  assert not (tmp_path / 'gs:').exists()  # nothing went through pathlib
  local_shards = shards_lib.TokenShards(root / 'bucket' / 'data', max_len=40)
  np.testing.assert_array_equal(source.tokens, local_shards.tokens)
  # The same greedy answers as the local dataset's first 4 prompts.
  np.testing.assert_array_equal(source.tokens, shards_lib.TokenShards(path, max_len=40).tokens[:4])
  loaded = js.load_draft_head(root / 'bucket' / 'run' / 'export', target)
  jax.tree.map(np.testing.assert_array_equal, loaded.params, head.params)


def test_prompts_from_jsonl(tmp_path):
  path = tmp_path / 'p.jsonl'
  path.write_text('{"prompt_ids": [1, 2, 3]}\n\n{"prompt": "ab"}\n')
  with pytest.raises(ValueError, match='no tokenizer'):
    prompt_io.read_prompts_jsonl(path)
  prompts = prompt_io.read_prompts_jsonl(path, tokenize=lambda s: [ord(c) for c in s])
  assert [p.tolist() for p in prompts] == [[1, 2, 3], [97, 98]]


CONVERSATIONS = [  # the chat layout (a system turn, two answered user turns) and ShareGPT's
  {
    'messages': [
      {'role': 'system', 'content': 'Be brief.'},
      {'role': 'user', 'content': 'hello world'},
      {'role': 'assistant', 'content': 'hi'},
      {'role': 'user', 'content': 'def add(a, b):'},
      {'role': 'assistant', 'content': 'return a + b'},
    ]
  },
  {'conversations': [{'from': 'human', 'value': "It's 3.14"}, {'from': 'gpt', 'value': 'ok'}]},
  {'conversations': [{'from': 'human', 'value': 'café?'}]},  # no answer yet: one prompt
  {'prompt_ids': [5, 6, 7]},
]
CHAT_TEMPLATE = (
  '{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}'
  '{% if add_generation_prompt %}<assistant>{% endif %}'
)


def test_conversation_prompts_from_jsonl(tmp_path):
  """One prompt per assistant turn (the turns before it), chat and ShareGPT layouts; bad records
  are errors naming the line."""
  path = tmp_path / 'c.jsonl'
  path.write_text('\n'.join(json.dumps(r) for r in CONVERSATIONS) + '\n')
  seen = []
  chat = lambda messages: seen.append(messages) or [len(seen)]  # noqa: E731
  prompts = prompt_io.read_prompts_jsonl(path, chat=chat)
  assert [p.tolist() for p in prompts] == [[1], [2], [3], [4], [5, 6, 7]]
  system, user1, _, user2, _ = CONVERSATIONS[0]['messages']
  assert seen == [
    [system, user1],
    CONVERSATIONS[0]['messages'][:4],
    [{'role': 'user', 'content': "It's 3.14"}],
    [{'role': 'user', 'content': 'café?'}],
  ]
  assert user2['role'] == 'user'
  with pytest.raises(ValueError, match='c.jsonl:1 is a conversation but no chat template'):
    prompt_io.read_prompts_jsonl(path)
  for line, match in [
    ('{"conversations": [{"from": "robot", "value": "x"}]}', r'bad.jsonl:1, turn 0: want'),
    ('{"messages": []}', 'not a non-empty list'),
    ('{"text": "x"}', 'none of "prompt_ids", "prompt", "messages"'),
    ('[1, 2]', 'not a JSON object'),
    ('{"prompt": ', 'is not JSON'),
  ]:
    (tmp_path / 'bad.jsonl').write_text(line + '\n')
    with pytest.raises(ValueError, match=match):
      prompt_io.read_prompts_jsonl(tmp_path / 'bad.jsonl', chat=chat)
  with pytest.raises(FileNotFoundError, match='prompt file'):
    prompt_io.read_prompts_jsonl(tmp_path / 'missing.jsonl')


def test_generate_data_and_train_from_jsonl_conversations(tmp_path):
  """generate_data on a JSONL of conversations with a GGUF target: its own chat template formats
  the prompts, its end-of-turn id stops the answers, greedy and sampled; train_draft reads the
  file the same way."""
  from tests.test_tokenizer import tiny_gguf_with_tokenizer

  gguf_path = tiny_gguf_with_tokenizer(tmp_path / 'tiny.gguf', 'gpt2')
  writer_meta = js.gguf_io.read_metadata(gguf_path)
  assert 'tokenizer.chat_template' not in writer_meta
  # The same file with a chat template: written again with it.
  from tests.test_gguf import TINY_LLAMA, random_llama_tensors
  from tests.test_tokenizer import byte_level_vocab

  tokens, merges = byte_level_vocab()
  cfg = dict(TINY_LLAMA, vocab_size=len(tokens))
  meta = {
    'tokenizer.ggml.model': 'gpt2',
    'tokenizer.ggml.pre': 'gpt2',
    'tokenizer.ggml.tokens': tokens,
    'tokenizer.ggml.merges': merges,
    'tokenizer.ggml.token_type': [1] * (len(tokens) - 1) + [3],
    'tokenizer.ggml.eos_token_id': len(tokens) - 1,
    'tokenizer.chat_template': CHAT_TEMPLATE,
  }
  js.gguf_io.write_gguf(gguf_path, cfg, random_llama_tensors(cfg), tokenizer_metadata=meta)
  prompts_path = tmp_path / 'conversations.jsonl'
  prompts_path.write_text('\n'.join(json.dumps(r) for r in CONVERSATIONS[:3] * 3) + '\n')
  config = draft_tiny.get_config()
  config.target.path = str(gguf_path)
  config.head.target_layer_ids = (0, 1)
  config.data.update(prompts=str(prompts_path), num_prompts=0, max_new_tokens=6, max_len=96)
  config.data.update(shard_size=4, generate_batch=4, sampled_every=3, top_p=1.0)
  config.data.temperature = 1.0
  paths = generate_data.run(config, str(tmp_path / 'gen'))
  tokenizer = js.load_tokenizer(gguf_path)
  want = [tokenizer.apply_chat_template(m) for r in CONVERSATIONS[:3] * 3
          for m in prompt_io.turn_prompts(prompt_io.conversation_messages(r))]  # fmt: skip
  assert {p.parent.name for p in paths} == {'greedy', 'sampled'}
  got, eos = [], tokenizer.eos_ids
  for path in paths:
    shard = np.load(path)
    for row, mask, length in zip(shard['tokens'], shard['loss_mask'], shard['lengths']):
      got.append(row[: int(np.argmax(mask))].tolist())
      response = row[:length][mask[:length] == 1]
      assert 1 <= len(response) <= 6 and not np.isin(response[:-1], list(eos)).any()
  assert len(got) == len(want) == 12
  assert sorted(got) == sorted(want)
  assert tokenizer.decode(want[1]).startswith('<system>Be brief.\n<user>hello world\n<assistant>hi')
  # train_draft reads the same file the same way (its evaluation prompts and data fallback).
  load = functools.partial(run_config.tokenizer_for, config.target)
  again = prompt_io.prompts_from_config(config.data, cfg['vocab_size'], load)
  assert [p.tolist() for p in again] == want
  # One read gives both the prompts and their stop ids (the tokenizer's end of turn).
  read, stops = prompt_io.prompts_and_stops(config.data, cfg['vocab_size'], load)
  assert [p.tolist() for p in read] == want and stops == tokenizer.eos_ids
  assert prompt_io.prompts_and_stops(draft_tiny.get_config().data, 97, load)[1] is None
  config.data.max_prompt_len = 30  # longer prompts are dropped
  assert len(prompt_io.prompts_from_config(config.data, cfg['vocab_size'], load)) < len(want)


def test_train_draft_logs_heldout_metrics_beside_the_copy_baseline(tmp_path):
  """With ``data.sampled_every`` the data splits into greedy/ and sampled/; the first greedy shard
  is held out, its metrics are logged, and the copy baseline on it lands in result.json."""
  config = draft_tiny.get_config('runlocal')
  config.data.update(sampled_every=4, shard_size=8, top_p=1.0)
  config.eval.update(heldout_shards=1, heldout_sequences=4, heldout_anchors=8, heldout_every=5)
  config.eval.update(num_prompts=1, max_new_tokens=8)
  config.eval.heldout_subdirs = ('sampled', 'round2/greedy')  # a second set; one not there
  config.train.update(steps=10, log_every=5, checkpoint_every=10)
  head_trainer.train_and_evaluate(config, str(tmp_path))
  shards = sorted(p.relative_to(tmp_path / 'data').as_posix() for p in tmp_path.rglob('*.npz'))
  assert shards[0] == 'greedy/shard_00000.npz' and 'sampled/shard_00000.npz' in shards
  result = json.loads((tmp_path / 'result.json').read_text())
  copy = result['heldout_copy_baseline']
  assert len(copy['accuracy']) == config.head.block_size - 1 and copy['expected_tau'] >= 1.0
  last = json.loads((tmp_path / 'metrics.jsonl').read_text().splitlines()[-1])
  assert last['step'] == 10 and 0.0 <= last['heldout_accuracy/depth1'] <= 1.0
  assert 0.0 <= last['heldout_sampled_accuracy/depth1'] <= 1.0
  assert not any(k.startswith('heldout_round2') for k in last)
  # experiments/tasks/heldout.py scores the exported head on the same batch and anchors as the log,
  # and decodes the held-out prompts into the stored greedy responses.
  target = run_config.load_target_from_config(config.target)
  heads = {'h': js.load_draft_head(tmp_path / 'export', target)}
  batch = run_config.load_heldout_batch(config, tmp_path / 'data')
  rows = heldout.evaluate_heads(config, target, heads, batch, [0, 3])
  assert [(r['first_tokens'], r['drafter'][:4]) for r in rows] == [
    (0, 'h'),
    (0, 'copy'),
    (3, 'h'),
    (3, 'copy'),
  ]
  np.testing.assert_allclose(rows[0]['expected_tau'], last['heldout_expected_tau'], rtol=1e-4)
  np.testing.assert_allclose(rows[1]['expected_tau'], copy['expected_tau'], rtol=1e-4)
  assert rows[3]['anchors'] < rows[1]['anchors']  # 2 anchors per sequence within 3 tokens
  (decoded,) = heldout.decode_heads(
    target, heads, batch, max_new_tokens=6, method=js.methods.Chain()
  )
  assert decoded['equal_to_stored'] == decoded['sequences'] == 4 and decoded['tau'] >= 1.0


def test_heldout_subdirs_are_those_of_the_rounds_read(tmp_path):
  for rel in ('greedy', 'round1/greedy', 'round2/greedy', 'round3/sampled'):
    (tmp_path / rel).mkdir(parents=True)
    (tmp_path / rel / 'shard_00000.npz').touch()
  config = ml_collections.ConfigDict(
    dict(
      data=dict(dir=str(tmp_path), prompt_rounds=2),
      eval=dict(heldout_subdirs=('round1/greedy', 'round2/greedy', 'round4/greedy')),
    )
  )
  assert run_config.heldout_subdirs(config) == ['round1/greedy']
  config.data.prompt_rounds = 3
  assert run_config.heldout_subdirs(config) == ['round1/greedy', 'round2/greedy']


def test_eval_heads_flags_and_methods():
  """eval_heads' ``--heads`` pairs, and a JetSpec++ head asked for a chain decodes as the chain
  of its MASK drafting (what the walk scores) and of its recycled guesses; a DSpark head as its
  own chain, verified whole."""
  assert heldout.parse_heads('a=x/y,b=z') == {'a': 'x/y', 'b': 'z'}
  with pytest.raises(ValueError, match='name=directory'):
    heldout.parse_heads('a=x,runs/b')
  kind = lambda k: types.SimpleNamespace(cfg=types.SimpleNamespace(kind=k, block_size=8))
  chain = js.methods.Chain(copy_len=2)
  assert heldout.methods_for(kind('dflash'), chain) == [chain]
  mask, recycled = heldout.methods_for(kind('jetspecpp'), chain)
  assert (mask.recycle, recycled.recycle) == (False, True)
  assert mask.budget == recycled.budget == 8 and mask.width == 1 and mask.copy_len == 2
  (dspark,) = heldout.methods_for(kind('dspark'), js.methods.Chain())
  assert isinstance(dspark, js.methods.DSpark) and dspark.threshold == 0.0
  with pytest.raises(ValueError, match='no copy candidates'):
    heldout.methods_for(kind('dspark'), chain)
  assert heldout.parse_method('chain') == js.methods.Chain()
  assert heldout.parse_method('tree:budget=16, copy_len=4') == js.methods.Tree(
    budget=16, copy_len=4
  )
  assert heldout.parse_method('dspark:threshold=0.3').threshold == 0.3
  merged = heldout.parse_method('tree:copy_prior=(0.2, 0.5),budget=8,depth_bonus=0.5')
  assert merged == js.methods.Tree(budget=8, copy_prior=(0.2, 0.5), depth_bonus=0.5)
  with pytest.raises(ValueError, match='key=value'):
    heldout.parse_method('tree:16')
  with pytest.raises(ValueError, match='not a number'):
    heldout.parse_method('tree:budget=sixteen')
  assert heldout.parse_method('tree:budget=8,algorithm=best_first').algorithm == 'best_first'
  with pytest.raises(ValueError, match='algorithm must be one of'):
    heldout.parse_method('tree:algorithm=widest')
  with pytest.raises(ValueError, match='no setting'):
    heldout.parse_method('tree:depth=3')


def test_train_draft_binary_end_to_end(tmp_path):
  """The runlocal config: data, training with checkpoints, export, and a tau gain."""
  config = draft_tiny.get_config('runlocal')
  result = head_trainer.train_and_evaluate(config, str(tmp_path))
  assert result['steps'] == 120
  assert sorted(p.name for p in (tmp_path / 'checkpoints').iterdir()) == ['120', '60']
  target = run_config.load_target_from_config(config.target)
  head = js.load_draft_head(tmp_path / 'export', target)
  assert head.cfg.block_size == 6 and head.cfg.causal
  assert result['tau_after'] > result['tau_before'] + 0.3, result
  saved = json.loads((tmp_path / 'result.json').read_text())
  assert saved['tau_after'] == result['tau_after']
  resolved = json.loads((tmp_path / 'config.json').read_text())  # the config as run
  assert resolved['train']['steps'] == 120 and resolved['eval']['method']['name'] == 'tree'
  # The walk over teacher-forced runs at every anchor of the stored greedy sequences is what
  # chain decoding their prompts does, round by round (training/walk.py).
  source = shards_lib.TokenShards(tmp_path / 'data', max_len=config.data.max_len)
  items = [source[i] for i in range(4)]
  batch = {k: np.stack([item[k] for item in items]) for k in items[0]}
  accepted = 0
  for i in range(4):
    steps = copy_baseline.decoding_walk(*walk.runs_of(head, target, batch, i))
    start, length = int(np.argmax(batch['loss_mask'][i] > 0)), int(batch['lengths'][i])
    prompt = batch['tokens'][i][:start]
    out = js.generate(
      target, head, prompt, method=js.methods.Chain(), max_new_tokens=length - start
    )
    np.testing.assert_array_equal(out.tokens, batch['tokens'][i][start:length])
    # Round by round; decoding's last round may also count drafts past the response's end.
    assert steps.size == out.stats.tau.size and steps[-1] <= out.stats.tau[-1]
    np.testing.assert_array_equal(steps[:-1], out.stats.tau[:-1])
    accepted += int(np.sum(steps[:-1] - 1))
  assert accepted > 0  # the trained head's drafts are accepted: the walk is not all ones


@pytest.mark.parametrize(
  'change, message',
  [
    (lambda c: c.train.update(loss='kl'), "train.loss must be one of .* got 'kl'"),
    (lambda c: c.train.update(labels='argmax'), 'train.labels must be one of'),
    (lambda c: c.train.update(compute_dtype='float8'), 'compute_dtype'),
    (lambda c: c.train.update(loss='dspark'), 'cannot train a jetspec head'),
    (lambda c: c.head.update(markov_rank=8, causal=False), 'cannot train a dspark head'),
    (lambda c: c.eval.method.update(name='beam'), 'method name must be one of'),
    (
      lambda c: setattr(c.eval, 'method', ml_collections.ConfigDict({'name': 'dspark'})),
      'cannot run the jetspec head',
    ),
    (lambda c: c.target.update(dtype='float16'), 'target.dtype must be one of'),
    (lambda c: c.head.update(target_layer_ids=(0, 9)), r'taps target layers \[9\], outside'),
    (lambda c: c.head.update(mask_token_id=97), 'mask_token_id=97 is outside the vocabulary'),
    (lambda c: c.data.update(prompts='missing.jsonl'), 'data.prompts must be one of'),
    (lambda c: c.train.update(micro_batches=3), 'micro_batches=3 must divide'),
    (lambda c: c.train.update(anchor_chunk=5), 'anchor_chunk=5 must divide'),
    (lambda c: c.mesh.update(model=3), r'mesh.model=3 must divide the \d+ devices'),
  ],
)
def test_a_bad_config_fails_before_any_work(change, message, tmp_path):
  """Mistakes that used to surface after data generation (or hours of training) are errors
  before the first target forward, in train_draft and in generate_data."""
  config = draft_tiny.get_config('runlocal')
  change(config)
  with pytest.raises(ValueError, match=message):
    head_trainer.train_and_evaluate(config, str(tmp_path / 'train'))
  with pytest.raises(ValueError, match=message):
    generate_data.run(config, str(tmp_path / 'data'))
  assert not (tmp_path / 'train' / 'checkpoints').exists() and not (tmp_path / 'data').exists()


def test_target_dtype_from_config():
  """``target.dtype``: bfloat16 weights where asked; 'auto' is float32 on this CPU."""
  config = draft_tiny.get_config().target
  assert run_config.target_dtype('auto') == jnp.float32  # the suite runs on CPU
  assert run_config.load_target_from_config(config).dtype == jnp.float32
  config.dtype = 'bfloat16'
  target = run_config.load_target_from_config(config)
  assert {x.dtype for x in jax.tree.leaves(target.params)} == {jnp.dtype(jnp.bfloat16)}


def test_target_on_a_one_device_mesh_stays_unsharded():
  """A one-device mesh places the parameters unsharded (``sharding.shard_params``: a named
  sharding there made the decode loop ~4x slower on XLA CPU); a mesh of several devices shards
  them."""
  from jetspec_jax import sharding

  config = draft_tiny.get_config().target
  one = run_config.load_target_from_config(config, sharding.make_mesh(devices=jax.devices()[:1]))
  kinds = {type(x.sharding) for x in jax.tree.leaves(one.params)}
  assert kinds == {jax.sharding.SingleDeviceSharding}
  if jax.device_count() > 1:
    many = run_config.load_target_from_config(config, sharding.make_mesh())
    kinds = {type(x.sharding) for x in jax.tree.leaves(many.params)}
    assert kinds == {jax.sharding.NamedSharding}


def test_stored_features_train_like_the_target_pass(target, head_cfg, dataset, tmp_path):
  """Shards that store the target's features (collected while generating) give the same data
  and the same training step as running the target in the step."""
  _, prompts = dataset
  taps = head_cfg.target_layer_ids
  data_lib.generate_dataset(
    target,
    prompts[:8],
    tmp_path,
    max_len=40,
    max_new_tokens=30,
    shard_size=4,
    batch_size=4,
    progress=False,
    feature_taps=taps,
  )
  with_features = shards_lib.TokenShards(tmp_path, max_len=40)
  plain = shards_lib.TokenShards(dataset[0], max_len=40)
  assert with_features.feature_taps == taps and plain.feature_taps is None
  np.testing.assert_array_equal(with_features.tokens, plain.tokens[:8])  # same greedy data
  item = with_features[5]
  n = int(item['lengths'])
  hidden, feats = head_sums.target_pass(target, jnp.asarray(item['tokens'][None, :n]), taps)
  want = np.concatenate([np.asarray(feats[0]), np.asarray(hidden[0])], axis=-1)
  np.testing.assert_allclose(item['features'][: n - 1], want[: n - 1], atol=2e-2, rtol=1e-2)
  assert not item['features'][n - 1 :].any()

  optimizer = loop_lib.make_optimizer(lr=1e-3, steps=2, warmup_steps=1)
  settings = head_sums.StepSettings(num_anchors=8, loss='fkl', loss_chunk=8)
  step = head_step.make_train_step(target, head_cfg, optimizer, settings, js.sharding.make_mesh(1))
  batch = shards_lib.make_batches(with_features, 4, seed=0)[0]
  params = dh.init_head_params(head_cfg, jax.random.key(0))
  _, stored = step(loop_lib.init_state(params, optimizer), batch, jax.random.key(1))
  no_features = {k: v for k, v in batch.items() if k != 'features'}
  params = dh.init_head_params(head_cfg, jax.random.key(0))
  _, computed = step(loop_lib.init_state(params, optimizer), no_features, jax.random.key(1))
  np.testing.assert_allclose(float(stored['loss']), float(computed['loss']), rtol=2e-3)


def test_features_recomputed_from_token_shards_equal_collected_ones(target, dataset, tmp_path):
  """Token shards are the asset, features a cache: a batched teacher-forced forward over the
  stored tokens gives the features that generation collected (float16 rounding apart), into a
  separate directory, resumably; tokens are stored as uint16."""
  _, prompts = dataset
  taps = (0, 2)
  collected = tmp_path / 'collected'
  data_lib.generate_dataset(
    target, prompts[:6], collected / 'greedy', max_len=40, max_new_tokens=30, shard_size=4,
    batch_size=4, progress=False, feature_taps=taps,
  )  # fmt: skip
  tokens_only = tmp_path / 'tokens'
  for shard in shards_lib.shard_paths(collected):
    dst = tokens_only / shard.relative_to(collected)
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(shard.read_bytes())
  assert np.load(dst)['tokens'].dtype == np.uint16
  cache = tmp_path / 'features'
  assert shards_lib.TokenShards(tokens_only, 40, features_dir=cache).feature_taps is None
  # Only the shards a run reads (the first of each directory here), then the second of two
  # workers' share (the other shard), then none.
  assert (
    features_lib.compute_features(target, tokens_only, cache, taps, batch_size=4, shards_per_dir=1)
    == 1
  )
  # The taps file is written once, whole (workers start together), and never again: a later
  # call leaves even its formatting alone.
  meta = cache / shards_lib.FEATURE_TAPS_FILE
  assert json.loads(meta.read_text()) == list(taps) and not list(cache.glob('*.tmp'))
  assert shards_lib.feature_taps(cache) == tuple(taps) and shards_lib.feature_taps(tmp_path) is None
  meta.write_text('[0,2]')
  second_half = functools.partial(features_lib.compute_features, part=1, parts=2, batch_size=4)
  assert features_lib.compute_features(target, tokens_only, cache, taps, part=0, parts=2) == 0
  assert second_half(target, tokens_only, cache, taps) == 1
  assert features_lib.compute_features(target, tokens_only, cache, taps, batch_size=4) == 0
  assert meta.read_text() == '[0,2]'
  with pytest.raises(ValueError, match='part 2 of 2'):
    features_lib.compute_features(target, tokens_only, cache, taps, part=2, parts=2)
  want, got = (
    shards_lib.TokenShards(collected, 40),
    shards_lib.TokenShards(tokens_only, 40, features_dir=cache),
  )
  assert got.feature_taps == taps == want.feature_taps and len(got) == len(want) == 6
  for i in range(6):
    np.testing.assert_array_equal(got[i]['tokens'], want[i]['tokens'])
    np.testing.assert_allclose(got[i]['features'], want[i]['features'], atol=2e-2, rtol=1e-2)
  with pytest.raises(ValueError, match='holds features of taps'):
    features_lib.compute_features(target, tokens_only, cache, (1,))
  # The forward's matmul mode is recorded; a cache filled before that (no mode file) is float32.
  assert shards_lib.feature_compute_dtype(cache) == 'float32'
  (cache / shards_lib.FEATURE_COMPUTE_FILE).unlink()
  assert shards_lib.feature_compute_dtype(cache) == 'float32'
  with pytest.raises(ValueError, match='computed in float32, not bfloat16'):
    features_lib.compute_features(target, tokens_only, cache, taps, compute_dtype='bfloat16')
  with pytest.raises(ValueError, match='compute_dtype must be one of'):
    features_lib.compute_features(target, tokens_only, cache, taps, compute_dtype='float16')
  # bfloat16 matmul inputs: a directory of its own, close to the float32 features, not equal.
  narrow = tmp_path / 'features_bf16'
  assert shards_lib.feature_compute_dtype(narrow) is None
  compute_narrow = functools.partial(features_lib.compute_features, compute_dtype='bfloat16')
  assert compute_narrow(target, tokens_only, narrow, taps, batch_size=4) == 2
  assert shards_lib.feature_compute_dtype(narrow) == 'bfloat16'
  near = shards_lib.TokenShards(tokens_only, 40, features_dir=narrow)
  gaps = [np.abs(near[i]['features'] - got[i]['features']).max() for i in range(6)]
  assert 0 < max(gaps) < 0.1, gaps
  # Features without the taps they were tapped at are refused, not read as tokens only.
  (narrow / shards_lib.FEATURE_TAPS_FILE).unlink()
  with pytest.raises(FileNotFoundError, match='holds features but no feature_taps.json'):
    shards_lib.TokenShards(tokens_only, 40, features_dir=narrow)


def test_token_shards_keep_the_first_shards_of_each_directory(tmp_path):
  """``shards_per_dir`` pins a prefix of data that is still being generated."""
  for sub in ('greedy', 'sampled'):
    (tmp_path / sub).mkdir()
    for i in range(3):
      seqs = [np.arange(1, 6) + 10 * i + (100 if sub == 'sampled' else 0)]
      shards_lib.write_shard(
        tmp_path / sub / shards_lib.SHARD_PATTERN.format(i), seqs, [np.ones(5)], 8
      )
  assert len(shards_lib.TokenShards(tmp_path)) == 6
  pinned = shards_lib.TokenShards(tmp_path, shards_per_dir=2)
  assert sorted(int(pinned[i]['tokens'][0]) for i in range(len(pinned))) == [1, 11, 101, 111]
  after_heldout = shards_lib.TokenShards(tmp_path, shards_per_dir=1, skip_per_dir=1)
  assert sorted(int(after_heldout[i]['tokens'][0]) for i in range(2)) == [11, 111]


RESUME_SCRIPT = r"""
import os, sys, tempfile
flags = os.environ.get("XLA_FLAGS", "")  # the suite flags, plus the devices
os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
import jetspec_jax as js
from jetspec_jax.models import draft_head as dh
from jetspec_jax.training import head_step, head_sums, loop as loop_lib
from absl import logging
logging.set_verbosity(logging.WARNING)
assert jax.device_count() == 4
target = js.testing.tiny_target(0, vocab_size=29)
cfg = dh.config_for_target(target.cfg, num_layers=1, block_size=5, target_layer_ids=(0, 2))
rng = np.random.default_rng(0)
batches = [
  dict(tokens=jnp.asarray(rng.integers(0, 29, (4, 24)), jnp.int32),
       loss_mask=jnp.ones((4, 24), jnp.uint8), lengths=jnp.full((4,), 24, jnp.int32),
       index=jnp.arange(4, dtype=jnp.int32))
  for _ in range(6)
]
opt = loop_lib.make_optimizer(lr=1e-2, steps=6, warmup_steps=1)
settings = head_sums.StepSettings(num_anchors=4, loss="fkl", loss_chunk=4)
root = tempfile.mkdtemp()

def run(workdir, mesh, **kw):
  state, _ = head_step.fit(target, cfg, batches, os.path.join(root, workdir), steps=6,
                           optimizer=opt, settings=settings, seed=0, log_every=3,
                           checkpoint_every=3, mesh=js.sharding.make_mesh(*mesh), **kw)
  return jax.device_get(state)

full = {mesh: run(f"full{mesh}", mesh) for mesh in ((2, 1), (1, 4))}
for before, after in (((1, 1), (2, 1)), ((2, 1), (2, 1)), ((2, 2), (1, 4))):
  name = f"resume{before}{after}"
  assert int(run(name, before, stop_after=3).step) == 3
  resumed = run(name, after)
  assert int(resumed.step) == 6
  if before == after:  # bit for bit
    jax.tree.map(np.testing.assert_array_equal, resumed.params, full[after].params)
    jax.tree.map(np.testing.assert_array_equal, resumed.opt_state, full[after].opt_state)
  else:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4),
                 resumed.params, full[after].params)
  print("resumed", before, "->", after)
print("OK")
"""


def test_resume_on_another_device_count_or_mesh():
  """A run checkpointed on 1 or 2 devices or a (2, 2) mesh resumes on 2 devices or a (1, 4)
  mesh (4 fake CPU devices): bit-identical to the uninterrupted run on the same mesh, within
  float tolerance when the mesh changes (a different reduction order)."""
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  out = subprocess.run(
    [sys.executable, '-c', RESUME_SCRIPT], capture_output=True, text=True, env=env, timeout=900
  )
  assert out.returncode == 0 and 'OK' in out.stdout, (out.stdout[-2000:], out.stderr[-4000:])


def test_the_log_says_progress_and_orbax_stays_quiet(tmp_path, monkeypatch):
  """Log lines give step/total, s/step, time left and the learning rate; Orbax's INFO lines (a
  dozen per checkpoint) are dropped unless JETSPEC_ORBAX_LOGS is set."""
  records = []

  class Keep(py_logging.Handler):
    def emit(self, record):
      records.append(record)

  handler = Keep(level=py_logging.INFO)
  py_logging.getLogger().addHandler(handler)
  monkeypatch.setattr(py_logging.getLogger(), 'level', py_logging.INFO)
  verbosity = absl_logging.get_verbosity()  # a pytest worker may start at WARNING
  absl_logging.set_verbosity(absl_logging.INFO)
  optimizer = loop.make_optimizer(lr=1e-2, steps=3, warmup_steps=1)
  state = loop.init_state({'w': jnp.ones(3)}, optimizer)

  def step(state, batch, i):
    return state.replace(step=state.step + 1), {'loss': jnp.float32(1.0)}

  try:
    schedule = loop.make_schedule(lr=1e-2, steps=3, warmup_steps=1)
    loop.train_loop(
      step, state, lambda s: None, tmp_path, steps=3, log_every=1, learning_rate=schedule
    )
  finally:
    py_logging.getLogger().removeHandler(handler)
    absl_logging.set_verbosity(verbosity)
  lines = [r.getMessage() for r in records if r.getMessage().startswith('step ')]
  assert (
    lines[0].startswith('step 1/3 (') and 'left)' in lines[0] and 'learning_rate 0.01' in lines[0]
  )
  assert lines[-1].startswith('step 3/3')
  assert not [r for r in records if f'{os.sep}orbax{os.sep}' in r.pathname]


def test_only_shards_picks_shards_of_one_kind():
  counts = dict(greedy=48, sampled=16)
  assert data_lib.parse_only_shards('', counts) is None
  assert data_lib.parse_only_shards('greedy:35,36', counts) == {('greedy', 35), ('greedy', 36)}
  for bad in ('greedy', 'typo:1', 'sampled:16', 'greedy:-1', 'greedy:1,x'):
    with pytest.raises(ValueError, match='only_shards'):
      data_lib.parse_only_shards(bad, counts)


def test_mixed_sources_give_whole_batches_in_their_shares(dataset):
  """data.mix: each step's batch comes whole from one source at that source's width, the sources
  in their shares; one source gives exactly its own batches."""
  short = shards_lib.TokenShards(dataset[0], max_len=40)
  wide = shards_lib.TokenShards(dataset[0], max_len=64)
  mixed = shards_lib.mix_batches([short, wide], [0.75, 0.25], 4, seed=0)
  widths = [mixed[s]['tokens'].shape for s in range(200)]
  assert set(widths) == {(4, 40), (4, 64)}
  assert widths.count((4, 64)) == 50
  alone = shards_lib.mix_batches([short], [1.0], 4, seed=0)
  np.testing.assert_array_equal(
    alone[7]['tokens'], shards_lib.make_batches(short, 4, 0)[7]['tokens']
  )
  with pytest.raises(ValueError, match='positive weights'):
    shards_lib.mix_batches([short, wide], [1.0, 0.0], 4, seed=0)


def test_train_draft_reads_a_mixed_directory_at_its_own_width(tmp_path):
  """A run with data.mix trains on data.dir and a directory of longer sequences at their own
  width; a weight that leaves data.dir no share is refused."""
  # A vocabulary of 1,024 ids: reduced draft vocabularies (multiples of 128) smaller than it
  wide = {'vocab_size': 1024}
  long = draft_tiny.get_config('runlocal')
  long.target.overrides = wide
  long.data.update(num_prompts=24, prompt_seed=1, max_new_tokens=60, max_len=80, shard_size=8)
  generate_data.run(long, str(tmp_path / 'long'))
  config = draft_tiny.get_config('runlocal')
  config.target.overrides = wide
  config.train.update(steps=6, log_every=3, checkpoint_every=6)
  config.eval.update(num_prompts=1, max_new_tokens=8)
  config.data.mix = [
    dict(dir=str(tmp_path / 'long' / 'data'), max_len=80, features_dir='', weight=0.5)
  ]
  config.head.draft_vocab_coverage = 0.9
  result = head_trainer.train_and_evaluate(config, str(tmp_path / 'train'))
  assert result['steps'] == 6
  assert result['num_sequences'] == 32 + 24
  # Continued on other data at a lower coverage, the head keeps every id it drafted
  target = run_config.load_target_from_config(config.target)
  first = js.load_draft_head(tmp_path / 'train' / 'export', target).draft_vocab
  continued = draft_tiny.get_config('runlocal')
  continued.target.overrides = wide
  continued.train.update(
    steps=2, log_every=1, checkpoint_every=2, init_from=str(tmp_path / 'train' / 'export')
  )
  continued.eval.update(num_prompts=1, max_new_tokens=8)
  continued.data.update(dir=str(tmp_path / 'long' / 'data'), max_len=80)
  continued.head.draft_vocab_coverage = 0.5
  head_trainer.train_and_evaluate(continued, str(tmp_path / 'continued'))
  grown = js.load_draft_head(tmp_path / 'continued' / 'export', target).draft_vocab
  assert first is not None and len(first) < 1024
  assert set(np.asarray(first)) <= set(np.asarray(grown))
  alone = js.draft_head.draft_vocabulary(
    shards_lib.TokenShards(tmp_path / 'long' / 'data', max_len=80).response_token_counts(1024), 0.5
  )
  assert len(alone) < len(grown)  # its new data alone would have given fewer ids
  config.data.mix = [dict(dir='x', max_len=80, features_dir='', weight=1.0)]
  with pytest.raises(ValueError, match='0 < weight < 1'):
    head_trainer.train_and_evaluate(config, str(tmp_path / 'bad'))
