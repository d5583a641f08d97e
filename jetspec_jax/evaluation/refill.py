"""AR decoding (greedy or sampled) over a stream of prompts with a fixed set of cache rows, each
refilled with the next prompt as soon as its response ends.

Batched AR (:func:`jetspec_jax.rounds.ar_loop`) runs a batch until its longest response ends, so
a batch holding one response that runs to the token cap and fifteen short ones spends most of its
row-steps on finished rows. Here the rows decode ``chunk`` steps at a time on device; between
chunks the host collects the rows that ended and prefills the next prompts into them, so every
row-step but the stream's tail decodes a live response. Each row is the target's greedy decode of
its own prompt (rows never read each other), as in :func:`jetspec_jax.decoding.generate`; or its
sample, drawn with keys of the prompt's own seed and the token's position, so a sample does not
depend on the rows, the chunk or the order prompts are answered in. One stream may mix both: a
sampled stream decodes the prompts ``greedy_of`` names greedily, each row its own way.
"""

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import rounds as rounds_lib

PROMPT_BUCKET = 128  # prompts are padded to a multiple of it: one prefill program per bucket


def padded_length(n: int) -> int:
  """A prompt of ``n`` tokens padded to :data:`PROMPT_BUCKET`."""
  return -(-n // PROMPT_BUCKET) * PROMPT_BUCKET


@dataclasses.dataclass(frozen=True)
class Finished:
  """One prompt's greedy response.

  Attributes:
    index: the order the prompt was drawn from the stream in.
    tokens: ``int32[n]`` the response (its stop id included when it stopped).
    seconds: the response's share of decoding time (each chunk's wall time split among the rows
      live in it) plus its own prefill.
  """

  index: int
  tokens: np.ndarray
  seconds: float


def _ended(tokens, counts, max_new_tokens: int, sampling: rounds_lib.Sampling):
  """Rows whose response ends with ``tokens`` (just written, ``counts`` tokens so far)."""
  return sampling.is_eos(tokens) | (counts >= max_new_tokens)


def _next(logits, seeds, counts, greedy, sampling: rounds_lib.Sampling):
  """Each row's next token (``counts``: tokens it has so far): the argmax, or a sample with the
  key of (its prompt's seed, its position); the argmax in a sampled stream's ``greedy`` rows."""
  argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if sampling.temperature == 0.0:
    return argmax
  keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds, counts)
  sample = jax.vmap(lambda lg, k: sampling.sample(lg[None], k)[0])(logits, keys)
  return jnp.where(greedy, argmax, sample)


@functools.partial(
  jax.jit, static_argnames=('capacity', 'max_new_tokens', 'sampling'), donate_argnames=('state',)
)
def _fill_row(
  target,
  state,
  prompt,
  prompt_len,
  row,
  seed,
  greedy,
  capacity: int,
  max_new_tokens: int,
  sampling: rounds_lib.Sampling,
):
  """Prefills ``prompt`` (``int32[1, Pb]``) into the first ``Pb`` slots of cache row ``row`` (the
  prefill attends over those only, not the row's whole capacity; the slots after them keep what
  they held, unread: a row reads its first ``lengths`` slots); its first token is the prefill's
  argmax (or sample, with the prompt's ``seed``, unless ``greedy``)."""
  del capacity  # the rows' capacity: the prefill's own cache is only as wide as the prompt
  cache, tok, done, counts, out, seeds, greedy_rows = state
  small, last_logits, _ = rounds_lib.prefill(target, prompt, prompt_len[None], prompt.shape[1])
  cache = jax.tree.map(
    lambda big, one: jax.lax.dynamic_update_slice(
      big, one.astype(big.dtype), (row,) + (0,) * (big.ndim - 1)
    ),
    cache,
    small,
  )
  first = _next(last_logits, seed[None], jnp.zeros((1,), jnp.int32), greedy[None], sampling)[0]
  out = out.at[row].set(jnp.zeros_like(out[row]).at[0].set(first))
  done = done.at[row].set(_ended(first, 1, max_new_tokens, sampling))
  seeds, greedy_rows = seeds.at[row].set(seed), greedy_rows.at[row].set(greedy)
  return cache, tok.at[row].set(first), done, counts.at[row].set(1), out, seeds, greedy_rows


@functools.partial(
  jax.jit, static_argnames=('steps', 'max_new_tokens', 'sampling'), donate_argnames=('state',)
)
def _decode(target, state, steps: int, max_new_tokens: int, sampling: rounds_lib.Sampling):
  """``steps`` steps of every row; a finished row keeps its cache length and output."""

  def body(_, carry):
    cache, tok, done, counts, out, seeds, greedy = carry
    step = target.forward(tok[:, None], cache)
    nxt = _next(target.lm_logits(step.hidden[:, 0]), seeds, counts, greedy, sampling)
    live = ~done
    slot = jnp.where(live, counts, max_new_tokens)  # out of bounds: dropped
    out = out.at[jnp.arange(out.shape[0]), slot].set(nxt, mode='drop')
    counts = counts + live.astype(jnp.int32)
    done = done | (live & _ended(nxt, counts, max_new_tokens, sampling))
    cache = step.cache.replace(lengths=jnp.where(live, step.cache.lengths, cache.lengths))
    return cache, nxt, done, counts, out, seeds, greedy

  return jax.lax.fori_loop(0, steps, body, state)


