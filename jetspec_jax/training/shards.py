"""Self-distilled token shards on disk (docs/training.md §1) and how training reads them.

``shard_00000.npz`` ... each hold ``tokens [N, L]`` (prompt + response, right-padded with 0; uint16
when the vocabulary fits, compressed: a few MB per million tokens, small enough to commit),
``loss_mask uint8[N, L]`` (1 on response tokens) and ``lengths int32[N]``. Shards are written
atomically and claimed while written (:class:`ShardClaim`), so generation resumes by skipping
finished shards and processes side by side split them. Training reads them through ``grain`` as
one random-access source, shuffled per epoch, batched; batch ``s`` is a pure function of
``(seed, s)``, so the data position of a resumed run is just its step. Target features (taps and
the final hidden state, float16) sit beside each shard or in a cache directory at the same
relative paths (:func:`features_path`), memory-mapped. Shards and prompt files go through
``etils.epath``, so a data directory may be a URL (``gs://bucket/data``).
"""

import collections
import fnmatch
import io
import json
import os
import pathlib
import re
import secrets
import socket

import grain
import numpy as np
from etils import epath

SHARD_PATTERN = 'shard_{:05d}.npz'


FEATURE_TAPS_FILE = 'feature_taps.json'  # in a features directory: the taps its features hold


# ... and the matmul mode its forward ran in (absent: 'float32', every cache built before it).
FEATURE_COMPUTE_FILE = 'feature_compute_dtype.json'


FEATURE_COMPUTE_DTYPES = ('float32', 'bfloat16')


def shard_paths(data_dir: str | os.PathLike, prompt_rounds: int | None = None) -> list[epath.Path]:
  """Finished shards under ``data_dir`` (subdirectories too), sorted. ``prompt_rounds``: only
  those of the first that many prompt rounds (round r >= 1 lives in ``data_dir/round{r}/``,
  :func:`jetspec_jax.training.chat_data.round_dirs`); None: every shard."""
  root = epath.Path(data_dir)
  if not root.is_dir():
    return []
  paths = [
    where / name
    for where, _, names in root.walk()  # epath has no recursive glob (a URL lists by walking)
    for name in names
    if fnmatch.fnmatch(name, 'shard_*.npz') and not name.endswith('.tmp.npz')
  ]
  if prompt_rounds is not None:
    paths = [p for p in paths if prompt_round_of(p, root) < prompt_rounds]
  return sorted(paths)


def prompt_round_dir(data_dir, prompt_round: int):
  """Where a prompt round's shards go: ``data_dir`` itself for round 0, else
  ``data_dir/round{r}`` (what :func:`prompt_round_of` reads back)."""
  return data_dir if prompt_round == 0 else data_dir / f'round{prompt_round}'


def prompt_round_of(path, data_dir) -> int:
  """The prompt round a shard belongs to: r for shards under ``data_dir/round{r}/``, else 0."""
  top = epath.Path(path).relative_to(epath.Path(data_dir)).parts[0]
  match = re.fullmatch(r'round(\d+)', top)
  return int(match.group(1)) if match else 0


