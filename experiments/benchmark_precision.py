"""float32 vs bfloat16-input / float32-accumulate matmuls on this machine: bare matmuls at the
shapes head training and decoding use, and the SmolLM2-135M target's decode, verify and prefill.

  python -m experiments.benchmark_precision --out=benchmarks/precision_cpu.json

Whether bf16 pays depends on the CPU (AMX / AVX512-BF16 units) or accelerator: measure, then set
``compute_dtype`` (``Target.with_compute_dtype``, ``train.compute_dtype``) accordingly. Each
timing is the median of ``--repeats`` synchronised calls after a compile and a warm-up.
"""

import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from experiments import bench
from jetspec_jax.models import gguf_io, hf_io, matmul

MATMULS = ((1, 576, 1536), (16, 576, 1536), (1024, 576, 1536), (1024, 576, 49152))
# (batch, new tokens, context): decode, verify 16 / 64 nodes, a batch-32 decode, a prefill.
TARGET_SHAPES = ((1, 1, 512), (1, 16, 512), (1, 64, 512), (32, 1, 512), (8, 480, 480))


def median_ms(fn, *args) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(flags.FLAGS.repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def matmul_rates() -> list[dict]:
  rows = []
  plain = jax.jit(lambda x, w: x @ w)
  mixed = jax.jit(lambda x, w: matmul.matmul(x, w, 1, jnp.bfloat16))
  for m, k, n in MATMULS:
    x, w = jnp.ones((m, k)), jnp.ones((k, n))
    gflop = 2 * m * k * n / 1e9
    rows.append(
      dict(
        shape=[m, k, n],
        float32_gflops=gflop / median_ms(plain, x, w) * 1e3,
        bf16_in_f32_acc_gflops=gflop / median_ms(mixed, x, w) * 1e3,
      )
    )
    print(json.dumps(rows[-1]), flush=True)
  return rows


def target_times() -> list[dict]:
  target = hf_io.load_target(gguf_io.resolve_model_path('smollm2_135m_instruct'))

  @jax.jit
  def step(tgt, tokens, cache):
    return tgt.lm_logits(tgt.forward(tokens, cache).hidden[:, -1:])

  rows = []
  for b, t, context in TARGET_SHAPES:
    row = dict(batch=b, new_tokens=t, context=context)
    for name, compute_dtype in (('float32_ms', None), ('bf16_in_f32_acc_ms', 'bfloat16')):
      tgt = target.with_compute_dtype(compute_dtype)
      cache = tgt.make_cache(b, max(context, t))
      start = 0 if t >= context else context - t - 1
      cache = cache.replace(lengths=jnp.full((b,), start, jnp.int32))
      row[name] = median_ms(step, tgt, jnp.ones((b, t), jnp.int32), cache)
    rows.append(row)
    print(json.dumps(row), flush=True)
  return rows


def main(argv):
  del argv
  record = dict(
    machine=bench.cpu_description(),
    devices=str(jax.devices()),
    matmuls=matmul_rates(),
    smollm2_135m=target_times(),
  )
  if flags.FLAGS.out:
    pathlib.Path(flags.FLAGS.out).write_text(json.dumps(record, indent=2) + '\n')


if __name__ == '__main__':
  flags.DEFINE_string('out', None, 'Write the results here as JSON.')
  flags.DEFINE_integer('repeats', 5, 'Timed calls per measurement.')
  app.run(main)
