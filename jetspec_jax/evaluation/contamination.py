"""Overlap of evaluation prompts with training prompts: exact (same normalised text) or a shared
13-word sequence, the check the field applies before reporting on public sets.

Texts are normalised to lower-case word sequences (``\\w+``), so whitespace, punctuation and
formatting do not hide a copy. An evaluation prompt is checked on its set's own text (not the
harness wording added around it, which every math prompt shares).
"""

import re

import numpy as np

NGRAM = 13
_USER_TURN = re.compile(r'<\|im_start\|>user\n(.*?)<\|im_end\|>', re.DOTALL)


def words(text: str) -> tuple[str, ...]:
  return tuple(re.findall(r'\w+', text.lower()))


def ngrams(seq: tuple[str, ...], n: int = NGRAM) -> set[tuple[str, ...]]:
  return {seq[i : i + n] for i in range(len(seq) - n + 1)}


class Index:
  """Training texts' normalised forms and n-grams, for :meth:`check`."""

  def __init__(self, texts, n: int = NGRAM):
    self.n = n
    self.exact: set[tuple[str, ...]] = set()
    self.grams: set[tuple[str, ...]] = set()
    self.count = 0
    for text in texts:
      w = words(text)
      self.exact.add(w)
      self.grams |= ngrams(w, n)
      self.count += 1

  def check(self, text: str) -> str | None:
    """``'exact'``, ``'13-gram'`` or None (no overlap)."""
    w = words(text)
    if w in self.exact:
      return 'exact'
    if ngrams(w, self.n) & self.grams:
      return f'{self.n}-gram'
    return None


def user_turns(tok, token_rows) -> list[str]:
  """The user turns of chat-formatted token sequences (a sequence without one: its whole text)."""
  out = []
  for ids in token_rows:
    text = tok.decode(np.asarray(ids).tolist())
    turns = _USER_TURN.findall(text)
    out.extend(turns or [text])
  return out


def training_prompts(tok, shard_paths) -> list[str]:
  """The prompts (user turns) of token shards: each sequence's tokens outside its response."""
  rows = []
  for path in shard_paths:
    with np.load(path) as z:
      for tokens, mask, length in zip(z['tokens'], z['loss_mask'], z['lengths'], strict=True):
        rows.append(tokens[:length][mask[:length] == 0])
  return user_turns(tok, rows)


def training_responses(tok, shard_paths) -> list[str]:
  """The responses of token shards (the target's own text)."""
  out = []
  for path in shard_paths:
    with np.load(path) as z:
      for tokens, mask, length in zip(z['tokens'], z['loss_mask'], z['lengths'], strict=True):
        out.append(tok.decode(tokens[:length][mask[:length] == 1].tolist()))
  return out


def report(index: Index, prompts_by_set: dict) -> dict:
  """Per set: prompts checked, exact and n-gram overlaps, and the overlapping prompt ids."""
  out = {}
  for name, prompts in prompts_by_set.items():
    hits = {p.prompt_id: index.check(p.source) for p in prompts}
    hits = {k: v for k, v in hits.items() if v}
    out[name] = dict(
      prompts=len(prompts),
      exact=sum(v == 'exact' for v in hits.values()),
      ngram=sum(v != 'exact' for v in hits.values()),
      overlapping=sorted(hits),
    )
  return out
