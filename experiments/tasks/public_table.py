"""The public benchmark table: greedy responses to public prompt sets, every head walked along them.

  python -m experiments.evaluate --config=experiments/configs/evaluate/public_smollm2.py \
      --workdir=benchmarks/public [--stages=responses,walk,render]

``responses``: the target's greedy responses (``WORKDIR/responses.jsonl``), generated a batch at
a time, the sets taken in turn so that an interrupted run covers every set; resumable.
``contamination``: every prompt of the sets against the committed training data (exact and
13-gram overlap, ``WORKDIR/contamination.json``); overlapping prompts are left out of the table.
``walk``: per prompt and per (drafter, method), the rounds decoding would take along the stored
response (``WORKDIR/walks.jsonl``, resumable per prompt). ``check``: a few walked records
re-decoded with ``js.generate`` (``WORKDIR/check.json``: same output hash, same rounds).
``render``: ``WORKDIR/results.json`` (summary + provenance) and ``docs/results.md``.

A head compared with the shipped ones (``public_smollm2.py:retrained``) walks the responses of
another workdir (``config.responses_from``), the first ``config.walk_per_set`` of each set, and
its results also hold the baseline workdir's walks of the same records and drafters
(``config.baseline``): a before/after table on equal prompts.
"""

import json
import pathlib
import time

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

import jetspec_jax as js
from jetspec_jax.evaluation import (
  contamination,
  prompt_sets,
  provenance,
  report,
  responses,
  tree_walk,
)
from jetspec_jax.models import model_cache

FLAGS = flags.FLAGS
STAGES = ('contamination', 'responses', 'walk', 'check', 'render')


def load_target(config):
  path = model_cache.resolve_model_path(config.target)
  return js.load_target(path), js.load_tokenizer(path)


def first_turn_prompts(config) -> dict[str, list[prompt_sets.Prompt]]:
  """Each set's drawn prompts (MT-Bench: its first turns)."""
  cache = config.cache_dir or None
  return {
    name: prompt_sets.sample(prompt_sets.load(name, cache), n, config.seed)
    for name, n in config.samples
  }


def second_turn_prompts(config, tok, path) -> list[prompt_sets.Prompt]:
  """MT-Bench's second turns whose first answer is in the responses file."""
  done = responses.read(path)
  first = {
    pid: tok.decode(r['response'], skip_special_tokens=True)
    for (bench, pid), r in done.items()
    if bench == 'mtbench' and pid.endswith('-1')
  }
  return prompt_sets.second_turns(first, config.cache_dir or None)


def interleaved(streams: dict[str, list], chunk: int) -> list:
  """The streams' items taken ``chunk`` at a time from each in turn."""
  out, at = [], 0
  longest = max((len(s) for s in streams.values()), default=0)
  while at < longest:
    for items in streams.values():
      out += items[at : at + chunk]
    at += chunk
  return out


def run_contamination(config, workdir: pathlib.Path) -> dict:
  """Overlap of every prompt of the sets (all of each, not only the drawn ones) with the committed
  training data: its prompts (exact or 13-gram) and its responses (13-gram). Writes
  ``contamination.json``; the summary excludes overlapping prompts and counts them."""
  _, tok = load_target(config)
  shards = sorted(pathlib.Path(config.training_data).rglob('shard_*.npz'))
  prompts = contamination.Index(contamination.training_prompts(tok, shards))
  answers = contamination.Index(contamination.training_responses(tok, shards))
  sets = {name: prompt_sets.load(name, config.cache_dir or None) for name, _ in config.samples}
  if 'mtbench' in sets:  # the second turns' own text is checked too
    first = {p.prompt_id: '' for p in sets['mtbench']}
    sets['mtbench'] = sets['mtbench'] + prompt_sets.second_turns(first, config.cache_dir or None)
  result = dict(
    training_data=config.training_data,
    shards=len(shards),
    training_prompts=prompts.count,
    training_responses=answers.count,
    ngram=contamination.NGRAM,
    against_prompts=contamination.report(prompts, sets),
    against_responses=contamination.report(answers, sets),
  )
  (workdir / 'contamination.json').write_text(json.dumps(result, indent=1) + '\n')
  return result


