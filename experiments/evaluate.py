"""Evaluation: the public benchmark table, and held-out teacher-forced metrics of heads.

  python -m experiments.evaluate --config=experiments/configs/evaluate/public_smollm2.py \
      --workdir=benchmarks/public

Tasks (``--task``): ``public`` (default; responses, tree walks, checks and the rendered table,
``tasks/public_table.py``), ``heldout`` (``tasks/heldout.py``), ``online`` (online adaptation on
public prompt streams, ``tasks/online_streams.py``).
"""

from experiments.tasks import verb

TASKS = dict(
  public='experiments.tasks.public_table',
  heldout='experiments.tasks.heldout',
  online='experiments.tasks.online_streams',
)

if __name__ == '__main__':
  verb.run(TASKS, default='public', compile_cache=True)
