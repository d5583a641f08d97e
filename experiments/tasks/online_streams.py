"""Online adaptation measured on public prompt streams
(``experiments/configs/evaluate/online_smollm2.py``).

  python -m experiments.evaluate --task=online \
      --config=experiments/configs/evaluate/online_smollm2.py \
      --workdir=benchmarks/online

Stages (``--stages``, resumable: finished parts are read back):
  responses  the target's greedy responses to every stream's prompts (batched AR, once)
  streams    per stream: the adapter observes the first half in order (each prompt walked first
             with the head of that moment: the learning curve), then the second half is walked
             with the frozen and the adapted head; ``WORKDIR/<stream>.json`` each
  bounds     per stream (``config.bound_streams``): what adapting harder gives, no rollback,
             ``bound_steps`` steps on the first half at once, and on the second half itself (an
             oracle: the prompts it is scored on); ``WORKDIR/<stream>_bounds.json`` each
  serve      real serving with updates on the first stream's first prompts (``js.generate``'s
             wall time against the updates')
  render     ``WORKDIR/results.json`` (with provenance) from the stream files
The served sequence the adapter learns from is the target's greedy response, what serving the
prompt returns (decoding is lossless; docs/design.md §5), so a stream is replayed from the
stored responses instead of decoded again.
"""

import json
import pathlib
import random
import time

import jax
from absl import flags, logging
from ml_collections import config_flags

import jetspec_jax as js
from jetspec_jax import methods as methods_lib
from jetspec_jax import online
from jetspec_jax.evaluation import prompt_sets, provenance, responses, tree_walk
from jetspec_jax.models import model_cache

STAGES = ('responses', 'streams', 'bounds', 'serve', 'render')
FLAGS = flags.FLAGS


def load(config):
  path = model_cache.resolve_model_path(config.target)
  target, tok = js.load_target(path), js.load_tokenizer(path)
  head = js.load_draft_head(config.head, target)
  if config.head_compute_dtype:
    head = head.with_compute_dtype(config.head_compute_dtype)
  return target, tok, head


def streams(config) -> dict[str, list[prompt_sets.Prompt]]:
  """Each stream's prompts in serving order: every set's seeded sample, then shuffled with the
  config's seed or concatenated (a shift from one kind of prompt to another)."""
  cache = config.cache_dir or None
  loaded = {}
  out = {}
  for name, sets, order in config.streams:
    prompts = []
    for set_name, n in sets:
      if set_name not in loaded:
        loaded[set_name] = prompt_sets.load(set_name, cache)
      prompts += prompt_sets.sample(loaded[set_name], n, config.seed)
    if order == 'shuffle':
      random.Random(config.seed).shuffle(prompts)
    elif order != 'concat':
      raise ValueError(f'stream {name}: order must be shuffle or concat, got {order!r}')
    out[name] = prompts
  return out


def run_responses(config, workdir: pathlib.Path) -> None:
  target, tok, _ = load(config)
  unique = {}
  for prompts in streams(config).values():
    for p in prompts:
      unique.setdefault((p.benchmark, p.prompt_id), p)
  responses.generate(
    target,
    tok,
    list(unique.values()),
    workdir / 'responses.jsonl',
    max_new_tokens=config.max_new_tokens,
    batch_size=config.batch_size,
  )


def _methods(config) -> list[methods_lib.Method]:
  return [methods_lib.from_config(dict(m)) for m in config.methods]


def _pooled(walks: list[tree_walk.Walk]) -> float | None:
  rounds = sum(w.rounds for w in walks)
  return sum(int(w.committed.sum()) for w in walks) / rounds if rounds else None


