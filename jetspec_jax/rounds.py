"""The device side of generation that every method shares: prefill, the AR loop, the round state
and the speculative loop.

Every method runs its whole decode in one jitted function: prefill, then ``lax.while_loop`` over
steps (AR) or speculative rounds, with no host sync until the end (docs/design.md §2, "the decode
loop"). A speculative round is one function of a named :class:`RoundState`: the method value
itself (:mod:`jetspec_jax.methods`: :class:`~jetspec_jax.methods.Tree`,
:class:`~jetspec_jax.methods.DSpark`, ...), passed to :func:`speculative_loop` as a static,
hashable ``round_fn``, so a new method is one new module plugged into the same loop. The host side
(validation, padding, outputs) is :mod:`jetspec_jax.decoding`.
"""

import dataclasses
import functools
from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp

from jetspec_jax import prompt_lookup
from jetspec_jax import tree as tree_lib
from jetspec_jax import verify as verify_lib
from jetspec_jax.kv_cache import KVCache
from jetspec_jax.models import decoder
from jetspec_jax.models import draft_head as draft_head_lib
from jetspec_jax.typing import Array, Int

PREFILL_CHUNK = 2048


def prefill(
  target: decoder.Target,
  prompts,
  prompt_lens,
  capacity: int,
  taps=(),
  with_hidden: bool = False,
  chunk: int = PREFILL_CHUNK,
):
  """Runs the target over right-padded prompts ``int32[B, Pb]`` of true lengths ``prompt_lens``.

  Padding rows are written to slot ``capacity`` (dropped), so each cache row holds exactly its
  prompt (``lengths = prompt_lens``); causal by slot, and padding comes after every real row.
  Prompts longer than ``chunk`` run ``chunk`` tokens at a time (``lax.scan``; each chunk attends
  causally to itself and to the chunks before it), so activations stay linear in ``chunk``.
  It runs in the target's prefill compute mode (``Target.for_prefill``).

  Returns:
    (cache, last_logits ``[B, V]`` float32, taps ``[B, Pb, n_taps*D]`` or None); with
    ``with_hidden`` the taps are followed by the final-normed hidden states on the feature axis.
  """
  b, pb = prompts.shape
  target = target.for_prefill()
  cache = target.make_cache(b, capacity)
  size = chunk if pb > chunk and pb % chunk == 0 else pb
  last_row = (prompt_lens - 1)[:, None, None]

  def run_chunk(cache, start):
    tokens = jax.lax.dynamic_slice_in_dim(prompts, start, size, axis=1)
    positions = jnp.broadcast_to(start + jnp.arange(size, dtype=jnp.int32)[None], (b, size))
    slots = jnp.where(positions < prompt_lens[:, None], positions, capacity)
    mask = decoder.TailMask(jnp.full((b,), start, jnp.int32)) if size < pb else None
    out = target.forward(tokens, cache, positions=positions, slots=slots, mask=mask, taps=taps)
    row = jnp.clip(last_row - start, 0, size - 1)
    last = jnp.take_along_axis(out.hidden, row, axis=1)[:, 0]
    features = with_features(out) if with_hidden else out.taps
    return out.cache, (last, features)

  starts = jnp.arange(0, pb, size, dtype=jnp.int32)
  cache, (lasts, features) = jax.lax.scan(run_chunk, cache, starts)
  owner = (prompt_lens - 1) // size  # the chunk that holds each prompt's last token
  last = jnp.take_along_axis(lasts, owner[None, :, None], axis=0)[0]
  if features is not None:
    features = jnp.moveaxis(features, 0, 1).reshape(b, pb, -1)
  return cache, target.lm_logits(last).astype(jnp.float32), features


def with_features(out: decoder.ForwardOutput):
  """``[taps | hidden]``: what a head reads and what its teacher's logits come from."""
  return jnp.concatenate([out.taps, out.hidden.astype(out.taps.dtype)], axis=-1)


