"""Generation: ``js.generate`` and its per-method device loops.

Every method runs its whole decode in one jitted function: prefill, then ``lax.while_loop`` over
steps (AR) or speculative rounds, with no host sync until the end (DESIGN.md §2, "the decode
loop"). Prompts are right-padded to a power-of-two bucket and the cache capacity is bucketed too, so
prompts of similar lengths share one compilation.
"""

import dataclasses
import functools
import time
from collections.abc import Iterable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import tree as tree_lib
from jetspec_jax import verify as verify_lib
from jetspec_jax.models import draft_head as draft_head_lib
from jetspec_jax.models import qwen3

METHODS = ('ar', 'chain', 'tree')


@dataclasses.dataclass(frozen=True)
class GenerationStats:
  """Statistics of one ``generate`` call (DESIGN.md §6).

  Attributes:
    tau: ``int32[rounds]`` tokens committed per target forward after prefill (bonus included;
      all ones for AR).
    rounds: target forwards after prefill (decode steps or verify rounds).
    new_tokens: tokens returned (the prefill's first token included).
    wall_s: wall time of the call, device work included.
  """

  tau: np.ndarray
  rounds: int
  new_tokens: int
  wall_s: float

  @property
  def mean_tau(self) -> float:
    return float(np.mean(self.tau)) if self.rounds else float('nan')

  @property
  def tps(self) -> float:
    """Generated tokens per wall second (batch 1)."""
    return self.new_tokens / self.wall_s if self.wall_s > 0 else float('nan')


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  tokens: np.ndarray  # int32[n]: generated tokens only, n <= max_new_tokens, EOS last if produced
  stats: GenerationStats


def bucket(n: int, minimum: int = 16) -> int:
  """The smallest power of two >= max(n, minimum)."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


PREFILL_CHUNK = 2048


def prefill(
  target: qwen3.Target,
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

  Returns:
    (cache, last_logits ``[B, V]`` float32, taps ``[B, Pb, n_taps*D]`` or None); with
    ``with_hidden`` the taps are followed by the final-normed hidden states on the feature axis.
  """
  b, pb = prompts.shape
  cache = target.make_cache(b, capacity)
  size = chunk if pb > chunk and pb % chunk == 0 else pb
  last_row = (prompt_lens - 1)[:, None, None]

  def run_chunk(cache, start):
    tokens = jax.lax.dynamic_slice_in_dim(prompts, start, size, axis=1)
    positions = jnp.broadcast_to(start + jnp.arange(size, dtype=jnp.int32)[None], (b, size))
    slots = jnp.where(positions < prompt_lens[:, None], positions, capacity)
    mask = qwen3.TailMask(jnp.full((b,), start, jnp.int32)) if size < pb else None
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


def with_features(out: qwen3.ForwardOutput):
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


def stop_ids(eos_id, default: int | None) -> tuple[int, ...]:
  """``eos_id`` (None, one id or a collection of ids) as a sorted tuple of stop ids."""
  if eos_id is None:
    eos_id = default
  if eos_id is None:
    return ()
  if isinstance(eos_id, int | np.integer):
    return (int(eos_id),)
  return tuple(sorted({int(i) for i in eos_id}))


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


@dataclasses.dataclass(frozen=True)
class TreeSettings:
  """Static tree shape: ``budget`` nodes (root included), ``width`` candidates per depth."""

  budget: int
  width: int
  algorithm: str = 'accum_logp'


def forced_choices(tree: tree_lib.Tree, accept_length: int):
  """Target "choices" that make acceptance follow each node's first child for ``accept_length``
  steps (benchmarks: realistic work per round, independent of the weights)."""
  b, m = tree.tokens.shape
  idx = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (b, m))
  parents = jnp.where(tree.parents >= 0, tree.parents, m)  # the root and padding: no parent
  first_child = jnp.full((b, m + 1), m, jnp.int32).at[jnp.arange(b)[:, None], parents].min(idx)
  first_child = first_child[:, :m]
  child_token = jnp.take_along_axis(tree.tokens, jnp.minimum(first_child, m - 1), axis=1)
  keep = (first_child < m) & (tree.depths < accept_length)
  return jnp.where(keep, child_token, -1)


