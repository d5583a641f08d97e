"""The one host training loop (draft heads and target LMs): state, optimizer, resume, guard, log.

``train_loop`` resumes from the latest checkpoint in ``workdir`` if there is one (else it starts
from the state it is given: ``init_from`` weights or a seeded init, the caller's choice), runs
``step_fn(state, batch_of(step), step) -> (state, metrics)`` to ``steps``, stops on the first
non-finite loss (checked every step), writes metrics as JSON lines and TensorBoard events at
log steps, and saves Orbax checkpoints (params, optimizer state and step; the data position of a
resumed run is its step, since ``batch_of`` is a pure function of it).
"""

import json
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from etils import epath
from tensorboardX import SummaryWriter

from jetspec_jax import sharding
from jetspec_jax.training import checkpoint as ckpt


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any

  def to_dict(self) -> dict:
    return dict(step=self.step, params=self.params, opt_state=self.opt_state)


def make_schedule(
  *, lr: float, steps: int, warmup_steps: int, final_lr_ratio: float = 0.0
) -> optax.Schedule:
  """Linear warmup to ``lr``, then cosine decay to ``lr * final_lr_ratio`` at ``steps``."""
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=lr,
    warmup_steps=max(1, warmup_steps),
    decay_steps=max(steps, warmup_steps + 1),
    end_value=lr * final_lr_ratio,
  )


def make_optimizer(
  *,
  lr: float,
  steps: int,
  warmup_steps: int,
  weight_decay: float = 0.0,
  grad_clip: float = 1.0,
  final_lr_ratio: float = 0.0,
):
  """AdamW on :func:`make_schedule` with global-norm clipping."""
  schedule = make_schedule(
    lr=lr, steps=steps, warmup_steps=warmup_steps, final_lr_ratio=final_lr_ratio
  )
  return optax.chain(
    optax.clip_by_global_norm(grad_clip), optax.adamw(schedule, weight_decay=weight_decay)
  )


def duration(seconds: float) -> str:
  """``'1h05m'``, ``'4m10s'``, ``'12s'``."""
  seconds = int(round(seconds))
  if seconds >= 3600:
    return f'{seconds // 3600}h{seconds % 3600 // 60:02d}m'
  if seconds >= 60:
    return f'{seconds // 60}m{seconds % 60:02d}s'
  return f'{seconds}s'


def init_state(params, optimizer) -> TrainState:
  return TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params))


class MetricWriter:
  """Metrics to ``workdir/metrics.jsonl`` and TensorBoard event files; vectors become
  ``name/depth{i+1}`` scalars. Only process 0 writes (the others' records are the same)."""

  def __init__(self, workdir: epath.Path):
    self._active = sharding.is_main_process()
    if self._active:
      self._jsonl = (workdir / 'metrics.jsonl').open('a')
      self._tb = SummaryWriter(str(workdir / 'tensorboard'))

  def write(self, step: int, metrics: dict) -> None:
    if not self._active:
      return
    flat = {}
    for name, value in metrics.items():
      value = np.asarray(value)
      if value.ndim == 0:
        flat[name] = float(value)
      else:
        flat.update({f'{name}/depth{i + 1}': float(v) for i, v in enumerate(value)})
    for name, value in flat.items():
      self._tb.add_scalar(name, value, step)
    self._jsonl.write(json.dumps({'step': step, **flat}) + '\n')
    self._jsonl.flush()

  def close(self):
    if not self._active:
      return
    self._jsonl.close()
    self._tb.close()


