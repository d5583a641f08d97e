"""The Mosaic (TPU) tree-attention kernel in TPU interpret mode, its lowering for TPU without one,
and the per-platform dispatch of ``attn_impl='pallas'``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import jetspec_jax as js
from pallas_kernels import tree_attention as ta
from pallas_kernels import tree_attention_tpu as tk
from tests.test_tree_attention import CASES, TOLERANCE, assert_grid_lowers, make_inputs

INTERPRET = pltpu.InterpretParams()  # TPU semantics on CPU; uninitialised memory reads as NaN
MOSAIC_CALL = re.compile(r'custom_call @tpu_custom_call')
TRITON_CALL = re.compile(r'custom_call @__gpu\$xla\.gpu\.triton')


@pytest.mark.parametrize('m, prefix, n, kh, h, dtype, kind', CASES)
def test_kernel_matches_reference(m, prefix, n, kh, h, dtype, kind):
  """The Triton kernel's case table: prefixes off the tile, M 1..255, GQA 1/2/4/8, head dims 64
  and 128, float32 and bfloat16, tree and causal tails."""
  args = make_inputs(m, m, prefix, n, kh, h, dtype, kind)
  got = tk.tree_attention(*args, interpret=INTERPRET)
  want = ta.tree_attention_reference(*args)
  assert got.dtype == dtype and got.shape == want.shape
  err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
  assert err <= TOLERANCE[dtype], err


def test_prefix_keys_past_length_are_ignored_and_dead_tiles_skipped():
  """NaN in cache slots >= prefix_len never reaches the output; a block of NaN whole tiles past
  the prefix is never even computed on (its tile index is clamped to the last live one)."""
  q, kt, vt, kc, vc, plen, anc = make_inputs(0, 9, (13, 300), 4, 2, 64, jnp.float32, 'random')
  bad_k = kc.at[0, 13:].set(jnp.nan).at[1, 300:].set(jnp.nan)
  bad_v = vc.at[0, 13:].set(jnp.nan).at[1, 300:].set(jnp.nan)
  got = tk.tree_attention(q, kt, vt, bad_k, bad_v, plen, anc, interpret=INTERPRET)
  want = ta.tree_attention_reference(q, kt, vt, kc, vc, plen, anc)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_tiles_respect_tpu_tiling():
  for t in (1, 7, 64, 255, 2048):
    for groups in range(1, 9):
      packed = ta.packed_groups(groups)
      block_q = tk.choose_block_q(t, packed)
      assert (block_q * packed) % 8 == 0 and block_q * packed <= 128
  assert tk.choose_block_k(1024) == 128 and tk.choose_block_k(40) == 8
  assert tk.choose_block_k(12) == 12  # no multiple of 8 divides it: the whole cache, one tile


@pytest.mark.parametrize('preset', ['qwen3_8b', 'qwen3_30b_a3b', 'qwen3_0_6b', 'smollm2_135m'])
def test_vmem_footprint_fits_a_v5e_core(preset):
  """The footprint computed from the block sizes (the kernel's ``vmem_limit_bytes`` less its
  headroom) stays under 16 MiB for a bf16 prefill chunk of 2048 tokens and a 255-node tree at
  a 32k-slot cache: the tail is streamed in tiles, not loaded whole (whole, a Qwen3-8B chunk's
  K and V tails alone would take 16 MiB double-buffered)."""
  cfg = js.decoder.PRESETS[preset]()
  heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
  for t, tree in ((2048, False), (255, True), (1, True)):
    lay = tk.layout(t, *heads, 32768, tree=tree, itemsize=2)
    assert lay.vmem_bytes + tk.VMEM_HEADROOM < 16 << 20, (preset, t, lay)
    assert lay.block_tail <= max(tk.CAUSAL_TAIL_TILE, 256)
  whole_tail = 2 * 2 * cfg.num_key_value_heads * 2048 * cfg.head_dim * 2
  assert tk.layout(2048, *heads, 32768, tree=False).vmem_bytes < whole_tail


def test_every_head_layout_lowers_to_mosaic():
  assert_grid_lowers(tk.tree_attention, 'tpu', MOSAIC_CALL.pattern)


def _tree_forward_args(target, m=9, capacity=64):
  tree = js.testing.random_tree(1, m, vocab_size=target.cfg.vocab_size)
  cache = target.make_cache(1, capacity).replace(lengths=jnp.array([20], jnp.int32))
  mask = js.decoder.TailMask(cache.lengths, tree.ancestor_mask()[None])
  return tree.tokens[None], cache, 20 + tree.depths[None], mask


def _export(target, platforms):
  tokens, cache, positions, mask = _tree_forward_args(target)

  def verify(target, tokens, cache, positions, mask):
    return target.forward(tokens, cache, positions=positions, mask=mask).hidden

  return jax.export.export(
    jax.jit(verify),
    platforms=platforms,
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call('__gpu$xla.gpu.triton')],
  )(target, tokens, cache, positions, mask).mlir_module()


def test_each_platform_lowers_its_own_kernel():
  """``attn_impl='pallas'`` picks the kernel at lowering time: the same jitted function exported
  for TPU holds Mosaic calls, for CUDA Triton calls (a program lowered for both at once cannot
  be made: Pallas lowers every branch for every platform, and a kernel's compiler parameters
  belong to one)."""
  target = js.testing.tiny_target(0, head_dim=64).with_attn_impl('pallas')
  tpu = _export(target, ['tpu'])
  assert MOSAIC_CALL.search(tpu) and not TRITON_CALL.search(tpu)
  cuda = _export(target, ['cuda'])
  assert TRITON_CALL.search(cuda) and not MOSAIC_CALL.search(cuda)


def test_a_platform_without_a_kernel_is_an_error():
  target = js.testing.tiny_target(0, head_dim=64).with_attn_impl('pallas_mosaic')
  with pytest.raises(Exception, match='cuda'):
    _export(target, ['cuda'])


def test_generate_with_the_mosaic_kernel_equals_autoregressive():
  """Greedy decoding with the TPU kernel (TPU interpret mode) inside the model: prefill (causal
  tail), decode (one row) and tree verification, against AR with XLA attention."""
  target = js.testing.tiny_target(3, vocab_size=17)
  mosaic = target.with_attn_impl('pallas_mosaic')
  head = js.testing.random_draft_head(target, block_size=4, seed=2)
  prompt = js.testing.random_ids(4, (11,), 17)
  want = js.generate(target, None, prompt, max_new_tokens=12, method=js.methods.AR()).tokens
  got = js.generate(
    mosaic, head, prompt, max_new_tokens=12, method=js.methods.Tree(budget=12, width=3)
  )
  np.testing.assert_array_equal(got.tokens, want)


SHARDED = r"""
import os
flags = os.environ.get("XLA_FLAGS", "")  # the suite flags, plus the devices
os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
import jetspec_jax as js
from jetspec_jax import sharding
dims = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_attention_heads=8,
            num_key_value_heads=4, head_dim=16)
