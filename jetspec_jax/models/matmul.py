"""Mixed-precision matmuls: low-precision (bfloat16) inputs, float32 accumulation and output.

On accelerators this is the usual bf16 matmul; on a CPU with AMX it is also the fast path (a
1024x576x1536 matmul measured 57 GFLOP/s in float32 and 263-316 GFLOP/s with bfloat16 inputs and
``preferred_element_type=float32``, while a dot whose *output* is bfloat16 ran 50). The backward
pass keeps the same form: both gradient matmuls take bfloat16 inputs (the float32 cotangent is
rounded once) and accumulate in float32, so the gradients reach the float32 master weights at
float32. Plain ``jax.grad`` of a bf16-input dot would instead multiply the float32 cotangent by a
bfloat16 operand, which XLA runs as a float32 dot.

:func:`dot_general` plugs into Flax's ``nn.Dense(dot_general=...)`` / ``nn.DenseGeneral``;
:func:`matmul` contracts the trailing axes of ``x`` with the leading axes of ``w``.
"""

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

# Mixed-precision dots take at least this many rows (zero rows padded, then dropped). XLA:CPU
# runs a bfloat16 dot of 1-2 rows through another kernel than one of 3 or more: slower (on AMX, a
# SmolLM2 stack of projections took 149 ms at 1 row, 36 at 2 and 4, 39 at 16) and not equal to it
# row by row, while from 3 rows every row's result is bit-identical whatever the row count. So a
# decode step's projections equal a verify's for the same token. (The attention still sums in
# another order, cache slots against tree slots, so greedy speculative decoding of a bfloat16
# target is close to its AR, not equal: benchmarks/history/smollm2_135m_bf16.) A padded row reads no
# more weights.
MIN_ROWS = 4

# A compute mode, not a dtype: each float32 input row is split into two bfloat16 rows, ``hi =
# bf16(x)`` and ``lo = bf16(x - hi)``, multiplied in one bfloat16 dot (float32 accumulation) and
# summed. Rounding every input to bfloat16 turns the float32 round-off of a different summation
# order (a decode step against a verify) into a whole bfloat16 step of some inputs, which flips
# greedy near-ties (the SmolLM2 benchmark: 1 prompt of 9); the split keeps 16 significant bits,
# and there greedy speculative decoding equalled AR on all 9. Twice the rows cost little in a
# dot that reads its weights once (benchmarks/history/smollm2_135m_bf16).
SPLIT = 'bfloat16x2'


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def matmul(x, w, num_contract: int = 1, compute_dtype: Any = jnp.bfloat16):
  """``x [..., *K] @ w [*K, *N] -> [..., *N]`` (float32) with ``compute_dtype`` inputs."""
  out, _ = _matmul_fwd(x, w, num_contract, compute_dtype)
  return out


def _flat(x, w, num_contract):
  k = math.prod(w.shape[:num_contract])
  return x.reshape(-1, k), w.reshape(k, -1)


def _dot(a, b, compute_dtype, contract_b: int = 0):
  """``a [M, K]`` times ``b`` (``[K, N]``, or ``[N, K]`` with ``contract_b=1``) -> float32."""
  rows = a.shape[0]
  if is_split(compute_dtype):
    # x = hi + lo, both bfloat16 (16 significant bits together), as 2M rows of one dot.
    a = a.astype(jnp.float32)
    hi = a.astype(jnp.bfloat16)
    lo = (a - hi.astype(jnp.float32)).astype(jnp.bfloat16)
    both = _dot(jnp.concatenate([hi, lo]), b, jnp.bfloat16, contract_b)
    return both[:rows] + both[rows:]
  if rows < MIN_ROWS:
    a = jnp.pad(a, ((0, MIN_ROWS - rows), (0, 0)))
  dims = (((1,), (contract_b,)), ((), ()))
  out = jax.lax.dot_general(
    a.astype(compute_dtype), b.astype(compute_dtype), dims, preferred_element_type=jnp.float32
  )
  return out[:rows]


def _matmul_fwd(x, w, num_contract, compute_dtype):
  if x.shape[x.ndim - num_contract :] != w.shape[:num_contract]:
    raise ValueError(f'cannot contract {x.shape} with {w.shape} over {num_contract} axes')
  x2, w2 = _flat(x, w, num_contract)
  out_shape = x.shape[: x.ndim - num_contract] + w.shape[num_contract:]
  out = _dot(x2, w2, compute_dtype).reshape(out_shape)
  # Residuals in the compute dtype (half the memory; the backward reads them so), plus empty
  # arrays that carry the inputs' dtypes (residuals must be arrays).
  store = jnp.bfloat16 if is_split(compute_dtype) else compute_dtype
  xc, wc = x.astype(store), w.astype(store)
  return out, (xc, wc, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _matmul_bwd(num_contract, compute_dtype, residuals, g):
  xc, wc, x_dtype, w_dtype = residuals
  x2, w2 = _flat(xc, wc, num_contract)
  g2 = g.reshape(x2.shape[0], w2.shape[1]).astype(xc.dtype)
  dx = _dot(g2, w2.T, compute_dtype).reshape(xc.shape).astype(x_dtype.dtype)
  dw = _dot(x2.T, g2, compute_dtype).reshape(wc.shape).astype(w_dtype.dtype)
  return dx, dw


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def matmul_rows(x, table, compute_dtype: Any = jnp.bfloat16):
  """``x [..., D]`` against the rows of ``table [V, D]`` -> ``[..., V]`` float32, with
  ``compute_dtype`` inputs (a tied LM head). The table is read as stored: with the 49k x 576
  bfloat16 table passed transposed (``x @ table.T``) XLA:CPU took 37-41 ms at 2-16 rows, read as
  stored 4.4-6."""
  if x.shape[-1] != table.shape[-1]:
    raise ValueError(f'cannot score {x.shape} against table rows {table.shape}')
  out = _dot(x.reshape(-1, x.shape[-1]), table, compute_dtype, contract_b=1)
  return out.reshape(x.shape[:-1] + table.shape[:1])


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


def is_split(compute_dtype) -> bool:
  return isinstance(compute_dtype, str) and compute_dtype == SPLIT


def resolve(compute_dtype) -> Any:
  """``None``/``'float32'`` -> None (plain matmuls); ``'bfloat16'`` etc. -> the dtype;
  :data:`SPLIT` stays itself."""
  if compute_dtype is None:
    return None
  if is_split(compute_dtype):
    return SPLIT
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
