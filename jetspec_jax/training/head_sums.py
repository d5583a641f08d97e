"""The draft head's forward and loss sums over a batch: the frozen target's features (once per
sequence, ``stop_gradient`` at one boundary), the head's blocks on them (clean, JetSpec++'s second
blocks, DSpark's), and the loss sums the train step divides by the global batch's weight."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.methods import dspark
from jetspec_jax.models import decoder
from jetspec_jax.models import draft_head as dh
from jetspec_jax.training import blocks as blocks_lib
from jetspec_jax.training import losses

# The loss's hard labels: the data's tokens, or the target's argmax at every position (greedy
# drafting's answer, also on sampled sequences; needs the features cache, data.compute_features).
LABELS = ('data', 'target_argmax')


@dataclasses.dataclass(frozen=True)
class StepSettings:
  """Static settings of the loss (hashable)."""

  num_anchors: int = 512
  loss: str = 'fkl'
  temperature: float = 1.0
  gamma: float = 0.0
  loss_chunk: int = 64
  remat: bool = True
  consistency_weight: float = 0.3  # JetSpec++ heads only (sequence_sums)
  # 'bfloat16': every head matmul and the vocabulary projection take bfloat16 inputs and
  # accumulate in float32 (models/matmul.py); parameters and optimizer state stay float32.
  compute_dtype: str | None = None
  # Memory for long sequences (the 8B recipe): the global batch runs as ``micro_batches``
  # accumulated slices, and a sequence's blocks ``anchor_chunk`` anchors at a time, each chunk
  # rematerialised (0: all at once; JetSpec / DFlash-style heads). Same sums, less memory.
  micro_batches: int = 1
  anchor_chunk: int = 0


TARGET_ATTENTION_TILE = 256


def target_pass(target: decoder.Target, tokens, taps, batch_sharding=None):
  """The frozen target over ``tokens [B, L]``: (final hidden ``[B, L, D]``, taps ``[B, L, F]``).
  ``batch_sharding``: where the batch lives, held through the target's layers."""
  b, seq_len = tokens.shape
  # Past one attention tile, a cache a tile longer than the sequence: the target's attention then
  # runs tile by tile (decoder.attention_live), memory linear in L, never [L, L] scores per head
  # (nothing here is differentiated).
  tile = TARGET_ATTENTION_TILE
  capacity = (-(-seq_len // tile) + 1) * tile if seq_len > tile else seq_len
  cache = target.make_cache(b, capacity)
  out = target.forward(tokens, cache, taps=taps, activation_sharding=batch_sharding)
  return jax.lax.stop_gradient(out.hidden), jax.lax.stop_gradient(out.taps)


def head_context_kv(params, head_cfg: dh.DraftHeadConfig, features, compute_dtype=None):
  """The head's per-layer context K/V of one sequence's ``features [L, F]`` (shared by every
  block of the sequence, never repeated per block)."""
  module = dh.DraftHeadModule(head_cfg, features.dtype, compute_dtype=compute_dtype)
  return module.apply(
    {'params': dh.backbone_params(params)},
    features[None],
    jnp.arange(features.shape[0])[None],
    method=dh.DraftHeadModule.context_kv,
  )


def head_blocks_on_context(
  params, head_cfg, target: decoder.Target, context_kv, blk: blocks_lib.Blocks, dtype, compute_dtype
):
  """The head's final-normed outputs ``[A, bs, D]`` of blocks over a precomputed context; each
  block's mask keeps only its own context prefix."""
  module = dh.DraftHeadModule(head_cfg, dtype, compute_dtype=compute_dtype)
  x = dh.embed_block(head_cfg, params, target.embed, blk.tokens, blk.guessed)
  return module.apply(
    {'params': dh.backbone_params(params)},
    x.astype(dtype),
    blk.positions,
    *context_kv,
    blk.context_mask,
    dh.in_block_mask(head_cfg),
  )


def head_block_outputs(
  params,
  head_cfg: dh.DraftHeadConfig,
  target: decoder.Target,
  features,
  blk: blocks_lib.Blocks,
  compute_dtype=None,
):
  """The head's final-normed outputs ``[A, bs, D]`` for all blocks of one sequence."""
  context_kv = head_context_kv(params, head_cfg, features, compute_dtype)
  return head_blocks_on_context(
    params, head_cfg, target, context_kv, blk, features.dtype, compute_dtype
  )


def sums_in_chunks(sums_of_blocks, blk: blocks_lib.Blocks, chunk: int) -> losses.LossSums:
  """``sums_of_blocks(blk)`` summed ``chunk`` anchors at a time in a rematerialised scan, so
  one chunk's activations (attention over the whole context included) are alive at a time,
  forward and backward."""
  num_blocks = blk.keep.shape[0]
  if num_blocks % chunk:
    raise ValueError(f'anchor_chunk={chunk} must divide the {num_blocks} anchors of a sequence')
  chunks = jax.tree.map(lambda x: x.reshape((num_blocks // chunk, chunk) + x.shape[1:]), blk)
  return scan_sum(jax.checkpoint(sums_of_blocks), chunks)


def scan_sum(fn, xs):
  """``sum_i fn(xs[i])`` (a pytree) over the leading axis of ``xs``, one slice alive at a time."""

  def body(total, x):
    return jax.tree.map(jnp.add, total, fn(x)), None

  first = jax.eval_shape(fn, jax.tree.map(lambda x: x[0], xs))
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), first)
  total, _ = jax.lax.scan(body, zeros, xs)
  return total


def dspark_blocks(key, tokens, loss_mask, length, head_cfg: dh.DraftHeadConfig, num_anchors: int):
  """A DSpark head's blocks: slot ``k`` predicts ``x_{a+k+1}``, so blocks of ``bs + 1``
  positions give the targets and their first ``bs`` slots are the head's inputs.

  Returns:
    (the ``bs + 1``-slot blocks: targets, validity, keep; the ``bs``-slot input blocks).
  """
  bs = head_cfg.block_size
  blk = blocks_lib.make_blocks(
    key,
    tokens,
    loss_mask,
    length,
    num_anchors=num_anchors,
    block_size=bs + 1,
    mask_token_id=head_cfg.mask_token_id,
  )
  inputs = blk._replace(
    tokens=blk.tokens[:, :bs],
    positions=blk.positions[:, :bs],
    context_mask=blk.context_mask[:, :bs],
  )
  return blk, inputs


def sequence_sums(
  params,
  head_cfg: dh.DraftHeadConfig,
  target: decoder.Target,
  tokens,
  loss_mask,
  length,
  hidden,
  features,
  key,
  settings: StepSettings,
  labels=None,
  draft_vocab=None,
) -> losses.LossSums:
  """Loss sums of one sequence's sampled blocks (docs/training.md §5).

  ``labels [L]`` (default: ``tokens``) are the hard labels of the loss: ``labels[p]`` is what a
  slot at position ``p`` should draft (the target's argmax at ``p - 1`` for greedy drafting, also
  on sampled sequences, whose tokens remain the context). With ``draft_vocab`` (sorted ids
  ``[K]``) the head is scored over those ids only and a label outside them has no loss.
  """
  is_dspark = head_cfg.kind == 'dspark'
  labels = tokens if labels is None else labels
  seq_len = tokens.shape[0]
  project = lambda h: dh.vocab_logits(target, h, draft_vocab, settings.compute_dtype)
  if draft_vocab is None:
    to_draft = lambda ids: ids
  else:
    index = jnp.full((target.cfg.vocab_size,), -1, jnp.int32)
    index = index.at[draft_vocab].set(jnp.arange(draft_vocab.shape[0], dtype=jnp.int32))
    to_draft = lambda ids: index[ids]

  def label_at(positions, valid):
    return jnp.where(valid, to_draft(labels[jnp.clip(positions, 0, seq_len - 1)]), 0)

  outputs = lambda blk: head_block_outputs(
    params, head_cfg, target, features, blk, settings.compute_dtype
  )
  if is_dspark != (settings.loss == 'dspark'):
    raise ValueError(
      f'a {head_cfg.kind} head cannot train with loss={settings.loss!r} '
      "(loss='dspark' trains exactly the DSpark heads)"
    )
  span = head_cfg.block_size + int(is_dspark)
  weights = blocks_lib.depth_weights(span, settings.gamma)
  if settings.anchor_chunk and head_cfg.kind in ('dspark', 'jetspecpp'):
    raise ValueError(f'anchor_chunk is for JetSpec / DFlash-style heads, not {head_cfg.kind!r}')
  if is_dspark:
    bs = head_cfg.block_size
    blk, inputs = dspark_blocks(key, tokens, loss_mask, length, head_cfg, settings.num_anchors)
    out = outputs(inputs)
    teacher = hidden[jnp.clip(inputs.positions, 0, seq_len - 1)]
    return losses.dspark_block_losses(
      out,
      teacher,
      blk.targets[:, :bs],  # x_{a+k}: the anchor, then the true tokens
      label_at(blk.positions[:, 1:], blk.valid[:, 1:]),
      blk.valid[:, 1:],
      blk.keep,
      lm_head=project,
      markov_bias=lambda prev: dspark.markov_bias(params, prev, draft_vocab),
      confidence_logits=lambda h, prev: dspark.confidence_logits(params, h, prev),
      weights=weights[1:],
      chunk=settings.loss_chunk,
      remat=settings.remat,
    )
  refine = head_cfg.kind == 'jetspecpp'
  if refine and settings.num_anchors < 2:
    raise ValueError('a jetspecpp head trains on pairs of blocks: num_anchors must be >= 2')
  blk = blocks_lib.make_blocks(
    key,
    tokens,
    loss_mask,
    length,
    num_anchors=settings.num_anchors // 2 if refine else settings.num_anchors,
    block_size=span,
    mask_token_id=head_cfg.mask_token_id,
  )
  unseeded = blk  # JetSpec++ builds its second blocks from the MASK blocks, then seeds them
  if head_cfg.copy_seed:  # slots hold the context's copy candidates, as drafting feeds them
    blk = blocks_lib.copy_seeded_blocks(blk, tokens, head_cfg.copy_seed)

  def sums_of(blk, out):
    teacher = hidden[jnp.clip(blk.positions - 1, 0, seq_len - 1)]
    return losses.block_losses(
      out,
      teacher,
      label_at(blk.positions, blk.valid),
      blk.valid,
      blk.keep,
      lm_head=project,
      weights=weights,
      loss=settings.loss,
      temperature=settings.temperature,
      chunk=settings.loss_chunk,
      remat=settings.remat,
    )

  if settings.anchor_chunk and not refine:
    context_kv = head_context_kv(params, head_cfg, features, settings.compute_dtype)
    on_context = lambda b: head_blocks_on_context(
      params, head_cfg, target, context_kv, b, features.dtype, settings.compute_dtype
    )
    return sums_in_chunks(lambda b: sums_of(b, on_context(b)), blk, settings.anchor_chunk)
  out = outputs(blk)
  sums = sums_of(blk, out)
  if not refine:
    return sums
  # JetSpec++: half the anchors are clean blocks, each followed by a second block seeded with
  # the clean block's own draft (no gradient through the seed): see second_block_outputs.
  second, second_out = second_block_outputs(
    head_cfg, tokens, loss_mask, length, unseeded, out, key, outputs, project, draft_vocab
  )
  refined = sums_of(second, second_out)
  # Consistency (XPress-style, docs/training.md §6): plain MASK drafting is pulled toward the
  # stop-gradient output of its in-round refinement, the better-informed pass at the same slots.
  pairs = np.flatnonzero(second_block_kinds(blk.keep.shape[0]) == 'in_round')
  consistency, _ = losses.consistency_sums(
    out[pairs],
    second_out[pairs],
    blk.valid[pairs] & second.valid[pairs],
    lm_head=project,
    weights=weights,
    chunk=settings.loss_chunk,
    remat=settings.remat,
  )
  # The logged accuracy and expected tau stay those of plain (MASK) drafting, comparable with a
  # JetSpec head's (refined accuracy: evaluate with generate).
  return sums._replace(
    loss=sums.loss + refined.loss + settings.consistency_weight * consistency,
    weight=sums.weight + refined.weight,
  )


# The second block after clean block k is of kind SECOND_BLOCK_CYCLE[k % 4]: a static pattern,
# so every kind has a fixed count per sequence (anchors are random positions, so the pattern
# picks blocks at random).
SECOND_BLOCK_CYCLE = ('in_round', 'noisy', 'next_round', 'next_round')
NOISE_WINDOW = 4  # Jacobi Forcing's progressive window (blocks), blocks_lib.progressive_noise


def second_block_kinds(num_blocks: int) -> np.ndarray:
  """The kinds of ``num_blocks`` second blocks (``SECOND_BLOCK_CYCLE`` repeated)."""
  return np.array([SECOND_BLOCK_CYCLE[k % len(SECOND_BLOCK_CYCLE)] for k in range(num_blocks)])


def second_block_outputs(
  head_cfg,
  tokens,
  loss_mask,
  length,
  clean: blocks_lib.Blocks,
  out,
  key,
  outputs,
  project,
  draft_vocab=None,
):
  """The JetSpec++ second blocks after ``clean`` blocks (MASK slots) whose head outputs are
  ``out``, and their head outputs (``outputs(blocks)``; ``project`` scores outputs over the draft
  vocabulary ``draft_vocab``, None: all ids); a copy-seeded head's slots left without a guess
  then take the copy candidates at their anchor. By :func:`second_block_kinds`:

  * ``'next_round'``: the block the next round drafts, anchored where the clean block's greedy
    chain stops and seeded with its leftover draft (:func:`blocks_lib.refine_blocks`);
  * ``'in_round'``: the clean block again, every slot holding its own draft (a refine pass);
  * ``'noisy'``: the clean block with a token-only run of true tokens then own-draft tokens
    after the anchor, on the progressive schedule (:func:`blocks_lib.noisy_context_blocks`).
  """
  num_blocks = clean.keep.shape[0]
  kinds = second_block_kinds(num_blocks)
  draft = project(jax.lax.stop_gradient(out[:, 1:]))
  guesses = jnp.argmax(draft, axis=-1).astype(jnp.int32)
  if draft_vocab is not None:
    guesses = draft_vocab[guesses]
  refine = blocks_lib.refine_blocks(
    clean,
    guesses,
    tokens,
    loss_mask,
    length,
    head_cfg.mask_token_id,
    jnp.asarray(kinds == 'in_round'),
  )
  noisy_index = np.flatnonzero(kinds == 'noisy')
  if noisy_index.size:
    run, truth = blocks_lib.progressive_noise(
      jax.random.fold_in(key, 2), noisy_index.size, head_cfg.block_size, NOISE_WINDOW
    )
    zeros = jnp.zeros((num_blocks,), jnp.int32)
    noisy = blocks_lib.noisy_context_blocks(
      clean, guesses, zeros.at[noisy_index].set(run), zeros.at[noisy_index].set(truth)
    )
    is_noisy = jnp.asarray(kinds == 'noisy')
    refine = jax.tree.map(
      lambda a, b: jnp.where(is_noisy.reshape((-1,) + (1,) * (a.ndim - 1)), a, b), noisy, refine
    )
  if head_cfg.copy_seed:  # the slots still without a guess take the copy candidates
    refine = blocks_lib.copy_seeded_blocks(refine, tokens, head_cfg.copy_seed)
  return refine, outputs(refine)


def batch_sums(
  params,
  head_cfg: dh.DraftHeadConfig,
  target: decoder.Target,
  batch: dict,
  key,
  settings: StepSettings,
  draft_vocab=None,
  batch_sharding=None,
) -> losses.LossSums:
  """Loss sums of a batch (:func:`make_train_step`'s ``batch``), summed over its sequences.

  The target runs only when the batch carries no stored ``features``. ``batch_sharding``: where
  per-sequence arrays live (the batch axis over ``'data'``), held there so that FSDP-sharded
  weights are gathered rather than the batch.
  """
  if batch_sharding is not None:
    pin = lambda x: jax.lax.with_sharding_constraint(x, batch_sharding)
    batch = jax.tree.map(pin, batch)
  else:
    pin = lambda x: x
  num_tap_features = head_cfg.num_taps * head_cfg.hidden_size
  if 'features' in batch:
    stored = jax.lax.stop_gradient(batch['features'].astype(target.dtype))
    hidden, features = stored[..., num_tap_features:], stored[..., :num_tap_features]
  else:
    hidden, features = target_pass(
      target, batch['tokens'], head_cfg.target_layer_ids, batch_sharding
    )
  hidden, features = pin(hidden), pin(features)
  keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(batch['index'])

  def one(tokens, loss_mask, length, hidden, features, key, labels):
    return sequence_sums(
      params,
      head_cfg,
      target,
      tokens,
      loss_mask,
      length,
      hidden,
      features,
      key,
      settings,
      labels=labels,
      draft_vocab=draft_vocab,
    )

  labels = batch.get('labels', batch['tokens'])
  sums = jax.vmap(one)(
    batch['tokens'], batch['loss_mask'], batch['lengths'], hidden, features, keys, labels
  )
  return jax.tree.map(lambda x: jnp.sum(x, axis=0), sums)


def sums_metrics(sums: losses.LossSums) -> dict:
  """Loss, per-depth accuracy (depth 1 .. max) and expected chain tau of summed loss sums."""
  count = jnp.maximum(sums.count, 1)
  return dict(
    loss=sums.loss / jnp.maximum(sums.weight, 1e-9),
    accuracy=(sums.correct / count)[1:],
    expected_tau=1.0 + sums.accepted / jnp.maximum(sums.blocks, 1),
  )
