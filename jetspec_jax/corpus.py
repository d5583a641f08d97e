"""The code corpus every Python install carries: the standard library's sources, split by module.

Defined once here: the embedded code model trains on the training split, its heads' prompts come
from the training split, and evaluation prompts come from :data:`VALIDATION_MODULES` (held out).
"""

import pathlib
import sysconfig

VALIDATION_MODULES = ('json', 'csv', 'textwrap', 'fractions', 'statistics')
_SKIP_PARTS = {'test', 'tests', 'idlelib', 'site-packages', 'turtledemo', 'lib2to3', '__pycache__'}


def stdlib_files(
  validation_modules: tuple[str, ...],
) -> tuple[list[pathlib.Path], list[pathlib.Path]]:
  """(train, validation) ``.py`` files of the standard library; validation = the named modules."""
  root = pathlib.Path(sysconfig.get_paths()['stdlib'])
  files = sorted(f for f in root.rglob('*.py') if not _SKIP_PARTS & set(f.relative_to(root).parts))
  if not files:
    raise FileNotFoundError(f'no standard-library sources under {root}')

  def module(f):
    rel = f.relative_to(root)
    return rel.parts[0].removesuffix('.py')

  val = [f for f in files if module(f) in validation_modules]
  train = [f for f in files if module(f) not in validation_modules]
  return train, val


def read_texts(files) -> list[str]:
  return [f.read_text(encoding='utf-8', errors='replace') for f in files]
