"""Shared test set-up: CPU only, float32 matmuls at full precision."""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402

jax.config.update('jax_default_matmul_precision', 'highest')
