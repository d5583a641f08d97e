"""Decoding benchmark of SmolLM2-135M-Instruct with its heads on a CPU: tau, tokens/s and speedup
on held-out chat-formatted prompts in three groups (code: HumanEval as a request; chat:
``EVAL_CHAT_INSTRUCTIONS``; math: ``EVAL_MATH_TEMPLATES``), disjoint from the heads' training
prompts, stopping at the tokenizer's stop ids; settings interleaved prompt by prompt; transformers'
own ``generate`` (greedy and prompt lookup) on the same file as the peer.

  python -m experiments.benchmark --config=experiments/configs/benchmark/smollm2.py[:preset] \
      --workdir=runs/benchmark_<preset>

Presets: none (the shipped JetSpec and DFlash-style heads, chains and best_first trees of 8 and 16
nodes with and without 4 copy candidates, T=0 and T=1, batch 1 and 8, the peers); ``sweep``
(budgets 8-128, ``accum_logp`` and ``top2gap``); ``dspark`` and ``jetspecpp`` (each shipped head
beside the JetSpec head); ``copy`` (copy candidates joined to trees, chains and JetSpec++ trees);
``groups`` (16 prompts per group); ``long`` (up to 256 new tokens), ``best_first`` and
``best_first_budgets`` (node-by-node trees of 6-16 nodes on long responses); ``compare`` (the
shipped JetSpec head beside any export: ``--config.heads.other=runs/<run>/export``); ``public``
(the public table's wall clock: 8 seeded prompts of each public set, 256 new tokens, the CPU
settings on the float32 and the bfloat16x2 target against the float32 AR and the peers); ``quick``.
"""

import ml_collections


