"""Checkpoint I/O without torch: round trips and clear errors on bad directories."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax as js
from jetspec_jax.models import hf_io


@pytest.fixture(scope='module', params=['dense', 'moe'])
def saved(request, tmp_path_factory):
  target = js.testing.tiny_target(3, moe=request.param == 'moe')
  path = tmp_path_factory.mktemp(request.param)
  js.save_target(target, path)
  return target, path


def copy(src, tmp_path):
  dst = tmp_path / 'ckpt'
  shutil.copytree(src, dst)
  return dst


def test_round_trip_is_exact(saved):
  target, path = saved
  loaded = js.load_target(path)
  assert loaded.cfg == target.cfg
  jax.tree.map(
    lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
    loaded.params,
    target.params,
  )


def test_sharded_round_trip(saved, tmp_path):
  target, _ = saved
  js.save_target(target, tmp_path, max_shard_bytes=50_000)
  index = json.loads((tmp_path / hf_io.INDEX_FILE).read_text())
  assert len(set(index['weight_map'].values())) > 1
  assert not (tmp_path / hf_io.SINGLE_FILE).exists()
  ids = js.testing.random_ids(0, (1, 6), target.cfg.vocab_size)
  np.testing.assert_array_equal(
    np.asarray(js.load_target(tmp_path).forward_logits(ids)), np.asarray(target.forward_logits(ids))
  )


def test_bfloat16_load(saved):
  target, path = saved
  bf16 = js.load_target(path, dtype=jnp.bfloat16)
  assert bf16.dtype == jnp.bfloat16
  ids = js.testing.random_ids(0, (1, 6), target.cfg.vocab_size)
  np.testing.assert_allclose(
    np.asarray(bf16.forward_logits(ids)), np.asarray(target.forward_logits(ids)), atol=0.1
  )


def test_missing_directory_and_files(saved, tmp_path):
  _, path = saved
  with pytest.raises(FileNotFoundError, match='does not exist'):
    js.load_target(tmp_path / 'nope')
  ckpt = copy(path, tmp_path)
  (ckpt / 'model.safetensors').unlink()
  with pytest.raises(FileNotFoundError, match='no model.safetensors'):
    js.load_target(ckpt)
  (ckpt / 'config.json').unlink()
  with pytest.raises(FileNotFoundError, match='no config.json'):
    js.load_target(ckpt)


def test_missing_unexpected_and_misshapen_tensors(saved, tmp_path):
  _, path = saved
  tensors = hf_io.read_tensors(path)
  ckpt = copy(path, tmp_path)

  def write(t):
    hf_io.write_tensors(t, ckpt)

  name = 'model.layers.1.self_attn.k_norm.weight'
  write({k: v for k, v in tensors.items() if k != name})
  with pytest.raises(js.CheckpointError, match=f'missing tensor {name}'):
    js.load_target(ckpt)
  write({**tensors, 'model.layers.9.extra.weight': np.zeros(3, np.float32)})
  with pytest.raises(js.CheckpointError, match='unexpected tensor model.layers.9.extra.weight'):
    js.load_target(ckpt)
  name = 'model.layers.0.self_attn.q_proj.weight'
  write({**tensors, name: tensors[name][:-1]})
  with pytest.raises(js.CheckpointError, match=f'shape mismatch for {name}'):
    js.load_target(ckpt)


def test_missing_expert_tensor(tmp_path):
  target = js.testing.tiny_target(0, moe=True)
  js.save_target(target, tmp_path)
  tensors = hf_io.read_tensors(tmp_path)
  name = 'model.layers.2.mlp.experts.4.up_proj.weight'
  del tensors[name]
  hf_io.write_tensors(tensors, tmp_path)
  with pytest.raises(js.CheckpointError, match=f'missing tensor {name}'):
    js.load_target(tmp_path)


def test_corrupt_and_partial_files(saved, tmp_path):
  _, path = saved
  ckpt = copy(path, tmp_path)
  data = (ckpt / 'model.safetensors').read_bytes()
  (ckpt / 'model.safetensors').write_bytes(data[: len(data) // 2])
  with pytest.raises(js.CheckpointError, match='cannot read'):
    js.load_target(ckpt)
  (ckpt / 'config.json').write_text('{"model_type": ')
  with pytest.raises(js.CheckpointError, match='not valid JSON'):
    js.load_target(ckpt)


def test_partial_sharded_checkpoint(saved, tmp_path):
  target, _ = saved
  js.save_target(target, tmp_path, max_shard_bytes=50_000)
  shard = sorted(tmp_path.glob('model-*.safetensors'))[-1]
  shard.unlink()
  with pytest.raises(js.CheckpointError, match=f'shard {shard.name} .* is missing'):
    js.load_target(tmp_path)


def test_unsupported_architecture(saved, tmp_path):
  _, path = saved
  ckpt = copy(path, tmp_path)
  config = json.loads((ckpt / 'config.json').read_text())
  config.update(architectures=['MistralForCausalLM'], model_type='mistral')
  (ckpt / 'config.json').write_text(json.dumps(config))
  with pytest.raises(js.CheckpointError, match='unsupported architecture'):
    js.load_target(ckpt)
  config.update(
    architectures=['Qwen3ForCausalLM'],
    model_type='qwen3',
    rope_parameters={'rope_type': 'yarn', 'factor': 4.0, 'rope_theta': 1e6},
  )
  (ckpt / 'config.json').write_text(json.dumps(config))
  with pytest.raises(js.CheckpointError, match="rope_type 'yarn' is not supported"):
    js.load_target(ckpt)


def test_config_reads_legacy_rope_theta():
  hf = hf_io.config_to_hf(js.decoder.tiny())
  del hf['rope_parameters']
  hf['rope_theta'] = 12345.0
  assert hf_io.config_from_hf(hf).rope_theta == 12345.0


def test_a_hub_model_id_resolves_through_the_local_cache(saved, tmp_path, monkeypatch):
  """``load_target('org/name')`` finds the model in a Hugging Face cache laid out as the hub
  writes it (models--org--name/refs/main -> snapshots/<commit>/), offline; an id that is not
  cached is a FileNotFoundError saying where it looked and how to download it."""
  constants = pytest.importorskip('huggingface_hub.constants')
  target, path = saved
  cache = tmp_path / 'hub'
  commit = '0123456789abcdef0123456789abcdef01234567'
  repo = cache / 'models--tiny-org--tiny-model'
  shutil.copytree(path, repo / 'snapshots' / commit)
  (repo / 'refs').mkdir()
  (repo / 'refs' / 'main').write_text(commit)
  monkeypatch.setattr(constants, 'HF_HUB_CACHE', str(cache))
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')
  monkeypatch.chdir(tmp_path)  # 'tiny-org/tiny-model' is no local path here
  loaded = js.load_target('tiny-org/tiny-model')
  assert loaded.cfg == target.cfg
  with pytest.raises(FileNotFoundError, match=r'not in the local cache .*hub.*huggingface-cli'):
    js.load_target('tiny-org/other-model')
