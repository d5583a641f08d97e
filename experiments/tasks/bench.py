"""What every benchmark binary and the demo share: settings, measuring, summaries, the result
envelope, writers, timing.

A :class:`Setting` names one way to decode (AR is a setting like any other). :func:`measure`
decodes a list of prompts with it after a compile warm-up; :func:`summarize` turns the outputs into
tau / tokens per second / speedup; :func:`check_lossless` compares greedy outputs with AR's;
:func:`envelope` is the part of every result file that says where and with what it was measured;
:func:`write_result` writes the JSON and its markdown table.
"""

import dataclasses
import json
import pathlib
import platform
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jetspec_jax as js
from jetspec_jax.evaluation import provenance


@dataclasses.dataclass(frozen=True)
class Setting:
  """One way to decode: a method value (:mod:`jetspec_jax.methods`) and the name of the head it
  runs (None for AR)."""

  method: js.methods.Method = js.methods.AR()
  head: str | None = None

  def __post_init__(self):
    if not isinstance(self.method, js.methods.Method):
      raise TypeError(f'a setting takes a method value, got {self.method!r}')
    is_ar = isinstance(self.method, js.methods.AR)
    if is_ar != (self.head is None):
      raise ValueError(f'{self.method} takes {"no" if is_ar else "a"} head')

  @property
  def name(self) -> str:
    copy_len = getattr(self.method, 'copy_len', 0)
    copy_prior = getattr(self.method, 'copy_prior', ())
    merged = '/copymerge' + ','.join(f'{p:g}' for p in copy_prior) if copy_prior else ''
    bonus = getattr(self.method, 'depth_bonus', 0.0)
    deeper = f'/depth_bonus{bonus:g}' if bonus else ''
    return self._base_name + (f'/copy{copy_len}' if copy_len else '') + merged + deeper

  @property
  def _base_name(self) -> str:
    m = self.method
    if isinstance(m, js.methods.AR):
      return 'ar'
    if isinstance(m, js.methods.Chain):
      return f'chain/{self.head}'
    if isinstance(m, js.methods.DSpark):
      if m.verify_length == 'scheduler':
        return f'dspark/{self.head}/scheduler'
      return f'dspark/{self.head}/threshold{m.threshold:g}'
    tree = f'{self.head}/{m.algorithm}/{m.budget}'
    if isinstance(m, js.methods.JetSpecPP):
      seed = 'recycle' if m.recycle else 'mask'
      return f'jetspecpp/{tree}/{seed}/passes{m.refine_passes}'
    return f'{m.name}/{tree}'

  def row(self) -> dict:
    """The setting's name, method, head and every method setting (None where it has none)."""
    keys = ('budget', 'algorithm', 'verify_length', 'threshold', 'recycle', 'refine_passes')
    return dict(
      setting=self.name,
      method=self.method.name,
      head=self.head,
      **{k: getattr(self.method, k, None) for k in keys},
      copy_len=getattr(self.method, 'copy_len', 0),
    )


TARGET_PRECISIONS = ('float32', 'bfloat16', 'bfloat16x2', 'bfloat16x2+bf16_prefill')


def target_precision(float32, name: str):
  """The float32 target, or it with bfloat16 weight matrices (float32 accumulation): each
  projection's input rounded to bfloat16 (``bfloat16``) or split into two bfloat16 halves
  (``bfloat16x2``; activations, norms and the KV cache stay float32), the split one with its
  prompt forward in rounded bfloat16 (``bfloat16x2+bf16_prefill``)."""
  if name == 'float32':
    return float32
  if name == 'bfloat16':
    return float32.with_weight_dtype('bfloat16')
  if name == 'bfloat16x2':
    return float32.with_weight_dtype('bfloat16', split_inputs=True)
  if name == 'bfloat16x2+bf16_prefill':
    split = float32.with_weight_dtype('bfloat16', split_inputs=True)
    return split.with_prefill_compute_dtype('bfloat16')
  raise ValueError(f'unknown target precision {name!r}; known: {", ".join(TARGET_PRECISIONS)}')


def head_settings(
  heads: Sequence[str],
  budgets: Sequence[int],
  algorithms: Sequence[str],
  width: int = 7,
  kinds: dict[str, str] | None = None,
  dspark_verify: Sequence[tuple[str, float]] = (('threshold', 0.0),),
  jetspecpp_variants: Sequence[tuple[bool, int]] = ((False, 0), (True, 0)),
  copy_lens: Sequence[int] = (0,),
) -> list[Setting]:
  """AR, then for every head its chain and its trees (every algorithm and budget); a DSpark head
  (``kinds[head] == 'dspark'``) gets one setting per ``(verify_length, threshold)`` instead, a
  JetSpec++ head one tree per budget, algorithm and ``(recycle, refine_passes)``. Chains and
  trees come once per ``copy_lens`` entry (0: no copy candidates; a tree's budget must exceed
  it)."""
  m = js.methods
  out = [Setting()]
  for head in heads:
    if (kinds or {}).get(head) == 'dspark':
      out += [Setting(m.DSpark(v, t), head) for v, t in dspark_verify]
      continue
    if (kinds or {}).get(head) == 'jetspecpp':
      out += [
        Setting(m.JetSpecPP(b, width, a, copy_len=c, recycle=r, refine_passes=n), head)
        for a in algorithms
        for b in budgets
        for r, n in jetspecpp_variants
        for c in copy_lens
        if b > c
      ]
      continue
    out += [Setting(m.Chain(copy_len=c), head) for c in copy_lens]
    for a in algorithms:
      out += [
        Setting(m.Tree(b, width, a, copy_len=c), head) for b in budgets for c in copy_lens if b > c
      ]
  return out


