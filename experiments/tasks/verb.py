"""The verb binaries' dispatch: ``python -m experiments.<verb> [--task=NAME] --config=...
--workdir=...`` imports the task's module, defines its flags and runs its ``main`` under absl."""

import importlib
import sys

import jax
from absl import app, flags

from jetspec_jax.models import model_cache


def pop_task(argv: list[str], tasks: dict[str, str], default: str) -> tuple[str, list[str]]:
  """The ``--task=NAME`` (or ``--task NAME``) of ``argv`` and the rest of it."""
  task, rest, i = default, [argv[0]], 1
  while i < len(argv):
    arg = argv[i]
    if arg.startswith('--task='):
      task = arg.split('=', 1)[1]
    elif arg == '--task' and i + 1 < len(argv):
      task = argv[i + 1]
      i += 1
    else:
      rest.append(arg)
    i += 1
  if task not in tasks:
    raise SystemExit(f'--task={task!r} is not one of {", ".join(sorted(tasks))}')
  return task, rest


def run(
  tasks: dict[str, str],
  default: str,
  argv: list[str] | None = None,
  compile_cache: bool = False,
) -> None:
  """Runs the chosen task's module (``tasks``: name -> module path) as an absl program;
  ``compile_cache``: with the ``--compile_cache`` flag (a persistent XLA compilation cache)."""
  task, rest = pop_task(list(sys.argv if argv is None else argv), tasks, default)
  module = importlib.import_module(tasks[task])
  module.define_flags()
  main = module.main
  if compile_cache:
    # Compiled programs persist across runs of the data, train and evaluate verbs: a resumed or
    # repeated run skips the minutes each shape (a prefill bucket, a walk, a train step) takes
    # to compile on a CPU. The timing verbs (benchmark, microbench) compile afresh.
    flags.DEFINE_string(
      'compile_cache',
      str(model_cache.cache_dir() / 'xla'),
      'Persistent XLA compilation cache ("": none).',
    )

    def main(argv):
      use_compile_cache(flags.FLAGS.compile_cache)
      return module.main(argv)

  app.run(main, argv=rest)


def use_compile_cache(directory: str) -> None:
  """Compiled programs are stored in, and read back from, ``directory`` ('': not at all)."""
  if directory:
    jax.config.update('jax_compilation_cache_dir', directory)
