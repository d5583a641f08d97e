"""Benchmark of SmolLM2-135M-Instruct (the main job's model) with its two heads, on the CPU.

Run (the README's SmolLM2 table):
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py \
      --workdir=benchmarks/smollm2_135m
DSpark against JetSpec and DFlash-style (all three heads: same data, size and steps), batch 1 and
8, T=0 and T=1:
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py:dspark \
      --workdir=benchmarks/smollm2_135m_dspark

Held-out chat-formatted prompts in three groups (code: HumanEval as a request; chat:
``EVAL_CHAT_INSTRUCTIONS``; math: ``EVAL_MATH_TEMPLATES``), disjoint from the heads' training
prompts; decoding stops at the tokenizer's stop ids. The peer is transformers' own ``generate``
(greedy and prompt-lookup) on the same GGUF file and prompts (test-only dependencies).
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.target = 'smollm2_135m_instruct'
  config.heads = ml_collections.ConfigDict(
    dict(
      jetspec='assets/jetspec_head_smollm2_135m',
      dflash='assets/dflash_head_smollm2_135m',
    )
  )
  config.prompts = 'chat'
  config.num_per_group = 2
  config.stop_at_eos = True
  config.max_new_tokens = 48
  config.width = 7
  config.budgets = (8, 16, 32, 64, 128)
  config.tree_algorithms = ('accum_logp', 'top2gap')
  config.sampled_tree_algorithms = ('accum_logp',)  # T=1
  config.temperatures = (0.0, 1.0)
  config.peers = ('greedy', 'prompt_lookup')
  config.peer_threads = 2
  config.batch_sizes = ()
  config.batch_budget = 16
  config.batch_head = 'jetspec'
  if arg == 'dspark':
    config.heads.dspark = 'assets/dspark_head_smollm2_135m'
    config.num_per_group = 3
    config.budgets = (8, 16)
    config.tree_algorithms = ('accum_logp',)
    config.dspark_verify = (('threshold', 0.0), ('threshold', 0.3), ('scheduler', 0.0))
    config.peers = ()
    config.batch_sizes = (1, 8)
    config.batch_temperatures = (0.0, 1.0)
    config.batch_settings = (
      'ar',
      'chain/dflash',
      'tree/jetspec/accum_logp/16',
      'dspark/dspark/threshold0.3',
      'dspark/dspark/scheduler',
    )
  if arg == 'quick':  # tau / speedup of the settings that matter on a CPU, in minutes
    config.budgets = (8, 16, 32)
    config.tree_algorithms = ('accum_logp',)
    config.temperatures = (0.0,)
  return config
