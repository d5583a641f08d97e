"""The target-feature cache: the head's taps and the final hidden state of every token of every
shard, recomputed from the tokens by a batched teacher-forced forward (docs/training.md §2). The
tokens are the asset, the features a cache that one command rebuilds.
"""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from tqdm import tqdm

from jetspec_jax import rounds
from jetspec_jax.models import decoder
from jetspec_jax.training import shards as shards_lib


def compute_features(
  target: decoder.Target,
  data_dir: str | os.PathLike,
  features_dir: str | os.PathLike,
  taps: tuple[int, ...],
  *,
  batch_size: int = 8,
  progress: bool = True,
  shards_per_dir: int | None = None,
  prompt_rounds: int | None = None,
  part: int = 0,
  parts: int = 1,
  compute_dtype: str = 'float32',
) -> int:
  """Recomputes the target features of every shard under ``data_dir`` (``shards_per_dir``: of
  the first that many of each directory, the ones a run reads; ``prompt_rounds``: of the first
  that many prompt rounds, :func:`shards_lib.shard_paths`) that has none in
  ``features_dir`` (a batched teacher-forced forward over prompt + response, the same rows that
  generation collects: taps, then the final-normed hidden state; the last token's row is zeros,
  as the target never reads it). Beside each shard's features go its labels
  (``shard_*.labels.npy``, int32 ``[sum of lengths]``): the target's argmax at every position
  (the greedy next token after it), from the same forward. Resumable: finished shards are
  skipped. ``part`` of ``parts``: every ``parts``-th of those shards from the ``part``-th, so
  that processes split the work (``experiments/tasks/build_features.py``). ``compute_dtype``
  ``'bfloat16'``: the forward's matmuls take bfloat16 inputs with float32 accumulation, about 1.7x
  faster on a CPU with AMX; features and labels are then close to the float32 forward's, not equal
  (on SmolLM2-135M nearly all labels equal; benchmarks/history/README.md, "feature_dtype").
  A features directory holds one mode: another one is refused.

  Returns:
    How many shards were computed.
  """
  if not 0 <= part < parts:
    raise ValueError(f'part {part} of {parts}: need 0 <= part < parts')
  data_dir, features_dir = epath.Path(data_dir), pathlib.Path(features_dir)
  features_dir.mkdir(parents=True, exist_ok=True)
  if compute_dtype not in shards_lib.FEATURE_COMPUTE_DTYPES:
    raise ValueError(
      f'compute_dtype must be one of {shards_lib.FEATURE_COMPUTE_DTYPES}, got {compute_dtype!r}'
    )
  taps = tuple(taps)
  _pin_feature_meta(
    features_dir,
    shards_lib.FEATURE_TAPS_FILE,
    taps,
    shards_lib.feature_taps(features_dir),
    'of taps ',
  )
  stored_mode = shards_lib.feature_compute_dtype(features_dir)
  _pin_feature_meta(
    features_dir, shards_lib.FEATURE_COMPUTE_FILE, compute_dtype, stored_mode, 'computed in '
  )
  if compute_dtype == 'bfloat16':
    target = target.with_compute_dtype('bfloat16')
  hidden_size = target.cfg.hidden_size

  @jax.jit
  def forward(tokens, lengths):
    feats = rounds.prefill(target, tokens, lengths, tokens.shape[1], taps=taps, with_hidden=True)[2]
    argmax = jnp.argmax(target.lm_logits(feats[..., -hidden_size:]), axis=-1)
    return feats, argmax.astype(jnp.int32)

  def done(p):
    return all(
      shards_lib.features_path(p, data_dir, features_dir, k).exists()
      for k in ('features', 'labels')
    )

  paths = shards_lib.select_shards(shards_lib.shard_paths(data_dir, prompt_rounds), shards_per_dir)[
    part::parts
  ]
  todo = [p for p in paths if not done(p)]
  for path in tqdm(todo, desc='features', unit='shard', disable=not progress):
    shard = shards_lib.load_shard(path)
    tokens, lengths = shard['tokens'].astype(np.int32), shard['lengths']
    rows, labels = [None] * len(lengths), [None] * len(lengths)
    # Shortest first, each batch as wide as its longest row rounded up to 64 (a few shapes, so a
    # few compiles): on the SmolLM2 data this forwards 1.07M positions for 0.90M tokens, where
    # file order and power-of-two widths forwarded 1.78M. Measured there on 2 cores: 68 s per
    # shard after the compiles, against 76 (the forward's cost is not proportional to width).
    order = np.argsort(lengths, kind='stable')
    for b in range(0, len(order), batch_size):
      idx = order[b : b + batch_size]
      lens = lengths[idx]
      width = min(-(-int(lens.max()) // _FEATURE_WIDTH_STEP) * _FEATURE_WIDTH_STEP, tokens.shape[1])
      batch = np.zeros((batch_size, width), np.int32)
      batch[: len(idx)] = tokens[idx, :width]
      padded_lens = np.concatenate([lens, np.ones(batch_size - len(lens), lens.dtype)])
      feats, argmax = forward(jnp.asarray(batch), jnp.asarray(padded_lens, jnp.int32))
      feats, argmax = np.asarray(feats), np.asarray(argmax)
      for i, (j, n) in enumerate(zip(idx, lens, strict=True)):
        row = feats[i, :n].astype(np.float16)
        row[n - 1] = 0
        rows[j], labels[j] = row, argmax[i, :n]
    out = shards_lib.features_path(path, data_dir, features_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    shards_lib.save_rows(
      shards_lib.features_path(path, data_dir, features_dir, 'labels'), labels, np.int32
    )
    shards_lib.save_features(out, rows)
  return len(todo)


_FEATURE_WIDTH_STEP = 64


def _pin_feature_meta(features_dir: pathlib.Path, name: str, value, stored, what: str) -> None:
  """Records ``value`` as a features directory's ``name`` file when none is stored yet (``stored``
  None), else refuses a different one: a directory holds features of one kind only."""
  if stored is None:
    # Workers of experiments/tasks/build_features.py start together: each writes a whole file under
    # its own temporary name, so none reads another's half-written one.
    shards_lib.write_atomically(epath.Path(features_dir / name), json.dumps(value).encode(), '.tmp')
  elif stored != value:
    raise ValueError(
      f'{features_dir} holds features {what}{stored}, not {value}: use another features directory'
    )
