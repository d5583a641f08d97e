"""Benchmark of the embedded default: ar vs chain vs tree, both heads, several budgets.

Run (the README's table):
  python -m experiments.benchmark --config=experiments/configs/benchmark/code_small.py \
      --workdir=benchmarks
Smoke run (CI): ``--config=experiments/configs/benchmark/code_small.py:tiny``.
"""

import ml_collections

from jetspec_jax import corpus


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.target = 'assets/target_code_small'
  config.heads = ml_collections.ConfigDict(
    dict(jetspec='assets/jetspec_head_code_small', dflash='assets/dflash_head_code_small')
  )
  config.prompts = 'code'  # raw code prompts: HumanEval + held-out standard-library modules
  config.num_humaneval = 16
  config.num_heldout = 8
  config.validation_modules = corpus.VALIDATION_MODULES
  config.max_new_tokens = 64
  config.width = 7
  config.budgets = (8, 16, 32, 64, 128, 255)
  config.tree_algorithms = ('accum_logp', 'top2gap')
  config.temperatures = (0.0, 1.0)
  config.batch_sizes = (1, 2, 4, 8)
  config.batch_budget = 32
  config.batch_head = 'jetspec'
  if arg == 'tiny':
    config.num_humaneval, config.num_heldout = 2, 1
    config.max_new_tokens = 16
    config.budgets = (8,)
    config.tree_algorithms = ('accum_logp',)
    config.batch_sizes = (1, 2)
    config.batch_budget = 8
    config.round_cost_batches = (1,)
    config.round_cost_settings = ('tree/jetspec/accum_logp/8',)
  return config
