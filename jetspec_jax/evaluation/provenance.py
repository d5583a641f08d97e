"""What made a result: the commit, the command, the date, the machine, the versions and the
sha256 of every weight file read (the head of every result file of the public table)."""

import datetime
import hashlib
import importlib.metadata
import os
import pathlib
import platform
import subprocess
import sys


def git_commit(repo='.') -> dict:
  """``{'commit': sha or None, 'dirty': bool}`` of the checkout at ``repo``."""
  try:
    sha = subprocess.run(
      ['git', 'rev-parse', 'HEAD'], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    status = subprocess.run(
      ['git', 'status', '--porcelain', '--untracked-files=no'],
      cwd=repo,
      capture_output=True,
      text=True,
      check=True,
    ).stdout
  except (OSError, subprocess.CalledProcessError):
    return {'commit': None, 'dirty': None}
  return {'commit': sha, 'dirty': bool(status.strip())}


def cpu_description(cpuinfo: str = '/proc/cpuinfo') -> str:
  """The CPU's model name and its matrix / bf16 units (``amx_bf16``, ``avx512_bf16``), which
  decide whether bfloat16-input matmuls pay on it; ``platform.machine()`` where unreadable."""
  try:
    text = pathlib.Path(cpuinfo).read_text()
  except OSError:
    return platform.machine()
  fields = [ln.split(':', 1) for ln in text.splitlines() if ':' in ln]
  model = next((v.strip() for k, v in fields if k.strip() == 'model name'), '')
  flags = next((v.split() for k, v in fields if k.strip() == 'flags'), [])
  units = [f for f in ('amx_bf16', 'avx512_bf16') if f in flags]
  return f'{model or platform.machine()} ({", ".join(units) or "no amx_bf16 / avx512_bf16"})'


def versions(packages=('jax', 'jaxlib', 'flax', 'numpy', 'optax')) -> dict:
  out = {'python': platform.python_version()}
  for name in packages:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


def file_sha256(path) -> str:
  h = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(1 << 20), b''):
      h.update(block)
  return h.hexdigest()


def weights_sha256(path) -> dict[str, str]:
  """sha256 of each weight file of a checkpoint directory (``*.safetensors``), or of one file."""
  path = pathlib.Path(path)
  files = sorted(path.glob('*.safetensors')) if path.is_dir() else [path]
  return {f.name: file_sha256(f) for f in files}


def command_line() -> str:
  """This process's command as typed: ``python -m package.module ...`` for a module run."""
  main = sys.modules.get('__main__')
  spec = getattr(main, '__spec__', None)
  head = ['python', '-m', spec.name] if spec is not None and spec.name else ['python', sys.argv[0]]
  return ' '.join([*head, *sys.argv[1:]])


def record(repo='.') -> dict:
  return dict(
    **git_commit(repo),
    command=command_line(),
    date_utc=datetime.datetime.now(datetime.UTC).strftime('%Y-%m-%dT%H:%M:%SZ'),
    cpu=cpu_description(),
    cores=os.cpu_count(),
    versions=versions(),
  )
