"""The public benchmark table: greedy responses to public prompt sets, every head walked along them.

  python -m experiments.evaluate --config=experiments/configs/evaluate_smollm2.py \
      --workdir=benchmarks/public [--stages=responses,walk,render]

``responses``: the target's greedy responses (``WORKDIR/responses.jsonl``), generated a batch at
a time, the sets taken in turn so that an interrupted run covers every set; resumable.
``walk``: per prompt and per (drafter, method), the rounds decoding would take along the stored
response (``WORKDIR/walks.jsonl``, resumable per prompt). ``render``: ``WORKDIR/results.json``
(summary + provenance) and ``docs/results.md``.
"""

import pathlib

import jax
from absl import app, flags, logging
from ml_collections import config_flags

import jetspec_jax as js
from jetspec_jax.evaluation import prompt_sets, responses
from jetspec_jax.models import gguf_io

FLAGS = flags.FLAGS


def load_target(config):
  path = gguf_io.resolve_model_path(config.target)
  return js.load_target(path), js.load_tokenizer(path)


def first_turn_prompts(config) -> dict[str, list[prompt_sets.Prompt]]:
  """Each set's drawn prompts (MT-Bench: its first turns)."""
  cache = config.cache_dir or None
  return {
    name: prompt_sets.sample(prompt_sets.load(name, cache), n, config.seed)
    for name, n in config.samples
  }


def second_turn_prompts(config, tok, path) -> list[prompt_sets.Prompt]:
  """MT-Bench's second turns whose first answer is in the responses file."""
  done = responses.read(path)
  first = {
    pid: tok.decode(r['response'], skip_special_tokens=True)
    for (bench, pid), r in done.items()
    if bench == 'mtbench' and pid.endswith('-1')
  }
  return prompt_sets.second_turns(first, config.cache_dir or None)


def interleaved(streams: dict[str, list], chunk: int) -> list:
  """The streams' items taken ``chunk`` at a time from each in turn."""
  out, at = [], 0
  longest = max((len(s) for s in streams.values()), default=0)
  while at < longest:
    for items in streams.values():
      out += items[at : at + chunk]
    at += chunk
  return out


def run_responses(config, workdir: pathlib.Path) -> None:
  target, tok = load_target(config)
  path = workdir / 'responses.jsonl'
  streams = first_turn_prompts(config)
  order = interleaved(streams, config.batch_size)
  logging.info('%d first-turn prompts', len(order))
  step = config.batch_size * len(streams)
  for first in range(0, len(order), step):
    responses.generate(
      target,
      tok,
      order[first : first + step],
      path,
      max_new_tokens=config.max_new_tokens,
      batch_size=config.batch_size,
    )
    if any(name == 'mtbench' for name, _ in config.samples):
      responses.generate(
        target,
        tok,
        second_turn_prompts(config, tok, path),
        path,
        max_new_tokens=config.max_new_tokens,
        batch_size=config.batch_size,
      )
    logging.info('responses: %d stored', len(responses.read(path)))


def main(argv):
  del argv
  config = FLAGS.config
  workdir = pathlib.Path(FLAGS.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  logging.info('JAX %s on %s', jax.__version__, jax.devices())
  stages = [s for s in FLAGS.stages.split(',') if s]
  unknown = set(stages) - {'responses', 'walk', 'render'}
  if unknown:
    raise app.UsageError(f'unknown stages {sorted(unknown)}: responses, walk, render')
  if 'responses' in stages:
    run_responses(config, workdir)


if __name__ == '__main__':
  config_flags.DEFINE_config_file('config', 'experiments/configs/evaluate_smollm2.py', 'Config.')
  flags.DEFINE_string('workdir', None, 'Where responses, walks and results go.')
  flags.DEFINE_string('stages', 'responses,walk,render', 'Comma-separated stages to run.')
  flags.mark_flags_as_required(['workdir'])
  app.run(main)