def run_stream(config, workdir: pathlib.Path, name: str, prompts, target, tok, head) -> dict:
  stored = responses.read(workdir / 'responses.jsonl')
  method_list = _methods(config)
  curve_method = method_list[config.curve_method]
  adapter = online.Adapter(
    target, head, curve_method, online.OnlineConfig(**config.online.to_dict())
  )
  taps = tuple(head.cfg.target_layer_ids)
  half = len(prompts) // 2
  curve, walk_s, observe_s = [], 0.0, 0.0
  for p in prompts[:half]:
    rec = stored[p.benchmark, p.prompt_id]
    ids = responses.prompt_ids(tok, p)
    start = time.perf_counter()
    (w,), _ = tree_walk.walks(target, adapter.head, ids, rec['response'], [curve_method])
    walk_s += time.perf_counter() - start
    curve.append(
      dict(
        benchmark=p.benchmark,
        prompt_id=p.prompt_id,
        committed=int(w.committed.sum()),
        rounds=w.rounds,
      )
    )
    start = time.perf_counter()
    adapter.observe(ids, rec['response'])
    observe_s += time.perf_counter() - start
  evaluated = {
    'frozen': {id(m): [] for m in method_list},
    'adapted': {id(m): [] for m in method_list},
  }
  per_prompt = []
  for p in prompts[half:]:
    rec = stored[p.benchmark, p.prompt_id]
    ids = responses.prompt_ids(tok, p)
    start = time.perf_counter()
    features, _ = tree_walk.teacher_forced(target, ids, rec['response'], taps)
    row = dict(benchmark=p.benchmark, prompt_id=p.prompt_id)
    for which, h in (('frozen', head), ('adapted', adapter.head)):
      found, _ = tree_walk.walks(target, h, ids, rec['response'], method_list, features=features)
      for m, w in zip(method_list, found, strict=True):
        evaluated[which][id(m)].append(w)
      row[which] = [w.tau for w in found]
    walk_s += time.perf_counter() - start
    per_prompt.append(row)
  rows = []
  for m in method_list:
    frozen, adapted = _pooled(evaluated['frozen'][id(m)]), _pooled(evaluated['adapted'][id(m)])
    rows.append(
      dict(
        method=m.to_config(),
        label=_label(m),
        frozen_tau=frozen,
        adapted_tau=adapted,
        gain=None if frozen is None or adapted is None else adapted - frozen,
      )
    )
  update_s = sum(u['seconds'] for u in adapter.updates)
  tokens = sum(len(stored[p.benchmark, p.prompt_id]['response']) for p in prompts[:half])
  result = dict(
    stream=name,
    prompts=len(prompts),
    adapted_on=half,
    sets=sorted({p.benchmark for p in prompts}),
    second_half_sets=sorted({p.benchmark for p in prompts[half:]}),
    rows=rows,
    curve=curve,
    updates=adapter.updates,
    update_seconds=update_s,
    observe_seconds=observe_s,
    walk_seconds=walk_s,
    first_half_response_tokens=tokens,
    per_prompt=per_prompt,
    online=config.online.to_dict(),
  )
  (workdir / f'{name}.json').write_text(json.dumps(result, indent=1) + '\n')
  logging.info('%s: %s', name, [(r['label'], r['frozen_tau'], r['adapted_tau']) for r in rows])
  return result


def _label(m: methods_lib.Method) -> str:
  if isinstance(m, methods_lib.Chain):
    return 'chain'
  return f'tree {m.budget} {m.algorithm}'


def run_streams(config, workdir: pathlib.Path) -> None:
  target, tok, head = load(config)
  for name, prompts in streams(config).items():
    if (workdir / f'{name}.json').exists():
      continue
    run_stream(config, workdir, name, prompts, target, tok, head)


def run_bound(config, workdir: pathlib.Path, name: str, prompts, target, tok, head) -> dict:
  """Tau on the second half (the curve's method) after ``bound_steps`` steps at once on one
  half, every sequence in the buffer, no held-out slice and no rollback."""
  stored = responses.read(workdir / 'responses.jsonl')
  method = _methods(config)[config.curve_method]
  half = len(prompts) // 2
  trained = {}
  for trained_on, part in (('first half', prompts[:half]), ('second half', prompts[half:])):
    settings = dict(
      config.online.to_dict(),
      update_every=len(part),
      steps=config.bound_steps,
      buffer_size=len(part),
      holdout_every=0,
    )
    adapter = online.Adapter(target, head, method, online.OnlineConfig(**settings))
    for p in part:
      adapter.observe(responses.prompt_ids(tok, p), stored[p.benchmark, p.prompt_id]['response'])
    trained[trained_on] = adapter
  # Each second-half sequence's features once, walked with both trained heads.
  walks = {trained_on: [] for trained_on in trained}
  taps = tuple(head.cfg.target_layer_ids)
  for p in prompts[half:]:
    ids, response = responses.prompt_ids(tok, p), stored[p.benchmark, p.prompt_id]['response']
    features, _ = tree_walk.teacher_forced(target, ids, response, taps)
    for trained_on, adapter in trained.items():
      (w,), _ = tree_walk.walks(target, adapter.head, ids, response, [method], features=features)
      walks[trained_on].append(w)
  rows = []
  for trained_on, adapter in trained.items():
    update = adapter.updates[-1]
    rows.append(
      dict(
        trained_on=trained_on,
        steps=config.bound_steps,
        loss=update['loss'],
        update_seconds=update['seconds'],
        tau=_pooled(walks[trained_on]),
      )
    )
    logging.info('%s bound, %s: %s', name, trained_on, rows[-1])
  curve_row = json.loads((workdir / f'{name}.json').read_text())['rows'][config.curve_method]
  result = dict(
    stream=name,
    method=method.to_config(),
    label=_label(method),
    frozen_tau=curve_row['frozen_tau'],
    online_tau=curve_row['adapted_tau'],
    rows=rows,
  )
  (workdir / f'{name}_bounds.json').write_text(json.dumps(result, indent=1) + '\n')
  return result


