"""A small Qwen3-architecture code model trained from scratch on the Python standard library.

Run (resumable; re-run the same command after an interruption):
  python -m experiments.train --task=target \
      --config=experiments/configs/train/target_code_small.py \
      --workdir=runs/target_code_small
  cp -r runs/target_code_small/export/. assets/target_code_small/
Tiny smoke run (what CI runs): ``--config=experiments/configs/train/target_code_small.py:tiny``.

Held-out modules (validation): see ``validation_modules``. The committed model's card:
assets/target_code_small/README.md.
"""

import ml_collections

from jetspec_jax import corpus


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.vocab_size = 4096
  config.validation_modules = corpus.VALIDATION_MODULES
  config.model = ml_collections.ConfigDict(
    dict(
      hidden_size=256,
      intermediate_size=768,
      num_hidden_layers=6,
      num_attention_heads=8,
      num_key_value_heads=2,
      head_dim=32,
      rope_theta=10000.0,
      tie_word_embeddings=True,
      max_position_embeddings=2048,
    )
  )
  config.seq_len = 256
  config.batch = 16
  config.steps = 1500
  config.lr = 2e-3
  config.warmup_steps = 100
  config.weight_decay = 0.01
  config.log_every = 50
  config.eval_every = 250
  config.eval_batches = 8
  config.checkpoint_every = 250
  config.export_dir = ''
  if arg == 'tiny':
    config.vocab_size = 300
    config.model.update(
      hidden_size=32,
      intermediate_size=48,
      num_hidden_layers=2,
      num_attention_heads=2,
      num_key_value_heads=1,
      head_dim=16,
    )
    config.seq_len, config.batch, config.steps = 32, 4, 6
    config.log_every, config.eval_every, config.eval_batches, config.checkpoint_every = 3, 6, 1, 3
  return config
