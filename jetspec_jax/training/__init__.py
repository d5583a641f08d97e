"""Training: draft heads by self-distillation (docs/training.md) and the small target LM, on one
loop."""

from jetspec_jax.training.head_step import fit, make_train_step
from jetspec_jax.training.head_sums import StepSettings
from jetspec_jax.training.head_trainer import train_and_evaluate
from jetspec_jax.training.loop import TrainState, init_state, make_optimizer, train_loop

__all__ = [
  'StepSettings',
  'TrainState',
  'fit',
  'init_state',
  'make_optimizer',
  'make_train_step',
  'train_and_evaluate',
  'train_loop',
]
