"""The embedded default's two heads: JetSpec (causal) and DFlash-style (bidirectional).

Run (after experiments/configs/train/target_code_small.py has produced assets/target_code_small):
  python -m experiments.data --config=experiments/configs/train/draft_code_small.py:jetspec \
      --workdir=runs/heads_data
  python -m experiments.train --config=experiments/configs/train/draft_code_small.py:jetspec \
      --config.data.dir=runs/heads_data/data --workdir=runs/jetspec_head
  python -m experiments.train --config=experiments/configs/train/draft_code_small.py:dflash \
      --config.data.dir=runs/heads_data/data --workdir=runs/dflash_head
  cp runs/jetspec_head/export/* assets/jetspec_head_code_small/
  cp runs/dflash_head/export/* assets/dflash_head_code_small/
Both heads train on the same self-distilled data: the target's greedy continuations of function
signatures + docstrings cut from the standard library's training split (never the held-out
modules or HumanEval); 500 steps each. Their cards: assets/{jetspec,dflash}_head_code_small/.
"""

import ml_collections

from experiments.configs.train import draft_tiny
from jetspec_jax import corpus


def get_config(arg: str | None = 'jetspec') -> ml_collections.ConfigDict:
  config = draft_tiny.get_config()
  config.target = ml_collections.ConfigDict(
    dict(
      path='assets/target_code_small',
      preset='',
      seed=0,
      param_scale=1.0,
      overrides={},
      dtype='auto',
    )
  )
  config.head = ml_collections.ConfigDict(
    dict(
      num_layers=2,
      block_size=8,
      causal=arg != 'dflash',
      target_layer_ids=(1, 3, 4),
      intermediate_size=0,
      mask_token_id=1,  # '<|mask|>' in the embedded tokenizer
      init_from_target_layers=False,  # start head layers as copies of the target's last layers
    )
  )
  config.data.update(
    dir='',
    prompts='stdlib_functions',
    tokenizer='assets/target_code_small',
    num_prompts=320,
    validation_modules=corpus.VALIDATION_MODULES,
    prompt_seed=0,
    max_new_tokens=96,
    max_len=256,
    shard_size=64,
    generate_batch=32,
    temperature=0.0,
  )
  config.train.update(
    num_anchors=32,
    loss='fkl',
    temperature=1.0,
    gamma=0.0,
    loss_chunk=32,
    global_batch=8,
    steps=500,
    lr=2e-3,
    warmup_steps=25,
    log_every=25,
    checkpoint_every=100,
  )
  config.eval.update(num_prompts=8, max_new_tokens=64)
  config.eval.method = ml_collections.ConfigDict(dict(name='tree', budget=32, width=7))
  return config
