"""The draft head: block masks, context cache, released checkpoint layout, fit checks."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax as js
from jetspec_jax.models import draft_head as dh
from jetspec_jax.models import head_io, hf_io

ATOL = 2e-5


@pytest.fixture(scope='module')
def target():
  return js.testing.tiny_target(0)


def features(seed, rows, head):
  rng = np.random.default_rng(seed)
  width = head.cfg.num_taps * head.cfg.hidden_size
  return jnp.asarray(rng.normal(size=(rows, width)).astype(np.float32))


def block_hidden(head, ctx_feats, x):
  """Runs the head's layers on explicit block embeddings ``x [bs, D]`` after ``ctx_feats``."""
  c = ctx_feats.shape[0]
  cache = head.extend_context(head.make_cache(1, c), ctx_feats[None], jnp.array([c]))
  positions = c + jnp.arange(head.cfg.block_size)[None]
  ctx_mask, blk_mask = dh.block_mask(head.cfg, jnp.array([c]), c)
  module = dh.DraftHeadModule(head.cfg)
  return module.apply(
    {'params': head.params}, x[None], positions, cache.k, cache.v, ctx_mask, blk_mask
  )[0]


@pytest.mark.parametrize('causal', [True, False])
def test_causal_slots_ignore_later_slots(target, causal):
  """Causal head: output at slot i is unchanged when any slot j > i changes (not so if full)."""
  head = js.testing.random_draft_head(target, block_size=6, causal=causal, seed=1)
  ctx = features(0, 9, head)
  x = jax.random.normal(jax.random.key(2), (6, head.cfg.hidden_size))
  base = np.asarray(block_hidden(head, ctx, x))
  for j in range(1, 6):
    changed = np.asarray(block_hidden(head, ctx, x.at[j].add(1.0)))
    earlier_same = np.allclose(changed[:j], base[:j], atol=1e-6)
    if causal:
      assert earlier_same, f'slot {j} leaked into earlier slots'
    else:
      assert not earlier_same
    assert not np.allclose(changed[j:], base[j:], atol=1e-6)


def test_one_set_of_weights_drafts_blocks_of_8_and_16(target):
  """No weight depends on the block size: a head of blocks of 8 runs at 16 with the same weights,
  and a causal one's first 8 slots there are its blocks-of-8 outputs."""
  head8 = js.testing.random_draft_head(target, block_size=8, causal=True, seed=1)
  head16 = dh.DraftHead(dataclasses.replace(head8.cfg, block_size=16), head8.params)
  fresh = dh.init_head_params(head16.cfg, jax.random.key(0))
  assert jax.tree.map(jnp.shape, fresh) == jax.tree.map(jnp.shape, head8.params)
  ctx = features(0, 9, head8)
  x = jax.random.normal(jax.random.key(2), (16, head8.cfg.hidden_size))
  np.testing.assert_allclose(
    block_hidden(head16, ctx, x)[:8], block_hidden(head8, ctx, x[:8]), atol=ATOL
  )


def test_context_at_or_after_anchor_is_invisible(target):
  """Context rows at positions >= the anchor's never influence the block."""
  head = js.testing.random_draft_head(target, block_size=5, seed=3)
  ctx = features(1, 12, head)
  anchor = jnp.array([7])
  cache = head.extend_context(head.make_cache(1, 32), ctx[None, :8], jnp.array([8]))
  clean = head.propose_cached(target, cache, anchor)
  # Write garbage rows at slots 8..11 (positions >= the anchor's), then restore the length.
  dirty = head.extend_context(cache, ctx[None, 8:] * 50.0, jnp.array([4]))
  dirty = dirty.replace(lengths=cache.lengths)
  np.testing.assert_allclose(
    np.asarray(head.propose_cached(target, dirty, anchor)), np.asarray(clean), atol=1e-6
  )
  # And the last context row does matter (the test is not vacuous).
  other = head.extend_context(head.make_cache(1, 32), ctx[None, 1:9], jnp.array([8]))
  assert not np.allclose(np.asarray(head.propose_cached(target, other, anchor)), np.asarray(clean))


