"""How often copy candidates are right, by match length: the priors of ``Tree(copy_prior=...)``.

  python -m experiments.data --task=copy_priors --out=benchmarks/copy_calibration_smollm2_135m.json

On held-out greedy sequences of the target (token shards only, no features), every response
position is an anchor: the continuation of the longest earlier match (up to ``--max_ngram``
tokens) of the context ending there (:func:`jetspec_jax.prompt_lookup.continuation`) is compared
with the tokens that follow. Per match length ``n``: how many anchors have one, the precision of
the first copied token, and the precision of depth ``d`` given depths ``< d`` were right (the
conditional probability a tree builder adds along a path). ``copy_prior`` is the first
token's precision per ``n``: deeper tokens of a right copy are right more often (the match has
grown), so it under-weights them, never the first.
"""

import json
import pathlib

from absl import flags

from jetspec_jax.training import copy_calibration

FLAGS = flags.FLAGS


def main(argv):
  del argv
  result = copy_calibration.calibrate(FLAGS.shards, FLAGS.max_ngram, FLAGS.depth)
  for r in result['rows']:
    cond = ' '.join('-' if p is None else f'{p:.2f}' for p in r['conditional_precision'])
    print(
      f'n={r["ngram"]}: {r["anchors"]} anchors ({r["share_of_anchors"]:.2f}), first '
      f'{r["first_precision"]:.3f}, conditional by depth {cond} (pooled '
      f'{r["pooled_conditional"]:.3f})'
    )
  print(f'anchors {result["anchors"]}, no match {result["no_match"]:.3f}')
  print(f'copy_prior={tuple(result["copy_prior"])}')
  if FLAGS.out:
    pathlib.Path(FLAGS.out).write_text(json.dumps(result, indent=2))


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  flags.DEFINE_list(
    'shards',
    [
      'data/smollm2_135m/data/greedy/shard_00000.npz',
      'data/smollm2_135m/data/round1/greedy/shard_00000.npz',
      'data/smollm2_135m/data/round2/greedy/shard_00000.npz',
    ],
    'Held-out greedy token shards (each directory first shard is never trained on).',
  )
  flags.DEFINE_integer('max_ngram', 4, 'Longest suffix match tried.')
  flags.DEFINE_integer('depth', 7, 'Copied tokens per anchor (the head depth).')
  flags.DEFINE_string('out', None, 'Write the table here (JSON).')
