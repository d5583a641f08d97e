"""Anchor blocks for draft-head training (spec §C.3-C.4).

Per sequence, up to ``num_anchors`` anchors are drawn uniformly without replacement from the valid
positions (``loss_mask[a] == loss_mask[a+1] == 1``: the anchor and its first target are response
tokens, as at inference where the anchor is always a generated token) and sorted. Block ``k`` is
``[x_a, MASK x (bs-1)]`` at positions ``a .. a+bs-1``. Its queries see context positions ``< a``
(strictly: the anchor has no feature row at inference, spec §I.8), their own block causally (or
fully, for the bidirectional baseline) and no other block. Slot ``i >= 1`` predicts ``x_{a+i}``
(teacher: the target's logits at ``a+i-1``); slot 0 has no loss; a slot is valid only inside the
sequence and the response, and validity is cut at the first invalid slot.

Example, ``bs = 3``, anchors at 2 and 5, sequence length 7 (``x`` = visible)::

  keys:           context 0..6          block k=0   block k=1
  query (0, i)    x x . . . . .         causal      .
  query (1, i)    x x x x x . .         .           causal
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

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
  """

  anchors: Int[Array, ' anchors']
  keep: Bool[Array, ' anchors']
  tokens: Int[Array, 'anchors T']
  positions: Int[Array, 'anchors T']
  targets: Int[Array, 'anchors T']
  valid: Bool[Array, 'anchors T']
  context_mask: Bool[Array, 'anchors T L']


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
  seq_len = tokens.shape[0]
  anchors, keep = sample_anchors(key, loss_mask, length, num_anchors)
  slot = jnp.arange(block_size)[None, :]
  positions = anchors[:, None] + slot
  in_range = positions < length
  gathered = jnp.clip(positions, 0, seq_len - 1)
  targets = jnp.where(in_range, tokens[gathered], 0)
  valid = keep[:, None] & (slot > 0) & in_range & (loss_mask[gathered] > 0)
  # Cut at the first invalid slot after the anchor (the anchor slot itself has no loss).
  valid = jnp.cumprod(valid | (slot == 0), axis=1).astype(bool) & (slot > 0)
  block_tokens = jnp.where(slot == 0, tokens[anchors][:, None], mask_token_id)
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


def depth_weights(block_size: int, gamma: float) -> Array:
  """Per-slot loss weights: ``exp(-(i-1)/gamma)`` for ``i >= 1``; ``gamma == 0`` is uniform."""
  i = jnp.arange(block_size, dtype=jnp.float32)
  if gamma == 0:
    return jnp.ones((block_size,), jnp.float32)
  return jnp.exp(-jnp.maximum(i - 1.0, 0.0) / gamma)
