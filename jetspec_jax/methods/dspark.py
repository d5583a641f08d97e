"""DSpark (arXiv 2607.05147): a parallel block, a sequential Markov stage, calibrated confidence,
a verify length per sequence, and chain verification with standard lossless acceptance.

One round, for ``B`` sequences (block ``bs = gamma``; the backbone's anchor slot predicts too, so a
block drafts ``gamma`` tokens):

1. **Parallel stage**: the bidirectional backbone reads the context and ``[anchor, MASK, ...]``
   once: hidden states ``h_1..h_gamma`` and base logits ``U_k = lm_head(h_k)``.
2. **Sequential stage** (:func:`draft_chain`, a ``lax.scan`` over depth):
   ``p_k(v) ∝ exp(U_k(v) + W1[x_{k-1}] W2(v))`` with ``x_0`` the anchor and ``x_{k-1}`` the token
   actually drafted at ``k-1``; ``x_k`` is its argmax (greedy) or a sample at the round's
   temperature, and ``q_k`` is exactly the distribution it was drawn from.
   Confidence ``c_k = sigmoid(w . [h_k; W1[x_{k-1}]] / t_k)``: the estimated probability that
   ``x_k`` is accepted given ``x_{<k}`` were (``t_k``: the calibration temperatures).
3. **Verify length** ``l_b`` in ``0..gamma``: a static threshold on the survival
   ``a_k = prod_{i<=k} c_i`` (:func:`threshold_lengths`), or the hardware-aware prefix scheduler
   over the batch (:func:`schedule_lengths`): admit ``(b, k)`` by descending ``a``, maximise
   ``tau * SPS(width)`` with ``SPS`` a steps-per-second table profiled on the running device
   (:func:`profile_sps`), and stop at the first non-improvement. The stop makes the decision to
   verify ``x_k`` depend only on ``a_1..a_k``, i.e. on tokens before ``x_k`` (non-anticipating);
   without it the choice of verifying ``x_1`` could depend on ``x_1`` itself (via ``c_2``), which
   biases the output (the paper's Appendix A; a test).
4. **Verify** the chain ``[anchor, x_1..x_l]`` in one target forward. Shapes are static, so the
   forward runs at the smallest compiled width ``>= max_b l_b + 1`` (``lax.switch`` over
   ``verify_widths``): a shorter verify is a cheaper program, which is what the scheduler trades.
5. **Accept** (:func:`accept_chain`): greedy, the longest prefix equal to the target's argmax, then
   its bonus; sampled, ``x_k`` is kept with probability ``min(1, p_k(x_k) / q_k(x_k))`` and the
   first rejection draws from ``norm(max(0, p_k - q_k))`` (if all ``l`` are kept, the bonus is a
   sample of ``p_{l+1}``). Output is distributed exactly as the target's.
"""

import dataclasses
import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import rounds as rounds_lib
from jetspec_jax import tree as tree_lib
from jetspec_jax import verify as verify_lib
from jetspec_jax.kv_cache import KVCache
from jetspec_jax.methods.base import Method
from jetspec_jax.models import decoder
from jetspec_jax.models import draft_head as draft_head_lib
from jetspec_jax.typing import Array, Float, Int

VERIFY_LENGTHS = ('threshold', 'scheduler')


# The sequential stage and the confidence head.


def markov_bias(params: dict, prev: Int[Array, '...'], vocab=None) -> Float[Array, '... V']:
  """``W1[prev] W2``: the low-rank bias on the next token's logits given the previous token
  (over the ids ``vocab`` only, when given: a reduced draft vocabulary in training)."""
  embed = params['markov']['embed'][prev].astype(jnp.float32)
  proj = params['markov']['proj']
  if vocab is not None:
    proj = proj[:, vocab]
  return embed @ proj.astype(jnp.float32)


def confidence_logits(
  params: dict, hidden: Float[Array, '... D'], prev: Int[Array, '...']
) -> Float[Array, '...']:
  """``w . [h_k; W1[x_{k-1}]] + b`` (before calibration and the sigmoid), float32."""
  z = jnp.concatenate(
    [hidden.astype(jnp.float32), params['markov']['embed'][prev].astype(jnp.float32)], axis=-1
  )
  conf = params['confidence']
  return z @ conf['kernel'].astype(jnp.float32) + conf['bias'].astype(jnp.float32)


