"""The text around the code: the front page stays short, every cited file exists, no file speaks of
how it was made, every asset has a card whose front matter parses, and every generated table in
the documents equals what its result file renders to."""

import json
import pathlib
import re

import pytest
import yaml

from jetspec_jax.evaluation import doc_tables

ROOT = pathlib.Path(__file__).parent.parent

# Words that describe how the repository was made instead of what it is: numbered work periods,
# issue numbers, remarks about the machine's state, and a style guide that is not in the repository.
FORBIDDEN = (
  r'\bsessions?\b',
  r'\bissues? #?\d',
  r'\bthe VM\b',
  r'\bquiet machine',
  r'\bslow(?:er)? day\b',
  r'\bmachine was busy',
  r'STYLE\.md',
  r'\bwork[- ]periods?\b',
)
FORBIDDEN_RE = re.compile('|'.join(FORBIDDEN), re.I)
CHECKED_DIRS = ('docs', 'assets', 'jetspec_jax', 'pallas_kernels', 'experiments', 'benchmarks')
CHECKED_DIRS += ('data', 'notebooks', 'tests')
CHECKED_SUFFIXES = ('.md', '.py', '.json', '.ipynb', '.toml', '.txt', '.cfg')
THIS = pathlib.Path(__file__).resolve()


def checked_files():
  files = [ROOT / 'README.md', ROOT / 'Makefile', ROOT / 'pyproject.toml']
  for d in CHECKED_DIRS:
    for p in sorted((ROOT / d).rglob('*')):
      if p.is_file() and p.suffix in CHECKED_SUFFIXES and p.resolve() != THIS:
        files.append(p)
  return files


def forbidden_hits(text: str) -> list[str]:
  return [m.group(0) for m in FORBIDDEN_RE.finditer(text)]


def test_no_file_speaks_of_how_it_was_made():
  hits = {}
  for path in checked_files():
    found = forbidden_hits(path.read_text(errors='replace'))
    if found:
      hits[str(path.relative_to(ROOT))] = sorted(set(found))
  assert hits == {}


def test_the_forbidden_words_check_catches_a_planted_remark():
  planted = 'Measured in session 58 on a quiet machine (issue 28; see STYLE.md).'
  assert len(forbidden_hits(planted)) == 4
  assert forbidden_hits('a busy train station; sessions of a web server are not ours') == [
    'sessions'
  ]
  assert forbidden_hits('the target verifies the tree in one pass') == []


MD_CITE = re.compile(r'(?<![\w/.:<>{}-])((?:[\w.-]+/)*[\w-]+\.md)\b')


def cited_markdown(path: pathlib.Path):
  """The ``.md`` files ``path`` cites; in code, only paths with a folder (a bare name there is
  usually a file the code writes)."""
  text = path.read_text(errors='replace')
  text = re.sub(r'https?://\S+', '', text)  # links out of the repository are not citations
  for m in MD_CITE.finditer(text):
    if path.suffix == '.md' or '/' in m.group(1):
      yield m.group(1)


def resolves(citing: pathlib.Path, cited: str) -> bool:
  return (ROOT / cited).exists() or (citing.parent / cited).exists()


def test_every_cited_markdown_file_exists():
  missing = [
    f'{p.relative_to(ROOT)}: {c}'
    for p in checked_files()
    if p.parent.name != 'tests'  # the tests' own examples
    for c in cited_markdown(p)
    if not resolves(p, c)
  ]
  assert missing == []


def test_the_cited_files_check_catches_a_missing_file(tmp_path):
  f = tmp_path / 'x.md'
  f.write_text('see docs/design.md and docs/nowhere.md, https://example.org/y.md')
  cited = list(cited_markdown(f))
  assert cited == ['docs/design.md', 'docs/nowhere.md']
  assert [resolves(f, c) for c in cited] == [True, False]


