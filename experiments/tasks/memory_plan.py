"""Per-device memory of a head-training step and of data generation on a device mesh, computed
without weights or accelerators: the jitted functions are lowered on abstract, sharded arrays
and compiled, and XLA's ``memory_analysis()`` gives arguments + temporaries per device.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
    python -m experiments.microbench --task=memory \\
      --config=experiments/configs/train/draft_qwen3_8b.py \\
      --target_preset=qwen3_8b --meshes=1x8,2x4,8x1+fsdp --out=benchmarks/memory_qwen3_8b

The compile is XLA:CPU's (forced host devices stand in for the chips): it upcasts some bfloat16
work to float32, so accelerator figures are expected at or below these.
"""

import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
from absl import flags, logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import config_flags

from jetspec_jax import decoding, rounds, sharding
from jetspec_jax.models import decoder
from jetspec_jax.models import draft_head as dh
from jetspec_jax.rounds import Sampling
from jetspec_jax.training import head_step, run_config
from jetspec_jax.training import loop as loop_lib

GIB = 2**30


_CONFIG = None  # set by define_flags
_PRESET = None  # set by define_flags
_MESHES = None  # set by define_flags
_OUT = None  # set by define_flags


def abstract_target(cfg: decoder.DecoderConfig, dtype, mesh, *, fsdp: bool = False):
  """A :class:`decoder.Target` of shape structs placed on ``mesh`` (no weights)."""
  shapes = jax.eval_shape(functools.partial(decoder.init_params, cfg), jax.random.key(0))
  specs = sharding.param_specs(shapes, mesh, fsdp=fsdp)
  params = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype, sharding=NamedSharding(mesh, s)),
    shapes,
    specs,
  )
  return decoder.Target(cfg=cfg, params=params)


def _report(analysis) -> dict:
  args, temp = analysis.argument_size_in_bytes, analysis.temp_size_in_bytes
  out = analysis.output_size_in_bytes - analysis.alias_size_in_bytes  # donated: written in place
  return dict(
    arguments_gib=args / GIB, temporaries_gib=temp / GIB, total_gib=(args + temp + out) / GIB
  )


def train_step_memory(config, target_cfg: decoder.DecoderConfig, mesh) -> dict:
  """Per-device bytes of one head-training step (``config.train``: batch, anchors, micro
  batches, anchor chunks; the target runs inside the step, as for a model whose features are
  not stored)."""
  fsdp = bool(config.mesh.get('fsdp', False))
  dtype = run_config.target_dtype(config.target.get('dtype', 'auto'))
  if config.target.get('dtype', 'auto') == 'auto':
    dtype = jnp.bfloat16  # what 'auto' is on the accelerators this plans for
  target = abstract_target(target_cfg, dtype, mesh, fsdp=fsdp)
  head_cfg = run_config.head_config(config.head, target_cfg)
  settings = run_config.step_settings(config.train)
  optimizer = loop_lib.make_optimizer(lr=1e-4, steps=100, warmup_steps=1)
  step = head_step.make_train_step(target, head_cfg, optimizer, settings, mesh, fsdp=fsdp)
  state = jax.eval_shape(
    lambda: loop_lib.init_state(
      dh.init_head_params(head_cfg, jax.random.key(0), jnp.float32), optimizer
    )
  )
  placement = step.state_shardings(state)
  state = jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, placement
  )
  b, length = config.train.global_batch, config.data.max_len
  rows = NamedSharding(mesh, P('data'))
  batch = dict(
    tokens=jax.ShapeDtypeStruct((b, length), jnp.int32, sharding=rows),
    loss_mask=jax.ShapeDtypeStruct((b, length), jnp.uint8, sharding=rows),
    lengths=jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows),
    index=jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows),
  )
  analysis = step.lower(state, batch, jax.random.key(0)).compile().memory_analysis()
  return dict(stage='train step', batch=b, seq_len=length, **_report(analysis))