def speculative_round(
  target,
  head,
  state,
  sampling: Sampling,
  tree_settings: TreeSettings,
  forced_accept_length: int | None = None,
):
  """One JetSpec round: draft -> tree -> verify -> accept -> commit (DESIGN.md §5).

  ``state`` holds the target cache (committed length ``P``), the head's context cache, the
  features of last round's accepted path not yet in the head's cache (``pending``), the anchor
  (committed token ``P``) and a PRNG key. Returns the new state and the committed tokens
  (``[block_size]``, the first ``acc + 1`` valid: accepted drafts then the bonus).
  ``forced_accept_length`` (benchmarks only) replaces the target's choices so that exactly that
  many draft nodes are accepted whenever the tree is deep enough.
  """
  cache, dcache, pending, num_pending, anchor, key = state
  max_depth = head.cfg.max_depth
  dcache = head.extend_context(dcache, pending, num_pending)
  draft_logits = head.propose_cached(dcache, anchor)  # [B, D, V]
  ids, logprobs = tree_lib.topk_per_depth(draft_logits, tree_settings.width)
  builder = functools.partial(
    tree_lib.TREE_BUILDERS[tree_settings.algorithm], budget=tree_settings.budget
  )
  tree = jax.vmap(lambda i, lp, a: builder(i, lp, anchor=a))(ids, logprobs, anchor)
  anc = jax.vmap(lambda p: tree_lib.ancestor_mask(p, max_depth))(tree.parents)
  verified = verify_lib.verify_tree(target, cache, tree, anc, head.cfg.target_layer_ids)
  key, sub = jax.random.split(key)
  choices = sampling.sample(verified.logits, sub)  # [B, M]
  if forced_accept_length is not None:
    choices = forced_choices(tree, forced_accept_length)
  accepted = verify_lib.accept(tree, anc, choices, max_depth)
  if forced_accept_length is not None:  # -1 marks "no match"; the bonus must stay a token
    accepted = accepted._replace(bonus=jnp.maximum(accepted.bonus, 0))
  cache = verify_lib.commit(verified.cache, cache.lengths, accepted)
  pending = verify_lib.gather_path(verified.features, accepted.path)
  path_tokens = jnp.take_along_axis(tree.tokens, accepted.path, axis=1)  # [B, D+1], root first
  committed = jnp.concatenate([path_tokens[:, 1:], jnp.zeros_like(anchor)[:, None]], axis=1)
  committed = committed.at[jnp.arange(anchor.shape[0]), accepted.num_accepted].set(accepted.bonus)
  new_state = (cache, dcache, pending, accepted.num_accepted + 1, accepted.bonus, key)
  return new_state, committed, accepted.num_accepted + 1


