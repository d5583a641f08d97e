"""Heads for SmolLM2-135M-Instruct (the main job's model): JetSpec, DFlash-style, JetSpec++ and
DSpark, one recipe.

Data (once, shared by every head; resumable; hours on 2 CPU cores). The token shards are committed
(``data/smollm2_135m/``, its card says what they hold); the target features are a cache outside
the repository, rebuilt from the tokens the first time a head trains (``data.features_dir``):
  python -m experiments.data --config=experiments/configs/train/draft_smollm2.py \
      --workdir=data/smollm2_135m
Heads: the presets ``jetspec``, ``dflash``, ``jetspecpp`` and ``dspark`` train on prompt round 0
(1,600 steps); ``<head>_shipped`` continues from that head's export for 1,500 steps on rounds
0-2, the shipped heads' recipe (their cards: assets/<head>_head_smollm2_135m/README.md):
  python -m experiments.train --config=experiments/configs/train/draft_smollm2.py:jetspec \
      --workdir=runs/jetspec
  python -m experiments.train --config=experiments/configs/train/draft_smollm2.py:jetspec_shipped \
      --workdir=runs/jetspec_shipped
``public_chat`` is the data of prompts people send (data/public_chat/README.md);
``<head>_public`` continues a shipped head on rounds 0-2 plus that data, ``jetspec_b16`` and
``dflash_b16`` are the first stage with the paper's blocks of 16 (a scaling point at equal
compute), and ``<head>_public_b16`` is the recipe of the heads drafting blocks of 16
(assets/<head>_head_smollm2_135m_b16; the public-chat shards as committed at 9cd5d39).

Prompts are made offline and never include an evaluation prompt: instructions the model writes
itself from its bare user-turn prefix, coding tasks from the standard library's training split,
and templated math word problems (evaluation uses HumanEval, ``EVAL_CHAT_INSTRUCTIONS`` and the
disjoint ``EVAL_MATH_TEMPLATES`` of jetspec_jax/training/chat_prompts.py). Responses are the
target's own: greedy, and sampled at T=1 for every 4th prompt.
"""

import ml_collections

from experiments.configs.train import draft_tiny
from jetspec_jax import corpus
from jetspec_jax.models import model_cache


