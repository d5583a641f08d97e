"""Tables in the README, docs and cards, written from result files, so that no number is typed by
hand: each sits between markers naming its renderer and its result file,

  <!-- generated: public_summary from benchmarks/public/results.json -->
  ...
  <!-- end generated -->

(``# generated: ...`` / ``# end generated`` inside a card's YAML front matter). ``python -m
jetspec_jax.evaluation.doc_tables`` rewrites every block; a test re-renders each and compares.
A source may be a glob (``benchmarks/heldout/*.json``) or several, comma-separated: the renderer
gets every file they match, in that order.
"""

import dataclasses
import json
import pathlib
import re
import sys

from jetspec_jax.evaluation import goal_tables, heldout_tables, report

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCUMENTS = ('README.md', 'docs/*.md', 'assets/*/README.md', 'data/*/README.md')
DOCUMENTS += ('experiments/README.md', 'benchmarks/**/README.md')
BLOCK = re.compile(
  r'^(?P<open>(?:<!--|#) generated: (?P<renderer>\w+)(?::(?P<arg>[\w.-]+))? from '
  r'(?P<source>\S+?)(?: -->)?)\n(?P<body>.*?)^(?P<close>(?:<!--|#) end generated(?: -->)?)$',
  re.M | re.S,
)

# The drafters of the public table as the cards and the front page name them.
DRAFTERS = {
  'jetspec': ('JetSpec', 'jetspec_head_smollm2_135m'),
  'dflash': ('DFlash-style', 'dflash_head_smollm2_135m'),
  'jetspecpp': ('JetSpec++', 'jetspecpp_head_smollm2_135m'),
  'dspark': ('DSpark', 'dspark_head_smollm2_135m'),
  'copy': ('copy drafter (no head)', None),
}
SUMMARY_METHODS = ('chain', 'tree 8 best_first', 'tree 16 best_first', 'tree 128 best_first')
SUMMARY_METHODS += ('tree 128 accum_logp',)


def _public_rows(result: dict) -> dict[tuple[str, str], dict]:
  return {(r['drafter'], r['method']): r for r in result['rows']}


_fmt = report._fmt  # '—' for a missing value
_machine = report.machine


def _spread(row: dict) -> str:
  """The range of the per-set tau: how much the mean hides."""
  taus = [v['tau'] for v in row['sets'].values() if v['tau'] is not None]
  return f'{min(taus):.2f}-{max(taus):.2f}' if taus else '—'


def public_summary(records: dict[str, dict], arg: str | None) -> str:
  """Front page: each drafter's tau, mean over the public sets, at the CPU and paper settings."""
  ((source, result),) = records.items()
  rows = _public_rows(result)
  sets = [b for b in report.BENCHMARKS if b in result['sets']]
  prompts = sum(result['sets'][b]['walked'] for b in sets)
  lines = [
    '| drafter | ' + ' | '.join(SUMMARY_METHODS) + ' | range over sets (tree 16) |',
    '|---|' + '---|' * (len(SUMMARY_METHODS) + 1),
  ]
  for drafter, (name, _) in DRAFTERS.items():
    found = [rows.get((drafter, m)) for m in SUMMARY_METHODS]
    if drafter == 'copy':  # a chain of copied tokens: the chain column
      copy = [r for r in result['rows'] if r['drafter'] == 'copy']
      found = copy[:1] + [None] * (len(SUMMARY_METHODS) - 1)
    if not any(found):
      continue
    cells = [_fmt(r['mean_over_sets']) if r else '—' for r in found]
    ref = rows.get((drafter, 'tree 16 best_first')) or next(r for r in found if r)
    lines.append(f'| {name} | ' + ' | '.join(cells) + f' | {_spread(ref)} |')
  for r in result['rows']:
    if r['drafter'] == 'dspark' and r['method'].startswith('dspark'):
      lines.append(
        f'| DSpark, its own verify ({r["method"]}) | {_fmt(r["mean_over_sets"])} |'
        + ' — |' * (len(SUMMARY_METHODS) - 1)
        + f' {_spread(r)} |'
      )
  copy = next((r['config'] for r in result['rows'] if r['drafter'] == 'copy'), None)
  lines += [
    '',
    f'Mean tau over {len(sets)} public sets ({prompts} prompts, greedy, up to '
    f'{result["provenance"]["config"]["max_new_tokens"]} new tokens'
    + (f'; the copy drafter: a chain of up to {copy["copy_len"]} copied tokens' if copy else '')
    + '). Per set, spread and method: [docs/results.md](docs/results.md).',
  ]
  return '\n'.join(lines) + '\n'


