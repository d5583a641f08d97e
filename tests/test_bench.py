"""The shared benchmark library: settings, summaries, the lossless check, tables."""

import json

import numpy as np
import pytest

from experiments import bench
from jetspec_jax.decoding import GenerateOutput, GenerationStats


def fake_output(tokens, taus, wall):
  stats = GenerationStats(
    new_tokens=len(tokens), rounds=len(taus), tau=np.asarray(taus), wall_s=wall
  )
  return GenerateOutput(tokens=np.asarray(tokens), stats=stats)


def test_settings_name_and_validate():
  settings = bench.head_settings(['jetspec'], budgets=(8, 16), algorithms=('accum_logp',))
  assert [s.name for s in settings] == [
    'ar',
    'chain/jetspec',
    'tree/jetspec/accum_logp/8',
    'tree/jetspec/accum_logp/16',
  ]
  assert settings[2].generate_kwargs() == dict(
    method='tree', budget=8, width=7, tree_algorithm='accum_logp'
  )
  with pytest.raises(ValueError, match='method'):
    bench.Setting('beam', 'jetspec')
  with pytest.raises(ValueError, match='head'):
    bench.Setting('ar', 'jetspec')
  with pytest.raises(ValueError, match='head'):
    bench.Setting('chain')
  with pytest.raises(ValueError, match='budget'):
    bench.Setting('tree', 'jetspec')
  dspark = bench.head_settings(
    ['jetspec', 'ds'],
    budgets=(8,),
    algorithms=('accum_logp',),
    kinds=dict(jetspec='jetspec', ds='dspark'),
    dspark_verify=(('threshold', 0.0), ('threshold', 0.3), ('scheduler', 0.0)),
  )
  assert [s.name for s in dspark][3:] == [
    'dspark/ds/threshold0',
    'dspark/ds/threshold0.3',
    'dspark/ds/scheduler',
  ]
  assert dspark[4].generate_kwargs() == dict(
    method='dspark', verify_length='threshold', threshold=0.3
  )
  with pytest.raises(ValueError, match='verify_length'):
    bench.Setting('dspark', 'ds')


def test_summarize_counts_tau_tokens_and_speedup():
  outs = [fake_output([1, 2, 3, 4], [1, 3], 2.0), fake_output([5, 6], [2], 1.0)]
  s = bench.summarize(outs, ar_wall_s=6.0)
  assert s['tokens'] == 6 and s['wall_s'] == 3.0
  assert s['tau'] == pytest.approx(2.0) and s['tps'] == pytest.approx(2.0)
  assert s['speedup'] == pytest.approx(2.0)
  assert s['tau_histogram'][:4] == [0, 1, 1, 1]
  json.dumps(s)  # plain types only


def test_check_lossless_names_the_prompt():
  ar = [fake_output([1, 2], [1, 1], 1.0), fake_output([3, 4], [1, 1], 1.0)]
  bench.check_lossless('tree', [fake_output([1, 2], [2], 1.0), ar[1]], ar)
  with pytest.raises(AssertionError, match='prompt 1'):
    bench.check_lossless('tree', [ar[0], fake_output([3, 5], [2], 1.0)], ar)


def test_markdown_and_write_result(tmp_path):
  table = bench.markdown((('a', '{a}'), ('b', '{b:.1f}')), [dict(a='x', b=1.25)])
  assert table == '| a | b |\n|---|---|\n| x | 1.2 |\n'
  path = bench.write_result({'rows': [1]}, tmp_path / 'out', 'r', table)
  assert json.loads(path.read_text()) == {'rows': [1]}
  assert (tmp_path / 'out' / 'r.md').read_text() == table