def calibration_temperatures(head: draft_head_lib.DraftHead) -> Float[Array, ' T']:
  if head.calibration is None:
    return jnp.ones((head.cfg.block_size,), jnp.float32)
  return jnp.asarray(head.calibration, jnp.float32)


class Draft(NamedTuple):
  """A drafted chain (``B`` sequences, ``gamma`` tokens)."""

  tokens: Int[Array, 'B depth']  # x_1 .. x_gamma
  logits: Float[Array, 'B depth V']  # q_k's logits: x_k was drawn from softmax of these
  confidence: Float[Array, 'B depth']  # calibrated c_k
  confidence_logits: Float[Array, 'B depth']  # before calibration and the sigmoid


def draft_chain(
  head: draft_head_lib.DraftHead,
  target: decoder.Target,
  hidden: Float[Array, 'B T D'],
  anchor: Int[Array, ' B'],
  key,
  temperature: float,
) -> Draft:
  """The sequential stage over the backbone's outputs ``hidden [B, gamma, D]``, left to right."""
  params = head.params
  base = head.vocab_logits(target, hidden)  # U: [B, gamma, V]

  def step(carry, xs):
    prev, key = carry
    u, h = xs
    logits = u + markov_bias(params, prev)
    conf = confidence_logits(params, h, prev)
    if temperature == 0.0:
      token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
      key, sub = jax.random.split(key)
      logits = logits / temperature
      token = jax.random.categorical(sub, logits).astype(jnp.int32)
    return (token, key), (token, logits, conf)

  xs = (jnp.moveaxis(base, 1, 0), jnp.moveaxis(hidden, 1, 0))
  _, (tokens, logits, conf) = jax.lax.scan(step, (anchor, key), xs)
  confidence = jax.nn.sigmoid(conf.T / calibration_temperatures(head)[None])
  return Draft(tokens.T, jnp.moveaxis(logits, 0, 1), confidence, conf.T)


# Verify length.


def survival(confidence: Float[Array, 'B depth']) -> Float[Array, 'B depth']:
  """``a_k = prod_{i <= k} c_i``: the estimated probability that ``x_1..x_k`` are all accepted."""
  return jnp.cumprod(confidence, axis=-1)


def threshold_lengths(confidence: Float[Array, 'B depth'], threshold: float) -> Int[Array, ' B']:
  """Verify up to the first position whose survival falls below ``threshold``."""
  keep = survival(confidence) >= threshold
  return jnp.sum(jnp.cumprod(keep, axis=-1), axis=-1).astype(jnp.int32)


def schedule_lengths(
  confidence: Float[Array, 'B depth'],
  sps: Float[Array, ' W'],
  *,
  early_stop: bool = True,
) -> Int[Array, ' B']:
  """The hardware-aware prefix scheduler (the paper's Algorithm 1) over a batch.

  Candidates ``(b, k)`` are admitted by descending survival ``a_{b,k}`` (ties: shallower first,
  so a row's prefix is admitted in order). After each admission the expected tokens per round
  ``tau = B + sum of admitted a`` and the verify width ``w = max_b l_b + 1`` give the objective
  ``tau * sps[w - 1]`` (``sps[w - 1]``: rounds per second at verify width ``w``); the best
  admitted set so far is kept.

  Args:
    confidence: ``[B, gamma]`` calibrated confidences of the drafted tokens.
    sps: ``[gamma + 1]`` steps per second at verify widths ``1 .. gamma + 1``.
    early_stop: stop at the first admission that does not improve the objective (lossless).
      ``False`` searches every prefix of the order for the best one: the biased variant of the
      paper's Appendix A, kept only so a test can show the bias.

  Returns:
    ``int32[B]`` verify lengths (draft tokens to verify per sequence).
  """
  b, gamma = confidence.shape
  a = survival(confidence).reshape(-1)
  rows = jnp.repeat(jnp.arange(b, dtype=jnp.int32), gamma)
  depth = jnp.tile(jnp.arange(1, gamma + 1, dtype=jnp.int32), b)
  order = jnp.lexsort((depth, -a))  # by descending a, then by depth
  sps = jnp.asarray(sps, jnp.float32)
  base = jnp.float32(b) * sps[0]

  def admit(carry, i):
    lengths, tau, width, best, best_lengths, stopped = carry
    r, k = rows[i], depth[i]
    new_lengths = lengths.at[r].max(k)
    new_tau = tau + a[i]
    new_width = jnp.maximum(width, k + 1)
    theta = new_tau * sps[new_width - 1]
    better = (theta > best) & ~stopped
    best = jnp.where(better, theta, best)
    best_lengths = jnp.where(better, new_lengths, best_lengths)
    go_on = ~stopped if not early_stop else ~stopped & better
    lengths = jnp.where(go_on, new_lengths, lengths)
    tau = jnp.where(go_on, new_tau, tau)
    width = jnp.where(go_on, new_width, width)
    return (lengths, tau, width, best, best_lengths, ~go_on), None

  zeros = jnp.zeros((b,), jnp.int32)
  init = (zeros, jnp.float32(b), jnp.int32(1), base, zeros, jnp.bool_(False))
  (_, _, _, _, lengths, _), _ = jax.lax.scan(admit, init, order)
  return lengths