def responses_path(config, workdir: pathlib.Path) -> pathlib.Path:
  """The responses a workdir walks: its own, or those of ``config.responses_from``."""
  source = config.responses_from
  return (pathlib.Path(source) if source else workdir) / 'responses.jsonl'


def walk_keys(config, stored: dict) -> list:
  """The stored records to walk: all, or the first ``config.walk_per_set`` of each set."""
  limit = config.walk_per_set
  seen: dict[str, int] = {}
  keys = []
  for key in stored:
    seen[key[0]] = seen.get(key[0], 0) + 1
    if not limit or seen[key[0]] <= limit:
      keys.append(key)
  return keys


def run_responses(config, workdir: pathlib.Path) -> None:
  if config.responses_from:
    raise ValueError('a workdir that walks responses_from has no responses stage of its own')
  target, tok = load_target(config)
  path = workdir / 'responses.jsonl'
  streams = first_turn_prompts(config)
  done = responses.read(path)
  order = [
    p for p in interleaved(streams, config.batch_size) if (p.benchmark, p.prompt_id) not in done
  ]
  logging.info('%d first-turn prompts to answer, %d records stored', len(order), len(done))
  # Rounds of prompts decoded as one refilled stream; MT-Bench's second turns follow each round.
  step = config.batch_size * config.round_batches
  for first in range(0, len(order), step):
    responses.generate(
      target,
      tok,
      order[first : first + step],
      path,
      max_new_tokens=config.max_new_tokens,
      batch_size=config.batch_size,
    )
    if any(name == 'mtbench' for name, _ in config.samples):
      responses.generate(
        target,
        tok,
        second_turn_prompts(config, tok, path),
        path,
        max_new_tokens=config.max_new_tokens,
        batch_size=config.batch_size,
      )
    logging.info('responses: %d stored', len(responses.read(path)))


def drafter_methods(config, name: str, head) -> list[js.methods.Method]:
  """The methods a head is walked with: the config's chains and trees (a JetSpec++ head: the
  same trees as ``JetSpecPP(recycle=False)``; a DSpark head: its threshold rule and the whole
  chain)."""
  if head.cfg.kind == 'dspark':
    return [js.methods.DSpark(), js.methods.DSpark(threshold=0.0)]
  out = []
  for m in config.methods:
    method = js.methods.from_config(dict(m))
    if head.cfg.kind == 'jetspecpp':
      budget = head.cfg.block_size if method.name == 'chain' else method.budget
      width = 1 if method.name == 'chain' else method.width
      algorithm = 'accum_logp' if method.name == 'chain' else method.algorithm
      method = js.methods.JetSpecPP(budget=budget, width=width, algorithm=algorithm, recycle=False)
    out.append(method)
  return out


def copy_method(config, head) -> js.methods.Tree:
  """The copy drafter alone: a root-only head tree plus a copy branch as deep as the block."""
  depth = head.cfg.max_depth
  return js.methods.Tree(budget=depth + 1, width=1, copy_len=depth, copy_ngram=config.copy_ngram)


def load_heads(config, target) -> dict:
  """The config's heads, drafting in ``config.head_compute_dtype``."""
  return {
    name: js.load_draft_head(path, target).with_compute_dtype(config.head_compute_dtype or None)
    for name, path in config.heads
  }


def walk_record(name, head, head_sha, method, w: tree_walk.Walk, new_tokens: int) -> dict:
  return dict(
    drafter=name,
    head_sha256=head_sha,
    head_compute_dtype=head.compute_dtype,
    method=method.to_config(),
    new_tokens=new_tokens,
    rounds=w.rounds,
    tau=round(w.tau, 6),
    accepted_hist=w.histogram(),
    capped=w.capped,
  )


def read_walks(workdir: pathlib.Path) -> dict:
  """Every walked record: ``walks.jsonl`` and the files of processes run side by side
  (``walks.<part>.jsonl``)."""
  out = {}
  for path in sorted(workdir.glob('walks*.jsonl')):
    out.update(responses.read(path))
  return out


