"""Draft-head training by self-distillation (spec §C)."""

from jetspec_jax.training.train import (
  StepSettings,
  TrainState,
  fit,
  make_optimizer,
  make_train_step,
  train_and_evaluate,
)

__all__ = [
  'StepSettings',
  'TrainState',
  'fit',
  'make_optimizer',
  'make_train_step',
  'train_and_evaluate',
]
