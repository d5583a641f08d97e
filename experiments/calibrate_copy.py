"""How often copy candidates are right, by match length: the priors of ``Tree(copy_prior=...)``.

  python -m experiments.calibrate_copy --out=benchmarks/copy_calibration_smollm2_135m.json

On held-out greedy sequences of the target (token shards only, no features), every response
position is an anchor: the continuation of the longest earlier match (up to ``--max_ngram``
tokens) of the context ending there (:func:`jetspec_jax.prompt_lookup.continuation`) is compared
with the tokens that follow. Per match length ``n``: how many anchors have one, the precision of
the first copied token, and the precision of depth ``d`` given depths ``< d`` were right (the
conditional probability a tree builder adds along a path). ``copy_prior`` is the first
token's precision per ``n``: deeper tokens of a right copy are right more often (the match has
grown), so it under-weights them, never the first.
"""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from jetspec_jax import prompt_lookup

FLAGS = flags.FLAGS
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


def anchor_outcomes(tokens: np.ndarray, loss_mask: np.ndarray, max_ngram: int, depth: int):
  """Per response anchor of one sequence: (match length, copied count, ``bool[depth]`` whether
  each copied token equals the sequence's next ones)."""
  n = len(tokens)
  history = jnp.asarray(tokens, jnp.int32)
  lookup = functools.partial(prompt_lookup.continuation, max_ngram=max_ngram, length=depth)
  anchors = np.nonzero(loss_mask[1:n])[0]  # position p predicts p + 1, a response token
  anchors = anchors[anchors + 1 < n]
  copied, count, ngram = jax.jit(jax.vmap(lookup, in_axes=(None, 0)))(history, jnp.asarray(anchors))
  copied, count, ngram = map(np.asarray, (copied, count, ngram))
  future = np.full((len(anchors), depth), -1)
  for d in range(depth):
    at = anchors + 1 + d
    future[:, d] = np.where(at < n, tokens[np.minimum(at, n - 1)], -1)
  right = (copied == future) & (np.arange(depth)[None] < count[:, None])
  return ngram, count, right


def calibrate(shards, max_ngram: int, depth: int) -> dict:
  ngrams, counts, rights = [], [], []
  for path in shards:
    with np.load(path) as z:
      for tokens, mask, length in zip(z['tokens'], z['loss_mask'], z['lengths'], strict=True):
        g, c, r = anchor_outcomes(tokens[:length].astype(np.int64), mask[:length], max_ngram, depth)
        ngrams.append(g), counts.append(c), rights.append(r)
  ngram, count, right = map(np.concatenate, (ngrams, counts, rights))
  rows = []
  for n in range(1, max_ngram + 1):
    sel = ngram == n
    r, c = right[sel], count[sel]
    prefix_right = np.cumprod(r, axis=1).astype(bool)  # depths 0..d all right
    conditional, hits, tries = [], 0, 0
    for d in range(depth):
      reached = (c > d) & (prefix_right[:, d - 1] if d else True)
      h, t = int(r[reached, d].sum()), int(reached.sum())
      conditional.append(h / t if t else None)
      hits, tries = hits + h, tries + t
    rows.append(
      dict(
        ngram=n,
        anchors=int(sel.sum()),
        share_of_anchors=float(sel.mean()),
        first_precision=float(r[:, 0].mean()) if sel.any() else None,
        conditional_precision=conditional,
        pooled_conditional=hits / tries if tries else None,
      )
    )
  return dict(
    shards=list(shards),
    anchors=int(len(ngram)),
    no_match=float((ngram == 0).mean()),
    rows=rows,
    copy_prior=[round(r['first_precision'], 2) for r in rows],
  )


def main(argv):
  del argv
  result = calibrate(FLAGS.shards, FLAGS.max_ngram, FLAGS.depth)
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


if __name__ == '__main__':
  app.run(main)
