"""The Pallas tree-attention kernel (interpret mode on CPU) against its jnp reference."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax as js
from pallas_kernels import tree_attention as ta

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}

# (tree nodes M, prefix lengths per sequence, query heads, kv heads, head dim, dtype, tree kind)
CASES = [
  (1, (0, 37), 4, 4, 64, jnp.float32, 'chain'),
  (7, (5, 0), 4, 2, 64, jnp.float32, 'random'),
  (7, (130,), 8, 2, 128, jnp.bfloat16, 'star'),
  (64, (77, 3), 8, 2, 64, jnp.float32, 'random'),
  (64, (0,), 8, 8, 128, jnp.bfloat16, 'chain'),
  (64, (200,), 8, 2, 128, jnp.float32, 'star'),
  (255, (61,), 4, 1, 64, jnp.float32, 'random'),
  (255, (129,), 8, 2, 128, jnp.bfloat16, 'random'),
  (33, (1,), 16, 4, 64, jnp.bfloat16, 'causal'),
  (130, (250,), 4, 2, 64, jnp.float32, 'causal'),
  # Query heads per K/V head that are not powers of two (SmolLM2-135M: 9 / 3), packed as G'.
  (13, (20, 3), 9, 3, 64, jnp.float32, 'random'),
  (40, (70,), 10, 2, 128, jnp.bfloat16, 'causal'),
  (7, (5,), 6, 1, 64, jnp.float32, 'star'),
  (33, (9,), 14, 2, 64, jnp.bfloat16, 'random'),
]

# The layouts every kernel must lower for on its real platform: query heads per K/V head 1-8,
# head dims 64 and 128, float32 and bfloat16, trees (T <= 255) and causal prefill chunks (T up to
# 2048). Interpret mode checks none of the platforms' tiling rules; an export does.
EXPORT_GRID = [
  (groups, h, dtype, t, tree)
  for groups in range(1, 9)
  for h in (64, 128)
  for dtype in (jnp.float32, jnp.bfloat16)
  for t, tree in ((1, True), (33, True), (255, True), (33, False), (2048, False))
]


def export_kernel(kernel, platform, groups, h, dtype, t, tree, kv_heads=2, capacity=4096):
  """``kernel`` exported for ``platform`` on abstract inputs; returns the MLIR text."""
  sd = jax.ShapeDtypeStruct
  args = [
    sd((1, t, kv_heads * groups, h), dtype),
    sd((1, t, kv_heads, h), dtype),
    sd((1, t, kv_heads, h), dtype),
    sd((1, capacity, kv_heads, h), dtype),
    sd((1, capacity, kv_heads, h), dtype),
    sd((1,), jnp.int32),
  ]
  if tree:
    args.append(sd((1, t, t), jnp.bool_))
  return jax.export.export(
    jax.jit(kernel),
    platforms=[platform],
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call('__gpu$xla.gpu.triton')],
  )(*args).mlir_module()


def assert_grid_lowers(kernel, platform, call):
  """Every :data:`EXPORT_GRID` layout lowers to ``call``; failures are listed together."""
  failed = []
  for layout in EXPORT_GRID:
    try:
      assert re.search(call, export_kernel(kernel, platform, *layout))
    except Exception as e:  # noqa: BLE001 - collect every failing layout, then report
      failed.append(f'{layout}: {str(e).splitlines()[0][:160]}')
  assert not failed, '\n'.join(failed)


def make_inputs(seed, m, prefix, n, kh, h, dtype, kind, capacity=512):
  rng = np.random.default_rng(seed)
  b = len(prefix)

  def normal(*shape):
    return jnp.asarray(rng.normal(size=shape), dtype)

  if kind == 'causal':
    ancestors = None
  else:
    ancestors = jnp.stack(
      [js.testing.random_tree(seed + i, m, kind=kind).ancestor_mask() for i in range(b)]
    )
  return (
    normal(b, m, n, h),
    normal(b, m, kh, h),
    normal(b, m, kh, h),
    normal(b, capacity, kh, h),
    normal(b, capacity, kh, h),
    jnp.asarray(prefix, jnp.int32),
    ancestors,
  )


@pytest.mark.parametrize('m, prefix, n, kh, h, dtype, kind', CASES)
def test_kernel_matches_reference(m, prefix, n, kh, h, dtype, kind):
  args = make_inputs(m, m, prefix, n, kh, h, dtype, kind)
  got = ta.tree_attention(
    *args, interpret=True, block_sizes=ta.BlockSizes(block_q=16, block_k=64, block_tail=32)
  )
  want = ta.tree_attention_reference(*args)
  assert got.dtype == dtype and got.shape == want.shape
  err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
  assert err <= TOLERANCE[dtype], err


def test_prefix_keys_past_length_are_ignored():
  """Garbage in cache slots >= prefix_len (e.g. NaN) never reaches the output."""
  q, kt, vt, kc, vc, plen, anc = make_inputs(0, 9, (13,), 4, 2, 64, jnp.float32, 'random')
  kc_bad = kc.at[:, 13:].set(jnp.nan)
  vc_bad = vc.at[:, 13:].set(jnp.nan)
  got = ta.tree_attention(q, kt, vt, kc_bad, vc_bad, plen, anc, interpret=True)
  np.testing.assert_allclose(
    np.asarray(got),
    np.asarray(ta.tree_attention_reference(q, kt, vt, kc, vc, plen, anc)),
    atol=2e-5,
  )


def test_pack_ancestors_example():
  """The docstring's five-node tree: node 3's row is the word 0b01011."""
  anc = js.testing.random_tree(0, 5, kind='star').ancestor_mask()
  parents = jnp.array([-1, 0, 0, 1, 1])
  anc = js.tree.ancestor_mask(parents, 4)
  words = np.asarray(ta.pack_ancestors(anc[None], 32))[0, :5, 0]
  assert words.tolist() == [0b1, 0b11, 0b101, 0b1011, 0b10011]


def test_bad_shapes():
  q, kt, vt, kc, vc, plen, anc = make_inputs(0, 5, (3,), 4, 2, 64, jnp.float32, 'random')
  with pytest.raises(ValueError, match='k_tail/v_tail must be'):
    ta.tree_attention(q, kt[:, :4], vt, kc, vc, plen, anc, interpret=True)
  with pytest.raises(ValueError, match='multiple of'):
    ta.tree_attention(q[:, :, :3], kt, vt, kc, vc, plen, anc, interpret=True)
  with pytest.raises(ValueError, match='ancestors must be'):
    ta.tree_attention(q, kt, vt, kc, vc, plen, anc[:, :4, :4], interpret=True)
  with pytest.raises(ValueError, match='power of two'):
    ta.BlockSizes(block_q=12)
  with pytest.raises(ValueError, match='multiple of 32'):
    ta.BlockSizes(block_tail=16)


@pytest.mark.parametrize('tree', [True, False])
def test_lowers_to_triton_for_gpu(tree):
  """The kernel body uses no CPU-only construct: it lowers to Triton IR for CUDA (no GPU needed)."""
  sd = jax.ShapeDtypeStruct
  b, m, n, kh, h, s = 1, 64, 32, 8, 128, 1024
  args = [
    sd((b, m, n, h), jnp.bfloat16),
    sd((b, m, kh, h), jnp.bfloat16),
    sd((b, m, kh, h), jnp.bfloat16),
    sd((b, s, kh, h), jnp.bfloat16),
    sd((b, s, kh, h), jnp.bfloat16),
    sd((b,), jnp.int32),
  ]
  if tree:
    args.append(sd((b, m, m), jnp.bool_))
  exported = jax.export.export(
    jax.jit(ta.tree_attention),
    platforms=['cuda'],
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call('__gpu$xla.gpu.triton')],
  )(*args)
  assert re.search(r'custom_call @__gpu\$xla\.gpu\.triton', exported.mlir_module())


def test_every_head_layout_lowers_to_triton():
  assert_grid_lowers(ta.tree_attention, 'cuda', r'custom_call @__gpu\$xla\.gpu\.triton')


def test_packing_pads_groups_to_a_power_of_two():
  q = jnp.arange(2 * 5 * 6 * 4, dtype=jnp.float32).reshape(2, 5, 6, 4)  # 6 heads, 2 kv: G = 3
  rows = ta.pack_query_rows(q, 8, 2)
  assert rows.shape == (2, 2, 8 * 4, 4)  # G' = 4
  assert not rows.reshape(2, 2, 8, 4, 4)[:, :, :, 3].any()  # the padding head is zeros
  np.testing.assert_array_equal(ta.unpack_query_rows(rows, 5, 3), q)


@pytest.mark.gpu
def test_kernel_on_gpu():
  if jax.default_backend() != 'gpu':
    pytest.skip('needs a GPU')
  args = make_inputs(1, 128, (1000,), 32, 8, 128, jnp.bfloat16, 'random', capacity=2048)
  got = ta.tree_attention(*args)
  want = ta.tree_attention_reference(*args)
  assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32)))) <= 3e-2


def test_target_forward_pallas_equals_xla():
  """Prefill, decode and the tree-masked forward agree between the two attention paths."""
  target = js.testing.tiny_target(0)
  pallas = target.with_attn_impl('pallas')
  ids = js.testing.random_ids(0, (2, 12), target.cfg.vocab_size)
  np.testing.assert_allclose(
    np.asarray(pallas.forward_logits(ids)), np.asarray(target.forward_logits(ids)), atol=2e-5
  )
  tree = js.testing.random_tree(1, 9, vocab_size=target.cfg.vocab_size)
  anc = tree.ancestor_mask()[None]
  outs = {}
  for name, t in (('xla', target), ('pallas', pallas)):
    cache = t.forward(jnp.asarray(ids[:1]), t.make_cache(1, 32)).cache
    mask = js.decoder.TailMask(cache.lengths, anc)
    out = t.forward(
      tree.tokens[None], cache, positions=12 + tree.depths[None], mask=mask, taps=(0, 2)
    )
    outs[name] = (t.lm_logits(out.hidden), out.taps)
  for a, b in zip(outs['xla'], outs['pallas']):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_generate_with_pallas_equals_xla(tmp_path):
  """End to end: greedy tree decoding with attn_impl='pallas' gives the same tokens as 'xla'."""
  js.save_target(js.testing.tiny_target(3, vocab_size=17), tmp_path)
  xla = js.load_target(tmp_path)
  pallas = js.load_target(tmp_path, attn_impl='pallas')
  assert pallas.attn_impl == 'pallas'
  head = js.testing.random_draft_head(xla, block_size=6, seed=2)
  prompt = js.testing.random_ids(4, (11,), 17)
  want = js.generate(xla, None, prompt, max_new_tokens=24, method=js.methods.AR()).tokens
  for method in (js.methods.AR(), js.methods.Tree(budget=24, width=4)):
    out = js.generate(
      pallas, head if method.head_kinds else None, prompt, max_new_tokens=24, method=method
    )
    np.testing.assert_array_equal(out.tokens, want)
  with pytest.raises(ValueError, match='needs a TailMask'):
    pallas.forward(
      jnp.zeros((1, 2), jnp.int32), pallas.make_cache(1, 8), mask=jnp.ones((1, 2, 8), bool)
    )


@pytest.mark.parametrize(
  'num_new, groups, head_dim, want_blocks',
  [(1, 4, 64, 1), (1, 1, 128, 1), (7, 2, 64, 1), (130, 4, 128, 9)],
)
def test_no_row_block_is_pure_padding(num_new, groups, head_dim, want_blocks):
  """The grid runs only row blocks that hold a real node (a decode is one block, not two)."""
  bs = ta.choose_block_sizes(num_new, groups, head_dim)
  assert bs.block_q * groups >= ta.MIN_ROWS and bs.block_k == (128 if head_dim <= 64 else 64)
  q = jnp.zeros((1, num_new, 2 * groups, head_dim))
  kt = jnp.zeros((1, num_new, 2, head_dim))
  kc = jnp.zeros((1, 256, 2, head_dim))
  jaxpr = str(
    jax.make_jaxpr(lambda *a: ta.tree_attention(*a, interpret=True))(
      q, kt, kt, kc, kc, jnp.array([5], jnp.int32)
    )
  )
  assert f'grid=(1, 2, {want_blocks})' in jaxpr
  assert -(-num_new // bs.block_q) == want_blocks
