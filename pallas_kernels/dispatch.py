"""Which tree-attention kernel runs where, decided at lowering time.

``attn_impl='pallas'``: the Triton kernel on CUDA GPUs, the Mosaic kernel on TPUs, the Triton
kernel in the Pallas interpreter on CPU. ``attn_impl='pallas_mosaic'``: the Mosaic kernel on a
TPU, in TPU interpret mode on CPU (how its tests run it inside the model). The choice is made by
``jax.lax.platform_dependent`` when the program is lowered, so the same jitted function lowers
to the right kernel for each platform (``jax.export(..., platforms=['tpu'])`` gives Mosaic calls,
``['cuda']`` Triton calls, on any machine); lowering for a platform with no kernel (e.g. ROCm, or
``'pallas_mosaic'`` on CUDA) fails with JAX's error naming the platform. (One module for TPU and
CUDA at once cannot be made: Pallas lowers every branch for every platform and a kernel's
compiler parameters belong to one.)

Inside a mesh (``jax.set_mesh``) with a ``'model'`` axis, the kernel runs under ``shard_map``:
each device attends with its own K/V heads (and its own sequences over ``'data'``), the way the
parameter rules of :mod:`jetspec_jax.sharding` split the projections; a custom call is never
handed to the SPMD partitioner, which cannot split one.
"""

import functools

import jax
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from pallas_kernels import tree_attention as triton_kernel
from pallas_kernels import tree_attention_tpu as mosaic_kernel

IMPLS = ('pallas', 'pallas_mosaic')


def tree_attention(
  q, k_tail, v_tail, k_cache, v_cache, prefix_len, ancestors=None, *, impl: str = 'pallas'
):
  """:func:`pallas_kernels.tree_attention.tree_attention` on the kernel of the lowering platform."""
  if impl not in IMPLS:
    raise ValueError(f'impl must be one of {IMPLS}, got {impl!r}')
  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and mesh.shape.get('model', 1) * mesh.shape.get('data', 1) > 1:
    return _sharded(q, k_tail, v_tail, k_cache, v_cache, prefix_len, ancestors, impl, mesh)
  return _on_platform(q, k_tail, v_tail, k_cache, v_cache, prefix_len, ancestors, impl)


def _sharded(q, k_tail, v_tail, k_cache, v_cache, prefix_len, ancestors, impl, mesh):
  """The kernel per device: heads over ``'model'`` and sequences over ``'data'`` where the
  sizes divide (else that dimension stays whole on every device)."""
  b, kh = k_cache.shape[0], k_cache.shape[2]
  data = 'data' if b % mesh.shape.get('data', 1) == 0 else None
  model = 'model' if kh % mesh.shape.get('model', 1) == 0 else None
  heads = P(data, None, model, None)
  specs = (heads, heads, heads, heads, heads, P(data), None if ancestors is None else P(data))
  kernel = functools.partial(_on_platform, impl=impl)
  return jax.shard_map(
    lambda *args: kernel(*args), mesh=mesh, in_specs=specs, out_specs=heads, check_vma=False
  )(q, k_tail, v_tail, k_cache, v_cache, prefix_len, ancestors)


def _on_platform(q, k_tail, v_tail, k_cache, v_cache, prefix_len, ancestors, impl):
  args = (q, k_tail, v_tail, k_cache, v_cache, prefix_len, ancestors)
  mosaic = functools.partial(mosaic_kernel.tree_attention, interpret=False)
  if impl == 'pallas_mosaic':
    interpreted = functools.partial(mosaic_kernel.tree_attention, interpret=pltpu.InterpretParams())
    return jax.lax.platform_dependent(*args, tpu=mosaic, cpu=interpreted)
  return jax.lax.platform_dependent(
    *args,
    cuda=functools.partial(triton_kernel.tree_attention, interpret=False),
    tpu=mosaic,
    cpu=functools.partial(triton_kernel.tree_attention, interpret=True),
  )
