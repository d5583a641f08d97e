"""Shared array-type aliases and the project's axis-letter vocabulary.

Every einsum string, jaxtyping shape and shape comment in the project uses these letters:

  B batch            T query tokens      S cache slots (static capacity)
  N query heads      K kv heads          G query heads per kv head (N = K * G)
  H head dim         D model dim         F MLP dim
  V vocab            M tree nodes        L layers         E experts
  C draft context rows                   W tree width (top-W per depth)

and, where one letter would collide (``D`` is the model dim), whole words in jaxtyping shapes:

  depth    draft depths below the anchor (``block_size - 1``)
  path     nodes on an accepted path, root included (``depth + 1``)
  anchors  sampled training blocks of one sequence

Example: ``jnp.einsum('BTKGH,BSKH->BKGTS', q, k)``; ``Float[Array, 'B depth V']``.
"""

from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

__all__ = ['Array', 'Bool', 'Float', 'Int', 'PRNGKeyArray']
