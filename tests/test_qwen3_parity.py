"""Parity with Hugging Face transformers on tiny random Qwen3 and Qwen3-MoE models.

Models are built offline from a config with a fixed seed, their weights perturbed so that every
tensor (norm scales included) matters, saved with ``save_pretrained`` and loaded with
``js.load_target``. Max |logit diff| must stay <= 1e-4 in float32.
"""

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
}


def build_hf_model(case: str, seed: int = 0):
  kwargs = {**BASE, **CASES[case]}
  torch.manual_seed(seed)
  if 'num_experts' in kwargs:
    # The eager expert loop: torch's grouped matmul needs 16-byte strides our odd sizes lack.
    config = transformers.Qwen3MoeConfig(**kwargs, experts_implementation='eager')
    model = transformers.Qwen3MoeForCausalLM(config)
  else:
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kwargs))
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith('norm.weight'):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.15 * torch.randn_like(p))
  return model.eval()


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
  got = np.asarray(target.logits(ids))
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
  cls = transformers.Qwen3MoeForCausalLM if 'moe' in case else transformers.Qwen3ForCausalLM
  kwargs = {'experts_implementation': 'eager'} if 'moe' in case else {}
  reloaded = cls.from_pretrained(tmp_path / 'roundtrip', **kwargs).eval()
  ids = js.testing.random_ids(3, (1, 10), target.cfg.vocab_size)
  want, _ = hf_outputs(model, ids)
  got, _ = hf_outputs(reloaded, ids)
  np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
  again = js.load_target(tmp_path / 'roundtrip')
  np.testing.assert_allclose(np.asarray(again.logits(ids)), want, atol=TOL, rtol=0)


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
    np.asarray(fused.logits(ids)), np.asarray(ref.logits(ids)), atol=1e-6, rtol=0
  )
