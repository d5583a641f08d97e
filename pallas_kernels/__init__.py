"""Pallas kernels, each with a pure-jnp ``*_reference`` (docs/design.md §2, kernels)."""