def heads_summary(records: dict[str, dict], arg: str | None) -> str:
  """Heads walked in several workdirs along the same records (``public_smollm2.py:block16`` and
  the like): each head's tau, mean over the sets, at the summary's methods (DSpark: its own
  verify), its weights and the records it walked."""
  lines = [
    '| head | ' + ' | '.join(SUMMARY_METHODS) + ' | range over sets (tree 16) |',
    '|---|' + '---|' * (len(SUMMARY_METHODS) + 1),
  ]
  walked, weights = set(), {}
  for _, result in records.items():
    rows = _public_rows(result)
    sets = [b for b in report.BENCHMARKS if b in result['sets'] and result['sets'][b]['walked']]
    walked.add((sum(result['sets'][b]['walked'] for b in sets), len(sets)))
    weights.update(result['provenance']['heads'])
    for drafter in dict.fromkeys(r['drafter'] for r in result['rows']):
      name = DRAFTERS[drafter][0]
      found = [rows.get((drafter, m)) for m in SUMMARY_METHODS]
      if any(found):
        cells = [_fmt(r['mean_over_sets']) if r else '—' for r in found]
        ref = rows.get((drafter, 'tree 16 best_first')) or next(r for r in found if r)
        lines.append(f'| {name} | ' + ' | '.join(cells) + f' | {_spread(ref)} |')
      for r in result['rows']:
        if r['drafter'] == drafter and r['method'].startswith('dspark'):
          lines.append(
            f'| {name}, its own verify ({r["method"]}) | {_fmt(r["mean_over_sets"])} |'
            + ' — |' * (len(SUMMARY_METHODS) - 1)
            + f' {_spread(r)} |'
          )
  if len(walked) != 1:
    raise ValueError(f'the heads walked different records: {sorted(walked)} (records, sets)')
  ((count, sets),) = walked
  lines += [
    '',
    f'Mean tau over {sets} public sets, {count} records each head (greedy); weights: '
    f'{report.checksums(weights)}.',
  ]
  return '\n'.join(lines) + '\n'


def card_public(records: dict[str, dict], arg: str | None) -> str:
  """A card's public-benchmark table: one drafter's tau per set at every method."""
  ((source, result),) = records.items()
  sets = [b for b in report.BENCHMARKS if b in result['sets']]
  lines = [
    '| method | ' + ' | '.join(sets) + ' | mean |',
    '|---|' + '---|' * (len(sets) + 1),
  ]
  for r in result['rows']:
    if r['drafter'] != arg:
      continue
    cells = [_fmt(r['sets'].get(b, {}).get('tau')) for b in sets]
    lines.append(f'| {r["method"]} | ' + ' | '.join(cells) + f' | {_fmt(r["mean_over_sets"])} |')
  walked = ', '.join(f'{b} {result["sets"][b]["walked"]}' for b in sets)
  lines += ['', f'Prompts per set: {walked} (greedy, [docs/results.md](../../docs/results.md)).']
  return '\n'.join(lines) + '\n'


def card_model_index(records: dict[str, dict], arg: str | None) -> str:
  """A card's ``model-index`` entries (YAML, indented for the results list): tau per public set
  at best_first trees of 16 and 128 nodes."""
  ((source, result),) = records.items()
  rows = _public_rows(result)
  lines = []
  for method in ('tree 16 best_first', 'tree 128 best_first', 'dspark threshold 0'):
    row = rows.get((arg, method))
    if not row:
      continue
    for b in [b for b in report.BENCHMARKS if b in row['sets']]:
      tau = row['sets'][b]['tau']
      lines += [
        '      - task: {type: text-generation, name: speculative decoding}',
        f'        dataset: {{name: {b}, type: {b}}}',
        '        metrics:',
        f'          - {{type: acceptance_length, name: "tau, {method}", value: {tau:.3f}}}',
      ]
  return '\n'.join(lines) + '\n'


