"""Each experiment binary's entry point runs end to end on its tiny config."""

from experiments import demo
from experiments.configs import demo as demo_config


def test_demo_runs_on_tiny_config():
  results = demo.run(demo_config.get_config('tiny'))
  assert set(results) == {'ar', 'chain', 'tree'}
  assert results['ar']['tokens'] == 8 and all(r['tps'] > 0 for r in results.values())


def test_tree_attention_benchmark_runs_on_tiny_config(tmp_path):
  from experiments import benchmark_tree_attention
  from experiments.configs import tree_attention

  result = benchmark_tree_attention.run(tree_attention.get_config('tiny'), str(tmp_path))
  assert len(result['rows']) == 2 and all(r['kernel_ms'] > 0 for r in result['rows'])
  assert list(tmp_path.glob('tree_attention_*.json')) and list(tmp_path.glob('*.md'))


def test_generate_data_binary_runs_and_resumes(tmp_path):
  from experiments import generate_data
  from experiments.configs import draft_tiny

  config = draft_tiny.get_config('runlocal')
  paths = generate_data.run(config, str(tmp_path))
  assert len(paths) == 1 and paths[0].exists()
  stamp = paths[0].stat().st_mtime_ns
  assert generate_data.run(config, str(tmp_path))[0].stat().st_mtime_ns == stamp


def test_qwen3_8b_recipe_config():
  from experiments.configs import draft_qwen3_8b

  config = draft_qwen3_8b.get_config()
  assert tuple(config.head.target_layer_ids) == (1, 9, 17, 25, 33)
  assert config.head.block_size == 16 and config.head.num_layers == 5
  assert config.train.num_anchors == 512 and config.train.lr == 3e-4
  assert config.train.loss == 'fkl'
