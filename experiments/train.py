"""Training: a draft head by self-distillation (a config with a ``head``), or the small code
model from scratch (a target config such as ``configs/target_code_small.py``); resumable.

  python -m experiments.train --config=experiments/configs/train/draft_smollm2.py:jetspec \
      --workdir=runs/jetspec
  python -m experiments.train --task=target \
      --config=experiments/configs/train/target_code_small.py \
      --workdir=runs/target

Tasks (``--task``): ``draft`` (default; ``tasks/train_draft.py``), ``target``
(``tasks/train_target.py``).
"""

from experiments.tasks import verb

TASKS = dict(
  draft='experiments.tasks.train_draft',
  target='experiments.tasks.train_target',
)

if __name__ == '__main__':
  verb.run(TASKS, default='draft', compile_cache=True)
