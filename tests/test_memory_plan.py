"""The Qwen3-8B head recipe fits 16 GiB chips (v5e) on an 8-device mesh.

The per-device memory of one training step at the config's batch (16 x 4096, 512 anchors) and
of one data-generation call, from XLA's ``memory_analysis()`` of the jitted functions lowered
on abstract, sharded arrays (8 forced CPU devices; no weights). The README's table comes from
the same binary over more meshes.
"""

import json
import os
import subprocess
import sys

import pytest

V5E_GIB = 16.0


@pytest.mark.slow  # ~100 s of compiles: `make test-slow`; the README's table has the command
def test_qwen3_8b_recipe_fits_16_gib_per_device(tmp_path):
  out = tmp_path / 'memory'
  env = {
    **os.environ,
    'JAX_PLATFORMS': 'cpu',
    'XLA_FLAGS': '--xla_force_host_platform_device_count=8',
  }
  cmd = [
    sys.executable,
    '-m',
    'experiments.microbench',
    '--task=memory',
    '--config=experiments/configs/train/draft_qwen3_8b.py',
    '--target_preset=qwen3_8b',
    '--meshes=1x8',
    f'--out={out}',
  ]
  run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  report = json.loads(out.with_suffix('.json').read_text())
  assert report['devices'] == '8 x cpu'
  rows = {r['stage']: r for r in report['rows']}
  train, generate = rows['train step'], rows['data generation']
  assert (train['batch'], train['seq_len'], train['micro_batches']) == (16, 4096, 16)
  assert generate['seq_len'] == 4096
  # The frozen bf16 target (16.4 GB) and the ~1B-parameter head with float32 Adam state
  # (12.6 GB) are split 8 ways: arguments alone are over 3 GiB; everything under 16 GiB.
  assert 3.0 < train['arguments_gib'] < train['total_gib'] < V5E_GIB, train
  assert 1.5 < generate['arguments_gib'] < generate['total_gib'] < V5E_GIB, generate