def _decode(target, heads, setting: Setting, prompt, seed, *, shapes, **options):
  """One ``js.generate`` of ``prompt`` with ``setting`` (its head looked up in ``heads``)."""
  head = heads[setting.head] if setting.head else None
  return js.generate(
    target, head, prompt, seed=seed, method=setting.method, **options, **(shapes or {})
  )


def measure(
  target,
  heads: dict,
  setting: Setting,
  prompts: Sequence[np.ndarray],
  *,
  max_new_tokens: int,
  temperature: float = 0.0,
  shapes: dict | None = None,
  eos_id=None,
  warmup: bool = True,
) -> list:
  """``js.generate`` outputs for every prompt (seed = prompt index), after a compile warm-up."""
  options = dict(
    max_new_tokens=max_new_tokens, temperature=temperature, shapes=shapes, eos_id=eos_id
  )
  decode = lambda prompt, seed: _decode(target, heads, setting, prompt, seed, **options)

  if warmup:
    decode(prompts[0], 0)
  outputs = [decode(p, i) for i, p in enumerate(prompts)]
  # A setting's programs are never run again: dropping them keeps a long benchmark under the
  # kernel's memory-map limit (a 50-setting run died compiling: "Cannot allocate memory").
  jax.clear_caches()
  return outputs


def measure_interleaved(
  target,
  heads: dict,
  settings: Sequence[Setting],
  prompts: Sequence[np.ndarray],
  *,
  max_new_tokens: int,
  temperature: float = 0.0,
  shapes: dict | None = None,
  eos_id=None,
) -> dict[str, list]:
  """:func:`measure` for several settings at once, prompt by prompt: every setting compiles
  first, then prompt ``i`` is decoded by each setting in turn (the order rotated by one per
  prompt), so a machine whose speed drifts during the run (a shared VM) slows every setting
  alike instead of the ones that ran in its slow minutes. Every setting's programs stay compiled
  until the end: fit for a few dozen settings (:func:`measure` frees them one setting at a time).
  Returns ``{setting.name: outputs}``, each as :func:`measure`'s."""
  names = [s.name for s in settings]
  if len(set(names)) != len(names):
    raise ValueError(f'settings must have distinct names, got {names}')
  runs = {s.name: (target, heads, s) for s in settings}
  options = dict(
    max_new_tokens=max_new_tokens, temperature=temperature, shapes=shapes, eos_id=eos_id
  )
  return measure_runs(runs, prompts, **options)


def measure_runs(runs: dict, prompts: Sequence[np.ndarray], **options) -> dict[str, list]:
  """:func:`measure_interleaved` for runs of different targets: ``{label: (target, heads,
  setting)}`` -> ``{label: outputs}``; ``options`` go to ``js.generate``."""
  labels = list(runs)

  def decode(label, prompt, seed):
    target, heads, setting = runs[label]
    return _decode(target, heads, setting, prompt, seed, **options)

  for label in labels:  # compile warm-ups
    decode(label, prompts[0], 0)
  outputs = {label: [] for label in labels}
  for i, prompt in enumerate(prompts):
    shift = i % len(labels)
    for label in labels[shift:] + labels[:shift]:
      outputs[label].append(decode(label, prompt, i))
  jax.clear_caches()
  return outputs


def tau_histogram(taus: np.ndarray, max_tau: int = 16) -> list[int]:
  """``counts[k]``: rounds that committed ``k`` tokens, ``k = 0 .. max(max_tau, taus.max())``."""
  return np.bincount(np.asarray(taus, int), minlength=max_tau + 1).tolist()


def summarize(outputs: Sequence, ar_wall_s: float | None = None) -> dict:
  """tau (mean tokens per round), tokens/s, wall seconds, tokens, speedup over ``ar_wall_s``;
  with round counters, their totals, and for JetSpec++ ``guess_accuracy`` (correct / checked),
  with copy candidates ``copy_share`` (accepted copy-branch nodes / accepted drafts)."""
  wall = sum(o.stats.wall_s for o in outputs)
  tokens = sum(int(o.stats.new_tokens) for o in outputs)
  taus = np.concatenate([o.stats.tau for o in outputs])
  summary = dict(
    tau=float(taus.mean()) if taus.size else float('nan'),  # nan: no round ran (EOS at once)
    tps=tokens / wall,
    wall_s=wall,
    tokens=tokens,
    tau_histogram=tau_histogram(taus),
  )
  if ar_wall_s is not None:
    summary['speedup'] = ar_wall_s / wall
  counters = {}
  for o in outputs:
    for k, v in o.stats.round_stats.items():
      counters[k] = counters.get(k, 0) + v
  if counters:
    rounds = sum(o.stats.rounds for o in outputs)
    summary['round_stats'] = counters
  if 'guessed' in counters:
    summary['guessed_per_round'] = counters['guessed'] / max(rounds, 1)
    summary['guess_accuracy'] = counters['guess_correct'] / max(counters['guess_checked'], 1)
  if 'copy_accepted' in counters:  # share of accepted drafts only the copy branch held
    summary['copy_share'] = counters['copy_accepted'] / max(int((taus - 1).sum()), 1)
  return summary


