"""Draft heads in the released layout (DFlash's ``DFlashDraftModel`` ``config.json`` +
``model.safetensors``; docs/draft_head.md §6): the head's config, its weights, a DSpark head's
calibration and the reduced draft vocabulary's ``d2t`` / ``t2d`` maps, read and written without
torch. Target checkpoints are :mod:`jetspec_jax.models.hf_io`."""

import json
import os
from collections.abc import Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from jetspec_jax.models import checkpoint_files, decoder, draft_head, hf_io
from jetspec_jax.models.checkpoint_files import (
  CheckpointError,
  read_config,
  read_tensors,
  rope_scaling_from_hf,
  rope_theta_from_hf,
  write_tensors,
)


def _head_rules(cfg: draft_head.DraftHeadConfig) -> Iterator[hf_io.Rule]:
  dims = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size)
  yield ('fc', 'kernel'), 'fc.weight', hf_io.transposed, hf_io.transposed
  yield ('hidden_norm', 'scale'), 'hidden_norm.weight', hf_io.identity, hf_io.identity
  for i in range(cfg.num_hidden_layers):
    yield from hf_io.layer_rules(f'layers_{i}', f'layers.{i}', (), *dims)
    yield from hf_io.mlp_rules(f'layers_{i}', f'layers.{i}')
  yield ('norm', 'scale'), 'norm.weight', hf_io.identity, hf_io.identity
  if cfg.markov_rank:  # DSpark: the Markov stage (Embedding(V, r), Linear(r, V)) and confidence
    yield ('markov', 'embed'), 'markov_head.embed.weight', hf_io.identity, hf_io.identity
    yield ('markov', 'proj'), 'markov_head.proj.weight', hf_io.transposed, hf_io.transposed
    yield ('confidence', 'kernel'), 'confidence_head.weight', _row_out, _row_in
    yield ('confidence', 'bias'), 'confidence_head.bias', _row_out, _row_in
  if cfg.reads_guesses:  # JetSpec++ / copy-seeded: the vector added to a guessed token's embedding
    yield ('draft_embed',), 'draft_embed.weight', hf_io.identity, hf_io.identity


def _row_out(x):  # torch Linear(n, 1) weight [1, n] / bias [1] -> [n] / []
  return x.reshape(x.shape[1:])


def _row_in(x):
  return x.reshape((1,) + x.shape)


CALIBRATION_TENSOR = 'confidence_head.temperature'  # DSpark: per-position STS temperatures


# A reduced draft vocabulary in EAGLE-3's layout: ``d2t[i] = token_id - i`` for draft index i
# (int64 [K]) and ``t2d[token_id]`` true where the id is in the draft vocabulary (bool [V]).
DRAFT_VOCAB_TENSORS = ('d2t', 't2d')


def draft_vocab_tensors(draft_vocab, vocab_size: int) -> dict[str, np.ndarray]:
  """``d2t`` / ``t2d`` of draft token ids (EAGLE-3's offsets), stored sorted and once each.

  A head scores its draft ids by token id (the target's LM head rows, a DSpark head's Markov
  columns), so their order carries nothing and sorting keeps what the head drafts."""
  ids = np.unique(np.asarray(draft_vocab, np.int64))
  if len(ids) == 0 or ids[0] < 0 or ids[-1] >= vocab_size:
    raise ValueError(f'draft_vocab must hold token ids in [0, {vocab_size}), got {len(ids)} ids')
  t2d = np.zeros((vocab_size,), bool)
  t2d[ids] = True
  return dict(d2t=ids - np.arange(len(ids)), t2d=t2d)


