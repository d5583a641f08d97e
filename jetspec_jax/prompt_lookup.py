"""Copy candidates: the continuation of the longest suffix match in the committed context.

Prompt lookup (Saxena, 2023; the n-gram drafter of vLLM and of REST-style methods) drafts by
copying: find the most recent earlier place where the last ``n`` committed tokens occurred, and
propose what followed them there. It has no parameters, and it is strong exactly where a small
model's output repeats its context (code that quotes the prompt, lists, restated questions).

Here it runs on device with static shapes, per row: ``history [S]`` holds the committed tokens
``x[0..P]`` (``x[P]`` is the anchor); every position ``j < P`` is scored by how many of the last
``max_ngram`` tokens match backwards from it. The longest match wins; among those, the one with
the most tokens after it before the anchor (up to the ``length`` wanted), then the latest: inside
a repetition (``8 8 8 8``) the latest match sits just before the anchor and could offer one token,
an earlier one offers ``length``.
Example, ``max_ngram = 3``::

  position  0  1  2  3  4  5  6  7
  history   a  b  c  d  x  b  c  d      anchor P = 7, suffix "b c d"
  match     0  0  0  3  0  0  0         j = 3 matches all 3 tokens backwards
  continuation  x[4..7] = x b c d       (at most P - j tokens: it stops at the anchor)

The candidates join a draft tree as one extra branch (:func:`jetspec_jax.tree.add_branch`);
verification and acceptance do not change, so the output stays exactly the target's.
"""

import jax.numpy as jnp

from jetspec_jax.typing import Array, Float, Int


def continuation(
  history: Int[Array, ' S'], last: Int[Array, ''], *, max_ngram: int, length: int
) -> tuple[Int[Array, ' L'], Int[Array, ''], Int[Array, '']]:
  """The tokens that followed the latest longest match of the context's suffix.

  Args:
    history: ``int32[S]`` committed tokens; entries past ``last`` are ignored.
    last: index of the last committed token (the anchor).
    max_ngram: longest suffix tried (static); a match of 1 token counts.
    length: how many tokens to propose (static).

  Returns:
    (tokens ``int32[length]``, count: the valid leading entries, ngram: the match length; count
    and ngram are 0 when the suffix never occurred before).
  """
  s = history.shape[0]
  j = jnp.arange(s)
  run = jnp.ones((s,), bool)
  ngram = jnp.zeros((s,), jnp.int32)
  for k in range(max_ngram):
    here = history[jnp.maximum(j - k, 0)]
    there = history[jnp.maximum(last - k, 0)]
    run = run & (j - k >= 0) & (last - k >= 0) & (here == there)
    ngram = ngram + run.astype(jnp.int32)
  room = jnp.minimum(length, last - j)  # tokens after j, up to the anchor
  score = jnp.where((j < last) & (ngram > 0), (ngram * (length + 1) + room) * s + j, -1)
  best = jnp.argmax(score)
  found = score[best] >= 0
  count = jnp.where(found, room[best], 0).astype(jnp.int32)
  tokens = history[jnp.minimum(best + 1 + jnp.arange(length), s - 1)]
  return tokens.astype(jnp.int32), count, jnp.where(found, ngram[best], 0)


def record(
  history: Int[Array, 'B S'], start: Int[Array, ' B'], committed: Int[Array, 'B n']
) -> Int[Array, 'B S']:
  """Writes each row's ``committed`` tokens at ``start + 1 ...`` (entries past a row's tau are
  written too and overwritten by later rounds; positions past ``S`` are dropped)."""
  b, n = committed.shape
  positions = start[:, None] + 1 + jnp.arange(n)[None]
  return history.at[jnp.arange(b)[:, None], positions].set(committed, mode='drop')


def start_history(
  prompts: Int[Array, 'B P'], prompt_lens: Int[Array, ' B'], anchor: Int[Array, ' B'], size: int
) -> Int[Array, 'B S']:
  """``int32[B, size]``: each row's prompt, then its anchor at index ``prompt_lens``."""
  b, p = prompts.shape
  history = jnp.zeros((b, size), jnp.int32).at[:, :p].set(prompts)
  return history.at[jnp.arange(b), prompt_lens].set(anchor, mode='drop')


def seed_guesses(
  history: Int[Array, ' S'], last: Int[Array, ''], *, max_ngram: int, depth: int
) -> Int[Array, ' depth']:
  """A copy-seeded head's slot guesses (``DraftHeadConfig.copy_seed``): the :func:`continuation`
  of the context ending at ``last`` (the anchor), ``-1`` (MASK) where it has no token. Only
  tokens at or before ``last`` are read, so training may pass a whole stored sequence."""
  tokens, count, _ = continuation(history, last, max_ngram=max_ngram, length=depth)
  return jnp.where(jnp.arange(depth) < count, tokens, -1).astype(jnp.int32)


def merge_into_logprobs(
  logprobs: Float[Array, 'depth V'],
  history: Int[Array, ' S'],
  last: Int[Array, ''],
  prior: tuple[float, ...],
) -> Float[Array, 'depth V']:
  """Copy candidates as draft candidates: the :func:`continuation` of the context (longest match
  up to ``len(prior)`` tokens, one token per depth) with probability ``prior[n - 1]`` for a match
  of ``n`` tokens. At each depth the continuation's token gets ``max(its log-prob, log prior)``;
  every other entry is unchanged, so a tree builder spends its whole budget on whichever of head
  and copy is likelier, instead of a fixed copy branch."""
  depth = logprobs.shape[0]
  tokens, count, ngram = continuation(history, last, max_ngram=len(prior), length=depth)
  log_prior = jnp.log(jnp.asarray(prior, jnp.float32))[jnp.maximum(ngram - 1, 0)]
  rows = jnp.arange(depth)
  current = logprobs[rows, tokens]
  merged = jnp.where(rows < count, jnp.maximum(current, log_prior), current)
  return logprobs.at[rows, tokens].set(merged)
