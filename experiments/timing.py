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
