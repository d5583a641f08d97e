"""Draft-head losses: forward KL to the target at temperature T, or hard-label CE
(docs/training.md §4); and DSpark's ``0.1 CE + 0.9 TV + 1.0 BCE(confidence, 1 - TV)``
(:func:`dspark_block_losses`).

``L = T^2 * sum_m w_m KL(softmax(z_p[m]/T) || softmax(z_q[m]/T)) / sum_m w_m`` over active slots
(non-anchor, valid), where ``z_p`` are the target's logits at position ``a+i-1`` and ``z_q`` the
head's at slot ``i``. Vocabulary-sized logits are made a chunk of anchors at a time, in float32,
inside a rematerialised scan, so those of all blocks never sit in memory together (forward or
backward).
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jetspec_jax.typing import Array

LOSSES = ('fkl', 'tvd', 'ce', 'dspark')
DSPARK_WEIGHTS = dict(ce=0.1, tv=0.9, confidence=1.0)


class LossSums(NamedTuple):
  """Sums over one batch shard (divide after summing across devices).

  Attributes:
    loss: sum of weighted per-slot losses.
    weight: sum of weights of active slots.
    correct: ``[bs]`` per-depth count of head argmax == target argmax (``'fkl'``) or == the
      data's token (``'ce'``; the same for greedy data, where the data is the target's argmax).
    count: ``[bs]`` per-depth count of active slots.
    accepted: sum over blocks of the leading run of correct slots (chain acceptance).
    blocks: number of real blocks.
  """

  loss: Array
  weight: Array
  correct: Array
  count: Array
  accepted: Array
  blocks: Array


def _chunk_sums(per_slot, w, correct, valid, leading):
  """One chunk's sums: weighted loss, weight, per-slot correct and valid counts, and the
  leading run of correct slots (``leading`` selects the slots that count toward it)."""
  run = jnp.sum(jnp.cumprod(leading, axis=1), axis=1)
  return (jnp.sum(w * per_slot), jnp.sum(w), jnp.sum(correct, 0), jnp.sum(valid, 0), jnp.sum(run))


def _scan_chunks(one_chunk, arrays, num_slots: int, chunk: int, remat: bool):
  """Sums ``one_chunk(xs) -> sums`` over ``arrays`` (leading axis ``A``) ``chunk`` at a time,
  each chunk's vocabulary-sized logits made inside the scan (rematerialised with ``remat``).

  Returns:
    (loss, weight, correct ``[num_slots]``, count ``[num_slots]``, accepted).
  """
  a = arrays[0].shape[0]
  chunk = math.gcd(a, max(1, min(chunk, a)))

  def body(carry, xs):
    return jax.tree.map(jnp.add, carry, one_chunk(*xs)), None

  init = (
    jnp.float32(0),
    jnp.float32(0),
    jnp.zeros((num_slots,), jnp.int32),
    jnp.zeros((num_slots,), jnp.int32),
    jnp.int32(0),
  )
  xs = tuple(x.reshape((a // chunk, chunk) + x.shape[1:]) for x in arrays)
  sums, _ = jax.lax.scan(jax.checkpoint(body) if remat else body, init, xs)
  return sums


def _depth_sums(sums, keep) -> LossSums:
  """:class:`LossSums` of scanned sums over slots for depths 1 .. n: the per-depth counts get
  a leading 0, so index ``k`` is depth ``k`` (as they are read)."""
  loss_sum, weight_sum, correct, count, accepted = sums
  lead = jnp.zeros((1,), jnp.int32)
  return LossSums(
    loss_sum,
    weight_sum,
    jnp.concatenate([lead, correct]),
    jnp.concatenate([lead, count]),
    accepted,
    jnp.sum(keep),
  )


def block_losses(
  head_hidden: Array,
  teacher_hidden: Array,
  targets: Array,
  valid: Array,
  keep: Array,
  *,
  lm_head: Callable[[Array], Array],
  weights: Array,
  loss: str = 'fkl',
  temperature: float = 1.0,
  chunk: int = 64,
  remat: bool = True,
) -> LossSums:
  """Loss sums for ``A`` blocks of one sequence.

  Args:
    head_hidden: ``[A, bs, D]`` the head's final-normed outputs.
    teacher_hidden: ``[A, bs, D]`` the target's final-normed hidden at ``a+i-1``.
    targets: ``int32[A, bs]`` ``x_{a+i}`` (the hard labels: indices into ``lm_head``'s
      output; ``-1`` where the label is outside a reduced draft vocabulary: no loss there, and
      never correct).
    valid: ``bool[A, bs]`` active slots.
    keep: ``bool[A]`` real blocks.
    lm_head: hidden ``[..., D]`` -> logits ``[..., V]`` (the target's frozen head).
    weights: ``[bs]`` depth weights.
    loss: ``'fkl'`` (forward KL to the target's distribution), ``'tvd'`` (total variation
      distance to it, the other loss online speculative decoding compares) or ``'ce'``.
    temperature: distillation temperature (``'fkl'``, ``'tvd'``).
    chunk: anchors per chunk (rounded down to a divisor of ``A``).
    remat: recompute each chunk's logits in the backward pass instead of keeping them (bounds
      accelerator memory; on a CPU with room to spare, ``False`` skips the recomputation).
  """
  if loss not in ('fkl', 'tvd', 'ce'):
    raise ValueError(
      f"loss must be 'fkl', 'tvd' or 'ce' here ('dspark': dspark_block_losses), got {loss!r}"
    )
  # The anchor slot has no loss: it is never projected onto the vocabulary.
  head_hidden, teacher_hidden = head_hidden[:, 1:], teacher_hidden[:, 1:]
  targets, valid, weights = targets[:, 1:], valid[:, 1:], weights[1:]
  depth = head_hidden.shape[1]

  def one_chunk(hh, th, tgt, vld):
    zq = lm_head(hh).astype(jnp.float32)
    if loss == 'fkl':
      zp = jax.lax.stop_gradient(lm_head(th).astype(jnp.float32))
      log_q = jax.nn.log_softmax(zq / temperature, axis=-1)
      log_p = jax.nn.log_softmax(zp / temperature, axis=-1)
      per_slot = temperature**2 * jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
      label, labelled = jnp.argmax(zp, -1), vld
    elif loss == 'tvd':
      zp = jax.lax.stop_gradient(lm_head(th).astype(jnp.float32))
      q = jax.nn.softmax(zq / temperature, axis=-1)
      p = jax.nn.softmax(zp / temperature, axis=-1)
      per_slot = 0.5 * jnp.sum(jnp.abs(p - q), axis=-1)
      label, labelled = jnp.argmax(zp, -1), vld
    else:  # no teacher logits: the label is the data's token
      log_q = jax.nn.log_softmax(zq, axis=-1)
      labelled = vld & (tgt >= 0)
      picked = jnp.take_along_axis(log_q, jnp.maximum(tgt, 0)[..., None], axis=-1)[..., 0]
      per_slot = jnp.where(labelled, -picked, 0.0)
      label = tgt
    w = jnp.where(labelled, weights[None, :], 0.0)
    correct = (jnp.argmax(zq, -1) == label) & labelled
    return _chunk_sums(per_slot, w, correct, vld, correct)

  arrays = (head_hidden, teacher_hidden, targets, valid)
  return _depth_sums(_scan_chunks(one_chunk, arrays, depth, chunk, remat), keep)


def consistency_sums(
  student_hidden: Array,
  reference_hidden: Array,
  valid: Array,
  *,
  lm_head: Callable[[Array], Array],
  weights: Array,
  chunk: int = 64,
  remat: bool = True,
) -> tuple[Array, Array]:
  """``(sum_m w_m KL(softmax(z_ref[m]) || softmax(z_student[m])), sum_m w_m)`` over ``valid``
  slots, with no gradient through the reference (a head's own better-informed pass).

  Args:
    student_hidden, reference_hidden: ``[A, bs, D]`` head outputs at the same positions.
    valid: ``bool[A, bs]`` slots that count.
    lm_head, weights, chunk, remat: as :func:`block_losses`.
  """
  bs = student_hidden.shape[1]

  def one_chunk(sh, rh, vld):
    log_q = jax.nn.log_softmax(lm_head(sh).astype(jnp.float32), axis=-1)
    log_p = jax.lax.stop_gradient(jax.nn.log_softmax(lm_head(rh).astype(jnp.float32), axis=-1))
    per_slot = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    none = jnp.zeros_like(vld)
    return _chunk_sums(per_slot, jnp.where(vld, weights[None, :], 0.0), none, vld, none)

  arrays = (student_hidden, reference_hidden, valid)
  loss_sum, weight_sum, *_ = _scan_chunks(one_chunk, arrays, bs, chunk, remat)
  return loss_sum, weight_sum


def dspark_block_losses(
  head_hidden: Array,
  teacher_hidden: Array,
  previous: Array,
  targets: Array,
  valid: Array,
  keep: Array,
  *,
  lm_head: Callable[[Array], Array],
  markov_bias: Callable[[Array], Array],
  confidence_logits: Callable[[Array, Array], Array],
  weights: Array,
  chunk: int = 64,
  remat: bool = True,
) -> LossSums:
  """DSpark's loss sums for ``A`` blocks of one sequence (every slot predicts; docs/training.md §4).

  Per slot ``k``: the draft distribution ``p_d = softmax(U_k + W1[x_{k-1}] W2)`` with the Markov
  bias teacher-forced on the true previous token, the teacher's ``p_t`` (temperature 1),
  ``TV = 0.5 |p_d - p_t|_1`` and the confidence ``c_k = sigmoid(w . [h_k; W1[x_{k-1}]])``;
  ``loss = 0.1 CE(p_d, x_{k+1}) + 0.9 TV + 1.0 BCE(c_k, stop_gradient(1 - TV))``, weighted by
  ``weights[k]``.

  Args:
    head_hidden: ``[A, gamma, D]`` the backbone's outputs (slot ``k`` predicts ``x_{a+k+1}``).
    teacher_hidden: ``[A, gamma, D]`` the target's final hidden at ``a+k``.
    previous: ``int32[A, gamma]`` ``x_{a+k}`` (slot 0: the anchor).
    targets: ``int32[A, gamma]`` ``x_{a+k+1}``.
    valid, keep, lm_head, weights, chunk, remat: as :func:`block_losses`.
    markov_bias: previous tokens ``[...]`` -> bias ``[..., V]``.
    confidence_logits: (hidden ``[..., D]``, previous ``[...]``) -> logits ``[...]``.

  Returns:
    :class:`LossSums` whose per-depth counts have a leading 0 (index ``k`` = depth ``k``, as
    for the other heads).
  """
  gamma = head_hidden.shape[1]
  w_ce, w_tv, w_conf = DSPARK_WEIGHTS['ce'], DSPARK_WEIGHTS['tv'], DSPARK_WEIGHTS['confidence']

  def one_chunk(hh, th, prev, tgt, vld):
    zq = lm_head(hh).astype(jnp.float32) + markov_bias(prev)
    zp = jax.lax.stop_gradient(lm_head(th).astype(jnp.float32))
    log_q = jax.nn.log_softmax(zq, axis=-1)
    p_t = jax.nn.softmax(zp, axis=-1)
    picked = jnp.take_along_axis(log_q, jnp.maximum(tgt, 0)[..., None], axis=-1)[..., 0]
    ce = jnp.where(tgt >= 0, -picked, 0.0)  # -1: outside a reduced draft vocabulary
    tv = 0.5 * jnp.sum(jnp.abs(jnp.exp(log_q) - p_t), axis=-1)
    label = jax.lax.stop_gradient(1.0 - tv)
    z = confidence_logits(hh, prev)
    bce = -(label * jax.nn.log_sigmoid(z) + (1.0 - label) * jax.nn.log_sigmoid(-z))
    per_slot = w_ce * ce + w_tv * tv + w_conf * bce
    w = jnp.where(vld, weights[None, :], 0.0)
    correct = (jnp.argmax(zq, -1) == tgt) & vld
    return _chunk_sums(per_slot, w, correct, vld, correct)

  arrays = (head_hidden, teacher_hidden, previous, targets, valid)
  return _depth_sums(_scan_chunks(one_chunk, arrays, gamma, chunk, remat), keep)