def test_the_front_page_is_short_and_starts_with_the_two_commands():
  lines = (ROOT / 'README.md').read_text().splitlines()
  assert len(lines) <= 150
  head = '\n'.join(lines[:8])
  assert 'make demo' in head and 'make test' in head


ASSET_DIRS = sorted(p for p in (ROOT / 'assets').iterdir() if p.is_dir())


def front_matter(path: pathlib.Path) -> dict:
  text = path.read_text()
  assert text.startswith('---\n'), f'{path}: no YAML front matter'
  end = text.index('\n---\n', 4)
  return yaml.safe_load(text[4:end])


@pytest.mark.parametrize('asset', ASSET_DIRS, ids=lambda p: p.name)
def test_every_asset_has_a_card(asset):
  meta = front_matter(asset / 'README.md')
  assert meta['license'] and meta['library_name'] == 'jetspec_jax'
  body = (asset / 'README.md').read_text()
  if (asset / 'config.json').exists() and 'target' not in asset.name:
    assert meta['base_model'] and meta['datasets']
    for section in ('## Model', '## Training', '## Evaluation', '## Usage', '## Limitations'):
      assert section in body, f'{asset.name}: no "{section}"'
    results = meta['model-index'][0]['results']
    assert results and all(r['metrics'] for r in results)
    # every preset a card names exists
    for preset in re.findall(r'draft_\w+\.py:(\w+)', body):
      config_file = re.search(rf'(draft_\w+)\.py:{preset}', body).group(1)
      module = __import__(f'experiments.configs.train.{config_file}', fromlist=['get_config'])
      module.get_config(preset)


def test_the_data_cards_parse():
  for card in sorted((ROOT / 'data').glob('*/README.md')):
    meta = front_matter(card)
    assert meta['license'] and meta['pretty_name']


def test_every_generated_table_equals_its_result_file():
  """A number in a generated block typed by hand, or a result file changed without re-rendering
  (``python -m jetspec_jax.evaluation.doc_tables``), fails here."""
  blocks = doc_tables.find_all(ROOT)
  assert len(blocks) >= 8  # the front page, the results page and every card
  stale = [f'{b.path.relative_to(ROOT)}: {b.renderer} of {b.source}' for b in blocks if b.stale()]
  assert stale == []


def test_a_hand_edited_number_in_a_generated_table_is_found(tmp_path):
  blocks = [b for b in doc_tables.find_all(ROOT) if b.path.name == 'README.md']
  block = blocks[0]
  assert not block.stale()
  edited = re.sub(r'\d\.\d\d', '9.99', block.current, count=1)
  assert edited != block.current
  assert block.replace(current=edited).stale()


def test_result_files_record_what_made_them():
  """The result files the generated tables read carry their provenance."""
  files = {f for b in doc_tables.find_all(ROOT) for f in b.files()}
  assert len(files) >= 5
  for path in sorted(files):
    prov = json.loads(path.read_text())['provenance']
    for key in ('commit', 'dirty', 'command', 'date_utc', 'cpu', 'versions'):
      assert key in prov, f'{path}: no {key}'
    assert 'weights_sha256' in prov or 'heads' in prov, f'{path}: no weight checksums'


SHIPPED_HEADS = [
  (kind, preset, asset)
  for kind in ('jetspec', 'dflash', 'jetspecpp', 'dspark')
  for preset, asset in (
    (f'{kind}_shipped', f'{kind}_head_smollm2_135m'),
    (f'{kind}_public_b16', f'{kind}_head_smollm2_135m_b16'),
  )
  if (ROOT / 'assets' / asset).is_dir()
]