def test_cached_equals_uncached_across_rounds(target):
  """Appending each round's accepted rows to the cache == recomputing the whole context."""
  head = js.testing.random_draft_head(target, block_size=6, seed=4)
  ctx = features(2, 20, head)
  anchors = js.testing.random_ids(5, (4,), target.cfg.vocab_size)
  cache = head.make_cache(1, 32)
  lengths = [7, 3, 6, 1]  # prompt, then acc + 1 rows per round (<= block size)
  done = 0
  for rows, anchor in zip(lengths, anchors):
    pending = jnp.zeros((1, 8, ctx.shape[1])).at[0, :rows].set(ctx[done : done + rows])
    cache = head.extend_context(cache, pending, jnp.array([rows]))
    done += rows
    cached = head.propose_cached(target, cache, jnp.array([anchor]))[0]
    fresh = head.propose(target, ctx[:done], int(anchor))
    assert fresh.shape == (5, target.cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(cached), np.asarray(fresh), atol=ATOL)


def test_block_mask_picture():
  cfg = dh.config_for_target(js.decoder.tiny(), block_size=3)
  ctx, blk = dh.block_mask(cfg, jnp.array([2]), 4)
  mask = np.concatenate([np.asarray(ctx)[0], np.asarray(blk)], axis=1).astype(int)
  np.testing.assert_array_equal(
    mask, [[1, 1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 0, 1, 1, 1]]
  )


def test_default_tap_rule():
  assert dh.default_tap_layers(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B's released taps
  assert dh.default_tap_layers(48, 5) == (1, 12, 23, 34, 45)  # Qwen3-30B-A3B's
  assert dh.default_tap_layers(36, 1) == (18,)


# Checkpoints in the released layout.


def released_layout(cfg: dh.DraftHeadConfig, seed=0) -> dict[str, np.ndarray]:
  """Random tensors named and shaped exactly as the released JetSpec/DFlash heads."""
  rng = np.random.default_rng(seed)
  d, h = cfg.hidden_size, cfg.head_dim
  n, k, f = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
  shapes = {'fc.weight': (d, cfg.num_taps * d), 'hidden_norm.weight': (d,), 'norm.weight': (d,)}
  for i in range(cfg.num_hidden_layers):
    p = f'layers.{i}'
    shapes.update(
      {
        f'{p}.self_attn.q_proj.weight': (n * h, d),
        f'{p}.self_attn.k_proj.weight': (k * h, d),
        f'{p}.self_attn.v_proj.weight': (k * h, d),
        f'{p}.self_attn.o_proj.weight': (d, n * h),
        f'{p}.self_attn.q_norm.weight': (h,),
        f'{p}.self_attn.k_norm.weight': (h,),
        f'{p}.mlp.gate_proj.weight': (f, d),
        f'{p}.mlp.up_proj.weight': (f, d),
        f'{p}.mlp.down_proj.weight': (d, f),
        f'{p}.input_layernorm.weight': (d,),
        f'{p}.post_attention_layernorm.weight': (d,),
      }
    )
  return {name: (0.1 * rng.normal(size=s)).astype(np.float32) for name, s in shapes.items()}


def test_loads_released_layout_and_round_trips(target, tmp_path):
  cfg = dh.config_for_target(target.cfg, num_layers=2, block_size=6, target_layer_ids=(0, 2))
  tensors = released_layout(cfg)
  hf_io.write_tensors(tensors, tmp_path / 'released')
  (tmp_path / 'released' / 'config.json').write_text(json.dumps(head_io.head_config_to_hf(cfg)))
  head = js.load_draft_head(tmp_path / 'released', target)
  assert head.cfg == cfg
  np.testing.assert_array_equal(np.asarray(head.params['fc']['kernel']), tensors['fc.weight'].T)
  q = np.asarray(head.params['layers_1']['q_proj']['kernel'])
  np.testing.assert_array_equal(
    q.reshape(q.shape[0], -1), tensors['layers.1.self_attn.q_proj.weight'].T
  )
  js.save_draft_head(head, tmp_path / 'saved')
  saved = hf_io.read_tensors(tmp_path / 'saved')
  assert sorted(saved) == sorted(tensors)
  for name in tensors:
    np.testing.assert_array_equal(saved[name], tensors[name])
  config = json.loads((tmp_path / 'saved' / 'config.json').read_text())
  assert config['dflash_config'] == {
    'causal_head': True,
    'target_layer_ids': [0, 2],
    'mask_token_id': cfg.mask_token_id,
  }
  assert config['block_size'] == 6 and config['num_target_layers'] == 3
  reloaded = js.load_draft_head(tmp_path / 'saved', target)
  feats = features(0, 5, head)
  np.testing.assert_array_equal(
    np.asarray(reloaded.propose(target, feats, 3)), np.asarray(head.propose(target, feats, 3))
  )
  js.save_draft_head(head, tmp_path / 'bf16', dtype=jnp.bfloat16)  # a shipped head
  assert all(t.dtype == jnp.bfloat16 for t in hf_io.read_tensors(tmp_path / 'bf16').values())
  small = js.load_draft_head(tmp_path / 'bf16', target)
  assert small.dtype == target.dtype
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-6), small.params, head.params
  )


