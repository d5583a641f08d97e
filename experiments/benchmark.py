"""Benchmark harness: tau, tokens/s and speedup of ``ar``, ``chain`` and ``tree`` decoding.

  python -m experiments.benchmark --config=experiments/configs/benchmark.py --workdir=benchmarks

For every temperature, every prompt is decoded with AR and with each (head, method, budget, tree
algorithm) setting, in one process, after a compile warm-up per setting. Speedup = AR wall time /
method wall time on the same prompts and ``max_new_tokens`` (DESIGN.md §6). Writes
``benchmark.json`` (config, versions, device, per-prompt numbers, aggregates), ``benchmark.md``
and plots (tau vs budget, speedup vs budget, histogram of tokens per round).
"""

import json
import pathlib
import platform

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags
from tqdm import tqdm

import jetspec_jax as js
from jetspec_jax import corpus, sharding
from jetspec_jax import prompts as prompts_lib
from jetspec_jax.tokenizer import Tokenizer


def load_prompt_sets(config, tok: Tokenizer) -> dict[str, list[np.ndarray]]:
  sets = {}
  if config.num_humaneval:
    sets['humaneval'] = [
      tok.encode(p) for _, p in prompts_lib.humaneval_prompts(config.num_humaneval)
    ]
  if config.num_heldout:
    _, val_files = corpus.stdlib_files(tuple(config.validation_modules))
    sets['heldout'] = [
      tok.encode(p) for _, p in prompts_lib.function_prompts(val_files, limit=config.num_heldout)
    ]
  return sets


def settings(config, heads: dict) -> list[dict]:
  """Every (head, method, budget, algorithm) setting to run besides AR."""
  out = []
  for head_name in heads:
    out.append(
      dict(name=f'chain/{head_name}', head=head_name, method='chain', budget=None, algorithm=None)
    )
    for algorithm in config.tree_algorithms:
      for budget in config.budgets:
        out.append(
          dict(
            name=f'tree/{head_name}/{algorithm}/{budget}',
            head=head_name,
            method='tree',
            budget=budget,
            algorithm=algorithm,
          )
        )
  return out


def run(config, workdir: str) -> dict:
  target = js.load_target(config.target)
  tok = Tokenizer(config.target)
  heads = {name: js.load_draft_head(path, target) for name, path in config.heads.items()}
  prompt_sets = load_prompt_sets(config, tok)
  prompts = [(set_name, p) for set_name, ps in prompt_sets.items() for p in ps]
  runs = settings(config, heads)
  # One shape for every prompt, so each setting compiles once (warm-up) and timings exclude it.
  overhang = max(config.budgets) + max(h.cfg.block_size for h in heads.values())
  shapes = js.decoding.shared_shapes([p for _, p in prompts], config.max_new_tokens, overhang)
  rows, per_prompt = [], []
  for temperature in config.temperatures:

    def decode(setting, prompt, seed, temperature=temperature):
      head = heads[setting['head']] if setting else None
      kwargs = (
        dict(method='ar')
        if setting is None
        else dict(
          method=setting['method'],
          budget=setting['budget'] or 64,
          width=config.width,
          tree_algorithm=setting['algorithm'] or 'accum_logp',
        )
      )
      return js.generate(
        target,
        head,
        prompt,
        max_new_tokens=config.max_new_tokens,
        temperature=temperature,
        seed=seed,
        **shapes,
        **kwargs,
      )

    results = {}
    for setting in tqdm([None] + runs, desc=f'T={temperature}', unit='setting'):
      name = 'ar' if setting is None else setting['name']
      decode(setting, prompts[0][1], 0)  # compile warm-up
      outs = [decode(setting, p, i) for i, (_, p) in enumerate(prompts)]
      results[name] = outs
      for i, ((set_name, _), out) in enumerate(zip(prompts, outs)):
        per_prompt.append(
          dict(
            temperature=temperature,
            setting=name,
            prompt_set=set_name,
            prompt=i,
            tokens=int(out.stats.new_tokens),
            wall_s=out.stats.wall_s,
            tau=out.stats.tau.tolist(),
          )
        )
    ar_wall = sum(o.stats.wall_s for o in results['ar'])
    for name, outs in results.items():
      if temperature == 0:  # lossless check on every prompt
        for a, b in zip(outs, results['ar']):
          if not np.array_equal(a.tokens, b.tokens):
            raise AssertionError(f'{name} differs from ar at T=0')
      setting = next((s for s in runs if s['name'] == name), None)
      wall = sum(o.stats.wall_s for o in outs)
      tokens = sum(o.stats.new_tokens for o in outs)
      taus = np.concatenate([o.stats.tau for o in outs])
      rows.append(
        dict(
          temperature=temperature,
          setting=name,
          method=setting['method'] if setting else 'ar',
          head=setting['head'] if setting else None,
          budget=setting['budget'] if setting else None,
          algorithm=setting['algorithm'] if setting else None,
          tau=float(taus.mean()),
          tps=tokens / wall,
          speedup=ar_wall / wall,
          wall_s=wall,
          tokens=tokens,
          tau_histogram=np.bincount(taus, minlength=17).tolist(),
        )
      )
      logging.info('%s', rows[-1])
  batch_rows = run_batches(config, target, heads, [p for _, p in prompts], shapes)
  result = dict(
    config=config.to_dict(),
    device=jax.devices()[0].device_kind,
    backend=jax.default_backend(),
    versions=dict(jax=jax.__version__, python=platform.python_version(), jetspec=js.__version__),
    num_prompts={k: len(v) for k, v in prompt_sets.items()},
    rows=rows,
    per_prompt=per_prompt,
    batch_rows=batch_rows,
  )
  write_outputs(result, pathlib.Path(workdir))
  return result