@functools.partial(
  jax.jit, static_argnames=('capacity', 'max_new_tokens', 'sampling', 'tree_settings')
)
def speculative_loop(
  target,
  head,
  prompts,
  prompt_lens,
  key,
  *,
  capacity: int,
  max_new_tokens: int,
  sampling: Sampling,
  tree_settings: TreeSettings,
):
  """Speculative decoding of ``B`` sequences on device: prefill, then rounds in a while loop.

  Every sequence drafts and verifies its own tree in the same round, accepts its own number of
  tokens, and keeps its own cache length and head context; a sequence that reached EOS or
  ``max_new_tokens`` stops recording (its rows still compute, harmlessly) until all are done.

  Args:
    prompts: ``int32[B, Pb]`` right-padded prompts; ``prompt_lens``: ``int32[B]``.

  Returns:
    (tokens ``[B, max_new_tokens + block_size]``, counts ``[B]``, tau per round
    ``[B, max_new_tokens]``, rounds ``[B]``). Tokens past ``counts`` are scratch.
  """
  b, bs = prompts.shape[0], head.cfg.block_size
  cache, last_logits, features = prefill(
    target, prompts, prompt_lens, capacity, taps=head.cfg.target_layer_ids
  )
  dcache = head.extend_context(head.make_cache(b, capacity), features, prompt_lens)
  key, sub = jax.random.split(key)
  anchor = sampling.sample(last_logits, sub)  # [B]
  out = jnp.zeros((b, max_new_tokens + bs), jnp.int32).at[:, 0].set(anchor)
  taus = jnp.zeros((b, max_new_tokens), jnp.int32)
  pending = jnp.zeros((b, bs, features.shape[-1]), features.dtype)
  state = (cache, dcache, pending, jnp.zeros((b,), jnp.int32), anchor, key)
  rows = jnp.arange(b)

  def active(n, done):
    return (n < max_new_tokens) & ~done

  def cond(carry):
    n, _, done, *_ = carry
    return jnp.any(active(n, done))

  def body(carry):
    n, rounds, done, out, taus, state = carry
    live = active(n, done)
    state, committed, tau = speculative_round(target, head, state, sampling, tree_settings)
    written = jax.vmap(lambda o, c, i: jax.lax.dynamic_update_slice(o, c, (i,)))(out, committed, n)
    out = jnp.where(live[:, None], written, out)
    hit = jnp.any(sampling.is_eos(committed) & (jnp.arange(bs)[None] < tau[:, None]), axis=1)
    taus = taus.at[rows, rounds].set(jnp.where(live, tau, taus[rows, rounds]), mode='drop')
    live_i = live.astype(jnp.int32)
    return n + live_i * tau, rounds + live_i, done | (live & hit), out, taus, state

  n0 = jnp.ones((b,), jnp.int32)
  init = (n0, jnp.zeros((b,), jnp.int32), sampling.is_eos(anchor), out, taus, state)
  n, rounds, _, out, taus, _ = jax.lax.while_loop(cond, body, init)
  return out, n, taus, rounds


def _prepare_prompts(
  target: qwen3.Target,
  prompts,
  max_new_tokens: int,
  extra: int = 0,
  min_prompt_bucket: int = 0,
  min_capacity: int = 0,
):
  """Validates and right-pads prompts to one power-of-two bucket.

  ``min_prompt_bucket`` / ``min_capacity`` let a caller share one compilation across prompts of
  different lengths (a benchmark pads every prompt to the same shapes).

  Returns:
    (prompts ``int32[B, Pb]``, lengths ``int32[B]``, cache capacity).
  """
  if max_new_tokens < 1:
    raise ValueError(f'{max_new_tokens=} must be >= 1')
  arrays = []
  for ids in prompts:
    ids = np.asarray(ids)
    if ids.ndim != 1:
      raise ValueError(f'prompt_ids must be a 1-D sequence of token ids, got shape {ids.shape}')
    if ids.size == 0:
      raise ValueError('prompt_ids is empty')
    if not np.issubdtype(ids.dtype, np.integer):
      raise TypeError(f'prompt_ids must be integers, got dtype {ids.dtype}')
    qwen3.check_token_ids(ids, target.cfg.vocab_size)
    arrays.append(ids)
  longest = max(ids.size for ids in arrays)
  needed = longest + max_new_tokens + extra
  if needed > target.cfg.max_position_embeddings:
    raise ValueError(
      f'prompt ({longest}) + max_new_tokens ({max_new_tokens}) + round overhang ({extra}) = '
      f'{needed} exceeds the model context {target.cfg.max_position_embeddings}'
    )
  padded = np.zeros((len(arrays), max(bucket(longest), min_prompt_bucket)), np.int32)
  for i, ids in enumerate(arrays):
    padded[i, : ids.size] = ids
  lengths = jnp.asarray([ids.size for ids in arrays], jnp.int32)
  return jnp.asarray(padded), lengths, max(bucket(needed), min_capacity)


