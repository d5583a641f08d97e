"""Decoding with bfloat16-weight targets against the float32 one, on the benchmark's prompts.

  python -m experiments.benchmark --task=bf16 --out=benchmarks/smollm2_135m_bf16

The target's weight matrices in bfloat16 with float32 accumulation, each projection's input
rounded to bfloat16 (``Target.with_weight_dtype('bfloat16')``, ``bfloat16``) or split into two
bfloat16 halves (``split_inputs=True``, ``bfloat16x2``; activations, norms and the KV cache stay
float32), the split one with its prompt forward in rounded bfloat16
(``with_prefill_compute_dtype('bfloat16')``, ``bfloat16x2+bf16_prefill``: AR reads the same
prefill), and the same target in float32, each decoding the held-out prompts of
``configs/benchmark/smollm2.py`` (3 per group, greedy, the model's stop ids) with AR, a chain and
``best_first`` trees, settings of both targets interleaved prompt by prompt after a compile
warm-up each. Per setting: tau, tokens/s, speedup over the float32 AR and over the bfloat16 AR,
and how many greedy outputs equal AR's of the same target and the float32 AR's (token for
token). Speculative decoding of the float32 target is checked equal to its AR; the bfloat16
targets' is reported, not asserted: greedy equality holds in float32 (docs/design.md §5), while
with bfloat16 inputs a different summation order of the verify can flip a near-tie
(models/matmul.py, ``SPLIT``).
"""

import json
import pathlib

import jax
import numpy as np
from absl import flags

import jetspec_jax as js
from experiments.tasks import bench
from jetspec_jax.training import chat_prompts

FLAGS = flags.FLAGS


def settings(budgets) -> list[bench.Setting]:
  m = js.methods
  trees = [bench.Setting(m.Tree(b, 7, 'best_first'), 'jetspec') for b in budgets]
  if FLAGS.copy_prior:
    prior = tuple(float(p) for p in FLAGS.copy_prior)
    merged = [m.Tree(b, 7, 'best_first', copy_prior=prior) for b in budgets]
    trees += [bench.Setting(t, 'jetspec') for t in merged]
  for bonus in FLAGS.depth_bonus:
    deeper = [m.Tree(b, 7, 'best_first', depth_bonus=float(bonus)) for b in budgets]
    trees += [bench.Setting(t, 'jetspec') for t in deeper]
  return [bench.Setting(), bench.Setting(m.Chain(), 'jetspec'), *trees]


