"""Accelerator benchmark: each part of a JetSpec round, and a whole round, vs the weight-read limit.

  python -m experiments.microbench --config=experiments/configs/microbench/accel.py:qwen3_8b \
      --workdir=benchmarks

At batch 1 a target step cannot beat reading every weight once: ``limit = parameter bytes /
copy bandwidth``, with the bandwidth measured in the same run (a device-to-device copy). Every
timing is the median of ``repeats`` synchronised calls after a warm-up (the target's cache is
donated and carried from call to call, as in the decode loop), reported in ms, as a multiple of
that limit and as a multiple of one AR decode step at the same context (``x_decode``). With
``prefill_memory_tokens`` it also records the compiled temporaries of a Qwen3-8B float32 prefill
(``memory_analysis()`` on abstract inputs; no weights needed). Writes
``accel_<preset>_<device>.json`` and ``.md``.

CPU presets: ``smollm2_135m`` and ``qwen3_0_6b`` (float32; the XLA attention path: Pallas runs
only in interpret mode off an accelerator, which is a correctness tool, not a timing).
"""

import functools

import jax
import jax.numpy as jnp
from absl import flags, logging
from ml_collections import config_flags

import jetspec_jax as js
from experiments.tasks import bench
from experiments.tasks.bench import median_time, median_time_carried
from jetspec_jax import decoding, methods, rounds, sharding, verify
from jetspec_jax.methods import tree as tree_method
from jetspec_jax.models import decoder
from jetspec_jax.models import draft_head as dh


