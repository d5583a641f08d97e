"""Runtime shape checks of public array functions (jaxtyping + beartype, under jit)."""

import jax
import jax.numpy as jnp
import pytest
from beartype import beartype
from jaxtyping import jaxtyped

from jetspec_jax import tree as tree_lib
from jetspec_jax import verify


def checked(fn, **jit_kwargs):
  return jax.jit(jaxtyped(typechecker=beartype)(fn), **jit_kwargs)


def test_tree_functions_check_shapes():
  build = checked(tree_lib.accum_logp, static_argnames='budget')
  ids, lps = jnp.zeros((3, 2), jnp.int32), jnp.zeros((3, 2), jnp.float32)
  tree = build(ids, lps, budget=5)
  assert tree.tokens.shape == (5,)
  with pytest.raises(Exception, match="parameter 'topk_logprobs'"):
    build(ids, jnp.zeros((3, 4), jnp.float32), budget=5)
  anc = checked(tree_lib.ancestor_mask, static_argnames='max_depth')(tree.parents, max_depth=3)
  assert anc.shape == (5, 5)
  with pytest.raises(Exception, match="parameter 'parents'"):
    checked(tree_lib.ancestor_mask, static_argnames='max_depth')(
      jnp.zeros((5,), jnp.float32), max_depth=3
    )


def test_verify_accept_checks_shapes():
  tree = jax.tree.map(
    lambda x: x[None],
    tree_lib.accum_logp(jnp.zeros((3, 2), jnp.int32), jnp.zeros((3, 2), jnp.float32), 5),
  )
  anc = tree_lib.ancestor_mask(tree.parents[0], 3)[None]
  accept = checked(verify.accept, static_argnames='max_depth')
  out = accept(tree, anc, jnp.zeros((1, 5), jnp.int32), max_depth=3)
  assert out.path.shape == (1, 4)
  with pytest.raises(Exception, match="parameter 'choices'"):
    accept(tree, anc, jnp.zeros((1, 6), jnp.int32), max_depth=3)
