"""Each experiment binary's entry point runs end to end on its tiny config."""

from experiments import demo
from experiments.configs import demo as demo_config


def test_demo_runs_on_tiny_config():
  results = demo.run(demo_config.get_config('tiny'))
  assert set(results) == {'ar', 'chain', 'tree'}
  assert results['ar']['tokens'] == 8 and all(r['tps'] > 0 for r in results.values())
