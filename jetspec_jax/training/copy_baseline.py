"""The zero-parameter drafter a head must beat: copying from the context (prompt lookup).

:func:`copy_metrics` scores, teacher-forced on stored sequences, the drafts of
:func:`jetspec_jax.prompt_lookup.continuation` exactly as the training metrics score a head's
block (:func:`jetspec_jax.training.head_sums.sums_metrics`): at every valid anchor ``a`` the
draft's ``k``-th token is compared with the label of position ``a + k`` (the data's token, or the
target's argmax there), slots past the response or past the first invalid one do not count, a
slot the copy cannot fill (the match has fewer tokens after it) counts as wrong, and the expected
chain tau is one plus the mean leading run of correct slots. Every valid anchor is scored (the
head's metrics sample anchors uniformly from the same set), so the two read side by side.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import prompt_lookup
from jetspec_jax.training import blocks as blocks_lib


@functools.partial(jax.jit, static_argnames=('block_size', 'max_ngram'))
def _sequence_counts(tokens, labels, loss_mask, length, *, block_size: int, max_ngram: int):
  seq_len = tokens.shape[0]
  anchors = jnp.arange(seq_len)
  keep = blocks_lib.valid_anchor_positions(loss_mask, length)
  depth = jnp.arange(1, block_size)

  def one(a):
    draft, count, _ = prompt_lookup.continuation(
      tokens, a, max_ngram=max_ngram, length=block_size - 1
    )
    positions = a + depth
    in_range = positions < length
    gathered = jnp.clip(positions, 0, seq_len - 1)
    valid = in_range & (loss_mask[gathered] > 0)
    valid = jnp.cumprod(valid).astype(bool)  # cut at the first invalid slot, as blocks_at does
    correct = valid & (depth <= count) & (draft == labels[gathered])
    return correct, valid, jnp.sum(jnp.cumprod(correct))

  correct, valid, run = jax.vmap(one)(anchors)
  keep2 = keep[:, None]
  sums = (
    jnp.sum(correct & keep2, 0),
    jnp.sum(valid & keep2, 0),
    jnp.sum(jnp.where(keep, run, 0)),
    jnp.sum(keep),
  )
  return sums, run, keep


def decoding_walk(run: np.ndarray, keep: np.ndarray) -> np.ndarray:
  """Tokens committed per round by greedy chain decoding that accepts ``run[a]`` drafts at
  anchor ``a`` (``keep``: the valid anchors, one response's contiguous span).

  Decoding does not visit every anchor: from the first valid one, a round commits the accepted
  drafts plus the target's own token and the next round is anchored there, so the positions
  inside an accepted run are skipped. The uniform average over anchors (``expected_tau``) counts
  them, which overstates decoding where long runs cluster; this is the walk decoding takes. The
  last round stops at the response's last token (decoding may count drafts past a cut there)."""
  valid = np.flatnonzero(keep)
  steps = []
  if valid.size:
    a, end = int(valid[0]), int(valid[-1])
    while a <= end:  # the last valid anchor drafts the response's last token
      steps.append(min(int(run[a]) + 1, end + 1 - a))
      a += steps[-1]
  return np.asarray(steps, np.int64)


def copy_metrics(batch: dict, *, block_size: int, max_ngram: int = 3) -> dict:
  """Per-depth accuracy (depth 1 .. ``block_size - 1``), expected chain tau (every anchor
  weighted alike) and walk tau (the anchors greedy decoding visits, :func:`decoding_walk`) of
  copy drafts.

  Args:
    batch: ``tokens [B, L]``, ``loss_mask [B, L]``, ``lengths [B]`` and, optionally,
      ``labels [B, L]`` (the target's argmax; else the tokens are the labels).
    block_size: the head's block size (its drafts are ``block_size - 1`` tokens).
    max_ngram: the longest context suffix matched.
  """
  labels = batch.get('labels', batch['tokens'])
  totals, walk_rounds, walk_tokens = None, 0, 0
  for tokens, label, mask, length in zip(
    batch['tokens'], labels, batch['loss_mask'], batch['lengths']
  ):
    counts, run, keep = _sequence_counts(
      jnp.asarray(tokens, jnp.int32),
      jnp.asarray(label, jnp.int32),
      jnp.asarray(mask),
      jnp.asarray(length, jnp.int32),
      block_size=block_size,
      max_ngram=max_ngram,
    )
    counts = [np.asarray(c, np.int64) for c in counts]
    steps = decoding_walk(np.asarray(run), np.asarray(keep))
    walk_rounds, walk_tokens = walk_rounds + steps.size, walk_tokens + int(steps.sum())
    totals = counts if totals is None else [t + c for t, c in zip(totals, counts)]
  correct, count, accepted, blocks = totals
  return dict(
    accuracy=correct / np.maximum(count, 1),
    expected_tau=1.0 + accepted / max(int(blocks), 1),
    walk_tau=walk_tokens / max(walk_rounds, 1),
    anchors=int(blocks),
  )
