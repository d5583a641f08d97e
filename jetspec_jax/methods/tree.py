"""Tree and chain rounds: the JetSpec round and the DFlash-style chain baseline.

One round, for ``B`` sequences: the head drafts per-depth logits for the block after the anchor in
one forward; a tree of ``budget`` nodes (root = the anchor) is built from them
(:mod:`jetspec_jax.tree`: ``accum_logp``, ``top2gap`` or ``best_first``), optionally with a copy
branch (:mod:`jetspec_jax.prompt_lookup`); the target verifies the whole tree in one tree-masked
forward;
the longest path the target agrees with is committed with the target's bonus token
(:mod:`jetspec_jax.verify`; docs/design.md §5). A chain is the tree of width 1.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jetspec_jax import prompt_lookup
from jetspec_jax import rounds as rounds_lib
from jetspec_jax import tree as tree_lib
from jetspec_jax import verify as verify_lib
from jetspec_jax.kv_cache import KVCache
from jetspec_jax.methods.base import Method
from jetspec_jax.models import decoder
from jetspec_jax.models import draft_head as draft_head_lib
from jetspec_jax.typing import Array

# Per-round counters of a round with copy candidates: nodes the copy branch added to the tree,
# and how many of them were accepted (drafts the head's own tree did not hold).
COPY_STATS = ('copy_nodes', 'copy_accepted')
# The head kinds whose per-depth logits build a tree (DSpark and JetSpec++ heads run their own).
TREE_HEADS = ('jetspec', 'dflash')
# The defaults are the measured best (docs/methods.md, "Defaults"): ``best_first`` commits more
# per round than ``accum_logp`` at every budget of the public table; the budget is per platform,
# because a CPU verifies a tree at a cost that grows with its nodes (8 is its fastest setting,
# the main job's table) and an accelerator verifies the paper's 128 nodes in about one decode
# step.
DEFAULT_ALGORITHM = 'best_first'
CPU_BUDGET = 8
ACCELERATOR_BUDGET = 128


def default_budget() -> int:
  """The tree budget for the platform JAX runs on: ``CPU_BUDGET`` or ``ACCELERATOR_BUDGET``."""
  return CPU_BUDGET if jax.default_backend() == 'cpu' else ACCELERATOR_BUDGET


def check_copy(copy_len: int, copy_ngram: int) -> None:
  if copy_len < 0 or copy_ngram < 1:
    raise ValueError(f'{copy_len=} must be >= 0 and {copy_ngram=} >= 1')


def check_copy_fits(copy_len: int, head) -> None:
  if copy_len > head.cfg.max_depth:
    raise ValueError(f'{copy_len=} must be in [0, the head depth {head.cfg.max_depth}]')


@dataclasses.dataclass(frozen=True)
class Tree(Method):
  """JetSpec: a draft tree of ``budget`` nodes (root included), ``width`` candidates per depth,
  built by ``algorithm`` (``'accum_logp'``, ``'top2gap'`` or ``'best_first'``,
  :data:`jetspec_jax.tree.TREE_BUILDERS`).

  ``copy_len > 0`` adds copy candidates (:mod:`jetspec_jax.prompt_lookup`): up to ``copy_len``
  tokens that followed the latest longest match (``1..copy_ngram`` tokens) of the context's
  suffix join the tree as one branch (:func:`jetspec_jax.tree.add_branch`). They count in the
  budget: the head's tree gets ``budget - copy_len`` nodes; ``copy_len`` is at most the head's
  depth. ``stats.round_stats`` then counts ``copy_nodes`` and ``copy_accepted``.

  ``copy_prior`` (instead of ``copy_len``) merges the copy candidates into the head's instead:
  the continuation's token at each depth gets probability ``copy_prior[n - 1]`` for a match of
  ``n`` tokens when the head gives it less (:func:`jetspec_jax.prompt_lookup.merge_into_logprobs`),
  and the builder spends the whole budget.

  ``depth_bonus`` is added to every candidate's log-probability while the tree is built: a node at
  depth ``d`` scores ``d * depth_bonus`` more, so a positive bonus grows deeper, narrower trees.
  The head's per-depth distributions are marginals, and a path's later tokens are right more
  often once its earlier ones are (the conditional acceptance exceeds the marginal), which a
  product of marginals does not see. It shapes the tree only: verification and acceptance read
  the draft logits, so output stays the target's.
  """

  name = 'tree'
  head_kinds = TREE_HEADS

  budget: int = dataclasses.field(default_factory=default_budget)
  width: int = 7
  algorithm: str = DEFAULT_ALGORITHM
  copy_len: int = 0
  copy_ngram: int = 4
  copy_prior: tuple[float, ...] = ()
  depth_bonus: float = 0.0

  def __post_init__(self):
    object.__setattr__(self, 'copy_prior', tuple(float(p) for p in self.copy_prior))
    object.__setattr__(self, 'depth_bonus', float(self.depth_bonus))
    if any(not 0.0 < p <= 1.0 for p in self.copy_prior):
      raise ValueError(f'copy_prior={self.copy_prior} must hold probabilities in (0, 1]')
    if self.copy_prior and self.copy_len:
      raise ValueError('copy_prior merges copy candidates into the tree; copy_len must be 0')
    if self.budget < 1:
      raise ValueError(f'budget={self.budget} must be >= 1 (it counts the root)')
    if self.width < 1:
      raise ValueError(f'width={self.width} must be >= 1')
    if self.algorithm not in tree_lib.TREE_BUILDERS:
      raise ValueError(
        f'algorithm must be one of {sorted(tree_lib.TREE_BUILDERS)}, got {self.algorithm!r}'
      )
    check_copy(self.copy_len, self.copy_ngram)
    if self.budget - self.copy_len < 1:
      raise ValueError(
        f'budget={self.budget} leaves no node for the head after copy_len={self.copy_len} '
        '(the root counts)'
      )

  @property
  def stat_names(self) -> tuple[str, ...]:
    return COPY_STATS if self.copy_len else ()

  @property
  def keeps_history(self) -> bool:
    return self.copy_len > 0 or bool(self.copy_prior)

  def make_round(self, target, head):
    if self.width > target.cfg.vocab_size:
      raise ValueError(f'width={self.width} must be in [1, vocab_size={target.cfg.vocab_size}]')
    check_copy_fits(self.copy_len, head)
    return self, self.budget

  def __call__(self, target, head, state, sampling, round_data=None):
    return speculative_round(target, head, state, sampling, self)

  def draft(self, target, head, state):
    """The head's part of a round alone (its cost is the round's draft share)."""
    return draft(target, head, state)[1]


@dataclasses.dataclass(frozen=True)
class Chain(Method):
  """The head's top-1 block verified as a chain (the DFlash baseline): the tree of width 1 and
  ``block_size`` nodes; copy candidates (``copy_len``, as :class:`Tree`'s) come on top."""

  name = 'chain'
  head_kinds = TREE_HEADS

  copy_len: int = 0
  copy_ngram: int = 4

  def __post_init__(self):
    check_copy(self.copy_len, self.copy_ngram)

  def make_round(self, target, head):
    check_copy_fits(self.copy_len, head)
    tree = Tree(
      budget=head.cfg.block_size + self.copy_len,
      width=1,
      copy_len=self.copy_len,
      copy_ngram=self.copy_ngram,
    )
    return tree.make_round(target, head)


def speculative_round(
  target: decoder.Target,
  head: draft_head_lib.DraftHead,
  state: rounds_lib.RoundState,
  sampling: rounds_lib.Sampling,
  tree_settings: Tree,
  choose: rounds_lib.Choose | None = None,
) -> tuple[rounds_lib.RoundState, rounds_lib.RoundOutput]:
  """One JetSpec round: draft -> tree -> verify -> accept -> commit (docs/design.md §5).

  ``choose(tree, logits, key) -> int32[B, M]`` gives the target's token at every node; by default
  it samples the verified logits with ``sampling`` (greedy: argmax). Anything else (a benchmark
  forcing a fixed acceptance) is passed in, never built into the round.
  """
  draft_cache, draft_logits = draft(target, head, state)
  return verify_tree_round(
    target, head, state, draft_cache, draft_logits, sampling, tree_settings, choose
  )


def draft(target: decoder.Target, head: draft_head_lib.DraftHead, state: rounds_lib.RoundState):
  """The head's part of a round: (head context cache with the last accepted features,
  per-depth logits ``[B, D, V]``; a copy-seeded head's slots hold the context's copy
  candidates)."""
  draft_cache = head.extend_context(state.draft_cache, state.pending, state.num_pending)
  guesses = copy_seed_guesses(head, state)
  return draft_cache, head.propose_cached(target, draft_cache, state.anchor, guesses)


def copy_seed_guesses(head: draft_head_lib.DraftHead, state: rounds_lib.RoundState):
  """A copy-seeded head's slot guesses ``[B, depth]`` (the context's copy candidates, ``-1``
  where none; :func:`jetspec_jax.prompt_lookup.seed_guesses`), or None for any other head."""
  if not head.cfg.copy_seed:
    return None
  if state.history is None:
    raise ValueError('a copy_seed head drafts from RoundState.history (start_rounds keeps it)')
  seed = functools.partial(
    prompt_lookup.seed_guesses, max_ngram=head.cfg.copy_seed, depth=head.cfg.max_depth
  )
  return jax.vmap(seed)(state.history, state.cache.lengths)


def verify_tree_round(
  target: decoder.Target,
  head: draft_head_lib.DraftHead,
  state: rounds_lib.RoundState,
  draft_cache: KVCache,
  draft_logits: Array,
  sampling: rounds_lib.Sampling,
  tree_settings: Tree,
  choose: rounds_lib.Choose | None = None,
) -> tuple[rounds_lib.RoundState, rounds_lib.RoundOutput]:
  """The rest of a tree round, from the per-depth ``draft_logits [B, D, V]``: tree -> verify ->
  accept -> commit. ``draft_cache`` already holds the committed context's features."""
  max_depth = head.cfg.max_depth
  tree, from_copy = draft_tree(draft_logits, state, tree_settings)
  anc = jax.vmap(lambda p: tree_lib.ancestor_mask(p, max_depth))(tree.parents)
  verified = verify_lib.verify_tree(target, state.cache, tree, anc, head.cfg.target_layer_ids)
  key, sub = jax.random.split(state.key)
  if choose is None:
    choices = sampling.sample(verified.logits, sub)  # [B, M]
  else:
    choices = choose(tree, verified.logits, sub)
  accepted = verify_lib.accept(tree, anc, choices, max_depth)
  bonus = jnp.maximum(accepted.bonus, 0)  # a chooser may mark "no token" with -1
  cache = verify_lib.commit(verified.cache, state.cache.lengths, accepted._replace(bonus=bonus))
  pending = verify_lib.gather_path(verified.features, accepted.path)
  path_tokens = jnp.take_along_axis(tree.tokens, accepted.path, axis=1)  # [B, D+1], root first
  committed = jnp.concatenate([path_tokens[:, 1:], jnp.zeros_like(bonus)[:, None]], axis=1)
  rows = jnp.arange(bonus.shape[0])
  committed = committed.at[rows, accepted.num_accepted].set(bonus)
  tau = accepted.num_accepted + 1
  stats = None
  if from_copy is not None:
    on_path = jnp.arange(max_depth + 1)[None] <= accepted.num_accepted[:, None]
    stats = dict(
      copy_nodes=jnp.sum(from_copy, axis=1, dtype=jnp.int32),
      copy_accepted=jnp.sum(
        jnp.take_along_axis(from_copy, accepted.path, axis=1) & on_path, axis=1, dtype=jnp.int32
      ),
    )
  new_state = state.replace(
    cache=cache,
    draft_cache=draft_cache,
    pending=pending,
    num_pending=tau,
    anchor=bonus,
    key=key,
  )
  out = rounds_lib.RoundOutput(
    committed, tau, tree, anc, choices, accepted.path, draft_logits, stats=stats
  )
  return new_state, out


def draft_tree(
  draft_logits: Array, state: rounds_lib.RoundState, settings: Tree
) -> tuple[tree_lib.Tree, Array | None]:
  """The round's trees ``[B, budget]`` from per-depth logits ``[B, D, V]``, and with copy
  candidates (``settings.copy_len > 0``) which nodes they added (``bool[B, budget]``)."""
  ids, logprobs = tree_candidates(draft_logits, state, settings)
  return build_tree(ids, logprobs, state, settings)


def tree_candidates(
  draft_logits: Array, state: rounds_lib.RoundState, settings: Tree, width: int | None = None
) -> tuple[Array, Array]:
  """Each depth's top candidates ``[B, D, width]`` (ids, log-probabilities; ``width`` defaults
  to the settings'), copy priors merged in. Their first ``w`` columns are the top ``w`` (a
  caller may share one top-k among trees of several widths)."""
  if settings.copy_prior:
    if state.history is None:
      raise ValueError('copy candidates need RoundState.history (start_rounds(keep_history=True))')
    logprobs = jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)
    merge = functools.partial(prompt_lookup.merge_into_logprobs, prior=settings.copy_prior)
    draft_logits = jax.vmap(merge)(logprobs, state.history, state.cache.lengths)
  # Merged copy candidates are not renormalised: each keeps the probability it was given.
  normalize = not settings.copy_prior
  return tree_lib.topk_per_depth(draft_logits, width or settings.width, normalize=normalize)


def build_tree(
  ids: Array, logprobs: Array, state: rounds_lib.RoundState, settings: Tree
) -> tuple[tree_lib.Tree, Array | None]:
  """:func:`draft_tree` from the candidates :func:`tree_candidates` gives (the settings' width
  of them is read)."""
  ids, logprobs = ids[..., : settings.width], logprobs[..., : settings.width]
  if settings.depth_bonus:
    logprobs = logprobs + settings.depth_bonus
  head_budget = settings.budget - settings.copy_len
  builder = functools.partial(tree_lib.TREE_BUILDERS[settings.algorithm], budget=head_budget)
  tree = jax.vmap(lambda i, lp, a: builder(i, lp, anchor=a))(ids, logprobs, state.anchor)
  if not settings.copy_len:
    return tree, None
  if state.history is None:
    raise ValueError('copy candidates need RoundState.history (start_rounds(keep_history=True))')
  tree = tree_lib.pad(tree, settings.copy_len)
  lookup = functools.partial(
    prompt_lookup.continuation, max_ngram=settings.copy_ngram, length=settings.copy_len
  )
  tokens, count, _ = jax.vmap(lookup)(state.history, state.cache.lengths)
  return jax.vmap(tree_lib.add_branch)(tree, tokens, count)
