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

from jetspec_jax import sharding
from jetspec_jax.models import checkpoint_files, decoder, model_cache
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


def architecture_fields(cfg, dtype) -> dict:
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
    architecture_fields(cfg, dtype),
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
Rule = tuple[tuple[str, ...], str, Callable, Callable]


def transposed(x):
  return x.T


def identity(x):
  return x


def layer_rules(
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
    yield (lp, *attn, norm, 'scale'), f'{hp}.self_attn.{norm}.weight', identity, identity
  for norm in ('input_layernorm', 'post_attention_layernorm'):
    yield (lp, norm, 'scale'), f'{hp}.{norm}.weight', identity, identity


def mlp_rules(lp: str, hp: str):
  for proj in ('gate_proj', 'up_proj', 'down_proj'):
    yield (lp, 'mlp', proj, 'kernel'), f'{hp}.mlp.{proj}.weight', transposed, transposed


def _target_rules(cfg: decoder.DecoderConfig) -> Iterator[Rule]:
  dims = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size)
  yield ('embed_tokens', 'embedding'), 'model.embed_tokens.weight', identity, identity
  for i in range(cfg.num_hidden_layers):
    lp, hp = f'layers_{i}', f'model.layers.{i}'
    yield from layer_rules(lp, hp, ('self_attn',), *dims, cfg.qk_norm, cfg.attention_bias)
    if cfg.is_sparse_layer(i):
      # The router; experts are many HF tensors per Flax leaf (see _expert_leaves).
      yield (lp, 'mlp', 'gate', 'kernel'), f'{hp}.mlp.gate.weight', transposed, transposed
    else:
      yield from mlp_rules(lp, hp)
  yield ('norm', 'scale'), 'model.norm.weight', identity, identity
  if not cfg.tie_word_embeddings:
    yield ('lm_head', 'kernel'), 'lm_head.weight', transposed, transposed


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


def set_path(tree: dict, path: tuple[str, ...], value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def get_path(tree: dict, path: tuple[str, ...]):
  for key in path:
    tree = tree[key]
  return tree


def checked(to_flax, value: np.ndarray, hf_name: str, want: tuple[int, ...]):
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


def map_from_hf(tensors, rules, expected, used: set[str], ignorable=()) -> dict:
  """Applies ``rules``, then checks that every tensor was used (``ignorable`` excepted)."""
  params = {}
  for path, hf_name, to_flax, _ in rules:
    if hf_name not in tensors:
      raise CheckpointError(f'missing tensor {hf_name}')
    used.add(hf_name)
    set_path(
      params, path, checked(to_flax, tensors[hf_name], hf_name, get_path(expected, path).shape)
    )
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
  params = map_from_hf(tensors, _target_rules(cfg), expected, used, ignorable)
  for path, value in experts:
    want = get_path(expected, path).shape
    if value.shape != want:
      raise CheckpointError(
        f'shape mismatch for experts of {".".join(path)}: stacked {value.shape}, expected {want}'
      )
    set_path(params, path, value)
  return jax.tree.map(lambda x: jnp.asarray(x, dtype), params)


def params_to_hf(params: dict, cfg: decoder.DecoderConfig) -> dict[str, np.ndarray]:
  """The inverse of :func:`params_from_hf` (experts written per expert)."""
  tensors = {
    name: to_hf(np.asarray(get_path(params, path))) for path, name, _, to_hf in _target_rules(cfg)
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
    path = model_cache.cached_checkpoint(path)
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
