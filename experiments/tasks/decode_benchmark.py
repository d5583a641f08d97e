"""Benchmark harness: tau, tokens/s and speedup of ``ar``, ``chain`` and ``tree`` decoding.

  python -m experiments.benchmark --config=experiments/configs/benchmark/code_small.py \
      --workdir=benchmarks
  python -m experiments.benchmark --config=experiments/configs/benchmark/smollm2.py \
      --workdir=benchmarks/smollm2_135m

For every temperature, every prompt is decoded with AR and with each (head, method, budget, tree
algorithm) setting, in one process, after a compile warm-up per setting; with
``config.interleave`` prompt by prompt across the settings (:func:`bench.measure_interleaved`: on
a machine whose speed drifts, every setting meets the drift alike), else setting after setting.
Speedup = AR wall time / method wall time on the same prompts and ``max_new_tokens``
(docs/design.md §6); greedy outputs are checked identical to AR's. With ``config.peers``,
transformers' own ``generate`` (greedy and prompt-lookup) decodes the same prompts from the same
model file. Writes ``benchmark.json`` (config, versions, device, per-prompt numbers, aggregates
per prompt group), ``benchmark.md`` and plots (tau vs budget, speedup vs budget, histogram of
tokens per round).
"""

import pathlib

import jax
import numpy as np
from absl import flags, logging
from ml_collections import config_flags
from tqdm import tqdm

import jetspec_jax as js
from experiments.tasks import bench, peers
from jetspec_jax import corpus, sharding
from jetspec_jax import prompts as prompts_lib
from jetspec_jax.evaluation import prompt_sets, provenance, responses
from jetspec_jax.training import chat_prompts


def load_prompt_groups(config, tok) -> dict[str, list[np.ndarray]]:
  """``{group: [prompt ids]}``: raw code prompts for a code model (``prompts='code'``), the
  held-out chat-formatted groups code / chat / math for an instruct model (``'chat'``), or
  ``num_per_group`` seeded prompts of each public set in ``public_sets`` in the target's chat
  template (``'public'``: the sets of docs/results.md; MT-Bench's first turns)."""
  if config.prompts == 'public':
    groups = {}
    for name in config.public_sets:
      drawn = prompt_sets.sample(prompt_sets.load(name), config.num_per_group, config.seed)
      groups[name] = [responses.prompt_ids(tok, p) for p in drawn]
    return groups
  if config.prompts == 'chat':
    groups = chat_prompts.eval_prompt_groups(
      tok, num_code=config.num_per_group, num_math=config.num_per_group
    )
    return {g: [np.asarray(p) for p in ps[: config.num_per_group]] for g, ps in groups.items()}
  sets = {}
  if config.num_humaneval:
    sets['humaneval'] = [
      np.asarray(tok.encode(p)) for _, p in prompts_lib.humaneval_prompts(config.num_humaneval)
    ]
  if config.num_heldout:
    _, val_files = corpus.stdlib_files(tuple(config.validation_modules))
    sets['heldout'] = [
      np.asarray(tok.encode(p))
      for _, p in prompts_lib.function_prompts(val_files, limit=config.num_heldout)
    ]
  return sets


def config_settings(config, kinds: dict[str, str], temperature: float) -> list[bench.Setting]:
  """The settings a benchmark config runs at ``temperature`` for heads of ``kinds``
  (``{name: head kind}``): AR, then every head's chains and trees (:func:`bench.head_settings`).
  At T > 0 a config may run fewer tree algorithms (``sampled_tree_algorithms``) and copy lengths
  (``sampled_copy_lens``)."""
  sampled = temperature > 0
  algorithms = config.tree_algorithms
  copy_lens = tuple(config.get('copy_lens', (0,)))
  if sampled:
    algorithms = config.get('sampled_tree_algorithms') or algorithms
    copy_lens = tuple(config.get('sampled_copy_lens') or copy_lens)
  return bench.head_settings(
    list(kinds),
    config.budgets,
    algorithms,
    config.width,
    kinds,
    tuple(tuple(v) for v in config.get('dspark_verify', (('threshold', 0.0),))),
    tuple(tuple(v) for v in config.get('jetspecpp_variants', ((False, 0), (True, 0)))),
    copy_lens,
  )