def copy_bandwidth(num_bytes: int, repeats: int) -> float:
  """Bytes per second of a device copy (read + write counted)."""
  x = jnp.ones((num_bytes // 4,), jnp.float32)
  copy = jax.jit(lambda a: a + 1.0)
  return 2 * x.nbytes / median_time(copy, x, repeats=repeats)


def filled_cache(target, capacity: int, length: int, key):
  """A cache of ``capacity`` slots whose first ``length`` hold random K/V."""
  cache = target.make_cache(1, capacity)
  k = jax.random.normal(key, cache.k[0].shape, cache.dtype)
  # One buffer per layer and per K/V: the timed steps donate (update in place) the cache.
  return cache.replace(
    k=tuple(jnp.array(k, copy=True) for _ in cache.k),
    v=tuple(jnp.array(k, copy=True) for _ in cache.v),
    lengths=jnp.array([length], jnp.int32),
  )


def prefill_memory(num_tokens: int, cfg=None) -> dict:
  """Compiled temporaries of a batch-1 prefill of ``num_tokens`` (float32, abstract weights)."""
  cfg = cfg or decoder.qwen3_8b()
  params = jax.eval_shape(functools.partial(decoder.init_params, cfg), jax.random.key(0))
  target = jax.eval_shape(lambda p: decoder.Target(cfg=cfg, params=p), params)
  prompts = jax.ShapeDtypeStruct((1, num_tokens), jnp.int32)
  lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
  capacity = decoding.bucket(num_tokens + 1)
  fn = jax.jit(lambda t, p, n: rounds.prefill(t, p, n, capacity)[:2])  # cache + logits out
  analysis = fn.lower(target, prompts, lengths).compile().memory_analysis()
  return dict(
    tokens=num_tokens,
    capacity=capacity,
    temp_gib=analysis.temp_size_in_bytes / 2**30,
    output_gib=analysis.output_size_in_bytes / 2**30,
  )


def forced_choices(tree: js.tree.Tree, accept_length: int):
  """Target "choices" that make acceptance follow each node's first child for ``accept_length``
  steps: realistic work per round, independent of the weights (a ``choose=`` for
  :func:`jetspec_jax.methods.tree.speculative_round`; -1 marks "no token")."""
  b, m = tree.tokens.shape
  idx = jnp.broadcast_to(jnp.arange(m, dtype=jnp.int32), (b, m))
  parents = jnp.where(tree.parents >= 0, tree.parents, m)  # the root and padding: no parent
  first_child = jnp.full((b, m + 1), m, jnp.int32).at[jnp.arange(b)[:, None], parents].min(idx)
  first_child = first_child[:, :m]
  child_token = jnp.take_along_axis(tree.tokens, jnp.minimum(first_child, m - 1), axis=1)
  keep = (first_child < m) & (tree.depths < accept_length)
  return jnp.where(keep, child_token, -1)


def run(config, workdir: str) -> dict:
  dtype = jnp.dtype(config.dtype)
  cfg = decoder.PRESETS[config.preset]()
  key = jax.random.key(config.seed)
  params = jax.jit(functools.partial(decoder.init_params, cfg, dtype=dtype))(key)
  target = decoder.Target(cfg=cfg, params=params)
  taps = tuple(t for t in config.taps if t < cfg.num_hidden_layers)
  head_cfg = dh.config_for_target(
    cfg, num_layers=config.head_layers, block_size=config.block_size, target_layer_ids=taps
  )
  head = dh.DraftHead(
    cfg=head_cfg,
    params=jax.jit(functools.partial(dh.init_head_params, head_cfg, dtype=dtype))(key),
  )
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  bandwidth = copy_bandwidth(config.copy_bytes, config.repeats)
  limit_s = param_bytes / bandwidth
  rows = []

  decode_s = {}

  def record(part, seconds, **extra):
    x_decode = seconds / decode_s[extra['context']] if extra.get('context') in decode_s else None
    row = dict(part=part, ms=seconds * 1e3, x_limit=seconds / limit_s, x_decode=x_decode)
    rows.append(dict(row, **extra))
    logging.info('%s', rows[-1])

  budget = config.round_budget
  settings = methods.Tree(budget=budget, width=config.width)

  def forced(tree, logits, key):
    del logits, key
    return forced_choices(tree, config.forced_accept)

  for context in config.contexts:
    capacity = decoding.bucket(context + max(config.nodes) + config.block_size)
    cache = filled_cache(target, capacity, context, key)
    tok = jnp.zeros((1, 1), jnp.int32)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def decode_step(cache, target, tok):
      out = target.forward(tok, cache)
      # Same length every call: each call is the step at this context.
      return jnp.argmax(target.lm_logits(out.hidden[:, -1]), -1), out.cache.replace(
        lengths=cache.lengths
      )

    decode_s[context], cache = median_time_carried(
      decode_step, cache, target, tok, repeats=config.repeats
    )
    record('ar_decode_step', decode_s[context], context=context)
    for impl in config.attn_impls:
      t_impl = target.with_attn_impl(impl)
      for m in config.nodes:
        tree = js.testing.random_tree(config.seed, m, vocab_size=cfg.vocab_size)
        batched = jax.tree.map(lambda x: x[None], tree)
        anc = tree.ancestor_mask()[None]

        @functools.partial(jax.jit, donate_argnums=(0,))
        def verify_step(cache, t, batched, anc):
          verified = verify.verify_tree(t, cache, batched, anc, taps)
          choices = jnp.argmax(verified.logits, -1)
          return choices, verified.cache.replace(lengths=cache.lengths)

        seconds, cache = median_time_carried(
          verify_step, cache, t_impl, batched, anc, repeats=config.repeats
        )
        record('verify', seconds, context=context, nodes=m, attn_impl=impl)
    dcache = head.extend_context(
      head.make_cache(1, capacity),
      jnp.zeros((1, context, len(taps) * cfg.hidden_size), dtype),
      jnp.array([context]),
    )
    pending = jnp.zeros((1, config.block_size, len(taps) * cfg.hidden_size), dtype)

    @jax.jit
    def draft_step(target, head, dcache, pending):
      dc = head.extend_context(dcache, pending, jnp.array([config.forced_accept + 1]))
      return head.propose_cached(target, dc, jnp.zeros((1,), jnp.int32))

    record(
      'draft_head',
      median_time(draft_step, target, head, dcache, pending, repeats=config.repeats),
      context=context,
    )
    draft_logits = draft_step(target, head, dcache, pending)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def tree_accept_commit(cache, draft_logits):
      ids, lps = js.tree.topk_per_depth(draft_logits, config.width)
      tree = jax.vmap(lambda i, lp: js.tree.accum_logp(i, lp, budget))(ids, lps)
      anc = jax.vmap(lambda p: js.tree.ancestor_mask(p, head_cfg.max_depth))(tree.parents)
      accepted = verify.accept(
        tree, anc, forced_choices(tree, config.forced_accept), head_cfg.max_depth
      )
      accepted = accepted._replace(bonus=jnp.maximum(accepted.bonus, 0))
      committed = verify.commit(cache, cache.lengths, accepted)
      return committed.lengths, committed.replace(lengths=cache.lengths)

    seconds, cache = median_time_carried(
      tree_accept_commit, cache, draft_logits, repeats=config.repeats
    )
    record('tree_accept_commit', seconds, context=context, nodes=budget)
    for impl in config.attn_impls:
      t_impl = target.with_attn_impl(impl)

      @jax.jit
      def run_rounds(t, h, cache, dcache, pending):
        state = rounds.RoundState(
          cache=cache,
          draft_cache=dcache,
          pending=pending,
          num_pending=jnp.array([config.forced_accept + 1]),
          anchor=jnp.zeros((1,), jnp.int32),
          key=jax.random.key(0),
        )

        def body(_, state):
          return tree_method.speculative_round(
            t, h, state, rounds.Sampling(), settings, choose=forced
          )[0]

        return jax.lax.fori_loop(0, config.rounds, body, state).cache.lengths

      seconds = (
        median_time(run_rounds, t_impl, head, cache, dcache, pending, repeats=config.repeats)
        / config.rounds
      )
      record(
        'full_round',
        seconds,
        context=context,
        nodes=budget,
        attn_impl=impl,
        tokens_per_round=config.forced_accept + 1,
        tokens_per_s=(config.forced_accept + 1) / seconds,
      )
  memory = [prefill_memory(n) for n in config.get('prefill_memory_tokens', ())]
  for m in memory:
    logging.info('Qwen3-8B prefill %s', m)
  result = dict(
    **bench.envelope(config),
    prefill_memory_qwen3_8b_f32=memory,
    param_bytes=param_bytes,
    copy_bandwidth_gbs=bandwidth / 1e9,
    weight_read_limit_ms=limit_s * 1e3,
    rows=rows,
  )
  bench.write_result(result, workdir, f'accel_{config.preset}_{bench.device_tag()}', table(result))
  print(table(result))
  return result


def _times(x) -> str:
  return '' if x is None else f'{x:.2f}'


def table(result) -> str:
  head = (
    f'{result["device"]}: params {result["param_bytes"] / 1e9:.2f} GB, copy bandwidth '
    f'{result["copy_bandwidth_gbs"]:.0f} GB/s, weight-read limit '
    f'{result["weight_read_limit_ms"]:.3f} ms\n\n'
  )
  lines = [
    '| part | context | nodes | attn | ms | x limit | x decode step |',
    '|---|---|---|---|---|---|---|',
  ]
  lines += [
    f'| {r["part"]} | {r.get("context", "")} | {r.get("nodes", "")} | '
    f'{r.get("attn_impl", "")} | {r["ms"]:.3f} | {r["x_limit"]:.2f} | {_times(r["x_decode"])} |'
    for r in result['rows']
  ]
  memory = result.get('prefill_memory_qwen3_8b_f32') or []
  if memory:
    lines += ['', '| Qwen3-8B prefill (float32) | tokens | cache capacity | temporaries GiB |']
    lines += ['|---|---|---|---|']
    lines += [
      f'| compiled | {m["tokens"]} | {m["capacity"]} | {m["temp_gib"]:.2f} |' for m in memory
    ]
  return head + '\n'.join(lines) + '\n'


def main(argv):
  del argv
  sharding.maybe_initialize_distributed(flags.FLAGS.distributed)
  logging.info('JAX %s on %s', jax.__version__, jax.devices())
  run(flags.FLAGS.config, flags.FLAGS.workdir)


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  config_flags.DEFINE_config_file(
    'config', 'experiments/configs/microbench/accel.py', 'Benchmark config.'
  )
  flags.DEFINE_string('workdir', 'benchmarks', 'Where the JSON and table go.')
  flags.DEFINE_bool('distributed', False, 'Call jax.distributed.initialize() (multi-host).')