def count_equal(outputs: Sequence, reference: Sequence) -> int:
  """How many outputs equal the reference's token for token."""
  pairs = zip(outputs, reference, strict=True)
  return sum(np.array_equal(a.tokens, b.tokens) for a, b in pairs)


def check_lossless(name: str, outputs: Sequence, ar_outputs: Sequence) -> None:
  """Raises unless every greedy output equals AR's token for token."""
  for i, (a, b) in enumerate(zip(outputs, ar_outputs, strict=True)):
    if not np.array_equal(a.tokens, b.tokens):
      raise AssertionError(f'{name} differs from ar on prompt {i}: not lossless')


def envelope(config, weights: dict | None = None) -> dict:
  """Where and with what a result was measured (the head of every result file): ``weights`` maps
  each model or head read to its files' sha256 (``{}``: random weights)."""
  return dict(
    provenance=dict(provenance.record(), weights_sha256=weights or {}),
    config=config.to_dict() if hasattr(config, 'to_dict') else dict(config),
    device=jax.devices()[0].device_kind,
    backend=jax.default_backend(),
    cpu=cpu_description(),
    versions=dict(jax=jax.__version__, python=platform.python_version(), jetspec=js.__version__),
  )


cpu_description = provenance.cpu_description


def device_tag() -> str:
  return jax.devices()[0].device_kind.replace(' ', '_').lower()


def markdown(columns: Sequence[tuple[str, str]], rows: Sequence[dict]) -> str:
  """A markdown table: ``columns`` are ``(header, format)`` with format ``'{key:spec}'``."""
  lines = ['| ' + ' | '.join(h for h, _ in columns) + ' |', '|' + '---|' * len(columns)]
  lines += ['| ' + ' | '.join(fmt.format(**r) for _, fmt in columns) + ' |' for r in rows]
  return '\n'.join(lines) + '\n'


def write_result(result: dict, out_dir, name: str, table: str) -> pathlib.Path:
  """``name.json`` and ``name.md`` in ``out_dir``; returns the JSON path."""
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  (out / f'{name}.json').write_text(json.dumps(result, indent=2))
  (out / f'{name}.md').write_text(table)
  return out / f'{name}.json'


def median_time(fn: Callable, *args, repeats: int) -> float:
  """Median wall seconds of ``fn(*args)`` after one warm-up call, synchronised every call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def median_time_carried(fn: Callable, state, *args, repeats: int):
  """Median wall seconds of ``out, state = fn(state, *args)`` with ``state`` donated.

  Each call gets the state the previous one returned, as a decode loop carries its cache, so a
  step that updates a large buffer in place is not charged for copying it.

  Returns:
    (median seconds, the last state): the donated input is gone, the caller goes on with this.
  """
  out, state = fn(state, *args)
  jax.block_until_ready(out)
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out, state = fn(state, *args)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - start)
  return float(np.median(times)), state


def round_cost(
  target, head, setting: Setting, *, batch: int, capacity: int, repeats: int = 5
) -> dict:
  """Milliseconds of one round of ``setting`` and of its head's part alone (``round_fn.draft``),
  for ``batch`` sequences whose caches are half full, and the head's share of the round.

  The round is timed carrying its state from call to call (as the decode loop does); the draft
  part reads the state the rounds left, so a JetSpec++ draft is timed with real guesses in its
  slots.
  """
  round_fn, _ = setting.method.make_round(target, head)
  sampling = js.rounds.Sampling()
  prompt_len = capacity // 2
  prompts = jnp.ones((batch, prompt_len), jnp.int32)
  lengths = jnp.full((batch,), prompt_len, jnp.int32)
  state = js.rounds.start_rounds(
    target,
    head,
    prompts,
    lengths,
    jax.random.key(0),
    capacity=capacity,
    sampling=sampling,
    keep_history=getattr(round_fn, 'keeps_history', False),  # as the decode loop starts it
  )
  if hasattr(round_fn, 'init_state'):
    state = round_fn.init_state(head, state)
  data = setting.method.round_data(target, head, batch, capacity)
  step = jax.jit(lambda s: round_fn(target, head, s, sampling, data)[::-1], donate_argnums=0)
  round_s, state = median_time_carried(step, state, repeats=repeats)
  draft = jax.jit(lambda s: round_fn.draft(target, head, s))
  draft_s = median_time(draft, state, repeats=repeats)
  return dict(
    setting=setting.name,
    batch=batch,
    round_ms=1e3 * round_s,
    draft_ms=1e3 * draft_s,
    draft_share=draft_s / round_s,
  )