def run(config, workdir: str) -> dict:
  # Greedy settings run on every target precision in ``config.targets`` (float32 first: the AR
  # every speedup is measured against, and the one whose outputs must equal AR's).
  precisions = tuple(config.get('targets', ('float32',)))
  if not precisions or precisions[0] != 'float32':
    raise ValueError(f'config.targets must start with float32, got {precisions}')
  model_path = js.model_cache.resolve_model_path(config.target)
  float32 = js.load_target(model_path)
  tok = js.load_tokenizer(model_path)
  targets = {name: bench.target_precision(float32, name) for name in precisions}
  drafting = config.get('head_compute_dtype') or None  # the heads' projection inputs
  heads_of = {
    name: {
      h: js.load_draft_head(path, t).with_compute_dtype(drafting)
      for h, path in config.heads.items()
    }
    for name, t in targets.items()
  }
  target, heads = float32, heads_of['float32']
  groups = load_prompt_groups(config, tok)
  prompts = [(group, p) for group, ps in groups.items() for p in ps]
  ids = [p for _, p in prompts]
  eos = tok.eos_ids if config.get('stop_at_eos', False) else None
  kinds = {name: h.cfg.kind for name, h in heads.items()}
  settings = config_settings(config, kinds, temperature=0.0)
  sampled = config_settings(config, kinds, temperature=1.0)
  # One shape for every prompt, so each setting compiles once (warm-up) and timings exclude it.
  overhang = max(config.budgets) + max(h.cfg.block_size for h in heads.values())
  shapes = js.decoding.shared_shapes(ids, config.max_new_tokens, overhang)
  rows, per_prompt, ar_tokens = [], [], None
  for temperature in config.temperatures:
    runs = settings if temperature == 0 else sampled
    on = precisions if temperature == 0 else ('float32',)  # sampled: float32 only
    labelled = {(name, s): (targets[name], heads_of[name], s) for name in on for s in runs}
    common = dict(
      max_new_tokens=config.max_new_tokens, temperature=temperature, shapes=shapes, eos_id=eos
    )
    if config.get('interleave', False):  # prompt by prompt: speed drift hits every setting alike
      logging.info('T=%s: %d settings, interleaved', temperature, len(labelled))
      outputs = bench.measure_runs(labelled, ids, **common)
    else:
      outputs = {}
      for label in tqdm(labelled, desc=f'T={temperature}', unit='setting'):
        target_here, heads_here, setting = labelled[label]
        outputs[label] = bench.measure(target_here, heads_here, setting, ids, **common)
    ar = outputs[('float32', bench.Setting())]
    if temperature == 0:
      ar_tokens = [o.tokens for o in ar]
    for name, setting in labelled:
      outs = outputs[(name, setting)]
      if temperature == 0 and name == 'float32':
        bench.check_lossless(setting.name, outs, ar)
      by_group = {}
      for group in groups:
        pick = [i for i, (g, _) in enumerate(prompts) if g == group]
        ar_wall = sum(ar[i].stats.wall_s for i in pick)
        by_group[group] = {
          k: v
          for k, v in bench.summarize([outs[i] for i in pick], ar_wall).items()
          if k != 'tau_histogram'
        }
      summary = bench.summarize(outs, sum(o.stats.wall_s for o in ar))
      # Another precision's greedy outputs are counted, not asserted: a near-tie may flip.
      extra = {} if len(precisions) == 1 else dict(target=name)
      if name != 'float32' and temperature == 0:
        extra['equal_to_float32_ar'] = bench.count_equal(outs, ar)
      row = setting.row()
      label = row['setting'] if name == 'float32' else f'{name}:{setting.name}'
      row['setting'] = label
      rows.append(dict(temperature=temperature, **row, **extra, **summary, groups=by_group))
      logging.info('%s', {k: v for k, v in rows[-1].items() if k != 'groups'})
      per_prompt += [
        dict(
          temperature=temperature,
          setting=label,
          **({} if len(precisions) == 1 else dict(target=name)),
          prompt_set=group,
          prompt=i,
          tokens=int(out.stats.new_tokens),
          wall_s=out.stats.wall_s,
          tau=out.stats.tau.tolist(),
        )
        for i, ((group, _), out) in enumerate(zip(prompts, outs))
      ]
  # The peer stops where ``generate`` stops: the tokenizer's ids, else the config's EOS.
  weights = {h: provenance.weights_sha256(path) for h, path in config.heads.items()}
  weights['target'] = provenance.weights_sha256(model_path)
  result = dict(
    **bench.envelope(config, weights),
    num_prompts={k: len(v) for k, v in groups.items()},
    rows=rows,
    peer_rows=[],
    per_prompt=per_prompt,
    batch_rows=[],
    round_cost_rows=[],
  )
  # The settings' rows are written as soon as they are measured; the file grows with each stage
  # that follows, so a run stopped during the peers keeps what it measured.
  write_outputs(result, pathlib.Path(workdir))
  peer_eos = js.decoding.stop_ids(eos, target.cfg.eos_token_id)
  result['peer_rows'] = run_peers(config, model_path, prompts, peer_eos, rows, ar_tokens)
  write_outputs(result, pathlib.Path(workdir))
  by_name = {s.name: s for s in settings}
  result['batch_rows'] = run_batches(config, target, heads, ids, shapes, by_name)
  result['round_cost_rows'] = run_round_costs(config, target, heads, shapes, by_name)
  write_outputs(result, pathlib.Path(workdir))
  return result