def generation_memory(config, target_cfg: decoder.DecoderConfig, mesh) -> dict:
  """Per-device bytes of one data-generation call (``rounds.ar_loop``: prefill, then greedy
  decoding to ``data.max_len`` for ``data.generate_batch`` prompts, batch over ``'data'``; the
  KV cache dominates)."""
  target = abstract_target(target_cfg, jnp.bfloat16, mesh, fsdp=bool(config.mesh.fsdp))
  b = config.data.generate_batch
  new = config.data.max_new_tokens
  prompt_len = config.data.max_len - new
  rows = NamedSharding(mesh, P('data'))
  prompts = jax.ShapeDtypeStruct((b, prompt_len), jnp.int32, sharding=rows)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32, sharding=rows)
  eos = decoding.stop_ids(None, target_cfg.eos_token_id, target_cfg.vocab_size)
  sampling = Sampling(0.0, 0, 1.0, eos)
  lowered = rounds.ar_loop.lower(
    target,
    prompts,
    lengths,
    jax.random.key(0),
    capacity=config.data.max_len,
    max_new_tokens=new,
    sampling=sampling,
  )
  analysis = lowered.compile().memory_analysis()
  return dict(stage='data generation', batch=b, seq_len=config.data.max_len, **_report(analysis))


def plan(config, target_cfg: decoder.DecoderConfig, meshes) -> list[dict]:
  rows = []
  for name in meshes:
    shape, _, option = name.partition('+')
    data, model = (int(x) for x in shape.split('x'))
    mesh = sharding.make_mesh(data, model)
    cfg = config.copy_and_resolve_references()
    cfg.mesh.fsdp = option == 'fsdp'
    # The global batch stays the config's; each data shard then runs global / data sequences,
    # micro-batched down to one per device.
    micro = max(1, cfg.train.global_batch // data)
    cfg.train.micro_batches = micro
    for stage in (train_step_memory, generation_memory):
      row = dict(mesh=name, **stage(cfg, target_cfg, mesh))
      if stage is train_step_memory:
        row['micro_batches'] = micro
      logging.info('%s', row)
      rows.append(row)
  return rows


def markdown(rows: list[dict]) -> str:
  lines = [
    '| mesh (data x model) | stage | batch x length | micro-batches | arguments | temporaries '
    '| total per device |',
    '|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    lines.append(
      f'| {r["mesh"]} | {r["stage"]} | {r["batch"]} x {r["seq_len"]} '
      f'| {r.get("micro_batches", "-")} '
      f'| {r["arguments_gib"]:.2f} GiB | {r["temporaries_gib"]:.2f} GiB '
      f'| **{r["total_gib"]:.2f} GiB** |'
    )
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  config = _CONFIG.value
  target_cfg = decoder.PRESETS[_PRESET.value]()
  rows = plan(config, target_cfg, _MESHES.value)
  print(markdown(rows))
  if _OUT.value:
    out = pathlib.Path(_OUT.value)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
      devices=f'{jax.device_count()} x {jax.devices()[0].platform}',
      target=_PRESET.value,
      head=dataclasses.asdict(run_config.head_config(config.head, target_cfg)),
    )
    out.with_suffix('.json').write_text(json.dumps(dict(**meta, rows=rows), indent=2, default=str))
    out.with_suffix('.md').write_text(markdown(rows))


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  global _CONFIG, _PRESET, _MESHES, _OUT
  _CONFIG = config_flags.DEFINE_config_file('config', 'experiments/configs/train/draft_qwen3_8b.py')
  _PRESET = flags.DEFINE_string('target_preset', 'qwen3_8b', 'decoder.PRESETS name of the target')
  _MESHES = flags.DEFINE_list(
    'meshes', ['1x8', '2x4', '8x1+fsdp'], 'data x model meshes to analyse (+fsdp: mesh.fsdp)'
  )
  _OUT = flags.DEFINE_string('out', '', 'write <out>.json and <out>.md')
