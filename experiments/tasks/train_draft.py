"""Trains a JetSpec draft head by self-distillation.

  python -m experiments.train --config=experiments/configs/train/draft_tiny.py --workdir=DIR

Generates the self-distilled data when the data directory is empty, trains with checkpoints
(re-running the same command resumes), exports the head to DIR/export in the released layout and
writes DIR/result.json.
"""

import jax
from absl import flags, logging
from ml_collections import config_flags

from jetspec_jax import sharding, training


def main(argv):
  del argv
  sharding.maybe_initialize_distributed(flags.FLAGS.distributed)
  logging.info('JAX %s on %s', jax.__version__, jax.devices())
  result = training.train_and_evaluate(flags.FLAGS.config, flags.FLAGS.workdir)
  print({k: v for k, v in result.items() if k != 'history'})


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  config_flags.DEFINE_config_file(
    'config', 'experiments/configs/train/draft_tiny.py', 'Training config.'
  )
  flags.DEFINE_string('workdir', None, 'Checkpoints, metrics and the exported head.')
  flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() (multi-host).')
  flags.mark_flags_as_required(['workdir'])
