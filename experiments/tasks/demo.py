"""The main job: ar vs chain vs tree (vs tree + copy candidates) decoding of SmolLM2-135M-Instruct,
lossless and timed.

  make demo
  # == python -m experiments.demo [--config=experiments/configs/demo/main_job.py[:code_small]]

Loads the target (the packaged SmolLM2-135M-Instruct GGUF by default), its tokenizer and JetSpec
head, generates greedily for a few held-out chat-formatted prompts (code and chat) with each
method (after a compile warm-up), checks that the outputs are identical, prints tau / tokens per
second / speedup and one completion, and writes a plot of tokens committed per round. With
``config.bfloat16x2`` it also decodes with the target's weights in bfloat16 (each projection input
split into two bfloat16 halves; the prompt's forward with rounded inputs,
``config.bfloat16x2_prefill``), ar and tree, timed against the float32 ar, and reports whether
that target's tree equals its own ar.
"""

import functools
import json
import pathlib

import jax
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

import jetspec_jax as js
from experiments.tasks import bench
from jetspec_jax import prompts as prompts_lib
from jetspec_jax.evaluation import provenance, responses
from jetspec_jax.models import matmul
from jetspec_jax.training import chat_prompts

REBUILD = 'see assets/README.md for the commands that rebuild assets/'


def demo_prompts(config, tok) -> list[np.ndarray]:
  """Chat-formatted code and chat requests (``prompts='chat'``) or raw HumanEval prompts."""
  if config.prompts == 'chat':
    groups = chat_prompts.eval_prompt_groups(tok, num_code=config.num_prompts, num_math=0)
    half = (config.num_prompts + 1) // 2
    chosen = groups['code'][:half] + groups['chat'][: config.num_prompts - half]
  else:
    chosen = [tok.encode(p) for _, p in prompts_lib.humaneval_prompts(config.num_prompts)]
  return [np.asarray(p) for p in chosen]


def run(config, workdir: str = 'runs/demo', out: str = '') -> dict:
  if not pathlib.Path(config.head).exists():
    raise FileNotFoundError(f'{config.head} is missing; {REBUILD}')
  model_path = js.model_cache.resolve_model_path(config.target)
  target = js.load_target(model_path)
  head = js.load_draft_head(config.head, target).with_compute_dtype(config.head_compute_dtype)
  tok = js.load_tokenizer(model_path)
  print(
    f'target: {model_path.name} ({js.decoder.count_params(target.params) / 1e6:.1f}M parameters, '
    f'{target.cfg.model_type}); JetSpec head: {js.decoder.count_params(head.params) / 1e6:.1f}M '
    f'parameters, block {head.cfg.block_size}; {jax.devices()[0].device_kind}'
  )
  prompts = demo_prompts(config, tok)
  eos = tok.eos_ids if config.prompts == 'chat' else None
  shapes = js.decoding.shared_shapes(
    prompts, config.max_new_tokens, config.budget + head.cfg.block_size
  )
  tree = functools.partial(js.methods.Tree, config.budget, config.width, config.algorithm)
  settings = {
    'ar': bench.Setting(),
    'chain': bench.Setting(js.methods.Chain(), 'jetspec'),
    'tree': bench.Setting(tree(), 'jetspec'),
    'tree+copy': bench.Setting(tree(copy_len=config.copy_len), 'jetspec'),
  }
  runs = {(name, 'float32'): (target, {'jetspec': head}, s) for name, s in settings.items()}
  if config.bfloat16x2:
    narrow = target.with_weight_dtype('bfloat16', split_inputs=True)
    narrow = narrow.with_prefill_compute_dtype(config.bfloat16x2_prefill)
    narrow_head = js.load_draft_head(config.head, narrow)
    narrow_heads = {'jetspec': narrow_head.with_compute_dtype(config.head_compute_dtype)}
    for name in ('ar', 'tree'):
      runs[(name, matmul.SPLIT)] = (narrow, narrow_heads, settings[name])
  # Prompt by prompt across the runs, so a drift of the machine's speed slows all alike.
  outputs = bench.measure_runs(
    runs, prompts, max_new_tokens=config.max_new_tokens, shapes=shapes, eos_id=eos
  )
  outputs_by_run = outputs
  ar = outputs[('ar', 'float32')]
  for name in ('chain', 'tree', 'tree+copy'):
    bench.check_lossless(name, outputs[(name, 'float32')], ar)
  ar_wall = sum(o.stats.wall_s for o in ar)
  results = {key: bench.summarize(outs, ar_wall) for key, outs in outputs.items()}
  print(f'\n{"method":10s} {"target":>10s} {"tau":>6s} {"tok/s":>8s} {"speedup":>8s}')
  for (name, weights), r in results.items():
    print(f'{name:10s} {weights:>10s} {r["tau"]:6.2f} {r["tps"]:8.1f} {r["speedup"]:7.2f}x')
  print(
    f'\ngreedy outputs of ar, chain, tree ({config.budget} nodes, {config.algorithm}) and '
    f'tree+copy (the same budget, {config.copy_len} of it copy candidates) are identical on '
    f'{len(prompts)} held-out prompts (float32 target)'
  )
  if config.bfloat16x2:
    narrow_ar = outputs[('ar', matmul.SPLIT)]
    same = bench.count_equal(outputs[('tree', matmul.SPLIT)], narrow_ar)
    same_f32 = bench.count_equal(narrow_ar, ar)
    own = results[('ar', matmul.SPLIT)]['wall_s'] / results[('tree', matmul.SPLIT)]['wall_s']
    print(
      f'{matmul.SPLIT} target (bfloat16 weights, each input as two bfloat16 halves; prefill '
      f'{config.bfloat16x2_prefill or matmul.SPLIT}): its tree '
      f'equals its ar on {same}/{len(prompts)} prompts and runs {own:.2f}x its ar; its ar equals '
      f'the float32 ar on {same_f32}/{len(prompts)}; the speedups above are over the float32 ar'
    )
  outputs = {name: outputs[(name, 'float32')] for name in settings}
  shown = tok.decode(prompts[0].tolist()) + tok.decode(outputs['tree'][0].tokens.tolist())
  print(f'\nfirst prompt and its completion (tree):\n{shown}')
  plot_path = write_plot(outputs, pathlib.Path(workdir), head.cfg.block_size)
  methods = {name + ('' if w == 'float32' else f'/{w}'): r for (name, w), r in results.items()}
  summary = dict(**bench.envelope(config), num_prompts=len(prompts), methods=methods)
  (pathlib.Path(workdir) / 'demo.json').write_text(json.dumps(summary, indent=2))
  print(f'plot: {plot_path}; numbers: {pathlib.Path(workdir) / "demo.json"}')
  if out:
    record = result_record(config, outputs_by_run, results, ar, head_dir=config.head)
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(out).write_text(json.dumps(record, indent=1) + '\n')
    print(f'result file: {out}')
  return methods