def verify_widths(max_depth: int) -> tuple[int, ...]:
  """Compiled verify widths (nodes, root included): powers of two up to ``max_depth + 1``."""
  widths, w = [], 1
  while w < max_depth + 1:
    widths.append(w)
    w *= 2
  return tuple(widths) + (max_depth + 1,)


def width_table(values_at_widths, widths: tuple[int, ...]) -> np.ndarray:
  """Expands per-compiled-width values to every width ``1 .. widths[-1]`` (a width runs at the
  smallest compiled width that holds it)."""
  out = []
  for w in range(1, widths[-1] + 1):
    out.append(values_at_widths[next(i for i, c in enumerate(widths) if c >= w)])
  return np.asarray(out, np.float32)


# Verification and acceptance.


def chain_tree(tokens: Int[Array, 'B M']) -> tree_lib.Tree:
  """A batch of chains ``tokens[:, 0] -> tokens[:, 1] -> ...`` as trees."""
  b, m = tokens.shape
  nodes = jnp.arange(m, dtype=jnp.int32)
  return tree_lib.Tree(
    tokens=tokens,
    parents=jnp.broadcast_to(nodes - 1, (b, m)),
    depths=jnp.broadcast_to(nodes, (b, m)),
    scores=jnp.zeros((b, m), jnp.float32),
    num_nodes=jnp.full((b,), m, jnp.int32),
  )


def verify_chain(
  target: decoder.Target,
  cache: KVCache,
  chain: Int[Array, 'B M'],
  num_verified: Int[Array, ''],
  widths: tuple[int, ...],
  taps: tuple[int, ...],
) -> verify_lib.Verified:
  """The target over the first ``num_verified`` nodes of ``chain`` (at least), at the smallest
  compiled width that holds them; logits and features are padded to ``M`` nodes."""
  b, m = chain.shape

  def run(width):
    def branch(cache):
      tree = chain_tree(chain[:, :width])
      anc = jnp.broadcast_to(jnp.tril(jnp.ones((width, width), bool)), (b, width, width))
      out = verify_lib.verify_tree(target, cache, tree, anc, taps)
      pad = lambda x: jnp.pad(x, ((0, 0), (0, m - width), (0, 0)))
      return verify_lib.Verified(pad(out.logits), pad(out.features), out.cache)

    return branch

  index = jnp.searchsorted(jnp.asarray(widths), num_verified, side='left')
  return jax.lax.switch(jnp.minimum(index, len(widths) - 1), [run(w) for w in widths], cache)