def test_head_that_does_not_fit_the_target(target, tmp_path):
  head = js.testing.random_draft_head(target, block_size=4)
  js.save_draft_head(head, tmp_path)
  config = json.loads((tmp_path / 'config.json').read_text())

  def load_with(**changes):
    dflash = {**config['dflash_config'], **changes.pop('dflash', {})}
    (tmp_path / 'config.json').write_text(
      json.dumps({**config, **changes, 'dflash_config': dflash})
    )
    return js.load_draft_head(tmp_path, target)

  with pytest.raises(js.CheckpointError, match='vocab_size 300 != target vocab_size 257'):
    load_with(vocab_size=300)
  with pytest.raises(js.CheckpointError, match='hidden_size 64 != target hidden_size 44'):
    load_with(hidden_size=64)
  with pytest.raises(js.CheckpointError, match=r'taps target layers \[7\]'):
    load_with(dflash={'target_layer_ids': [0, 7]})
  with pytest.raises(js.CheckpointError, match='built for a 36-layer target'):
    load_with(num_target_layers=36)
  with pytest.raises(js.CheckpointError, match='shape mismatch for fc.weight'):
    load_with(dflash={'target_layer_ids': [0, 1, 2]})
  with pytest.raises(js.CheckpointError, match='lacks dflash_config.mask_token_id'):
    (tmp_path / 'config.json').write_text(json.dumps({**config, 'dflash_config': {}}))
    js.load_draft_head(tmp_path, target)


def test_propose_rejects_bad_features(target):
  head = js.testing.random_draft_head(target, block_size=4)
  with pytest.raises(ValueError, match='features have width'):
    head.propose(target, jnp.zeros((3, 7)), 1)
  with pytest.raises(ValueError, match=r'\[C, n_taps\*D\]'):
    head.propose(target, jnp.zeros((7,)), 1)


def test_qwen3_8b_head_has_the_released_parameter_count():
  """5 layers, taps [1, 9, 17, 25, 33] on Qwen3-8B: 1,048,626,432 parameters
  (docs/draft_head.md §1)."""
  cfg = dh.config_for_target(
    js.decoder.qwen3_8b(),
    num_layers=5,
    block_size=16,
    target_layer_ids=(1, 9, 17, 25, 33),
    mask_token_id=151669,
  )
  shapes = jax.eval_shape(lambda: dh.init_head_params(cfg, jax.random.key(0), jnp.bfloat16))
  assert js.decoder.count_params(shapes) == 1_048_626_432


