"""Parity with Hugging Face transformers on tiny random Qwen3, Qwen3-MoE, Llama and Qwen2 models.

Models are built offline from a config with a fixed seed, their weights perturbed so that every
tensor (norm scales included) matters, saved with ``save_pretrained`` and loaded with
``js.load_target``. Max |logit diff| must stay <= 1e-4 in float32.
"""

import dataclasses
import json

import numpy as np
import pytest

import jetspec_jax as js

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

TOL = 1e-4
BASE = dict(
  vocab_size=257,
  hidden_size=44,
  intermediate_size=67,
  num_hidden_layers=3,
  num_attention_heads=4,
  head_dim=14,
  rope_theta=10000.0,
  max_position_embeddings=512,
)
CASES = {
  'mha_untied': dict(num_key_value_heads=4, tie_word_embeddings=False),
  'gqa_untied': dict(num_key_value_heads=2, tie_word_embeddings=False),
  'mqa_tied': dict(num_key_value_heads=1, tie_word_embeddings=True),
  'gqa_tied': dict(num_key_value_heads=2, tie_word_embeddings=True),
  'moe': dict(
    num_key_value_heads=2,
    tie_word_embeddings=False,
    num_experts=5,
    num_experts_per_tok=2,
    moe_intermediate_size=23,
    mlp_only_layers=[1],
    norm_topk_prob=True,
  ),
  'moe_unnormed': dict(
    num_key_value_heads=1,
    tie_word_embeddings=True,
    num_experts=4,
    num_experts_per_tok=3,
    moe_intermediate_size=19,
    norm_topk_prob=False,
  ),
  # The Llama family: no q/k norm; Llama-3 RoPE scaling; Qwen2's q/k/v biases.
  'llama_gqa_tied': dict(family='llama', num_key_value_heads=2, tie_word_embeddings=True),
  'llama_mha_untied': dict(family='llama', num_key_value_heads=4, tie_word_embeddings=False),
  'llama3_rope_gqa': dict(
    family='llama',
    num_key_value_heads=2,
    tie_word_embeddings=False,
    rope_parameters=dict(
      rope_type='llama3',
      rope_theta=10000.0,
      factor=8.0,
      low_freq_factor=1.0,
      high_freq_factor=4.0,
      original_max_position_embeddings=64,
    ),
  ),
  'qwen2_bias': dict(family='qwen2', num_key_value_heads=2, tie_word_embeddings=True),
}
HF_CLASSES = {
  'qwen3': ('Qwen3Config', 'Qwen3ForCausalLM'),
  'moe': ('Qwen3MoeConfig', 'Qwen3MoeForCausalLM'),
  'llama': ('LlamaConfig', 'LlamaForCausalLM'),
  'qwen2': ('Qwen2Config', 'Qwen2ForCausalLM'),
}


def family(case: str) -> str:
  return CASES[case].get('family', 'moe' if 'num_experts' in CASES[case] else 'qwen3')


def build_hf_model(case: str, seed: int = 0):
  kwargs = {**BASE, **CASES[case]}
  kwargs.pop('family', None)
  torch.manual_seed(seed)
  config_cls, model_cls = (getattr(transformers, n) for n in HF_CLASSES[family(case)])
  if family(case) == 'moe':
    # The eager expert loop: torch's grouped matmul needs 16-byte strides our odd sizes lack.
    kwargs['experts_implementation'] = 'eager'
  model = model_cls(config_cls(**kwargs))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith('norm.weight'):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.15 * torch.randn_like(p))
  return model.eval()


def test_families_load_with_their_switches(saved):
  case, _, path = saved
  cfg = js.load_target(path).cfg
  assert cfg.qk_norm == (family(case) in ('qwen3', 'moe'))
  assert cfg.attention_bias == (family(case) == 'qwen2')
  assert (cfg.rope_scaling is not None) == (case == 'llama3_rope_gqa')


def test_llama3_rope_scaling_matters():
  """The scaled case would fail without the scaling: the check can see it."""
  model = build_hf_model('llama3_rope_gqa')
  ids = js.testing.random_ids(1, (1, 40), BASE['vocab_size'])
  want, _ = hf_outputs(model, ids)
  cfg = js.hf_io.config_from_hf(model.config.to_dict())
  tensors = {k: v.numpy() for k, v in model.state_dict().items()}
  unscaled = dataclasses.replace(cfg, rope_scaling=None)
  target = js.Target(cfg=unscaled, params=js.hf_io.params_from_hf(tensors, unscaled))
  assert np.abs(np.asarray(target.forward_logits(ids)) - want).max() > 100 * TOL