def get_config(arg: str | None = 'jetspec') -> ml_collections.ConfigDict:
  # '<head>_shipped': the shipped head's second stage, from the first stage's export;
  # '<head>_public': the shipped head continued on rounds 0-2 plus the public-chat data;
  # '<head>_b16': the first stage with blocks of 16 (jetspec, dflash);
  # '<head>_public_b16': '<head>_public' at blocks of 16, the heads in assets/<head>_*_b16
  suffix = next(
    (x for x in ('_shipped', '_public_b16', '_public', '_b16') if arg and arg.endswith(x)), ''
  )
  arg = arg.removesuffix(suffix) if suffix else arg
  shipped = suffix == '_shipped'
  config = draft_tiny.get_config()
  config.target = ml_collections.ConfigDict(
    dict(
      path='', preset='smollm2_135m_instruct', seed=0, param_scale=1.0, overrides={}, dtype='auto'
    )
  )
  config.head = ml_collections.ConfigDict(
    dict(
      num_layers=3,
      block_size=8,
      causal=arg != 'dflash',
      target_layer_ids=(1, 8, 15, 22, 27),
      intermediate_size=0,
      mask_token_id=0,  # '<|endoftext|>': never inside a chat turn, so free to mean MASK
      init_from_target_layers=True,  # start head layers as copies of the target's last layers
      markov_rank=0,
      refine=False,  # a JetSpec++ head (jetspec_jax/methods/jetspecpp.py)
      # > 0: draft slots hold the context's copy candidates (prompt lookup, matches of up to
      # copy_seed tokens) as guessed tokens, in training and drafting (DraftHeadConfig.copy_seed)
      copy_seed=3,
      # A reduced draft vocabulary: the most frequent ids of the generated responses covering
      # 99% of them (15,360 of 49,152 on ~2,300 sequences); the head scores only
      # those, and ships the map as EAGLE-3's d2t/t2d. 0: the whole vocabulary.
      draft_vocab_coverage=0.99,
    )
  )
  config.data = ml_collections.ConfigDict(
    dict(
      dir='data/smollm2_135m/data',  # committed token shards (generate_data's workdir/data)
      features_dir=str(model_cache.cache_dir() / 'features' / 'smollm2_135m'),  # rebuilt cache
      feature_batch=8,
      # 'bfloat16': the cache's forward with bfloat16 matmul inputs, faster with AMX, its labels
      # nearly all equal to the float32 forward's; it needs its own features_dir (e.g.
      # .../smollm2_135m_bf16). Heads trained on either score alike
      # (benchmarks/history/README.md, "feature_dtype").
      features_compute_dtype='float32',
      prompts='chat_mix',
      num_instructions=2400,
      instruction_tokens=96,
      instruction_top_p=1.0,
      num_coding=2000,
      num_math=1200,
      # Prompt rounds generated and trained on: round 0 is the plan above (5,063 prompts, about
      # 1.0M response tokens); round r >= 1 is a fresh plan of the same sizes (its own seed,
      # instructions, the next slice of coding tasks, new math problems; no repeated text) in
      # data/round{r}/ (chat_data.generate_chat_dataset). 2: about 2M response tokens.
      prompt_rounds=1,
      # Each round's prompt mix (the last one for rounds past the tuple): 'chat' is the plan
      # above; 'tasks' (round 2) is the forms of the evaluation prompts, never their content:
      # num_task_requests short templated requests (explain, list, compare, write a short...),
      # num_coding stdlib functions to complete from signature + docstring in a code block, and
      # num_math problems of the training and extra math templates; no self-written stage.
      round_mixes=('chat', 'chat', 'tasks'),
      num_task_requests=1600,
      only_round=-1,  # >= 0: generate just that round (e.g. 2 before round 1 is finished)
      validation_modules=corpus.VALIDATION_MODULES,
      max_prompt_len=160,
      max_new_tokens=320,
      max_len=480,
      shard_size=64,
      generate_batch=32,  # 116 tokens/s on 2 cores (16: 94, 64: 118; measured)
      sampled_every=4,
      temperature=1.0,
      top_p=1.0,
      regenerate_missing=False,
      only_shards='',  # e.g. 'greedy:35,36': generate just those (held-out calibration data)
      feature_taps=(1, 8, 15, 22, 27),  # = head.target_layer_ids; the features training reads
      # Train on the first N shards of each directory after the held-out one (0: all; DSpark:
      # 56, see below); smaller N are the data-scaling studies (benchmarks/history/README.md).
      shards_per_dir=0,
    )
  )
  config.train.update(
    # Sized for 2 CPU cores (experiments/tasks/training_throughput.py; the studies:
    # benchmarks/history/README.md): the 99% draft vocabulary trains faster than the whole one,
    # 32 anchors give the same slots/s as 16 with twice the data per step, and bfloat16-input
    # matmuls (compute_dtype) pay only on a CPU with AMX or AVX512-BF16: off, so every head
    # here trains in float32.
    num_anchors=32,
    loss='ce',
    labels='target_argmax',  # CE on the target's greedy token, also on sampled sequences
    compute_dtype=None,
    temperature=1.0,
    gamma=4.0,  # depth weights exp(-(k-1)/4): held-out depth-1 0.589 -> 0.648 (assets/README)
    loss_chunk=16,
    remat=False,
    consistency_weight=0.3,  # JetSpec++ heads only: MASK drafting -> its in-round refinement
    global_batch=8,
    steps=1600,  # 800 -> 1600 on all of round 0: held-out expected tau 3.35 -> 3.62
    lr=1e-3,
    warmup_steps=50,
    log_every=25,
    checkpoint_every=100,
  )
  config.eval.update(num_prompts=8, max_new_tokens=96)
  config.eval.method = ml_collections.ConfigDict(dict(name='tree', budget=32, width=7))
  # Held-out teacher-forced metrics, logged beside the training ones: the first 32 sequences of
  # greedy/shard_00000 (the first shard of each data directory is never trained on).
  config.eval.update(heldout_shards=1, heldout_sequences=32, heldout_anchors=64, heldout_every=100)
  # Also held out, when a run reads round 2 (prompt_rounds >= 3): the first 32 sequences of
  # round2/greedy/shard_00000, the 'tasks' mix, logged as heldout_round2_greedy_*.
  config.eval.heldout_subdirs = ('round2/greedy',)
  if arg == 'dspark':
    # DSpark: a bidirectional backbone whose anchor slot predicts too, so block 7 drafts 7 tokens
    # like the other heads' block 8; Markov rank 256 and the loss weights exp(-k/4) of the
    # paper's code; its loss needs the teacher's logits (the stored final hidden states).
    config.head.update(block_size=7, causal=False, markov_rank=256, copy_seed=0)
    # greedy 57-58 stay out of training: the held-out shards the confidence temperatures are
    # fitted and reported on (experiments/tasks/dspark_calibration.py, --fit_shards=57,1
    # --eval_shards=58,1)
    config.data.update(shards_per_dir=56)
    config.train.update(loss='dspark', gamma=4.0)
    # chain tau: verify every token
    config.eval.method = ml_collections.ConfigDict(dict(name='dspark', threshold=0.0))
  if arg == 'jetspecpp':
    # JetSpec++: the JetSpec head plus draft_embed; each step's 16 blocks per sequence are 8
    # clean blocks and 8 second blocks after them (2 in-round refine passes, 2 noisy-context
    # blocks, 4 next-round refine blocks: head_sums.second_block_outputs), plus the
    # consistency term on the in-round pairs.
    # copy_seed=3: the slots its recycled guesses leave empty hold copy candidates (the shipped
    # head; 0: every empty slot MASK)
    config.head.update(refine=True, copy_seed=3)
    config.eval.method = ml_collections.ConfigDict(dict(name='jetspecpp', budget=32, width=7))
  if shipped:
    # The shipped heads' second stage: the first stage's head (this preset without the suffix,
    # its export in runs/<head>/export) + 1,500 steps on prompt rounds 0-2, a fresh optimiser.
    config.data.prompt_rounds = 3
    config.train.update(init_from=f'runs/{arg}/export', steps=1500, lr=5e-4)
    config.eval.update(num_prompts=2, max_new_tokens=48)
    if arg == 'dflash':  # it read the bfloat16 feature cache (within 0.01 of the float32 one)
      config.data.update(
        features_compute_dtype='bfloat16',
        features_dir=str(model_cache.cache_dir() / 'features' / 'smollm2_135m_bf16'),
      )
  if suffix in ('_public', '_public_b16'):
    # The shipped head (assets/) continued on rounds 0-2 and, in half the steps, the public-chat
    # conversations (data.mix: their own width and feature cache; the first shard of each of its
    # directories held out). Width 1,536 holds 99% of the first turns whole (a longer one is cut;
    # later turns need 3,072, at 2.2x the step time); their features are computed with bfloat16
    # matmul inputs, ~1.7x faster with AMX (the heads score alike on either cache).
    config.data.prompt_rounds = 3
    config.data.mix = [
      dict(
        dir='data/public_chat',
        max_len=1536,
        features_dir=str(model_cache.cache_dir() / 'features' / 'public_chat_smollm2_135m_bf16'),
        features_compute_dtype='bfloat16',
        weight=0.5,
      )
    ]
    config.train.update(init_from=f'assets/{arg}_head_smollm2_135m', steps=1500, lr=5e-4)
    config.eval.update(num_prompts=2, max_new_tokens=48)
  if suffix == '_public_b16':
    # Every family at one recipe with the paper's block size: each shipped head continued
    # 600 steps on the first training shard of each rounds' directory and the public-chat
    # conversations (the bfloat16 feature caches), drafting blocks of 16 (DSpark: 15, its
    # anchor slot predicts too) from 16 anchors a sequence, the slots of 32 blocks of 8.
    config.head.block_size = 15 if arg == 'dspark' else 16
    config.train.update(num_anchors=16, steps=600, warmup_steps=30, checkpoint_every=100)
    config.data.update(
      shards_per_dir=1,
      features_compute_dtype='bfloat16',
      features_dir=str(model_cache.cache_dir() / 'features' / 'smollm2_135m_bf16'),
    )
  if suffix == '_b16':
    if arg not in ('jetspec', 'dflash'):
      raise ValueError(f'blocks of 16 are a preset of the jetspec and dflash heads, not {arg!r}')
    # The paper's block size at equal compute: twice the draft slots per anchor, half the
    # anchors (16 x 16 = 32 x 8 slots a sequence).
    config.head.block_size = 16
    config.train.num_anchors = 16
  if arg == 'public_chat':
    # Data from prompts people send (jetspec_jax/training/public_chat.py; card:
    # data/public_chat/README.md): ShareGPT and Alpaca user turns, up to 3 turns a conversation,
    # each answered by the target after its own earlier answers, responses of up to 1,024 tokens.
    config.data.update(
      prompts='public_chat',
      dir='data/public_chat',
      max_turns=3,
      # > 0: answer only turns 1..answer_turns of each conversation (e.g. 1: every first turn
      # before any second one); the conversations kept stay those of max_turns, and a run with
      # a larger value resumes each shard at its next turn
      answer_turns=0,
      max_prompt_len=2048,
      max_new_tokens=1024,
      max_len=3072,
      generate_batch=16,
      shard_size=16,  # one batch a shard: the long job lands in small resumable pieces
    )
  if arg == 'tiny':  # a smoke test of the pipeline (tests)
    config.data.update(
      num_instructions=4,
      instruction_tokens=12,
      num_coding=2,
      num_math=2,
      num_task_requests=2,
      max_new_tokens=8,
      max_len=180,
      shard_size=4,
      generate_batch=4,
    )
  return config
