"""The public benchmark table of SmolLM2-135M-Instruct and its shipped heads (docs/results.md).

  python -m experiments.evaluate --config=experiments/configs/evaluate/public_smollm2.py \
      --workdir=benchmarks/public

Greedy responses of the target to the public prompt sets (jetspec_jax/evaluation/prompt_sets.py)
up to ``max_new_tokens``, then every drafter x method walked along them
(jetspec_jax/evaluation/tree_walk.py). ``:tiny``: a few short responses, one head (tests).
``:retrained``: the JetSpec head continued on the public-chat data
(experiments/configs/train/draft_smollm2.py:jetspec_public), walked along the first 32 responses
of each set of benchmarks/public and shown beside the shipped head on the same records:

  python -m experiments.evaluate --config=experiments/configs/evaluate/public_smollm2.py:retrained \
      --workdir=benchmarks/public_retrained --stages=walk,render

``:block16``: the same continuation drafting blocks of 16, beside the blocks-of-8 head on the
same records (its baseline is ``benchmarks/public_retrained``), workdir
``benchmarks/public_block16``. ``:dflash_block16``: the DFlash-style head continued the same way
at blocks of 16, beside the JetSpec one on the same records (baseline
``benchmarks/public_block16``), workdir ``benchmarks/causal_vs_bidirectional``.
``:jetspecpp_block16`` and ``:dspark_block16``: those two heads continued the same way, beside
the shipped ones (workdirs ``benchmarks/public_block16/jetspecpp`` and ``.../dspark``).
``:block16_file`` and ``:dflash_block16_file``: the shipped bfloat16 files of the
blocks-of-16 JetSpec and DFlash-style heads beside their walked float32 exports, 4 records a set
(workdirs ``benchmarks/public_block16/file_jetspec`` and ``.../file_dflash``).
"""

import ml_collections

# (set, prompts drawn with ``seed``; None: all of them)
SAMPLES = (
  ('gsm8k', 128),
  ('math500', 128),
  ('aime2024', None),
  ('aime2025', None),
  ('humaneval', None),
  ('mbpp', 128),
  ('mtbench', None),  # 80 questions x 2 turns
  ('alpacaeval', 128),
)

HEADS = (
  ('jetspec', 'assets/jetspec_head_smollm2_135m'),
  ('dflash', 'assets/dflash_head_smollm2_135m'),
  ('jetspecpp', 'assets/jetspecpp_head_smollm2_135m'),
  ('dspark', 'assets/dspark_head_smollm2_135m'),
)

# Method configs (js.methods.from_config) walked for every head that runs them; 'copy' is the
# copy drafter alone (prompt lookup, no head).
METHODS = (
  {'name': 'chain'},
  {'name': 'tree', 'budget': 8, 'width': 7, 'algorithm': 'best_first'},
  {'name': 'tree', 'budget': 16, 'width': 7, 'algorithm': 'best_first'},
  {'name': 'tree', 'budget': 128, 'width': 7, 'algorithm': 'best_first'},
  {'name': 'tree', 'budget': 128, 'width': 7, 'algorithm': 'accum_logp'},
)


