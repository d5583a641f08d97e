"""Tau of greedy decoding read off a stored greedy response, for trees, chains, copy candidates
and DSpark, without decoding (docs/benchmarks.md, "The public table").

Greedy decoding commits exactly the target's greedy response, so the tokens every round verifies
against are known in advance: the stored ones. At every anchor ``p`` of the response the head
drafts from the target's features of ``x[0..p-1]`` (one teacher-forced forward of the whole
sequence) and the anchor token ``x[p]``; the method's own tree code
(:func:`jetspec_jax.methods.tree.draft_tree`, copy candidates included) builds the round's tree
and :func:`jetspec_jax.verify.accept` accepts along it with the stored tokens as the target's
choices. Decoding visits only some anchors: a round anchored at ``p`` that accepts ``k`` drafts
anchors the next at ``p + k + 1`` (:func:`walk`). A test shows the walk's rounds equal real
decoding's round by round; they can differ where the target's verify and its teacher-forced
forward disagree on a float near-tie (counted per prompt as ``label_mismatches``).
"""

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import methods as methods_lib
from jetspec_jax import tree as tree_lib
from jetspec_jax import verify as verify_lib
from jetspec_jax.methods import dspark as dspark_lib
from jetspec_jax.methods import tree as tree_method
from jetspec_jax.models import draft_head as dh
from jetspec_jax.models import matmul
from jetspec_jax.training import blocks as blocks_lib
from jetspec_jax.training import head_sums

LENGTH_BUCKET = 256  # sequences are padded to a multiple of it: one compile per bucket
ANCHOR_BUCKET = 128  # the response's anchors, padded to a multiple of it


@dataclasses.dataclass(frozen=True)
class Walk:
  """The rounds greedy decoding takes along one response.

  Attributes:
    committed: ``int[rounds]`` tokens each round commits (accepted drafts + the bonus).
    accepted: ``int[rounds]`` accepted drafts per round.
    max_accept: the most drafts a round can accept (the head's depth; DSpark's chain length).
  """

  committed: np.ndarray
  accepted: np.ndarray
  max_accept: int

  @property
  def rounds(self) -> int:
    return int(self.committed.size)

  @property
  def tau(self) -> float:
    return float(self.committed.mean()) if self.rounds else float('nan')

  @property
  def capped(self) -> int:
    """Rounds that accepted every draft the head could give (a longer block would go on)."""
    return int(np.sum(self.accepted >= self.max_accept))

  def histogram(self) -> list[int]:
    """Rounds by accepted drafts ``0 .. max_accept``."""
    return np.bincount(self.accepted, minlength=self.max_accept + 1).tolist()


def walk(accepted_at: np.ndarray, start: int, end: int, max_accept: int) -> Walk:
  """Decoding's walk over anchors ``start .. end`` (the response's first token to its
  next-to-last) accepting ``accepted_at[p]`` drafts at anchor ``p``; the last round stops at
  the response's last token."""
  committed, accepted = [], []
  p = start
  while p <= end:
    k = min(int(accepted_at[p]), end - p)
    accepted.append(k)
    committed.append(k + 1)
    p += k + 1
  return Walk(np.asarray(committed, np.int64), np.asarray(accepted, np.int64), max_accept)


def tree_settings(method: methods_lib.Method, head: dh.DraftHead, target) -> tree_method.Tree:
  """The tree a Tree / Chain / JetSpecPP(recycle=False) method builds each round."""
  if isinstance(method, methods_lib.JetSpecPP):
    if method.recycle or method.refine_passes:
      raise ValueError('a JetSpec++ round walks like a tree only with recycle=False and no refine')
    method = methods_lib.Tree(
      budget=method.budget,
      width=method.width,
      algorithm=method.algorithm,
      copy_len=method.copy_len,
      copy_ngram=method.copy_ngram,
    )
  if not isinstance(method, methods_lib.Tree | methods_lib.Chain):
    raise ValueError(f'{method!r} is not a tree method')
  return method.make_round(target, head)[0]


def padded(x: np.ndarray, size: int) -> np.ndarray:
  return np.pad(x, [(0, size - x.shape[0])] + [(0, 0)] * (x.ndim - 1))


def _chunked(x, chunk: int):
  """``[L, ...]`` -> ``[L / chunk, chunk, ...]`` (zero-padded)."""
  pad = -x.shape[0] % chunk
  return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape((-1, chunk) + x.shape[1:])


def _unchunked(x, seq_len: int):
  """``[chunks, rows, chunk]`` -> ``[rows, L]``."""
  return jnp.moveaxis(x, 1, 0).reshape(x.shape[1], x.shape[0] * x.shape[2])[:, :seq_len]