def accept_chain(
  draft: Draft,
  target_logits: Float[Array, 'B M V'],
  lengths: Int[Array, ' B'],
  key,
  sampling: rounds_lib.Sampling,
) -> tuple[Int[Array, ' B'], Int[Array, ' B']]:
  """Lossless acceptance of the first ``lengths[b]`` drafted tokens.

  ``target_logits[:, k]`` is the target at chain node ``k`` (node 0 = the anchor), i.e. its
  prediction of ``x_{k+1}``.

  Returns:
    (accepted drafts ``int32[B]``, bonus token ``int32[B]``).
  """
  b, gamma = draft.tokens.shape
  rows = jnp.arange(b)
  admitted = jnp.arange(gamma)[None] < lengths[:, None]
  if sampling.temperature == 0.0:
    choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, gamma + 1]
    keep = (draft.tokens == choice[:, :gamma]) & admitted
    n = jnp.sum(jnp.cumprod(keep, axis=1), axis=1).astype(jnp.int32)
    return n, choice[rows, n]
  t = sampling.temperature
  p = jax.nn.softmax(verify_lib.process_logits(target_logits, t, sampling.top_k, sampling.top_p))
  q = jax.nn.softmax(draft.logits, axis=-1)  # [B, gamma, V]
  pick = lambda d: jnp.take_along_axis(d, draft.tokens[..., None], axis=-1)[..., 0]
  key_u, key_b = jax.random.split(key)
  u = jax.random.uniform(key_u, (b, gamma))
  keep = (u * pick(q) < pick(p[:, :gamma])) & admitted
  n = jnp.sum(jnp.cumprod(keep, axis=1), axis=1).astype(jnp.int32)
  p_n = p[rows, n]
  q_n = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)[rows, n]
  residual = jnp.maximum(p_n - q_n, 0.0)
  rejected = (n < lengths)[:, None] & (jnp.sum(residual, axis=-1, keepdims=True) > 0)
  dist = jnp.where(rejected, residual, p_n)
  bonus = jax.random.categorical(key_b, jnp.log(dist)).astype(jnp.int32)
  return n, bonus


# The round.


@dataclasses.dataclass(frozen=True)
class DSpark(Method):
  """DSpark: a DSpark head's sequential chain, verified up to a confidence-chosen length.

  Attributes:
    verify_length: ``'threshold'`` or ``'scheduler'``.
    threshold: the survival threshold (``'threshold'``); 0 verifies the whole block.
    widths: compiled verify widths (nodes, root included), ascending, the last ``gamma + 1``
      (default: :func:`verify_widths`).
  """

  name = 'dspark'
  head_kinds = ('dspark',)

  verify_length: str = 'threshold'
  threshold: float = 0.5
  widths: tuple[int, ...] = ()

  def __post_init__(self):
    if self.verify_length not in VERIFY_LENGTHS:
      raise ValueError(f'verify_length must be one of {VERIFY_LENGTHS}, got {self.verify_length!r}')
    if not 0.0 <= self.threshold <= 1.0:
      raise ValueError(f'threshold={self.threshold} must be in [0, 1]')
    if self.widths and (
      self.widths[0] < 1 or any(a >= b for a, b in zip(self.widths, self.widths[1:]))
    ):
      raise ValueError(f'widths={self.widths} must be ascending and >= 1')

  def make_round(self, target, head):
    return self, head.cfg.max_depth + 1

  def round_data(self, target, head, batch_size, capacity):
    """The scheduler's rounds-per-second table (draft + verify at each verify width), profiled
    once per device, batch and capacity; None for the threshold."""
    if self.verify_length != 'scheduler':
      return None
    widths = self.widths or verify_widths(head.cfg.max_depth)
    return jnp.asarray(profile_sps(target, batch_size, capacity, widths, head=head))

  def __call__(self, target, head, state, sampling, sps=None):
    return dspark_round(target, head, state, sampling, self, sps)

  def draft(self, target, head, state):
    """The head's part of a round alone (greedy; its cost is the round's draft share)."""
    draft_cache = head.extend_context(state.draft_cache, state.pending, state.num_pending)
    hidden = head.block_hidden(target, draft_cache, state.anchor)
    return draft_chain(head, target, hidden, state.anchor, state.key, 0.0).tokens


