"""Anchor blocks for draft-head training (docs/training.md §3).

Per sequence, up to ``num_anchors`` anchors are drawn uniformly without replacement from the valid
positions (``loss_mask[a] == loss_mask[a+1] == 1``: the anchor and its first target are response
tokens, as at inference where the anchor is always a generated token) and sorted. Block ``k`` is
``[x_a, MASK x (bs-1)]`` at positions ``a .. a+bs-1``. Its queries see context positions ``< a``
(strictly: the anchor has no feature row at inference, docs/training.md §3), their own block
causally (or fully, for the bidirectional baseline) and no other block. Slot ``i >= 1`` predicts
``x_{a+i}`` (teacher: the target's logits at ``a+i-1``); slot 0 has no loss; a slot is valid only
inside the sequence and the response, and validity is cut at the first invalid slot.

Example, ``bs = 3``, anchors at 2 and 5, sequence length 7 (``x`` = visible)::

  keys:           context 0..6          block k=0   block k=1
  query (0, i)    x x . . . . .         causal      .
  query (1, i)    x x x x x . .         .           causal

JetSpec++ heads also train on blocks whose slots hold guessed tokens (``Blocks.guessed``):
:func:`refine_blocks` (the next round's block, seeded with the last draft) and
:func:`noisy_context_blocks` (a token-only run of true and own-draft tokens after the anchor).
A copy-seeded head's blocks hold the context's copy candidates (:func:`copy_seeded_blocks`).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jetspec_jax import prompt_lookup
from jetspec_jax.models import draft_head
from jetspec_jax.typing import Array, Bool, Int


class Blocks(NamedTuple):
  """Sampled blocks of one sequence.

  Attributes:
    anchors: ``int32[A]`` sorted anchor positions (padding: 0).
    keep: ``bool[A]`` real (not padding) blocks.
    tokens: ``int32[A, bs]`` block input ids ``[x_a, MASK, ...]``.
    positions: ``int32[A, bs]`` ``a + i``.
    targets: ``int32[A, bs]`` ``x_{a+i}`` (0 where out of range).
    valid: ``bool[A, bs]`` slots with a loss.
    context_mask: ``bool[A, bs, L]`` context positions each query sees (``j < a``).
    guessed: ``bool[A, bs]`` slots holding a guessed token instead of MASK (JetSpec++:
      :func:`refine_blocks`, :func:`noisy_context_blocks`), or None.
  """

  anchors: Int[Array, ' anchors']
  keep: Bool[Array, ' anchors']
  tokens: Int[Array, 'anchors T']
  positions: Int[Array, 'anchors T']
  targets: Int[Array, 'anchors T']
  valid: Bool[Array, 'anchors T']
  context_mask: Bool[Array, 'anchors T L']
  guessed: Bool[Array, 'anchors T'] | None = None


def valid_anchor_positions(loss_mask: Array, length: Array) -> Bool[Array, ' L']:
  """Positions ``a`` with ``loss_mask[a] == loss_mask[a+1] == 1`` and ``a + 1 < length``."""
  seq_len = loss_mask.shape[0]
  pos = jnp.arange(seq_len)
  nxt = jnp.concatenate([loss_mask[1:], jnp.zeros((1,), loss_mask.dtype)])
  return (loss_mask > 0) & (nxt > 0) & (pos + 1 < length)


def sample_anchors(key, loss_mask: Array, length: Array, num_anchors: int):
  """Up to ``num_anchors`` valid positions, uniformly without replacement, sorted.

  Returns:
    (anchors ``int32[A]``, keep ``bool[A]``); padding anchors are 0 with ``keep = False``.
  """
  valid = valid_anchor_positions(loss_mask, length)
  # Random priorities; invalid positions rank last. top_k of iid uniforms = a uniform subset.
  scores = jnp.where(valid, jax.random.uniform(key, valid.shape), -1.0)
  top, idx = jax.lax.top_k(scores, min(num_anchors, valid.shape[0]))
  keep = top >= 0.0
  anchors = jnp.where(keep, idx, jnp.iinfo(jnp.int32).max)
  order = jnp.argsort(anchors)
  anchors, keep = anchors[order], keep[order]
  anchors = jnp.where(keep, anchors, 0).astype(jnp.int32)
  if num_anchors > valid.shape[0]:  # more anchors than positions: pad
    pad = num_anchors - valid.shape[0]
    anchors = jnp.concatenate([anchors, jnp.zeros((pad,), jnp.int32)])
    keep = jnp.concatenate([keep, jnp.zeros((pad,), bool)])
  return anchors, keep


def make_blocks(
  key,
  tokens: Int[Array, ' L'],
  loss_mask: Array,
  length: Array,
  *,
  num_anchors: int,
  block_size: int,
  mask_token_id: int,
) -> Blocks:
  """Samples anchors and builds the blocks, targets and masks of one sequence."""
  anchors, keep = sample_anchors(key, loss_mask, length, num_anchors)
  return blocks_at(anchors, keep, tokens, loss_mask, length, block_size, mask_token_id)


def blocks_at(anchors, keep, tokens, loss_mask, length, block_size: int, mask_token_id: int):
  """The blocks ``[x_a, MASK x (bs-1)]`` at given ``anchors`` (``keep``: real blocks)."""
  seq_len = tokens.shape[0]
  slot = jnp.arange(block_size)[None, :]
  positions = anchors[:, None] + slot
  in_range = positions < length
  gathered = jnp.clip(positions, 0, seq_len - 1)
  targets = jnp.where(in_range, tokens[gathered], 0)
  valid = keep[:, None] & (slot > 0) & in_range & (loss_mask[gathered] > 0)
  # Cut at the first invalid slot after the anchor (the anchor slot itself has no loss).
  valid = jnp.cumprod(valid | (slot == 0), axis=1).astype(bool) & (slot > 0)
  anchor_tokens = tokens[jnp.clip(anchors, 0, seq_len - 1)]
  block_tokens = jnp.where(slot == 0, anchor_tokens[:, None], mask_token_id)
  context_mask = jnp.arange(seq_len)[None, None, :] < anchors[:, None, None]
  context_mask = jnp.broadcast_to(context_mask, (anchors.shape[0], block_size, seq_len))
  context_mask = context_mask & keep[:, None, None]
  return Blocks(
    anchors,
    keep,
    block_tokens.astype(jnp.int32),
    positions.astype(jnp.int32),
    targets.astype(jnp.int32),
    valid,
    context_mask,
  )


def every_anchor_blocks(cfg, tokens, loss_mask, length, anchors=None):
  """The block drafting reads at ``anchors`` (``int32[A]``; default every position) of one stored
  sequence (a copy-seeded head's slots hold its seeds), and which of them are valid anchors:
  ``(blocks [A, bs], valid [A])``; an anchor past the sequence is invalid. What the
  teacher-forced walks over a sequence read (``training/walk.py``, ``evaluation/tree_walk.py``)."""
  seq_len = tokens.shape[0]
  if anchors is None:
    anchors = jnp.arange(seq_len, dtype=jnp.int32)
  valid = valid_anchor_positions(loss_mask, length)[jnp.clip(anchors, 0, seq_len - 1)]
  valid = valid & (anchors < seq_len)
  blk = blocks_at(anchors, valid, tokens, loss_mask, length, cfg.block_size, cfg.mask_token_id)
  if cfg.copy_seed:
    blk = copy_seeded_blocks(blk, tokens, cfg.copy_seed)
  return blk, valid


def copy_seeded_blocks(clean: Blocks, tokens: Int[Array, ' L'], max_ngram: int) -> Blocks:
  """The blocks of a copy-seeded head (``DraftHeadConfig.copy_seed``): slot ``i`` of the block
  anchored at ``a`` holds the ``i``-th token of the context's copy candidates
  (:func:`jetspec_jax.prompt_lookup.seed_guesses` over ``x_0 .. x_a``, exactly what drafting
  reads at inference), flagged ``guessed``; slots the copy cannot fill stay MASK. Slots that
  already hold a guess (JetSpec++ refine and noisy blocks) keep it, as
  :func:`jetspec_jax.methods.jetspecpp.draft` fills only the slots its recycled guesses leave
  empty. Targets, validity and masks are the clean block's: the copy comes from tokens at or
  before the anchor, so no label leaks in."""
  depth = clean.tokens.shape[1] - 1
  seed = lambda a: prompt_lookup.seed_guesses(tokens, a, max_ngram=max_ngram, depth=depth)
  guesses = jnp.where(clean.keep[:, None], jax.vmap(seed)(clean.anchors), -1)
  had = jnp.zeros(clean.tokens.shape, bool) if clean.guessed is None else clean.guessed
  filled, guessed = draft_head.fill_slots(clean.tokens, jnp.where(had[:, 1:], -1, guesses))
  return clean._replace(tokens=filled, guessed=guessed | had)


def refine_blocks(
  clean: Blocks,
  guesses: Int[Array, 'anchors depth'],
  tokens: Int[Array, ' L'],
  loss_mask: Array,
  length: Array,
  mask_token_id: int,
  in_round: Bool[Array, ' anchors'] | None = None,
) -> Blocks:
  """JetSpec++ refine blocks: where the next round's block sits after each clean block.

  ``guesses[k]`` is the clean block ``k``'s draft (its argmax at depths ``1..D``, no gradient).
  The round it stands for accepts ``acc`` = the leading run of correct guesses, so the next block
  is anchored at ``a' = a + acc + 1`` (on the committed bonus token ``x_{a'}``), and its slot ``i``
  (position ``a' + i``) holds the old guess for that position (``guesses[k, acc + i]``) while one
  exists, MASK after: exactly what :func:`jetspec_jax.methods.jetspecpp.realign` feeds at
  inference. The block sees context ``< a'`` only, and its guesses depend on context ``< a`` and
  on ``x_a``, so nothing at or after ``a' + 1`` reaches it; a block whose anchor is no valid
  anchor is dropped.
  Where ``in_round``, the block is instead the clean block itself fed its own draft (anchor
  ``a``, slot ``i`` holds ``guesses[k, i-1]``): an in-round refinement pass
  (``refine_passes`` of :func:`jetspec_jax.methods.jetspecpp.refined_logits`).
  """
  bs = clean.tokens.shape[1]
  depth = bs - 1
  correct = (guesses == clean.targets[:, 1:]) & clean.valid[:, 1:]
  accepted = jnp.sum(jnp.cumprod(correct, axis=1), axis=1)
  if in_round is not None:
    accepted = jnp.where(in_round, -1, accepted)  # the same anchor, every slot guessed
  anchors = (clean.anchors + accepted + 1).astype(jnp.int32)
  seq_len = tokens.shape[0]
  ok = valid_anchor_positions(loss_mask, length)[jnp.clip(anchors, 0, seq_len - 1)]
  keep = clean.keep & ok & (anchors < seq_len)
  anchors = jnp.where(keep, anchors, 0)
  blk = blocks_at(anchors, keep, tokens, loss_mask, length, bs, mask_token_id)
  idx = accepted[:, None] + jnp.arange(1, bs)[None]  # slot i's position in the old draft
  have = jnp.concatenate([jnp.zeros((anchors.shape[0], 1), bool), idx < depth], axis=1)
  old = jnp.take_along_axis(guesses, jnp.clip(idx, 0, depth - 1), axis=1)
  slot_tokens = jnp.where(have[:, 1:], old, blk.tokens[:, 1:])
  return blk._replace(
    tokens=jnp.concatenate([blk.tokens[:, :1], slot_tokens], axis=1), guessed=have & keep[:, None]
  )


def noisy_context_blocks(
  clean: Blocks,
  guesses: Int[Array, 'anchors depth'],
  run: Int[Array, ' anchors'],
  truth: Int[Array, ' anchors'],
) -> Blocks:
  """JetSpec++ noisy-context blocks (Jacobi Forcing's noisy context, docs/training.md §6).

  At each clean block's anchor ``a`` (context taps ``< a`` as the clean block's), slots
  ``1..run[k]`` are token-only context: the first ``truth[k]`` of them hold the true tokens
  ``x_{a+i}`` (the part of an unverified trunk that turns out right), the rest the clean block's
  own draft ``guesses[k, i-1]``; the slots after the run hold MASK. Every run slot is flagged
  ``guessed``, as at inference, where the head cannot tell a right guess from a wrong one. A slot
  that holds its true token holds its own target, so it has no loss; the slots after it keep
  theirs (validity is not cut there): they draft under that token-only context.
  """
  bs = clean.tokens.shape[1]
  slot = jnp.arange(bs)[None, :]
  in_run = (slot >= 1) & (slot <= run[:, None])
  true_slot = in_run & (slot <= truth[:, None])
  own = jnp.concatenate([clean.tokens[:, :1], guesses], axis=1)
  tokens = jnp.where(true_slot, clean.targets, jnp.where(in_run, own, clean.tokens))
  return clean._replace(
    tokens=tokens.astype(jnp.int32),
    valid=clean.valid & ~true_slot,
    guessed=in_run & clean.keep[:, None],
  )


def progressive_noise(key, num_blocks: int, block_size: int, window: int):
  """Run lengths and true-token counts of ``num_blocks`` noisy-context blocks.

  The run length is uniform in ``1 .. bs-2`` (at least one MASK slot after it). The noise ratio
  (the share of the run that is the head's own draft) follows Jacobi Forcing's linear
  progressive schedule: block ``n`` has ratio ``((n + phase) mod window + 1) / window``, a ramp
  from easy to hard repeated every ``window`` blocks, with a random ``phase`` per sequence. The
  true tokens are the run's leading ``round((1 - ratio) * run)`` (a converged prefix, as in a
  Jacobi trajectory).

  Returns:
    (run ``int32[num_blocks]``, truth ``int32[num_blocks]``).
  """
  run_key, phase_key = jax.random.split(key)
  run = jax.random.randint(run_key, (num_blocks,), 1, max(block_size - 1, 2))
  phase = jax.random.randint(phase_key, (), 0, window)
  ratio = ((jnp.arange(num_blocks) + phase) % window + 1) / window
  truth = jnp.round((1.0 - ratio) * run).astype(jnp.int32)
  return run.astype(jnp.int32), truth


def depth_weights(block_size: int, gamma: float) -> Array:
  """Per-slot loss weights: ``exp(-(i-1)/gamma)`` for ``i >= 1``; ``gamma == 0`` is uniform."""
  i = jnp.arange(block_size, dtype=jnp.float32)
  if gamma == 0:
    return jnp.ones((block_size,), jnp.float32)
  return jnp.exp(-jnp.maximum(i - 1.0, 0.0) / gamma)
