"""Self-distilled chat data for an instruct target (the SmolLM2 heads): prompts made offline.

Two stages, both written as resumable shards (a killed run continues where it stopped):

1. ``instructions/``: the target writes user instructions itself from the bare user-turn prefix
   of its chat template (sampled; Magpie-style). Finished, cleaned, de-duplicated ones are kept.
2. ``data/greedy/`` and ``data/sampled/``: the target answers every training prompt (its own
   instructions, standard-library coding tasks, templated math word problems; see
   :mod:`jetspec_jax.training.chat_prompts`), greedily for most prompts and sampled for every
   ``sampled_every``-th one. Shards of the two kinds are produced alternately, so a partial
   dataset already mixes every source and both temperatures.

Training reads ``data/`` as one source (``TokenShards`` reads shards in subdirectories). With
``data.feature_taps`` set, head training reads the target's features of every token instead of
running the target: collected during generation beside each shard, or, with ``data.features_dir``,
recomputed from the token shards into that directory by a batched forward
(:func:`jetspec_jax.training.data.compute_features`), so the token shards alone are the asset.
"""

import pathlib

import numpy as np
from absl import logging

from jetspec_jax import corpus
from jetspec_jax.models import decoder
from jetspec_jax.training import chat_prompts
from jetspec_jax.training import data as data_lib
from jetspec_jax.training import shards as shards_lib


def eval_chat_prompts(tokenizer, limit: int | None = None) -> list[list[int]]:
  """Held-out chat prompts (written for evaluation only) for tau checks during training."""
  texts = chat_prompts.EVAL_CHAT_INSTRUCTIONS[:limit]
  return [chat_prompts.chat_prompt(tokenizer, text) for text in texts]


def self_written_instructions(
  target: decoder.Target, tokenizer, out_dir, data_config, *, seed: int
) -> list[str]:
  """Stage 1: instructions the target writes from its user-turn prefix (cleaned, unique)."""
  prefix = chat_prompts.user_turn_prefix(tokenizer)
  n = data_config.num_instructions
  paths = data_lib.generate_dataset(
    target,
    [prefix] * n,
    out_dir,
    max_len=len(prefix) + data_config.instruction_tokens,
    max_new_tokens=data_config.instruction_tokens,
    shard_size=data_config.shard_size,
    batch_size=data_config.generate_batch,
    temperature=1.0,
    top_p=data_config.instruction_top_p,
    seed=seed + 1,
    eos=tokenizer.eos_ids,
    wait=True,  # processes started side by side split stage 1; each reads all of it
  )
  return instructions_from_shards(paths, tokenizer)


def instructions_from_shards(paths, tokenizer) -> list[str]:
  """The finished, cleaned, de-duplicated instructions of stage-1 shards, in shard order."""
  eos = np.asarray(sorted(tokenizer.eos_ids))
  seen, out = set(), []
  for path in paths:
    shard = np.load(path)
    for tokens, mask, length in zip(shard['tokens'], shard['loss_mask'], shard['lengths']):
      response = tokens[:length][mask[:length] == 1]
      if not response.size or not np.isin(response[-1], eos):
        continue  # ran out of tokens before finishing the instruction
      text = chat_prompts.clean_instruction(tokenizer.decode(response[:-1]))
      if text is not None and text.lower() not in seen:
        seen.add(text.lower())
        out.append(text)
  return out


# Round r >= 1 of the prompt plan draws with this seed offset (round 0 is the plan as it was).
ROUND_SEED_STRIDE = 1000


def round_dirs(workdir, data_dir, prompt_round: int) -> tuple[pathlib.Path, pathlib.Path]:
  """Where a prompt round's instructions and responses go: round 0 in ``instructions/`` and
  ``data/{greedy,sampled}``, round r in ``instructions_round{r}/`` and
  ``data/round{r}/{greedy,sampled}`` (training reads the rounds below ``data.prompt_rounds``)."""
  workdir, data_dir = pathlib.Path(workdir), pathlib.Path(data_dir)
  suffix = f'_round{prompt_round}' if prompt_round else ''
  return workdir / f'instructions{suffix}', shards_lib.prompt_round_dir(data_dir, prompt_round)


def round_mix(data_config, prompt_round: int) -> str:
  """The prompt mix of a round: ``data.round_mixes[prompt_round]`` (the last one past its end;
  ``'chat'`` when unset)."""
  mixes = tuple(data_config.get('round_mixes') or ('chat',))
  mix = mixes[min(prompt_round, len(mixes) - 1)]
  if mix not in ('chat', 'tasks'):
    raise ValueError(f"data.round_mixes: unknown prompt mix {mix!r} (known: 'chat', 'tasks')")
  return mix