def draft_vocab_from_tensors(tensors, vocab_size: int, where) -> np.ndarray | None:
  """The sorted draft token ids stored as ``d2t`` / ``t2d``, checked; None if absent."""
  if 'd2t' not in tensors:
    return None
  d2t = np.asarray(tensors['d2t'], np.int64)
  ids = d2t + np.arange(len(d2t))
  if d2t.ndim != 1 or len(ids) == 0 or ids.min() < 0 or ids.max() >= vocab_size:
    raise CheckpointError(f'{where}: d2t maps outside the vocabulary [0, {vocab_size})')
  if np.any(np.diff(ids) <= 0):
    raise CheckpointError(f'{where}: d2t must list increasing token ids')
  if 't2d' in tensors:
    t2d = np.asarray(tensors['t2d']).astype(bool)
    if t2d.shape != (vocab_size,) or not np.array_equal(np.flatnonzero(t2d), ids):
      raise CheckpointError(f'{where}: t2d does not match d2t')
  return ids.astype(np.int32)


HEAD_ARCHITECTURE = 'DFlashDraftModel'


def head_config_from_hf(hf: Mapping) -> draft_head.DraftHeadConfig:
  """A :class:`DraftHeadConfig` from a released head's ``config.json``."""
  archs = hf.get('architectures') or [HEAD_ARCHITECTURE]
  if archs[0] != HEAD_ARCHITECTURE:
    raise CheckpointError(
      f'not a draft head: architectures {archs}, expected [{HEAD_ARCHITECTURE!r}]'
    )
  dflash = hf.get('dflash_config') or {}
  for name in ('block_size', 'num_target_layers'):
    if name not in hf:
      raise CheckpointError(f'head config.json lacks {name!r}')
  if 'mask_token_id' not in dflash:
    raise CheckpointError('head config.json lacks dflash_config.mask_token_id')
  rope_scaling_from_hf(hf, allow_scaling=False)  # heads use plain RoPE
  layers = hf['num_hidden_layers']
  taps = dflash.get('target_layer_ids') or draft_head.default_tap_layers(
    hf['num_target_layers'], layers
  )
  heads = hf['num_attention_heads']
  return draft_head.DraftHeadConfig(
    hidden_size=hf['hidden_size'],
    intermediate_size=hf['intermediate_size'],
    num_hidden_layers=layers,
    num_attention_heads=heads,
    num_key_value_heads=hf.get('num_key_value_heads') or heads,
    head_dim=hf.get('head_dim') or hf['hidden_size'] // heads,
    vocab_size=hf['vocab_size'],
    target_layer_ids=tuple(taps),
    num_target_layers=hf['num_target_layers'],
    block_size=hf['block_size'],
    mask_token_id=dflash['mask_token_id'],
    causal=bool(dflash.get('causal_head', False)),
    rope_theta=rope_theta_from_hf(hf),
    rms_norm_eps=hf.get('rms_norm_eps', 1e-6),
    max_position_embeddings=hf.get('max_position_embeddings', 40960),
    markov_rank=_markov_rank(dflash),
    refine=dflash.get('head_kind') == 'jetspecpp',
    copy_seed=int(dflash.get('copy_seed', 0)),
  )


HEAD_KINDS = ('jetspec', 'dflash', 'dspark', 'jetspecpp')


def _markov_rank(dflash: Mapping) -> int:
  kind = dflash.get('head_kind', 'jetspec' if dflash.get('causal_head') else 'dflash')
  if kind not in HEAD_KINDS:
    raise CheckpointError(f'unknown head_kind {kind!r}; this library reads {HEAD_KINDS}')
  if kind == 'jetspecpp' and not dflash.get('causal_head'):
    raise CheckpointError('a jetspecpp head config.json needs dflash_config.causal_head = true')
  if kind != 'dspark':
    return 0
  if not dflash.get('markov_rank'):
    raise CheckpointError('a dspark head config.json needs dflash_config.markov_rank > 0')
  return int(dflash['markov_rank'])


