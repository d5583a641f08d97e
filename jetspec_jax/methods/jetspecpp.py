"""JetSpec++: each round's draft block is seeded with the previous round's draft of the same
positions, and refines it on the now-true context (docs/design.md §5; docs/methods.md §5).

A JetSpec block anchored at ``P`` drafts positions ``P+1 .. P+D`` from MASK slots. After a round
commits ``tau`` tokens, the next anchor sits at ``P' = P + tau`` and the old draft still holds a
guess for positions ``P'+1 .. P+D``: the **pre-draft** of the next block, made while the current
tree was being built and verified, at no extra cost. A JetSpec++ head (``DraftHeadConfig.refine``)
reads those guesses in its slots (``embed(token) + draft_embed``) instead of MASK, with the
committed context's features now including the accepted tokens, and outputs **refined**
per-depth logits; slots with no guess stay MASK, or, for a copy-seeded head
(``DraftHeadConfig.copy_seed``), take the context's copy candidates. Optionally
``refine_passes`` more passes feed the block its own rank-1 trunk (in-round Jacobi refinement).
The refined trunk becomes the guesses of the next round.

Lossless: the tree verified in a round is a deterministic function of the committed prefix and
of draft-side state (earlier drafts), never of the target's choices in this round, and it is
verified exactly as a JetSpec tree (greedy match; at ``T > 0`` sample-and-match, which is exact
for any tree). With no guess in any slot the round is the JetSpec round bit for bit.

Per round the counters ``guessed`` (slots fed a guess), ``guess_checked`` (of those, slots at a
position this round committed) and ``guess_correct`` (of those, guesses equal to the committed
token) are reported in :attr:`jetspec_jax.rounds.RoundOutput.stats`.
"""

import dataclasses

import jax.numpy as jnp

from jetspec_jax import rounds as rounds_lib
from jetspec_jax.methods import tree as tree_method
from jetspec_jax.methods.base import Method
from jetspec_jax.models import decoder
from jetspec_jax.models import draft_head as draft_head_lib
from jetspec_jax.typing import Array, Int

NO_GUESS = -1
STAT_NAMES = ('guessed', 'guess_checked', 'guess_correct')


def init_guesses(head: draft_head_lib.DraftHead, state: rounds_lib.RoundState):
  """A state with no guesses yet (the first round drafts from MASK slots)."""
  b = state.anchor.shape[0]
  return state.replace(guesses=jnp.full((b, head.cfg.max_depth), NO_GUESS, jnp.int32))


def realign(guesses: Int[Array, 'B depth'], shift: Int[Array, ' B']) -> Int[Array, 'B depth']:
  """The last draft's guesses for the slots of the next block: the last block was anchored
  ``shift`` (= its tau) positions before this one, so slot ``i`` takes guess ``shift + i``, or
  ``NO_GUESS`` past the last draft."""
  depth = guesses.shape[1]
  idx = shift[:, None] + jnp.arange(depth)[None]
  taken = jnp.take_along_axis(guesses, jnp.clip(idx, 0, depth - 1), axis=1)
  return jnp.where(idx < depth, taken, NO_GUESS)


def refined_logits(
  target: decoder.Target,
  head: draft_head_lib.DraftHead,
  draft_cache,
  anchor: Int[Array, ' B'],
  guesses: Int[Array, 'B depth'],
  refine_passes: int = 0,
):
  """Per-depth logits ``[B, D, V]`` of the block whose slots hold ``guesses`` (``NO_GUESS``:
  MASK), then ``refine_passes`` times of the block holding the previous pass's trunk."""
  logits = head.propose_cached(target, draft_cache, anchor, guesses)
  for _ in range(refine_passes):
    trunk = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = head.propose_cached(target, draft_cache, anchor, trunk)
  return logits


