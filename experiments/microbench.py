"""Microbenchmarks: the parts of a round, the tree-attention kernel, training throughput, matmul
precision modes, and the memory plan of a large recipe.

  python -m experiments.microbench --config=experiments/configs/microbench/accel.py:smollm2_135m \
      --workdir=benchmarks/accel

Tasks (``--task``): ``round`` (default; ``tasks/round_costs.py``), ``kernel``
(``tasks/kernel_bench.py``), ``training`` (``tasks/training_throughput.py``), ``precision``
(``tasks/precision.py``), ``memory`` (``tasks/memory_plan.py``).
"""

from experiments.tasks import verb

TASKS = dict(
  round='experiments.tasks.round_costs',
  kernel='experiments.tasks.kernel_bench',
  training='experiments.tasks.training_throughput',
  precision='experiments.tasks.precision',
  memory='experiments.tasks.memory_plan',
)

if __name__ == '__main__':
  verb.run(TASKS, default='round')
