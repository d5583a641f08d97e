"""Online adaptation of a draft head to the prompts it serves (online speculative decoding, OSD).

An :class:`Adapter` wraps generation: every served sequence (prompt + the target's own output)
goes into a bounded replay buffer, and every ``update_every`` served prompts the head takes
``steps`` optimizer steps on the buffer with the offline training loss, then is swapped in. The
target is never changed and every round is still verified by it, so the output is the target's
whatever the head (greedy: token for token; sampled: its distribution; docs/design.md §5).

Each update is scored on a slice of the buffer held out from training (the head's expected chain
tau, teacher-forced on the same anchors every time); an update that lowers it is rolled back, so
the head never gets worse on what was served for long. The adapter's state (head, optimizer,
buffer, counters) saves with Orbax and restores; a checkpoint that is partial or whose files do
not match their checksums is refused with a clear error.

Greedy serving distils the target's argmax (cross-entropy on the served tokens, which are the
target's greedy choices); sampled serving its distribution at the served positions (forward KL
or total variation distance, ``OnlineConfig.sampled_loss``), as OSD compares. The target's
features are computed by one teacher-forced forward per served sequence, cached in the buffer
(``features='cache'``) or recomputed in every step (``'recompute'``: no memory per sequence).
"""

import dataclasses
import functools
import json
import os
import pathlib
import shutil
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from jetspec_jax import decoding, sharding
from jetspec_jax import methods as methods_lib
from jetspec_jax.evaluation import provenance
from jetspec_jax.models import decoder
from jetspec_jax.models import draft_head as draft_head_lib
from jetspec_jax.training import checkpoint as ckpt
from jetspec_jax.training import head_step, head_sums
from jetspec_jax.training.loop import TrainState

STATE_DIR = 'state'
BUFFER_FILE = 'buffer.npz'
META_FILE = 'adapter.json'
FEATURE_MODES = ('cache', 'recompute')
SAMPLED_LOSSES = ('fkl', 'tvd')
FEATURE_BUCKET = 128  # served sequences are padded to a multiple of it for their target forward


class CheckpointError(ValueError):
  """An adapter checkpoint that is missing files or whose files do not match their checksums."""


@dataclasses.dataclass(frozen=True)
class OnlineConfig:
  """How the head learns while it serves.

  Attributes:
    update_every: served prompts between updates.
    steps: optimizer steps per update.
    batch_size: buffered sequences per step.
    num_anchors: blocks per sequence per step (as offline training's ``train.num_anchors``).
    lr: AdamW learning rate (constant).
    grad_clip: global-norm clip of the gradients.
    buffer_size: training sequences kept (the oldest leave first).
    holdout_every: every ``holdout_every``-th served sequence is held out to score updates
      (0: no held-out slice, every update is kept).
    holdout_size: held-out sequences kept (the oldest leave first).
    tolerance: an update is kept when the held-out expected tau is at least ``before -
      tolerance``.
    max_len: tokens per buffered sequence (prompt + output; longer ones keep their first
      ``max_len``); the static length of every step.
    sampled_loss: the loss of sequences served by sampling: ``'fkl'`` or ``'tvd'``.
    gamma: depth weights ``exp(-(k-1)/gamma)`` (0: equal), as offline training.
    features: ``'cache'`` (one target forward per served sequence, kept in the buffer) or
      ``'recompute'`` (the target runs in every step).
    seed: the batches' and anchors' randomness.
  """

  update_every: int = 8
  steps: int = 8
  batch_size: int = 4
  num_anchors: int = 16
  lr: float = 1e-4
  grad_clip: float = 1.0
  buffer_size: int = 128
  holdout_every: int = 4
  holdout_size: int = 16
  tolerance: float = 0.0
  max_len: int = 512
  sampled_loss: str = 'fkl'
  gamma: float = 4.0
  features: str = 'cache'
  seed: int = 0

  def __post_init__(self):
    positive = ('update_every', 'steps', 'batch_size', 'num_anchors', 'buffer_size', 'max_len')
    for name in positive:
      if getattr(self, name) < 1:
        raise ValueError(f'OnlineConfig.{name} must be >= 1, got {getattr(self, name)}')
    if self.holdout_every < 0 or self.holdout_size < 1:
      raise ValueError(f'{self.holdout_every=} must be >= 0 and {self.holdout_size=} >= 1')
    if not self.lr > 0 or self.tolerance < 0:
      raise ValueError(f'{self.lr=} must be > 0 and {self.tolerance=} >= 0')
    if self.sampled_loss not in SAMPLED_LOSSES:
      raise ValueError(f'sampled_loss must be one of {SAMPLED_LOSSES}, got {self.sampled_loss!r}')
    if self.features not in FEATURE_MODES:
      raise ValueError(f'features must be one of {FEATURE_MODES}, got {self.features!r}')


