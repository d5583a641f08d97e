"""Draft-head training throughput: block slots per second of the jitted train step.

  python -m experiments.microbench --task=training \
      --config=experiments/configs/train/draft_smollm2.py \
      --variants=full,vocab99 --out=benchmarks/training_throughput_smollm2.json

Batches are real sequences of the configured data (tokens, masks, lengths) with stored-feature
inputs of the right shape (random values: a step's cost does not depend on them, and no feature
cache is needed). A variant is ``full`` (the whole 49k vocabulary), ``vocabNN`` (a reduced draft
vocabulary covering NN% of the data's response tokens, ``vocab995`` = 99.5%), either with
``+bf16`` (bfloat16-input, float32-accumulate matmuls). Each variant: one compile, ``--warmup``
steps, then the median of ``--steps`` timed steps. Slots are the active (loss-carrying) slots.
``--config.train.micro_batches=N`` times the step as N accumulated slices of the batch (the same
loss and gradients; with N = the batch, one sequence per slice).
"""

import json
import pathlib
import time

import jax
import numpy as np
from absl import flags
from ml_collections import config_flags

from experiments.tasks import bench
from jetspec_jax import sharding
from jetspec_jax.models import draft_head as dh
from jetspec_jax.training import head_step, head_sums, run_config
from jetspec_jax.training import shards as shards_lib
from jetspec_jax.training.loop import init_state, make_optimizer


def parse_variant(name: str) -> tuple[float, str | None]:
  """``'vocab99+bf16'`` -> (0.99, 'bfloat16'); ``'full'`` -> (0.0, None)."""
  base, _, extra = name.partition('+')
  if extra not in ('', 'bf16'):
    raise ValueError(f'unknown variant suffix {extra!r} in {name!r}')
  if base == 'full':
    coverage = 0.0
  elif base.startswith('vocab') and base[5:].isdigit():
    digits = base[5:]
    coverage = int(digits) / 10 ** len(digits)
  else:
    raise ValueError(f'unknown variant {name!r}: full, vocabNN, optionally +bf16')
  return coverage, 'bfloat16' if extra == 'bf16' else None


def time_variant(config, target, head_cfg, source, name: str, steps: int, warmup: int) -> dict:
  coverage, compute_dtype = parse_variant(name)
  draft_vocab = None
  if coverage:
    draft_vocab = dh.draft_vocabulary(source.response_token_counts(target.cfg.vocab_size), coverage)
  settings = head_sums.StepSettings(
    num_anchors=config.train.num_anchors,
    loss=config.train.loss,
    gamma=config.train.gamma,
    loss_chunk=config.train.loss_chunk,
    remat=config.train.remat,
    consistency_weight=config.train.consistency_weight,
    compute_dtype=compute_dtype,
    micro_batches=config.train.micro_batches,
  )
  optimizer = make_optimizer(lr=1e-4, steps=100, warmup_steps=1)
  step = head_step.make_train_step(
    target, head_cfg, optimizer, settings, sharding.make_mesh(), draft_vocab
  )
  state = init_state(dh.init_head_params(head_cfg, jax.random.key(0)), optimizer)
  batches = shards_lib.make_batches(source, config.train.global_batch, config.seed)
  width = (head_cfg.num_taps + 1) * head_cfg.hidden_size
  rng = np.random.default_rng(0)
  times, slots = [], []
  for i in range(1 + warmup + steps):
    batch = dict(batches[i])
    shape = batch['tokens'].shape + (width,)
    batch['features'] = rng.standard_normal(shape, np.float32).astype(np.float32)
    start = time.perf_counter()
    state, metrics = step(state, batch, jax.random.key(i))
    jax.block_until_ready(state)
    if i > warmup:
      times.append(time.perf_counter() - start)
      slots.append(int(metrics['active_slots']))
  median = float(np.median(times))
  return dict(
    variant=name,
    draft_vocab=len(draft_vocab) if draft_vocab is not None else target.cfg.vocab_size,
    compute_dtype=compute_dtype or 'float32',
    step_s=median,
    slots_per_step=float(np.mean(slots)),
    slots_per_s=float(np.mean(slots)) / median,
  )


def main(argv):
  del argv
  config = flags.FLAGS.config
  target = run_config.load_target_from_config(config.target)
  head_cfg = dh.config_for_target(
    target.cfg,
    num_layers=config.head.num_layers,
    block_size=config.head.block_size,
    causal=config.head.causal,
    target_layer_ids=tuple(config.head.target_layer_ids),
    mask_token_id=config.head.mask_token_id,
    markov_rank=config.head.markov_rank,
    refine=config.head.refine,
  )
  source = shards_lib.TokenShards(config.data.dir, max_len=config.data.max_len)
  results = []
  for name in flags.FLAGS.variants:
    result = time_variant(
      config, target, head_cfg, source, name, flags.FLAGS.steps, flags.FLAGS.warmup
    )
    results.append(result)
    print(json.dumps(result), flush=True)
  if flags.FLAGS.out:
    record = dict(
      machine=bench.cpu_description(),
      devices=str(jax.devices()),
      head_kind=head_cfg.kind,
      global_batch=config.train.global_batch,
      num_anchors=config.train.num_anchors,
      micro_batches=config.train.micro_batches,
      block_size=head_cfg.block_size,
      results=results,
    )
    pathlib.Path(flags.FLAGS.out).write_text(json.dumps(record, indent=2) + '\n')


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  flags.DEFINE_list('variants', ['full', 'vocab99'], 'What to time (module doc).')
  flags.DEFINE_integer('steps', 5, 'Timed steps per variant.')
  flags.DEFINE_integer('warmup', 1, 'Untimed steps after the compile.')
  flags.DEFINE_string('out', None, 'Write the results here as JSON.')
  config_flags.DEFINE_config_file(
    'config', 'experiments/configs/train/draft_smollm2.py', 'Head config.'
  )
