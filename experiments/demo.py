"""The main job: ar vs chain vs tree (vs tree + copy candidates) decoding of SmolLM2-135M-Instruct,
lossless and timed (``tasks/demo.py``).

  make demo
  # == python -m experiments.demo [--config=experiments/configs/demo/main_job.py[:code_small]]
"""

from experiments.tasks import verb

TASKS = dict(demo='experiments.tasks.demo')

if __name__ == '__main__':
  verb.run(TASKS, default='demo')
