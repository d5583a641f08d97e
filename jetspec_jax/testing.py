"""Tiny fixtures shared by tests, notebooks and users."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import tree as tree_lib
from jetspec_jax.models import decoder
from jetspec_jax.models.draft_head import random_draft_head  # noqa: F401  (a shared fixture)


def tiny_target(
  seed: int = 0, *, moe: bool = False, dtype=jnp.float32, **overrides
) -> decoder.Target:
  """A random tiny Qwen3 (or Qwen3-MoE) target; ``overrides`` change config fields."""
  cfg = decoder.tiny_moe(**overrides) if moe else decoder.tiny(**overrides)
  params = decoder.init_params(cfg, jax.random.key(seed), dtype)
  return decoder.Target(cfg=cfg, params=params)


def random_ids(seed: int, shape, vocab_size: int) -> np.ndarray:
  """Deterministic random token ids ``int32[shape]``."""
  return np.random.default_rng(seed).integers(0, vocab_size, size=shape, dtype=np.int32)


def random_tree(
  seed: int, num_nodes: int, *, kind: str = 'random', vocab_size: int = 257, size: int | None = None
):
  """A tree in topological order for tests: ``'random'``, ``'chain'`` or ``'star'``.

  ``size`` (>= ``num_nodes``) pads the arrays like a budgeted tree.
  """
  rng = np.random.default_rng(seed)
  size = num_nodes if size is None else size
  if kind == 'chain':
    parents = np.arange(num_nodes) - 1
  elif kind == 'star':
    parents = np.where(np.arange(num_nodes) == 0, -1, 0)
  elif kind == 'random':
    parents = np.array([-1] + [rng.integers(0, i) for i in range(1, num_nodes)])
  else:
    raise ValueError(f"kind must be 'random', 'chain' or 'star', got {kind!r}")
  depths = np.zeros(num_nodes, np.int32)
  for i in range(1, num_nodes):
    depths[i] = depths[parents[i]] + 1
  pad = size - num_nodes
  return tree_lib.Tree(
    tokens=jnp.asarray(np.pad(rng.integers(0, vocab_size, num_nodes), (0, pad)), jnp.int32),
    parents=jnp.asarray(np.pad(parents, (0, pad), constant_values=-1), jnp.int32),
    depths=jnp.asarray(np.pad(depths, (0, pad)), jnp.int32),
    scores=jnp.asarray(
      np.pad(-np.arange(num_nodes, dtype=np.float32), (0, pad), constant_values=-np.inf)
    ),
    num_nodes=jnp.int32(num_nodes),
  )


# Ops by which a compiled program talks to the host: Python callbacks (jax.debug.callback,
# pure_callback, io_callback) and XLA's infeed/outfeed/send/recv.
_HOST_OP = re.compile(
  r'custom_call_target="[^"]*callback[^"]*"|\b(infeed|outfeed|send|recv|send-done|recv-done)\('
)


def host_transfer_ops(compiled) -> list[str]:
  """The host-interaction ops in a compiled program (``jax.jit(f).lower(...).compile()``)."""
  return [m.group(0) for m in _HOST_OP.finditer(compiled.as_text())]
