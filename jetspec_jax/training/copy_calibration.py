"""How often copy candidates are right, by match length, on stored token shards: the priors of
``Tree(copy_prior=...)`` (run by ``experiments/tasks/copy_priors.py``).

Every response position of a sequence is an anchor: the continuation of the longest earlier match
of the context ending there (:func:`jetspec_jax.prompt_lookup.continuation`) is compared with the
tokens that follow. Per match length ``n``: how many anchors have one, the precision of the first
copied token, and the precision of depth ``d`` given depths ``< d`` were right (the conditional
probability a tree builder adds along a path). ``copy_prior`` is the first token's precision per
``n``: deeper tokens of a right copy are right more often (the match has grown), so it
under-weights them, never the first.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import prompt_lookup

BUCKET = 256  # sequences and anchor lists are padded to multiples of it: one compile per bucket


@functools.partial(jax.jit, static_argnames=('max_ngram', 'depth'))
def _lookup_all(history, anchors, *, max_ngram: int, depth: int):
  lookup = functools.partial(prompt_lookup.continuation, max_ngram=max_ngram, length=depth)
  return jax.vmap(lookup, in_axes=(None, 0))(history, anchors)


def _pad(x: np.ndarray) -> np.ndarray:
  return np.pad(x, (0, -len(x) % BUCKET))


def anchor_outcomes(tokens: np.ndarray, loss_mask: np.ndarray, max_ngram: int, depth: int):
  """Per response anchor of one sequence: (match length, copied count, ``bool[depth]`` whether
  each copied token equals the sequence's next ones)."""
  n = len(tokens)
  anchors = np.nonzero(loss_mask[1:n])[0]  # position p predicts p + 1, a response token
  anchors = anchors[anchors + 1 < n]
  # Padding changes nothing: the lookup reads history up to its anchor only, and padded anchors
  # (0) are dropped.
  history = jnp.asarray(_pad(np.asarray(tokens)), jnp.int32)
  out = _lookup_all(history, jnp.asarray(_pad(anchors)), max_ngram=max_ngram, depth=depth)
  copied, count, ngram = (np.asarray(x)[: len(anchors)] for x in out)
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
    copy_prior=copy_prior_from_precisions([r['first_precision'] for r in rows]),
  )


PRIOR_FLOOR = 0.01  # the smallest prior at two decimals: Tree(copy_prior=...) takes (0, 1]


def copy_prior_from_precisions(precisions) -> list[float]:
  """``Tree(copy_prior=...)`` from per-match-length first-token precisions (None: no anchor had
  a match of that length).

  Rounded to two decimals and floored at :data:`PRIOR_FLOOR`, so every entry is a probability
  ``Tree`` accepts. A length without anchors takes the prior of the nearest shorter length that
  has some (a longer match is at least as often right), else of the nearest longer one.
  """
  known = [i for i, p in enumerate(precisions) if p is not None]
  if not known:
    raise ValueError('no anchor had a copy match of any length: nothing to calibrate on')
  prior = []
  for i in range(len(precisions)):
    shorter = [k for k in known if k <= i]
    source = shorter[-1] if shorter else known[0]
    prior.append(max(PRIOR_FLOOR, round(float(precisions[source]), 2)))
  return prior
