"""Tiny fixtures shared by tests, notebooks and users (STYLE.md item 16)."""

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.models import qwen3


def tiny_target(
  seed: int = 0, *, moe: bool = False, dtype=jnp.float32, **overrides
) -> qwen3.Target:
  """A random tiny Qwen3 (or Qwen3-MoE) target; ``overrides`` change config fields."""
  cfg = qwen3.tiny_moe(**overrides) if moe else qwen3.tiny(**overrides)
  params = qwen3.init_params(cfg, jax.random.key(seed), dtype)
  return qwen3.Target(cfg=cfg, params=params)


def random_ids(seed: int, shape, vocab_size: int) -> np.ndarray:
  """Deterministic random token ids ``int32[shape]``."""
  return np.random.default_rng(seed).integers(0, vocab_size, size=shape, dtype=np.int32)
