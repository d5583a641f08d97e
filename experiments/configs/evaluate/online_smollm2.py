"""Online adaptation of the shipped JetSpec head on public prompt streams (docs/training.md §9).

  python -m experiments.evaluate --task=online \
      --config=experiments/configs/evaluate/online_smollm2.py \
      --workdir=benchmarks/online

Each stream is a seeded sequence of public prompts (jetspec_jax/evaluation/prompt_sets.py). The
target's greedy responses (what serving them returns) are generated once; the adapter observes
the first half of a stream in order, updating as it goes (the learning curve: each prompt's tau
with the head of that moment, before it is observed), and the second half, never adapted on, is
walked with the frozen and the adapted head. ``:only_<stream>``: one stream (processes side by
side each take one); ``:tiny``: a few short prompts (tests).
"""

import ml_collections

# name -> ((set, prompts), ...) and the order: 'shuffle' (seeded) or 'concat' (a shift).
STREAMS = (
  ('gsm8k', (('gsm8k', 128),), 'shuffle'),
  ('code', (('humaneval', 64), ('mbpp', 64)), 'shuffle'),
  ('chat', (('mtbench', 80), ('alpacaeval', 48)), 'shuffle'),
  (
    'mixed',
    (('gsm8k', 32), ('humaneval', 16), ('mbpp', 16), ('mtbench', 32), ('alpacaeval', 32)),
    'shuffle',
  ),
  ('shifting', (('alpacaeval', 32), ('mtbench', 32), ('gsm8k', 64)), 'concat'),
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.target = 'smollm2_135m_instruct'
  config.head = 'assets/jetspec_head_smollm2_135m'
  config.head_compute_dtype = 'bfloat16'  # drafting (walks and serving); training is float32
  config.streams = [[name, [list(s) for s in sets], order] for name, sets, order in STREAMS]
  config.seed = 0
  config.max_new_tokens = 256
  config.batch_size = 16
  config.methods = [
    {'name': 'chain'},
    {'name': 'tree', 'budget': 16, 'width': 7, 'algorithm': 'best_first'},
    {'name': 'tree', 'budget': 128, 'width': 7, 'algorithm': 'best_first'},
  ]
  # The bounds stage: adapting harder on these streams (no rollback, bound_steps at once).
  config.bound_streams = ['gsm8k', 'chat']
  config.bound_steps = 256
  config.curve_method = 1  # the learning curve's method (index into methods): tree 16
  config.window = 16  # prompts per point of the learning curve
  config.online = ml_collections.ConfigDict(
    dict(
      update_every=8,
      steps=16,
      batch_size=4,
      num_anchors=32,
      lr=3e-4,
      buffer_size=128,
      holdout_every=4,
      holdout_size=16,
      tolerance=0.0,
      max_len=1024,
      gamma=4.0,
      features='cache',
      seed=0,
    )
  )
  # Real serving with updates on the first prompts of the first stream: js.generate's wall time
  # against the updates' (0: none).
  config.serve_prompts = 16
  config.serve_max_new_tokens = 128
  config.cache_dir = ''
  if arg and arg.startswith('only_'):  # e.g. 'only_chat': one stream (processes side by side)
    names = arg.removeprefix('only_').split('_and_')
    config.streams = [s for s in config.streams if s[0] in names]
    if len(config.streams) != len(names):
      raise ValueError(f'unknown stream in {arg!r}; streams: {[s[0] for s in STREAMS]}')
  if arg == 'tiny':  # the real model, a few short responses (tests)
    config.streams = [['gsm8k', [['gsm8k', 4]], 'shuffle']]
    config.max_new_tokens = 16
    config.batch_size = 4
    config.methods = [
      {'name': 'chain'},
      {'name': 'tree', 'budget': 8, 'width': 7, 'algorithm': 'best_first'},
    ]
    config.window = 1
    config.online.update(
      update_every=1, steps=2, batch_size=2, num_anchors=4, max_len=320, holdout_every=2
    )
    config.bound_steps = 2
    config.serve_prompts = 2
    config.serve_max_new_tokens = 8
  return config
