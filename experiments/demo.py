"""The main job: ar vs chain vs tree decoding on the embedded default, lossless and timed.

  python -m experiments.demo [--config=experiments/configs/demo.py[:tiny]] [--workdir=runs/demo]

Loads the target, tokenizer and JetSpec head from assets/, generates greedily for a handful of
HumanEval prompts with each method (after a compile warm-up), checks that the outputs are
identical, prints tau / tokens per second / speedup and the first completion, and writes a plot
of tokens committed per round.
"""

import json
import pathlib

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

import jetspec_jax as js
from jetspec_jax import prompts as prompts_lib
from jetspec_jax.tokenizer import Tokenizer

REBUILD = 'see assets/README.md for the commands that rebuild assets/'


def run(config, workdir: str = 'runs/demo') -> dict:
  for path in (config.target, config.head):
    if not pathlib.Path(path).exists():
      raise FileNotFoundError(f'{path} is missing; {REBUILD}')
  target = js.load_target(config.target)
  head = js.load_draft_head(config.head, target)
  tok = Tokenizer(config.target)
  print(
    f'target: {js.qwen3.count_params(target.params) / 1e6:.2f}M-parameter Qwen3 code model; '
    f'JetSpec head: {js.qwen3.count_params(head.params) / 1e6:.2f}M parameters, block '
    f'{head.cfg.block_size}'
  )
  prompts = [tok.encode(p) for _, p in prompts_lib.humaneval_prompts(config.num_prompts)]
  shapes = js.decoding.shared_shapes(
    prompts, config.max_new_tokens, config.budget + head.cfg.block_size
  )
  methods = {
    'ar': (None, dict(method='ar')),
    'chain': (head, dict(method='chain')),
    'tree': (head, dict(method='tree', budget=config.budget, width=config.width)),
  }
  results, outputs = {}, {}
  for name, (h, kwargs) in methods.items():
    js.generate(target, h, prompts[0], max_new_tokens=config.max_new_tokens, **shapes, **kwargs)
    outs = [
      js.generate(target, h, p, max_new_tokens=config.max_new_tokens, **shapes, **kwargs)
      for p in prompts
    ]
    outputs[name] = outs
    wall = sum(o.stats.wall_s for o in outs)
    tokens = sum(o.stats.new_tokens for o in outs)
    results[name] = dict(
      tau=float(np.mean(np.concatenate([o.stats.tau for o in outs]))),
      tps=tokens / wall,
      wall_s=wall,
      tokens=tokens,
    )
  for name in ('chain', 'tree'):
    for a, b in zip(outputs[name], outputs['ar']):
      if not np.array_equal(a.tokens, b.tokens):
        raise AssertionError(f'{name} output differs from ar: not lossless')
  print(f'\n{"method":8s} {"tau":>6s} {"tok/s":>8s} {"speedup":>8s}')
  for name, r in results.items():
    r['speedup'] = results['ar']['wall_s'] / r['wall_s']
    print(f'{name:8s} {r["tau"]:6.2f} {r["tps"]:8.0f} {r["speedup"]:7.2f}x')
  print(f'\ngreedy outputs of ar, chain and tree are identical on {len(prompts)} HumanEval prompts')
  first = prompts_lib.humaneval_prompts(1)[0][1]
  print(f'\nfirst completion (tree):\n{first}{tok.decode(outputs["tree"][0].tokens)}')
  plot_path = write_plot(outputs, pathlib.Path(workdir), head.cfg.block_size)
  summary = dict(
    config=config.to_dict(),
    device=jax.devices()[0].device_kind,
    versions=dict(jax=jax.__version__, jetspec=js.__version__),
    num_prompts=len(prompts),
    methods=results,
  )
  (pathlib.Path(workdir) / 'demo.json').write_text(json.dumps(summary, indent=2))
  print(f'plot: {plot_path}; numbers: {pathlib.Path(workdir) / "demo.json"}')
  return results


def write_plot(outputs, workdir: pathlib.Path, block_size: int) -> pathlib.Path:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  workdir.mkdir(parents=True, exist_ok=True)
  fig, ax = plt.subplots(figsize=(6, 3.5))
  for name in ('chain', 'tree'):
    taus = np.concatenate([o.stats.tau for o in outputs[name]])
    hist = np.bincount(taus, minlength=block_size + 1)[1:]
    ax.bar(
      np.arange(1, block_size + 1) + (0.2 if name == 'tree' else -0.2),
      hist / hist.sum(),
      width=0.4,
      label=f'{name} (mean tau {taus.mean():.2f})',
    )
  ax.set(
    xlabel='tokens committed per round',
    ylabel='fraction of rounds',
    title='JetSpec on the embedded default',
  )
  ax.legend()
  fig.tight_layout()
  path = workdir / 'demo_tau.png'
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv):
  del argv
  logging.info('JAX %s on %s', jax.__version__, jax.devices())
  run(flags.FLAGS.config, flags.FLAGS.workdir)


if __name__ == '__main__':
  config_flags.DEFINE_config_file('config', 'experiments/configs/demo.py', 'Demo configuration.')
  flags.DEFINE_string('workdir', 'runs/demo', 'Where the plot goes.')
  app.run(main)
