"""Trains the embedded default's target (and its tokenizer) from scratch; resumable.

  python -m experiments.train --task=target \
      --config=experiments/configs/train/target_code_small.py \
      --workdir=runs/target_code_small
"""

import jax
from absl import flags, logging
from ml_collections import config_flags

from jetspec_jax import sharding
from jetspec_jax.training import target_trainer


def main(argv):
  del argv
  sharding.maybe_initialize_distributed(flags.FLAGS.distributed)
  logging.info('JAX %s on %s', jax.__version__, jax.devices())
  print(target_trainer.train_target(flags.FLAGS.config, flags.FLAGS.workdir))


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  config_flags.DEFINE_config_file(
    'config', 'experiments/configs/train/target_code_small.py', 'Target config.'
  )
  flags.DEFINE_string('workdir', None, 'Checkpoints, tokenizer, metrics and export.')
  flags.mark_flags_as_required(['workdir'])
  flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() (multi-host).')
