"""Held-out, teacher-forced metrics of exported heads and of the copy drafter, side by side.

  python -m experiments.evaluate --task=heldout \
      --config=experiments/configs/train/draft_smollm2.py \
      --heads=recipe=runs/jetspec_r3_full/export,seeded=runs/jetspec_copy3_r3data/export \
      --first_tokens=0,48 --out=benchmarks/heldout_smollm2.json

The batch is the one ``train_draft`` logs its ``heldout_*`` metrics on (the config's
``eval.heldout_*``: the first sequences of ``greedy/shard_00000``, never trained on), scored by
the same function: per-depth accuracy, expected chain tau and loss, at the same fixed anchors
(``--heldout_subdir=round2/greedy``: another directory's first shard, e.g. a later round's)
(a DSpark head needs its own config, ``draft_smollm2.py:dspark``, for its loss).
``--first_tokens=N`` scores only the first ``N`` response tokens of each sequence (0: all of
them): decoding ``N`` new tokens sees that part of an answer. Every row also has its walk tau:
the chain tau over the anchors greedy decoding visits (``training/walk.py``), where the expected
chain tau weights every anchor alike (not for DSpark heads).
``--decode_tokens=N`` also decodes the same sequences' prompts with each head for ``N`` tokens
(greedy; ``--decode_method``, repeatable: ``chain``, ``tree:budget=16``, ...) and reports the
measured tau beside the teacher-forced numbers, with how many outputs equal the stored greedy
responses.
"""

import ast
import dataclasses
import json
import pathlib
import re

import jax
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

from jetspec_jax import decoding, methods, sharding
from jetspec_jax.evaluation import provenance
from jetspec_jax.methods import base as methods_base
from jetspec_jax.models import head_io
from jetspec_jax.training import copy_baseline, head_step, run_config, walk

FLAGS = flags.FLAGS


def parse_heads(spec: str) -> dict[str, str]:
  """``'a=dir1,b=dir2'`` -> ``{'a': 'dir1', 'b': 'dir2'}``."""
  heads = {}
  for item in filter(None, spec.split(',')):
    name, sep, path = item.partition('=')
    if not sep or not name or not path:
      raise ValueError(f'--heads takes name=directory pairs, got {item!r}')
    heads[name] = path
  return heads


def parse_method(spec: str) -> methods.Method:
  """``'tree:budget=16,copy_len=4'`` -> ``Tree(budget=16, copy_len=4)``; a bare name takes the
  method's defaults. Values are Python literals (``16``, ``0.3``, ``False``, a tuple
  ``copy_prior=(0.5,0.9)``: commas inside brackets belong to the value) or bare words
  (``algorithm=best_first``)."""
  name, _, settings = spec.partition(':')
  name = name.strip()
  cls = methods_base.REGISTRY.get(name)
  # The settings whose value is text (e.g. Tree.algorithm) take a bare word.
  defaults = {f.name: f.default for f in dataclasses.fields(cls)} if cls else {}
  fields = {}
  for item in filter(None, re.split(r',(?![^()\[\]]*[)\]])', settings)):
    key, sep, value = item.partition('=')
    if not sep or not key:
      raise ValueError(f'method settings are key=value pairs, got {item!r} in {spec!r}')
    key, value = key.strip(), value.strip()
    try:
      fields[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError) as e:
      if not (value.isidentifier() and isinstance(defaults.get(key), str)):
        raise ValueError(f'{key}={value!r} in {spec!r} is not a number or a boolean') from e
      fields[key] = value
  return methods.from_config({'name': name, **fields})


def evaluate_heads(
  config, target, heads: dict, full: dict, first_tokens, seed: int = 0
) -> list[dict]:
  """One row per (scope, drafter): the heads in ``heads`` (name -> DraftHead) and ``copy``, on
  the held-out batch ``full`` (:func:`run_config.load_heldout_batch`)."""
  settings = run_config.step_settings(config.train)
  settings = dataclasses.replace(settings, num_anchors=config.eval.get('heldout_anchors', 64))
  rows = []
  for n in first_tokens:
    batch = run_config.first_response_tokens(full, n) if n else full
    scope = f'first {n} response tokens' if n else 'whole responses'
    for name, head in heads.items():
      evaluate = head_step.make_heldout_eval(
        target, head.cfg, batch, settings, head.draft_vocab, seed=seed
      )
      metrics = evaluate(head.params)
      row = dict(
        scope=scope,
        first_tokens=n,
        drafter=name,
        accuracy=np.asarray(metrics['heldout_accuracy']).round(4).tolist(),
        expected_tau=round(float(metrics['heldout_expected_tau']), 4),
        loss=round(float(metrics['heldout_loss']), 4),
      )
      if head.cfg.kind != 'dspark':  # the anchors decoding visits (training/walk.py)
        row['walk_tau'] = round(float(walk.walk_metrics(head, target, batch)['walk_tau']), 4)
      rows.append(row)
      logging.info('%s', rows[-1])
    block_size = max(h.cfg.block_size for h in heads.values()) if heads else 8
    copy = copy_baseline.copy_metrics(batch, block_size=block_size)
    rows.append(
      dict(
        scope=scope,
        first_tokens=n,
        drafter='copy (prompt lookup, n <= 3)',
        accuracy=np.round(copy['accuracy'], 4).tolist(),
        expected_tau=round(float(copy['expected_tau']), 4),
        walk_tau=round(float(copy['walk_tau']), 4),
        anchors=copy['anchors'],
      )
    )
    logging.info('%s', rows[-1])
  return rows


