"""Timing shared by the benchmark binaries."""

import time

import jax
import numpy as np


def median_time(fn, *args, repeats: int) -> float:
  """Median wall seconds of ``fn(*args)`` after one warm-up call, synchronised every call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def median_time_carried(fn, state, *args, repeats: int):
  """Median wall seconds of ``out, state = fn(state, *args)`` with ``state`` donated.

  Each call gets the state the previous one returned, as a decode loop carries its cache, so a
  step that updates a large buffer in place is not charged for copying it.

  Returns:
    (median seconds, the last state): the donated input is gone, the caller goes on with this.
  """
  out, state = fn(state, *args)
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out, state = fn(state, *args)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - start)
  return float(np.median(times)), state