def run_walks(config, workdir: pathlib.Path, part: int = 0, parts: int = 1) -> None:
  target, tok = load_target(config)
  heads = load_heads(config, target)
  shas = {name: provenance.weights_sha256(path) for name, path in config.heads}
  taps = {tuple(h.cfg.target_layer_ids) for h in heads.values()}
  stored = responses.read(responses_path(config, workdir))
  keys = walk_keys(config, stored)
  path = workdir / ('walks.jsonl' if parts == 1 else f'walks.{part}.jsonl')
  done = read_walks(workdir)
  # The sets in turn, so that a run stopped early has walked some prompts of every set.
  todo = interleaved(
    {
      b: [k for k in keys if k[0] == b and k not in done] for b in dict.fromkeys(k[0] for k in keys)
    },
    1,
  )
  todo = todo[part::parts]  # processes side by side take every parts-th prompt
  logging.info('walks: %d prompts to walk, %d walked', len(todo), len(done))
  first_head = next(iter(heads))
  for key in todo:
    r = stored[key]
    start = time.perf_counter()
    prompt = responses.prompt_ids(
      tok, prompt_sets.Prompt(r['benchmark'], r['prompt_id'], tuple(r['messages']))
    )
    if responses.ids_sha256(prompt) != r['prompt_sha256']:
      raise ValueError(f'{key}: the chat template no longer gives the stored prompt')
    features, facts = None, {}
    if len(taps) == 1:  # one target forward serves every head
      features, facts['label_mismatches'] = tree_walk.teacher_forced(
        target, prompt, r['response'], next(iter(taps))
      )
    rows = []
    for name, head in heads.items():
      methods = drafter_methods(config, name, head)
      copy = copy_method(config, head) if config.copy_drafter and name == first_head else None
      if copy is not None:
        methods = [*methods, copy]
      walks, facts_here = tree_walk.walks(target, head, prompt, r['response'], methods, features)
      facts.update(facts_here)
      for m, w in zip(methods, walks, strict=True):
        drafter, sha = ('copy', None) if m is copy else (name, shas[name])
        rows.append(walk_record(drafter, head, sha, m, w, len(r['response'])))
    record = dict(
      benchmark=r['benchmark'],
      prompt_id=r['prompt_id'],
      messages=r['messages'],
      response_sha256=r['response_sha256'],
      new_tokens=len(r['response']),
      stopped=r['stopped'],
      walk_s=round(time.perf_counter() - start, 2),
      **facts,
      walks=rows,
    )
    with path.open('a') as f:
      f.write(json.dumps(record) + '\n')


def run_check(config, workdir: pathlib.Path) -> dict:
  """Re-decodes ``config.check_prompts`` walked records (drawn with ``config.seed`` among those of
  at most ``config.check_max_tokens`` new tokens: a CPU decodes a budget-128 tree slowly) with
  ``js.generate``, each with its messages, head and method: tau and the output's sha256 must be
  the record's. Writes ``check.json``; returns it."""
  target, tok = load_target(config)
  heads = load_heads(config, target)
  walked = sorted(read_walks(workdir).values(), key=lambda r: r['prompt_id'])
  walked = sorted(walked, key=lambda r: r['benchmark'])
  walked = [r for r in walked if r['new_tokens'] <= config.check_max_tokens]
  rng = np.random.default_rng(config.seed)
  chosen = rng.choice(len(walked), min(config.check_prompts, len(walked)), replace=False)
  first_head = next(iter(heads))
  rows = []
  for i in sorted(chosen):
    rec = walked[int(i)]
    prompt = responses.prompt_ids(
      tok, prompt_sets.Prompt(rec['benchmark'], rec['prompt_id'], tuple(rec['messages']))
    )
    for w in rec['walks']:
      head = heads[first_head if w['drafter'] == 'copy' else w['drafter']]
      method = js.methods.from_config(w['method'])
      out = js.generate(
        target,
        head,
        prompt,
        method=method,
        max_new_tokens=config.max_new_tokens,
        eos_id=sorted(tok.eos_ids),
      )
      rows.append(
        dict(
          benchmark=rec['benchmark'],
          prompt_id=rec['prompt_id'],
          drafter=w['drafter'],
          method=w['method'],
          output_equal=responses.ids_sha256(out.tokens) == rec['response_sha256'],
          rounds_walk=w['rounds'],
          rounds_decode=out.stats.rounds,
          tau_walk=w['tau'],
          tau_decode=float((len(out.tokens) - 1) / max(out.stats.rounds, 1)),
        )
      )
  result = dict(
    drawn_from=f'{len(walked)} walked records of at most {config.check_max_tokens} new tokens',
    records=len(rows),
    outputs_equal=sum(r['output_equal'] for r in rows),
    rounds_equal=sum(r['rounds_walk'] == r['rounds_decode'] for r in rows),
    rows=rows,
  )
  (workdir / 'check.json').write_text(json.dumps(result, indent=1) + '\n')
  return result


