"""Builds the target-feature cache a head-training config reads, in parallel processes.

  python -m experiments.data --task=features --config=experiments/configs/train/draft_smollm2.py \
      --config.data.prompt_rounds=3 --workers=2

``train_draft`` computes the features it is missing itself, in one process; on a fresh machine
this builds them first, each worker a disjoint share of the shards (every ``workers``-th from its
own offset), so a CPU the one process leaves part idle is kept busy. Finished shards are skipped,
so an interrupted build resumes where it stopped, and ``train_draft`` with the same config then
finds nothing left to compute. ``--config.data.features_compute_dtype=bfloat16`` (with a
``data.features_dir`` of its own) builds the cache with bfloat16 matmul inputs, ~1.5x faster on a
CPU with AMX (benchmarks/history/README.md).
"""

import subprocess
import sys
import time

from absl import flags, logging
from ml_collections import config_flags

from jetspec_jax.training import run_config

FLAGS = flags.FLAGS


def worker_command(argv: list[str], part: int) -> list[str]:
  """This binary's own command line for worker ``part`` (the config and its overrides kept)."""
  keep = [a for a in argv[1:] if not a.startswith(('--part', '--task'))]
  return [sys.executable, '-m', 'experiments.data', '--task=features', *keep, f'--part={part}']


def run(config, *, part: int = 0, parts: int = 1) -> int:
  """Computes this process's share of the missing features; returns how many shards it did."""
  if not config.data.get('dir'):
    raise ValueError('config.data.dir is empty: point it at the token shards')
  target = run_config.load_target_from_config(config.target)
  return run_config.build_feature_cache(config, target, config.data.dir, part=part, parts=parts)


def main(argv):
  del argv  # absl's leftovers: the workers get this process's whole command line
  start = time.time()
  if FLAGS.part is None and FLAGS.workers > 1:
    workers = [subprocess.Popen(worker_command(sys.argv, i)) for i in range(FLAGS.workers)]
    failed = [i for i, w in enumerate(workers) if w.wait() != 0]
    if failed:
      raise SystemExit(f'feature workers {failed} failed (re-running resumes)')
    logging.info('features built by %d workers in %.0f s', FLAGS.workers, time.time() - start)
    return
  part, parts = (0, 1) if FLAGS.part is None else (FLAGS.part, FLAGS.workers)
  n = run(FLAGS.config, part=part, parts=parts)
  print(f'part {part} of {parts}: {n} shards computed in {time.time() - start:.0f} s', flush=True)


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  config_flags.DEFINE_config_file('config', None, 'Head-training config.', lock_config=True)
  flags.DEFINE_integer('workers', 2, 'Processes, each computing a disjoint share of the shards.')
  flags.DEFINE_integer('part', None, 'Internal: the share this process computes.')
  flags.mark_flags_as_required(['config'])
