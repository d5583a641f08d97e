"""Multi-host training: two processes (coordinator on 127.0.0.1, CPU collectives through gloo) run
``train_and_evaluate`` as on a two-host slice: each generates its own data shards, they train
one head over a mesh spanning both, are killed 5 steps after a checkpoint, resume, and end with
the parameters one 2-device process gets from the same config."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import safetensors.numpy

RUN = """
import os, sys
process_id, workdir, kill_at = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
import jax
from jetspec_jax import sharding, training
from jetspec_jax.training import shards as shards_lib
from experiments.configs.train import draft_tiny
write_shard = shards_lib.write_shard
def recording_write_shard(path, *args, **kwargs):
  print('WROTE', jax.process_index(), path.name, flush=True)
  return write_shard(path, *args, **kwargs)
shards_lib.write_shard = recording_write_shard
from jetspec_jax.training import loop
write_metrics = loop.MetricWriter.write
def killing_write(self, step, metrics):  # a crash: gone at once, nothing saved since
  if step == kill_at:
    os._exit(17)
  return write_metrics(self, step, metrics)
loop.MetricWriter.write = killing_write
if process_id >= 0:
  assert sharding.maybe_initialize_distributed()  # JAX_COORDINATOR_ADDRESS and friends
assert jax.device_count() == 2, jax.devices()
config = draft_tiny.get_config('runlocal')
config.data.update(num_prompts=16, shard_size=4)
config.train.update(steps=20, log_every=5, checkpoint_every=10)
config.eval.update(num_prompts=0)
result = training.train_and_evaluate(config, workdir)
print('DONE', jax.process_index(), result['steps'], flush=True)
"""


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def run_processes(workdir, kill_at: int = 0, *, two_processes: bool) -> list[str]:
  """Runs RUN in one 2-device process or in two 1-device processes (killed at step ``kill_at``
  when given); returns their stdout."""
  base = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  flags = os.environ.get('XLA_FLAGS', '')  # the suite's (tests/conftest.py), plus the devices
  if not two_processes:
    env = {**base, 'XLA_FLAGS': f'{flags} --xla_force_host_platform_device_count=2'}
    cmd = [sys.executable, '-c', RUN, '-1', str(workdir), str(kill_at)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0 and 'DONE 0' in out.stdout, out.stderr[-3000:]
    return [out.stdout]
  port = free_port()
  procs = []
  for i in range(2):
    env = {
      **base,
      'XLA_FLAGS': f'{flags} --xla_force_host_platform_device_count=1',
      'JAX_COORDINATOR_ADDRESS': f'127.0.0.1:{port}',
      'JAX_NUM_PROCESSES': '2',
      'JAX_PROCESS_ID': str(i),
    }
    cmd = [sys.executable, '-c', RUN, str(i), str(workdir), str(kill_at)]
    procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env))
  outputs = []
  for i, p in enumerate(procs):
    stdout, stderr = p.communicate(timeout=900)
    if kill_at:
      assert p.returncode == 17, stderr.decode()[-3000:]
    else:
      assert p.returncode == 0 and f'DONE {i}' in stdout.decode(), stderr.decode()[-3000:]
    outputs.append(stdout.decode())
  return outputs


def exported(workdir):
  return safetensors.numpy.load_file(workdir / 'export' / 'model.safetensors')


def test_two_processes_generate_train_resume_like_one_two_device_process(tmp_path):
  multi, single = tmp_path / 'multi', tmp_path / 'single'
  killed = run_processes(multi, kill_at=15, two_processes=True)  # 5 steps after a checkpoint
  assert sorted(p.name for p in (multi / 'checkpoints').iterdir()) == ['10']
  assert not (multi / 'export').exists()
  # Each process wrote its own shards: process i shards i and i + 2.
  wrote = [line for out in killed for line in out.splitlines() if line.startswith('WROTE')]
  assert wrote == [
    'WROTE 0 shard_00000.npz',
    'WROTE 0 shard_00002.npz',
    'WROTE 1 shard_00001.npz',
    'WROTE 1 shard_00003.npz',
  ], wrote
  resumed = run_processes(multi, two_processes=True)  # from the step-10 checkpoint to 20
  assert not any('WROTE' in out for out in resumed)  # the data was there
  run_processes(single, two_processes=False)
  for name in [f'shard_{i:05d}.npz' for i in range(4)]:  # the same data as one process's
    np.testing.assert_array_equal(
      np.load(multi / 'data' / name)['tokens'], np.load(single / 'data' / name)['tokens']
    )
  # One writer, process 0: steps 5 and 10 before the kill, 15 and 20 after the resume.
  steps = [json.loads(line)['step'] for line in (multi / 'metrics.jsonl').read_text().splitlines()]
  assert steps == [5, 10, 15, 20], steps
  assert json.loads((multi / 'result.json').read_text())['steps'] == 20
  got, want = exported(multi), exported(single)
  assert got.keys() == want.keys()
  for name in want:
    np.testing.assert_allclose(got[name], want[name], atol=2e-5, err_msg=name)
