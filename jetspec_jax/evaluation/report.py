"""The public table's summary (``results.json``) from per-prompt walk records, and its markdown
(``docs/results.md``), so that no number in the docs is typed by hand (a test re-renders)."""

import json
import pathlib

import numpy as np

from jetspec_jax.evaluation import prompt_sets

BENCHMARKS = tuple(prompt_sets.SETS)
# The public JetSpec reference's reported acceptance lengths (Qwen3-8B target, trees of budget
# 128, depth 20, up to 2048 new tokens, greedy), shown as an anchor row; its file says so.
REFERENCE_FILE = pathlib.Path(__file__).resolve().parents[2] / 'benchmarks' / 'reference_tau.json'


def method_label(method: dict) -> str:
  """A short name for a method config: ``chain``, ``tree 16 best_first``, ``dspark t=0.5``."""
  name = method['name']
  if name == 'dspark':
    return f'dspark threshold {method["threshold"]:g}'
  if name == 'chain':
    return 'chain' + (f' + copy {method["copy_len"]}' if method.get('copy_len') else '')
  if name in ('tree', 'jetspecpp'):
    if (
      method.get('copy_len') and method['budget'] == method['copy_len'] + 1 and method['width'] == 1
    ):
      return f'copy {method["copy_len"]}'
    if method['width'] == 1 and name == 'jetspecpp':
      return 'chain'
    label = f'tree {method["budget"]} {method["algorithm"]}'
    return label + (f' + copy {method["copy_len"]}' if method.get('copy_len') else '')
  return name


def overlapping(contamination: dict | None) -> dict[str, set[str]]:
  """Per set, the prompt ids that overlap the training data (prompts or responses)."""
  out = {}
  for part in ('against_prompts', 'against_responses'):
    for name, r in (contamination or {}).get(part, {}).items():
      out.setdefault(name, set()).update(r['overlapping'])
  return out


def summarize(
  response_records, walk_records, batch_size: int = 1, contamination: dict | None = None
) -> dict:
  """Per benchmark and (drafter, method): pooled tau (committed tokens / rounds), the spread of
  per-prompt tau, the share of rounds capped by the head's block, the pooled histogram of
  accepted drafts; and per benchmark the prompts, tokens and stops, and the seconds spent
  (generation: each batch's wall time shared by its rows, ``batch_size`` where a record does
  not say; walks)."""
  excluded = overlapping(contamination)
  # An MT-Bench second turn goes with its question: '81-2' is excluded when '81-1' or it overlaps.
  dropped = lambda r: (
    r['prompt_id'] in excluded.get(r['benchmark'], ())
    or (r['benchmark'] == 'mtbench' and r['prompt_id'][:-1] + '1' in excluded.get('mtbench', ()))
  )
  walks = sorted(
    (r for r in walk_records if not dropped(r)), key=lambda r: (r['benchmark'], r['prompt_id'])
  )
  sets = {}
  for r in response_records:
    if dropped(r):
      sets.setdefault(r['benchmark'], {}).setdefault('excluded', 0)
      sets[r['benchmark']]['excluded'] += 1
      continue
    s = sets.setdefault(r['benchmark'], {})
    for key in ('prompts', 'new_tokens', 'stopped', 'walked', 'generate_s', 'walk_s', 'excluded'):
      s.setdefault(key, 0)
    s['prompts'] += 1
    if 'generate_s' in r:  # the response's own share of decoding (refilled rows)
      s['generate_s'] += r['generate_s']
    else:  # a whole batch's wall time, shared by its rows
      s['generate_s'] += r.get('batch_wall_s', 0.0) / r.get('batch_rows', batch_size)
    s['new_tokens'] += len(r['response'])
    s['stopped'] += int(r['stopped'])
  cells = {}
  for rec in walks:
    sets[rec['benchmark']]['walked'] += 1
    sets[rec['benchmark']]['walk_s'] += rec.get('walk_s', 0.0)
    sets[rec['benchmark']].setdefault('label_mismatches', 0)
    sets[rec['benchmark']]['label_mismatches'] += rec.get('label_mismatches', 0)
    for w in rec['walks']:
      key = (w['drafter'], method_label(w['method']), rec['benchmark'])
      c = cells.setdefault(
        key, dict(method=w['method'], taus=[], committed=0, rounds=0, capped=0, hist=[])
      )
      if w['rounds']:
        c['taus'].append(w['tau'])
      c['committed'] += w['new_tokens'] - 1
      c['rounds'] += w['rounds']
      c['capped'] += w['capped']
      h = w['accepted_hist']
      c['hist'] = [a + b for a, b in zip(c['hist'] + [0] * len(h), h + [0] * len(c['hist']))][
        : max(len(h), len(c['hist']))
      ]
  rows = {}
  for (drafter, label, bench), c in sorted(cells.items()):
    row = rows.setdefault(
      (drafter, label), dict(drafter=drafter, method=label, config=c['method'], sets={})
    )
    row['sets'][bench] = dict(
      prompts=len(c['taus']),
      tau=c['committed'] / c['rounds'] if c['rounds'] else None,
      prompt_tau_std=float(np.std(c['taus'])) if c['taus'] else None,
      capped_share=c['capped'] / c['rounds'] if c['rounds'] else None,
      accepted_hist=c['hist'],
    )
  for row in rows.values():
    taus = [v['tau'] for v in row['sets'].values() if v['tau'] is not None]
    row['mean_over_sets'] = float(np.mean(taus)) if taus else None
  checked = None
  if contamination:
    checked = {
      part: {n: {k: v for k, v in r.items() if k != 'overlapping'} for n, r in sets_.items()}
      for part, sets_ in contamination.items()
      if part.startswith('against_')
    }
    checked['training'] = {
      k: contamination.get(k) for k in ('training_data', 'shards', 'training_prompts', 'ngram')
    }
  return dict(
    sets=sets,
    rows=list(rows.values()),
    not_on_index=list(prompt_sets.NOT_ON_INDEX),
    contamination=checked,
  )