def run_batches(config, target, heads, prompts, shapes) -> list[dict]:
  """Throughput and per-sequence latency at several batch sizes (greedy; ar and tree)."""
  head_name = config.batch_head
  rows = []
  for batch in config.batch_sizes:
    groups = [prompts[i : i + batch] for i in range(0, len(prompts) - batch + 1, batch)]
    if not groups:
      continue
    for name, head, kwargs in (
      ('ar', None, dict(method='ar')),
      (
        f'tree/{head_name}/{config.batch_budget}',
        heads[head_name],
        dict(method='tree', budget=config.batch_budget, width=config.width),
      ),
    ):

      def decode(group, head=head, kwargs=kwargs):
        return js.generate(
          target, head, list(group), max_new_tokens=config.max_new_tokens, **shapes, **kwargs
        )

      decode(groups[0])  # warm-up
      outs = [decode(g) for g in groups]
      walls = [o[0].stats.wall_s for o in outs]  # one wall time per batch
      tokens = sum(x.stats.new_tokens for o in outs for x in o)
      taus = np.concatenate([x.stats.tau for o in outs for x in o])
      rows.append(
        dict(
          batch=batch,
          setting=name,
          tps=tokens / sum(walls),
          latency_s=float(np.mean(walls)),
          tau=float(taus.mean()),
        )
      )
      logging.info('%s', rows[-1])
  return rows


def markdown_table(rows) -> str:
  lines = ['| T | setting | tau | tok/s | speedup |', '|---|---|---|---|---|']
  lines += [
    f'| {r["temperature"]:g} | {r["setting"]} | {r["tau"]:.2f} | {r["tps"]:.0f} | '
    f'{r["speedup"]:.2f}x |'
    for r in rows
  ]
  return '\n'.join(lines) + '\n'


def write_outputs(result: dict, out: pathlib.Path) -> None:
  out.mkdir(parents=True, exist_ok=True)
  (out / 'benchmark.json').write_text(json.dumps(result, indent=2))
  batch = [
    '',
    '| batch | setting | tau | tok/s (all sequences) | latency per batch (s) |',
    '|---|---|---|---|---|',
  ]
  batch += [
    f'| {r["batch"]} | {r["setting"]} | {r["tau"]:.2f} | {r["tps"]:.0f} | {r["latency_s"]:.3f} |'
    for r in result['batch_rows']
  ]
  (out / 'benchmark.md').write_text(markdown_table(result['rows']) + '\n'.join(batch) + '\n')
  plot(result['rows'], out)


def plot(rows, out: pathlib.Path) -> None:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(15, 4))
  for temperature in sorted({r['temperature'] for r in rows}):
    trees = [r for r in rows if r['method'] == 'tree' and r['temperature'] == temperature]
    for key in sorted({(r['head'], r['algorithm']) for r in trees}):
      sel = sorted(
        (r for r in trees if (r['head'], r['algorithm']) == key), key=lambda r: r['budget']
      )
      label = f'{key[0]} {key[1]} T={temperature:g}'
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
      and (r['method'] == 'chain' or r['budget'] == max(x['budget'] or 0 for x in rows))
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


if __name__ == '__main__':
  config_flags.DEFINE_config_file('config', 'experiments/configs/benchmark.py', 'Benchmark.')
  flags.DEFINE_string('workdir', 'benchmarks', 'Where JSON, table and plots go.')
  flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() (multi-host).')
  app.run(main)