def speed(records: dict[str, dict], arg: str | None) -> str:
  """The main job's (``make demo``) timing table: tau and tokens/s per setting, with the spread
  over its prompts, and the machine once."""
  ((source, result),) = records.items()
  prov = result['provenance']
  lines = [
    '| method | target | tau | tokens/s (min-max over prompts) | speedup over float32 AR |',
    '|---|---|---|---|---|',
  ]
  for r in result['rows']:
    spread = f'{min(r["prompt_tokens_per_s"]):.1f}-{max(r["prompt_tokens_per_s"]):.1f}'
    lines.append(
      f'| {r["method"]} | {r["target"]} | {r["tau"]:.2f} | {r["tokens_per_s"]:.1f} ({spread}) '
      f'| {r["speedup"]:.2f}x |'
    )
  lines += [
    '',
    f'{result["prompts"]} prompts, {result["max_new_tokens"]} new tokens each, settings '
    f'interleaved prompt by prompt; outputs equal to AR: {result["outputs_equal"]}. '
    f'{_machine(prov)}.',
  ]
  return '\n'.join(lines) + '\n'


def defaults(records: dict[str, dict], arg: str | None) -> str:
  """The evidence for ``Tree()``'s defaults: tau by builder and budget, mean over the sets."""
  ((source, result),) = records.items()
  rows = _public_rows(result)
  methods = ('tree 8 best_first', 'tree 16 best_first', 'tree 128 best_first')
  methods += ('tree 128 accum_logp',)
  lines = ['| head | ' + ' | '.join(methods) + ' |', '|---|' + '---|' * len(methods)]
  for drafter, (name, _) in DRAFTERS.items():
    found = [rows.get((drafter, m)) for m in methods]
    if any(found):
      cells = [_fmt(r['mean_over_sets']) if r else '—' for r in found]
      lines.append(f'| {name} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


def demo_index(records: dict[str, dict], arg: str | None) -> str:
  """``model-index`` entries (YAML) from a main-job result file: tau per decoding method of the
  float32 target."""
  ((source, result),) = records.items()
  lines = []
  for r in result['rows']:
    if r['target'] != 'float32' or r['method'] == 'ar':
      continue
    lines += [
      '      - task: {type: text-generation, name: speculative decoding}',
      f'        dataset: {{name: "{arg}", type: {arg}}}',
      '        metrics:',
      f'          - {{type: acceptance_length, name: "tau, {r["method"]}", value: {r["tau"]:.3f}}}',
    ]
  return '\n'.join(lines) + '\n'


def _accel_key(r: dict) -> tuple:
  return (r['part'], r.get('nodes'), r.get('attn_impl'), r['context'])


def accel(records: dict[str, dict], arg: str | None) -> str:
  """What a round's parts cost (``experiments/tasks/round_costs.py``), per context length."""
  ((source, result),) = records.items()
  prov = result['provenance']
  contexts = sorted({r['context'] for r in result['rows']})
  lines = [
    '| part | ' + ' | '.join(f'ms at context {c} (x a decode step)' for c in contexts) + ' |',
    '|---|' + '---|' * len(contexts),
  ]
  parts = []
  for r in result['rows']:
    key = (r['part'], r.get('nodes'), r.get('attn_impl'))
    if key not in parts:
      parts.append(key)
  for part, nodes, impl in parts:
    cells = []
    for c in contexts:
      found = [r for r in result['rows'] if _accel_key(r) == (part, nodes, impl, c)]
      row = found[0] if found else None
      cells.append('—' if row is None else f'{row["ms"]:.1f} ({row["x_decode"]:.2f})')
    label = part.replace('_', ' ') + (f', {nodes} nodes' if nodes else '')
    lines.append(f'| {label} | ' + ' | '.join(cells) + ' |')
  lines += [
    '',
    f'{_machine(prov)}; median of {result["config"]["repeats"]} calls.',
  ]
  return '\n'.join(lines) + '\n'


def wallclock(records: dict[str, dict], arg: str | None) -> str:
  """A decoding benchmark's speed table (``experiments/tasks/decode_benchmark.py``): per target
  precision and setting, tau, tokens/s with its spread over prompts, the speedup over the
  float32 AR with its spread over prompt sets, outputs equal to the float32 AR; then the peers."""
  ((source, result),) = records.items()
  prov = result['provenance']
  prompts = sum(result['num_prompts'].values())
  walls = {}
  for p in result['per_prompt']:
    if p['temperature'] == 0:
      walls.setdefault(p['setting'], []).append(p['tokens'] / p['wall_s'])
  lines = [
    '| target | setting | tau | tokens/s (min-max over prompts) | speedup over float32 AR '
    '(min-max over sets) | outputs equal to float32 AR |',
    '|---|---|---|---|---|---|',
  ]
  for r in result['rows']:
    if r['temperature'] != 0:
      continue
    target = r.get('target', 'float32')
    setting = r['setting'].removeprefix(f'{target}:')
    tps = walls[r['setting']]
    by_set = [g['speedup'] for g in r['groups'].values()]
    equal = r.get('equal_to_float32_ar', prompts)  # float32: asserted equal when measured
    lines.append(
      f'| {target} | {setting} | {r["tau"]:.2f} | {r["tps"]:.1f} ({min(tps):.1f}-{max(tps):.1f}) '
      f'| {r["speedup"]:.2f}x ({min(by_set):.2f}-{max(by_set):.2f}) | {equal}/{prompts} |'
    )
  peers = [
    f'{r["setting"]} {r["tps"]:.1f} tokens/s (leading tokens equal to our AR: {r["agreement"]:.0%})'
    for r in result.get('peer_rows', [])
  ]
  config = result['config']
  lines += [
    '',
    f'{prompts} prompts ({", ".join(f"{k} {v}" for k, v in result["num_prompts"].items())}), '
    f'up to {config["max_new_tokens"]} new tokens each, greedy, the settings of every target '
    f'interleaved prompt by prompt in one process; heads drafting in '
    f'{config.get("head_compute_dtype") or "float32"}.'
    + (f' Peers on the same prompts and model file: {"; ".join(peers)}.' if peers else '')
    + f' {_machine(prov)}.',
  ]
  return '\n'.join(lines) + '\n'


def before_after(records: dict[str, dict], arg: str | None) -> str:
  """A head walked beside a baseline workdir's (``public_smollm2.py:retrained``, ``:block16``):
  per set and method, tau of the baseline's head and of the new one on the same records, named
  by the config's ``labels`` (baseline, new). With ``baseline_drafter`` the baseline's rows are
  that drafter's (``:dflash_block16``: a DFlash-style head beside the JetSpec one)."""
  ((source, result),) = records.items()
  config = result['provenance']['config']
  was, now = config.get('labels') or ('shipped', 'continued')
  paired = config.get('baseline_drafter') or None
  base = _public_rows(result['baseline'])
  rows = _public_rows(result)
  sets = [b for b in report.BENCHMARKS if b in result['sets'] and result['sets'][b]['walked']]
  lines = [
    '| drafter | method | ' + ' | '.join(sets) + ' | mean |',
    '|---|---|' + '---|' * (len(sets) + 1),
  ]
  order = {m: i for i, m in enumerate(SUMMARY_METHODS)}
  for (drafter, method), after in sorted(
    rows.items(), key=lambda kv: (kv[0][0], order.get(kv[0][1], len(order)), kv[0][1])
  ):
    before = base.get((paired or drafter, method))
    if before is None:
      continue
    for name, row in ((was, before), (now, after)):
      cells = [_fmt(row['sets'].get(b, {}).get('tau')) for b in sets]
      lines.append(
        f'| {DRAFTERS[row["drafter"]][0]}, {name} | {method} | '
        + ' | '.join(cells)
        + f' | {_fmt(row["mean_over_sets"])} |'
      )
  walked = sum(result['sets'][b]['walked'] for b in sets)
  heads = result['provenance']['heads']
  responses = config.get('responses_from') or result['baseline']['source']
  lines += [
    '',
    f'{walked} records of {responses} (the first {config["walk_per_set"]} of each set), '
    f'both heads walked along the same responses; weights: '
    f'{report.checksums(heads)} ({now}), '
    f'{report.checksums(result["baseline"]["heads"], only=[paired] if paired else heads)} '
    f'({was}). '
    f'{now.capitalize()}: {_machine(result["provenance"])}.',
  ]
  if 'machine' in result['baseline']:
    lines[-1] += f' {was.capitalize()}: {_machine(result["baseline"]["machine"])}.'
  if 'check' in result:  # walked records re-decoded with js.generate (the 'check' stage)
    c = result['check']
    lines[-1] += (
      f' The {now} head re-decoded {c["records"]} walked records (drafters x methods) with '
      f'js.generate: {c["outputs_equal"]} outputs and {c["rounds_equal"]} round counts equal '
      'to the walk.'
    )
  return '\n'.join(lines) + '\n'


def data_sizes(records: dict[str, dict], arg: str | None) -> str:
  """A data card's table (``jetspec_jax/training/data_sizes.py``): per directory of shards."""
  ((source, result),) = records.items()
  lines = [
    '| directory | shards | sequences | tokens | response tokens | held out |',
    '|---|---|---|---|---|---|',
  ]
  for d, c in result['dirs'].items():
    held = c['heldout']
    lines.append(
      f'| `{d}/` | {c["shards"]} | {c["sequences"]:,} | {c["tokens"]:,} | '
      f'{c["response_tokens"]:,} | {held["shard"]} ({held["sequences"]} sequences) |'
    )
  t = result['total']
  lines.append(
    f'| all | {t["shards"]} | {t["sequences"]:,} | {t["tokens"]:,} | {t["response_tokens"]:,} | |'
  )
  return '\n'.join(lines) + '\n'


def _feature_share(serve: dict) -> str:
  """The buffer's teacher-forced forwards against decoding, where the serve record has them."""
  if serve.get('feature_seconds') is None:
    return ''
  share = serve['feature_seconds'] / serve['serve_seconds']
  return (
    f'; the teacher-forced forwards that give the buffer its features took '
    f'{serve["feature_seconds"]:.1f} s ({share:.0%} of decoding)'
  )


def online(records: dict[str, dict], arg: str | None) -> str:
  """Online adaptation per stream: tau on the second half (never adapted on) with the frozen
  and the adapted head, per method; the updates kept and their cost."""
  ((source, result),) = records.items()
  labels = [r['label'] for r in result['streams'][0]['rows']] if result['streams'] else []
  lines = [
    '| stream | prompts (adapted on) | '
    + ' | '.join(f'{lab}: frozen / adapted (gain)' for lab in labels)
    + ' | updates kept | seconds updating / walking |',
    '|---|---|' + '---|' * (len(labels) + 2),
  ]
  for st in result['streams']:
    cells = [
      f'{r["frozen_tau"]:.2f} / {r["adapted_tau"]:.2f} ({r["gain"]:+.2f})' for r in st['rows']
    ]
    kept = sum(u['kept'] for u in st['updates'])
    lines.append(
      f'| {st["stream"]} ({", ".join(st["second_half_sets"])}) | {st["prompts"]} '
      f'({st["adapted_on"]}) | ' + ' | '.join(cells) + f' | {kept} of {len(st["updates"])} | '
      f'{st["update_seconds"]:.0f} / {st["walk_seconds"]:.0f} |'
    )
  serve = result.get('serve')
  if serve:
    lines += [
      '',
      f'Real serving with updates ({serve["stream"]}, {serve["prompts"]} prompts, up to '
      f'{serve["max_new_tokens"]} new tokens): {serve["tokens_per_s_serving"]:.1f} tokens/s '
      f'decoding, {serve["tokens_per_s_with_updates"]:.1f} counting the '
      f'updates ({serve["updates"]}: {serve["update_seconds"]:.0f} s against '
      f'{serve["serve_seconds"]:.0f} s of decoding){_feature_share(serve)}; outputs equal to '
      f'AR: {serve["outputs_equal_to_ar"]} of {serve["prompts"]}.',
    ]
  prov = result['provenance']
  lines += [
    '',
    f'{_machine(prov)}.',
  ]
  return '\n'.join(lines) + '\n'


def online_curve(records: dict[str, dict], arg: str | None) -> str:
  """The learning curve: pooled tau per window of the first half, each prompt walked with the
  head of the moment it was served."""
  ((source, result),) = records.items()
  window = result['provenance']['config']['window']
  lines = [f'| stream | tau per window of {window} prompts, in serving order |', '|---|---|']
  for st in result['streams']:
    points = []
    curve = st['curve']
    for i in range(0, len(curve), window):
      part = curve[i : i + window]
      rounds = sum(c['rounds'] for c in part)
      points.append(f'{sum(c["committed"] for c in part) / rounds:.2f}' if rounds else '—')
    lines.append(f'| {st["stream"]} | ' + ' → '.join(points) + ' |')
  return '\n'.join(lines) + '\n'


RENDERERS = dict(
  online=online,
  online_curve=online_curve,
  data_sizes=data_sizes,
  accel=accel,
  demo_index=demo_index,
  defaults=defaults,
  public_summary=public_summary,
  goals=goal_tables.goals,
  card_public=card_public,
  card_model_index=card_model_index,
  heldout=heldout_tables.heldout,
  card_heldout_index=heldout_tables.card_heldout_index,
  speed=speed,
  wallclock=wallclock,
  before_after=before_after,
  heads_summary=heads_summary,
  heldout_compare=heldout_tables.heldout_compare,
)


@dataclasses.dataclass(frozen=True)
class Block:
  path: pathlib.Path
  renderer: str
  arg: str | None
  source: str  # relative to the repository root; may be a glob
  current: str
  root: pathlib.Path = ROOT

  def files(self) -> list[pathlib.Path]:
    found = []
    for pattern in self.source.split(','):
      matched = sorted(self.root.glob(pattern))
      if not matched:
        raise FileNotFoundError(f'{self.path}: no result file {pattern}')
      found += [f for f in matched if f not in found]
    return found

  def expected(self) -> str:
    if self.renderer not in RENDERERS:
      raise KeyError(f'{self.path}: no renderer {self.renderer!r}; known: {sorted(RENDERERS)}')
    records = {str(f.relative_to(self.root)): json.loads(f.read_text()) for f in self.files()}
    return RENDERERS[self.renderer](records, self.arg)

  def stale(self) -> bool:
    return self.current != self.expected()

  def replace(self, **changes) -> 'Block':
    return dataclasses.replace(self, **changes)


def documents(root=ROOT) -> list[pathlib.Path]:
  root = pathlib.Path(root)
  return sorted({p for pattern in DOCUMENTS for p in root.glob(pattern) if p.is_file()})


def blocks_in(path: pathlib.Path, root=ROOT) -> list[Block]:
  return [
    Block(path, m['renderer'], m['arg'], m['source'], m['body'], pathlib.Path(root))
    for m in BLOCK.finditer(path.read_text())
  ]


def find_all(root=ROOT) -> list[Block]:
  return [b for p in documents(root) for b in blocks_in(p, root)]


def rewrite(path: pathlib.Path, root=ROOT, missing: list | None = None) -> bool:
  """Re-renders every block of ``path``; returns whether the file changed. A block whose result
  file is missing is left as it is and named in ``missing``."""
  text = path.read_text()

  def fill(m):
    block = Block(path, m['renderer'], m['arg'], m['source'], m['body'], pathlib.Path(root))
    try:
      return f'{m["open"]}\n{block.expected()}{m["close"]}'
    except FileNotFoundError as e:
      if missing is None:
        raise
      missing.append(str(e))
      return m.group(0)

  new = BLOCK.sub(fill, text)
  if new != text:
    path.write_text(new)
  return new != text


def main(argv=None) -> int:
  root = pathlib.Path(argv[1]) if argv and len(argv) > 1 else ROOT
  missing = []
  changed = [p for p in documents(root) if blocks_in(p, root) and rewrite(p, root, missing)]
  for p in changed:
    print(f'rewrote {p.relative_to(root)}')
  for m in missing:
    print(f'not rendered: {m}')
  print(f'{len(find_all(root))} generated blocks, {len(changed)} files changed')
  return 1 if missing else 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
