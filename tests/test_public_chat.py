"""Prompts people send (ShareGPT, Alpaca) from pinned package files, their filters, and the
self-distillation of whole conversations, each turn after the target's own earlier answers."""

import json

import numpy as np
import pytest

import jetspec_jax as js
from jetspec_jax.evaluation import contamination
from jetspec_jax.training import public_chat
from jetspec_jax.training import shards as shards_lib


def test_complete_elements_stops_at_the_cut():
  text = json.dumps([{'a': 1}, {'b': [2, 3]}, {'c': 'x'}])
  assert public_chat.complete_elements(text) == [{'a': 1}, {'b': [2, 3]}, {'c': 'x'}]
  assert public_chat.complete_elements(text[:-9]) == [{'a': 1}, {'b': [2, 3]}]


def test_packaged_sources_read_whole():
  sharegpt = public_chat.sharegpt()
  assert len(sharegpt) == 17397  # 17,671 whole conversations, 274 without a user turn
  assert sum(len(c.turns) >= 2 for c in sharegpt) > 12_000
  assert len(public_chat.alpaca_demo()) == 999


def test_select_filters_and_counts():
  convs = [
    public_chat.Conversation('s', '1', ('How do I sort a list in Python?', 'And in reverse?')),
    public_chat.Conversation('s', '2', ('how do I  sort a list in python?',)),  # a duplicate
    public_chat.Conversation('s', '3', ('Comment trier une liste en Python ?',)),  # not English
    public_chat.Conversation('s', '4', ('What is the capital of France?', 'x')),  # 2nd too short
    public_chat.Conversation(
      's',
      '5',
      ('What is ' + 'one two three four five six seven eight nine ten eleven twelve thirteen',),
    ),
  ]
  index = contamination.Index(
    ['one two three four five six seven eight nine ten eleven twelve thirteen fourteen']
  )
  kept, counts = public_chat.select(convs, eval_index=index)
  assert [c.conv_id for c in kept] == ['1', '4']
  assert kept[1].turns == ('What is the capital of France?',)
  assert counts == dict(
    read=5, not_english_or_length=1, duplicate=1, overlaps_eval=1, kept=2, turns=3
  )


@pytest.fixture(scope='module')
def tok():
  try:
    return js.load_tokenizer(js.model_cache.smollm2_135m_instruct_path())
  except FileNotFoundError as e:
    pytest.skip(str(e))


def test_each_turn_follows_the_targets_own_answers(tok, tmp_path):
  target = js.testing.tiny_target(0, vocab_size=49152)
  convs = [
    public_chat.Conversation('s', 'a', ('Say hi.', 'Again?', 'Once more?')),
    public_chat.Conversation('s', 'b', ('Count to three.',)),
    public_chat.Conversation('s', 'c', ('Name a colour.', 'Another?')),
  ]
  kwargs = dict(
    max_turns=3,
    shard_size=2,
    batch_size=2,
    max_new_tokens=6,
    max_prompt_len=256,
    sampled_every=3,
    temperature=1.0,
    seed=0,
  )
  written = public_chat.generate(target, tok, convs, tmp_path, **kwargs)
  # a (index 0) is sampled; b and c are greedy, in shard 0 of that kind.
  assert written == {'greedy': 3, 'sampled': 3}
  turn1 = public_chat.read_answers(tok, public_chat.shard_path(tmp_path, 'greedy', 1, 0))
  assert sorted(turn1) == ['b', 'c']
  shard = shards_lib.load_shard(public_chat.shard_path(tmp_path, 'greedy', 2, 0))
  ids = json.loads(
    public_chat.ids_path(public_chat.shard_path(tmp_path, 'greedy', 2, 0)).read_text()
  )
  assert ids == ['c']
  prompt = shard['tokens'][0][: shard['lengths'][0]][
    shard['loss_mask'][0][: shard['lengths'][0]] == 0
  ]
  expected = tok.apply_chat_template(public_chat.turn_messages(convs[2], 2, [turn1['c']]))
  np.testing.assert_array_equal(prompt, expected)  # turn 2 is asked after the target's answer
  assert public_chat.shard_path(tmp_path, 'sampled', 3, 0).exists()
  assert public_chat.generate(target, tok, convs, tmp_path, **kwargs) == {'greedy': 0, 'sampled': 0}
  # A sampled answer's keys are its (seed, conversation, turn): lost turns come back the same.
  lost = [public_chat.shard_path(tmp_path, 'sampled', t, 0) for t in (2, 3)]
  before = [p.read_bytes() for p in lost]
  for p in lost:
    p.unlink()
  assert public_chat.generate(target, tok, convs, tmp_path, **kwargs) == {'greedy': 0, 'sampled': 2}
  assert [p.read_bytes() for p in lost] == before


