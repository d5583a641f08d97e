"""The main job: generate with AR, chain and tree decoding, check losslessness, report timing.

  python -m experiments.demo [--config=experiments/configs/demo.py[:tiny]]

Until the embedded default exists (assets/), the target is a random Qwen3-architecture model and
the draft head is random too, so tau is near 1: this shows the machinery and its exactness, not a
speedup.
"""

import time

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

import jetspec_jax as js


def run(config) -> dict:
  cfg = js.Qwen3Config(**config.target.to_dict())
  target = js.Target(cfg=cfg, params=js.qwen3.init_params(cfg, jax.random.key(config.seed)))
  head = js.draft_head.random_draft_head(
    target, block_size=config.block_size, num_layers=config.head_layers, seed=config.seed + 1
  )
  print(
    f'target: random Qwen3, {js.qwen3.count_params(target.params) / 1e6:.2f}M params, '
    f'{cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}; random draft head, '
    f'{js.qwen3.count_params(head.params) / 1e6:.2f}M params, block {config.block_size}'
  )
  prompts = [
    js.testing.random_ids(config.seed + i, (config.prompt_len,), cfg.vocab_size)
    for i in range(config.num_prompts)
  ]
  methods = {
    'ar': dict(method='ar'),
    'chain': dict(method='chain'),
    'tree': dict(method='tree', budget=config.budget, width=config.width),
  }
  results, reference = {}, None
  for name, kwargs in methods.items():
    run_head = None if name == 'ar' else head
    start = time.perf_counter()
    js.generate(target, run_head, prompts[0], max_new_tokens=config.max_new_tokens, **kwargs)
    compile_s = time.perf_counter() - start
    outs = [
      js.generate(target, run_head, p, max_new_tokens=config.max_new_tokens, **kwargs)
      for p in prompts
    ]
    tokens = [o.tokens for o in outs]
    if reference is None:
      reference = tokens
    assert all(np.array_equal(a, b) for a, b in zip(tokens, reference)), f'{name} != ar'
    wall = sum(o.stats.wall_s for o in outs)
    results[name] = dict(
      tokens=sum(o.stats.new_tokens for o in outs),
      wall_s=wall,
      tps=sum(o.stats.new_tokens for o in outs) / wall,
      tau=float(np.mean(np.concatenate([o.stats.tau for o in outs]))),
      compile_s=compile_s,
    )
  base = results['ar']['wall_s']
  print(f'\n{"method":8s} {"tau":>6s} {"tok/s":>8s} {"speedup":>8s} {"compile s":>10s}')
  for name, r in results.items():
    r['speedup'] = base / r['wall_s']
    print(f'{name:8s} {r["tau"]:6.2f} {r["tps"]:8.0f} {r["speedup"]:7.2f}x {r["compile_s"]:10.2f}')
  print(f'\ngreedy outputs identical across methods on {len(prompts)} prompts')
  print(f'first completion: {reference[0][:16].tolist()}')
  return results


def main(argv):
  del argv
  logging.info('JAX %s on %s', jax.__version__, jax.devices())
  run(flags.FLAGS.config)


if __name__ == '__main__':
  # Flags are defined only when run as a binary, so tests can import several binaries.
  config_flags.DEFINE_config_file('config', 'experiments/configs/demo.py', 'Demo configuration.')
  app.run(main)
