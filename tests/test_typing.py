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


def test_cache_head_round_and_kernel_check_shapes():
  """kv_cache, the draft head, the round's entry and the kernel wrapper reject mismatched
  axes at trace time (named axes: ``B``, ``path``, ...)."""
  import numpy as np

  import jetspec_jax as js
  from jetspec_jax import kv_cache, rounds
  from pallas_kernels import tree_attention as ta

  cache = kv_cache.init_cache(
    num_layers=1, batch_size=2, capacity=8, num_kv_heads=1, head_dim=4, dtype=jnp.float32
  )
  commit = checked(kv_cache.commit_path)
  path = jnp.zeros((2, 3), jnp.int32)
  out = commit(cache, jnp.zeros((2,), jnp.int32), path, jnp.ones((2,), jnp.int32))
  assert out.lengths.shape == (2,)
  with pytest.raises(Exception, match="parameter 'num_accepted'"):
    commit(cache, jnp.zeros((2,), jnp.int32), path, jnp.ones((3,), jnp.int32))

  target = js.testing.tiny_target(0, vocab_size=32)
  head = js.testing.random_draft_head(target, block_size=3, seed=1)
  width = head.cfg.num_taps * head.cfg.hidden_size
  extend = checked(js.DraftHead.extend_context)
  dcache = head.make_cache(2, 8)
  extend(head, dcache, jnp.zeros((2, 3, width)), jnp.ones((2,), jnp.int32))
  with pytest.raises(Exception, match="parameter 'num_new'"):
    extend(head, dcache, jnp.zeros((2, 3, width)), jnp.ones((1,), jnp.int32))

  start = checked(rounds.start_rounds, static_argnames=('capacity', 'sampling'))
  prompts = jnp.asarray(np.arange(1, 9).reshape(2, 4), jnp.int32)
  kw = dict(capacity=16, sampling=rounds.Sampling())
  state = start(target, head, prompts, jnp.array([4, 3]), jax.random.key(0), **kw)
  assert state.anchor.shape == (2,)
  with pytest.raises(Exception, match="parameter 'prompt_lens'"):
    start(target, head, prompts, jnp.array([4, 3, 2]), jax.random.key(0), **kw)

  kernel = checked(ta.tree_attention.__wrapped__, static_argnames='interpret')  # unjitted
  q, kv = jnp.zeros((1, 2, 2, 4)), jnp.zeros((1, 2, 1, 4))
  cache_kv = jnp.zeros((1, 8, 1, 4))
  kernel(q, kv, kv, cache_kv, cache_kv, jnp.array([3]), interpret=True)
  with pytest.raises(Exception, match="parameter 'k_cache'"):
    kernel(q, kv, kv, jnp.zeros((1, 8, 2, 4)), cache_kv, jnp.array([3]), interpret=True)