def _prepare_prompt(
  target: qwen3.Target,
  prompt_ids,
  max_new_tokens: int,
  extra: int = 0,
  min_prompt_bucket: int = 0,
  min_capacity: int = 0,
):
  """One prompt: (``int32[1, Pb]``, ``int32[1]``, capacity)."""
  return _prepare_prompts(
    target, [prompt_ids], max_new_tokens, extra, min_prompt_bucket, min_capacity
  )


def shared_shapes(prompts, max_new_tokens: int, overhang: int = 0) -> dict:
  """``generate`` keyword arguments that give every prompt in ``prompts`` the same shapes.

  Benchmarks use them so each setting compiles once (in a warm-up) and timings exclude it;
  ``overhang`` is the largest ``budget + block_size`` the prompts will be decoded with.
  """
  longest = max(len(p) for p in prompts)
  return dict(
    min_prompt_bucket=bucket(longest), min_capacity=bucket(longest + max_new_tokens + overhang)
  )


def _is_batch(prompt_ids) -> bool:
  """A list/tuple of sequences (not a flat sequence of ids) is a batch of prompts."""
  return (
    isinstance(prompt_ids, list | tuple) and len(prompt_ids) > 0 and np.ndim(prompt_ids[0]) == 1
  )


def _truncate(tokens: np.ndarray, n: int, max_new_tokens: int, eos: tuple[int, ...]) -> np.ndarray:
  tokens = np.asarray(tokens[: min(n, max_new_tokens)])
  if eos:
    hits = np.flatnonzero(np.isin(tokens, eos))
    if hits.size:
      tokens = tokens[: hits[0] + 1]
  return tokens


def _collect(out, counts, wall, max_new_tokens, eos, taus=None, rounds=None):
  """Per-sequence outputs from the device loop's buffers (AR when ``taus`` is None)."""
  results = []
  for i in range(out.shape[0]):
    tokens = _truncate(out[i], int(counts[i]), max_new_tokens, eos)
    if taus is None:  # one target forward per token after the first
      tau, num_rounds = np.ones((len(tokens) - 1,), np.int32), len(tokens) - 1
    else:
      tau, num_rounds = np.asarray(taus[i, : int(rounds[i])]), int(rounds[i])
    stats = GenerationStats(tau=tau, rounds=num_rounds, new_tokens=len(tokens), wall_s=wall)
    results.append(GenerateOutput(tokens=tokens, stats=stats))
  return results


def _run_ar(target, prompt_list, key, sampling, max_new_tokens, feature_taps=(), **shape_kwargs):
  """The host side of batched AR: pad, run :func:`ar_loop`, fetch.

  Returns:
    (tokens, counts, prompt lengths, features or None, wall seconds), all on the host.
  """
  prompts, lengths, capacity = _prepare_prompts(
    target, prompt_list, max_new_tokens, 0, **shape_kwargs
  )
  start = time.perf_counter()
  result = ar_loop(
    target,
    prompts,
    lengths,
    key,
    capacity=capacity,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    feature_taps=tuple(feature_taps),
  )
  out, n, features = jax.device_get(result)
  return out, n, np.asarray(lengths), features, time.perf_counter() - start


def generate_with_features(
  target: qwen3.Target,
  prompt_list,
  *,
  feature_taps: tuple[int, ...] = (),
  max_new_tokens: int,
  temperature: float = 0.0,
  top_p: float = 1.0,
  seed: int = 0,
  eos_id=None,
) -> list[tuple[np.ndarray, np.ndarray | None]]:
  """Batched AR generation that also returns every sequence's features (training data).

  Returns:
    Per prompt ``(response_tokens, features)``: ``features [P + n, F]`` for the ``P`` prompt and
    ``n`` response tokens, ``F = len(feature_taps) * D + D`` (taps, then the final-normed hidden
    state); the last response token's row is zeros (the target never reads it). Without
    ``feature_taps`` the features are None (plain generation, the same tokens).
  """
  eos = stop_ids(eos_id, target.cfg.eos_token_id)
  sampling = Sampling(float(temperature), 0, float(top_p), eos)
  key = jax.random.key(seed)
  out, n, lengths, features, _ = _run_ar(
    target, prompt_list, key, sampling, max_new_tokens, feature_taps
  )
  results = []
  for i, p_len in enumerate(lengths):
    tokens = _truncate(out[i], int(n[i]), max_new_tokens, eos)
    feats = None
    if features is not None:
      prompt_feats, new_feats = features
      feats = np.concatenate([prompt_feats[i, :p_len], new_feats[i, : len(tokens)]])
      feats[-1] = 0  # the last token is never fed to the target
    results.append((tokens, feats))
  return results