def result_record(config, outputs, results, ar, *, head_dir) -> dict:
  """The main job's result file (the front page's table renders it): per setting tau,
  tokens/s with its per-prompt spread, speedup over the float32 ar, and whether every output
  equals its own target's ar; with what made it."""
  rows = []
  for (name, weights), r in results.items():
    outs = outputs[(name, weights)]
    own_ar = outputs[('ar', weights)]
    rows.append(
      dict(
        method=name,
        target=weights,
        tau=r['tau'],
        tokens_per_s=r['tps'],
        prompt_tokens_per_s=[int(o.stats.new_tokens) / o.stats.wall_s for o in outs],
        speedup=r['speedup'],
        equal_to_own_ar=bench.count_equal(outs, own_ar),
        output_sha256=[responses.ids_sha256(o.tokens) for o in outs],
      )
    )
  return dict(
    provenance=dict(
      provenance.record(),
      weights_sha256={'jetspec': provenance.weights_sha256(head_dir)},
      config=config.to_dict(),
    ),
    prompts=len(ar),
    max_new_tokens=config.max_new_tokens,
    outputs_equal=all(r['equal_to_own_ar'] == len(ar) for r in rows),
    rows=rows,
  )


def write_plot(outputs, workdir: pathlib.Path, block_size: int) -> pathlib.Path:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  workdir.mkdir(parents=True, exist_ok=True)
  fig, ax = plt.subplots(figsize=(6, 3.5))
  names = ('chain', 'tree', 'tree+copy')
  for i, name in enumerate(names):
    taus = np.concatenate([o.stats.tau for o in outputs[name]])
    hist = np.bincount(taus, minlength=block_size + 1)[1:]
    ax.bar(
      np.arange(1, block_size + 1) + 0.27 * (i - 1),
      hist / hist.sum(),
      width=0.27,
      label=f'{name} (mean tau {taus.mean():.2f})',
    )
  ax.set(
    xlabel='tokens committed per round',
    ylabel='fraction of rounds',
    title='JetSpec: tokens per round',
  )
  ax.legend()
  fig.tight_layout()
  path = workdir / 'demo_tau.png'
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv):
  del argv
  logging.info('JAX %s on %s', jax.__version__, jax.devices())
  run(flags.FLAGS.config, flags.FLAGS.workdir, flags.FLAGS.out)


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  config_flags.DEFINE_config_file(
    'config', 'experiments/configs/demo/main_job.py', 'Demo configuration.'
  )
  flags.DEFINE_string('workdir', 'runs/demo', 'Where the plot goes.')
  flags.DEFINE_string('out', '', 'Also write a result file (benchmarks/main_job.json).')
