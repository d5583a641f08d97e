"""The layout: the package layers cleanly (no import circle, no project import hidden inside a
function), every cited docs/ section exists, and every method is listed once."""

import ast
import json
import pathlib
import re

import jetspec_jax as js

ROOT = pathlib.Path(__file__).parent.parent
PACKAGES = ('jetspec_jax', 'pallas_kernels')


def module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def project_imports(node: ast.AST, modules: set[str]) -> set[str]:
  """Project modules an import statement names (``from a import b`` may name module a.b)."""
  found = set()
  if isinstance(node, ast.Import):
    found = {a.name for a in node.names}
  elif isinstance(node, ast.ImportFrom) and node.module:
    found = {node.module} | {f'{node.module}.{a.name}' for a in node.names}
  return {m for m in found if m in modules}


def sources():
  return {module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob('*.py'))}


def import_graph():
  files = sources()
  modules = set(files)
  graph, hidden = {}, []
  for name, path in files.items():
    tree = ast.parse(path.read_text())
    top = set()
    for node in tree.body:
      top |= project_imports(node, modules)
    for node in ast.walk(tree):
      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        for inner in ast.walk(node):
          if project_imports(inner, modules):
            hidden.append(f'{name}.{node.name}')
    # A module importing its own package (``from jetspec_jax import tree``) is not an edge: the
    # package's __init__ re-exports its modules.
    graph[name] = {m for m in top if m != name and not name.startswith(m + '.')}
  return graph, hidden


def find_cycle(graph):
  state = {}

  def visit(node, stack):
    state[node] = 'open'
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 'open':
        return stack[stack.index(nxt) :] + [nxt]
      if nxt not in state:
        found = visit(nxt, stack + [nxt])
        if found:
          return found
    state[node] = 'done'
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node, [node])
      if found:
        return found
  return None


def test_no_import_circle_and_no_hidden_project_imports():
  graph, hidden = import_graph()
  assert 'jetspec_jax.rounds' in graph['jetspec_jax.decoding']
  assert 'jetspec_jax.training.loop' in graph['jetspec_jax.training.head_step']
  assert find_cycle(graph) is None, find_cycle(graph)
  assert hidden == []


def test_the_cycle_finder_finds_a_planted_circle():
  graph, _ = import_graph()
  planted = {k: set(v) for k, v in graph.items()}
  planted['jetspec_jax.verify'].add('jetspec_jax.decoding')  # decoding -> rounds -> verify
  cycle = find_cycle(planted)
  assert cycle is not None and 'jetspec_jax.verify' in cycle


DOC_REF = re.compile(r'docs/(\w+)\.md(?: §(\d+))?')
SOURCE_SUFFIXES = ('.py', '.ipynb', '.md')


def cited_docs():
  """``(file, doc, section)`` for every ``docs/<name>.md [§N]`` cited in the sources, notebooks,
  README and the docs themselves."""
  files = [
    p
    for d in (*PACKAGES, 'experiments', 'tests', 'notebooks', 'docs', 'assets')
    for p in (ROOT / d).rglob('*')
    if p.suffix in SOURCE_SUFFIXES
  ]
  files.append(ROOT / 'README.md')
  for path in files:
    if path.name in ('test_layout.py', 'test_house.py'):  # their own examples
      continue
    for m in DOC_REF.finditer(path.read_text()):
      yield path.relative_to(ROOT), m.group(1), m.group(2)


def test_every_cited_doc_section_exists():
  """A reference ``docs/x.md §N`` names a file in docs/ with a ``## N.`` heading; no source cites
  a document outside the repository."""
  refs = list(cited_docs())
  assert len(refs) > 20  # the sources do cite the docs
  missing = []
  for path, doc, section in refs:
    target = ROOT / 'docs' / f'{doc}.md'
    if not target.exists():
      missing.append(f'{path}: docs/{doc}.md')
    elif section and not re.search(rf'^## {section}\. ', target.read_text(), re.M):
      missing.append(f'{path}: docs/{doc}.md §{section}')
  assert missing == []
  outside = re.compile(r'DESIGN\.md|jetspec_spec\.md|next_methods\.md|\bspec §')
  stale = [
    str(p.relative_to(ROOT))
    for d in (*PACKAGES, 'experiments', 'tests', 'notebooks')
    for p in (ROOT / d).rglob('*')
    if p.suffix in SOURCE_SUFFIXES and p.name != 'test_layout.py' and outside.search(p.read_text())
  ]
  assert stale == []


def test_doc_section_check_catches_a_wrong_section():
  assert DOC_REF.search('see docs/design.md §9').groups() == ('design', '9')
  assert not re.search(r'^## 9\. ', (ROOT / 'docs' / 'design.md').read_text(), re.M)


def test_every_method_is_listed_once_and_built_from_its_config():
  """Each module of jetspec_jax/methods/ registers its methods; the package lists every one, and
  each round-trips through its config."""
  modules = {p.stem for p in (ROOT / 'jetspec_jax' / 'methods').glob('*.py')} - {'__init__', 'base'}
  registered = {cls.__module__.rsplit('.', 1)[-1] for cls in js.methods.REGISTRY.values()}
  assert registered == modules
  for name, cls in js.methods.REGISTRY.items():
    assert getattr(js.methods, cls.__name__) is cls and cls.__name__ in js.methods.__all__
    method = cls()
    assert js.methods.from_config(method.to_config()) == method
    assert js.methods.from_config(name) == method
    # ... also through JSON (a result record's method), which turns tuples into lists
    again = js.methods.from_config(json.loads(json.dumps(method.to_config())))
    assert again == method and hash(again) == hash(method)


def test_no_source_file_is_long():
  """Files with one job: no module of the package is over 600 lines."""
  long = {}
  for path in sources().values():
    lines = len(path.read_text().splitlines())
    if lines > 600:
      long[str(path.relative_to(ROOT))] = lines
  assert not long, long


# An experiment config (ml_collections) is read as ``config.<block>`` (the whole config) or as a
# block handed down (``data_config``, ``train_config``, ``target_config``).
RAW_CONFIG = re.compile(r'\bconfig\.(data|train|eval|head|target|mesh)\b')
CONFIG_BLOCK = re.compile(r'\b(data|train|target|eval)_config\b')


def test_the_experiment_config_is_read_in_few_places():
  """Following a head-training config down the package climbs back to it in few places: the
  orchestration and the module that resolves it into typed values read the whole config; the
  data block is read by the prompt readers, the data writers and the chat-data plan.
  Everything else takes typed values."""
  files = {str(p.relative_to(ROOT)): p.read_text() for p in sources().values()}
  whole = {name for name, text in files.items() if RAW_CONFIG.search(text)}
  blocks = {name for name, text in files.items() if CONFIG_BLOCK.search(text)}
  training = 'jetspec_jax/training/'
  assert whole == {
    training + 'head_trainer.py',
    training + 'run_config.py',
    training + 'chat_data.py',
  }
  assert blocks == {
    training + 'run_config.py',
    training + 'prompt_io.py',
    training + 'data.py',
    training + 'chat_data.py',
  }
