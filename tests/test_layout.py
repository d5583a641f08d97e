"""The package layers cleanly: no import circle, no project import hidden inside a function."""

import ast
import pathlib

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
  assert 'jetspec_jax.training.loop' in graph['jetspec_jax.training.head_trainer']
  assert find_cycle(graph) is None, find_cycle(graph)
  assert hidden == []


def test_the_cycle_finder_finds_a_planted_circle():
  graph, _ = import_graph()
  planted = {k: set(v) for k, v in graph.items()}
  planted['jetspec_jax.verify'].add('jetspec_jax.decoding')  # decoding -> rounds -> verify
  cycle = find_cycle(planted)
  assert cycle is not None and 'jetspec_jax.verify' in cycle