def test_greedy_turns_are_the_targets_own_and_resume_at_the_first_missing(tok, tmp_path):
  """Conversations go through one stream of refilled rows, several shards in flight: each
  answer equals AR decoding of its turn's prompt, and a shard whose later turns are lost is
  completed with the same answers."""
  target = js.testing.tiny_target(0, vocab_size=49152)
  convs = [
    public_chat.Conversation('s', str(i), tuple(f'Question {i}.{t}?' for t in range(1 + i % 3)))
    for i in range(7)
  ]
  kwargs = dict(
    max_turns=3,
    shard_size=2,
    batch_size=3,
    max_new_tokens=5,
    max_prompt_len=200,
    sampled_every=0,
    temperature=0.0,
  )
  written = public_chat.generate(target, tok, convs, tmp_path, **kwargs)
  assert written == {'greedy': sum(len(c.turns) for c in convs), 'sampled': 0}
  files = sorted(tmp_path.rglob('shard_*'))
  before = {p: p.read_bytes() for p in files}
  for s in range(4):
    answers = {c.conv_id: [] for c in convs[2 * s : 2 * s + 2]}
    for turn in range(1, 4):
      path = public_chat.shard_path(tmp_path, 'greedy', turn, s)
      shard = shards_lib.load_shard(path)
      ids = json.loads(public_chat.ids_path(path).read_text())
      assert ids == [c.conv_id for c in convs[2 * s : 2 * s + 2] if len(c.turns) >= turn]
      for row, conv_id in enumerate(ids):
        conv = convs[int(conv_id)]
        prompt = tok.apply_chat_template(public_chat.turn_messages(conv, turn, answers[conv_id]))
        expected = js.generate(
          target,
          None,
          np.asarray(prompt),
          method=js.methods.AR(),
          max_new_tokens=5,
          eos_id=sorted(tok.eos_ids),
        ).tokens
        length = shard['lengths'][row]
        np.testing.assert_array_equal(shard['tokens'][row][:length], np.r_[prompt, expected])
        answers[conv_id].append(public_chat.answer_text(tok, expected))
  for turn in (2, 3):  # shard 1 lost its later turns
    path = public_chat.shard_path(tmp_path, 'greedy', turn, 1)
    path.unlink()
    public_chat.ids_path(path).unlink()
  again = public_chat.generate(target, tok, convs, tmp_path, **kwargs)
  assert again['greedy'] == sum(len(c.turns) - 1 for c in convs[2:4])
  assert {p: p.read_bytes() for p in sorted(tmp_path.rglob('shard_*'))} == before
  assert not list(tmp_path.rglob('*.claim'))
  # Every first turn before any second one (the data job's answer_turns), then the rest: the
  # same files.
  staged = tmp_path / 'staged'
  first = public_chat.generate(target, tok, convs, staged, **{**kwargs, 'max_turns': 1})
  assert first['greedy'] == len(convs)
  assert {p.parent.name for p in staged.rglob('shard_*')} == {'turn1'}
  public_chat.generate(target, tok, convs, staged, **kwargs)
  assert {p.relative_to(staged): p.read_bytes() for p in sorted(staged.rglob('shard_*'))} == {
    p.relative_to(tmp_path): b for p, b in before.items()
  }