def run_peers(config, model_path, prompts, eos, rows, ar_tokens) -> list[dict]:
  """transformers' ``generate`` on the same prompts and model file, against our AR (T=0).

  ``agreement``: mean fraction of each output's leading tokens equal to our greedy AR's."""
  if not config.get('peers'):
    return []
  found = peers.transformers_generate(
    str(model_path),
    [p for _, p in prompts],
    max_new_tokens=config.max_new_tokens,
    eos_ids=eos,
    modes=tuple(config.peers),
    threads=config.get('peer_threads'),
  )
  ours = {r['setting']: r for r in rows if r['temperature'] == 0}
  out = []
  for mode, r in found.items():
    out.append(
      dict(
        setting=f'transformers/{mode}',
        tps=r['tps'],
        wall_s=r['wall_total_s'],
        tokens=r['new_tokens'],
        agreement=peers.agreement(ar_tokens, r['tokens']) if ar_tokens else None,
        tps_over_ours={name: ours[name]['tps'] / r['tps'] for name in ours},
      )
    )
    logging.info('%s', {k: v for k, v in out[-1].items() if k != 'tps_over_ours'})
  return out


def run_batches(config, target, heads, prompts, shapes, settings_by_name) -> list[dict]:
  """Batched decoding: total tokens/s (all sequences) and per-user tokens/s (each sequence's
  tokens over its batch's wall time, averaged), at every batch size and batch temperature.

  The prompts are the first ``max(batch_sizes)`` in the order given (the same for every batch
  size); the settings are ``config.batch_settings`` by name (default: ar and a JetSpec tree).
  """
  rows = []
  names = config.get('batch_settings') or (
    'ar',
    bench.Setting(js.methods.Tree(config.batch_budget, config.width), config.batch_head).name,
  )
  tree = bench.Setting(js.methods.Tree(config.batch_budget, config.width), config.batch_head)
  settings_by_name = dict(settings_by_name, **{tree.name: tree})
  if not config.batch_sizes:
    return rows
  pool = prompts[: max(config.batch_sizes)]
  for temperature in config.get('batch_temperatures') or (0.0,):
    for batch in config.batch_sizes:
      groups = [list(pool[i : i + batch]) for i in range(0, len(pool) - batch + 1, batch)]
      if not groups:
        continue
      for name in names:
        setting = settings_by_name[name]
        outs = bench.measure(
          target,
          heads,
          setting,
          groups,
          max_new_tokens=config.max_new_tokens,
          temperature=temperature,
          shapes=shapes,
        )
        walls = [o[0].stats.wall_s for o in outs]  # one wall time per batch
        tokens = sum(x.stats.new_tokens for o in outs for x in o)
        user_tps = [x.stats.new_tokens / x.stats.wall_s for o in outs for x in o]
        taus = np.concatenate([x.stats.tau for o in outs for x in o])
        counters = bench.summarize([x for o in outs for x in o])
        rows.append(
          dict(
            temperature=temperature,
            batch=batch,
            setting=setting.name,
            tps=tokens / sum(walls),
            user_tps=float(np.mean(user_tps)),
            latency_s=float(np.mean(walls)),
            tau=float(taus.mean()),
            **{k: counters[k] for k in ('guess_accuracy', 'guessed_per_round') if k in counters},
          )
        )
        logging.info('%s', rows[-1])
  return rows