@pytest.mark.parametrize('kind,preset,asset', SHIPPED_HEADS, ids=[h[2] for h in SHIPPED_HEADS])
def test_each_shipped_head_is_its_preset(kind, preset, asset):
  """The architecture a shipped head stores (its config.json) is what its card's preset
  (``draft_smollm2.py:<kind>_shipped``, ``:<kind>_public_b16``) builds, and the card names
  that preset."""
  from experiments.configs.train import draft_smollm2

  assert len(SHIPPED_HEADS) >= 4
  config = draft_smollm2.get_config(preset)
  asset = ROOT / 'assets' / asset
  stored = json.loads((asset / 'config.json').read_text())
  extra = stored['dflash_config']
  assert stored['num_hidden_layers'] == config.head.num_layers
  assert stored['block_size'] == config.head.block_size
  assert extra['causal_head'] == config.head.causal
  assert tuple(extra['target_layer_ids']) == tuple(config.head.target_layer_ids)
  assert extra['mask_token_id'] == config.head.mask_token_id
  assert extra.get('copy_seed', 0) == config.head.copy_seed
  assert extra.get('markov_rank', 0) == config.head.markov_rank
  assert (extra.get('head_kind') == 'jetspecpp') == config.head.refine
  assert f'draft_smollm2.py:{preset}' in (asset / 'README.md').read_text()
  assert config.data.prompt_rounds == 3
  if preset.endswith('_shipped'):
    assert config.train.init_from == f'runs/{kind}/export'
  else:  # the shipped head continued
    assert config.train.init_from == f'assets/{kind}_head_smollm2_135m'
    assert config.data.mix[0]['dir'] == 'data/public_chat'


def test_a_summary_reads_heads_from_several_result_files():
  """``heads_summary`` over comma-separated sources: one row per head in the sources' order, its
  mean tau as its own file holds it; heads walked on different records are refused."""
  sources = 'benchmarks/public_block16/results.json,benchmarks/causal_vs_bidirectional/results.json'
  block = doc_tables.Block(ROOT / 'README.md', 'heads_summary', None, sources, '')
  files = block.files()
  assert [f.parent.name for f in files] == ['public_block16', 'causal_vs_bidirectional']
  rows = [line for line in block.expected().splitlines() if line.startswith('| ')][1:]
  assert [line.split(' | ')[0] for line in rows] == ['| JetSpec', '| DFlash-style']
  for line, path in zip(rows, files):
    result = json.loads(path.read_text())
    tree16 = next(r for r in result['rows'] if r['method'] == 'tree 16 best_first')
    assert line.split(' | ')[3] == f'{tree16["mean_over_sets"]:.2f}'
  fewer = json.loads(files[1].read_text())
  fewer['sets']['gsm8k']['walked'] -= 1
  records = {str(f): json.loads(f.read_text()) for f in files[:1]}
  records['other'] = fewer
  with pytest.raises(ValueError, match='different records'):
    doc_tables.heads_summary(records, None)
  with pytest.raises(FileNotFoundError, match='no result file'):
    block.replace(source=sources + ',benchmarks/none/results.json').files()


def test_goals_take_the_best_result_file_and_name_it():
  """Each goal's best value over the files, named by the file's directory; a goal a file cannot
  measure (no DFlash-style head beside the blocks-of-16 one) comes from the file that can."""
  files = ['benchmarks/public/results.json', 'benchmarks/public_block16/results.json']
  block = doc_tables.Block(ROOT / 'README.md', 'goals', None, ','.join(files), '')
  rows = {line.split(' | ')[0][2:]: line.split(' | ')[1:] for line in block.expected().splitlines()}
  tree16 = []
  for path in files:
    result = json.loads((ROOT / path).read_text())
    row = next(
      r for r in result['rows'] if (r['drafter'], r['method']) == ('jetspec', 'tree 16 best_first')
    )
    tree16.append((row['mean_over_sets'], pathlib.PurePath(path).parent.name))
  value, where = max(tree16)
  assert rows['JetSpec best_first tree 16, tau, mean over the public sets'][1:3] == [
    f'{value:.2f}',
    where,
  ]
  assert rows['JetSpec (causal) minus DFlash-style, tree 16 tau'][2] == 'public'
