"""Draft-head training by self-distillation, end to end: ``train_and_evaluate(config, workdir)``
resolves the config (``run_config``), builds or reads the data and its feature cache, fits the
head (``head_step``, ``head_sums``) with checkpoints, evaluates it and exports it."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from etils import epath

from jetspec_jax import decoding, methods, sharding
from jetspec_jax.models import draft_head as dh
from jetspec_jax.models import head_io
from jetspec_jax.training import chat_data, copy_baseline, head_step, run_config
from jetspec_jax.training import shards as shards_lib
from jetspec_jax.training.loop import (
  make_optimizer,
  make_schedule,
)


def train_and_evaluate(config, workdir: str) -> dict:
  """Everything ``experiments/tasks/train_draft.py`` does: data, training, export, tau before/after.

  The config is checked first (:func:`run_config.check_config`) and written to
  ``workdir/config.json``."""
  workdir_path = epath.Path(workdir)  # a URL too (gs://...): every file below goes through epath
  run_config.check_config(config)
  run_config.save_resolved_config(config, workdir_path)
  mesh = run_config.mesh_from_config(config)
  target = run_config.load_target_from_config(
    config.target, mesh, fsdp=config.get('mesh', {}).get('fsdp')
  )
  # Data generation and tau evaluation run on each process's own devices (a copy of the target
  # there when the mesh spans processes); training runs on the whole mesh.
  local_target = target
  if jax.process_count() > 1:
    local_target = run_config.load_target_from_config(
      config.target, run_config.local_mesh_from_config(config)
    )
  head_cfg = run_config.head_config(config.head, target.cfg)
  data_dir = epath.Path(config.data.dir or workdir_path / 'data')
  if config.data.prompts == 'chat_mix':  # made by experiments/tasks/generate_data.py (2 stages)
    prompts = chat_data.eval_chat_prompts(run_config.tokenizer_for(config.target))
  else:
    prompts, eos = run_config.training_prompts(config, target.cfg.vocab_size)
    if not shards_lib.shard_paths(data_dir) or config.data.regenerate_missing:
      run_config.generate_data(config, local_target, data_dir, prompts=prompts, eos=eos)
  features_dir = config.data.get('features_dir') or None
  target_labels = config.train.get('labels', 'data') == 'target_argmax'
  heldout_shards = config.eval.get('heldout_shards', 0)
  shards_per_dir = config.data.get('shards_per_dir') or None
  prompt_rounds = config.data.get('prompt_rounds')  # chat data: the plan's rounds it reads
  run_config.build_feature_cache(config, target, data_dir)
  source = shards_lib.TokenShards(
    data_dir,
    max_len=config.data.max_len,
    shards_per_dir=shards_per_dir,
    skip_per_dir=heldout_shards,
    features_dir=features_dir,
    target_labels=target_labels,
    prompt_rounds=prompt_rounds,
  )
  # data.mix: more directories (e.g. long conversations), each at its own width and share
  mixed = run_config.mixed_sources(config, heldout_shards, target_labels)
  sources = [source] + [s for s, _ in mixed]
  for s in sources:
    if s.feature_taps is not None and s.feature_taps != tuple(head_cfg.target_layer_ids):
      raise ValueError(
        f'the data stores features of target layers {s.feature_taps}, the head taps '
        f'{tuple(head_cfg.target_layer_ids)}; regenerate the data or match the taps'
      )
  batches = shards_lib.mix_batches(
    sources,
    [1.0 - sum(w for _, w in mixed)] + [w for _, w in mixed],
    config.train.global_batch,
    config.seed,
  )
  draft_vocab = None
  continued = (
    head_io.load_draft_head(config.train.init_from, target) if config.train.init_from else None
  )
  if config.head.get('draft_vocab_coverage'):
    counts = sum(s.response_token_counts(target.cfg.vocab_size) for s in sources)
    # A continued head keeps every id it drafted, plus those its new data needs
    own = None if continued is None else continued.draft_vocab
    draft_vocab = dh.draft_vocabulary(counts, config.head.draft_vocab_coverage, include=own)
    logging.info(
      'draft vocabulary: %d of %d ids cover %.4f of the response tokens',
      len(draft_vocab),
      target.cfg.vocab_size,
      counts[draft_vocab].sum() / counts.sum(),
    )
  optimizer = make_optimizer(
    lr=config.train.lr,
    steps=config.train.steps,
    warmup_steps=config.train.warmup_steps,
    weight_decay=config.train.weight_decay,
    grad_clip=config.train.grad_clip,
  )
  settings = run_config.step_settings(config.train)
  evaluate = None
  if heldout_shards:  # the first shards of greedy/, never trained on (skip_per_dir above)
    heldout_batch = run_config.load_heldout_batch(config, data_dir)
    heldout_settings = dataclasses.replace(
      settings, num_anchors=config.eval.get('heldout_anchors', 64)
    )
    # More held-out sets (e.g. a later prompt round's), logged as heldout_<subdir>_*: only
    # those of the rounds this run reads, whose features the cache holds.
    extra = run_config.heldout_subdirs(config, data_dir)
    if extra:
      logging.info('also held out: the first shard of each of %s', extra)
    heldout_sets = [(heldout_batch, 'heldout_')] + [
      (run_config.load_heldout_batch(config, data_dir, d), f'heldout_{d.replace("/", "_")}_')
      for d in extra
    ]
    evaluators = [
      head_step.make_heldout_eval(
        target, head_cfg, b, heldout_settings, draft_vocab, seed=config.seed, prefix=prefix
      )
      for b, prefix in heldout_sets
    ]
    evaluate = lambda params: {k: v for e in evaluators for k, v in e(params).items()}
    # What the head must beat on the same sequences: copying from the context.
    copy = copy_baseline.copy_metrics(heldout_batch, block_size=head_cfg.block_size)
    logging.info(
      'held-out copy baseline (prompt lookup, n <= 3): accuracy by depth %s, expected tau %.3f',
      np.round(copy['accuracy'], 3).tolist(),
      copy['expected_tau'],
    )
  if continued is not None:
    init_params = continued.params
  else:
    init_params = dh.init_head_params(head_cfg, jax.random.key(config.seed), target.dtype)
    if config.head.get('init_from_target_layers'):
      init_params = dh.init_from_target_layers(init_params, head_cfg, target.params)
  initial = dh.DraftHead(
    cfg=head_cfg,
    params=init_params,
    draft_vocab=None if draft_vocab is None else jnp.asarray(draft_vocab),
  )
  eval_prompts = [np.asarray(p) for p in prompts[: config.eval.num_prompts]]

  method = methods.from_config(config.eval.method)

  def mean_tau(h):
    taus = [
      decoding.generate(
        local_target,
        h if jax.process_count() == 1 else h.replace(params=sharding.to_host(h.params)),
        p,
        max_new_tokens=config.eval.max_new_tokens,
        method=method,
      ).stats.tau
      for p in eval_prompts
    ]
    return float(np.mean(np.concatenate(taus))) if taus else float('nan')

  # Measured before training: the step donates (and so deletes) the initial parameters.
  tau_before = mean_tau(initial)
  state, history = head_step.fit(
    target,
    head_cfg,
    batches,
    workdir,
    steps=config.train.steps,
    optimizer=optimizer,
    settings=settings,
    seed=config.seed,
    init_params=initial.params,
    log_every=config.train.log_every,
    checkpoint_every=config.train.checkpoint_every,
    stop_after=config.train.get('stop_after'),
    mesh=mesh,
    fsdp=bool(config.get('mesh', {}).get('fsdp', False)),
    draft_vocab=draft_vocab,
    evaluate=evaluate,
    eval_every=config.eval.get('heldout_every', 0),
    learning_rate=make_schedule(
      lr=config.train.lr, steps=config.train.steps, warmup_steps=config.train.warmup_steps
    ),
  )
  head = initial.replace(params=state.params)
  export_dir = workdir_path / 'export'
  if sharding.is_main_process():
    head_io.save_draft_head(head.replace(params=sharding.to_host(head.params)), export_dir)
  else:
    sharding.to_host(head.params)  # the gather is collective: every process takes part
  result = dict(
    steps=int(state.step),
    history=history,
    export_dir=str(export_dir),
    num_sequences=sum(len(s) for s in sources),
    num_tokens=sum(s.num_tokens for s in sources),
  )
  result.update(tau_before=tau_before, tau_after=mean_tau(head))
  if heldout_shards:
    result['heldout_copy_baseline'] = dict(
      accuracy=copy['accuracy'].tolist(), expected_tau=copy['expected_tau']
    )
  logging.info('tau before %.3f after %.3f', result['tau_before'], result['tau_after'])
  if sharding.is_main_process():
    (workdir_path / 'result.json').write_text(
      json.dumps({k: v for k, v in result.items() if k != 'history'}, indent=2)
    )
  return result