def head_config_to_hf(cfg: draft_head.DraftHeadConfig, dtype=jnp.float32) -> dict:
  return dict(
    hf_io.architecture_fields(cfg, dtype),
    architectures=[HEAD_ARCHITECTURE],
    model_type='qwen3',
    tie_word_embeddings=False,
    block_size=cfg.block_size,
    num_target_layers=cfg.num_target_layers,
    dflash_config=dict(
      causal_head=cfg.causal,
      target_layer_ids=list(cfg.target_layer_ids),
      mask_token_id=cfg.mask_token_id,
      # Only DSpark and JetSpec++ heads name their kind: JetSpec / DFlash configs stay the
      # released ones.
      **({'head_kind': 'dspark', 'markov_rank': cfg.markov_rank} if cfg.markov_rank else {}),
      **({'head_kind': 'jetspecpp'} if cfg.refine else {}),
      **({'copy_seed': cfg.copy_seed} if cfg.copy_seed else {}),
    ),
  )


def load_draft_head(
  path: str | os.PathLike, target: decoder.Target, *, dtype=None
) -> draft_head.DraftHead:
  """Loads a JetSpec / DFlash / DSpark / JetSpec++ head checkpoint and binds it to ``target``.

  The kind comes from ``config.json`` (``dflash_config.head_kind``; without it, ``causal_head``
  tells JetSpec from DFlash); a DSpark head also reads its Markov and confidence tensors and,
  when present, its calibration temperatures.

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` (or a sharded index).
    target: the target whose embedding and LM head the head uses.
    dtype: parameter dtype; defaults to the target's.

  Raises:
    FileNotFoundError, CheckpointError: as :func:`load_target`; also when the head's hidden
      size, vocabulary or tap layers do not fit the target.
  """
  path = checkpoint_files.resolve(path)
  cfg = head_config_from_hf(read_config(path))
  try:
    draft_head.check_fits_target(cfg, target.cfg)
  except ValueError as e:
    raise CheckpointError(f'head at {path} does not fit the target: {e}') from e
  dtype = target.dtype if dtype is None else dtype
  expected = jax.eval_shape(lambda: draft_head.init_head_params(cfg, jax.random.key(0), dtype))
  tensors = read_tensors(path)
  calibration = None
  if cfg.markov_rank and CALIBRATION_TENSOR in tensors:
    calibration = jnp.asarray(
      hf_io.checked(
        hf_io.identity, tensors[CALIBRATION_TENSOR], CALIBRATION_TENSOR, (cfg.block_size,)
      ),
      jnp.float32,
    )
  draft_vocab = draft_vocab_from_tensors(tensors, cfg.vocab_size, path)
  params = hf_io.map_from_hf(
    tensors,
    _head_rules(cfg),
    expected,
    set(),
    ignorable=[CALIBRATION_TENSOR, *DRAFT_VOCAB_TENSORS],
  )
  params = jax.tree.map(lambda x: jnp.asarray(x, dtype), params)
  return draft_head.DraftHead(
    cfg=cfg,
    params=params,
    calibration=calibration,
    draft_vocab=None if draft_vocab is None else jnp.asarray(draft_vocab),
  )


def save_draft_head(head: draft_head.DraftHead, path: str | os.PathLike, dtype=None) -> None:
  """Writes ``head`` in the released layout (``fc.weight``, ``layers.{i}.*``, ...), cast to
  ``dtype`` if given (e.g. ``jnp.bfloat16`` for a shipped head). ``path`` may be a URL
  (``gs://...``, through ``etils.epath``)."""
  path = epath.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  if dtype is not None:
    head = head.replace(params=jax.tree.map(lambda x: x.astype(dtype), head.params))
  params = jax.device_get(head.params)
  tensors = {
    name: to_hf(np.asarray(hf_io.get_path(params, p)))
    for p, name, _, to_hf in _head_rules(head.cfg)
  }
  if head.calibration is not None:
    tensors[CALIBRATION_TENSOR] = np.asarray(head.calibration, np.float32)
  if head.draft_vocab is not None:
    tensors.update(draft_vocab_tensors(jax.device_get(head.draft_vocab), head.cfg.vocab_size))
  write_tensors(tensors, path)
  (path / 'config.json').write_text(json.dumps(head_config_to_hf(head.cfg, head.dtype), indent=2))
