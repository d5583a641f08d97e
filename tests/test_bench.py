"""The shared benchmark library: settings, summaries, the lossless check, tables."""

import json

import numpy as np
import pytest

import jetspec_jax as js
from experiments.tasks import bench
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
  assert settings[2].method == js.methods.Tree(budget=8, width=7, algorithm='accum_logp')
  deeper = bench.Setting(js.methods.Tree(8, 7, 'best_first', depth_bonus=0.5), 'jetspec')
  assert deeper.name == 'tree/jetspec/best_first/8/depth_bonus0.5'
  with pytest.raises(TypeError, match='method value'):
    bench.Setting('tree', 'jetspec')
  with pytest.raises(ValueError, match='head'):
    bench.Setting(js.methods.AR(), 'jetspec')
  with pytest.raises(ValueError, match='head'):
    bench.Setting(js.methods.Chain())
  dspark = bench.head_settings(
    ['jetspec', 'ds', 'pp'],
    budgets=(8,),
    algorithms=('accum_logp',),
    kinds=dict(jetspec='jetspec', ds='dspark', pp='jetspecpp'),
    dspark_verify=(('threshold', 0.0), ('threshold', 0.3), ('scheduler', 0.0)),
    jetspecpp_variants=((True, 1),),
    copy_lens=(0, 4),
  )
  assert [s.name for s in dspark][1:] == [
    'chain/jetspec',
    'chain/jetspec/copy4',
    'tree/jetspec/accum_logp/8',
    'tree/jetspec/accum_logp/8/copy4',
    'dspark/ds/threshold0',
    'dspark/ds/threshold0.3',
    'dspark/ds/scheduler',
    'jetspecpp/pp/accum_logp/8/recycle/passes1',
    'jetspecpp/pp/accum_logp/8/recycle/passes1/copy4',
  ]
  assert dspark[6].method == js.methods.DSpark(verify_length='threshold', threshold=0.3)
  assert dspark[6].row()['threshold'] == 0.3 and dspark[6].row()['budget'] is None
  assert dspark[-1].row()['copy_len'] == 4 and dspark[-1].row()['refine_passes'] == 1


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


def test_cpu_description_names_the_bf16_units(tmp_path):
  info = tmp_path / 'cpuinfo'
  info.write_text('processor\t: 0\nmodel name\t: Xeon X\nflags\t\t: sse avx512_bf16 amx_bf16\n')
  assert bench.cpu_description(str(info)) == 'Xeon X (amx_bf16, avx512_bf16)'
  info.write_text('model name\t: EPYC Y\nflags\t\t: sse avx2\n')
  assert bench.cpu_description(str(info)) == 'EPYC Y (no amx_bf16 / avx512_bf16)'
  assert bench.cpu_description(str(tmp_path / 'missing'))  # the architecture, not an error


def test_measure_interleaved_decodes_prompt_by_prompt_in_rotating_order(monkeypatch):
  calls = []

  def fake_generate(target, head, prompt, *, seed, method, **kwargs):
    calls.append((method.name, int(prompt[0]), seed))
    return fake_output([int(prompt[0])], [1], 0.1)

  monkeypatch.setattr(js, 'generate', fake_generate)
  settings = bench.head_settings(['jetspec'], budgets=(8,), algorithms=('accum_logp',))
  prompts = [np.array([10]), np.array([11]), np.array([12])]
  heads = dict(jetspec=object())
  outputs = bench.measure_interleaved(None, heads, settings, prompts, max_new_tokens=4)
  warmups = [('ar', 10, 0), ('chain', 10, 0), ('tree', 10, 0)]
  assert calls[:3] == warmups  # every setting compiles before any timed decode
  assert calls[3:] == [
    ('ar', 10, 0), ('chain', 10, 0), ('tree', 10, 0),
    ('chain', 11, 1), ('tree', 11, 1), ('ar', 11, 1),
    ('tree', 12, 2), ('ar', 12, 2), ('chain', 12, 2),
  ]  # fmt: skip
  assert list(outputs) == [s.name for s in settings]
  for outs in outputs.values():  # each setting's outputs in prompt order
    assert [int(o.tokens[0]) for o in outs] == [10, 11, 12]
  with pytest.raises(ValueError, match='distinct'):
    bench.measure_interleaved(None, heads, settings + settings[:1], prompts, max_new_tokens=4)