@dataclasses.dataclass
class Served:
  """One buffered sequence: prompt + output ids, the output's mask, how it was served."""

  tokens: np.ndarray  # int32 [n]
  loss_mask: np.ndarray  # uint8 [n]: 1 on the output
  sampled: bool
  features: np.ndarray | None = None  # float16 [n, taps*D + D] with features='cache'


class Adapter:
  """A draft head that keeps learning from what it serves (see the module docstring).

  ``adapter.generate(prompt_ids, ...)`` takes :func:`jetspec_jax.generate`'s arguments;
  ``adapter.head`` is the current head (usable with ``js.generate``); ``adapter.updates`` lists
  every update (served count, held-out tau before and after, kept or rolled back, seconds).
  """

  def __init__(
    self,
    target: decoder.Target,
    head: draft_head_lib.DraftHead,
    method: methods_lib.Method | None = None,
    config: OnlineConfig = OnlineConfig(),
  ):
    if head.cfg.kind not in ('jetspec', 'dflash', 'jetspecpp'):
      raise ValueError(
        f'online adaptation trains jetspec, dflash or jetspecpp heads, not {head.cfg.kind}'
      )
    self.target = target
    self.method = methods_lib.Tree() if method is None else method
    self.method.check_head(head)
    self.config = config
    self.head = head
    self.served = 0
    self.updates: list[dict] = []
    self.serve_seconds = 0.0
    self.feature_seconds = 0.0  # teacher-forced forwards of served sequences (features='cache')
    self._train: list[Served] = []
    self._holdout: list[Served] = []
    self._rng = np.random.default_rng(config.seed)
    self._optimizer = optax.chain(
      optax.clip_by_global_norm(config.grad_clip), optax.adamw(config.lr, weight_decay=0.0)
    )
    self._opt_state = self._optimizer.init(head.params)
    self._step_count = 0
    self._steps = {}  # loss -> jitted train step
    self._mesh = sharding.make_mesh(data=1, model=1, devices=jax.devices()[:1])
    self._score_cache: float | None = None
    self._evaluate = jax.jit(self._metrics, static_argnames='settings')

  # Serving.

  def generate(self, prompt_ids, **kwargs):
    """:func:`jetspec_jax.generate` with the current head; each served sequence is then observed
    (and may trigger an update). Returns what ``generate`` returns."""
    kwargs.setdefault('method', self.method)
    start = time.perf_counter()
    out = decoding.generate(self.target, self.head, prompt_ids, **kwargs)
    self.serve_seconds += time.perf_counter() - start
    sampled = float(kwargs.get('temperature', 0.0)) > 0.0
    batch = isinstance(out, list)
    prompts = list(prompt_ids) if batch else [prompt_ids]
    for prompt, result in zip(prompts, out if batch else [out], strict=True):
      self.observe(prompt, result.tokens, sampled=sampled)
    return out

  def observe(self, prompt_ids, output_ids, *, sampled: bool = False) -> dict | None:
    """Adds one served sequence to the buffer; every ``update_every``-th runs an update (its
    record is returned)."""
    prompt = np.asarray(prompt_ids, np.int32).reshape(-1)
    output = np.asarray(output_ids, np.int32).reshape(-1)
    if prompt.size == 0:
      raise ValueError('an observed sequence needs a non-empty prompt')
    tokens = np.concatenate([prompt, output])[: self.config.max_len]
    mask = np.concatenate([np.zeros(prompt.size, np.uint8), np.ones(output.size, np.uint8)])
    seq = Served(tokens, mask[: self.config.max_len], bool(sampled))
    if self.config.features == 'cache':
      start = time.perf_counter()
      seq.features = self._features(tokens)
      self.feature_seconds += time.perf_counter() - start
    self.served += 1
    held = self.config.holdout_every and self.served % self.config.holdout_every == 0
    if held:
      self._holdout = (self._holdout + [seq])[-self.config.holdout_size :]
      self._score_cache = None
    else:
      self._train = (self._train + [seq])[-self.config.buffer_size :]
    if self.served % self.config.update_every == 0:
      return self.update()
    return None

  # Learning.

  def update(self) -> dict | None:
    """``steps`` optimizer steps on the training buffer; kept when the held-out expected tau
    does not fall by more than ``tolerance``, else rolled back. None when nothing is buffered."""
    if not self._train:
      return None
    start = time.perf_counter()
    before = self._score(self.head.params)
    loss = self._loss()
    step = self._train_step(loss)
    # The step donates its state: train copies, so the current head stays whole for a rollback.
    state = TrainState(
      jnp.asarray(self._step_count, jnp.int32),
      jax.tree.map(jnp.copy, self.head.params),
      jax.tree.map(jnp.copy, self._opt_state),
    )
    key = jax.random.key(self.config.seed)
    losses = []
    for i in range(self.config.steps):
      batch = self._batch(self._sample(self._train, self.config.batch_size))
      state, metrics = step(state, batch, jax.random.fold_in(key, self._step_count + i))
      losses.append(float(metrics['loss']))
    after = self._score(state.params)
    kept = before is None or after >= before - self.config.tolerance
    if kept:
      self.head = self.head.replace(params=state.params)
      self._opt_state = state.opt_state
      self._step_count += self.config.steps
      self._score_cache = after
    record = dict(
      served=self.served,
      steps=self.config.steps,
      loss=float(np.mean(losses)),
      heldout_tau_before=before,
      heldout_tau_after=after,
      kept=bool(kept),
      seconds=time.perf_counter() - start,
    )
    self.updates.append(record)
    return record

  def _loss(self) -> str:
    return self.config.sampled_loss if any(s.sampled for s in self._train) else 'ce'

  def _settings(self, loss: str) -> head_sums.StepSettings:
    return head_sums.StepSettings(
      num_anchors=self.config.num_anchors,
      loss=loss,
      gamma=self.config.gamma,
      loss_chunk=self.config.num_anchors,
      remat=False,
    )

  def _train_step(self, loss: str):
    if loss not in self._steps:
      self._steps[loss] = head_step.make_train_step(
        self.target,
        self.head.cfg,
        self._optimizer,
        self._settings(loss),
        self._mesh,
        self.head.draft_vocab,
      )
    return self._steps[loss]

  def _metrics(self, params, target_params, batch, key, vocab, *, settings):
    tgt = self.target.replace(params=target_params)
    sums = head_sums.batch_sums(params, self.head.cfg, tgt, batch, key, settings, vocab)
    return head_sums.sums_metrics(sums)

  def _score(self, params) -> float | None:
    """The held-out slice's expected chain tau (None without one); the same anchors every time."""
    if not self._holdout:
      return None
    if params is self.head.params and self._score_cache is not None:
      return self._score_cache
    vocab = None if self.head.draft_vocab is None else jnp.asarray(self.head.draft_vocab)
    batch = self._batch(self._holdout, rows=self.config.holdout_size)
    metrics = self._evaluate(
      params, self.target.params, batch, jax.random.key(1), vocab, settings=self._settings('ce')
    )
    return float(metrics['expected_tau'])

  def _sample(self, pool: list[Served], n: int) -> list[Served]:
    return [pool[i] for i in self._rng.integers(0, len(pool), n)]

  def _batch(self, seqs: Sequence[Served], rows: int | None = None) -> dict:
    """Padded arrays of ``seqs`` (``rows`` of them, empty rows weigh nothing)."""
    rows = len(seqs) if rows is None else rows
    length = self.config.max_len
    tokens = np.zeros((rows, length), np.int32)
    mask = np.zeros((rows, length), np.uint8)
    lengths = np.ones(rows, np.int32)
    for i, s in enumerate(seqs):
      tokens[i, : s.tokens.size] = s.tokens
      mask[i, : s.tokens.size] = s.loss_mask
      lengths[i] = s.tokens.size
    batch = dict(
      tokens=tokens, loss_mask=mask, lengths=lengths, index=np.arange(rows, dtype=np.int32)
    )
    if self.config.features == 'cache':
      width = seqs[0].features.shape[-1]
      feats = np.zeros((rows, length, width), np.float16)
      for i, s in enumerate(seqs):
        feats[i, : s.tokens.size] = s.features
      batch['features'] = feats
    return {k: jnp.asarray(v) for k, v in batch.items()}

  def _features(self, tokens: np.ndarray) -> np.ndarray:
    """The target's taps and final hidden state at every position (one teacher-forced forward
    of the sequence padded to a multiple of ``FEATURE_BUCKET``: one compile per bucket, no
    forward over ``max_len``), float16, as offline training stores them."""
    size = min(-(-tokens.size // FEATURE_BUCKET) * FEATURE_BUCKET, self.config.max_len)
    padded = np.zeros((1, size), np.int32)
    padded[0, : tokens.size] = tokens
    hidden, feats = _target_pass(self.target, jnp.asarray(padded), self.head.cfg.target_layer_ids)
    both = jnp.concatenate([feats, hidden], axis=-1)[0, : tokens.size]
    return np.asarray(both.astype(jnp.float16))

  # Checkpoints.

  def save(self, directory) -> pathlib.Path:
    """Writes the adapter's state under ``directory`` (replaced whole: written beside it, then
    renamed into place)."""
    directory = pathlib.Path(directory).absolute()
    tmp = directory.with_name(f'{directory.name}.tmp-{os.getpid()}')
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ckpt.quiet_orbax()
    state = dict(params=self.head.params, opt_state=self._opt_state)
    with ocp.StandardCheckpointer() as saver:
      saver.save(tmp / STATE_DIR, state)
      saver.wait_until_finished()
    buffers = {}
    for name, pool in (('train', self._train), ('holdout', self._holdout)):
      buffers[f'{name}_tokens'] = np.concatenate(
        [s.tokens for s in pool] or [np.zeros(0, np.int32)]
      )
      buffers[f'{name}_mask'] = np.concatenate(
        [s.loss_mask for s in pool] or [np.zeros(0, np.uint8)]
      )
      buffers[f'{name}_lengths'] = np.asarray([s.tokens.size for s in pool], np.int64)
      buffers[f'{name}_sampled'] = np.asarray([s.sampled for s in pool], bool)
    np.savez(tmp / BUFFER_FILE, **buffers)
    meta = dict(
      config=dataclasses.asdict(self.config),
      method=self.method.to_config(),
      head_kind=self.head.cfg.kind,
      served=self.served,
      step_count=self._step_count,
      serve_seconds=self.serve_seconds,
      updates=self.updates,
      rng=self._rng.bit_generator.state,
      buffer_sha256=provenance.file_sha256(tmp / BUFFER_FILE),
    )
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory

  @classmethod
  def restore(cls, directory, target: decoder.Target, head: draft_head_lib.DraftHead) -> 'Adapter':
    """The adapter saved in ``directory``; ``head`` gives the architecture (its weights are
    replaced by the saved ones). A missing file or a buffer whose checksum does not match
    raises :class:`CheckpointError`."""
    directory = pathlib.Path(directory)
    for name in (STATE_DIR, BUFFER_FILE, META_FILE):
      if not (directory / name).exists():
        raise CheckpointError(f'{directory} is not a whole adapter checkpoint: {name} is missing')
    try:
      meta = json.loads((directory / META_FILE).read_text())
    except ValueError as e:
      raise CheckpointError(f'{directory / META_FILE} is not valid JSON: {e}') from e
    if provenance.file_sha256(directory / BUFFER_FILE) != meta.get('buffer_sha256'):
      raise CheckpointError(f'{directory / BUFFER_FILE} does not match its recorded checksum')
    if meta.get('head_kind') != head.cfg.kind:
      raise CheckpointError(
        f'the checkpoint holds a {meta.get("head_kind")} head, not {head.cfg.kind}'
      )
    adapter = cls(
      target, head, methods_lib.from_config(meta['method']), OnlineConfig(**meta['config'])
    )
    abstract = ckpt.abstract_like(dict(params=head.params, opt_state=adapter._opt_state))
    ckpt.quiet_orbax()
    try:
      with ocp.StandardCheckpointer() as loader:
        state = loader.restore(directory.absolute() / STATE_DIR, abstract)
    except Exception as e:  # Orbax raises several types for a damaged directory
      raise CheckpointError(f'{directory / STATE_DIR} could not be restored: {e}') from e
    adapter.head = head.replace(params=state['params'])
    adapter._opt_state = state['opt_state']
    with np.load(directory / BUFFER_FILE) as z:
      for name in ('train', 'holdout'):
        offsets = np.concatenate([[0], np.cumsum(z[f'{name}_lengths'])])
        pool = []
        for i, sampled in enumerate(z[f'{name}_sampled']):
          a, b = offsets[i], offsets[i + 1]
          seq = Served(z[f'{name}_tokens'][a:b], z[f'{name}_mask'][a:b], bool(sampled))
          if adapter.config.features == 'cache':
            seq.features = adapter._features(seq.tokens)
          pool.append(seq)
        setattr(adapter, f'_{name}', pool)
    adapter.served = meta['served']
    adapter._step_count = meta['step_count']
    adapter.serve_seconds = meta['serve_seconds']
    adapter.updates = meta['updates']
    adapter._rng.bit_generator.state = meta['rng']
    return adapter


@functools.partial(jax.jit, static_argnums=2)
def _target_pass(target, tokens, taps):
  return head_sums.target_pass(target, tokens, taps)
