"""The main job: JetSpec on the embedded default (a small code model trained on the Python
standard library, with its JetSpec head), on HumanEval prompts.

Run:
  make demo          # == .venv/bin/python -m experiments.demo
Smoke run (CI): ``--config=experiments/configs/demo.py:tiny``.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.target = 'assets/target_code_small'
  config.head = 'assets/jetspec_head_code_small'
  config.num_prompts = 4
  config.max_new_tokens = 96
  config.budget = 32
  config.width = 7
  if arg == 'tiny':
    config.num_prompts = 2
    config.max_new_tokens = 24
    config.budget = 16
  return config