def generate(
  target: qwen3.Target,
  head: draft_head_lib.DraftHead | None = None,
  prompt_ids=None,
  *,
  max_new_tokens: int = 256,
  method: str = 'tree',
  budget: int = 64,
  width: int = 7,
  temperature: float = 0.0,
  top_p: float = 1.0,
  top_k: int = 0,
  seed: int = 0,
  eos_id: int | Iterable[int] | None = None,
  tree_algorithm: str = 'accum_logp',
  min_prompt_bucket: int = 0,
  min_capacity: int = 0,
) -> GenerateOutput | list[GenerateOutput]:
  """Generates up to ``max_new_tokens`` tokens after ``prompt_ids``, on device.

  Args:
    target: the target model.
    head: the draft head (may be None for ``method='ar'``); it must fit the target.
    prompt_ids: 1-D token ids, or a list of them (a batch of prompts of any lengths: each
      sequence drafts, verifies and stops on its own; the result is then a list).
    max_new_tokens: most tokens to return (EOS included).
    method: ``'ar'`` (autoregressive), ``'chain'`` (the head's top-1 block verified as a chain,
      the DFlash baseline) or ``'tree'`` (JetSpec).
    budget: tree nodes per round, root included (``'tree'``).
    width: candidates per depth (``'tree'``).
    temperature: 0 for greedy; otherwise sample-and-match acceptance (exact).
    top_p: nucleus filtering of the target's distribution when sampling.
    top_k: top-k filtering of the target's distribution when sampling (0: off).
    seed: PRNG seed.
    eos_id: stop token id or a collection of them (e.g. a tokenizer's ``eos_ids``); defaults
      to the target config's ``eos_token_id``.
    tree_algorithm: ``'accum_logp'`` or ``'top2gap'``.
    min_prompt_bucket: pad the prompt to at least this many positions (shared compilations).
    min_capacity: cache capacity of at least this many slots (shared compilations).

  Returns:
    A :class:`GenerateOutput`: the generated tokens (no prompt) and :class:`GenerationStats`.
  """
  if method not in METHODS:
    raise ValueError(f'method must be one of {METHODS}, got {method!r}')
  if temperature < 0:
    raise ValueError(f'{temperature=} must be >= 0')
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f'{top_p=} must be in (0, 1]')
  if top_k < 0 or top_k > target.cfg.vocab_size:
    raise ValueError(f'{top_k=} must be in [0, vocab_size={target.cfg.vocab_size}]')
  eos = stop_ids(eos_id, target.cfg.eos_token_id)
  sampling = Sampling(float(temperature), int(top_k), float(top_p), eos)
  key = jax.random.key(seed)
  batch = _is_batch(prompt_ids)
  prompt_list = list(prompt_ids) if batch else [prompt_ids]
  if method == 'ar':
    out, n, _, _, wall = _run_ar(
      target,
      prompt_list,
      key,
      sampling,
      max_new_tokens,
      min_prompt_bucket=min_prompt_bucket,
      min_capacity=min_capacity,
    )
    results = _collect(out, n, wall, max_new_tokens, eos)
    return results if batch else results[0]

  if head is None:
    raise ValueError(f'method={method!r} needs a draft head')
  draft_head_lib.check_fits_target(head.cfg, target.cfg)
  head = head.replace(target=target)  # the head drafts with this target's embedding and head
  bs = head.cfg.block_size
  if method == 'chain':
    tree_settings = TreeSettings(budget=bs, width=1)
  else:
    if budget < 1:
      raise ValueError(f'{budget=} must be >= 1 (it counts the root)')
    if not 1 <= width <= target.cfg.vocab_size:
      raise ValueError(f'{width=} must be in [1, vocab_size={target.cfg.vocab_size}]')
    if tree_algorithm not in tree_lib.TREE_BUILDERS:
      raise ValueError(
        f'tree_algorithm must be one of {sorted(tree_lib.TREE_BUILDERS)}, got {tree_algorithm!r}'
      )
    tree_settings = TreeSettings(budget=int(budget), width=int(width), algorithm=tree_algorithm)
  prompts, lengths, capacity = _prepare_prompts(
    target,
    prompt_list,
    max_new_tokens,
    tree_settings.budget + bs,
    min_prompt_bucket,
    min_capacity,
  )
  start = time.perf_counter()
  out, n, taus, rounds = speculative_loop(
    target,
    head,
    prompts,
    lengths,
    key,
    capacity=capacity,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    tree_settings=tree_settings,
  )
  out, n, taus, rounds = jax.device_get((out, n, taus, rounds))
  results = _collect(out, n, time.perf_counter() - start, max_new_tokens, eos, taus, rounds)
  return results if batch else results[0]


