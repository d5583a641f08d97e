"""Each experiment binary's entry point runs end to end on its tiny config."""

from experiments import demo
from experiments.configs import demo as demo_config


def test_demo_runs_on_tiny_config():
  summary = demo.run(demo_config.get_config('tiny'))
  assert summary['tokens'] == 8 and summary['tokens_per_s'] > 0
