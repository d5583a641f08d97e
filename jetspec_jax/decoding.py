"""Generation: ``js.generate`` and its per-method device loops.

Every method runs its whole decode in one jitted function: prefill, then ``lax.while_loop`` over
steps (AR) or speculative rounds, with no host sync until the end (DESIGN.md §2, "the decode
loop"). Prompts are right-padded to a power-of-two bucket and the cache capacity is bucketed too, so
prompts of similar lengths share one compilation.
"""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.models import qwen3

METHODS = ('ar', 'chain', 'tree')


@dataclasses.dataclass(frozen=True)
class GenerationStats:
  """Statistics of one ``generate`` call (DESIGN.md §6).

  Attributes:
    tau: mean tokens committed per target forward after prefill (1.0 for AR).
    rounds: target forwards after prefill (decode steps or verify rounds).
    new_tokens: tokens generated (the prefill's first token included).
    wall_s: wall time of the call, device work included.
    acceptance_lengths: tokens committed per round, ``[rounds]``.
  """

  tau: float
  rounds: int
  new_tokens: int
  wall_s: float
  acceptance_lengths: np.ndarray

  @property
  def tokens_per_s(self) -> float:
    return self.new_tokens / self.wall_s if self.wall_s > 0 else float('nan')


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
  tokens: np.ndarray  # int32[new_tokens]: generated tokens, EOS included if reached
  stats: GenerationStats


def bucket(n: int, minimum: int = 16) -> int:
  """The smallest power of two >= max(n, minimum)."""
  return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def sample_token(logits, key, temperature: float):
  """Greedy (``temperature == 0``) or temperature sampling from ``logits[..., V]``."""
  if temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits.astype(jnp.float32) / temperature).astype(jnp.int32)


def prefill(target: qwen3.Target, prompt, prompt_len, capacity: int, taps=()):
  """Runs the target over a right-padded prompt ``int32[1, Pb]`` of true length ``prompt_len``.

  Padding rows are written to slot ``capacity`` (dropped), so the cache holds exactly the prompt.

  Returns:
    (cache, last_logits ``[1, V]`` float32, taps ``[1, Pb, n_taps*D]`` or None)
  """
  pb = prompt.shape[1]
  positions = jnp.arange(pb, dtype=jnp.int32)[None]
  slots = jnp.where(positions < prompt_len, positions, capacity)
  cache = target.make_cache(1, capacity)
  mask = qwen3.causal_mask(positions, capacity)
  out = target.forward(prompt, cache, positions=positions, slots=slots, mask=mask, taps=taps)
  last = jax.lax.dynamic_index_in_dim(out.hidden, prompt_len - 1, axis=1, keepdims=False)
  return out.cache, target.lm_logits(last).astype(jnp.float32), out.taps


@functools.partial(jax.jit, static_argnames=('capacity', 'max_new_tokens', 'temperature', 'eos'))
def _ar_loop(target, prompt, prompt_len, key, *, capacity, max_new_tokens, temperature, eos):
  cache, last_logits, _ = prefill(target, prompt, prompt_len, capacity)
  key, sub = jax.random.split(key)
  first = sample_token(last_logits[0], sub, temperature)
  out = jnp.zeros((max_new_tokens,), jnp.int32).at[0].set(first)

  def done(tok):
    return jnp.asarray(False) if eos is None else tok == eos

  def cond(state):
    i, tok, *_ = state
    return (i < max_new_tokens) & ~done(tok)

  def body(state):
    i, tok, cache, out, key = state
    fwd = target.forward(tok[None, None], cache)
    logits = target.lm_logits(fwd.hidden[0, 0]).astype(jnp.float32)
    key, sub = jax.random.split(key)
    nxt = sample_token(logits, sub, temperature)
    return i + 1, nxt, fwd.cache, out.at[i].set(nxt), key

  n, _, _, out, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), first, cache, out, key))
  return out, n


def _prepare_prompt(target: qwen3.Target, prompt_ids, max_new_tokens: int, extra: int = 0):
  ids = np.asarray(prompt_ids)
  if ids.ndim != 1:
    raise ValueError(f'prompt_ids must be a 1-D sequence of token ids, got shape {ids.shape}')
  if ids.size == 0:
    raise ValueError('prompt_ids is empty')
  if not np.issubdtype(ids.dtype, np.integer):
    raise TypeError(f'prompt_ids must be integers, got dtype {ids.dtype}')
  qwen3.check_token_ids(ids, target.cfg.vocab_size)
  if max_new_tokens < 1:
    raise ValueError(f'{max_new_tokens=} must be >= 1')
  needed = ids.size + max_new_tokens + extra
  if needed > target.cfg.max_position_embeddings:
    raise ValueError(
      f'prompt ({ids.size}) + max_new_tokens ({max_new_tokens}) + round '
      f'overhang ({extra}) = {needed} exceeds the model context '
      f'{target.cfg.max_position_embeddings}'
    )
  padded = np.zeros((1, bucket(ids.size)), np.int32)
  padded[0, : ids.size] = ids
  return jnp.asarray(padded), ids.size, bucket(needed)


def generate(
  target: qwen3.Target,
  head=None,
  prompt_ids=None,
  *,
  max_new_tokens: int = 256,
  method: str = 'ar',
  budget: int = 64,
  width: int = 7,
  temperature: float = 0.0,
  seed: int = 0,
) -> GenerateOutput:
  """Generates ``max_new_tokens`` tokens (or up to EOS) after ``prompt_ids``.

  Args:
    target: the target model.
    head: the draft head (``None`` for ``method='ar'``).
    prompt_ids: 1-D token ids.
    max_new_tokens: tokens to generate, EOS included.
    method: ``'ar'`` (autoregressive), ``'chain'`` or ``'tree'``.
    budget: tree nodes per round, root included (``'tree'``).
    width: candidates per depth (``'tree'``).
    temperature: 0 for greedy.
    seed: PRNG seed for sampling.

  Returns:
    A :class:`GenerateOutput` with the new tokens and :class:`GenerationStats`.
  """
  del budget, width  # Used by the speculative methods.
  if method not in METHODS:
    raise ValueError(f'method must be one of {METHODS}, got {method!r}')
  if method != 'ar':
    raise NotImplementedError(f'method={method!r} needs the draft head (not built yet)')
  if head is not None:
    raise ValueError("method='ar' takes no draft head")
  if temperature < 0:
    raise ValueError(f'{temperature=} must be >= 0')
  prompt, prompt_len, capacity = _prepare_prompt(target, prompt_ids, max_new_tokens)
  start = time.perf_counter()
  out, n = _ar_loop(
    target,
    prompt,
    jnp.int32(prompt_len),
    jax.random.key(seed),
    capacity=capacity,
    max_new_tokens=max_new_tokens,
    temperature=float(temperature),
    eos=target.cfg.eos_token_id,
  )
  out, n = jax.device_get((out, n))
  wall = time.perf_counter() - start
  n = int(n)
  stats = GenerationStats(
    tau=1.0, rounds=n - 1, new_tokens=n, wall_s=wall, acceptance_lengths=np.ones((n - 1,), np.int32)
  )
  return GenerateOutput(tokens=np.asarray(out[:n]), stats=stats)
