"""Benchmarks the tree-attention kernel against the XLA dense-mask path.

  python -m experiments.microbench --task=kernel \
      --config=experiments/configs/microbench/tree_attention.py

The kernel is the platform's (:mod:`pallas_kernels.dispatch`): Triton on a CUDA GPU, Mosaic on a
TPU, the interpreted Triton kernel on CPU. Writes ``tree_attention_<device>.json`` and a markdown
table to ``--workdir``; the bandwidth ratio is against the chip's HBM peak (a TPU reports its
own; elsewhere ``config.peak_bandwidth_gbs``).
"""

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

import jetspec_jax as js
from experiments.tasks import bench
from experiments.tasks.bench import median_time
from jetspec_jax.decoding import bucket
from pallas_kernels import dispatch


def run(config, workdir: str) -> dict:
  dtype = jnp.dtype(config.dtype)
  backend = jax.default_backend()
  interpret = backend == 'cpu'
  kernel_name = {'gpu': 'triton', 'tpu': 'mosaic'}.get(backend, 'triton (interpreted)')
  peak_gbs = peak_bandwidth_gbs(config)
  n, kh, h = config.num_heads, config.num_kv_heads, config.head_dim
  rng = np.random.default_rng(config.seed)
  rows = []
  for prefix in config.prefix_lengths:
    for m in config.num_nodes:
      capacity = bucket(prefix + m)

      def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)

      q, kt, vt = normal(1, m, n, h), normal(1, m, kh, h), normal(1, m, kh, h)
      kc, vc = normal(1, capacity, kh, h), normal(1, capacity, kh, h)
      plen = jnp.array([prefix], jnp.int32)
      anc = js.testing.random_tree(config.seed, m).ancestor_mask()[None]
      kernel = jax.jit(dispatch.tree_attention)
      dense_mask = js.decoder.TailMask(plen, anc).to_dense(m, capacity)

      @jax.jit
      def xla(q, kt, vt, kc, vc, mask, plen=plen):
        slots = plen[:, None] + jnp.arange(kt.shape[1])[None]
        kc = js.kv_cache.write_slots(kc, slots, kt)
        vc = js.kv_cache.write_slots(vc, slots, vt)
        return js.decoder.attention_xla(q, kc, vc, mask)

      t_kernel = median_time(kernel, q, kt, vt, kc, vc, plen, anc, repeats=config.repeats)
      t_xla = median_time(xla, q, kt, vt, kc, vc, dense_mask, repeats=config.repeats)
      # Bytes the kernel must move: prefix K/V, tail K/V, queries and outputs.
      moved = dtype.itemsize * (2 * (prefix + m) * kh * h + 2 * m * n * h)
      rows.append(
        dict(
          prefix=prefix,
          nodes=m,
          kernel_ms=t_kernel * 1e3,
          xla_ms=t_xla * 1e3,
          kernel_gbs=moved / t_kernel / 1e9,
          xla_gbs=moved / t_xla / 1e9,
          kernel_vs_peak=moved / t_kernel / 1e9 / peak_gbs,
        )
      )
      logging.info('%s', rows[-1])
  result = dict(
    **bench.envelope(config),
    kernel=kernel_name,
    interpret=interpret,
    peak_bandwidth_gbs=peak_gbs,
    rows=rows,
  )
  table = bench.markdown(
    (
      ('prefix', '{prefix}'),
      ('M', '{nodes}'),
      ('pallas ms', '{kernel_ms:.3f}'),
      ('xla ms', '{xla_ms:.3f}'),
      ('pallas GB/s', '{kernel_gbs:.1f}'),
      ('xla GB/s', '{xla_gbs:.1f}'),
      ('pallas / peak BW', '{kernel_vs_peak:.1%}'),
    ),
    rows,
  )
  bench.write_result(result, workdir, f'tree_attention_{bench.device_tag()}', table)
  print(table)
  return result


def peak_bandwidth_gbs(config) -> float:
  """The HBM peak the ratio column divides by: a TPU's own figure, else the config's."""
  if jax.default_backend() == 'tpu':
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.get_tpu_info().mem_bw_bytes_per_second / 1e9
  return config.peak_bandwidth_gbs


def main(argv):
  del argv
  logging.info('JAX %s on %s', jax.__version__, jax.devices())
  run(flags.FLAGS.config, flags.FLAGS.workdir)


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  # Flags are defined only when run as a binary, so tests can import several binaries.
  config_flags.DEFINE_config_file('config', 'experiments/configs/microbench/tree_attention.py')
  flags.DEFINE_string('workdir', 'benchmarks', 'Where the JSON and table go.')
