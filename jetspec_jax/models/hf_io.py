"""Hugging Face checkpoint import/export for Qwen3 / Qwen3-MoE / Llama / Qwen2 targets (no torch).

Reads ``config.json`` plus ``model.safetensors`` or a sharded ``model.safetensors.index.json``
with ``safetensors.numpy`` (bfloat16 arrives as ``ml_dtypes.bfloat16``), and writes the same
layout so ``transformers`` loads it back.

Name mapping (HF tensor ``[out, in]`` -> Flax kernel ``[in, out]``, heads split out)::

  model.embed_tokens.weight                 [V, D]      embed_tokens/embedding       [V, D]
  model.layers.i.self_attn.q_proj.weight    [N*H, D]    layers_i/self_attn/q_proj/kernel [D, N, H]
  model.layers.i.self_attn.{k,v}_proj.weight[K*H, D]    .../{k,v}_proj/kernel        [D, K, H]
  model.layers.i.self_attn.o_proj.weight    [D, N*H]    .../o_proj/kernel            [N, H, D]
  model.layers.i.self_attn.{q,k,v}_proj.bias [n*H]  .../{q,k,v}_proj/bias   [n, H]  (Qwen2 only)
  model.layers.i.self_attn.{q,k}_norm.weight[H]     .../{q,k}_norm/scale   [H]     (Qwen3 only)
  model.layers.i.{input,post_attention}_layernorm.weight  layers_i/<same>/scale      [D]
  model.layers.i.mlp.{gate,up}_proj.weight  [F, D]      layers_i/mlp/<same>/kernel   [D, F]
  model.layers.i.mlp.down_proj.weight       [D, F]      layers_i/mlp/down_proj/kernel [F, D]
  model.layers.i.mlp.gate.weight (MoE)      [E, D]      layers_i/mlp/gate/kernel     [D, E]
  model.layers.i.mlp.experts.e.{gate,up}_proj.weight [f, D]  .../experts/{gate,up}_proj [E, D, f]
  model.layers.i.mlp.experts.e.down_proj.weight      [D, f]  .../experts/down_proj     [E, f, D]
  model.norm.weight                                     norm/scale
  lm_head.weight                            [V, D]      lm_head/kernel               [D, V]

Experts are also accepted in the fused layout (``mlp.experts.gate_up_proj [E, 2f, D]``,
``mlp.experts.down_proj [E, D, f]``); they are always written per expert.
"""

import dataclasses
import json
import os
import pathlib
from collections.abc import Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from jetspec_jax import sharding
from jetspec_jax.models import checkpoint_files, decoder, draft_head, gguf_io
from jetspec_jax.models.checkpoint_files import (  # noqa: F401  (re-exported)
  INDEX_FILE,
  SINGLE_FILE,
  CheckpointError,
  read_config,
  read_tensors,
  rope_scaling_from_hf,
  rope_theta_from_hf,
  safetensor_files,
  write_tensors,
)

SUPPORTED_ARCHITECTURES = {
  arch: model_type for model_type, arch in decoder.HF_ARCHITECTURES.items()
}


# Config.


def rope_params_to_hf(cfg) -> dict:
  params = {'rope_type': 'default', 'rope_theta': cfg.rope_theta}
  scaling = getattr(cfg, 'rope_scaling', None)
  if scaling is not None:
    params.update(rope_type='llama3', **dataclasses.asdict(scaling))
  return params