class ShardClaim:
  """An exclusive claim on writing a shard: ``PATH.claim`` created with ``O_EXCL`` (local
  directories), holding the claimer's host and process id, removed on exit. A claim left by a
  process of this host that is gone is stale and taken over. Other file systems have no
  exclusive create: the claim is then always granted (multi-host jobs split shards by process
  index instead)."""

  def __init__(self, path):
    self.path = epath.Path(path)
    self.claim = self.path.with_name(self.path.name + '.claim')
    self.held = False

  def _local(self) -> bool:
    return '://' not in os.fspath(self.claim)

  def _stale(self) -> bool:
    try:
      host, pid = self.claim.read_text().split()
    except (FileNotFoundError, ValueError):
      return False
    if host != socket.gethostname():
      return False
    try:
      os.kill(int(pid), 0)
    except ProcessLookupError:
      return True
    except PermissionError:
      return False
    return False

  def __enter__(self) -> bool:
    if not self._local():
      return True
    self.claim.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
      try:
        fd = os.open(os.fspath(self.claim), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
      except FileExistsError:
        if not self._stale():
          return False
        self.claim.unlink(missing_ok=True)
        continue
      with os.fdopen(fd, 'w') as f:
        f.write(f'{socket.gethostname()} {os.getpid()}')
      self.held = True
      return True
    return False

  def __exit__(self, *exc) -> None:
    if self.held:
      self.claim.unlink(missing_ok=True)
      self.held = False


def select_shards(
  paths: list[epath.Path], shards_per_dir: int | None = None, skip_per_dir: int = 0
) -> list[epath.Path]:
  """Of each directory's shards (``paths`` sorted, as :func:`shard_paths` returns them), the
  ``shards_per_dir`` after its first ``skip_per_dir`` (``None``: all after them)."""
  seen = collections.Counter()
  kept = []
  for p in paths:
    i = seen[p.parent]
    seen[p.parent] += 1
    if i >= skip_per_dir and (shards_per_dir is None or i < skip_per_dir + shards_per_dir):
      kept.append(p)
  return kept


def features_path(
  shard: epath.Path, data_dir=None, features_dir=None, kind: str = 'features'
) -> epath.Path | pathlib.Path:
  """A shard's features (``kind='labels'``: its target-argmax labels): beside it, or at its
  relative path under ``features_dir`` (a local cache)."""
  beside = shard.with_name(shard.name.removesuffix('.npz') + f'.{kind}.npy')
  if features_dir is None:
    return beside
  return pathlib.Path(features_dir) / os.fspath(beside.relative_to(epath.Path(data_dir)))


def feature_taps(features_dir) -> tuple[int, ...] | None:
  """The target layers a features directory's features were tapped at; None where none are
  recorded (no features computed there yet)."""
  taps_file = pathlib.Path(features_dir) / FEATURE_TAPS_FILE
  return tuple(json.loads(taps_file.read_text())) if taps_file.exists() else None


def feature_compute_dtype(features_dir) -> str | None:
  """The matmul mode a features directory's forward ran in: ``'float32'`` for one filled before
  the mode was recorded (features but no mode file), None for one without features."""
  features_dir = pathlib.Path(features_dir)
  mode_file = features_dir / FEATURE_COMPUTE_FILE
  if mode_file.exists():
    return json.loads(mode_file.read_text())
  return 'float32' if next(features_dir.rglob('*.features.npy'), None) else None


def write_atomically(path: epath.Path, data: bytes, suffix: str) -> None:
  """Writes ``data`` to a temporary file of this process's own (process id + random suffix, so
  concurrent writers never share one) and renames it over ``path``: a reader sees the old file
  or the whole new one, and of two writers of one path the last rename wins."""
  tmp = path.with_name(f'{path.name}.{os.getpid()}.{secrets.token_hex(6)}{suffix}')
  try:
    tmp.write_bytes(data)
    tmp.replace(path)
  except BaseException:
    if tmp.exists():
      tmp.unlink()
    raise


def load_shard(path) -> dict[str, np.ndarray]:
  """A token shard's arrays (read whole: a URL cannot be memory-mapped)."""
  with np.load(io.BytesIO(epath.Path(path).read_bytes())) as shard:
    return dict(shard)


def write_shard(
  path: epath.Path, sequences, masks, max_len: int, features=None, feature_taps=()
) -> None:
  """Writes one shard atomically (temp file + rename).

  ``features`` (one ``[len(seq), F]`` array per sequence) go first, to
  ``shard_*.features.npy`` as one float16 ``[sum of lengths, F]`` array (memory-mappable;
  sequence ``i`` owns the ``lengths[i]`` rows after those of the sequences before it), so a
  shard whose ``.npz`` exists is complete.
  """
  n = len(sequences)
  fits_16 = all(len(s) == 0 or int(np.max(s)) < 1 << 16 for s in sequences)
  tokens = np.zeros((n, max_len), np.uint16 if fits_16 else np.int32)
  loss_mask = np.zeros((n, max_len), np.uint8)
  lengths = np.array([len(s) for s in sequences], np.int32)
  for i, (seq, mask) in enumerate(zip(sequences, masks)):
    tokens[i, : len(seq)] = seq
    loss_mask[i, : len(mask)] = mask
  extra = {}
  if features is not None:
    for seq, feats in zip(sequences, features):
      if len(feats) != len(seq):
        raise ValueError(f'{len(feats)} feature rows for a sequence of {len(seq)} tokens')
    save_features(features_path(path), features)
    extra['feature_taps'] = np.asarray(feature_taps, np.int32)
  buf = io.BytesIO()
  np.savez_compressed(buf, tokens=tokens, loss_mask=loss_mask, lengths=lengths, **extra)
  write_atomically(epath.Path(path), buf.getvalue(), '.tmp.npz')


class TokenShards:
  """All shards under a directory (subdirectories included) as one random-access source.

  Follows grain's data-source protocol. When every shard has target features
  (``shard_*.features.npy``, memory-mapped; beside the shards, or in ``features_dir`` as
  :func:`compute_features` writes them), items carry ``features [max_len, F]`` (float32,
  zero-padded) and ``feature_taps`` names the tapped layers they were collected with.
  """

  def __init__(
    self,
    data_dir: str | os.PathLike,
    max_len: int | None = None,
    shards_per_dir: int | None = None,
    skip_per_dir: int = 0,
    features_dir: str | os.PathLike | None = None,
    target_labels: bool = False,
    subdir: str | None = None,
    prompt_rounds: int | None = None,
  ):
    """``shards_per_dir`` keeps only the first that many shards of each directory (a fixed
    prefix of data that is still being generated) after skipping its first ``skip_per_dir``
    (held-out data: e.g. ``skip_per_dir=6, shards_per_dir=1`` is each directory's 7th shard).
    ``target_labels``: items carry ``labels [max_len]``, the target's greedy next token at every
    position (``labels[p]`` = argmax of the target at ``p - 1``; :func:`compute_features`).
    ``subdir``: only the shards under ``data_dir/subdir`` (features still found relative to
    ``data_dir``). ``prompt_rounds``: only the shards of the first that many prompt rounds
    (:func:`shard_paths`)."""
    paths = select_shards(
      shard_paths(epath.Path(data_dir) / subdir if subdir else data_dir, prompt_rounds),
      shards_per_dir,
      skip_per_dir,
    )
    if not paths:
      raise FileNotFoundError(f'no shard_*.npz files in {data_dir}')
    loaded = [load_shard(p) for p in paths]
    width = max(d['tokens'].shape[1] for d in loaded) if max_len is None else max_len
    self.width = width
    self.feature_taps: tuple[int, ...] | None = None
    self._features = None
    feature_files = [features_path(p, data_dir, features_dir) for p in paths]
    have_features = all(f.exists() for f in feature_files)
    if features_dir is not None and have_features:
      recorded = feature_taps(features_dir)
      if recorded is None:
        raise FileNotFoundError(
          f'{features_dir} holds features but no {FEATURE_TAPS_FILE}: recompute them with '
          'data.compute_features (experiments/tasks/build_features.py)'
        )
      taps = {recorded}
    else:
      taps = {tuple(int(i) for i in d['feature_taps']) for d in loaded if 'feature_taps' in d}
    if taps and have_features:
      if len(taps) != 1:
        raise ValueError(f'shards under {data_dir} were collected with different taps: {taps}')
      self.feature_taps = taps.pop()
      starts = [np.concatenate([[0], np.cumsum(d['lengths'])[:-1]]) for d in loaded]
      self._features = [(_memory_map(f), start) for f, start in zip(feature_files, starts)]
      self._where = [(s, j) for s, d in enumerate(loaded) for j in range(len(d['lengths']))]
    self._labels = None
    if target_labels:
      label_files = [features_path(p, data_dir, features_dir, 'labels') for p in paths]
      missing = [str(f) for f in label_files if not f.exists()]
      if missing or self._features is None:
        raise FileNotFoundError(
          f'target labels asked for, but {len(missing)} label files are missing (first: '
          f'{(missing or ["features"])[0]}); compute them with data.compute_features'
        )
      self._labels = [_memory_map(f) for f in label_files]

    def fit(x):
      x = x[:, :width]
      return np.pad(x, ((0, 0), (0, width - x.shape[1])))

    self.tokens = np.concatenate([fit(d['tokens']).astype(np.int32) for d in loaded])
    self.loss_mask = np.concatenate([fit(d['loss_mask']) for d in loaded])
    self.lengths = np.minimum(np.concatenate([d['lengths'] for d in loaded]), width)

  def __len__(self) -> int:
    return len(self.tokens)

  def __getitem__(self, i: int) -> dict:
    item = dict(tokens=self.tokens[i], loss_mask=self.loss_mask[i], lengths=self.lengths[i])
    if self._features is not None:
      shard, j = self._where[i]
      rows, offsets = self._features[shard]
      n = int(self.lengths[i])
      feats = np.zeros((self.width, rows.shape[1]), np.float32)
      feats[:n] = rows[offsets[j] : offsets[j] + n]
      item['features'] = feats
      if self._labels is not None:
        labels = np.array(self.tokens[i])  # position 0 has no prediction: its own token
        labels[1:n] = self._labels[shard][offsets[j] : offsets[j] + n - 1]
        item['labels'] = labels
    return item

  def response_token_counts(self, vocab_size: int) -> np.ndarray:
    """How often each token id occurs among the response tokens (``[vocab_size]``)."""
    return np.bincount(self.tokens[self.loss_mask > 0], minlength=vocab_size)[:vocab_size]

  @property
  def num_tokens(self) -> int:
    return int(self.lengths.sum())


def _memory_map(path) -> np.ndarray:
  if '://' in str(path):
    raise ValueError(
      f'features are memory-mapped from a local disk, not {path}: set data.features_dir to a '
      'local directory (a cache that compute_features rebuilds from the shards)'
    )
  return np.load(os.fspath(path), mmap_mode='r')


def make_batches(source: TokenShards, global_batch: int, seed: int) -> grain.MapDataset:
  """Shuffled (per epoch), repeated, batched; ``ds[step]`` is the batch of that step.

  Each batch carries ``index = arange(global_batch)``: the position of each sequence in the
  global batch, from which its anchor-sampling key is derived (so a sharded step draws the same
  anchors as a single-device one).
  """
  if len(source) < 1:
    raise ValueError('empty dataset')

  def with_index(batch):
    return {**batch, 'index': np.arange(global_batch, dtype=np.int32)}

  ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None)
  return ds.batch(global_batch, drop_remainder=True).map(with_index)


def mix_batches(
  sources: list[TokenShards], weights: list[float], global_batch: int, seed: int
) -> grain.MapDataset:
  """:func:`make_batches` of each source (the first with ``seed``, source ``i`` with
  ``seed + i``), mixed in the shares ``weights``: each batch comes whole from one source, at
  its own width; ``ds[step]`` is the batch of that step. One source: its batches."""
  if len(sources) != len(weights) or not sources or min(weights) <= 0:
    raise ValueError(f'{len(sources)} sources need as many positive weights, got {weights}')
  batches = [make_batches(s, global_batch, seed + i) for i, s in enumerate(sources)]
  return batches[0] if len(batches) == 1 else grain.MapDataset.mix(batches, list(weights))


def save_features(path, rows) -> None:
  """One float16 ``[sum of lengths, F]`` array, written atomically (temp file + rename)."""
  save_rows(path, rows, np.float16)


def save_rows(path, rows, dtype) -> None:
  """Per-sequence rows as one ``dtype`` array, written atomically (temp file + rename)."""
  buf = io.BytesIO()
  np.save(buf, np.concatenate(rows).astype(dtype))
  write_atomically(epath.Path(path), buf.getvalue(), '.tmp.npy')
