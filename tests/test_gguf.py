"""GGUF import: dequantization, llama.cpp's Q/K permutation, the conversion cache, bad files.

Tiny random Llama models are written with the ``gguf`` package's writer (quantized and float
tensors) and loaded both by ``js.load_target`` and by transformers' own GGUF loader.
"""

import dataclasses
import json

import gguf
import jax
import numpy as np
import pytest

import jetspec_jax as js
from jetspec_jax.models import gguf_io, model_cache

T = gguf.GGMLQuantizationType
TINY_LLAMA = dict(
  architectures=['LlamaForCausalLM'],
  model_type='llama',
  vocab_size=128,
  hidden_size=64,
  intermediate_size=96,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
  head_dim=16,
  rope_theta=10_000.0,
  rms_norm_eps=1e-5,
  max_position_embeddings=256,
  tie_word_embeddings=False,
  hidden_act='silu',
)
# One quantized type per kind of tensor, so every supported type is loaded end to end.
TENSOR_TYPES = {
  'model.embed_tokens.weight': T.Q8_0,
  'lm_head.weight': T.Q4_1,
  'model.layers.0.self_attn.q_proj.weight': T.Q4_0,
  'model.layers.0.self_attn.k_proj.weight': T.Q8_0,
  'model.layers.0.mlp.down_proj.weight': T.F16,
  'model.layers.1.self_attn.q_proj.weight': T.Q4_1,
  'model.layers.1.mlp.gate_proj.weight': T.BF16,
}