def _anchor_state(tokens, pos):
  """The round state a tree drafted at anchors ``pos`` of the stored sequence sees."""
  return types.SimpleNamespace(
    history=jnp.broadcast_to(tokens.astype(jnp.int32), (pos.shape[0], tokens.shape[0])),
    cache=types.SimpleNamespace(lengths=pos),
    anchor=tokens[pos].astype(jnp.int32),
  )


def _next_tokens(tokens):
  """The target's choice after a node at depth d of the round anchored at p: x[p + d + 1]."""
  return jnp.concatenate([tokens[1:], jnp.zeros((1,), tokens.dtype)]).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=('priors', 'width', 'dspark', 'chunk'))
def draft_at_anchors(
  head: dh.DraftHead,
  target,
  tokens,
  loss_mask,
  length,
  features,
  anchors,
  priors: tuple = (),
  width: int = 1,
  dspark: tuple = (),
  chunk: int = 16,
):
  """The head's drafts at ``anchors`` (``int32[W]``, positions of one stored sequence), from one
  pass of the head.

  Returns:
    (``{copy_prior: (ids, logprobs)}`` each ``[W, D, width]``, the tree candidates of each
    anchor; ``int32[len(dspark), W]`` the drafts DSpark's threshold rule accepts at each anchor).
  """
  cfg = head.cfg
  seq_len = tokens.shape[0]
  blk, _ = blocks_lib.every_anchor_blocks(cfg, tokens, loss_mask, length, anchors)
  compute_dtype = matmul.resolve(head.compute_dtype)  # drafting's own precision (decode's too)
  context_kv = head_sums.head_context_kv(head.params, cfg, features, compute_dtype)
  nxt = _next_tokens(tokens)

  def one_chunk(args):
    b, pos = args
    out = head_sums.head_blocks_on_context(
      head.params, cfg, target, context_kv, b, features.dtype, compute_dtype
    )
    state = _anchor_state(tokens, pos)
    candidates = {}
    if priors:
      draft_logits = head.vocab_logits(target, out[:, 1:])
      for prior in priors:
        merge = types.SimpleNamespace(copy_prior=prior, width=width)
        candidates[prior] = tree_method.tree_candidates(draft_logits, state, merge)
    rows = []
    if dspark:  # one greedy chain serves every threshold
      draft = dspark_lib.draft_chain(head, target, out, state.anchor, jax.random.key(0), 0.0)
      depth = jnp.arange(draft.tokens.shape[1])
      right = draft.tokens == nxt[jnp.clip(pos[:, None] + depth, 0, seq_len - 1)]
      run = jnp.sum(jnp.cumprod(right, axis=1), axis=1)
    for s in dspark:
      rows.append(jnp.minimum(run, dspark_lib.threshold_lengths(draft.confidence, s.threshold)))
    return candidates, jnp.stack(rows) if rows else jnp.zeros((0, chunk), jnp.int32)

  grouped = jax.tree.map(lambda x: _chunked(x, chunk), (blk, anchors))
  candidates, chains = jax.lax.map(one_chunk, grouped)
  window = anchors.shape[0]
  candidates = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:])[:window], candidates)
  return candidates, _unchunked(chains, window)


@functools.partial(jax.jit, static_argnames=('settings', 'max_depth', 'chunk'))
def accepted_in_trees(tokens, anchors, ids, logprobs, settings, max_depth: int, chunk: int = 16):
  """Drafts one tree setting accepts at each of ``anchors`` ``int32[W]``, from the anchors'
  candidates ``[W, D, width]`` (:func:`draft_at_anchors`)."""
  seq_len = tokens.shape[0]
  nxt = _next_tokens(tokens)

  def one_chunk(args):
    i, lp, pos = args
    tree, _ = tree_method.build_tree(i, lp, _anchor_state(tokens, pos), settings)
    anc = jax.vmap(lambda p: tree_lib.ancestor_mask(p, max_depth))(tree.parents)
    choices = nxt[jnp.clip(pos[:, None] + tree.depths, 0, seq_len - 1)]
    return verify_lib.accept(tree, anc, choices, max_depth).num_accepted

  grouped = (_chunked(ids, chunk), _chunked(logprobs, chunk), _chunked(anchors, chunk))
  return jax.lax.map(one_chunk, grouped).reshape(-1)[: anchors.shape[0]]


