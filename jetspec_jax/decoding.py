"""Generation, host side: ``js.generate``, prompt preparation, shapes and outputs.

Validates and pads the prompts, then runs one jitted device loop per call
(:mod:`jetspec_jax.rounds`: prefill, then ``lax.while_loop`` over AR steps or speculative rounds,
no host sync until the end, docs/design.md §2) and turns its buffers into :class:`GenerateOutput`.
Prompts are right-padded to a power-of-two bucket and the cache capacity is bucketed too, so
prompts of similar lengths share one compilation.
"""

import dataclasses
import math
import time
from collections.abc import Iterable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import methods as methods_lib
from jetspec_jax import rounds as rounds_lib
from jetspec_jax import tree as tree_lib
from jetspec_jax.methods import tree as tree_method
from jetspec_jax.models import decoder
from jetspec_jax.models import draft_head as draft_head_lib
from jetspec_jax.rounds import Sampling

# generate's default method (a JetSpec tree of 64 nodes, 7 candidates per depth).


@dataclasses.dataclass(frozen=True)
class GenerationStats:
  """Statistics of one ``generate`` call (docs/design.md §6).

  Attributes:
    tau: ``int32[rounds]`` tokens committed per target forward after prefill (bonus included;
      all ones for AR).
    rounds: target forwards after prefill (decode steps or verify rounds).
    new_tokens: tokens returned (the prefill's first token included).
    wall_s: wall time of the call, device work included.
    round_stats: the method's counters summed over this sequence's rounds (JetSpec++: slot
      guesses fed, checked and correct: :mod:`jetspec_jax.methods.jetspecpp`).
  """

  tau: np.ndarray
  rounds: int
  new_tokens: int
  wall_s: float
  round_stats: dict = dataclasses.field(default_factory=dict)

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


def stop_ids(eos_id, default: int | None, vocab_size: int | None = None) -> tuple[int, ...]:
  """``eos_id`` (None, one id or a collection of ids) as a sorted tuple of stop ids; with
  ``vocab_size``, an id outside the vocabulary (it could never stop anything) is an error."""
  if eos_id is None:
    eos_id = default
  if eos_id is None:
    return ()
  if isinstance(eos_id, int | np.integer):
    eos_id = (eos_id,)
  ids = tuple(sorted({int(i) for i in eos_id}))
  if vocab_size is not None and any(not 0 <= i < vocab_size for i in ids):
    raise ValueError(f'stop ids {ids} must be in [0, vocab_size={vocab_size})')
  return ids


def check_sampling(temperature: float, top_p: float, top_k: int, vocab_size: int) -> None:
  """Sampling settings that mean something: finite ``temperature >= 0``, ``top_p`` in (0, 1],
  ``top_k`` in ``[0, vocab_size]``."""
  if not math.isfinite(temperature) or temperature < 0:
    raise ValueError(f'{temperature=} must be finite and >= 0')
  if not 0.0 < top_p <= 1.0:  # also rejects nan
    raise ValueError(f'{top_p=} must be in (0, 1]')
  if top_k < 0 or top_k > vocab_size:
    raise ValueError(f'{top_k=} must be in [0, vocab_size={vocab_size}]')


