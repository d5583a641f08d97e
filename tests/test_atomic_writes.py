"""Shard and feature files under concurrent writers: whole files only, each shard written once."""

import os
import socket
import threading
import time

import numpy as np
import pytest
from etils import epath

import jetspec_jax as js
from jetspec_jax.training import data as data_lib
from jetspec_jax.training import shards as shards_lib


def test_concurrent_writers_and_readers_see_whole_files(tmp_path):
  """Four writers rewrite one file 150 times each while a reader reads it: no writer fails and
  every read is one writer's whole payload (a fixed temporary name failed both ways)."""
  path = epath.Path(tmp_path / 'shard.npz')
  payloads = [bytes([k]) * (200_000 + k) for k in range(4)]
  shards_lib.write_atomically(path, payloads[0], '.tmp.npz')
  errors, reads, stop = [], [], threading.Event()

  def write(k):
    try:
      for _ in range(150):
        shards_lib.write_atomically(path, payloads[k], '.tmp.npz')
    except Exception as e:  # noqa: BLE001 - the test reports any failure
      errors.append(e)

  def read():
    while not stop.is_set():
      reads.append(path.read_bytes())

  reader = threading.Thread(target=read)
  reader.start()
  writers = [threading.Thread(target=write, args=(k,)) for k in range(4)]
  for w in writers:
    w.start()
  for w in writers:
    w.join()
  stop.set()
  reader.join()
  assert not errors, errors
  assert reads and all(r in payloads for r in reads)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['shard.npz']  # no temporary left


def test_shard_claim_is_exclusive_and_stale_claims_are_taken_over(tmp_path):
  path = tmp_path / 'shard_00000.npz'
  with shards_lib.ShardClaim(path) as first:
    with shards_lib.ShardClaim(path) as second:
      assert first and not second
  assert not (tmp_path / 'shard_00000.npz.claim').exists()
  # A claim of a process of this host that is gone: taken over.
  (tmp_path / 'shard_00000.npz.claim').write_text(f'{socket.gethostname()} {2**22 + 12345}')
  with shards_lib.ShardClaim(path) as taken:
    assert taken
  # A live claimer (this process) keeps its claim.
  (tmp_path / 'shard_00000.npz.claim').write_text(f'{socket.gethostname()} {os.getpid()}')
  with shards_lib.ShardClaim(path) as refused:
    assert not refused


def test_side_by_side_generation_writes_each_shard_once(tmp_path):
  """A shard another live process has claimed is left to it; ``wait=True`` returns once that
  process has written it, and the shard is not rewritten."""
  target = js.testing.tiny_target(0)
  prompts = [js.testing.random_ids(i, (5,), target.cfg.vocab_size) for i in range(4)]
  out = tmp_path / 'stage1'
  out.mkdir()
  claim = out / 'shard_00001.npz.claim'
  claim.write_text(f'{socket.gethostname()} {os.getpid()}')  # "another process" holds shard 1

  def other_process():
    time.sleep(3.0)
    shards_lib.write_shard(epath.Path(out / 'shard_00001.npz'), [np.array([7, 7])], [[0, 1]], 4)
    claim.unlink()

  helper = threading.Thread(target=other_process)
  helper.start()
  kwargs = dict(max_len=12, max_new_tokens=3, shard_size=2, batch_size=2, progress=False)
  paths = data_lib.generate_dataset(target, prompts, out, wait=True, poll_s=0.2, **kwargs)
  helper.join()
  assert all(p.exists() for p in paths)
  assert shards_lib.load_shard(paths[1])['tokens'][0, :2].tolist() == [7, 7]  # not regenerated
  assert len(shards_lib.load_shard(paths[0])['lengths']) == 2


@pytest.mark.parametrize('wait', [False])
def test_without_wait_a_claimed_shard_is_skipped(tmp_path, wait):
  target = js.testing.tiny_target(0)
  prompts = [js.testing.random_ids(i, (5,), target.cfg.vocab_size) for i in range(2)]
  (tmp_path / 'shard_00000.npz.claim').write_text(f'{socket.gethostname()} {os.getpid()}')
  kwargs = dict(max_len=12, max_new_tokens=3, shard_size=2, batch_size=2, progress=False)
  paths = data_lib.generate_dataset(target, prompts, tmp_path, wait=wait, **kwargs)
  assert not paths[0].exists()
