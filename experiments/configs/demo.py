"""The main job's config.

Run:
  make demo            # == .venv/bin/python -m experiments.demo

Until the embedded default exists (assets/), the demo builds a random Qwen3-architecture target of
the size below and a random draft head, generates greedily with `ar`, `chain` and `tree`, checks
that the outputs are identical, and prints tau, tokens/s, speedup and compile time.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.prompt_len = 24
  config.max_new_tokens = 64
  config.num_prompts = 3
  config.block_size = 8
  config.head_layers = 1
  config.budget = 32
  config.width = 4
  config.target = ml_collections.ConfigDict(
    dict(
      vocab_size=4099,
      hidden_size=256,
      intermediate_size=683,
      num_hidden_layers=4,
      num_attention_heads=8,
      num_key_value_heads=2,
      head_dim=32,
      rope_theta=10000.0,
      max_position_embeddings=2048,
    )
  )
  if arg == 'tiny':
    config.max_new_tokens = 8
    config.num_prompts = 1
    config.target.update(
      vocab_size=257,
      hidden_size=44,
      intermediate_size=67,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      head_dim=14,
    )
  return config
