"""Generates self-distilled training data: the target regenerates each prompt's response.

  python -m experiments.data --config=experiments/configs/train/draft_tiny.py --workdir=DIR

Writes token shards to ``config.data.dir`` (or DIR/data); re-running skips finished shards.
"""

import json
import pathlib
import random

import jax
from absl import flags, logging
from ml_collections import config_flags

from jetspec_jax import sharding
from jetspec_jax.training import chat_data, public_chat, run_config


def run(config, workdir: str) -> list[pathlib.Path]:
  run_config.check_config(config)  # the training that follows would fail: before any generation
  # Each process generates its own shards on its own devices (tensor parallel over them).
  mesh = run_config.local_mesh_from_config(config)
  target = run_config.load_target_from_config(config.target, mesh)
  run_config.head_config(config.head, target.cfg)  # the head must fit the target: before the data
  run_config.save_resolved_config(config, workdir, 'generate_config.json')
  if config.data.prompts == 'public_chat':  # ShareGPT + Alpaca conversations, every turn
    return generate_public_chat(config, target, pathlib.Path(config.data.dir or workdir))
  if config.data.prompts == 'chat_mix':  # an instruct target: prompts made offline, 2 stages
    tokenizer = run_config.tokenizer_for(config.target)
    data_dir, counts = chat_data.generate_chat_dataset(config, target, tokenizer, workdir)
    logging.info('chat data: %s', counts)
    return sorted(data_dir.rglob('shard_*.npz'))
  # JSON-lines text / conversations (the chat template), stdlib functions, random ids
  return run_config.generate_data(config, target, config.data.dir or pathlib.Path(workdir) / 'data')


def generate_public_chat(config, target, data_dir: pathlib.Path) -> list[pathlib.Path]:
  """The filtered conversations in a seeded order (a partial dataset is a random sample of them),
  their selection counts in ``data_dir/selection.json``, then every turn answered."""
  tokenizer = run_config.tokenizer_for(config.target)
  conversations = public_chat.sharegpt() + public_chat.alpaca_demo()
  kept, counts = public_chat.select(
    conversations, eval_index=public_chat.eval_index(), max_turns=config.data.max_turns
  )
  random.Random(config.seed).shuffle(kept)
  data_dir.mkdir(parents=True, exist_ok=True)
  (data_dir / 'selection.json').write_text(json.dumps(counts, indent=1) + '\n')
  logging.info('public chat: %s', counts)
  public_chat.generate(
    target,
    tokenizer,
    kept,
    data_dir,
    # answer_turns: answer only turns up to it for now (the selection stays that of max_turns, so
    # a later run with more turns resumes each shard at its next turn)
    max_turns=config.data.answer_turns or config.data.max_turns,
    shard_size=config.data.shard_size,
    batch_size=config.data.generate_batch,
    max_new_tokens=config.data.max_new_tokens,
    max_prompt_len=config.data.max_prompt_len,
    sampled_every=config.data.sampled_every,
    temperature=config.data.temperature,
    top_p=config.data.top_p,
    seed=config.seed,
  )
  return sorted(data_dir.rglob('shard_*.npz'))


def main(argv):
  del argv
  sharding.maybe_initialize_distributed(flags.FLAGS.distributed)
  logging.info('JAX %s on %s', jax.__version__, jax.devices())
  paths = run(flags.FLAGS.config, flags.FLAGS.workdir)
  print(f'{len(paths)} shards in {paths[0].parent}')


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  config_flags.DEFINE_config_file(
    'config', 'experiments/configs/train/draft_tiny.py', 'Data config.'
  )
  flags.DEFINE_string('workdir', None, 'Where data/ goes unless config.data.dir is set.')
  flags.mark_flags_as_required(['workdir'])
  flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() (multi-host).')
