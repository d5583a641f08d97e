"""Checkpoint files shared by every format: safetensors (single or sharded), config.json, errors."""

import json
import os
import pathlib
import re
from collections.abc import Mapping

import numpy as np
import safetensors
import safetensors.numpy
from etils import epath

from jetspec_jax.models.decoder.config import RopeScaling

SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'


class CheckpointError(ValueError):
  """A checkpoint directory that cannot be read as the expected model."""


# ``org/name``: a Hugging Face Hub model id (not a path that exists, not absolute, not relative).
HUB_ID = re.compile(r'[A-Za-z0-9][\w.-]*/[\w.-]+')


def resolve(path: str | os.PathLike) -> pathlib.Path:
  """``path`` itself, or for a Hugging Face model id (``'Qwen/Qwen3-0.6B'``) that is not a local
  path, its snapshot in the local Hugging Face cache (``huggingface_hub``, offline: nothing is
  downloaded).

  Raises:
    FileNotFoundError: a model id that is not in the local cache, saying where it looked and how
      to download it.
  """
  local = pathlib.Path(path)
  if local.exists() or not HUB_ID.fullmatch(str(path)):
    return local
  try:
    import huggingface_hub  # only for hub ids; an optional dependency
    from huggingface_hub import constants
  except ImportError as e:
    raise FileNotFoundError(
      f'{path} is not a local path, and resolving it as a Hugging Face model id needs '
      'huggingface_hub (pip install huggingface_hub)'
    ) from e
  try:
    return pathlib.Path(huggingface_hub.snapshot_download(str(path), local_files_only=True))
  except Exception as e:  # the hub's own "not in the cache" errors differ by version
    raise FileNotFoundError(
      f'{path} is not a local path, and the Hugging Face model {path} is not in the local cache '
      f'({constants.HF_HUB_CACHE}); download it first: huggingface-cli download {path} '
      f'(or huggingface_hub.snapshot_download({str(path)!r}))'
    ) from e


def safetensor_files(path: pathlib.Path, prefix: str = 'model') -> list[pathlib.Path]:
  """The weight files of a checkpoint directory (single file or sharded index)."""
  single, index = path / f'{prefix}.safetensors', path / f'{prefix}.safetensors.index.json'
  if index.exists():
    try:
      weight_map = json.loads(index.read_text())['weight_map']
    except (json.JSONDecodeError, KeyError) as e:
      raise CheckpointError(f'{index} is not a valid safetensors index: {e}') from e
    files = [path / name for name in dict.fromkeys(weight_map.values())]
  elif single.exists():
    files = [single]
  else:
    raise FileNotFoundError(f'no {single.name} or {index.name} in {path}')
  for f in files:
    if not f.exists():
      raise CheckpointError(f'checkpoint shard {f.name} listed in {index.name} is missing')
  return files


def read_tensors(path: str | os.PathLike, prefix: str = 'model') -> dict[str, np.ndarray]:
  """All tensors of a checkpoint directory as numpy arrays (name -> array)."""
  tensors = {}
  for f in safetensor_files(pathlib.Path(path), prefix):
    try:
      tensors.update(safetensors.numpy.load_file(f))
    except (safetensors.SafetensorError, OSError, ValueError) as e:
      raise CheckpointError(f'cannot read {f}: {e}') from e
  return tensors


def write_tensors(
  tensors: Mapping[str, np.ndarray],
  path: str | os.PathLike,
  prefix: str = 'model',
  max_shard_bytes: int | None = None,
) -> None:
  """Writes tensors as one file, or as shards plus an index when over ``max_shard_bytes``.
  ``path`` may be a URL (``gs://...``: written through ``etils.epath``)."""
  path = epath.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors = {k: np.ascontiguousarray(v) for k, v in tensors.items()}
  total = sum(v.nbytes for v in tensors.values())
  if max_shard_bytes is None or total <= max_shard_bytes:
    (path / f'{prefix}.safetensors').write_bytes(_safetensors_bytes(tensors))
    return
  shards, current, size = [], {}, 0
  for name, value in tensors.items():
    if current and size + value.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = value
    size += value.nbytes
  shards.append(current)
  weight_map = {}
  for i, shard in enumerate(shards):
    fname = f'{prefix}-{i + 1:05d}-of-{len(shards):05d}.safetensors'
    (path / fname).write_bytes(_safetensors_bytes(shard))
    weight_map.update({name: fname for name in shard})
  index = {'metadata': {'total_size': total}, 'weight_map': weight_map}
  (path / f'{prefix}.safetensors.index.json').write_text(json.dumps(index, indent=2))


def _safetensors_bytes(tensors: Mapping[str, np.ndarray]) -> bytes:
  return safetensors.numpy.save(dict(tensors), metadata={'format': 'pt'})


def read_config(path: pathlib.Path) -> dict:
  if not path.is_dir():
    raise FileNotFoundError(f'checkpoint directory {path} does not exist')
  cfg_file = path / 'config.json'
  if not cfg_file.exists():
    raise FileNotFoundError(f'no config.json in {path}')
  try:
    return json.loads(cfg_file.read_text())
  except json.JSONDecodeError as e:
    raise CheckpointError(f'{cfg_file} is not valid JSON: {e}') from e


def _rope_params(hf: Mapping) -> dict:
  return dict(hf.get('rope_parameters') or hf.get('rope_scaling') or {})


def rope_theta_from_hf(hf: Mapping) -> float:
  """RoPE theta from ``rope_parameters`` (transformers >= 5) or ``rope_theta``."""
  theta = _rope_params(hf).get('rope_theta', hf.get('rope_theta'))
  if theta is None:
    raise CheckpointError('config.json gives no rope_theta (nor rope_parameters.rope_theta)')
  return float(theta)


def rope_scaling_from_hf(hf: Mapping, *, allow_scaling: bool = True) -> RopeScaling | None:
  """``None`` for default RoPE, a :class:`RopeScaling` for ``rope_type: llama3``."""
  params = _rope_params(hf)
  rope_type = params.get('rope_type', params.get('type', 'default'))
  if rope_type in ('default', None):
    return None
  if rope_type != 'llama3' or not allow_scaling:
    supported = "'default' or 'llama3'" if allow_scaling else "'default'"
    raise CheckpointError(f'rope_type {rope_type!r} is not supported (only {supported})')
  try:
    return RopeScaling(
      factor=float(params['factor']),
      low_freq_factor=float(params['low_freq_factor']),
      high_freq_factor=float(params['high_freq_factor']),
      original_max_position_embeddings=int(params['original_max_position_embeddings']),
    )
  except KeyError as e:
    raise CheckpointError(f'llama3 rope scaling lacks {e.args[0]!r}') from e