def _prepare_prompts(
  target: decoder.Target,
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
    decoder.check_token_ids(ids, target.cfg.vocab_size)
    arrays.append(ids)
  longest = max(ids.size for ids in arrays)
  needed = longest + max_new_tokens + extra
  if needed > target.cfg.max_position_embeddings:
    raise ValueError(
      f'prompt ({longest}) + max_new_tokens ({max_new_tokens}) + round overhang ({extra}) = '
      f'{needed} exceeds the model context {target.cfg.max_position_embeddings}'
    )
  # A shared-shape request that does not fit would silently compile another shape.
  if min_prompt_bucket and min_prompt_bucket < longest:
    raise ValueError(f'{min_prompt_bucket=} is shorter than the longest prompt ({longest})')
  if min_capacity and min_capacity < needed:
    raise ValueError(
      f'{min_capacity=} is below what this call needs: prompt ({longest}) + max_new_tokens '
      f'({max_new_tokens}) + round overhang ({extra}) = {needed}'
    )
  if min_prompt_bucket < 0 or min_capacity < 0:
    raise ValueError(f'{min_prompt_bucket=} and {min_capacity=} must be >= 0')
  padded = np.zeros((len(arrays), max(bucket(longest), min_prompt_bucket)), np.int32)
  for i, ids in enumerate(arrays):
    padded[i, : ids.size] = ids
  lengths = jnp.asarray([ids.size for ids in arrays], jnp.int32)
  return jnp.asarray(padded), lengths, max(bucket(needed), min_capacity)


def _prepare_prompt(
  target: decoder.Target,
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


def _collect(out, counts, wall, max_new_tokens, eos, taus=None, rounds=None, stats=None):
  """Per-sequence outputs from the device loop's buffers (AR when ``taus`` is None)."""
  results = []
  for i in range(out.shape[0]):
    tokens = _truncate(out[i], int(counts[i]), max_new_tokens, eos)
    if taus is None:  # one target forward per token after the first
      tau, num_rounds = np.ones((len(tokens) - 1,), np.int32), len(tokens) - 1
    else:
      tau, num_rounds = np.asarray(taus[i, : int(rounds[i])]), int(rounds[i])
    counters = {k: int(v[i]) for k, v in (stats or {}).items()}
    summary = GenerationStats(
      tau=tau, rounds=num_rounds, new_tokens=len(tokens), wall_s=wall, round_stats=counters
    )
    results.append(GenerateOutput(tokens=tokens, stats=summary))
  return results


def _run_ar(target, prompt_list, key, sampling, max_new_tokens, feature_taps=(), **shape_kwargs):
  """The host side of batched AR: pad, run :func:`jetspec_jax.rounds.ar_loop`, fetch.

  Returns:
    (tokens, counts, prompt lengths, features or None, wall seconds), all on the host.
  """
  prompts, lengths, capacity = _prepare_prompts(
    target, prompt_list, max_new_tokens, 0, **shape_kwargs
  )
  rounds_lib.bound_programs(rounds_lib.ar_loop)
  start = time.perf_counter()
  result = rounds_lib.ar_loop(
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
  target: decoder.Target,
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
  check_sampling(temperature, top_p, 0, target.cfg.vocab_size)
  eos = stop_ids(eos_id, target.cfg.eos_token_id, target.cfg.vocab_size)
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
  target: decoder.Target,
  head: draft_head_lib.DraftHead | None = None,
  prompt_ids=None,
  *,
  method: methods_lib.Method | None = None,
  max_new_tokens: int = 256,
  temperature: float = 0.0,
  top_p: float = 1.0,
  top_k: int = 0,
  seed: int = 0,
  eos_id: int | Iterable[int] | None = None,
  min_prompt_bucket: int = 0,
  min_capacity: int = 0,
) -> GenerateOutput | list[GenerateOutput]:
  """Generates up to ``max_new_tokens`` tokens after ``prompt_ids``, on device.

  Args:
    target: the target model.
    head: the draft head (None for :class:`~jetspec_jax.methods.AR`); it must fit the target and
      be of a kind the method runs.
    prompt_ids: 1-D token ids, or a list of them (a batch of prompts of any lengths: each
      sequence drafts, verifies and stops on its own; the result is then a list).
    method: a method value (:mod:`jetspec_jax.methods`): ``AR()`` (autoregressive), ``Chain()``
      (the head's top-1 block verified as a chain, the DFlash baseline), ``Tree(budget, width,
      algorithm)`` (JetSpec), ``DSpark(verify_length, threshold)`` (a DSpark head's sequential
      chain, verified up to a confidence-chosen length) or ``JetSpecPP(budget, width, recycle,
      refine_passes)`` (a JetSpec++ head's tree, its block seeded with the previous round's draft
      and refined). None: ``Tree()``, the measured best builder and budget for the platform
      (:func:`jetspec_jax.methods.tree.default_budget`). Trees and chains take copy candidates
      (``copy_len``). Each method's settings are documented on its class;
      ``methods.from_config`` builds one from a config.
    max_new_tokens: most tokens to return (EOS included).
    temperature: 0 for greedy; otherwise sample-and-match acceptance (exact).
    top_p: nucleus filtering of the target's distribution when sampling.
    top_k: top-k filtering of the target's distribution when sampling (0: off).
    seed: PRNG seed.
    eos_id: stop token id or a collection of them (e.g. a tokenizer's ``eos_ids``); defaults
      to the target config's ``eos_token_id``.
    min_prompt_bucket: pad the prompt to at least this many positions (shared compilations).
    min_capacity: cache capacity of at least this many slots (shared compilations).

  Returns:
    A :class:`GenerateOutput`: the generated tokens (no prompt) and :class:`GenerationStats`
    (with the method's per-round counters, e.g. copy candidates' ``copy_nodes`` and
    ``copy_accepted``, in ``stats.round_stats``).
  """
  method = methods_lib.Tree() if method is None else method  # the measured best, per platform
  if not isinstance(method, methods_lib.Method):
    raise TypeError(
      f'method must be a method value such as js.methods.Tree(budget=16), got {method!r} '
      '(js.methods.from_config turns a name or a config into one)'
    )
  check_sampling(temperature, top_p, top_k, target.cfg.vocab_size)
  eos = stop_ids(eos_id, target.cfg.eos_token_id, target.cfg.vocab_size)
  sampling = Sampling(float(temperature), int(top_k), float(top_p), eos)
  key = jax.random.key(seed)
  batch = _is_batch(prompt_ids)
  prompt_list = list(prompt_ids) if batch else [prompt_ids]
  if isinstance(method, methods_lib.AR):
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

  method.check_head(head)
  draft_head_lib.check_fits_target(head.cfg, target.cfg)
  round_fn, overhang = method.make_round(target, head)
  prompts, lengths, capacity = _prepare_prompts(
    target,
    prompt_list,
    max_new_tokens,
    overhang + head.cfg.block_size,
    min_prompt_bucket,
    min_capacity,
  )
  round_data = method.round_data(target, head, len(prompt_list), capacity)
  rounds_lib.bound_programs(rounds_lib.speculative_loop)
  start = time.perf_counter()
  out, n, taus, rounds, stats = rounds_lib.speculative_loop(
    target,
    head,
    prompts,
    lengths,
    key,
    round_data,
    capacity=capacity,
    max_new_tokens=max_new_tokens,
    sampling=sampling,
    round_fn=round_fn,
  )
  out, n, taus, rounds, stats = jax.device_get((out, n, taus, rounds, stats))
  wall = time.perf_counter() - start
  results = _collect(out, n, wall, max_new_tokens, eos, taus, rounds, stats)
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
  target: decoder.Target,
  head: draft_head_lib.DraftHead,
  prompt_ids,
  *,
  method: methods_lib.Tree | methods_lib.Chain | None = None,
) -> RoundTrace:
  """Prefill and the first greedy :func:`~jetspec_jax.methods.tree.speculative_round` of a tree
  ``method``, with every intermediate: the same round ``generate`` runs, so it commits what
  ``generate`` commits first.
  """
  method = methods_lib.Tree(budget=32, width=4) if method is None else method
  if not isinstance(method, (methods_lib.Tree, methods_lib.Chain)):
    raise ValueError(f'trace_first_round traces a Tree or Chain method, got {method!r}')
  if method.copy_len:
    raise ValueError("trace_first_round traces the head's own tree (copy_len=0)")
  method.check_head(head)
  draft_head_lib.check_fits_target(head.cfg, target.cfg)
  method, _ = method.make_round(target, head)  # a Chain becomes its tree of width 1
  prompt, prompt_len, capacity = _prepare_prompt(
    target, prompt_ids, 1, method.budget + head.cfg.block_size
  )
  sampling = Sampling()
  state = rounds_lib.start_rounds(
    target,
    head,
    prompt,
    prompt_len,
    jax.random.key(0),
    capacity=capacity,
    sampling=sampling,
    keep_history=method.keeps_history,
  )
  _, out = tree_method.speculative_round(target, head, state, sampling, method)
  tau = int(out.tau[0])
  return RoundTrace(
    jax.tree.map(lambda x: x[0], out.tree),
    out.ancestors[0],
    out.choices[0],
    np.asarray(out.path[0, :tau]),
    int(out.committed[0, tau - 1]),
    jax.nn.log_softmax(out.draft_logits[0].astype(jnp.float32), -1),
  )
