"""Every notebook executes headless on small settings, and is committed without outputs."""

import pathlib
import time

import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / 'notebooks').glob('*.ipynb'))


def test_there_are_three_notebooks():
  assert [p.name for p in NOTEBOOKS] == [
    '01_quickstart.ipynb',
    '02_train_a_draft_head.ipynb',
    '03_tree_attention.ipynb',
  ]


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped_and_thin(path):
  nb = nbformat.read(path, as_version=4)
  assert 'colab-badge' in nb.cells[0].source
  assert nb.cells[-1].source.startswith('## Next steps')
  for cell in nb.cells:
    if cell.cell_type == 'code':
      assert not cell.outputs and cell.execution_count is None, 'outputs must be stripped'
      assert 'class ' not in cell.source and 'nn.Module' not in cell.source  # no model code


@pytest.mark.parametrize('path', NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
  from nbclient import NotebookClient

  monkeypatch.setenv('JETSPEC_NOTEBOOK_SMOKE', '1')
  monkeypatch.setenv('MPLBACKEND', 'Agg')
  nb = nbformat.read(path, as_version=4)
  start = time.perf_counter()
  NotebookClient(
    nb, timeout=600, kernel_name='python3', resources={'metadata': {'path': str(path.parent)}}
  ).execute()
  print(f'{path.name}: {time.perf_counter() - start:.1f}s')
  errors = [
    o for c in nb.cells if c.cell_type == 'code' for o in c.outputs if o.output_type == 'error'
  ]
  assert not errors
  code = [c for c in nb.cells if c.cell_type == 'code']
  assert all(c.execution_count for c in code), 'every code cell ran'
