"""Self-distilled chat data for an instruct target (the SmolLM2 heads): prompts made offline.

Two stages, both written as resumable shards (a killed run continues where it stopped):

1. ``instructions/``: the target writes user instructions itself from the bare user-turn prefix
   of its chat template (sampled; Magpie-style). Finished, cleaned, de-duplicated ones are kept.
2. ``data/greedy/`` and ``data/sampled/``: the target answers every training prompt (its own
   instructions, standard-library coding tasks, templated math word problems; see
   :mod:`jetspec_jax.chat_prompts`), greedily for most prompts and sampled for every
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

from jetspec_jax import chat_prompts, corpus
from jetspec_jax import tokenizer as tokenizer_lib
from jetspec_jax.models import decoder, gguf_io
from jetspec_jax.training import data as data_lib


def tokenizer_for(target_config):
  """The target's own tokenizer: from ``target.path`` (GGUF or HF dir), else the packaged
  SmolLM2's (``preset='smollm2_135m_instruct'``)."""
  if target_config.get('path'):
    return tokenizer_lib.load_tokenizer(target_config.path)
  return tokenizer_lib.load_tokenizer(gguf_io.resolve_model_path(target_config.preset))


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
  )
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


def training_prompts(tokenizer, instructions: list[str], data_config, *, seed: int):
  """All training prompts as chat-formatted ids, shuffled so every source is spread evenly."""
  files = corpus.stdlib_files(tuple(data_config.validation_modules))[0]
  texts = (
    list(instructions)
    + chat_prompts.coding_tasks(files, limit=data_config.num_coding, seed=seed)
    + chat_prompts.math_word_problems(data_config.num_math, seed=seed)
  )
  order = np.random.default_rng(seed).permutation(len(texts))
  prompts = [chat_prompts.chat_prompt(tokenizer, texts[i]) for i in order]
  return [p for p in prompts if len(p) <= data_config.max_prompt_len]


def generate_chat_dataset(
  config, target: decoder.Target, tokenizer, workdir
) -> tuple[pathlib.Path, dict]:
  """Both stages; returns the data directory and counts."""
  workdir = pathlib.Path(workdir)
  data_config = config.data
  instructions = self_written_instructions(
    target, tokenizer, workdir / 'instructions', data_config, seed=config.seed
  )
  logging.info('%d usable self-written instructions', len(instructions))
  prompts = training_prompts(tokenizer, instructions, data_config, seed=config.seed)
  data_dir = pathlib.Path(data_config.dir or workdir / 'data')
  kinds = data_lib.generate_greedy_and_sampled(
    target, prompts, data_dir, data_config, seed=config.seed, eos=tokenizer.eos_ids
  )
  counts = dict(instructions=len(instructions), prompts=len(prompts), **kinds)
  return data_dir, counts