@dataclasses.dataclass(frozen=True)
class Sampling:
  """Static sampling settings (``temperature == 0`` is greedy)."""

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  eos: tuple[int, ...] = ()  # stop ids

  def sample(self, logits, key):
    return verify_lib.sample_tokens(logits, key, self.temperature, self.top_k, self.top_p)

  def is_eos(self, tokens):
    hit = jnp.zeros(tokens.shape, bool)
    for stop in self.eos:
      hit = hit | (tokens == stop)
    return hit


@functools.partial(
  jax.jit, static_argnames=('capacity', 'max_new_tokens', 'sampling', 'feature_taps')
)
def ar_loop(
  target,
  prompts,
  prompt_lens,
  key,
  *,
  capacity,
  max_new_tokens,
  sampling: Sampling,
  feature_taps: tuple[int, ...] = (),
):
  """Batched autoregressive decoding on device.

  Args:
    prompts: ``int32[B, Pb]`` right-padded prompts.
    prompt_lens: ``int32[B]`` true lengths.
    feature_taps: if given, also collect each fed token's features (taps of these layers, then
      the final-normed hidden state), as training data for heads (no extra target pass).

  Returns:
    (tokens ``int32[B, max_new_tokens]``, counts ``int32[B]``, features): sequence ``b``
    generated ``counts[b]`` tokens (EOS included); it stops at EOS while the others go on.
    ``features`` is None, or ``(prompt_features [B, Pb, F], new_features [B, max_new_tokens, F])``
    where ``new_features[:, i]`` belongs to generated token ``i`` (the last one is never fed).
  """
  b = prompts.shape[0]
  collect = bool(feature_taps)
  cache, last_logits, prompt_features = prefill(
    target, prompts, prompt_lens, capacity, taps=feature_taps, with_hidden=collect
  )
  key, sub = jax.random.split(key)
  first = sampling.sample(last_logits, sub)
  out = jnp.zeros((b, max_new_tokens), jnp.int32).at[:, 0].set(first)
  counts = jnp.ones((b,), jnp.int32)
  width = prompt_features.shape[-1] if collect else 0
  feats = jnp.zeros((b, max_new_tokens if collect else 0, width), target.dtype)

  def cond(state):
    i, _, done, *_ = state
    return (i < max_new_tokens) & ~jnp.all(done)

  def body(state):
    i, tok, done, counts, cache, out, feats, key = state
    step = target.forward(tok[:, None], cache, taps=feature_taps)
    if collect:
      feats = feats.at[:, i - 1].set(with_features(step)[:, 0])
    logits = target.lm_logits(step.hidden[:, 0]).astype(jnp.float32)
    key, sub = jax.random.split(key)
    nxt = sampling.sample(logits, sub)
    out = out.at[:, i].set(jnp.where(done, 0, nxt))
    counts = counts + (~done).astype(jnp.int32)
    done = done | sampling.is_eos(nxt)
    return i + 1, nxt, done, counts, step.cache, out, feats, key

  done = sampling.is_eos(first)
  init = (jnp.int32(1), first, done, counts, cache, out, feats, key)
  _, _, _, counts, _, out, feats, _ = jax.lax.while_loop(cond, body, init)
  return out, counts, ((prompt_features, feats) if collect else None)


@flax.struct.dataclass
class RoundState:
  """What a speculative round carries to the next, for ``B`` sequences.

  Attributes:
    cache: the target's KV cache; ``cache.lengths[b]`` = committed tokens ``P`` of row ``b``.
    draft_cache: the head's context cache (features of committed tokens it has read).
    pending: ``[B, D + 1, F]`` features of last round's accepted path, not yet in ``draft_cache``.
    num_pending: ``int32[B]`` valid rows of ``pending``.
    anchor: ``int32[B]`` committed token ``P`` (the last one; the target has not read it yet).
    key: PRNG key.
    guesses: JetSpec++ only: ``int32[B, D]`` the last draft's tokens (its rank-1 trunk) at
      depths ``1..D`` of the last block, anchored ``num_pending`` positions before ``anchor``
      (:mod:`jetspec_jax.methods.jetspecpp`); None for other rounds.
    history: ``int32[B, S]`` committed tokens ``x[0..P]`` (prompt, then every committed token),
      for rounds with copy candidates; None for other rounds.
  """

  cache: KVCache
  draft_cache: KVCache
  pending: Array
  num_pending: Array
  anchor: Array
  key: jax.Array
  guesses: Array | None = None
  history: Array | None = None


