"""The chain tau greedy decoding measures, read off stored sequences without decoding.

The held-out ``expected_tau`` (:func:`head_sums.sums_metrics`) weights every anchor alike.
Greedy chain decoding does not: a round anchored at ``a`` that accepts ``k`` drafts anchors the
next round at ``a + k + 1``, so it skips the anchors inside an accepted run, and long runs cluster
(a copied stretch), which makes the uniform average overstate what decoding measures. On a
stored greedy sequence the target's tokens are the stored ones, so the head's leading run of
correct drafts at *every* anchor (:func:`sequence_runs`), walked as decoding walks
(:func:`copy_baseline.decoding_walk`), gives the chain tau decoding that sequence's prompt
measures (:func:`walk_metrics`): on SmolLM2's held-out sequences the walk's rounds equal
decoding's round by round, except that decoding's last round may count drafts past the cut.
``experiments/tasks/heldout.py`` reports both.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.models import draft_head as dh
from jetspec_jax.training import blocks as blocks_lib
from jetspec_jax.training import copy_baseline, head_sums


@functools.partial(jax.jit, static_argnames=('chunk',))
def sequence_runs(
  head: dh.DraftHead, target, tokens, loss_mask, length, features, labels, chunk=32
):
  """``(run [L], valid [L])``: at every valid anchor ``a`` of one sequence, the number of
  leading draft slots whose argmax equals ``labels`` (plain MASK drafting; a copy-seeded head's
  slots hold its seeds), and which positions are valid anchors.

  Args:
    head: a JetSpec, DFlash-style or JetSpec++ head (DSpark drafts differently).
    tokens, loss_mask: ``[L]`` the stored sequence and its response mask; ``length``: its length.
    features: ``[L, T * D]`` the target's tapped features of the sequence.
    labels: ``[L]`` what a slot at each position should draft (the target's argmax).
    chunk: anchors per head forward (bounds memory; any value gives the same runs).
  """
  cfg = head.cfg
  seq_len = tokens.shape[0]
  blk, valid = blocks_lib.every_anchor_blocks(cfg, tokens, loss_mask, length)
  context_kv = head_sums.head_context_kv(head.params, cfg, features)
  pad = -seq_len % chunk
  padded = jax.tree.map(
    lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)) if x is not None else None, blk
  )
  in_chunks = jax.tree.map(
    lambda x: x.reshape((-1, chunk) + x.shape[1:]) if x is not None else None, padded
  )

  def one_chunk(b):
    out = head_sums.head_blocks_on_context(
      head.params, cfg, target, context_kv, b, features.dtype, None
    )
    draft = jnp.argmax(head.vocab_logits(target, out[:, 1:]), axis=-1)
    correct = b.valid[:, 1:] & (draft == labels[jnp.clip(b.positions[:, 1:], 0, seq_len - 1)])
    return jnp.sum(jnp.cumprod(correct, axis=1), axis=1)

  runs = jax.lax.map(one_chunk, in_chunks).reshape(-1)[:seq_len]
  return jnp.where(valid, runs, 0), valid


def runs_of(head: dh.DraftHead, target, batch: dict, i: int) -> tuple[np.ndarray, np.ndarray]:
  """:func:`sequence_runs` of sequence ``i`` of a batch (``tokens``, ``loss_mask``,
  ``lengths``, optionally ``features`` and ``labels``, as :class:`data.TokenShards` returns
  them; without stored features the target computes them)."""
  tokens = jnp.asarray(batch['tokens'][i], jnp.int32)
  taps = head.cfg.num_taps * head.cfg.hidden_size
  if 'features' in batch:
    features = jnp.asarray(batch['features'][i][..., :taps], target.dtype)
  else:
    _, features = head_sums.target_pass(target, tokens[None], head.cfg.target_layer_ids)
    features = features[0]
  labels = batch.get('labels', batch['tokens'])[i]
  run, valid = sequence_runs(
    head,
    target,
    tokens,
    jnp.asarray(batch['loss_mask'][i]),
    jnp.asarray(batch['lengths'][i], jnp.int32),
    features,
    jnp.asarray(labels, jnp.int32),
  )
  return np.asarray(run), np.asarray(valid)


def walk_metrics(head: dh.DraftHead, target, batch: dict) -> dict:
  """Over a batch of stored greedy sequences (as :func:`runs_of`): ``walk_tau`` (committed
  tokens per round of the decoding walk, the chain tau decoding measures), ``expected_tau``
  (every anchor alike, as the held-out metric), and the counts."""
  if head.cfg.kind == 'dspark':
    raise ValueError('walk_metrics scores JetSpec, DFlash-style and JetSpec++ heads, not dspark')
  rounds = committed = accepted = anchors = 0
  for i in range(len(batch['tokens'])):
    run, valid = runs_of(head, target, batch, i)
    steps = copy_baseline.decoding_walk(run, valid)
    rounds, committed = rounds + steps.size, committed + int(steps.sum())
    accepted, anchors = accepted + int(run[valid].sum()), anchors + int(valid.sum())
  return dict(
    walk_tau=committed / max(rounds, 1),
    expected_tau=1.0 + accepted / max(anchors, 1),
    rounds=rounds,
    anchors=anchors,
  )