def greedy_comparison(
  config, heads: dict, *, num_per_group: int, budgets, tree_algorithm: str, copy_lens
) -> None:
  """Sets ``config`` to compare ``heads`` (name -> export) at T=0 on chains and trees of
  ``budgets`` nodes, with each of ``copy_lens`` copy candidates, and no peers."""
  config.heads = ml_collections.ConfigDict(heads)
  config.num_per_group = num_per_group
  config.budgets = tuple(budgets)
  config.tree_algorithms = (tree_algorithm,)
  config.copy_lens = tuple(copy_lens)
  config.temperatures = (0.0,)
  config.peers = ()


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
  config.public_sets = ('gsm8k', 'math500', 'aime2024', 'aime2025', 'humaneval', 'mbpp')
  config.public_sets += ('mtbench', 'alpacaeval')
  config.seed = 0  # the public prompts' draw
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
  # Prompt by prompt across the settings, so a drift of the machine's speed slows all alike
  # (docs/benchmarks.md §2).
  config.interleave = True
  if arg is None:  # the shipped heads' settings that matter on a CPU
    config.num_per_group = 3
    config.budgets = (8, 16)
    config.tree_algorithms = ('best_first',)  # node by node (:best_first: +0.2-0.5 tau)
    config.sampled_tree_algorithms = ('best_first',)
    config.copy_lens = (0, 4)
    config.sampled_copy_lens = (0,)  # T=1: the heads alone
    config.batch_sizes = (1, 8)
    config.batch_temperatures = (0.0,)
    config.batch_settings = ('ar', 'tree/jetspec/best_first/8', 'tree/jetspec/best_first/16')
  if arg == 'dspark':
    # DSpark against JetSpec (the shipped heads, one recipe): the JetSpec head's fastest CPU
    # settings (trees of 8 nodes, with and without 4 copy candidates) beside DSpark's chain
    # verified whole (threshold 0), cut by its confidences (0.3) and by its scheduler.
    config.heads = ml_collections.ConfigDict(
      dict(
        jetspec='assets/jetspec_head_smollm2_135m',
        dspark='assets/dspark_head_smollm2_135m',
      )
    )
    config.num_per_group = 3
    config.budgets = (8,)
    config.tree_algorithms = ('accum_logp',)
    config.copy_lens = (0, 4)
    config.sampled_copy_lens = (0,)
    config.dspark_verify = (('threshold', 0.0), ('threshold', 0.3), ('scheduler', 0.0))
    config.peers = ()
    config.round_cost_batches = (1,)
    config.round_cost_settings = ('tree/jetspec/accum_logp/8/copy4', 'dspark/dspark/threshold0')
  if arg == 'jetspecpp':
    # JetSpec++ against JetSpec, the shipped heads (both copy-seeded, one recipe): trees of 8
    # nodes with and without 4 copy candidates, seeded slots (= JetSpec drafting with this head)
    # and recycled guesses, T=0 and T=1, batch 1.
    config.heads = ml_collections.ConfigDict(
      dict(
        jetspec='assets/jetspec_head_smollm2_135m',
        jetspecpp='assets/jetspecpp_head_smollm2_135m',
      )
    )
    config.num_per_group = 3
    config.budgets = (8,)
    config.tree_algorithms = ('accum_logp',)
    config.copy_lens = (0, 4)
    config.sampled_copy_lens = (0,)
    # (recycle, refine_passes): MASK slots, recycled guesses.
    config.jetspecpp_variants = ((False, 0), (True, 0))
    config.peers = ()
    config.round_cost_batches = (1,)  # the head's share of a round
    config.round_cost_settings = (
      'tree/jetspec/accum_logp/8/copy4',
      'jetspecpp/jetspecpp/accum_logp/8/recycle/passes0/copy4',
    )
  if arg == 'copy':
    config.heads.jetspecpp = 'assets/jetspecpp_head_smollm2_135m'
    config.num_per_group = 3
    config.budgets = (8, 16)
    config.tree_algorithms = ('accum_logp',)
    config.jetspecpp_variants = ((True, 0),)
    config.copy_lens = (0, 4, 7)  # 7: the heads' whole depth (block size 8)
    config.peers = ()
    config.batch_sizes = (1, 8)
    config.batch_temperatures = (0.0,)
    config.batch_settings = (
      'ar',
      'tree/jetspec/accum_logp/16',
      'tree/jetspec/accum_logp/16/copy7',
      'tree/jetspec/accum_logp/8/copy4',
    )
  if arg in ('long', 'best_first', 'best_first_budgets'):  # whole responses (<= 256)
    heads = dict(jetspec='assets/jetspec_head_smollm2_135m')
    greedy_comparison(
      config, heads, num_per_group=3, budgets=(8, 16), tree_algorithm='accum_logp', copy_lens=(0, 4)
    )
    config.max_new_tokens = 256
    config.round_cost_batches = (1,)  # ms per round and the head's share of it
    config.round_cost_settings = ('chain/jetspec', 'tree/jetspec/accum_logp/16/copy4')
  if arg == 'best_first':  # the :long run with node-by-node trees (jetspec_jax.tree.best_first)
    config.tree_algorithms = ('best_first',)
    config.round_cost_settings = ('tree/jetspec/best_first/8', 'tree/jetspec/best_first/16/copy4')
  if arg == 'best_first_budgets':  # the :best_first run with trees of 6-12 nodes, copy 0-2
    config.budgets = (6, 8, 10, 12)
    config.tree_algorithms = ('best_first',)
    config.copy_lens = (0, 2)
    config.round_cost_settings = tuple(f'tree/jetspec/best_first/{b}' for b in config.budgets)
  if arg == 'groups':  # tau per prompt group on 16 prompts each (the main table has 3), T=0
    heads = dict(jetspec='assets/jetspec_head_smollm2_135m')  # --config.heads.jetspec=<an export>
    greedy_comparison(
      config,
      heads,
      num_per_group=16,
      budgets=(8, 16),
      tree_algorithm='best_first',
      copy_lens=(0, 4),
    )
  if arg == 'compare':  # the shipped JetSpec head beside --config.heads.other=<an export>
    heads = dict(
      jetspec='assets/jetspec_head_smollm2_135m', other='assets/jetspec_head_smollm2_135m'
    )
    greedy_comparison(
      config, heads, num_per_group=4, budgets=(8, 16), tree_algorithm='best_first', copy_lens=(0, 4)
    )
  if arg == 'public':  # the public table's wall clock (docs/results.md): the CPU settings
    config.prompts = 'public'
    config.num_per_group = 8
    config.max_new_tokens = 256
    config.heads = ml_collections.ConfigDict(dict(jetspec='assets/jetspec_head_smollm2_135m'))
    config.budgets = (8, 16)
    config.tree_algorithms = ('best_first',)
    config.copy_lens = (0,)
    config.temperatures = (0.0,)
    config.targets = ('float32', 'bfloat16x2')  # every greedy setting on both, interleaved
    config.head_compute_dtype = 'bfloat16'  # the heads draft as in the public table
    config.peer_threads = 1  # the peers on one core, as our settings
  if arg == 'quick':  # tau / speedup of the settings that matter on a CPU, in minutes
    config.budgets = (8, 16, 32)
    config.tree_algorithms = ('accum_logp',)
    config.temperatures = (0.0,)
  return config