def methods_for(head, method) -> list:
  """The methods that decode ``head`` as ``method`` would: ``method`` itself; for a JetSpec++
  head asked for a chain, the chain of its MASK drafting (what the walk scores) and the chain of
  its recycled guesses (JetSpec++ decoding); for a DSpark head asked for a chain, its own chain
  verified whole (threshold 0, what the held-out expected tau scores)."""
  if head.cfg.kind == 'dspark' and isinstance(method, methods.Chain):
    if method.copy_len:
      raise ValueError('a DSpark chain has no copy candidates: decode it with copy_len=0')
    return [methods.DSpark(threshold=0.0)]
  if head.cfg.kind == 'jetspecpp' and isinstance(method, methods.Chain):
    chain = dict(budget=head.cfg.block_size, width=1, copy_len=method.copy_len)
    return [methods.JetSpecPP(**chain, recycle=False), methods.JetSpecPP(**chain, recycle=True)]
  return [method]


def decode_heads(target, heads: dict, batch: dict, *, max_new_tokens: int, method) -> list[dict]:
  """Greedy decoding of the batch's prompts (the tokens before each response) with every head:
  tau over all rounds, and how many outputs equal the stored response's first tokens."""
  rows = []
  for name, head in heads.items():
    for head_method in methods_for(head, method):
      taus, same = [], 0
      for tokens, mask, length in zip(batch['tokens'], batch['loss_mask'], batch['lengths']):
        start = int(np.argmax(np.asarray(mask) > 0))
        out = decoding.generate(
          target,
          head,
          np.asarray(tokens[:start]),
          method=head_method,
          max_new_tokens=max_new_tokens,
        )
        taus.append(out.stats.tau)
        stored = np.asarray(tokens[start : int(length)])[: len(out.tokens)]
        same += int(np.array_equal(out.tokens[: len(stored)], stored))
      taus = np.concatenate(taus)
      rows.append(
        dict(
          drafter=name,
          method=str(head_method),
          new_tokens=max_new_tokens,
          tau=round(float(np.mean(taus)), 4),
          rounds=int(taus.size),
          sequences=len(batch['tokens']),
          equal_to_stored=same,
        )
      )
      logging.info('%s', rows[-1])
  return rows


def markdown(rows: list[dict]) -> str:
  lines = [
    '| scope | drafter | depth-1 acc. | depth 2 / 3 / 7 | expected chain tau | walk tau | loss |',
    '|---|---|---|---|---|---|---|',
  ]
  for r in rows:
    acc = r['accuracy']
    deeper = ' / '.join(f'{acc[k]:.3f}' for k in (1, 2, 6) if k < len(acc))
    loss = f'{r["loss"]:.2f}' if 'loss' in r else '-'
    walk = f'{r["walk_tau"]:.3f}' if 'walk_tau' in r else '-'
    lines.append(
      f'| {r["scope"]} | {r["drafter"]} | {acc[0]:.3f} | {deeper} | {r["expected_tau"]:.3f} '
      f'| {walk} | {loss} |'
    )
  return '\n'.join(lines) + '\n'


def main(argv):
  del argv
  config = FLAGS.config
  target = run_config.load_target_from_config(config.target)
  heads = {
    name: head_io.load_draft_head(path, target) for name, path in parse_heads(FLAGS.heads).items()
  }
  first_tokens = [int(n) for n in FLAGS.first_tokens]
  batch = run_config.load_heldout_batch(config, subdir=FLAGS.heldout_subdir)
  rows = evaluate_heads(config, target, heads, batch, first_tokens, seed=config.seed)
  table = markdown(rows)
  decoded = []
  if FLAGS.decode_tokens:
    for spec in FLAGS.decode_method:
      decoded += decode_heads(
        target, heads, batch, max_new_tokens=FLAGS.decode_tokens, method=parse_method(spec)
      )
    table += '\n| decoded (greedy) | method | new tokens | tau | rounds | outputs = stored |\n'
    table += '|---|---|---|---|---|---|\n'
    for r in decoded:
      table += (
        f'| {r["drafter"]} | {r["method"]} | {r["new_tokens"]} | {r["tau"]:.3f} | {r["rounds"]} '
        f'| {r["equal_to_stored"]} / {r["sequences"]} |\n'
      )
  print(table)
  if FLAGS.out and sharding.is_main_process():
    out = pathlib.Path(FLAGS.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    heads_dirs = parse_heads(FLAGS.heads)
    record = dict(
      provenance=dict(
        provenance.record(),
        weights_sha256={n: provenance.weights_sha256(d) for n, d in heads_dirs.items()},
      ),
      heads=heads_dirs,
      heldout=dict(
        data_dir=config.data.dir,
        shards=config.eval.heldout_shards,
        sequences=config.eval.heldout_sequences,
        anchors=config.eval.heldout_anchors,
      ),
      devices=str(jax.devices()),
      heldout_subdir=FLAGS.heldout_subdir,
      rows=rows,
      decoded=decoded,
    )
    out.write_text(json.dumps(record, indent=2))
    out.with_suffix('.md').write_text(table)


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  config_flags.DEFINE_config_file(
    'config',
    'experiments/configs/train/draft_smollm2.py',
    'The training config (target, data, eval).',
  )
  flags.DEFINE_string('heads', '', 'name=export_dir pairs, comma-separated.')
  flags.DEFINE_string(
    'heldout_subdir', 'greedy', "The held-out shards' directory under data.dir (round2/greedy)."
  )
  flags.DEFINE_list('first_tokens', ['0'], 'Score the first N response tokens (0: all).')
  flags.DEFINE_integer('decode_tokens', 0, 'Also decode the held-out prompts for N tokens.')
  flags.DEFINE_multi_string(
    'decode_method',
    ['chain'],
    'The methods --decode_tokens decodes with (repeatable): a name, or name:key=value,... '
    '(e.g. tree:budget=16,copy_len=4).',
  )
  flags.DEFINE_string('out', '', 'A JSON file for the rows (and a .md beside it).')