def generate(
  target,
  prompts: Iterable[np.ndarray | None],
  *,
  max_new_tokens: int,
  eos: Iterable[int],
  rows: int = 16,
  chunk: int = 32,
  capacity: int | None = None,
  on_finished: Callable[[Finished], None] | None = None,
  temperature: float = 0.0,
  top_p: float = 1.0,
  seed_of: Callable[[int], int] | None = None,
  greedy_of: Callable[[int], bool] | None = None,
) -> list[Finished]:
  """Greedy (or sampled) responses of ``prompts`` (1-D token ids), ``rows`` decoded side by side.

  ``prompts`` is drawn lazily, one prompt each time a row is free, so it may be a generator that
  yields prompts made from responses already finished (a conversation's next turn, queued by
  ``on_finished``). It yields ``None`` when it has nothing to ask yet (the row waits and it is
  asked again after the next chunk); it must not yield ``None`` while no response is in flight.
  A response's ``index`` is the order its prompt was drawn in.

  Args:
    max_new_tokens: most tokens of a response (its stop id included).
    eos: stop ids.
    rows: cache rows decoded together.
    chunk: decode steps between the host's checks for finished rows.
    capacity: cache positions of a row; default: the longest prompt (``prompts`` must then be a
      sequence) rounded up to :data:`PROMPT_BUCKET`, plus ``max_new_tokens``.
    on_finished: called with each response as it ends (e.g. to append it to a file).
    temperature, top_p: > 0: sample (:func:`jetspec_jax.verify.sample_tokens`); token ``t`` of
      a response with the key ``fold_in(key(seed), t)``.
    seed_of: the seed (an int below 2**31) of the prompt drawn ``index``-th (default: its
      index): a prompt keeps its sample when the stream's order changes (e.g. a resumed run).
    greedy_of: in a sampled stream, whether the prompt drawn ``index``-th is answered greedily
      instead (default: none is): greedy and sampled answers side by side, each the same as in
      a stream of its own kind.

  Returns:
    The responses, in the order they finished.
  """
  eos = tuple(sorted({int(e) for e in eos}))
  if not eos:
    raise ValueError('refill generation needs stop ids (eos)')
  if max_new_tokens < 1:
    raise ValueError(f'max_new_tokens={max_new_tokens} must be >= 1')
  sampling = rounds_lib.Sampling(temperature=float(temperature), top_p=float(top_p), eos=eos)
  if capacity is None:
    if not isinstance(prompts, Sequence):
      raise ValueError('a prompt stream needs capacity= (its longest prompt is not known)')
    if not prompts:
      return []
    capacity = padded_length(max(len(p) for p in prompts)) + max_new_tokens
    rows = min(rows, len(prompts))

  def empty_rows():
    return (
      target.make_cache(rows, capacity),
      jnp.zeros((rows,), jnp.int32),
      jnp.ones((rows,), bool),
      jnp.zeros((rows,), jnp.int32),
      jnp.zeros((rows, max_new_tokens), jnp.int32),
      jnp.zeros((rows,), jnp.int32),  # each row's prompt seed
      jnp.zeros((rows,), bool),  # each row's prompt answered greedily (a sampled stream)
    )

  state = None  # made with the first prompt: a stream with nothing to ask allocates no cache
  owner = [-1] * rows  # the prompt each row decodes (-1: none)
  seconds = [0.0] * rows
  source = iter(prompts)
  drawn = 0
  exhausted = False
  finished = []

  def fill(row: int) -> None:
    nonlocal state, drawn, exhausted
    owner[row] = -1
    ids = None if exhausted else next(source, StopIteration)
    if ids is StopIteration:
      exhausted = True
    if ids is None or ids is StopIteration:
      return
    ids = np.asarray(ids, np.int32)
    if padded_length(len(ids)) + max_new_tokens > capacity:
      raise ValueError(
        f'a prompt of {len(ids)} tokens does not fit capacity={capacity} with '
        f'max_new_tokens={max_new_tokens} (prompts are padded to {PROMPT_BUCKET})'
      )
    owner[row], drawn = drawn, drawn + 1
    seed = owner[row] if seed_of is None else int(seed_of(owner[row]))
    greedy = greedy_of is not None and bool(greedy_of(owner[row]))
    if state is None:
      state = empty_rows()
    padded = np.zeros((1, padded_length(len(ids))), np.int32)
    padded[0, : len(ids)] = ids
    start = time.perf_counter()
    state = _fill_row(
      target,
      state,
      padded,
      np.int32(len(ids)),
      np.int32(row),
      np.int32(seed),
      np.bool_(greedy),
      capacity,
      max_new_tokens,
      sampling,
    )
    jax.block_until_ready(state)
    seconds[row] = time.perf_counter() - start

  while True:
    for row in range(rows):
      if owner[row] < 0 and not exhausted:
        fill(row)
    live = [r for r in range(rows) if owner[r] >= 0]
    if not live:
      if exhausted:
        return finished
      raise ValueError('the prompt stream has nothing to ask and no response is in flight')
    start = time.perf_counter()
    state = _decode(target, state, chunk, max_new_tokens, sampling)
    done, counts = jax.device_get((state[2], state[3]))
    share = (time.perf_counter() - start) / len(live)
    for row in live:
      seconds[row] += share
      if not done[row]:
        continue
      tokens = np.asarray(jax.device_get(state[4][row, : counts[row]]))
      result = Finished(owner[row], tokens, seconds[row])
      finished.append(result)
      if on_finished is not None:
        on_finished(result)
      fill(row)
