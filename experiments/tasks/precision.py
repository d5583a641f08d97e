"""float32 vs bfloat16-input / float32-accumulate matmuls on this machine: bare matmuls at the
shapes head training and decoding use, and the SmolLM2-135M target's decode, verify and prefill
in four precisions.

  python -m experiments.microbench --task=precision --out=benchmarks/precision_cpu.json

Target variants: ``float32``; ``bf16_compute`` (float32 weights, each projection casts its
inputs to bfloat16 and accumulates in float32: ``Target.with_compute_dtype('bfloat16')``);
``bf16_weights`` (the weight matrices stored in bfloat16, float32 activations and cache:
``Target.with_weight_dtype('bfloat16')``); ``bf16x2_weights`` (the same, each projection input
split into two bfloat16 halves: ``split_inputs=True``, ``matmul.SPLIT``). A step is the forward
plus the full-vocabulary logits of every new token (a verify's argmax needs them all; the
prefill, of its last token only).

Whether bf16 pays depends on the CPU (AMX / AVX512-BF16 units) or accelerator: measure, then set
``compute_dtype`` accordingly. Timings are interleaved: every round times each (variant, shape)
once, in a rotated order, so a machine that speeds up or slows down during the run shifts all
variants alike; min and median over ``--repeats`` rounds after a compile and a warm-up.
"""

import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments.tasks import bench
from jetspec_jax.models import hf_io, matmul, model_cache

MATMULS = (
  (1, 576, 1536),
  (2, 576, 1536),
  (4, 576, 1536),
  (16, 576, 1536),
  (1024, 576, 1536),
  (1024, 576, 49152),
)
# (batch, new tokens, context): decode, verify 2 / 8 / 16 / 32 / 64 nodes, a batch-32 decode, a
# 512-token prefill.
TARGET_SHAPES = (
  (1, 1, 512),
  (1, 2, 512),
  (1, 8, 512),
  (1, 16, 512),
  (1, 32, 512),
  (1, 64, 512),
  (32, 1, 512),
  (1, 512, 512),
)


def median_ms(fn, *args) -> float:
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(flags.FLAGS.repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def interleaved_ms(calls: dict, repeats: int) -> dict:
  """``{name: (min_ms, median_ms)}`` of zero-argument ``calls``, each compiled and warmed up
  first, then timed once per round in an order rotated every round."""
  for fn in calls.values():
    jax.block_until_ready(fn())
  names = list(calls)
  times = {name: [] for name in names}
  for r in range(repeats):
    shift = r % len(names)
    for name in names[shift:] + names[:shift]:
      start = time.perf_counter()
      jax.block_until_ready(calls[name]())
      times[name].append(1e3 * (time.perf_counter() - start))
  return {name: (min(t), float(np.median(t))) for name, t in times.items()}


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


def target_variants(target) -> dict:
  return dict(
    float32=target,
    bf16_compute=target.with_compute_dtype('bfloat16'),
    bf16_weights=target.with_weight_dtype('bfloat16'),
    bf16x2_weights=target.with_weight_dtype('bfloat16', split_inputs=True),
  )


def target_times() -> list[dict]:
  variants = target_variants(
    hf_io.load_target(model_cache.resolve_model_path('smollm2_135m_instruct'))
  )

  @functools.partial(jax.jit, static_argnames='last_only')
  def step(tgt, tokens, cache, last_only):
    hidden = tgt.forward(tokens, cache).hidden
    return tgt.lm_logits(hidden[:, -1:] if last_only else hidden)

  calls = {}
  for b, t, context in TARGET_SHAPES:
    for name, tgt in variants.items():
      cache = tgt.make_cache(b, max(context, t))
      start = 0 if t >= context else context - t - 1
      cache = cache.replace(lengths=jnp.full((b,), start, jnp.int32))
      tokens = jnp.ones((b, t), jnp.int32)
      calls[(b, t, context, name)] = functools.partial(step, tgt, tokens, cache, t > 64)
  times = interleaved_ms(calls, flags.FLAGS.repeats)
  rows = []
  for b, t, context in TARGET_SHAPES:
    row = dict(batch=b, new_tokens=t, context=context)
    for name in variants:
      row[f'{name}_min_ms'], row[f'{name}_median_ms'] = times[(b, t, context, name)]
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


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  flags.DEFINE_string('out', None, 'Write the results here as JSON.')
  flags.DEFINE_integer('repeats', 9, 'Timed calls per measurement (rounds, for the target).')
