"""The front page's goals table (``jetspec_jax/evaluation/doc_tables.py`` renderer): each goal
the project states against the best value any public result file measured, and where."""

import pathlib

from jetspec_jax.evaluation import report


def _rows(result: dict) -> dict[tuple[str, str], dict]:
  return {(r['drafter'], r['method']): r for r in result['rows']}


# Goals the project states, each read off a result file: (goal, renderer of the measured value).
def _goal_rows(result: dict):
  """(goal, target, value, bound) of one result file; a head walked beside a baseline workdir
  (``public_smollm2.py:block16`` and the like) is read from its rows, another family's head from
  the baseline's rows it was paired with."""
  rows = _rows(result)
  base = _rows(result['baseline']) if 'baseline' in result else {}
  paired = (result['provenance'].get('config') or {}).get('baseline_drafter') or None

  def get(drafter, method):
    if (drafter, method) in rows:
      return rows[(drafter, method)]
    return base.get((drafter, method)) if drafter == paired else None

  tree16 = get('jetspec', 'tree 16 best_first')
  tree128 = get('jetspec', 'tree 128 best_first')
  chain = get('jetspec', 'chain')
  dflash16 = get('dflash', 'tree 16 best_first')
  yield (
    'JetSpec best_first tree 16, tau, mean over the public sets',
    '>= 3.6',
    tree16 and tree16['mean_over_sets'],
    3.6,
  )
  for b in ('gsm8k', 'math500', 'humaneval'):
    v = tree128 and tree128['sets'].get(b, {}).get('tau')
    yield f'JetSpec best_first tree 128, tau on {b}', '>= 5.0', v, 5.0
  yield (
    'JetSpec chain, tau, mean over the public sets',
    '>= 2.5',
    chain and chain['mean_over_sets'],
    2.5,
  )
  diff = tree16 and dflash16 and tree16['mean_over_sets'] - dflash16['mean_over_sets']
  yield 'JetSpec (causal) minus DFlash-style, tree 16 tau', '>= 0', diff, 0.0


def goals(records: dict[str, dict], arg: str | None) -> str:
  """The goals against the best value any of the result files measured, and where: the
  directory of that file (its records: the whole table, or the first 32 of each set)."""
  best = {}
  for source, result in records.items():
    where = pathlib.PurePath(source).parent.name
    for goal, target, value, bound in _goal_rows(result):
      if goal not in best or (
        value is not None and (best[goal][2] is None or value > best[goal][2])
      ):
        best[goal] = (goal, target, value, bound, where if value is not None else '—')
  lines = ['| goal | target | best measured | in | met |', '|---|---|---|---|---|']
  for goal, target, value, bound, where in best.values():
    met = '—' if value is None else ('yes' if value >= bound else 'no')
    spec = '+.2f' if bound == 0 else '.2f'
    lines.append(f'| {goal} | {target} | {report._fmt(value, spec)} | {where} | {met} |')
  return '\n'.join(lines) + '\n'