def random_llama_tensors(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
  """HF-named float32 tensors of a random model of ``cfg``; norm scales near 1."""
  rng = np.random.default_rng(seed)
  qcfg = js.hf_io.config_from_hf(cfg)
  shapes = jax.eval_shape(lambda: js.decoder.init_params(qcfg, jax.random.key(0)))
  zeros = jax.tree.map(lambda s: np.zeros(s.shape, np.float32), shapes)
  tensors = js.hf_io.params_to_hf(zeros, qcfg)
  out = {}
  for name, value in tensors.items():
    if name.endswith('norm.weight'):
      out[name] = (1.0 + 0.2 * rng.standard_normal(value.shape)).astype(np.float32)
    else:
      out[name] = (0.15 * rng.standard_normal(value.shape)).astype(np.float32)
  return out


@pytest.fixture(scope='module')
def tiny_gguf(tmp_path_factory):
  path = tmp_path_factory.mktemp('gguf') / 'tiny-llama.gguf'
  tensors = random_llama_tensors(TINY_LLAMA)
  gguf_io.write_gguf(path, TINY_LLAMA, tensors, tensor_types=TENSOR_TYPES)
  return path, tensors


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
  monkeypatch.setenv('JETSPEC_JAX_CACHE', str(tmp_path / 'cache'))


@pytest.mark.parametrize('qtype', [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1])
def test_dequantize_matches_the_gguf_reference(qtype):
  rng = np.random.default_rng(int(qtype))
  values = (rng.standard_normal((6, 96)) * 3).astype(np.float32)
  if qtype == T.F32:
    raw = values.view(np.uint8)
  elif qtype == T.F16:
    raw = values.astype(np.float16).view(np.uint8)
  else:
    raw = gguf.quants.quantize(values, qtype)
  want = gguf.quants.dequantize(raw, qtype).reshape(values.shape)
  got = gguf_io.dequantize(raw, int(qtype), values.shape)
  np.testing.assert_array_equal(got, want)
  if qtype not in (T.F32,):
    assert not np.array_equal(got, values)  # the format really is lossy (not a pass-through)


# K-quant block layouts: bytes per 256-value block and the byte offsets of its f16 scales.
K_QUANT_SCALES = {
  T.Q2_K: (84, (80, 82)),
  T.Q3_K: (110, (108,)),
  T.Q4_K: (144, (0, 2)),
  T.Q5_K: (176, (0, 2)),
  T.Q6_K: (210, (208,)),
}


def random_kquant_blocks(qtype, rows: int, cols: int, seed: int, std: float = 0.15) -> np.ndarray:
  """``[rows, row bytes]`` random blocks of K-quant ``qtype`` whose values have about ``std``.

  ``gguf.quants`` decodes K-quants but cannot encode them, so the blocks are random bytes with
  their f16 super-block scales set; values are linear in those scales, which are then rescaled.
  """
  block_bytes, offsets = K_QUANT_SCALES[qtype]
  rng = np.random.default_rng(seed)
  blocks = rng.integers(0, 256, (rows * cols // 256, block_bytes), dtype=np.uint8)

  def set_scales(value):
    for o in offsets:
      blocks[:, o : o + 2] = np.full((len(blocks), 1), value, np.float16).view(np.uint8)

  set_scales(1e-3)
  values = gguf.quants.dequantize(blocks.reshape(rows, -1), qtype)
  set_scales(1e-3 * std / values.std())
  return blocks.reshape(rows, -1)


@pytest.mark.parametrize('qtype', [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1])
def test_other_types_decode_through_gguf_quants(qtype):
  """Types not decoded here go through ``gguf.quants`` (row by row, any tensor shape)."""
  shape = (3, 2, 512)
  if qtype in K_QUANT_SCALES:
    raw = random_kquant_blocks(qtype, 6, 512, seed=int(qtype))
  else:
    raw = gguf.quants.quantize(np.random.default_rng(0).standard_normal((6, 512)), qtype)
  got = gguf_io.dequantize(raw.reshape(-1), int(qtype), shape)
  want = gguf.quants.dequantize(raw, qtype).reshape(shape)
  np.testing.assert_array_equal(got, want)
  assert got.dtype == np.float32 and 0.05 < got.std() < 2
  with pytest.raises(ValueError, match='whole number'):
    gguf_io.dequantize(raw.reshape(-1)[:-1], int(qtype), shape)


def test_unpermute_inverts_llama_cpp_permutation():
  w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
  permuted = gguf_io.permute_qk(w, 8)
  assert not np.array_equal(permuted, w)
  np.testing.assert_array_equal(gguf_io.unpermute_qk(permuted, 8), w)


def transformers_gguf_logits(path, ids: np.ndarray) -> np.ndarray:
  """Logits of transformers' own loading of the GGUF file ``path`` (float32)."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  pytest.importorskip('accelerate')
  model = transformers.AutoModelForCausalLM.from_pretrained(
    str(path.parent), gguf_file=path.name, dtype=torch.float32
  ).eval()
  with torch.no_grad():
    return model(torch.from_numpy(ids).long()).logits.numpy()


def test_gguf_logits_match_transformers_gguf_loading(tiny_gguf):
  path, _ = tiny_gguf
  target = js.load_target(path)
  assert target.cfg.model_type == 'llama' and not target.cfg.qk_norm
  ids = js.testing.random_ids(5, (2, 19), TINY_LLAMA['vocab_size'])
  want = transformers_gguf_logits(path, ids)
  got = np.asarray(target.forward_logits(ids))
  print(f'gguf parity: max |logit diff| {np.abs(got - want).max():.3g}')
  assert np.abs(want).max() > 1.0
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


KQUANT_LLAMA = dict(TINY_LLAMA, hidden_size=256, intermediate_size=512, head_dim=64)
# Every K-quant, as a Q4_K_M / Q5_K_M / Q6_K file mixes them (rows of 256 or 512 values).
KQUANT_TYPES = {
  'model.embed_tokens.weight': T.Q6_K,
  'lm_head.weight': T.Q5_K,
  'model.layers.0.self_attn.q_proj.weight': T.Q4_K,
  'model.layers.0.self_attn.k_proj.weight': T.Q5_K,
  'model.layers.0.self_attn.v_proj.weight': T.Q6_K,
  'model.layers.0.self_attn.o_proj.weight': T.Q3_K,
  'model.layers.0.mlp.gate_proj.weight': T.Q2_K,
  'model.layers.0.mlp.up_proj.weight': T.Q4_K,
  'model.layers.0.mlp.down_proj.weight': T.Q6_K,
  'model.layers.1.self_attn.q_proj.weight': T.Q3_K,
  'model.layers.1.mlp.down_proj.weight': T.Q4_K,
}


def test_k_quant_gguf_logits_match_transformers_gguf_loading(tmp_path):
  tensors = random_llama_tensors(KQUANT_LLAMA, seed=3)
  for i, (name, qtype) in enumerate(KQUANT_TYPES.items()):
    rows, cols = tensors[name].shape
    tensors[name] = random_kquant_blocks(qtype, rows, cols, seed=i)
  path = tmp_path / 'tiny-llama-kquants.gguf'
  gguf_io.write_gguf(path, KQUANT_LLAMA, tensors, tensor_types=KQUANT_TYPES)
  target = js.load_target(path)
  ids = js.testing.random_ids(6, (2, 17), KQUANT_LLAMA['vocab_size'])
  want = transformers_gguf_logits(path, ids)
  got = np.asarray(target.forward_logits(ids))
  print(f'K-quant gguf parity: max |logit diff| {np.abs(got - want).max():.3g}')
  assert np.abs(want).max() > 5.0
  np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)  # logits up to ~20, float32 sums


LLAMA3_ROPE = dict(
  rope_type='llama3',
  factor=8.0,
  low_freq_factor=1.0,
  high_freq_factor=4.0,
  original_max_position_embeddings=64,
)


def test_llama3_rope_freqs_gguf_matches_transformers(tmp_path):
  """A Llama-3.1-style file carries its RoPE scaling as ``rope_freqs`` (llama.cpp's converter
  formula); the loaded target matches transformers' model of the original config, and would
  not without the scaling."""
  torch = pytest.importorskip('torch')
  transformers = pytest.importorskip('transformers')
  hf = dict(TINY_LLAMA, rope_scaling=dict(LLAMA3_ROPE, rope_theta=TINY_LLAMA['rope_theta']))
  tensors = random_llama_tensors(TINY_LLAMA, seed=4)
  path = tmp_path / 'tiny-llama3.gguf'
  gguf_io.write_gguf(path, hf, tensors)
  assert 'rope_freqs.weight' in {t.name for t in gguf.GGUFReader(str(path)).tensors}
  target = js.load_target(path)
  assert target.cfg.rope_scaling is not None
  np.testing.assert_allclose(
    js.decoder.layers.rope_inv_freq(16, 10_000.0, target.cfg.rope_scaling),
    js.decoder.layers.rope_inv_freq(16, 10_000.0, js.hf_io.rope_scaling_from_hf(hf)),
    rtol=1e-6,
  )
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf))
  model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
  ids = js.testing.random_ids(7, (1, 120), TINY_LLAMA['vocab_size'])  # past 64 positions
  with torch.no_grad():
    want = model.eval()(torch.from_numpy(ids).long()).logits.numpy()
  got = np.asarray(target.forward_logits(ids))
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
  plain = js.load_target(model_cache.cached_checkpoint(path)).cfg  # the same entry, scaled
  assert plain.rope_scaling == target.cfg.rope_scaling
  unscaled = js.Target(cfg=dataclasses.replace(target.cfg, rope_scaling=None), params=target.params)
  assert np.abs(np.asarray(unscaled.forward_logits(ids)) - want).max() > 1e-2


def test_llama3_scaling_is_recovered_from_llama_cpp_factors():
  """Llama-3.1-8B's parameters (theta 5e5, head_dim 128) come back from the factors; factors no
  llama3 scaling makes are refused."""
  kw = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original=8192)
  factors = gguf_io.llama_cpp_freq_factors(128, 500_000.0, **kw)
  got = gguf_io.llama3_scaling_from_freq_factors(
    factors, head_dim=128, theta=500_000.0, original=8192
  )
  assert got.factor == 8.0 and got.original_max_position_embeddings == 8192
  assert got.low_freq_factor == pytest.approx(1.0, rel=1e-4)
  assert got.high_freq_factor == pytest.approx(4.0, rel=1e-4)
  for bad in (np.linspace(1, 8, 64)[::-1], np.full(64, 2.0), factors[:-1]):
    with pytest.raises(js.CheckpointError, match='rope_freqs'):
      gguf_io.llama3_scaling_from_freq_factors(bad, head_dim=128, theta=500_000.0, original=8192)


def test_gguf_equals_its_dequantized_weights(tiny_gguf):
  """Float tensors come back exactly; quantized ones within their format's error."""
  path, tensors = tiny_gguf
  _, got = gguf_io.convert(path)
  assert set(got) == set(tensors)
  name = 'model.layers.1.self_attn.v_proj.weight'  # F32 (default type)
  np.testing.assert_array_equal(got[name], tensors[name])
  q = 'model.layers.0.self_attn.q_proj.weight'  # Q4_0 and permuted on disk
  assert np.abs(got[q] - tensors[q]).max() < 0.15 * np.abs(tensors[q]).max()
  assert np.corrcoef(got[q].ravel(), tensors[q].ravel())[0, 1] > 0.97


def test_no_stale_entry_is_reused(tiny_gguf, tmp_path, monkeypatch):
  """Every file of an entry is covered (an edited config.json, an extra file), and the source is
  hashed whole (a same-size edit in the middle of the GGUF names another entry)."""
  path, _ = tiny_gguf
  first = np.asarray(js.load_target(path).forward_logits(np.arange(7)[None]))
  entry = model_cache.cached_checkpoint(path)
  config = json.loads((entry / 'config.json').read_text())
  (entry / 'config.json').write_text(json.dumps(dict(config, rope_theta=123.0)))
  assert not model_cache._entry_is_valid(entry)
  np.testing.assert_array_equal(
    np.asarray(js.load_target(path).forward_logits(np.arange(7)[None])), first
  )
  assert json.loads((entry / 'config.json').read_text()) == config  # rebuilt
  (entry / 'config.json').write_text('{}')
  assert model_cache.cached_checkpoint(path) == entry and model_cache._entry_is_valid(entry)
  (entry / 'extra.bin').write_bytes(b'x')
  assert not model_cache._entry_is_valid(entry)
  model_cache.cached_checkpoint(path)
  assert not (entry / 'extra.bin').exists()

  edited = tmp_path / path.name
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x01  # same size, one bit in the middle (tensor data)
  edited.write_bytes(bytes(data))
  assert model_cache.cached_checkpoint(edited) != entry


def test_second_load_uses_the_cache_and_a_corrupt_entry_is_rebuilt(tiny_gguf, monkeypatch):
  path, _ = tiny_gguf
  first = np.asarray(js.load_target(path).forward_logits(np.arange(7)[None]))
  entry = model_cache.cached_checkpoint(path)
  files = json.loads((entry / model_cache.MANIFEST).read_text())['files']
  assert set(files) == {'config.json', 'model.safetensors'} and files['model.safetensors'][0] > 0

  def no_conversion(_):
    raise AssertionError('converted again although the cache entry is valid')

  monkeypatch.setattr(gguf_io, 'convert', no_conversion)
  np.testing.assert_array_equal(
    np.asarray(js.load_target(path).forward_logits(np.arange(7)[None])), first
  )
  weights = entry / 'model.safetensors'
  weights.write_bytes(weights.read_bytes()[:-100])  # truncated entry
  with pytest.raises(AssertionError, match='converted again'):
    js.load_target(path)
  monkeypatch.undo()
  monkeypatch.setenv('JETSPEC_JAX_CACHE', str(entry.parents[1]))
  np.testing.assert_array_equal(
    np.asarray(js.load_target(path).forward_logits(np.arange(7)[None])), first
  )
  data = bytearray(weights.read_bytes())
  data[-5] ^= 0xFF  # same size, corrupted content
  weights.write_bytes(bytes(data))
  assert not model_cache._entry_is_valid(entry)
  np.testing.assert_array_equal(
    np.asarray(js.load_target(path).forward_logits(np.arange(7)[None])), first
  )


def test_missing_and_truncated_files(tiny_gguf, tmp_path):
  path, _ = tiny_gguf
  with pytest.raises(FileNotFoundError, match='does not exist'):
    js.load_target(tmp_path / 'nothing.gguf')
  cut = tmp_path / 'cut.gguf'
  cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
  with pytest.raises(js.CheckpointError, match='cut.gguf'):
    js.load_target(cut)


def test_unsupported_architecture_is_named(tmp_path):
  path = tmp_path / 'gpt2.gguf'
  writer = gguf.GGUFWriter(str(path), 'gpt2')
  writer.add_block_count(1)
  writer.add_tensor('token_embd.weight', np.zeros((8, 4), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(js.CheckpointError, match="unsupported GGUF architecture 'gpt2'"):
    js.load_target(path)


def test_unknown_tensor_type_is_named(tmp_path, monkeypatch):
  """A type neither this module nor the installed ``gguf`` decodes names the tensor and type."""
  cfg = dict(TINY_LLAMA, num_hidden_layers=1)
  tensors = random_llama_tensors(cfg, seed=1)
  path = tmp_path / 'q5.gguf'
  name = 'model.layers.0.mlp.up_proj.weight'
  gguf_io.write_gguf(path, cfg, tensors, tensor_types={name: T.Q5_0})
  js.load_target(path)  # decoded by gguf.quants
  decode = gguf.quants.dequantize

  def without_q5_0(data, qtype):  # an older gguf that cannot decode Q5_0
    if qtype == T.Q5_0:
      raise NotImplementedError(f'Dequantization for {qtype.name} is not yet implemented')
    return decode(data, qtype)

  monkeypatch.setattr(gguf.quants, 'dequantize', without_q5_0)
  monkeypatch.setenv('JETSPEC_JAX_CACHE', str(tmp_path / 'other_cache'))
  with pytest.raises(js.CheckpointError, match=r'blk\.0\.ffn_up\.weight has type Q5_0'):
    js.load_target(path)


def test_transformers_peer_decodes_the_same_greedy_tokens(tiny_gguf):
  """The benchmark's peer (transformers' generate, greedy and prompt-lookup) on the same GGUF
  produces our greedy AR tokens; ``agreement`` measures the shared leading run."""
  pytest.importorskip('torch')
  pytest.importorskip('transformers')
  from experiments.tasks import peers

  path, _ = tiny_gguf
  target = js.load_target(path)
  prompts = [np.arange(3, 12), np.asarray([5, 9, 5, 9, 5, 9, 5])]
  eos = [TINY_LLAMA['vocab_size'] - 1]
  ours = [
    js.generate(target, None, p, max_new_tokens=12, method=js.methods.AR(), eos_id=eos).tokens
    for p in prompts
  ]
  found = peers.transformers_generate(str(path), prompts, max_new_tokens=12, eos_ids=eos)
  assert set(found) == set(peers.MODES)
  for mode, r in found.items():
    assert r['new_tokens'] == sum(len(t) for t in r['tokens']) and r['tps'] > 0
    assert peers.agreement(ours, r['tokens']) == 1.0, mode
  assert peers.agreement([np.asarray([1, 2, 3, 4])], [[1, 2, 0, 4]]) == 0.5
