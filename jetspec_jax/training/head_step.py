"""The jitted train step and the fit loop: ``train_step(state, batch, key) -> (state, metrics)`` is
one ``jit`` (donating the state) over the whole ``('data', 'model')`` mesh. The batch is split over
``'data'``; the target, the head and its optimizer state are placed by the inference partition
rules (tensor parallel over ``'model'``; FSDP over ``'data'`` on request); the loss is a sum over
the global batch divided by its active-slot weight, so any mesh computes the 1-device step."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from jetspec_jax import sharding
from jetspec_jax.models import decoder
from jetspec_jax.models import draft_head as dh
from jetspec_jax.training import head_sums
from jetspec_jax.training.loop import (
  TrainState,
  init_state,
  train_loop,
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
  settings: head_sums.StepSettings,
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
        sums = head_sums.batch_sums(
          params, head_cfg, tgt, micro_batch, key, settings, draft_vocab, batch_placement
        )
        return sums.loss, sums

      grads, sums = jax.grad(loss_fn, has_aux=True)(state.params)
      # Gradients where their parameters live (with FSDP: reduce-scattered, never whole).
      return jax.lax.with_sharding_constraint(grads, grad_placement), sums

    if micro == 1:
      grads, sums = grad_sums(batch)
    else:
      grads, sums = head_sums.scan_sum(grad_sums, split_micro_batches(batch, micro))
    weight = jnp.maximum(sums.weight, 1e-9)
    grads = jax.tree.map(lambda g: g / weight, grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(
      **head_sums.sums_metrics(sums),
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
  settings: head_sums.StepSettings,
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
    return head_sums.sums_metrics(
      head_sums.batch_sums(params, head_cfg, tgt, batch, key, settings, vocab)
    )

  def evaluate(params):
    metrics = sharding.to_host(run(params, target.params, vocab))
    return {prefix + k: v for k, v in metrics.items()}

  return evaluate


def fit(
  target: decoder.Target,
  head_cfg: dh.DraftHeadConfig,
  batches,
  workdir: str,
  *,
  steps: int,
  optimizer,
  settings: head_sums.StepSettings,
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