@flax.struct.dataclass
class RoundOutput:
  """What one round did (the loop keeps ``committed`` and ``tau``; a trace keeps everything).

  Attributes:
    committed: ``int32[B, D + 1]`` accepted drafts then the target's bonus token; the first
      ``tau`` are valid (``D``: the head's ``max_depth``).
    tau: ``int32[B]`` tokens committed this round (accepted + 1).
    tree: the drafted trees (``[B, M]`` leaves; tree rounds).
    ancestors: ``bool[B, M, M]`` ancestor-or-self masks (tree rounds).
    choices: ``int32[B, M]`` the target's token at every node (what acceptance compared; tree
      rounds).
    path: ``int32[B, D + 1]`` accepted node indices, root first (valid to ``tau``).
    draft_logits: ``[B, D, V]`` the head's per-depth logits (DSpark: those each token was drawn
      from).
    verify_len: ``int32[B]`` drafted tokens sent to verification (DSpark rounds).
    stats: ``{name: int32[B]}`` counters a method reports per round (JetSpec++: how many of its
      slot guesses were fed, checked against committed tokens and correct); the loop sums them.
  """

  committed: Array
  tau: Array
  tree: tree_lib.Tree | None = None
  ancestors: Array | None = None
  choices: Array | None = None
  path: Array | None = None
  draft_logits: Array | None = None
  verify_len: Array | None = None
  stats: dict | None = None


Choose = Callable[[tree_lib.Tree, Array, jax.Array], Array]


# Each (method, shape bucket, sampling) is one compiled program of a loop, and XLA on a CPU maps
# every program's code into memory: a long-lived process that compiles thousands of settings runs
# into the kernel's memory-map limit (vm.max_map_count). :func:`bound_programs` keeps a loop to
# this many live programs: once it holds that many, the next new one clears them all first (the
# settings in use compile again on their next call). Set it higher to trade memory for compiles.
MAX_LIVE_PROGRAMS = 32


def bound_programs(loop, limit: int | None = None) -> None:
  """Clears ``loop``'s compiled programs (a ``jax.jit`` function) when it holds ``limit``
  (default :data:`MAX_LIVE_PROGRAMS`) or more; ``generate`` calls it before every loop."""
  limit = MAX_LIVE_PROGRAMS if limit is None else limit
  if loop._cache_size() >= limit:
    loop.clear_cache()


def start_rounds(
  target: decoder.Target,
  head: draft_head_lib.DraftHead,
  prompts: Int[Array, 'B P'],
  prompt_lens: Int[Array, ' B'],
  key,
  *,
  capacity: int,
  sampling: Sampling,
  keep_history: bool = False,
) -> RoundState:
  """Prefill the target, read the prompt's features into the head, sample the first token.

  ``keep_history``: also keep the committed tokens (:attr:`RoundState.history`, with room for
  ``capacity`` plus one round's commit); always kept for a copy-seeded head, which drafts from
  them (``DraftHeadConfig.copy_seed``)."""
  b, rows = prompts.shape[0], head.cfg.max_depth + 1  # a round commits at most max_depth + 1
  cache, last_logits, features = prefill(
    target, prompts, prompt_lens, capacity, taps=head.cfg.target_layer_ids
  )
  draft_cache = head.extend_context(head.make_cache(b, capacity), features, prompt_lens)
  key, sub = jax.random.split(key)
  anchor = sampling.sample(last_logits, sub)  # [B]
  pending = jnp.zeros((b, rows, features.shape[-1]), features.dtype)
  history = None
  if keep_history or head.cfg.copy_seed:
    history = prompt_lookup.start_history(prompts, prompt_lens, anchor, capacity + rows)
  return RoundState(
    cache, draft_cache, pending, jnp.zeros((b,), jnp.int32), anchor, key, history=history
  )