def run_bounds(config, workdir: pathlib.Path) -> None:
  target, tok, head = load(config)
  for name, prompts in streams(config).items():
    if name in config.bound_streams and not (workdir / f'{name}_bounds.json').exists():
      run_bound(config, workdir, name, prompts, target, tok, head)


def run_serve(config, workdir: pathlib.Path) -> dict | None:
  """Real serving with updates: the first stream's first ``serve_prompts`` prompts decoded by
  ``adapter.generate`` (greedy, each checked against the stored AR response's prefix)."""
  if not config.serve_prompts:
    return None
  target, tok, head = load(config)
  name, prompts = next(iter(streams(config).items()))
  stored = responses.read(workdir / 'responses.jsonl')
  method = _methods(config)[config.curve_method]
  adapter = online.Adapter(target, head, method, online.OnlineConfig(**config.online.to_dict()))
  eos = sorted(tok.eos_ids)
  ids0 = responses.prompt_ids(tok, prompts[0])
  adapter.generate(ids0, max_new_tokens=4, eos_id=eos)  # compile warm-up, not counted
  adapter = online.Adapter(target, head, method, online.OnlineConfig(**config.online.to_dict()))
  equal, tokens = 0, 0
  for p in prompts[: config.serve_prompts]:
    ids = responses.prompt_ids(tok, p)
    out = adapter.generate(ids, max_new_tokens=config.serve_max_new_tokens, eos_id=eos)
    ref = stored[p.benchmark, p.prompt_id]['response'][: len(out.tokens)]
    equal += int(list(map(int, out.tokens)) == ref)
    tokens += len(out.tokens)
  update_s = sum(u['seconds'] for u in adapter.updates)
  result = dict(
    stream=name,
    prompts=config.serve_prompts,
    max_new_tokens=config.serve_max_new_tokens,
    outputs_equal_to_ar=equal,
    new_tokens=tokens,
    serve_seconds=adapter.serve_seconds,
    feature_seconds=adapter.feature_seconds,
    update_seconds=update_s,
    updates=len(adapter.updates),
    tokens_per_s_serving=tokens / adapter.serve_seconds,
    tokens_per_s_with_updates=tokens / (adapter.serve_seconds + update_s),
  )
  (workdir / 'serve.json').write_text(json.dumps(result, indent=1) + '\n')
  return result


def run_render(config, workdir: pathlib.Path) -> dict:
  found = [
    json.loads((workdir / f'{name}.json').read_text())
    for name, _, _ in config.streams
    if (workdir / f'{name}.json').exists()
  ]
  serve = (
    json.loads((workdir / 'serve.json').read_text()) if (workdir / 'serve.json').exists() else None
  )
  bounds = [
    json.loads((workdir / f'{name}_bounds.json').read_text())
    for name, _, _ in config.streams
    if (workdir / f'{name}_bounds.json').exists()
  ]
  result = dict(
    provenance=dict(
      provenance.record(),
      weights_sha256={'head': provenance.weights_sha256(config.head)},
      config=config.to_dict(),
    ),
    streams=[{k: v for k, v in s.items() if k != 'per_prompt'} for s in found],
    bounds=bounds,
    serve=serve,
    devices=str(jax.devices()),
  )
  (workdir / 'results.json').write_text(json.dumps(result, indent=1) + '\n')
  return result


def main(argv):
  del argv
  workdir = pathlib.Path(FLAGS.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  stages = [s for s in FLAGS.stages.split(',') if s]
  unknown = set(stages) - set(STAGES)
  if unknown:
    raise SystemExit(f'unknown stages {sorted(unknown)}; known: {STAGES}')
  config = FLAGS.config
  for stage in STAGES:
    if stage in stages:
      logging.info('stage %s', stage)
      globals()[f'run_{stage}'](config, workdir)


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  config_flags.DEFINE_config_file(
    'config', 'experiments/configs/evaluate/online_smollm2.py', 'Config.'
  )
  flags.DEFINE_string('workdir', None, 'Where responses, streams and results go.')
  flags.DEFINE_string('stages', ','.join(STAGES), 'Comma-separated stages to run.')
  flags.mark_flags_as_required(['workdir'])
