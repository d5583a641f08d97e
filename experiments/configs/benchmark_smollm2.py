"""Benchmark of SmolLM2-135M-Instruct (the main job's model) with its heads, on the CPU.

Run (the README's SmolLM2 table: the shipped JetSpec and DFlash-style heads, chains and trees of
8 and 16 nodes with and without 4 copy candidates at T=0, without them at T=1, batch 1 and 8,
transformers' own generate beside them; 9 held-out prompts):
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py \
      --workdir=benchmarks/smollm2_135m
The budget sweep (8-128 nodes, accum_logp and top2gap, 6 prompts) the configs below start from:
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py:sweep \
      --workdir=benchmarks/smollm2_135m_sweep
DSpark against JetSpec (the shipped heads: same recipe, data, size and steps; DSpark without copy
seeds), one sequence at a time, T=0 and T=1:
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py:dspark \
      --workdir=benchmarks/smollm2_135m_dspark
JetSpec++ against JetSpec (the shipped heads: same recipe, copy seeds, data, size and steps): trees
of 8 nodes with and without copy candidates, MASK (seeded) slots and recycled guesses, T=0 and
T=1, the head's share of a round:
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py:jetspecpp \
      --workdir=benchmarks/smollm2_135m_jetspecpp
Copy candidates (prompt lookup joined to the trees, chains and JetSpec++ trees; tau, speedup and
the share of accepted drafts that only the copy branch held), T=0 and T=1, batch 1 and 8:
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py:copy \
      --workdir=benchmarks/smollm2_135m_copy

Tau per prompt group on 16 prompts of each group (48 in all; greedy, chains and best_first trees
of 8 and 16 nodes, with and without 4 copy candidates), for one head (``heads.jetspec``):
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py:groups \
      --workdir=benchmarks/smollm2_135m_groups

The shipped JetSpec head on whole responses (up to 256 new tokens instead of the first 48; T=0,
chains and trees of 8 and 16 nodes, with and without copy candidates):
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py:long \
      --workdir=benchmarks/smollm2_135m_long

The same with trees built node by node (`tree.best_first`: the most probable paths, where
accum_logp adds all 7 candidates per expansion and so spends 8 nodes on the root's children):
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py:best_first \
      --workdir=benchmarks/smollm2_135m_best_first

Budgets of 6-12 nodes for those trees, each with and without a 2-token copy branch:
  python -m experiments.benchmark \
      --config=experiments/configs/benchmark_smollm2.py:best_first_budgets \
      --workdir=benchmarks/smollm2_135m_best_first_budgets

The JetSpec head trained for 1,600 steps on all of round 0 (assets/README.md, "Scaling with
steps") beside the 800-step head that was shipped when this ran (session 47; since session 48 the
1,600-step head is the shipped one, so ``heads.jetspec`` must name the older head's export for the
same comparison), whole responses, T=0, chains and trees of 6 and 8 nodes:
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py:steps \
      --config.heads.steps1600=runs/scale_all_jetspec_1600/export \
      --workdir=benchmarks/smollm2_135m_steps

A head trained with the new recipe (assets/README.md) against the shipped JetSpec head, T=0,
budget 16, with and without copy candidates:
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py:recipe \
      --config.heads.recipe=runs/jetspec_r3_full/export --workdir=benchmarks/smollm2_135m_recipe

A copy-seeded head (its draft slots hold the context's copy candidates) against the head of the
same recipe and data without them, T=0, chains and trees of 8 and 16 nodes, with and without a
copy branch:
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py:copy_seeded \
      --workdir=benchmarks/smollm2_135m_copy_seeded

The heads of issue 28 at equal data and steps (JetSpec with and without copy seeds, the seeded
DFlash-style head, JetSpec++), T=0, chains and trees of 16 nodes, with and without a copy branch:
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py:equal_data \
      --workdir=benchmarks/smollm2_135m_equal_data

The JetSpec head fine-tuned on prompt rounds 0-2 (2.0M response tokens; from the shipped head,
600 steps, assets/README.md) beside the shipped head, 4 prompts per group, T=0, chains and
best_first trees of 8 and 16 nodes, with and without 4 copy candidates:
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py:rounds \
      --workdir=benchmarks/smollm2_135m_rounds

Since session 54 ``assets/jetspec_head_smollm2_135m`` is the JetSpec head fine-tuned on rounds
0-2 (1,500 steps; assets/README.md). The comparisons above at equal data (``:dspark``,
``:jetspecpp``, ``:copy``, ``:rounds``, ``:groups``, ...) ran with the round-0 head shipped before
it; to repeat one, extract that head and name it:
  git archive a450b14 assets/jetspec_head_smollm2_135m | tar -x -C /tmp/round0
  python -m experiments.benchmark --config=experiments/configs/benchmark_smollm2.py:jetspecpp \
      --config.heads.jetspec=/tmp/round0/assets/jetspec_head_smollm2_135m --workdir=...

Held-out chat-formatted prompts in three groups (code: HumanEval as a request; chat:
``EVAL_CHAT_INSTRUCTIONS``; math: ``EVAL_MATH_TEMPLATES``), disjoint from the heads' training
prompts; decoding stops at the tokenizer's stop ids. The peer is transformers' own ``generate``
(greedy and prompt-lookup) on the same GGUF file and prompts (test-only dependencies).
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
  # Prompt by prompt across the settings: this shared VM's speed drifts by up to 2-3x for minutes
  # at a time (per-round times of one setting ranged 110-350 ms in one run), which setting after
  # setting turned into speedup differences between settings of equal tau and round cost.
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
    # DSpark against JetSpec (the shipped heads since session 62: 1,600 steps on round 0 + 1,500
    # on rounds 0-2, DSpark without greedy 57-58 of round 0, its calibration shards): the JetSpec
    # head's fastest CPU settings (trees of 8 nodes, with and without 4 copy candidates) beside
    # DSpark's chain verified whole (threshold 0), cut by its confidences (0.3) and by its
    # scheduler.
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
    # JetSpec++ against JetSpec, the shipped heads (since session 61 both copy-seeded, 1,600 steps
    # on round 0 + 1,500 on rounds 0-2): trees of 8 nodes with and without 4 copy candidates,
    # seeded slots (= JetSpec drafting with this head) and recycled guesses, T=0 and T=1, batch 1.
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
  if arg == 'recipe':  # a head of the new recipe (issue 28 runs) beside the shipped JetSpec head
    heads = dict(
      jetspec='assets/jetspec_head_smollm2_135m',
      recipe='runs/jetspec_r3_full/export',  # --config.heads.recipe=<a train_draft export>
    )
    greedy_comparison(
      config,
      heads,
      num_per_group=3,
      budgets=(16,),
      tree_algorithm='accum_logp',
      copy_lens=(0, 4, 7),
    )
  if arg == 'copy_seeded':  # a copy-seeded head (head.copy_seed) beside the same recipe without it
    heads = dict(
      recipe='runs/jetspec_r3_full/export',  # --config.heads.recipe=<a train_draft export>
      copy_seeded='runs/jetspec_copy3_r3data/export',
    )
    greedy_comparison(
      config, heads, num_per_group=3, budgets=(8, 16), tree_algorithm='accum_logp', copy_lens=(0, 4)
    )
  if arg == 'equal_data':  # issue 28's heads on the same data, steps and recipe (assets/README.md)
    heads = dict(
      recipe='runs/jetspec_r3_full/export',  # JetSpec, no seeds
      copy_seeded='runs/jetspec_copy3_r3data/export',  # JetSpec, copy_seed=3
      dflash_seeded='runs/dflash_copy3_r3data/export',  # DFlash-style, copy_seed=3
      jetspecpp='runs/jetspecpp_r3data/export',  # JetSpec++ (no seeds: refine excludes them)
    )
    greedy_comparison(
      config, heads, num_per_group=3, budgets=(16,), tree_algorithm='accum_logp', copy_lens=(0, 4)
    )
    config.jetspecpp_variants = ((True, 0),)
  if arg in ('long', 'best_first', 'best_first_budgets', 'steps'):  # whole responses (<= 256)
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
  if arg == 'steps':  # a 1,600-step head beside heads.jetspec (was the 800-step head), trees 6-8
    config.heads = ml_collections.ConfigDict(
      dict(
        jetspec='assets/jetspec_head_smollm2_135m',
        steps1600='runs/scale_all_jetspec_1600/export',  # --config.heads.steps1600=<an export>
      )
    )
    config.budgets = (6, 8)
    config.tree_algorithms = ('best_first',)
    config.copy_lens = (0,)
    config.round_cost_settings = ('tree/jetspec/best_first/8', 'tree/steps1600/best_first/8')
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
  if arg == 'rounds':  # the shipped JetSpec head fine-tuned on prompt rounds 0-2 beside it
    heads = dict(
      jetspec='assets/jetspec_head_smollm2_135m',
      rounds012='runs/jetspec_r012_ft600/export',  # --config.heads.rounds012=<an export>
    )
    greedy_comparison(
      config, heads, num_per_group=4, budgets=(8, 16), tree_algorithm='best_first', copy_lens=(0, 4)
    )
    config.round_cost_settings = ('tree/jetspec/best_first/8', 'tree/rounds012/best_first/8')
  if arg == 'quick':  # tau / speedup of the settings that matter on a CPU, in minutes
    config.budgets = (8, 16, 32)
    config.tree_algorithms = ('accum_logp',)
    config.temperatures = (0.0,)
  return config