def draft(
  target: decoder.Target,
  head: draft_head_lib.DraftHead,
  state: rounds_lib.RoundState,
  recycle: bool,
  refine_passes: int,
):
  """The head's part of a round: (head context cache with the last accepted features, the slot
  guesses fed, refined per-depth logits ``[B, D, V]``)."""
  draft_cache = head.extend_context(state.draft_cache, state.pending, state.num_pending)
  guesses = realign(state.guesses, state.num_pending)  # the last round committed num_pending
  if not recycle:
    guesses = jnp.full_like(guesses, NO_GUESS)
  copy = tree_method.copy_seed_guesses(head, state)  # a copy-seeded head: the empty slots
  if copy is not None:
    guesses = jnp.where(guesses == NO_GUESS, copy, guesses)
  logits = refined_logits(target, head, draft_cache, state.anchor, guesses, refine_passes)
  return draft_cache, guesses, logits


def jetspecpp_round(
  target: decoder.Target,
  head: draft_head_lib.DraftHead,
  state: rounds_lib.RoundState,
  sampling: rounds_lib.Sampling,
  tree_settings: tree_method.Tree,
  *,
  recycle: bool = True,
  refine_passes: int = 0,
) -> tuple[rounds_lib.RoundState, rounds_lib.RoundOutput]:
  """One JetSpec++ round: seed the block with last round's guesses -> refine -> tree -> verify
  -> accept -> commit; the refined trunk is kept as the next round's guesses."""
  if head.cfg.kind != 'jetspecpp':
    raise ValueError(f'a JetSpec++ round needs a jetspecpp head, got a {head.cfg.kind} head')
  draft_cache, guesses, logits = draft(target, head, state, recycle, refine_passes)
  new_state, out = tree_method.verify_tree_round(
    target, head, state, draft_cache, logits, sampling, tree_settings
  )
  fed = guesses >= 0
  committed_slot = jnp.arange(guesses.shape[1])[None] < out.tau[:, None]  # positions P+1..P+tau
  checked = fed & committed_slot
  correct = checked & (guesses == out.committed[:, : guesses.shape[1]])
  stats = dict(
    **(out.stats or {}),
    guessed=jnp.sum(fed, axis=1, dtype=jnp.int32),
    guess_checked=jnp.sum(checked, axis=1, dtype=jnp.int32),
    guess_correct=jnp.sum(correct, axis=1, dtype=jnp.int32),
  )
  new_state = new_state.replace(guesses=jnp.argmax(logits, axis=-1).astype(jnp.int32))
  return new_state, out.replace(stats=stats)


@dataclasses.dataclass(frozen=True)
class JetSpecPP(Method):
  """JetSpec++: a JetSpec++ head's tree, its block seeded with the previous round's draft of the
  same positions and refined on the now-true context.

  Attributes:
    budget, width, algorithm, copy_len, copy_ngram: the tree, as :class:`~jetspec_jax.methods.Tree`.
    recycle: seed each block with the previous draft of its positions (False: MASK slots, i.e.
      the JetSpec round with this head).
    refine_passes: extra head passes per round, each fed the previous pass's trunk.
  """

  name = 'jetspecpp'
  head_kinds = ('jetspecpp',)

  budget: int = dataclasses.field(default_factory=tree_method.default_budget)
  width: int = 7
  algorithm: str = tree_method.DEFAULT_ALGORITHM
  copy_len: int = 0
  copy_ngram: int = 4
  recycle: bool = True
  refine_passes: int = 0

  def __post_init__(self):
    if self.refine_passes < 0:
      raise ValueError(f'{self.refine_passes=} must be >= 0')
    _ = self.tree  # the tree's own checks

  @property
  def tree(self) -> tree_method.Tree:
    return tree_method.Tree(self.budget, self.width, self.algorithm, self.copy_len, self.copy_ngram)

  @property
  def stat_names(self) -> tuple[str, ...]:
    return STAT_NAMES + self.tree.stat_names

  @property
  def keeps_history(self) -> bool:
    return self.tree.keeps_history

  def make_round(self, target, head):
    self.tree.make_round(target, head)
    return self, self.budget

  def init_state(self, head, state):
    return init_guesses(head, state)

  def draft(self, target, head, state):
    """The head's part of a round alone (its cost is the round's draft share)."""
    return draft(target, head, state, self.recycle, self.refine_passes)[2]

  def __call__(self, target, head, state, sampling, round_data=None):
    return jetspecpp_round(
      target,
      head,
      state,
      sampling,
      self.tree,
      recycle=self.recycle,
      refine_passes=self.refine_passes,
    )