def test_live_context_attention_equals_dense_and_skips_dead_tiles():
  """Inference reads only the context tiles up to the anchor (NaN planted after them never
  reaches the output) and equals the dense form training uses."""
  rng = np.random.default_rng(0)
  b, t, n, kh, h, capacity, tile = 2, 5, 4, 2, 8, 1024, 128
  q = jnp.asarray(rng.standard_normal((b, t, n, h)), jnp.float32)
  ctx_k = rng.standard_normal((b, capacity, kh, h)).astype(np.float32)
  ctx_v = rng.standard_normal((b, capacity, kh, h)).astype(np.float32)
  blk_k = jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32)
  blk_v = jnp.asarray(rng.standard_normal((b, t, kh, h)), jnp.float32)
  anchor = jnp.array([300, 17], jnp.int32)
  ctx_mask = jnp.broadcast_to(
    jnp.arange(capacity)[None, None] < anchor[:, None, None], (b, t, capacity)
  )
  blk_mask = jnp.tril(jnp.ones((t, t), bool))
  dead = -(-300 // tile) * tile
  ctx_k[:, dead:], ctx_v[:, dead:] = np.nan, np.nan
  args = (q, jnp.asarray(ctx_k), jnp.asarray(ctx_v), blk_k, blk_v, ctx_mask, blk_mask)
  clean = (q, jnp.nan_to_num(ctx_k), jnp.nan_to_num(ctx_v), blk_k, blk_v, ctx_mask, blk_mask)
  want = dh.context_block_attention(*clean)
  got = dh.context_block_attention(*args, live_context=True, tile=tile)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-5)
  assert not np.isfinite(np.asarray(dh.context_block_attention(*args))).all()


def test_init_from_target_layers_copies_matching_weights(target):
  head = js.testing.random_draft_head(target, block_size=4, num_layers=2, target_layer_ids=(0, 2))
  params = js.draft_head.init_from_target_layers(head.params, head.cfg, target.params)
  last = target.cfg.num_hidden_layers - 1
  np.testing.assert_array_equal(
    params['layers_1']['q_proj']['kernel'],
    target.params[f'layers_{last}']['self_attn']['q_proj']['kernel'],
  )
  np.testing.assert_array_equal(
    params['layers_0']['mlp']['down_proj']['kernel'],
    target.params[f'layers_{last - 1}']['mlp']['down_proj']['kernel'],
  )
  np.testing.assert_array_equal(params['norm']['scale'], target.params['norm']['scale'])
  d = head.cfg.hidden_size
  fc = np.asarray(params['fc']['kernel'])
  np.testing.assert_array_equal(fc[d:], np.eye(d))  # the deepest of the two taps passes through
  assert not fc[:d].any()
  assert not np.array_equal(head.params['fc']['kernel'], fc)  # the input is not modified
  q = params['layers_1']['q_proj']['kernel']
  assert q.unsafe_buffer_pointer() != (
    target.params[f'layers_{last}']['self_attn']['q_proj']['kernel'].unsafe_buffer_pointer()
  )  # a training step donates the head's state: it must not alias the target
  with pytest.raises(ValueError, match='target layer ids'):
    js.draft_head.init_from_target_layers(head.params, head.cfg, target.params, (0,))


def test_unsorted_draft_vocab_saves_sorted_and_drafts_the_same(target, tmp_path):
  """A head built with an unsorted (and repeated) draft vocabulary saves it sorted, loads, and
  drafts exactly as before: the ids are scored by token id, so their order carries nothing."""
  head = dh.random_draft_head(target, block_size=4, seed=3)
  head = head.replace(draft_vocab=jnp.array([9, 2, 5, 2, 0], jnp.int32))
  js.save_draft_head(head, tmp_path / 'h')
  reloaded = js.load_draft_head(tmp_path / 'h', target)
  np.testing.assert_array_equal(np.asarray(reloaded.draft_vocab), [0, 2, 5, 9])
  feats = features(0, 5, head)
  np.testing.assert_array_equal(
    np.asarray(reloaded.propose(target, feats, 3)), np.asarray(head.propose(target, feats, 3))
  )
  with pytest.raises(ValueError, match='draft_vocab'):
    js.save_draft_head(head.replace(draft_vocab=jnp.array([-1, 2])), tmp_path / 'bad')