def run_render(config, workdir: pathlib.Path, docs_path) -> None:
  heads = {name: provenance.weights_sha256(path) for name, path in config.heads}
  overlap = workdir / 'contamination.json'
  overlap = json.loads(overlap.read_text()) if overlap.exists() else None
  stored = responses.read(responses_path(config, workdir))
  walked = read_walks(workdir)
  keys = walk_keys(config, stored)
  result = report.summarize(
    [stored[k] for k in keys], walked.values(), batch_size=config.batch_size, contamination=overlap
  )
  if config.baseline:
    # The baseline's walks of the same records, its rows of the drafters walked here only (or
    # of config.baseline_drafter: another family's head on the same records).
    drafters = {config.get('baseline_drafter') or name for name, _ in config.heads}
    before = read_walks(pathlib.Path(config.baseline))
    missing = [k for k in walked if k not in before]
    if missing:
      raise ValueError(
        f'{len(missing)} walked records are not in {config.baseline} (first: {missing[0]})'
      )
    changed = [k for k in walked if before[k]['response_sha256'] != walked[k]['response_sha256']]
    if changed:
      raise ValueError(
        f'{len(changed)} walked responses differ from those {config.baseline} walked '
        f'(first: {changed[0]}): the two tables would not compare equal records'
      )
    records = [
      dict(before[k], walks=[w for w in before[k]['walks'] if w['drafter'] in drafters])
      for k in walked
    ]
    base = report.summarize([stored[k] for k in walked], records, contamination=overlap)
    made = json.loads((pathlib.Path(config.baseline) / 'results.json').read_text())['provenance']
    result['baseline'] = dict(
      source=config.baseline,
      rows=base['rows'],
      heads=made['heads'],
      machine={k: made[k] for k in ('cpu', 'cores', 'commit', 'date_utc')},
    )
  result['provenance'] = dict(provenance.record(), heads=heads, config=config.to_dict())
  check = workdir / 'check.json'
  if check.exists():
    checked = json.loads(check.read_text())
    result['check'] = {k: v for k, v in checked.items() if k != 'rows'}
    result['check']['max_tau_difference'] = max(
      (abs(r['tau_walk'] - r['tau_decode']) for r in checked['rows']), default=0.0
    )
  (workdir / 'results.json').write_text(json.dumps(result, indent=1) + '\n')
  if docs_path:
    pathlib.Path(docs_path).write_text(report.render(result, str(workdir)))


def main(argv):
  del argv
  config = FLAGS.config
  workdir = pathlib.Path(FLAGS.workdir)
  workdir.mkdir(parents=True, exist_ok=True)
  logging.info('JAX %s on %s', jax.__version__, jax.devices())
  stages = [s for s in FLAGS.stages.split(',') if s]
  unknown = set(stages) - set(STAGES)
  if unknown:
    raise app.UsageError(f'unknown stages {sorted(unknown)}: {", ".join(STAGES)}')
  if 'contamination' in stages:
    run_contamination(config, workdir)
  if 'responses' in stages:
    run_responses(config, workdir)
  if 'walk' in stages:
    run_walks(config, workdir, FLAGS.part, FLAGS.parts)
  if 'check' in stages:
    run_check(config, workdir)
  if 'render' in stages:
    run_render(config, workdir, config.docs if FLAGS.docs is None else FLAGS.docs)


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  config_flags.DEFINE_config_file(
    'config', 'experiments/configs/evaluate/public_smollm2.py', 'Config.'
  )
  flags.DEFINE_string('workdir', None, 'Where responses, walks and results go.')
  flags.DEFINE_string('stages', ','.join(STAGES), 'Comma-separated stages to run.')
  flags.DEFINE_integer('part', 0, 'walk: this process takes every parts-th prompt from part.')
  flags.DEFINE_integer('parts', 1, 'walk: processes walking side by side.')
  flags.DEFINE_string(
    'docs', None, 'Where the rendered table goes ("": nowhere; default: config.docs).'
  )
  flags.mark_flags_as_required(['workdir'])
