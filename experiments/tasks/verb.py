"""The verb binaries' dispatch: ``python -m experiments.<verb> [--task=NAME] --config=...
--workdir=...`` imports the task's module, defines its flags and runs its ``main`` under absl."""

import importlib
import sys

from absl import app


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


def run(tasks: dict[str, str], default: str, argv: list[str] | None = None) -> None:
  """Runs the chosen task's module (``tasks``: name -> module path) as an absl program."""
  task, rest = pop_task(list(sys.argv if argv is None else argv), tasks, default)
  module = importlib.import_module(tasks[task])
  module.define_flags()
  app.run(module.main, argv=rest)