def accepted_at_anchors(
  head: dh.DraftHead,
  target,
  tokens,
  loss_mask,
  length,
  features,
  settings: tuple = (),
  dspark: tuple = (),
  chunk: int = 16,
  first: int = 0,
):
  """Drafts accepted at every anchor of one stored sequence, per method: ``int32[len(settings)
  + len(dspark), L]`` (0 where ``p`` is no anchor). Positions before ``first`` (the prompt's)
  are not drafted: the head runs on anchors ``first .. first + W - 1``, ``W`` the span from
  ``first`` to ``length`` rounded up to :data:`ANCHOR_BUCKET` (one compile per bucket).

  The head runs once (:func:`draft_at_anchors`: every anchor's top candidates, at the widest
  width of ``settings``); each tree is then built and accepted on its own
  (:func:`accepted_in_trees`), a narrower tree reading the candidates' first columns.

  Args:
    tokens, loss_mask: ``[L]`` the stored sequence (prompt + greedy response) and its response
      mask; ``length``: its length.
    features: ``[L, F]`` the target's tapped features of the sequence.
    settings: :class:`~jetspec_jax.methods.tree.Tree` values (a tree or chain head).
    dspark: :class:`~jetspec_jax.methods.dspark.DSpark` values with ``'threshold'`` (a DSpark
      head).
  """
  cfg = head.cfg
  priors = tuple(dict.fromkeys(s.copy_prior for s in settings))
  width = max((s.width for s in settings), default=1)
  span = -(-max(int(length) - first, 1) // ANCHOR_BUCKET) * ANCHOR_BUCKET
  anchors = jnp.int32(first) + jnp.arange(span, dtype=jnp.int32)
  candidates, chains = draft_at_anchors(
    head, target, tokens, loss_mask, length, features, anchors, priors, width, tuple(dspark), chunk
  )
  rows = [
    accepted_in_trees(tokens, anchors, *candidates[s.copy_prior], s, cfg.max_depth, chunk)
    for s in settings
  ]
  rows.extend(chains)
  valid = blocks_lib.valid_anchor_positions(loss_mask, length)
  at_anchors = jnp.zeros((len(rows), tokens.shape[0]), jnp.int32)
  at_anchors = at_anchors.at[:, anchors].set(jnp.stack(rows), mode='drop')
  return jnp.where(valid[None], at_anchors, 0)


@functools.partial(jax.jit, static_argnames=('taps',))
def sequence_features(target, tokens, taps: tuple[int, ...]):
  """The target's teacher-forced taps ``[L, F]`` of one sequence and its argmax ``[L]``."""
  hidden, features = head_sums.target_pass(target, tokens[None], taps)
  return features[0], jnp.argmax(target.lm_logits(hidden[0]), axis=-1).astype(jnp.int32)


def _sequence(prompt_ids, response):
  """Prompt + response as int32 ids padded to the length bucket, and the unpadded length."""
  seq = np.concatenate([np.asarray(prompt_ids, np.int32), np.asarray(response, np.int32)])
  size = -(-len(seq) // LENGTH_BUCKET) * LENGTH_BUCKET
  return padded(seq, size), len(seq)


def teacher_forced(target, prompt_ids, response, taps: tuple[int, ...]):
  """The sequence's tapped features (what :func:`walks` drafts from; any head with these taps)
  and ``label_mismatches``: the response positions where the teacher-forced argmax differs from
  the stored token (a float near-tie between that forward and the one that generated it)."""
  seq, n = _sequence(prompt_ids, response)
  features, argmax = sequence_features(target, jnp.asarray(seq), tuple(taps))
  start = len(prompt_ids)
  predicted = np.asarray(argmax)[start - 1 : n - 1]
  return features, int(np.sum(seq[start:n] != predicted))


def walks(
  target, head: dh.DraftHead, prompt_ids, response, method_list, features=None
) -> tuple[list[Walk], dict]:
  """Decoding's walks along ``response`` (the target's greedy tokens after ``prompt_ids``, the
  prefill's first token included) for each method of ``method_list`` run by ``head``;
  ``features``: :func:`teacher_forced`'s, computed here when not given.

  Returns:
    (one :class:`Walk` per method, facts of the sequence: ``label_mismatches`` when the features
    were computed here).
  """
  seq, n = _sequence(prompt_ids, response)
  mask = np.zeros(len(seq), np.int32)
  mask[len(prompt_ids) : n] = 1
  facts = {}
  if features is None:
    features, facts['label_mismatches'] = teacher_forced(
      target, prompt_ids, response, head.cfg.target_layer_ids
    )
  trees, chains = [], []
  for m in method_list:
    if isinstance(m, methods_lib.DSpark):
      if m.verify_length != 'threshold':
        raise ValueError('the walk follows DSpark with a threshold verify length')
      chains.append(m)
    else:
      trees.append(tree_settings(m, head, target))
  accepted = np.asarray(
    accepted_at_anchors(
      head,
      target,
      jnp.asarray(seq),
      jnp.asarray(mask),
      jnp.int32(n),
      features,
      settings=tuple(trees),
      dspark=tuple(chains),
      first=len(prompt_ids),
    )
  )
  start, end = len(prompt_ids), n - 2
  order = [m for m in method_list if not isinstance(m, methods_lib.DSpark)]
  order += [m for m in method_list if isinstance(m, methods_lib.DSpark)]
  by_method = {}
  for row, m in zip(accepted, order, strict=True):
    by_method[id(m)] = walk(row, start, end, head.cfg.max_depth)
  return [by_method[id(m)] for m in method_list], facts