def _beside(config, kind, head, baseline, labels=None, walk_per_set=32) -> None:
  """One head walked along benchmarks/public's stored responses (the first ``walk_per_set`` of
  each set) beside the baseline workdir's walks of the same records; no docs page of its own."""
  config.heads = [[kind, head]]
  config.copy_drafter = False
  config.responses_from = 'benchmarks/public'
  config.baseline = baseline
  if labels:
    config.labels = labels
  config.walk_per_set = walk_per_set
  config.docs = ''


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.target = 'smollm2_135m_instruct'  # a packaged model's name, or a GGUF / HF path
  config.samples = [list(s) for s in SAMPLES]
  config.seed = 0
  config.max_new_tokens = 1024
  config.batch_size = 16  # cache rows decoded together, each refilled as its response ends
  config.round_batches = 16  # prompts per round (x batch_size); second turns follow each round
  config.heads = [list(h) for h in HEADS]
  config.methods = [dict(m) for m in METHODS]
  # Heads draft with bfloat16-input projections (DraftHead.with_compute_dtype): the draft scores
  # only, so output is unchanged; the walk runs ~several times faster on a CPU with AMX, and
  # re-decoding a record uses the same setting (each record names it).
  config.head_compute_dtype = 'bfloat16'
  config.copy_drafter = True  # also walk the copy drafter alone (copy_len = the block)
  config.copy_ngram = 4
  config.training_data = 'data/smollm2_135m/data'  # checked for overlap with the prompts
  config.cache_dir = ''  # the packages' cache ('' -> ~/.cache/jetspec_jax/public_sets)
  # The 'check' stage re-decodes this many walked records with js.generate (every drafter and
  # method of each), drawn among those of at most check_max_tokens new tokens.
  config.check_prompts = 2
  config.check_max_tokens = 256
  config.docs = 'docs/results.md'  # the rendered table ('': none)
  # A workdir walking another's responses (no responses stage of its own), the first
  # walk_per_set of each set (0: all), its results beside the baseline workdir's walks
  config.responses_from = ''
  config.walk_per_set = 0
  config.baseline = ''
  config.labels = ['shipped', 'continued']  # the baseline's head and this one, in before/after
  config.baseline_drafter = ''  # the baseline's drafter beside each head ('': the same name)
  if arg == 'retrained':
    _beside(config, 'jetspec', 'runs/jetspec_public/export', 'benchmarks/public')
  if arg == 'block16':
    # The same continuation with blocks of 16 (draft_smollm2.py:jetspec_public at
    # head.block_size=16, num_anchors=16: equal slots a step), beside the blocks-of-8 one
    head = 'runs/jetspec_public_b16/export'
    _beside(config, 'jetspec', head, 'benchmarks/public_retrained', ['block 8', 'block 16'])
  if arg == 'dflash_block16':
    # The DFlash-style (bidirectional) twin of the blocks-of-16 JetSpec head: same data, steps
    # and slots (draft_smollm2.py:dflash_public at head.block_size=16, num_anchors=16, 600
    # steps), beside it on the same records
    head, labels = 'runs/dflash_public_b16_600/export', ['causal', 'bidirectional']
    _beside(config, 'dflash', head, 'benchmarks/public_block16', labels)
    config.baseline_drafter = 'jetspec'
  if arg in ('jetspecpp_block16', 'dspark_block16'):
    # The JetSpec++ or DSpark head continued at the same recipe as the blocks-of-16 pair
    # (draft_smollm2.py:<head>_public_b16), its shipped bfloat16 file walked beside the shipped
    # head it continues
    kind = arg.removesuffix('_block16')
    head = f'assets/{kind}_head_smollm2_135m_b16'
    _beside(config, kind, head, 'benchmarks/public', ['shipped', 'block 16'])
  if arg in ('block16_file', 'dflash_block16_file'):
    # The shipped bfloat16 file of a blocks-of-16 head beside the float32 export that was
    # walked (its workdir the baseline), on the first 4 records of each set: does the cast
    # change a round?
    kind = 'dflash' if arg.startswith('dflash') else 'jetspec'
    baseline = {
      'jetspec': 'benchmarks/public_block16',
      'dflash': 'benchmarks/causal_vs_bidirectional',
    }[kind]
    head, labels = f'assets/{kind}_head_smollm2_135m_b16', ['float32 export', 'bfloat16 file']
    _beside(config, kind, head, baseline, labels, walk_per_set=4)
  if arg == 'tiny':  # a few short responses, one head (tests)
    config.samples = [['humaneval', 1], ['mtbench', 1]]
    config.max_new_tokens = 24
    config.batch_size = 2
    config.round_batches = 1
    config.heads = [['jetspec', 'assets/jetspec_head_smollm2_135m']]
    config.methods = [
      {'name': 'chain'},
      {'name': 'tree', 'budget': 8, 'width': 7, 'algorithm': 'best_first'},
    ]
    config.check_prompts = 4
  return config