def train_loop(
  step_fn: Callable,
  state: TrainState,
  batch_of: Callable[[int], Any],
  workdir: str | pathlib.Path,
  *,
  steps: int,
  log_every: int = 10,
  checkpoint_every: int = 100,
  stop_after: int | None = None,
  tokens_of: Callable[[Any], int] | None = None,
  evaluate: Callable[[Any], dict] | None = None,
  eval_every: int = 0,
  max_to_keep: int = 3,
  state_sharding: jax.sharding.Sharding | None = None,
  learning_rate: Callable[[int], Any] | None = None,
) -> tuple[TrainState, list[dict]]:
  """Runs ``step_fn`` from the resumed (or given) state to ``steps``.

  Args:
    step_fn: ``(state, batch, step) -> (state, metrics)`` with ``metrics['loss']`` a scalar.
    state: the starting state if ``workdir`` holds no checkpoint (its structure is the restore
      target otherwise).
    batch_of: the batch of a step (pure in the step).
    workdir: checkpoints, ``metrics.jsonl`` and TensorBoard events go here.
    steps: total steps of the run.
    log_every: steps between metric records (and the last step).
    checkpoint_every: steps between checkpoints (and the last step).
    stop_after: end the run early at that step, after checkpointing it (kill/resume tests).
    tokens_of: tokens in a batch (logged as ``tokens_per_s``).
    evaluate: ``params -> metrics`` added to a log record every ``eval_every`` steps (and last).
    eval_every: see ``evaluate`` (0: only at the last step).
    max_to_keep: checkpoints kept.
    state_sharding: where the state lives during the run (e.g. replicated over the training
      mesh); a checkpoint is restored straight onto it, whatever devices wrote it, so a run
      resumes on another device count or mesh.
    learning_rate: the optimizer's schedule (``step -> lr``), logged as ``learning_rate``.

  Each log line says the step out of the total, the seconds per step and the time left.

  Returns:
    (final state, the logged records).

  Raises:
    FloatingPointError: a non-finite loss (at the step it appeared; the last checkpoint is
      intact).
  """
  workdir = epath.Path(workdir)  # a local path or gs://...
  workdir.mkdir(parents=True, exist_ok=True)
  mngr = ckpt.manager(workdir, max_to_keep=max_to_keep)
  if state_sharding is not None:
    if jax.process_count() > 1:
      state = sharding.to_host(state)  # one process's arrays cannot move onto another's devices
    state = jax.device_put(state, state_sharding)
  restored = ckpt.restore_latest(mngr, ckpt.abstract_like(state.to_dict()))
  if restored is not None:
    state = TrainState(**restored)
  writer = MetricWriter(workdir)
  history = []
  last = min(steps, stop_after) if stop_after is not None else steps
  tick, tokens = time.perf_counter(), 0
  run_start, first = tick, int(state.step)
  try:
    for step in range(int(state.step), last):
      batch = batch_of(step)
      state, metrics = step_fn(state, batch, step)
      metrics = sharding.to_host(metrics)  # syncs every step (safe with many devices)
      if not math.isfinite(float(metrics['loss'])):
        raise FloatingPointError(f'non-finite loss {metrics["loss"]} at step {step}')
      tokens += tokens_of(batch) if tokens_of else 0
      done = step + 1
      if done % log_every == 0 or done == last:
        elapsed = time.perf_counter() - tick
        record = dict(metrics)
        if tokens_of:
          record['tokens_per_s'] = tokens / max(elapsed, 1e-9)
        if learning_rate is not None:
          record['learning_rate'] = float(learning_rate(done))
        if evaluate is not None and (done == steps or (eval_every and done % eval_every == 0)):
          record.update(evaluate(state.params))
        writer.write(done, record)
        history.append({'step': done, **jax.tree.map(np.asarray, record)})
        per_step = (time.perf_counter() - run_start) / (done - first)
        logging.info(
          'step %d/%d (%.3g s/step, %s left) %s',
          done,
          last,
          per_step,
          duration(per_step * (last - done)),
          ' '.join(f'{k} {float(v):.4g}' for k, v in record.items() if np.ndim(v) == 0),
        )
        tick, tokens = time.perf_counter(), 0
      if done % checkpoint_every == 0 or done == last:
        ckpt.save(mngr, done, state.to_dict())
  finally:
    writer.close()
    mngr.close()
  return state, history
