"""Pallas kernels, each with a pure-jnp ``*_reference`` (DESIGN.md §2, kernels)."""