target = js.testing.tiny_target(0, **dims)
ids = np.arange(2 * 12).reshape(2, 12) % 64
tree = js.testing.random_tree(1, 9, vocab_size=64)
anc = jnp.stack([tree.ancestor_mask()] * 2)

def run(t):
  cache = t.forward(jnp.asarray(ids), t.make_cache(2, 32)).cache
  mask = js.decoder.TailMask(cache.lengths, anc)
  out = t.forward(jnp.stack([tree.tokens] * 2), cache, positions=12 + jnp.stack([tree.depths] * 2),
                  mask=mask)
  return np.asarray(t.forward_logits(ids)), np.asarray(t.lm_logits(out.hidden))

want = run(target)
for impl in ("pallas", "pallas_mosaic"):
  for data, model in ((1, 4), (2, 2)):
    mesh = sharding.make_mesh(data, model)
    t = target.replace(params=sharding.shard_params(target.params, mesh)).with_attn_impl(impl)
    with jax.set_mesh(mesh):
      jaxpr = str(jax.make_jaxpr(lambda t: t.forward_logits(ids))(t))
      got = jax.block_until_ready(run(t))
    assert "shard_map" in jaxpr
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, atol=2e-5)
    print("OK", impl, data, model)
"""


@pytest.mark.slow  # ~100 s on 4 fake devices: `make test-slow`
def test_kernels_run_per_device_inside_a_model_parallel_mesh():
  """4 fake CPU devices, heads split over 'model' (and sequences over 'data'): prefill and the
  tree-masked forward with either kernel (interpreted) run under shard_map and equal XLA's."""
  import os
  import subprocess
  import sys

  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  out = subprocess.run(
    [sys.executable, '-c', SHARDED], capture_output=True, text=True, env=env, timeout=900
  )
  assert out.returncode == 0, out.stderr[-4000:]
  assert out.stdout.count('OK') == 4