def training_texts(
  instructions: list[str], data_config, *, seed: int, prompt_round: int = 0, exclude=frozenset()
) -> list[str]:
  """One prompt round's texts, shuffled so every source is spread evenly.

  A ``'chat'`` round (:func:`round_mix`): the self-written ``instructions``, ``num_coding``
  standard-library coding tasks (the r-th ``'chat'`` round takes the r-th slice of one fixed
  shuffle, so rounds share none) and ``num_math`` math word problems. A ``'tasks'`` round (no
  self-written instructions): ``num_task_requests`` short task requests, ``num_coding``
  completion tasks (the k-th ``'tasks'`` round the k-th slice of their own shuffle) and
  ``num_math`` math problems of the training and the extra templates
  (:mod:`jetspec_jax.training.chat_prompts`). ``seed`` is the plan's (``config.seed``); round
  r draws with ``seed + r * ROUND_SEED_STRIDE``. Texts in ``exclude`` (lower-cased: earlier rounds'
  texts) are dropped; round 0 excludes none, so its prompts do not depend on how many rounds
  follow."""
  files = corpus.stdlib_files(tuple(data_config.validation_modules))[0]
  n = data_config.num_coding
  round_seed = seed + ROUND_SEED_STRIDE * prompt_round
  mix = round_mix(data_config, prompt_round)
  slice_index = sum(round_mix(data_config, r) == mix for r in range(prompt_round))
  if mix == 'chat':
    texts = (
      list(instructions)
      + chat_prompts.coding_tasks(files, limit=n, seed=seed, skip=n * slice_index)
      + chat_prompts.math_word_problems(data_config.num_math, seed=round_seed)
    )
  else:
    math_templates = chat_prompts.TRAIN_MATH_TEMPLATES + chat_prompts.TASK_MATH_TEMPLATES
    texts = (
      chat_prompts.task_requests(data_config.num_task_requests, seed=round_seed)
      + chat_prompts.completion_tasks(files, limit=n, seed=seed, skip=n * slice_index)
      + chat_prompts.math_word_problems(
        data_config.num_math, seed=round_seed, templates=math_templates
      )
    )
  texts = [t for t in texts if t.lower() not in exclude]
  order = np.random.default_rng(round_seed).permutation(len(texts))
  return [texts[i] for i in order]


def chat_token_prompts(tokenizer, texts: list[str], max_prompt_len: int) -> list[list[int]]:
  """``texts`` as chat-formatted ids, keeping those of at most ``max_prompt_len`` tokens."""
  prompts = [chat_prompts.chat_prompt(tokenizer, text) for text in texts]
  return [p for p in prompts if len(p) <= max_prompt_len]


def generate_chat_dataset(
  config, target: decoder.Target, tokenizer, workdir
) -> tuple[pathlib.Path, dict]:
  """Both stages for each of ``data.prompt_rounds`` prompt rounds (1 when unset), one round
  after the other; returns the data directory and counts. A later round is a fresh prompt plan
  (its own seed, instructions, coding-task slice and math problems, no text of an earlier
  round), so the data grows past one plan without reordering the prompts of finished shards.
  A ``'tasks'`` round (``data.round_mixes``) has no stage 1. ``data.only_round`` >= 0 answers
  that round's prompts only (earlier rounds' texts are still made, to exclude them)."""
  workdir = pathlib.Path(workdir)
  data_config = config.data
  data_dir = pathlib.Path(data_config.dir or workdir / 'data')
  counts, seen = {}, set()
  num_rounds = data_config.get('prompt_rounds', 1)
  only_round = data_config.get('only_round', -1)
  if only_round >= num_rounds:
    raise ValueError(f'data.only_round={only_round} is not below data.prompt_rounds={num_rounds}')
  for prompt_round in range(num_rounds):
    round_seed = config.seed + ROUND_SEED_STRIDE * prompt_round
    instructions_dir, round_data_dir = round_dirs(workdir, data_dir, prompt_round)
    instructions = []
    if round_mix(data_config, prompt_round) == 'chat':
      instructions = self_written_instructions(
        target, tokenizer, instructions_dir, data_config, seed=round_seed
      )
      logging.info('round %d: %d usable self-written instructions', prompt_round, len(instructions))
    texts = training_texts(
      instructions, data_config, seed=config.seed, prompt_round=prompt_round, exclude=seen
    )
    seen.update(t.lower() for t in texts)
    if only_round >= 0 and prompt_round != only_round:
      continue
    prompts = chat_token_prompts(tokenizer, texts, data_config.max_prompt_len)
    kinds = data_lib.generate_greedy_and_sampled(
      target, prompts, round_data_dir, data_config, seed=round_seed, eos=tokenizer.eos_ids
    )
    suffix = f'_round{prompt_round}' if prompt_round else ''
    counts.update({f'instructions{suffix}': len(instructions), f'prompts{suffix}': len(prompts)})
    counts.update({k + suffix: v for k, v in kinds.items()})
  return data_dir, counts