def run(out_dir: str | None) -> dict:
  path = js.model_cache.resolve_model_path(FLAGS.target)
  tok = js.load_tokenizer(path)
  float32 = js.load_target(path)
  if 'float32' not in FLAGS.targets:
    raise ValueError('--targets must include float32 (the AR every speedup is measured against)')
  targets = {name: bench.target_precision(float32, name) for name in FLAGS.targets}
  heads = {
    (name, dtype): {'jetspec': js.load_draft_head(FLAGS.head, t).with_compute_dtype(dtype)}
    for name, t in targets.items()
    for dtype in FLAGS.head_compute_dtypes
  }
  groups = chat_prompts.eval_prompt_groups(
    tok, num_code=FLAGS.num_per_group, num_math=FLAGS.num_per_group
  )
  prompts = [np.asarray(p) for ps in groups.values() for p in ps[: FLAGS.num_per_group]]
  prompts = prompts * FLAGS.repeats
  budgets = [int(b) for b in FLAGS.budgets]
  shapes = js.decoding.shared_shapes(prompts, FLAGS.max_new_tokens, max(budgets) + 8)
  first_head = FLAGS.head_compute_dtypes[0]
  runs = {}
  for name, target in targets.items():
    for s in settings(budgets):
      for dtype in [first_head] if s.head is None else FLAGS.head_compute_dtypes:
        runs[(name, s, dtype)] = (target, heads[(name, dtype)], s)
  outputs = bench.measure_runs(
    runs,
    prompts,
    max_new_tokens=FLAGS.max_new_tokens,
    temperature=0.0,
    shapes=shapes,
    eos_id=tok.eos_ids,
  )
  ar = {name: outputs[(name, bench.Setting(), first_head)] for name in targets}
  ar_wall = {name: sum(o.stats.wall_s for o in outs) for name, outs in ar.items()}
  rows = []
  for (name, setting, head_dtype), outs in outputs.items():
    summary = bench.summarize(outs, ar_wall['float32'])
    if name == 'float32':
      bench.check_lossless(setting.name, outs, ar['float32'])
    head_dtype = None if setting.head is None else head_dtype
    rows.append(
      dict(
        target=name,
        setting=setting.name,
        head_compute_dtype=head_dtype,
        tau=summary['tau'],
        tps=summary['tps'],
        speedup_vs_float32_ar=summary['speedup'],
        speedup_vs_same_target_ar=ar_wall[name] / summary['wall_s'],
        equal_to_same_target_ar=bench.count_equal(outs, ar[name]),
        equal_to_float32_ar=bench.count_equal(outs, ar['float32']),
        prompts=len(prompts),
      )
    )
    r = rows[-1]
    print(
      f'{name:10s} {setting.name:28s} {head_dtype or "":8s} '
      f'tau {r["tau"]:.2f} {r["tps"]:5.1f} tok/s '
      f'{r["speedup_vs_float32_ar"]:.2f}x f32 AR, {r["speedup_vs_same_target_ar"]:.2f}x own AR; '
      f'equal to own AR {r["equal_to_same_target_ar"]}/{len(prompts)}, '
      f'to f32 AR {r["equal_to_float32_ar"]}',
      flush=True,
    )
  result = dict(
    **bench.envelope(dict(FLAGS.flag_values_dict())),
    max_new_tokens=FLAGS.max_new_tokens,
    rows=rows,
  )
  if out_dir:
    bench.write_result(result, out_dir, 'benchmark', markdown(rows))
  return result


def markdown(rows) -> str:
  columns = ('target', 'setting', 'head', 'tau', 'tok/s', 'vs float32 AR', 'vs own AR')
  columns += ('= own AR', '= float32 AR')
  lines = ['| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
  for r in rows:
    cells = (
      r['target'],
      r['setting'],
      r['head_compute_dtype'] or '-',
      f'{r["tau"]:.2f}',
      f'{r["tps"]:.1f}',
      f'{r["speedup_vs_float32_ar"]:.2f}x',
      f'{r["speedup_vs_same_target_ar"]:.2f}x',
      f'{r["equal_to_same_target_ar"]}/{r["prompts"]}',
      f'{r["equal_to_float32_ar"]}/{r["prompts"]}',
    )
    lines.append('| ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  print(json.dumps(dict(jax=jax.__version__, devices=str(jax.devices()))))
  run(FLAGS.out and str(pathlib.Path(FLAGS.out)))


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  flags.DEFINE_string('out', None, 'Write benchmark.json and benchmark.md here.')
  flags.DEFINE_string('target', 'smollm2_135m_instruct', 'A packaged model name or a path.')
  flags.DEFINE_string('head', 'assets/jetspec_head_smollm2_135m', 'The JetSpec head.')
  flags.DEFINE_integer('num_per_group', 3, 'Prompts per group (code, chat, math).')
  flags.DEFINE_integer('max_new_tokens', 48, 'New tokens per prompt.')
  flags.DEFINE_list('budgets', ['8', '16'], 'best_first tree budgets.')
  flags.DEFINE_list(
    'copy_prior',
    [],
    'Also each tree with copy candidates merged at these probabilities per match length '
    '(Tree.copy_prior; experiments/tasks/copy_priors.py).',
  )
  flags.DEFINE_list(
    'depth_bonus',
    [],
    'Also each tree (without copy candidates) with these Tree.depth_bonus values (deeper trees).',
  )
  flags.DEFINE_integer(
    'repeats', 1, 'Decode the prompt list this many times (interleaved as one longer list).'
  )
  flags.DEFINE_list(
    'targets',
    ['float32', 'bfloat16', 'bfloat16x2', 'bfloat16x2+bf16_prefill'],
    'Target precisions to run.',
  )
  flags.DEFINE_list(
    'head_compute_dtypes',
    ['bfloat16'],
    "The head's projections: float32 and/or bfloat16 inputs (drafting only: lossless either way).",
  )
