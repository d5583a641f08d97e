"""The main job: generate with a Qwen3-architecture target and report timing.

python -m experiments.demo [--config=experiments/configs/demo.py[:tiny]]
"""

import time

import jax
import numpy as np
from absl import app, logging
from ml_collections import config_flags

import jetspec_jax as js

_CONFIG = config_flags.DEFINE_config_file(
  'config', 'experiments/configs/demo.py', 'Demo configuration.'
)


def run(config) -> dict:
  cfg = js.Qwen3Config(**config.target.to_dict())
  params = js.qwen3.init_params(cfg, jax.random.key(config.seed))
  target = js.Target(cfg=cfg, params=params)
  print(
    f'target: random Qwen3, {js.qwen3.count_params(params) / 1e6:.2f}M params, '
    f'{cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}'
  )
  prompts = [
    js.testing.random_ids(config.seed + i, (config.prompt_len,), cfg.vocab_size)
    for i in range(config.num_prompts)
  ]
  start = time.perf_counter()
  js.generate(target, None, prompts[0], max_new_tokens=config.max_new_tokens)
  compile_s = time.perf_counter() - start
  print(f'compile + first run: {compile_s:.2f}s')
  total_tokens, total_s = 0, 0.0
  for i, prompt in enumerate(prompts):
    out = js.generate(target, None, prompt, max_new_tokens=config.max_new_tokens)
    # Lossless check of the cached decode: each token is the argmax of a full forward.
    seq = np.concatenate([prompt, out.tokens])[None]
    full = np.asarray(target.logits(seq))[0, len(prompt) - 1 : -1].argmax(-1)
    assert (full == out.tokens).all(), 'cached decode disagrees with the full forward'
    total_tokens += out.stats.new_tokens
    total_s += out.stats.wall_s
    print(
      f'prompt {i}: {out.stats.new_tokens} tokens in {out.stats.wall_s * 1e3:.1f} ms '
      f'({out.stats.tokens_per_s:.0f} tok/s); first tokens {out.tokens[:12].tolist()}'
    )
  summary = dict(
    method='ar',
    tokens=total_tokens,
    wall_s=total_s,
    tokens_per_s=total_tokens / total_s,
    compile_s=compile_s,
  )
  print(
    f'ar: {summary["tokens_per_s"]:.0f} tok/s over {total_tokens} tokens '
    '(greedy output checked against full forwards)'
  )
  return summary


def main(argv):
  del argv
  logging.info('JAX %s on %s', jax.__version__, jax.devices())
  run(_CONFIG.value)


if __name__ == '__main__':
  app.run(main)
