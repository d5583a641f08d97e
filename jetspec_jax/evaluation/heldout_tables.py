"""Held-out tables of the documents (``jetspec_jax/evaluation/doc_tables.py`` renderers): the
teacher-forced metrics ``experiments/tasks/heldout.py`` writes, per held-out set."""

import pathlib

from jetspec_jax.evaluation import report

_fmt = report._fmt  # '—' for a missing value


def _round(record: dict) -> str:
  """A card's name for a held-out set: the prompt round of the rounds' data, else the set."""
  if pathlib.PurePath(record['heldout']['data_dir']).parts[:2] != ('data', 'smollm2_135m'):
    return _heldout_set(record)
  return 'round 2' if 'round2' in record.get('heldout_subdir', '') else 'round 0'


def _heldout_rows(records: dict[str, dict], drafter: str):
  for _, record in sorted(records.items()):
    round_ = _round(record)
    for r in record['rows']:
      if r['drafter'] == drafter or (drafter == 'copy' and r['drafter'].startswith('copy')):
        yield round_, r


def heldout(records: dict[str, dict], arg: str | None) -> str:
  """A card's held-out table: teacher-forced metrics on the held-out shards of each round."""
  lines = [
    '| held-out set | scope | depth-1 acc. | expected chain tau | walk tau |',
    '|---|---|---|---|---|',
  ]
  seen = set()
  for round_, r in _heldout_rows(records, arg):
    key = (round_, r['scope'])
    if key in seen:
      continue
    seen.add(key)
    walk = _fmt(r.get('walk_tau'), '.3f')
    lines.append(
      f'| {round_} | {r["scope"]} | {r["accuracy"][0]:.3f} | {r["expected_tau"]:.3f} | {walk} |'
    )
  return '\n'.join(lines) + '\n'


def card_heldout_index(records: dict[str, dict], arg: str | None) -> str:
  """``model-index`` entries of the held-out metrics (YAML)."""
  lines = []
  for round_, r in _heldout_rows(records, arg):
    if r['first_tokens'] != 0:
      continue
    name = f'held-out self-distillation, {round_}'
    lines += [
      '      - task: {type: text-generation, name: speculative decoding}',
      f'        dataset: {{name: "{name}", type: smollm2_135m_self_distillation}}',
      '        metrics:',
      f'          - {{type: accuracy, name: depth-1 accuracy, value: {r["accuracy"][0]:.3f}}}',
      f'          - {{type: acceptance_length, name: expected chain tau, '
      f'value: {r["expected_tau"]:.3f}}}',
    ]
  return '\n'.join(lines) + '\n'


def _heldout_set(record: dict) -> str:
  """A held-out record's set, as a reader names it: the data directory (the workdir of a
  ``generate_data`` run whose shards are in its ``data/``) and the held-out shard's directory."""
  path = pathlib.PurePath(record['heldout']['data_dir'])
  name = path.parent.name if path.name == 'data' else path.name
  return f'{name}/{record.get("heldout_subdir", "greedy")}'


def heldout_compare(records: dict[str, dict], arg: str | None) -> str:
  """Heads side by side on held-out sets (``experiments/tasks/heldout.py`` files, one per set and
  group of heads): per set (the files' order within one), scope and drafter (the heads, then the
  copy drafter), the teacher-forced depth-1 accuracy, expected chain tau and walk tau;
  ``:by_depth`` adds the accuracy at depths 4, 7 and 15 (a block of 8 drafts to depth 7, one of
  16 to depth 15) and names the copy drafter's block (a row shown once)."""
  deep = (4, 7, 15) if arg == 'by_depth' else ()
  head = ''.join(f' depth-{d} acc. |' for d in deep)
  lines = [
    f'| held-out set | scope | drafter | depth-1 acc. |{head} expected chain tau | walk tau |',
    '|---|---|---|---|' + '---|' * len(deep) + '---|---|',
  ]
  ordered = sorted(records.items())
  rows = [(_heldout_set(record), r) for _, record in ordered for r in record['rows']]
  seen = set()
  for name, r in sorted(rows, key=lambda x: x[0]):  # stable: each set's rows in file order
    acc, drafter = r['accuracy'], r['drafter']
    if deep and drafter.startswith('copy'):  # the heads' and the copy drafter's (prompt lookup)
      drafter = f'{drafter}, block {len(acc) + 1}'
    key = (name, r['scope'], drafter, r['expected_tau'])
    if key in seen:
      continue
    seen.add(key)
    cells = ''.join(f' {_fmt(acc[d - 1] if d <= len(acc) else None, ".3f")} |' for d in deep)
    walk = _fmt(r.get('walk_tau'), '.3f')
    lines.append(
      f'| {name} | {r["scope"]} | {drafter} | {acc[0]:.3f} |{cells} '
      f'{r["expected_tau"]:.3f} | {walk} |'
    )
  first = ordered[0][1]
  weights = {k: v for _, rec in ordered for k, v in rec['provenance']['weights_sha256'].items()}
  made = {}  # commit -> the machine line of its first file
  for _, rec in ordered:
    made.setdefault(rec['provenance']['commit'], report.machine(rec['provenance']))
  lines += [
    '',
    f"{first['heldout']['sequences']} sequences (at most) of each set's first shard, never "
    f'trained on, {first["heldout"]["anchors"]} anchors each; weights: '
    f'{report.checksums(weights)}. {"; ".join(made.values())}.',
  ]
  return '\n'.join(lines) + '\n'
