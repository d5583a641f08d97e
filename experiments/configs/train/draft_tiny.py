"""Train a tiny JetSpec head on a tiny random target's own (self-distilled) outputs.

Run:
  python -m experiments.train --config=experiments/configs/train/draft_tiny.py --workdir=/tmp/draft
  python -m experiments.train --config=experiments/configs/train/draft_tiny.py:runlocal \
      --workdir=/tmp/draft_local       # smaller; what the test suite runs
`result.json` in the workdir records tau before and after training.
"""

import ml_collections


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  config.target = ml_collections.ConfigDict(
    dict(
      path='', preset='tiny', seed=0, param_scale=1.0, overrides={'vocab_size': 97}, dtype='auto'
    )
  )
  config.head = ml_collections.ConfigDict(
    dict(
      num_layers=1,
      block_size=6,
      causal=True,
      target_layer_ids=(0, 2),
      intermediate_size=0,
      mask_token_id=None,
      init_from_target_layers=False,  # start head layers as copies of the target's last layers
    )
  )
  config.data = ml_collections.ConfigDict(
    dict(
      dir='',
      prompts='random',
      num_prompts=96,
      prompt_len=(4, 12),
      prompt_seed=0,
      max_new_tokens=40,
      max_len=56,
      shard_size=32,
      generate_batch=32,
      temperature=0.0,
      regenerate_missing=False,
    )
  )
  config.train = ml_collections.ConfigDict(
    dict(
      num_anchors=16,
      loss='fkl',
      temperature=1.0,
      gamma=0.0,
      loss_chunk=16,
      global_batch=8,
      steps=300,
      lr=3e-3,
      warmup_steps=20,
      weight_decay=0.0,
      grad_clip=1.0,
      log_every=25,
      checkpoint_every=100,
      init_from='',
      stop_after=None,
      micro_batches=1,  # the global batch as accumulated slices (memory; same step)
      anchor_chunk=0,  # a sequence's anchors this many at a time (memory; 0: all at once)
    )
  )
  # The device mesh (sharding.py): tensor parallel over 'model' (the target and the head, by the
  # inference partition rules), data parallel over the remaining devices; fsdp also splits
  # every weight and optimizer moment over 'data'.
  config.mesh = ml_collections.ConfigDict(dict(model=1, fsdp=False))
  config.eval = ml_collections.ConfigDict(
    dict(num_prompts=8, max_new_tokens=32, method=dict(name='tree', budget=16, width=4))
  )
  if arg == 'runlocal':
    config.data.num_prompts = 32
    config.train.steps = 120
    config.train.log_every = 20
    config.train.checkpoint_every = 60
    config.eval.num_prompts = 6
  return config
