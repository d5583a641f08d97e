"""One device mesh with axes ``('data', 'model')`` and partition rules for every parameter.

Tensor parallelism over ``'model'``: attention heads (q/k/v columns, o rows), MLP columns
(gate/up) and rows (down), MoE experts, and the vocabulary of the embedding / LM head. Batches go
over ``'data'``. Norm scales and small tensors are replicated, and so is any dimension the
``'model'`` axis does not divide (a rule never fails, it degrades to replication). With the
parameters placed, ``jit`` propagates the shardings through generation and training (GSPMD).
"""

import re

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ('data', 'model')

# (regex on the '/'-joined parameter path, spec); first match wins.
RULES = (
  (r'embed_tokens/embedding$', P('model', None)),  # [V, D]
  (r'lm_head/kernel$', P(None, 'model')),  # [D, V]
  (r'(q_proj|k_proj|v_proj)/kernel$', P(None, 'model', None)),  # [D, heads, H]
  (r'o_proj/kernel$', P('model', None, None)),  # [heads, H, D]
  (r'experts/(gate_proj|up_proj|down_proj)$', P('model', None, None)),  # [E, ., .]
  (r'mlp/gate/kernel$', P()),  # MoE router [D, E]
  (r'mlp/(gate_proj|up_proj)/kernel$', P(None, 'model')),  # [D, F]
  (r'mlp/down_proj/kernel$', P('model', None)),  # [F, D]
  (r'.*', P()),  # norms, fc, everything else
)


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
  """A ``('data', 'model')`` mesh; ``data`` defaults to all devices / ``model``."""
  devices = list(jax.devices() if devices is None else devices)
  if data is None:
    if len(devices) % model:
      raise ValueError(f'{len(devices)} devices do not split into model={model}')
    data = len(devices) // model
  if data * model > len(devices):
    raise ValueError(f'mesh {data}x{model} needs {data * model} devices, have {len(devices)}')
  return Mesh(np.array(devices[: data * model]).reshape(data, model), AXES)


def _fit(spec: P, shape, mesh: Mesh) -> P:
  """Replicates the dimensions of ``spec`` that the mesh does not divide."""
  parts = list(spec) + [None] * (len(shape) - len(spec))
  fitted = [
    axis if axis is None or shape[i] % mesh.shape[axis] == 0 else None
    for i, axis in enumerate(parts[: len(shape)])
  ]
  return P(*fitted)


def param_specs(params, mesh: Mesh):
  """A PartitionSpec for every leaf of a target or draft-head parameter pytree."""

  def spec(path, leaf):
    name = '/'.join(str(getattr(k, 'key', k)) for k in path)
    for pattern, rule in RULES:
      if re.search(pattern, name):
        return _fit(rule, leaf.shape, mesh)
    return P()

  return jax.tree_util.tree_map_with_path(spec, params)


def shard_params(params, mesh: Mesh):
  """Places ``params`` on ``mesh`` by :data:`RULES`."""
  specs = param_specs(params, mesh)
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Leading (batch) axis over ``'data'``."""
  return NamedSharding(mesh, P('data', *([None] * (ndim - 1))))


def maybe_initialize_distributed(force: bool = False) -> bool:
  """Calls ``jax.distributed.initialize()`` when asked (``force``) or when the environment
  names a coordinator (``JAX_COORDINATOR_ADDRESS``, or a multi-task SLURM job). Call it before
  anything touches the devices. Returns whether it initialized."""
  import os

  multi_task_slurm = int(os.environ.get('SLURM_NTASKS', '1')) > 1
  if force or os.environ.get('JAX_COORDINATOR_ADDRESS') or multi_task_slurm:
    jax.distributed.initialize()
    return True
  return False