def dspark_round(
  target: decoder.Target,
  head: draft_head_lib.DraftHead,
  state: rounds_lib.RoundState,
  sampling: rounds_lib.Sampling,
  settings: DSpark,
  sps: Float[Array, ' W'] | None = None,
) -> tuple[rounds_lib.RoundState, rounds_lib.RoundOutput]:
  """One DSpark round: draft chain -> verify length -> verify -> accept -> commit."""
  gamma = head.cfg.max_depth
  widths = settings.widths or verify_widths(gamma)
  if widths[-1] != gamma + 1:
    # A shorter last width would leave long verifies reading zero-padded logits.
    raise ValueError(f'widths={widths} must end at the whole chain, gamma + 1 = {gamma + 1}')
  draft_cache = head.extend_context(state.draft_cache, state.pending, state.num_pending)
  hidden = head.block_hidden(target, draft_cache, state.anchor)  # [B, gamma, D]
  key, draft_key, accept_key = jax.random.split(state.key, 3)
  draft = draft_chain(head, target, hidden, state.anchor, draft_key, sampling.temperature)
  if settings.verify_length == 'scheduler':
    if sps is None:
      raise ValueError("verify_length='scheduler' needs a steps-per-second table (profile_sps)")
    lengths = schedule_lengths(draft.confidence, sps)
  else:
    lengths = threshold_lengths(draft.confidence, settings.threshold)
  chain = jnp.concatenate([state.anchor[:, None], draft.tokens], axis=1)  # [B, gamma + 1]
  verified = verify_chain(
    target, state.cache, chain, jnp.max(lengths) + 1, widths, head.cfg.target_layer_ids
  )
  n, bonus = accept_chain(draft, verified.logits, lengths, accept_key, sampling)
  path = jnp.broadcast_to(jnp.arange(gamma + 1, dtype=jnp.int32), chain.shape)
  path = jnp.where(path <= n[:, None], path, 0)
  accepted = verify_lib.Accepted(path, n, bonus)
  cache = verify_lib.commit(verified.cache, state.cache.lengths, accepted)
  pending = verify_lib.gather_path(verified.features, path)
  rows = jnp.arange(chain.shape[0])
  committed = jnp.concatenate([draft.tokens, jnp.zeros_like(bonus)[:, None]], axis=1)
  committed = committed.at[rows, n].set(bonus)
  tau = n + 1
  new_state = rounds_lib.RoundState(cache, draft_cache, pending, tau, bonus, key)
  out = rounds_lib.RoundOutput(
    committed, tau, path=path, draft_logits=draft.logits, verify_len=lengths
  )
  return new_state, out


# The steps-per-second table.

_SPS_CACHE: dict = {}


def profile_sps(
  target: decoder.Target,
  batch_size: int,
  capacity: int,
  widths: tuple[int, ...],
  *,
  head: draft_head_lib.DraftHead | None = None,
  repeats: int = 3,
) -> np.ndarray:
  """Rounds per second at every verify width ``1 .. widths[-1]``, measured once per (model, head,
  batch, capacity, widths, device) on the running device and cached.

  Each compiled width's verify forward is timed (median of ``repeats`` after a warm-up) on a
  half-full cache; with ``head``, one draft (backbone + sequential stage, the same at every
  width) is timed too and added, so the table is of whole rounds: where the draft is a sizeable
  part of a round (a small target, a CPU), the scheduler then prices verify width against the
  round's real cost, not the target's alone.
  """
  device = jax.devices()[0]
  cache_key = (
    target.cfg,
    str(target.dtype),
    None if head is None else head.cfg,
    batch_size,
    capacity,
    widths,
    device.device_kind,
  )
  if cache_key in _SPS_CACHE:
    return _SPS_CACHE[cache_key]

  def median_seconds(fn, *args):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - start)
    return float(np.median(times))

  @functools.partial(jax.jit, static_argnames='width')
  def verify(target, cache, width):
    tokens = jnp.zeros((batch_size, width), jnp.int32)
    anc = jnp.broadcast_to(jnp.tril(jnp.ones((width, width), bool)), (batch_size, width, width))
    return verify_lib.verify_tree(target, cache, chain_tree(tokens), anc).logits

  half = jnp.full((batch_size,), capacity // 2, jnp.int32)
  draft_s = 0.0
  if head is not None:

    @jax.jit
    def draft(head, target, cache, anchor):
      hidden = head.block_hidden(target, cache, anchor)
      return draft_chain(head, target, hidden, anchor, jax.random.key(0), 0.0).tokens

    draft_cache = head.make_cache(batch_size, capacity).replace(lengths=half)
    draft_s = median_seconds(draft, head, target, draft_cache, jnp.zeros((batch_size,), jnp.int32))
  cache = target.make_cache(batch_size, capacity).replace(lengths=half)
  per_width = [1.0 / (median_seconds(verify, target, cache, w) + draft_s) for w in widths]
  table = width_table(per_width, widths)
  _SPS_CACHE[cache_key] = table
  return table