class RoundTrace(NamedTuple):
  """One speculative round, kept whole for inspection (notebooks, debugging)."""

  tree: tree_lib.Tree  # the drafted tree (no batch axis)
  ancestors: jax.Array  # [M, M] ancestor-or-self mask
  target_choices: jax.Array  # [M] the target's greedy token at every node
  path: np.ndarray  # accepted node indices, root first
  bonus: int  # the target's token after the accepted path
  draft_logprobs: jax.Array  # [D, V] the head's per-depth log-probabilities


def trace_first_round(
  target: qwen3.Target,
  head: draft_head_lib.DraftHead,
  prompt_ids,
  *,
  budget: int = 32,
  width: int = 4,
  tree_algorithm: str = 'accum_logp',
) -> RoundTrace:
  """Runs prefill and the first greedy round step by step, returning every intermediate.

  The same functions as :func:`speculative_round`, unjitted and unbatched where that reads
  better; the committed tokens equal what ``generate`` commits in its first round.
  """
  draft_head_lib.check_fits_target(head.cfg, target.cfg)
  head = head.replace(target=target)
  prompt, prompt_len, capacity = _prepare_prompt(
    target, prompt_ids, 1, budget + head.cfg.block_size
  )
  cache, last_logits, features = prefill(
    target, prompt, prompt_len, capacity, taps=head.cfg.target_layer_ids
  )
  anchor = jnp.argmax(last_logits, -1).astype(jnp.int32)  # [1]
  dcache = head.extend_context(head.make_cache(1, capacity), features, prompt_len)
  draft_logits = head.propose_cached(dcache, anchor)[0]
  ids, logprobs = tree_lib.topk_per_depth(draft_logits, width)
  tree = tree_lib.TREE_BUILDERS[tree_algorithm](ids, logprobs, budget, anchor=anchor[0])
  anc = tree.ancestor_mask(head.cfg.max_depth)
  batched = jax.tree.map(lambda x: x[None], tree)
  verified = verify_lib.verify_tree(target, cache, batched, anc[None])
  choices = jnp.argmax(verified.logits, -1).astype(jnp.int32)
  accepted = verify_lib.accept(batched, anc[None], choices, head.cfg.max_depth)
  n = int(accepted.num_accepted[0])
  return RoundTrace(
    tree,
    anc,
    choices[0],
    np.asarray(accepted.path[0, : n + 1]),
    int(accepted.bonus[0]),
    jax.nn.log_softmax(draft_logits, -1),
  )