def run_round_costs(config, target, heads, shapes, settings_by_name) -> list[dict]:
  """Per setting in ``config.round_cost_settings`` and batch in ``config.round_cost_batches``:
  ms per round, ms of the head's part, and its share (:func:`experiments.bench.round_cost`)."""
  rows = []
  capacity = shapes.get('min_capacity') or 512
  for batch in config.get('round_cost_batches') or ():
    for name in config.get('round_cost_settings') or ():
      setting = settings_by_name[name]
      row = bench.round_cost(target, heads[setting.head], setting, batch=batch, capacity=capacity)
      rows.append(row)
      logging.info('%s', row)
  return rows


ROW_COLUMNS = (
  ('T', '{temperature:g}'),
  ('setting', '{setting}'),
  ('tau', '{tau:.2f}'),
  ('tok/s', '{tps:.1f}'),
  ('speedup', '{speedup:.2f}x'),
)
BATCH_COLUMNS = (
  ('T', '{temperature:g}'),
  ('batch', '{batch}'),
  ('setting', '{setting}'),
  ('tau', '{tau:.2f}'),
  ('tok/s (all sequences)', '{tps:.1f}'),
  ('tok/s per user', '{user_tps:.1f}'),
  ('latency per batch (s)', '{latency_s:.3f}'),
)
COST_COLUMNS = (
  ('batch', '{batch}'),
  ('setting', '{setting}'),
  ('ms per round', '{round_ms:.1f}'),
  ('ms of the head', '{draft_ms:.1f}'),
  ('head share', '{draft_share:.0%}'),
)
PEER_COLUMNS = (
  ('peer (T=0, same prompts and model file)', '{setting}'),
  ('tok/s', '{tps:.1f}'),
  ('leading tokens equal to our AR', '{agreement:.0%}'),
)


def markdown_table(rows) -> str:
  return bench.markdown(ROW_COLUMNS, rows)


def group_table(rows) -> str:
  """tau and speedup per prompt group (one column pair per group)."""
  groups = list(rows[0]['groups']) if rows else []
  cols = [('T', '{temperature:g}'), ('setting', '{setting}')]
  for g in groups:
    cols += [(f'{g} tau', f'{{{g}_tau:.2f}}'), (f'{g} speedup', f'{{{g}_speedup:.2f}}x')]
  flat = [
    dict(
      temperature=r['temperature'],
      setting=r['setting'],
      **{f'{g}_{k}': r['groups'][g][k] for g in groups for k in ('tau', 'speedup')},
    )
    for r in rows
  ]
  return bench.markdown(cols, flat)


