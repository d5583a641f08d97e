"""Mixed-precision matmuls: low-precision (bfloat16) inputs, float32 accumulation and output.

On accelerators this is the usual bf16 matmul; on a CPU with AMX it is also the fast path (a
1024x576x1536 matmul measured 57 GFLOP/s in float32 and 263-316 GFLOP/s with bfloat16 inputs and
``preferred_element_type=float32``, while a dot whose *output* is bfloat16 ran 50). The backward
pass keeps the same form: both gradient matmuls take bfloat16 inputs (the float32 cotangent is
rounded once) and accumulate in float32, so the gradients reach the float32 master weights at
float32. Plain ``jax.grad`` of a bf16-input dot would instead multiply the float32 cotangent by a
bfloat16 operand, which XLA runs as a float32 dot.

:func:`dot_general` plugs into Flax's ``nn.Dense(dot_general=...)`` / ``nn.DenseGeneral``;
:func:`matmul` contracts the trailing axes of ``x`` with the leading axes of ``w``;
:func:`fold_vmapped_rows` makes ``grad`` of a vmapped loss take each weight gradient in one
matmul.
"""

import contextlib
import contextvars
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import custom_batching


def matmul(x, w, num_contract: int = 1, compute_dtype: Any = jnp.bfloat16):
  """``x [..., *K] @ w [*K, *N] -> [..., *N]`` (float32) with ``compute_dtype`` inputs.

  Inside :func:`fold_vmapped_rows`, a ``vmap`` over ``x`` alone folds the mapped axis into the
  rows of one matmul (see there)."""
  if _fold_rows.get():
    return _rows_folded(num_contract, jnp.dtype(compute_dtype))(x, w)
  return _mixed(x, w, num_contract, compute_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _mixed(x, w, num_contract: int = 1, compute_dtype: Any = jnp.bfloat16):
  out, _ = _matmul_fwd(x, w, num_contract, compute_dtype)
  return out


def _flat(x, w, num_contract):
  k = math.prod(w.shape[:num_contract])
  return x.reshape(-1, k), w.reshape(k, -1)


def _dot(a, b, compute_dtype):
  return jax.lax.dot(
    a.astype(compute_dtype), b.astype(compute_dtype), preferred_element_type=jnp.float32
  )


def _matmul_fwd(x, w, num_contract, compute_dtype):
  if x.shape[x.ndim - num_contract :] != w.shape[:num_contract]:
    raise ValueError(f'cannot contract {x.shape} with {w.shape} over {num_contract} axes')
  x2, w2 = _flat(x, w, num_contract)
  out_shape = x.shape[: x.ndim - num_contract] + w.shape[num_contract:]
  out = _dot(x2, w2, compute_dtype).reshape(out_shape)
  # Residuals in the compute dtype (half the memory; the backward reads them so), plus empty
  # arrays that carry the inputs' dtypes (residuals must be arrays).
  xc, wc = x.astype(compute_dtype), w.astype(compute_dtype)
  return out, (xc, wc, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _matmul_bwd(num_contract, compute_dtype, residuals, g):
  xc, wc, x_dtype, w_dtype = residuals
  x2, w2 = _flat(xc, wc, num_contract)
  g2 = g.reshape(x2.shape[0], w2.shape[1]).astype(compute_dtype)
  dx = _dot(g2, w2.T, compute_dtype).reshape(xc.shape).astype(x_dtype.dtype)
  dw = _dot(x2.T, g2, compute_dtype).reshape(wc.shape).astype(w_dtype.dtype)
  return dx, dw


_mixed.defvjp(_matmul_fwd, _matmul_bwd)

_fold_rows = contextvars.ContextVar('fold_vmapped_rows', default=False)


@contextlib.contextmanager
def fold_vmapped_rows():
  """While tracing inside this block, a :func:`matmul` that ``vmap`` maps over ``x`` but not
  over ``w`` runs as one matmul whose rows are all the mapped examples' rows.

  Why: ``jax.grad`` of a vmapped loss (the head's train step maps its loss over sequences) would
  otherwise batch :func:`matmul`'s custom VJP example by example, yielding one weight gradient
  per example that XLA then sums; on XLA CPU (jaxlib 0.10) that sum over the leading axis is
  pathologically slow (117 ms for ``[8, 576, 1536]``, against 1.3 ms for 8 adds). Folded, the
  weight gradient is one matmul over every example's rows and nothing is summed. The values are
  the same; the gradients differ only by float32 summation order.

  Only for ``grad`` *of* a ``vmap``: the folding is a ``jax.custom_batching.custom_vmap`` rule,
  which JAX cannot reverse-differentiate outside ``vmap``, so ``grad`` of a matmul traced in here
  without a ``vmap`` around it fails.
  """
  token = _fold_rows.set(True)
  try:
    yield
  finally:
    _fold_rows.reset(token)


@functools.cache
def _rows_folded(num_contract: int, compute_dtype):
  @custom_batching.custom_vmap
  def folded(x, w):
    return _mixed(x, w, num_contract, compute_dtype)

  @folded.def_vmap
  def rule(axis_size, in_batched, x, w):
    del axis_size
    x_batched, w_batched = in_batched
    if w_batched:  # per-example weights: nothing to fold
      per_example = lambda a, b: _mixed(a, b, num_contract, compute_dtype)
      return jax.vmap(per_example, in_axes=(0 if x_batched else None, 0))(x, w), True
    # The mapped axis (leading) is one more axis of rows. (Under nested vmaps this folds the
    # innermost one; outer ones batch the result as usual.)
    return _mixed(x, w, num_contract, compute_dtype), True

  return folded


def dot_general(compute_dtype: Any = jnp.bfloat16):
  """A ``lax.dot_general`` replacement for Flax's ``Dense`` / ``DenseGeneral``: the trailing
  axes of the input contract with the leading axes of the kernel (no batch axes), through
  :func:`matmul`. Other dimension numbers are refused (they never occur in those layers)."""

  def fn(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    del precision, preferred_element_type  # the output is float32 by construction
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    n = len(lhs_contract)
    trailing = tuple(range(lhs.ndim - n, lhs.ndim))
    if (
      lhs_batch
      or rhs_batch
      or tuple(lhs_contract) != trailing
      or tuple(rhs_contract) != tuple(range(n))
    ):
      raise NotImplementedError(f'mixed-precision dot_general for {dimension_numbers}')
    return matmul(lhs, rhs, n, compute_dtype)

  return fn


def resolve(compute_dtype) -> Any:
  """``None``/``'float32'`` -> None (plain matmuls); ``'bfloat16'`` etc. -> the dtype."""
  if compute_dtype is None:
    return None
  try:
    dtype = jnp.dtype(compute_dtype)
  except TypeError as e:
    raise ValueError(f'compute_dtype must be a float dtype name, got {compute_dtype!r}') from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise ValueError(f'compute_dtype must be a float dtype name, got {compute_dtype!r}')
  return None if dtype == jnp.float32 else dtype


def dense_options(compute_dtype) -> dict:
  """Keyword arguments for ``nn.Dense`` / ``nn.DenseGeneral``: mixed precision when
  ``compute_dtype`` is set (:func:`resolve`), else nothing (Flax's own dot)."""
  dtype = resolve(compute_dtype)
  return {} if dtype is None else dict(dot_general=dot_general(dtype))
