"""Autoregressive decoding: the target alone, one token per forward (the baseline and the
reference every lossless test compares with; :func:`jetspec_jax.rounds.ar_loop`)."""

import dataclasses

from jetspec_jax.methods.base import Method


@dataclasses.dataclass(frozen=True)
class AR(Method):
  """The target's own decoding; takes no head (a head passed with it is not read)."""

  name = 'ar'