def write_outputs(result: dict, out: pathlib.Path) -> None:
  tables = [markdown_table(result['rows']), group_table(result['rows'])]
  if result['peer_rows']:
    tables.append(bench.markdown(PEER_COLUMNS, result['peer_rows']))
  if result['batch_rows']:
    tables.append(bench.markdown(BATCH_COLUMNS, result['batch_rows']))
  if result.get('round_cost_rows'):
    tables.append(bench.markdown(COST_COLUMNS, result['round_cost_rows']))
  guessed = [r for r in result['rows'] if 'guess_accuracy' in r]
  if guessed:
    cols = (
      ('T', '{temperature:g}'),
      ('setting', '{setting}'),
      ('tau', '{tau:.2f}'),
      ('guessed slots per round', '{guessed_per_round:.2f}'),
      ('guesses equal to the committed token', '{guess_accuracy:.0%}'),
    )
    tables.append(bench.markdown(cols, guessed))
  copied = [r for r in result['rows'] if 'copy_share' in r]
  if copied:
    cols = (
      ('T', '{temperature:g}'),
      ('setting', '{setting}'),
      ('tau', '{tau:.2f}'),
      ('speedup', '{speedup:.2f}x'),
      ('accepted drafts from the copy branch', '{copy_share:.0%}'),
    )
    tables.append(bench.markdown(cols, copied))
  bench.write_result(result, out, 'benchmark', '\n'.join(tables))
  plot(result['rows'], out)


def plot(rows, out: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  rows = [r for r in rows if r.get('target', 'float32') == 'float32']  # one line per setting
  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  for temperature in sorted({r['temperature'] for r in rows}):
    trees = [r for r in rows if r['method'] == 'tree' and r['temperature'] == temperature]
    for key in sorted({(r['head'], r['algorithm'], r.get('copy_len', 0)) for r in trees}):
      sel = sorted(
        (r for r in trees if (r['head'], r['algorithm'], r.get('copy_len', 0)) == key),
        key=lambda r: r['budget'],
      )
      copy = f' copy{key[2]}' if key[2] else ''
      label = f'{key[0]} {key[1]}{copy} T={temperature:g}'
      axes[0].plot([r['budget'] for r in sel], [r['tau'] for r in sel], marker='o', label=label)
      axes[1].plot([r['budget'] for r in sel], [r['speedup'] for r in sel], marker='o', label=label)
    for r in rows:
      if r['method'] == 'chain' and r['temperature'] == temperature:
        axes[0].axhline(r['tau'], ls='--', lw=0.8, color='gray')
  axes[0].set(
    xscale='log',
    xlabel='budget (nodes)',
    ylabel='tau (tokens / round)',
    title='tau vs budget (dashed: chain)',
  )
  axes[1].set(
    xscale='log', xlabel='budget (nodes)', ylabel='speedup vs AR', title='speedup vs budget'
  )
  axes[1].axhline(1.0, color='black', lw=0.8)
  for r in rows:
    if (
      r['method'] != 'ar'
      and r['temperature'] == 0
      and (r['method'] in ('chain', 'dspark') or r['budget'] == max(x['budget'] or 0 for x in rows))
    ):
      hist = np.asarray(r['tau_histogram'], float)
      axes[2].plot(np.arange(len(hist)), hist / max(hist.sum(), 1), marker='.', label=r['setting'])
  axes[2].set(
    xlabel='tokens committed per round', ylabel='fraction of rounds', title='accepted length (T=0)'
  )
  for ax in axes:
    ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(out / 'benchmark.png', dpi=110)
  plt.close(fig)


def main(argv):
  del argv
  sharding.maybe_initialize_distributed(flags.FLAGS.distributed)
  logging.info('JAX %s on %s', jax.__version__, jax.devices())
  result = run(flags.FLAGS.config, flags.FLAGS.workdir)
  print(markdown_table(result['rows']))


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  config_flags.DEFINE_config_file(
    'config', 'experiments/configs/benchmark/code_small.py', 'Benchmark.'
  )
  flags.DEFINE_string('workdir', 'benchmarks', 'Where JSON, table and plots go.')
  flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() (multi-host).')
