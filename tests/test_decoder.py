"""The target forward's three modes, its cache and its error messages (no torch needed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax as js
from jetspec_jax.models import decoder

ATOL = 2e-5


@pytest.fixture(scope='module', params=['dense', 'moe'])
def target(request):
  return js.testing.tiny_target(0, moe=request.param == 'moe')


TAPS = (0, 2)


def full_forward(target, ids, taps=TAPS):
  """One causal forward from an empty cache: (logits [B,T,V], taps [B,T,F])."""
  b, t = ids.shape
  out = target.forward(jnp.asarray(ids), target.make_cache(b, t), taps=taps)
  return np.asarray(target.lm_logits(out.hidden)), np.asarray(out.taps)


def test_prefill_then_decode_equals_full_forward(target):
  """Prefill of a prefix + one-token decode steps with the cache == one full forward."""
  ids = js.testing.random_ids(0, (2, 12), target.cfg.vocab_size)
  want_logits, want_taps = full_forward(target, ids)
  capacity = 16
  out = target.forward(jnp.asarray(ids[:, :5]), target.make_cache(2, capacity), taps=TAPS)
  logits = [target.lm_logits(out.hidden)]
  taps = [out.taps]
  cache = out.cache
  assert cache.lengths.tolist() == [5, 5]
  step = jax.jit(lambda c, tok: target.forward(tok, c, taps=TAPS))
  for t in range(5, 12):
    out = step(cache, jnp.asarray(ids[:, t : t + 1]))
    cache = out.cache
    logits.append(target.lm_logits(out.hidden))
    taps.append(out.taps)
  assert cache.lengths.tolist() == [12, 12]
  np.testing.assert_allclose(np.concatenate(logits, 1), want_logits, atol=ATOL, rtol=0)
  np.testing.assert_allclose(np.concatenate(taps, 1), want_taps, atol=ATOL, rtol=0)


def test_masked_mode_with_causal_mask_equals_prefill(target):
  ids = js.testing.random_ids(1, (1, 10), target.cfg.vocab_size)
  want_logits, want_taps = full_forward(target, ids)
  capacity = 32
  positions = jnp.arange(10)[None]
  mask = np.tril(np.ones((10, capacity), bool), k=0)
  out = target.forward(
    jnp.asarray(ids),
    target.make_cache(1, capacity),
    positions=positions,
    slots=positions,
    mask=jnp.asarray(mask[None]),
    taps=TAPS,
  )
  np.testing.assert_allclose(
    np.asarray(target.lm_logits(out.hidden)), want_logits, atol=ATOL, rtol=0
  )
  np.testing.assert_allclose(np.asarray(out.taps), want_taps, atol=ATOL, rtol=0)


def random_parents(seed: int, num_nodes: int) -> np.ndarray:
  """A random tree in topological order: parents[0] = -1, parents[i] < i."""
  rng = np.random.default_rng(seed)
  return np.array([-1] + [rng.integers(0, i) for i in range(1, num_nodes)])


def ancestor_or_self(parents: np.ndarray) -> np.ndarray:
  m = len(parents)
  anc = np.eye(m, dtype=bool)
  for i in range(1, m):
    anc[i] |= anc[parents[i]]
  return anc


def tree_forward(target, prefix, tokens, anc, capacity, taps=()):
  """Prefill ``prefix``, then one masked forward over the tree nodes (a dense mask)."""
  p, m = len(prefix), len(tokens)
  depths = anc.sum(1) - 1
  out = target.forward(jnp.asarray(prefix[None]), target.make_cache(1, capacity))
  mask = np.zeros((1, m, capacity), bool)
  mask[0, :, :p] = True
  mask[0, :, p : p + m] = anc
  return target.forward(
    jnp.asarray(tokens[None]),
    out.cache,
    positions=jnp.asarray(p + depths[None]),
    slots=jnp.asarray(p + np.arange(m)[None]),
    mask=jnp.asarray(mask),
    taps=taps,
  )


def test_tree_masked_forward_equals_path_forward(target):
  """Each tree node's logits and taps == a plain forward along its root-to-node path.

  This is the invariant that makes one-pass tree verification exact (docs/design.md §5): a node sees
  the committed prefix plus its ancestors, at position ``P + depth``, so it computes what it
  would compute in the linear sequence.
  """
  vocab = target.cfg.vocab_size
  prefix = js.testing.random_ids(2, (7,), vocab)
  parents = random_parents(3, 11)
  tokens = js.testing.random_ids(4, (11,), vocab)
  anc = ancestor_or_self(parents)
  m = len(parents)
  tree = tree_forward(target, prefix, tokens, anc, 32, taps=TAPS)
  tree_logits = np.asarray(target.lm_logits(tree.hidden))[0]
  tree_taps = np.asarray(tree.taps)[0]
  for node in range(m):
    path = np.flatnonzero(anc[node])  # ancestors in topological (= depth) order
    seq = np.concatenate([prefix, tokens[path]])[None]
    want_logits, want_taps = full_forward(target, seq)
    np.testing.assert_allclose(tree_logits[node], want_logits[0, -1], atol=ATOL, rtol=0)
    np.testing.assert_allclose(tree_taps[node], want_taps[0, -1], atol=ATOL, rtol=0)


def test_commit_path_makes_cache_equal_to_linear(target):
  """After committing an accepted path, the cache equals that of the linear sequence."""
  vocab = target.cfg.vocab_size
  prefix = js.testing.random_ids(5, (6,), vocab)
  parents = np.array([-1, 0, 0, 1, 2, 3, 3])
  tokens = js.testing.random_ids(6, (7,), vocab)
  anc = ancestor_or_self(parents)
  p, capacity = 6, 16
  tree = tree_forward(target, prefix, tokens, anc, capacity)
  path = np.array([[0, 1, 3, 5]])
  cache = js.kv_cache.commit_path(tree.cache, jnp.array([p]), jnp.asarray(path), jnp.array([3]))
  assert cache.lengths.tolist() == [p + 4]
  linear = target.forward(
    jnp.asarray(np.concatenate([prefix, tokens[path[0]]])[None]), target.make_cache(1, capacity)
  )
  for got, want in zip(cache.k + cache.v, linear.cache.k + linear.cache.v):
    np.testing.assert_allclose(
      np.asarray(got)[:, : p + 4], np.asarray(want)[:, : p + 4], atol=ATOL, rtol=0
    )


@pytest.mark.parametrize(
  'preset, published',
  [
    (decoder.qwen3_8b, 8.19e9),
    (decoder.qwen3_30b_a3b, 30.5e9),
    (decoder.qwen3_0_6b, 0.596e9),
  ],
)
def test_preset_parameter_counts(preset, published):
  """Full-size presets, checked by shape only: counts match the published model sizes."""
  shapes = jax.eval_shape(lambda: decoder.init_params(preset(), jax.random.key(0), jnp.bfloat16))
  count = decoder.count_params(shapes)
  assert abs(count - published) / published < 0.005, count


def test_moe_preset_active_parameters():
  cfg = decoder.qwen3_30b_a3b()
  assert cfg.is_moe and all(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))


# Bad inputs: each a clear error.


def test_bad_token_ids(target):
  with pytest.raises(TypeError, match='integer'):
    target.forward_logits(np.zeros((1, 4), np.float32))
  with pytest.raises(ValueError, match=r'int\[B, T\]'):
    target.forward_logits(np.zeros((4,), np.int32))
  with pytest.raises(ValueError, match=r'token ids must be in \[0, 257\)'):
    target.forward_logits(np.array([[1, 2, 257]]))
  with pytest.raises(ValueError, match='token ids must be in'):
    target.forward_logits(np.array([[-1, 2]]))


def test_sequence_beyond_cache_capacity(target):
  ids = jnp.zeros((1, 9), jnp.int32)
  with pytest.raises(ValueError, match='exceed the cache capacity 8'):
    target.forward(ids, target.make_cache(1, 8))
  with pytest.raises(ValueError, match='batch 1 does not match the cache batch 2'):
    target.forward(ids, target.make_cache(2, 16))
  with pytest.raises(ValueError, match='mask must have shape'):
    target.forward(ids, target.make_cache(1, 16), mask=jnp.ones((1, 9, 9), bool))
  with pytest.raises(ValueError, match='tap layer 3 is outside'):
    target.forward(ids, target.make_cache(1, 16), taps=(3,))
  with pytest.raises(ValueError, match='attn_impl'):
    target.with_attn_impl('cuda')
  with pytest.raises(ValueError, match='attn_impl'):
    decoder.forward(target.params, ids, target.make_cache(1, 16), cfg=target.cfg, attn_impl='cuda')


def test_generate_prompt_beyond_context():
  target = js.testing.tiny_target(0, max_position_embeddings=32)
  with pytest.raises(ValueError, match='exceeds the model context 32'):
    js.generate(target, None, np.arange(30), max_new_tokens=8, method=js.methods.AR())


def test_bad_config():
  with pytest.raises(ValueError, match='multiple of'):
    decoder.tiny(num_attention_heads=5, num_key_value_heads=2)
  with pytest.raises(ValueError, match='even'):
    decoder.tiny(head_dim=13)


@pytest.mark.parametrize(
  'prefix_lens, num_new, kind',
  [((0, 37), 5, 'tree'), ((200, 3), 16, 'causal'), ((511, 64), 1, 'slots')],
)
def test_tiled_attention_equals_dense_and_skips_dead_tiles(prefix_lens, num_new, kind):
  """The online-softmax attention over live tiles equals the dense-mask reference, and never
  reads a tile past the live length (NaN planted there does not reach the output)."""
  rng = np.random.default_rng(len(prefix_lens) + num_new)
  b, n, kh, h, capacity, tile = 2, 6, 2, 8, 1024, 64
  q = jnp.asarray(rng.standard_normal((b, num_new, n, h)), jnp.float32)
  k = rng.standard_normal((b, capacity, kh, h)).astype(np.float32)
  v = rng.standard_normal((b, capacity, kh, h)).astype(np.float32)
  plen = jnp.asarray(prefix_lens, jnp.int32)
  if kind == 'tree':
    tree = js.testing.random_tree(3, num_new)
    mask = decoder.TailMask(plen, jnp.broadcast_to(tree.ancestor_mask(), (b, num_new, num_new)))
  elif kind == 'causal':
    mask = decoder.TailMask(plen)
  else:
    mask = decoder.CausalSlots(plen[:, None] + jnp.arange(num_new)[None])
  live = int(mask.live_slots(num_new))
  dead = -(-live // tile) * tile
  k[:, dead:], v[:, dead:] = np.nan, np.nan
  dense = mask.block(num_new, 0, capacity)
  want = decoder.attention_xla(q, jnp.nan_to_num(k), jnp.nan_to_num(v), dense)
  got = decoder.attention_live(q, jnp.asarray(k), jnp.asarray(v), mask, tile=tile)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
  full = decoder.attention_live(
    q, jnp.asarray(k), jnp.asarray(v), decoder.DenseMask(dense), tile=tile
  )
  assert not np.isfinite(np.asarray(full)).all()  # the planted NaN is reachable by a full scan