@functools.partial(jax.jit, static_argnames=('capacity', 'max_new_tokens', 'sampling', 'round_fn'))
def speculative_loop(
  target,
  head,
  prompts,
  prompt_lens,
  key,
  round_data=None,
  *,
  capacity: int,
  max_new_tokens: int,
  sampling: Sampling,
  round_fn: Callable,
):
  """Speculative decoding of ``B`` sequences on device: prefill, then rounds in a while loop.

  Every sequence drafts and verifies its own tree in the same round, accepts its own number of
  tokens, and keeps its own cache length and head context; a sequence that reached EOS or
  ``max_new_tokens`` stops recording (its rows still compute, harmlessly) until all are done.

  Args:
    prompts: ``int32[B, Pb]`` right-padded prompts; ``prompt_lens``: ``int32[B]``.
    round_data: arrays the round reads (e.g. DSpark's steps-per-second table), or None.
    round_fn: ``round_fn(target, head, state, sampling, round_data) -> (state, RoundOutput)``,
      optionally with ``init_state(head, state) -> state``, ``stat_names`` (the counters of
      its ``RoundOutput.stats``) and ``keeps_history`` (it reads :attr:`RoundState.history`),
      static and hashable: a method value (:mod:`jetspec_jax.methods`).

  Returns:
    (tokens ``[B, max_new_tokens + max_depth + 1]``, counts ``[B]``, tau per round
    ``[B, max_new_tokens]``, rounds ``[B]``, stats): tokens past ``counts`` are scratch;
    ``stats`` sums each row's :attr:`RoundOutput.stats` over its rounds (``{}`` if none).
  """
  b, bs = prompts.shape[0], head.cfg.max_depth + 1
  state = start_rounds(
    target,
    head,
    prompts,
    prompt_lens,
    key,
    capacity=capacity,
    sampling=sampling,
    keep_history=getattr(round_fn, 'keeps_history', False),
  )
  if hasattr(round_fn, 'init_state'):  # a round that carries more (JetSpec++: its guesses)
    state = round_fn.init_state(head, state)
  out = jnp.zeros((b, max_new_tokens + bs), jnp.int32).at[:, 0].set(state.anchor)
  taus = jnp.zeros((b, max_new_tokens), jnp.int32)
  rows = jnp.arange(b)

  def active(n, done):
    return (n < max_new_tokens) & ~done

  def cond(carry):
    n, _, done, *_ = carry
    return jnp.any(active(n, done))

  def body(carry):
    n, rounds, done, out, taus, stats, state = carry
    live = active(n, done)
    start = state.cache.lengths
    state, step = round_fn(target, head, state, sampling, round_data)
    if state.history is not None:
      state = state.replace(history=prompt_lookup.record(state.history, start, step.committed))
    stats = {k: v + jnp.where(live, step.stats[k], 0) for k, v in stats.items()}
    committed, tau = step.committed, step.tau
    written = jax.vmap(lambda o, c, i: jax.lax.dynamic_update_slice(o, c, (i,)))(out, committed, n)
    out = jnp.where(live[:, None], written, out)
    hit = jnp.any(sampling.is_eos(committed) & (jnp.arange(bs)[None] < tau[:, None]), axis=1)
    taus = taus.at[rows, rounds].set(jnp.where(live, tau, taus[rows, rounds]), mode='drop')
    live_i = live.astype(jnp.int32)
    return n + live_i * tau, rounds + live_i, done | (live & hit), out, taus, stats, state

  stats = {k: jnp.zeros((b,), jnp.int32) for k in getattr(round_fn, 'stat_names', ())}
  n0 = jnp.ones((b,), jnp.int32)
  init = (n0, jnp.zeros((b,), jnp.int32), sampling.is_eos(state.anchor), out, taus, stats, state)
  n, rounds, _, out, taus, stats, _ = jax.lax.while_loop(cond, body, init)
  return out, n, taus, rounds, stats
