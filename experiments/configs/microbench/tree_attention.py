"""Tree-attention kernel benchmark: Pallas kernel vs the XLA dense-mask path.

Run (GPU or TPU, the platform's kernel; Qwen3-8B attention shapes, bf16):
  python -m experiments.microbench --task=kernel \
      --config=experiments/configs/microbench/tree_attention.py \
      --workdir=benchmarks
CPU smoke run (interpret mode, tiny shapes; what CI runs):
  python -m experiments.microbench --task=kernel \
      --config=experiments/configs/microbench/tree_attention.py:tiny --workdir=/tmp/bench
No accelerator run is recorded in the repository yet.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.num_heads = 32
  config.num_kv_heads = 8
  config.head_dim = 128
  config.dtype = 'bfloat16'
  config.prefix_lengths = (1024, 4096, 16384)
  config.num_nodes = (16, 64, 128, 256)
  config.repeats = 20
  config.seed = 0
  config.peak_bandwidth_gbs = 4800.0  # H200 HBM3e, for the ratio column (a TPU reports its own)
  if arg == 'tiny':
    config.num_heads, config.num_kv_heads, config.head_dim = 4, 2, 64
    config.dtype = 'float32'
    config.prefix_lengths = (100,)
    config.num_nodes = (7, 16)
    config.repeats = 2
  return config