def config_from_hf(hf: Mapping) -> decoder.DecoderConfig:
  """Builds a :class:`DecoderConfig` from a Hugging Face ``config.json`` dict."""
  archs = hf.get('architectures') or []
  model_type = hf.get('model_type')
  known = set(SUPPORTED_ARCHITECTURES.values())
  if model_type not in known or (archs and archs[0] not in SUPPORTED_ARCHITECTURES):
    raise CheckpointError(
      f'unsupported architecture {archs or model_type!r}; supported: '
      f'{sorted(SUPPORTED_ARCHITECTURES)}'
    )
  if model_type == 'qwen2':
    attention_bias = True  # Qwen2 always has q/k/v biases (and none on o_proj)
  elif hf.get('attention_bias'):
    raise CheckpointError(
      f'attention_bias=True is not supported for {model_type} (biases on q/k/v and o_proj)'
    )
  else:
    attention_bias = False
  if hf.get('mlp_bias'):
    raise CheckpointError('mlp_bias=True is not supported')
  if hf.get('use_sliding_window'):
    raise CheckpointError('use_sliding_window=True is not supported')
  if hf.get('hidden_act', 'silu') != 'silu':
    raise CheckpointError(f'hidden_act {hf["hidden_act"]!r} is not supported (silu only)')
  heads = hf['num_attention_heads']
  eos = hf.get('eos_token_id')
  moe = {}
  if model_type == 'qwen3_moe':
    moe = dict(
      num_experts=hf.get('num_experts') or hf['num_local_experts'],
      num_experts_per_tok=hf['num_experts_per_tok'],
      moe_intermediate_size=hf['moe_intermediate_size'],
      norm_topk_prob=bool(hf.get('norm_topk_prob', False)),
      decoder_sparse_step=hf.get('decoder_sparse_step', 1),
      mlp_only_layers=tuple(hf.get('mlp_only_layers') or ()),
    )
  return decoder.DecoderConfig(
    vocab_size=hf['vocab_size'],
    hidden_size=hf['hidden_size'],
    intermediate_size=hf['intermediate_size'],
    num_hidden_layers=hf['num_hidden_layers'],
    num_attention_heads=heads,
    num_key_value_heads=hf.get('num_key_value_heads') or heads,
    head_dim=hf.get('head_dim') or hf['hidden_size'] // heads,
    rope_theta=rope_theta_from_hf(hf),
    rms_norm_eps=hf.get('rms_norm_eps', 1e-6),
    tie_word_embeddings=bool(hf.get('tie_word_embeddings', False)),
    max_position_embeddings=hf.get('max_position_embeddings', 40960),
    eos_token_id=eos[0] if isinstance(eos, list) else eos,
    model_type=model_type,
    qk_norm=model_type in ('qwen3', 'qwen3_moe'),
    attention_bias=attention_bias,
    rope_scaling=rope_scaling_from_hf(hf, allow_scaling=model_type == 'llama'),
    **moe,
  )


def _architecture_fields(cfg, dtype) -> dict:
  """The ``config.json`` fields shared by targets and heads (same attribute names)."""
  return dict(
    vocab_size=cfg.vocab_size,
    hidden_size=cfg.hidden_size,
    intermediate_size=cfg.intermediate_size,
    num_hidden_layers=cfg.num_hidden_layers,
    num_attention_heads=cfg.num_attention_heads,
    num_key_value_heads=cfg.num_key_value_heads,
    head_dim=cfg.head_dim,
    hidden_act='silu',
    max_position_embeddings=cfg.max_position_embeddings,
    rms_norm_eps=cfg.rms_norm_eps,
    rope_theta=cfg.rope_theta,
    rope_parameters=rope_params_to_hf(cfg),
    attention_bias=getattr(cfg, 'attention_bias', False),
    dtype=jnp.dtype(dtype).name,
  )


def config_to_hf(cfg: decoder.DecoderConfig, dtype=jnp.float32) -> dict:
  """The Hugging Face ``config.json`` dict for ``cfg``."""
  hf = dict(
    _architecture_fields(cfg, dtype),
    tie_word_embeddings=cfg.tie_word_embeddings,
    use_sliding_window=False,
    eos_token_id=cfg.eos_token_id,
  )
  if cfg.is_moe:
    hf.update(
      architectures=['Qwen3MoeForCausalLM'],
      model_type='qwen3_moe',
      num_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok,
      moe_intermediate_size=cfg.moe_intermediate_size,
      norm_topk_prob=cfg.norm_topk_prob,
      decoder_sparse_step=cfg.decoder_sparse_step,
      mlp_only_layers=list(cfg.mlp_only_layers),
    )
  else:
    hf.update(architectures=[decoder.HF_ARCHITECTURES[cfg.model_type]], model_type=cfg.model_type)
  if cfg.model_type == 'qwen2':
    del hf['attention_bias']  # implied by the family
  return hf


