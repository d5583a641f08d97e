"""Sharded generation and training on 4 fake CPU devices equal the single-device results."""

import os
import subprocess
import sys
import types

import jax
import pytest

import jetspec_jax as js
from jetspec_jax import sharding

SCRIPT = r"""
import os
flags = os.environ.get("XLA_FLAGS", "")  # the suite flags, plus the devices
os.environ["XLA_FLAGS"] = flags + " --xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
import jetspec_jax as js
from jetspec_jax import sharding
from jetspec_jax.models import draft_head as dh
from jetspec_jax.training import head_sums, head_step, loop as loop_lib
assert jax.device_count() == 4
dims = dict(vocab_size=64, hidden_size=48, intermediate_size=64, num_attention_heads=8,
            num_key_value_heads=4, head_dim=16)
for moe in (False, True):
  extra = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if moe else {}
  target = js.testing.tiny_target(0, moe=moe, **dims, **extra)
  head = js.testing.random_draft_head(target, block_size=5, seed=1)
  prompts = [np.arange(1, 10) % 64, np.arange(5, 9)]
  tree = js.methods.Tree(budget=16, width=3)
  want = [o.tokens for o in js.generate(target, head, prompts, max_new_tokens=16, method=tree)]
  opt = loop_lib.make_optimizer(lr=1e-2, steps=4, warmup_steps=1)
  settings = head_sums.StepSettings(num_anchors=4, loss="fkl", loss_chunk=4)
  batch = dict(tokens=jnp.asarray(np.arange(4 * 24).reshape(4, 24) % 64, jnp.int32),
               loss_mask=jnp.ones((4, 24), jnp.uint8), lengths=jnp.full((4,), 24, jnp.int32),
               index=jnp.arange(4, dtype=jnp.int32))

  def train(target, mesh):
    step = head_step.make_train_step(target, head.cfg, opt, settings, mesh)
    state = loop_lib.init_state(jax.tree.map(jnp.copy, head.params), opt)  # steps donate
    for s in range(2):
      state, _ = step(state, batch, jax.random.key(s))
      jax.block_until_ready(state)
    return jax.device_get(state.params)

  ref_params = train(target, sharding.make_mesh(1, 1))
  # Dense: mixed data x model; MoE: pure model (experts split over 'model'). Pure data parallel
  # and FSDP steps are compared with one device in tests/test_training.py.
  for data, model in ((1, 4),) if moe else ((2, 2),):
    mesh = sharding.make_mesh(data, model)
    t = target.replace(params=sharding.shard_params(target.params, mesh))
    h = head.replace(params=sharding.shard_params(head.params, mesh))
    q = t.params["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, "model", None), q.sharding
    got = [o.tokens for o in js.generate(t, h, prompts, max_new_tokens=16, method=tree)]
    for a, b in zip(got, want):
      np.testing.assert_array_equal(a, b)
    params = train(t, mesh)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=3e-5), params, ref_params)
    print("OK", moe, data, model)
"""


def test_sharded_generation_and_training_match_one_device():
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  out = subprocess.run(
    [sys.executable, '-c', SCRIPT], capture_output=True, text=True, env=env, timeout=900
  )
  assert out.returncode == 0, out.stderr[-4000:]
  assert out.stdout.count('OK') == 2


def test_rules_degrade_to_replication():
  fake = types.SimpleNamespace(shape={'data': 1, 'model': 3})
  P = jax.sharding.PartitionSpec
  assert sharding._fit(P('model', None), (67, 44), fake) == P(None, None)
  assert sharding._fit(P(None, 'model', None), (44, 6, 14), fake) == P(None, 'model', None)
  mesh = sharding.make_mesh(1, 1)
  target = js.testing.tiny_target(0)
  specs = sharding.param_specs(target.params, mesh)
  assert specs['layers_0']['mlp']['down_proj']['kernel'] == jax.sharding.PartitionSpec(
    'model', None
  )
  with pytest.raises(ValueError, match='needs 8 devices'):
    sharding.make_mesh(4, 2)
