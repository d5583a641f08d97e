"""Decoding benchmarks: tau, tokens/s and speedup of every setting on prompt groups, settings
interleaved prompt by prompt.

  python -m experiments.benchmark --config=experiments/configs/benchmark/smollm2.py \
      --workdir=runs/benchmark

Tasks (``--task``): ``decode`` (default; ``tasks/decode_benchmark.py``), ``bf16`` (float32
against bfloat16-weight targets, ``tasks/bf16_decode.py``).
"""

from experiments.tasks import verb

TASKS = dict(
  decode='experiments.tasks.decode_benchmark',
  bf16='experiments.tasks.bf16_decode',
)

if __name__ == '__main__':
  verb.run(TASKS, default='decode')