# Name mapping.

# One entry per Flax leaf: (flax path, HF name, to_flax(hf_array), to_hf(flax_array)).
_Rule = tuple[tuple[str, ...], str, Callable, Callable]


def _t(x):
  return x.T


def _ident(x):
  return x


def _layer_rules(
  lp: str,
  hp: str,
  attn: tuple[str, ...],
  n: int,
  k: int,
  h: int,
  d: int,
  qk_norm: bool = True,
  bias: bool = False,
):
  """Attention projections, q/k norms and the two layer norms of one decoder layer.

  ``lp``/``hp`` are the Flax / HF layer prefixes; ``attn`` is the Flax sub-path of the attention
  parameters (``('self_attn',)`` in the target, ``()`` in the draft head).
  """

  def heads_in(num):  # [num*H, D] <-> [D, num, H]
    return (lambda x: x.T.reshape(d, num, h), lambda x: x.reshape(d, num * h).T)

  for proj, num in (('q_proj', n), ('k_proj', k), ('v_proj', k)):
    yield (lp, *attn, proj, 'kernel'), f'{hp}.self_attn.{proj}.weight', *heads_in(num)
    if bias:
      split = (lambda x, num=num: x.reshape(num, h), lambda x: x.reshape(-1))
      yield (lp, *attn, proj, 'bias'), f'{hp}.self_attn.{proj}.bias', *split
  yield (
    (lp, *attn, 'o_proj', 'kernel'),
    f'{hp}.self_attn.o_proj.weight',
    lambda x: x.T.reshape(n, h, d),
    lambda x: x.reshape(n * h, d).T,
  )
  for norm in ('q_norm', 'k_norm') if qk_norm else ():
    yield (lp, *attn, norm, 'scale'), f'{hp}.self_attn.{norm}.weight', _ident, _ident
  for norm in ('input_layernorm', 'post_attention_layernorm'):
    yield (lp, norm, 'scale'), f'{hp}.{norm}.weight', _ident, _ident


def _mlp_rules(lp: str, hp: str):
  for proj in ('gate_proj', 'up_proj', 'down_proj'):
    yield (lp, 'mlp', proj, 'kernel'), f'{hp}.mlp.{proj}.weight', _t, _t


def _target_rules(cfg: decoder.DecoderConfig) -> Iterator[_Rule]:
  dims = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size)
  yield ('embed_tokens', 'embedding'), 'model.embed_tokens.weight', _ident, _ident
  for i in range(cfg.num_hidden_layers):
    lp, hp = f'layers_{i}', f'model.layers.{i}'
    yield from _layer_rules(lp, hp, ('self_attn',), *dims, cfg.qk_norm, cfg.attention_bias)
    if cfg.is_sparse_layer(i):
      # The router; experts are many HF tensors per Flax leaf (see _expert_leaves).
      yield (lp, 'mlp', 'gate', 'kernel'), f'{hp}.mlp.gate.weight', _t, _t
    else:
      yield from _mlp_rules(lp, hp)
  yield ('norm', 'scale'), 'model.norm.weight', _ident, _ident
  if not cfg.tie_word_embeddings:
    yield ('lm_head', 'kernel'), 'lm_head.weight', _t, _t


def _head_rules(cfg: draft_head.DraftHeadConfig) -> Iterator[_Rule]:
  dims = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size)
  yield ('fc', 'kernel'), 'fc.weight', _t, _t
  yield ('hidden_norm', 'scale'), 'hidden_norm.weight', _ident, _ident
  for i in range(cfg.num_hidden_layers):
    yield from _layer_rules(f'layers_{i}', f'layers.{i}', (), *dims)
    yield from _mlp_rules(f'layers_{i}', f'layers.{i}')
  yield ('norm', 'scale'), 'norm.weight', _ident, _ident
  if cfg.markov_rank:  # DSpark: the Markov stage (Embedding(V, r), Linear(r, V)) and confidence
    yield ('markov', 'embed'), 'markov_head.embed.weight', _ident, _ident
    yield ('markov', 'proj'), 'markov_head.proj.weight', _t, _t
    yield ('confidence', 'kernel'), 'confidence_head.weight', _row_out, _row_in
    yield ('confidence', 'bias'), 'confidence_head.bias', _row_out, _row_in
  if cfg.reads_guesses:  # JetSpec++ / copy-seeded: the vector added to a guessed token's embedding
    yield ('draft_embed',), 'draft_embed.weight', _ident, _ident


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