def hf_outputs(model, ids: np.ndarray):
  with torch.no_grad():
    out = model(torch.from_numpy(ids).long(), output_hidden_states=True)
  return out.logits.numpy(), [h.numpy() for h in out.hidden_states]


@pytest.fixture(scope='module', params=sorted(CASES))
def saved(request, tmp_path_factory):
  path = tmp_path_factory.mktemp(request.param)
  model = build_hf_model(request.param)
  model.save_pretrained(path)
  return request.param, model, path


def test_logits_match_transformers(saved):
  case, model, path = saved
  target = js.load_target(path)
  ids = js.testing.random_ids(1, (2, 13), target.cfg.vocab_size)
  want, _ = hf_outputs(model, ids)
  got = np.asarray(target.forward_logits(ids))
  diff = np.abs(got - want).max()
  print(f'parity {case}: max |logit diff| = {diff:.3g} (logit scale {np.abs(want).max():.3g})')
  assert np.abs(want).max() > 1.0  # the comparison is not between near-zero numbers
  assert diff <= TOL


def test_taps_match_hidden_states(saved):
  _, model, path = saved
  target = js.load_target(path)
  ids = js.testing.random_ids(2, (1, 11), target.cfg.vocab_size)
  _, hidden = hf_outputs(model, ids)
  taps = (0, 1)
  out = target.forward(ids, target.make_cache(1, 16), taps=taps)
  want = np.concatenate([hidden[i + 1] for i in taps], axis=-1)
  np.testing.assert_allclose(np.asarray(out.taps), want, atol=TOL, rtol=0)


def test_save_then_transformers_load(saved, tmp_path):
  case, model, path = saved
  target = js.load_target(path)
  js.save_target(target, tmp_path / 'roundtrip')
  cls = getattr(transformers, HF_CLASSES[family(case)][1])
  kwargs = {'experts_implementation': 'eager'} if family(case) == 'moe' else {}
  reloaded = cls.from_pretrained(tmp_path / 'roundtrip', **kwargs).eval()
  ids = js.testing.random_ids(3, (1, 10), target.cfg.vocab_size)
  want, _ = hf_outputs(model, ids)
  got, _ = hf_outputs(reloaded, ids)
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  again = js.load_target(tmp_path / 'roundtrip')
  np.testing.assert_allclose(np.asarray(again.forward_logits(ids)), want, atol=TOL, rtol=0)


def test_sharded_and_fused_expert_layouts(tmp_path):
  """A sharded index with experts stored fused ([E, 2f, D] / [E, D, f]) loads the same."""
  model = build_hf_model('moe', seed=1)
  model.save_pretrained(tmp_path / 'ref')
  ref = js.load_target(tmp_path / 'ref')
  tensors = js.hf_io.read_tensors(tmp_path / 'ref')
  cfg = ref.cfg
  for i in range(cfg.num_hidden_layers):
    if not cfg.is_sparse_layer(i):
      continue
    hp = f'model.layers.{i}.mlp.experts'
    gate = [tensors.pop(f'{hp}.{e}.gate_proj.weight') for e in range(cfg.num_experts)]
    up = [tensors.pop(f'{hp}.{e}.up_proj.weight') for e in range(cfg.num_experts)]
    down = [tensors.pop(f'{hp}.{e}.down_proj.weight') for e in range(cfg.num_experts)]
    tensors[f'{hp}.gate_up_proj'] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])
    tensors[f'{hp}.down_proj'] = np.stack(down)
  out = tmp_path / 'fused'
  js.hf_io.write_tensors(tensors, out, max_shard_bytes=20_000)
  (out / 'config.json').write_text((tmp_path / 'ref' / 'config.json').read_text())
  assert len(json.loads((out / 'model.safetensors.index.json').read_text())['weight_map'])
  fused = js.load_target(out)
  ids = js.testing.random_ids(4, (1, 9), cfg.vocab_size)
  np.testing.assert_allclose(
    np.asarray(fused.forward_logits(ids)), np.asarray(ref.forward_logits(ids)), atol=1e-6, rtol=0
  )
