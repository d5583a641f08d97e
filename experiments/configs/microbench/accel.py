"""Where a JetSpec round's time goes, against the weight-read limit (one device, batch 1).

Run on an accelerator (random bf16 weights; nothing to download):
  python -m experiments.microbench --config=experiments/configs/microbench/accel.py:qwen3_8b \
      --workdir=benchmarks
Other args: ``qwen3_30b_a3b``; ``tiny`` is the CPU smoke run CI executes. On a CPU (float32,
XLA attention; each part also as a multiple of one decode step, plus the Qwen3-8B prefill memory):
  python -m experiments.microbench --config=experiments/configs/microbench/accel.py:smollm2_135m \
      --workdir=benchmarks
  (and ``:qwen3_0_6b``).
Result: no accelerator run recorded yet. CPU (2 cores, float32;
benchmarks/history/accel_smollm2_135m_cpu.md): decode 36.8 ms at context 512; verify 16/64 nodes
2.33x/5.20x a decode step; full round at budget 32 2.96x; Qwen3-8B prefill temporaries
1.42 GiB at 4k and 16k tokens.
"""

import ml_collections


def get_config(arg: str | None = 'tiny') -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.preset = arg or 'tiny'
  config.dtype = 'bfloat16'
  config.head_layers = 5
  config.taps = (1, 9, 17, 25, 33)
  config.block_size = 16
  config.contexts = (512, 2048, 8192)
  config.nodes = (16, 32, 64, 128, 256)
  config.attn_impls = ('xla', 'pallas')
  config.width = 7
  config.round_budget = 64
  config.forced_accept = 6
  config.rounds = 8
  config.repeats = 10
  config.copy_bytes = 1 << 30
  config.seed = 0
  config.prefill_memory_tokens = ()
  if config.preset == 'qwen3_30b_a3b':
    config.taps = (1, 12, 23, 34, 45)
    config.head_layers = 8
  if config.preset in ('smollm2_135m', 'qwen3_0_6b'):  # CPU runs
    config.dtype = 'float32'
    config.attn_impls = ('xla',)
    config.contexts = (512, 2048)
    config.nodes = (16, 32, 64, 128)
    config.round_budget = 32
    config.forced_accept = 3
    config.rounds = 4
    config.repeats = 5
    config.copy_bytes = 1 << 28
    config.prefill_memory_tokens = (4096, 16384)
    if config.preset == 'smollm2_135m':
      config.head_layers, config.block_size, config.taps = 3, 8, (1, 8, 15, 22, 27)
    else:
      config.head_layers, config.block_size, config.taps = 2, 8, (1, 7, 14, 21, 25)
  if config.preset == 'tiny':
    config.dtype = 'float32'
    config.head_layers = 1
    config.taps = (0, 2)
    config.block_size = 6
    config.contexts = (48,)
    config.nodes = (8, 16)
    config.round_budget = 16
    config.forced_accept = 3
    config.rounds = 3
    config.repeats = 2
    config.copy_bytes = 1 << 24
  return config