def _expert_leaves(cfg: decoder.DecoderConfig, tensors: dict[str, np.ndarray], used: set[str]):
  """Yields (flax path, stacked array) for every sparse layer's experts (per-expert or fused)."""
  for i in range(cfg.num_hidden_layers):
    if not cfg.is_sparse_layer(i):
      continue
    hp, path = f'model.layers.{i}.mlp.experts', (f'layers_{i}', 'mlp', 'experts')
    fused_gu, fused_down = f'{hp}.gate_up_proj', f'{hp}.down_proj'
    if fused_gu in tensors and fused_down in tensors:
      gate_up = tensors[fused_gu]  # [E, 2f, D]
      f = gate_up.shape[1] // 2
      used.update((fused_gu, fused_down))
      yield path + ('gate_proj',), np.swapaxes(gate_up[:, :f], 1, 2)
      yield path + ('up_proj',), np.swapaxes(gate_up[:, f:], 1, 2)
      yield path + ('down_proj',), np.swapaxes(tensors[fused_down], 1, 2)
      continue
    for proj in ('gate_proj', 'up_proj', 'down_proj'):
      names = [f'{hp}.{e}.{proj}.weight' for e in range(cfg.num_experts)]
      missing = [name for name in names if name not in tensors]
      if missing:
        raise CheckpointError(
          f'missing tensor {missing[0]} ({len(missing)} expert tensors missing in all)'
        )
      used.update(names)
      yield path + (proj,), np.stack([tensors[name].T for name in names])