def machine(prov: dict) -> str:
  """Where and when a result file was made, as the tables state it once."""
  return (
    f'{prov["cpu"]}, {prov["cores"]} cores, commit `{str(prov["commit"])[:12]}`, {prov["date_utc"]}'
  )


def checksums(named: dict, only=None) -> str:
  """Each head's weights as the tables name them: ``name `sha256[:12] ...``` per weight file
  (``named``: head -> {file: sha256}); ``only``: just those heads."""
  return ', '.join(
    f'{k} `{" ".join(v[:12] for v in files.values())}`'
    for k, files in named.items()
    if only is None or k in only
  )


def _fmt(x, spec='.2f'):
  return '—' if x is None else format(x, spec)


def render(result: dict, source: str) -> str:
  """``docs/results.md`` from a summary (:func:`summarize` + provenance)."""
  prov = result.get('provenance', {})
  present = [b for b in BENCHMARKS if b in result['sets']]
  lines = [
    '# Results: acceptance length on public benchmarks',
    '',
    f'<!-- Generated by experiments/evaluate.py from {source}/results.json; do not edit. -->',
    '',
    "Tau: tokens committed per target forward (accepted drafts + the target's own token), greedy, "
    'read off the target\'s stored greedy responses by the tree walk (docs/benchmarks.md, "The '
    'public table"); pooled over each set\'s prompts (committed tokens / rounds). "mean" is the '
    'mean over the sets present.',
    '',
    f'- Target: `{prov.get("config", {}).get("target", "?")}`, float32; up to '
    f'{prov.get("config", {}).get("max_new_tokens", "?")} new tokens, stopping at its stop ids.',
    f'- Commit `{str(prov.get("commit"))[:12]}`{" (dirty)" if prov.get("dirty") else ""}, '
    f'{prov.get("date_utc", "?")}, {prov.get("cpu", "?")}, {prov.get("cores", "?")} cores.',
    f'- Command: `{prov.get("command", "?")}`',
    '',
    '## Prompts',
    '',
    '| set | prompts | walked | new tokens | mean tokens | stopped | label near-ties | '
    'excluded (overlap) |',
    '|---|---|---|---|---|---|---|---|',
  ]
  for b in present:
    s = result['sets'][b]
    lines.append(
      f'| {b} | {s["prompts"]} | {s["walked"]} | {s["new_tokens"]} | '
      f'{s["new_tokens"] / max(s["prompts"], 1):.0f} | {s["stopped"]} | '
      f'{s.get("label_mismatches", 0)} | {s.get("excluded", 0)} |'
    )
  overlap = result.get('contamination')
  if overlap:
    training = overlap['training']
    counts = []
    for name, r in overlap['against_prompts'].items():
      a = overlap.get('against_responses', {}).get(name, {})
      counts.append(f'{name} {r["exact"]} / {r["ngram"]} / {a.get("ngram", "?")} of {r["prompts"]}')
    lines += [
      '',
      f'Overlap with the training data (`{training["training_data"]}`, {training["shards"]} '
      f'shards, {training["training_prompts"]} prompts), every prompt of each set: exact / '
      f'{training["ngram"]}-gram with a training prompt / {training["ngram"]}-gram with a training '
      f'response: {"; ".join(counts)} (`contamination.json`).',
    ]
  gen = sum(s['generate_s'] for s in result['sets'].values()) / 3600
  walked = sum(s['walk_s'] for s in result['sets'].values()) / 3600
  lines += [
    '',
    f'Time on this machine: {gen:.1f} h generating the responses (batched AR, each response '
    f"counted at its share of its batch's time), {walked:.1f} h walking them. Decoding's wall "
    'clock on a subset of these prompts: docs/benchmarks.md, "Wall clock on this machine".',
  ]
  check = result.get('check')
  if check:
    lines += [
      f'Re-decoded with `js.generate` (its messages, head and method; '
      f'{check.get("drawn_from", "drawn at random")}): {check["records"]} records, '
      f'{check["outputs_equal"]} with the same output hash, {check["rounds_equal"]} with the same '
      f"rounds, tau within {check.get('max_tau_difference', 0.0):.3f} of the walk's "
      "(`check.json`; a round count can differ where the head's own draft scores tie, "
      'docs/benchmarks.md §1b).',
    ]
  lines += [
    '',
    f'Not on the package index, so not here: {", ".join(result["not_on_index"])}.',
    '',
    '## Tau per set',
    '',
    '| drafter | method | ' + ' | '.join(present) + ' | mean |',
    '|---|---|' + '---|' * (len(present) + 1),
  ]
  for row in result['rows']:
    cells = [_fmt(row['sets'].get(b, {}).get('tau')) for b in present]
    lines.append(
      f'| {row["drafter"]} | {row["method"]} | '
      + ' | '.join(cells)
      + f' | {_fmt(row["mean_over_sets"])} |'
    )
  reference = json.loads(REFERENCE_FILE.read_text()) if REFERENCE_FILE.exists() else None
  if reference:
    cells = [_fmt(reference['tau'].get(b)) for b in present]
    lines += [
      f'| *{reference["drafter"]}* | *{reference["method"]}* | ' + ' | '.join(cells) + ' | |',
      '',
      f'The last row is an anchor, not a measurement here: {reference["source"]}',
    ]
  lines += [
    '',
    '## Spread and block cap',
    '',
    'Per set: the standard deviation of per-prompt tau, and the share of rounds that accepted '
    'every draft the head can give (a longer block would have gone on).',
    '',
    '| drafter | method | ' + ' | '.join(present) + ' |',
    '|---|---|' + '---|' * len(present),
  ]
  for row in result['rows']:
    cells = []
    for b in present:
      v = row['sets'].get(b)
      cells.append(
        '—' if not v else f'±{_fmt(v["prompt_tau_std"])} / {_fmt(v["capped_share"], ".0%")}'
      )
    lines.append(f'| {row["drafter"]} | {row["method"]} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'
