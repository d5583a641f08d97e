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