def _set(tree: dict, path: tuple[str, ...], value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


def _checked(to_flax, value: np.ndarray, hf_name: str, want: tuple[int, ...]):
  try:
    out = to_flax(value)
  except ValueError as e:
    raise CheckpointError(
      f'shape mismatch for {hf_name}: got {value.shape}, cannot map to {want}'
    ) from e
  if out.shape != want:
    raise CheckpointError(
      f'shape mismatch for {hf_name}: got {value.shape}, expected a tensor that maps to {want}'
    )
  return out


def _map_from_hf(tensors, rules, expected, used: set[str], ignorable=()) -> dict:
  """Applies ``rules``, then checks that every tensor was used (``ignorable`` excepted)."""
  params = {}
  for path, hf_name, to_flax, _ in rules:
    if hf_name not in tensors:
      raise CheckpointError(f'missing tensor {hf_name}')
    used.add(hf_name)
    _set(params, path, _checked(to_flax, tensors[hf_name], hf_name, _get(expected, path).shape))
  unexpected = sorted(set(tensors) - used - set(ignorable))
  if unexpected:
    raise CheckpointError(
      f'unexpected tensor {unexpected[0]} ({len(unexpected)} unexpected in all)'
    )
  return params


def params_from_hf(
  tensors: dict[str, np.ndarray], cfg: decoder.DecoderConfig, dtype=jnp.float32
) -> dict:
  """Maps HF tensors to the target's Flax parameter pytree, checking names and shapes."""
  expected = jax.eval_shape(lambda: decoder.init_params(cfg, jax.random.key(0), dtype))
  used = set()
  experts = list(_expert_leaves(cfg, tensors, used))
  # Some tied checkpoints still store the (identical) LM head; it carries no information.
  ignorable = ('lm_head.weight',) if cfg.tie_word_embeddings else ()
  params = _map_from_hf(tensors, _target_rules(cfg), expected, used, ignorable)
  for path, value in experts:
    want = _get(expected, path).shape
    if value.shape != want:
      raise CheckpointError(
        f'shape mismatch for experts of {".".join(path)}: stacked {value.shape}, expected {want}'
      )
    _set(params, path, value)
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def params_to_hf(params: dict, cfg: decoder.DecoderConfig) -> dict[str, np.ndarray]:
  """The inverse of :func:`params_from_hf` (experts written per expert)."""
  tensors = {
    name: to_hf(np.asarray(_get(params, path))) for path, name, _, to_hf in _target_rules(cfg)
  }
  for i in range(cfg.num_hidden_layers):
    if not cfg.is_sparse_layer(i):
      continue
    experts = params[f'layers_{i}']['mlp']['experts']
    for proj in ('gate_proj', 'up_proj', 'down_proj'):
      stacked = np.asarray(experts[proj])
      for e in range(cfg.num_experts):
        tensors[f'model.layers.{i}.mlp.experts.{e}.{proj}.weight'] = stacked[e].T
  return tensors


# Public entry points.


def load_target(
  path: str | os.PathLike, *, dtype=jnp.float32, attn_impl: str = 'xla', mesh=None
) -> decoder.Target:
  """Loads a Hugging Face checkpoint directory or a GGUF file as a :class:`Target`.

  Args:
    path: directory with ``config.json`` and ``model.safetensors`` (or a sharded index), a
      ``.gguf`` file (Llama / Qwen2 / Qwen3; converted once and cached, see
      :mod:`jetspec_jax.models.gguf_io`), or a Hugging Face model id (``'Qwen/Qwen3-0.6B'``)
      already in the local Hugging Face cache.
    dtype: parameter and compute dtype (float32 for parity, bfloat16 on accelerators).
    attn_impl: ``'xla'``, ``'pallas'`` or ``'pallas_mosaic'`` (:mod:`pallas_kernels.dispatch`).
    mesh: a ``('data', 'model')`` mesh to place the parameters on (tensor-parallel over
      ``'model'``, see :mod:`jetspec_jax.sharding`); default: the default device.

  Raises:
    FileNotFoundError: the directory, ``config.json`` or the weights are missing.
    CheckpointError: unsupported architecture, missing/unexpected tensors, shape mismatches,
      unreadable files.
  """
  if attn_impl not in decoder.ATTN_IMPLS:
    raise ValueError(f'attn_impl must be one of {decoder.ATTN_IMPLS}, got {attn_impl!r}')
  path = checkpoint_files.resolve(path)
  if path.suffix == '.gguf':
    path = gguf_io.cached_checkpoint(path)
  cfg = config_from_hf(read_config(path))
  params = params_from_hf(read_tensors(path), cfg, dtype)
  if mesh is not None:
    params = sharding.shard_params(params, mesh)
  return decoder.Target(cfg=cfg, params=params, attn_impl=attn_impl)


def save_target(
  target: decoder.Target, path: str | os.PathLike, *, max_shard_bytes: int | None = None
) -> None:
  """Writes ``target`` as a Hugging Face checkpoint that ``transformers`` loads."""
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  tensors = params_to_hf(jax.device_get(target.params), target.cfg)
  write_tensors(tensors, path, max_shard_bytes=max_shard_bytes)
  (path / 'config.json').write_text(json.dumps(config_to_hf(target.cfg, target.dtype), indent=2))


# Draft heads (the released JetSpec / DFlash layout).

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
    _architecture_fields(cfg, dtype),
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
      _checked(_ident, tensors[CALIBRATION_TENSOR], CALIBRATION_TENSOR, (cfg.block_size,)),
      jnp.float32,
    )
  draft_vocab = draft_vocab_from_tensors(tensors, cfg.vocab_size, path)
  params = _map_from_hf(
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
    name: to_hf(np.asarray(_get(params, p))) for p, name, _, to_hf in _head_rules(head.cfg)
  }
  if head.calibration is not None:
    tensors[CALIBRATION_TENSOR] = np.asarray(head.calibration, np.float32)
  if head.draft_vocab is not None:
    tensors.update(draft_vocab_tensors(jax.device_get(head.draft_vocab), head.cfg.vocab_size))
  write_tensors(tensors, path)
  (path / 'config.json').write_text(json.dumps(head_config_to_hf(head.cfg, head.dtype), indent=2))
