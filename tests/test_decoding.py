"""The lossless invariants of speculative decoding (docs/design.md §5), and generate's errors."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax as js
from jetspec_jax import decoding, rounds, verify
from tests.conftest import VOCAB


@pytest.fixture(scope='module')
def heads(target):
  return {
    'causal': js.testing.random_draft_head(target, block_size=6, seed=1),
    'bidirectional': js.testing.random_draft_head(target, block_size=6, causal=False, seed=2),
    # Drafting in mixed precision changes draft scores only, never the output.
    'causal_bf16': js.testing.random_draft_head(target, block_size=6, seed=1).with_compute_dtype(
      'bfloat16'
    ),
  }


CASES = [
  (js.methods.Chain(), 'causal'),
  (js.methods.Chain(), 'bidirectional'),
  (js.methods.Tree(budget=1, width=7), 'causal'),
  (js.methods.Tree(budget=2, width=1), 'causal'),
  (js.methods.Tree(budget=16, width=3), 'causal'),
  (js.methods.Tree(budget=64, width=7), 'bidirectional'),
  (js.methods.Tree(budget=255, width=7), 'causal'),
  (js.methods.Tree(budget=40, width=5, algorithm='top2gap'), 'causal'),
  (js.methods.Tree(budget=16, width=4, algorithm='best_first', copy_len=3), 'causal'),
  (js.methods.Tree(budget=12, width=3, algorithm='best_first'), 'causal_bf16'),
]


@pytest.mark.parametrize('method, head_kind', CASES)
def test_greedy_speculative_equals_autoregressive(
  target, heads, prompts, ar_outputs, method, head_kind
):
  """Greedy chain/tree output == greedy AR output, token for token, in float32.

  This holds for any draft head (random ones here), budget and width: acceptance only commits
  tokens equal to the target's own argmax given the committed prefix.
  """
  accepted_drafts = 0
  for prompt, want in zip(prompts, ar_outputs):
    out = js.generate(target, heads[head_kind], prompt, max_new_tokens=30, method=method)
    np.testing.assert_array_equal(out.tokens, want)
    assert out.stats.rounds == len(out.stats.tau)
    assert out.stats.tau.sum() >= len(want) - 1  # every token after the first is committed
    assert out.stats.tau.max() <= heads[head_kind].cfg.block_size
    accepted_drafts += int((out.stats.tau - 1).sum())
  if getattr(method, 'budget', 6) > 2:
    assert accepted_drafts > 0, 'no draft was ever accepted: the commit path went untested'


def test_depth_bonus_shapes_the_tree_only(target, heads, prompts, ar_outputs):
  """``Tree.depth_bonus`` favours depth: a bonus larger than any log-probability gap turns a
  best-first tree of ``block_size`` nodes into the head's top-1 chain (the same rounds as
  ``Chain``, so the bonus reaches the builder); a moderate one stays lossless."""
  head = heads['causal']
  deep = js.methods.Tree(budget=6, width=3, algorithm='best_first', depth_bonus=100.0)
  plain = js.methods.Tree(budget=6, width=3, algorithm='best_first')
  moderate = js.methods.Tree(budget=12, width=3, algorithm='best_first', depth_bonus=0.7)
  differs = False  # without the bonus, some tree of 6 nodes is not the chain
  for prompt, want in zip(prompts, ar_outputs):
    run = functools.partial(js.generate, target, head, prompt, max_new_tokens=30)
    got, chain, without = run(method=deep), run(method=js.methods.Chain()), run(method=plain)
    np.testing.assert_array_equal(got.tokens, want)
    np.testing.assert_array_equal(got.stats.tau, chain.stats.tau)
    differs |= not np.array_equal(without.stats.tau, chain.stats.tau)
    np.testing.assert_array_equal(run(method=moderate).tokens, want)
  assert differs, 'best-first trees were chains anyway: the bonus went untested'


def test_moe_target_lossless():
  target = js.testing.tiny_target(2, moe=True, vocab_size=VOCAB)
  head = js.testing.random_draft_head(target, block_size=5, seed=3)
  prompt = js.testing.random_ids(1, (9,), VOCAB)
  want = js.generate(target, None, prompt, max_new_tokens=25, method=js.methods.AR()).tokens
  out = js.generate(
    target, head, prompt, max_new_tokens=25, method=js.methods.Tree(budget=32, width=4)
  )
  np.testing.assert_array_equal(out.tokens, want)
  assert out.stats.mean_tau > 1.0


@pytest.mark.parametrize('method', [js.methods.Chain(), js.methods.Tree(budget=32, width=4)])
def test_eos_stops_like_autoregressive(target, heads, prompts, ar_outputs, method):
  """With an EOS id, output ends at the first EOS exactly where AR's does."""
  prompt, free = prompts[1], ar_outputs[1]
  eos = int(free[7])
  want = free[: int(np.flatnonzero(free == eos)[0]) + 1]
  ar = js.generate(target, None, prompt, max_new_tokens=30, method=js.methods.AR(), eos_id=eos)
  np.testing.assert_array_equal(ar.tokens, want)
  out = js.generate(
    target,
    heads['causal'],
    prompt,
    max_new_tokens=30,
    method=method,
    eos_id=eos,
  )
  np.testing.assert_array_equal(out.tokens, want)


def test_rounds_run_without_host_transfers(target, heads, monkeypatch):
  """A whole generation (many rounds) is one device program with no host interaction inside.

  ``jax.transfer_guard`` cannot see callbacks compiled into a program, so the compiled program
  itself is inspected; planting a ``jax.debug.callback`` in the round shows the check sees one.
  """
  head = heads['causal']
  prompt, plen, capacity = decoding._prepare_prompt(target, np.arange(1, 8), 40, extra=40)  # [1]

  def compiled(max_new_tokens):
    loop = functools.partial(
      rounds.speculative_loop,
      capacity=capacity,
      max_new_tokens=max_new_tokens,
      sampling=rounds.Sampling(),
      round_fn=js.methods.Tree(budget=16, width=3),
    )
    return jax.jit(loop).lower(target, head, prompt, plen, jax.random.key(0)).compile()

  assert js.testing.host_transfer_ops(compiled(40)) == []
  out = rounds.speculative_loop(
    target,
    head,
    prompt,
    plen,
    jax.random.key(0),
    capacity=capacity,
    max_new_tokens=40,
    sampling=rounds.Sampling(),
    round_fn=js.methods.Tree(budget=16, width=3),
  )
  assert int(out[3][0]) > 3  # many rounds ran inside that one program

  original = js.methods.tree.speculative_round

  def chatty_round(*args, **kwargs):
    state, out = original(*args, **kwargs)
    jax.debug.callback(lambda t: None, out.tau)
    return state, out

  monkeypatch.setattr(js.methods.tree, 'speculative_round', chatty_round)
  assert js.testing.host_transfer_ops(compiled(41))  # a new shape: traced with the mutation


def exact_distribution(target, prompt, length, temperature, top_k, top_p):
  """P(x_1..x_length | prompt) for every sequence, by enumeration over a tiny vocabulary."""
  v = target.cfg.vocab_size
  probs = np.ones((1,))
  seqs = np.zeros((1, 0), np.int32)
  for _ in range(length):
    ids = np.concatenate([np.repeat(prompt[None], len(seqs), 0), seqs], axis=1)
    logits = target.forward_logits(ids)[:, -1]
    step = np.asarray(jax.nn.softmax(verify.process_logits(logits, temperature, top_k, top_p)))
    probs = (probs[:, None] * step).reshape(-1)
    seqs = np.concatenate([np.repeat(seqs, v, 0), np.tile(np.arange(v), len(seqs))[:, None]], 1)
  return probs  # indexed by the sequence in base-v


@pytest.mark.parametrize(
  'temperature, top_k, top_p, algorithm', [(1.0, 0, 1.0, 'accum_logp'), (0.8, 4, 0.9, 'best_first')]
)
def test_sampled_tree_matches_target_distribution(temperature, top_k, top_p, algorithm):
  """At T > 0, sample-and-match gives exactly the target's distribution over sequences, for
  trees of either shape (all candidates of a depth at once, or node by node).

  Chi-square over the first 3 generated tokens on a 5-token vocabulary (125 cells, cells with
  expected count < 5 pooled), 12k samples: the statistic must stay below dof + 6 sqrt(2 dof)
  (a false alarm has probability < 1e-6). Accepting drafts by any rule other than an exact
  sample (e.g. the target's argmax) moves the statistic far above that.
  """
  target = js.testing.tiny_target(5, vocab_size=5)
  target = target.replace(params=jax.tree.map(lambda p: p * 1.5, target.params))
  head = js.testing.random_draft_head(target, block_size=4, seed=6)
  prompt_np = np.array([1, 3, 0, 2])
  sampling = rounds.Sampling(temperature, top_k, top_p)
  prompt, plen, capacity = decoding._prepare_prompt(target, prompt_np, 3, extra=32)
  loop = functools.partial(
    rounds.speculative_loop,
    capacity=capacity,
    max_new_tokens=3,
    sampling=sampling,
    round_fn=js.methods.Tree(budget=12, width=3, algorithm=algorithm),
  )
  draw = jax.jit(jax.vmap(lambda k: loop(target, head, prompt, plen, k)[:2]))
  counts = np.zeros(125)
  for chunk in range(6):
    keys = jax.random.split(jax.random.key(chunk), 2000)
    tokens, _ = jax.device_get(draw(keys))
    tokens = tokens[:, 0]  # the batch of one
    codes = tokens[:, 0] * 25 + tokens[:, 1] * 5 + tokens[:, 2]
    counts += np.bincount(codes, minlength=125)
  assert_chi_square(counts, exact_distribution(target, prompt_np, 3, temperature, top_k, top_p))


def assert_chi_square(counts, probs):
  """Pearson's test of ``counts`` against ``probs`` (cells with expected count < 5 pooled); the
  bound dof + 6 sqrt(2 dof) gives a false alarm with probability < 1e-6."""
  expected = probs * counts.sum()
  small = expected < 5
  obs = np.append(counts[~small], counts[small].sum())
  exp = np.append(expected[~small], expected[small].sum())
  keep = exp > 0
  assert obs[~keep].sum() == 0, 'sampled a sequence the target gives probability 0'
  stat = (((obs - exp) ** 2)[keep] / exp[keep]).sum()
  dof = keep.sum() - 1
  print(f'chi-square {stat:.1f} with {dof} dof (bound {dof + 6 * np.sqrt(2 * dof):.1f})')
  assert stat < dof + 6 * np.sqrt(2 * dof), (stat, dof)


def test_sampled_tree_over_several_rounds_and_two_rows():
  """Several rounds (block 2: at most 2 tokens a round, so 4 tokens need >= 2 rounds after the
  prefill's), two rows of different prompt lengths in one batch: each row's 4-token sequence
  follows the target's distribution (fresh keys every round, KV commits and draft-cache growth
  under sampling), and the rows are independent (their first tokens' joint = product)."""
  target = js.testing.tiny_target(5, vocab_size=5)
  target = target.replace(params=jax.tree.map(lambda p: p * 1.5, target.params))
  head = js.testing.random_draft_head(target, block_size=2, seed=6)
  rows = [np.array([1, 3, 0, 2]), np.array([4, 1])]
  prompts, lengths, capacity = decoding._prepare_prompts(target, rows, 4, extra=16)
  loop = functools.partial(
    rounds.speculative_loop,
    capacity=capacity,
    max_new_tokens=4,
    sampling=rounds.Sampling(1.0),
    round_fn=js.methods.Tree(budget=4, width=2),
  )
  draw = jax.jit(jax.vmap(lambda k: loop(target, head, prompts, lengths, k)))
  counts = np.zeros((2, 625))
  joint = np.zeros(25)
  min_rounds = 0
  for chunk in range(6):
    keys = jax.random.split(jax.random.key(chunk), 2000)
    tokens, _, _, num_rounds, _ = jax.device_get(draw(keys))
    min_rounds = max(min_rounds, int(num_rounds.min()))
    for r in range(2):
      codes = tokens[:, r, :4] @ np.array([125, 25, 5, 1])
      counts[r] += np.bincount(codes, minlength=625)
    joint += np.bincount(tokens[:, 0, 0] * 5 + tokens[:, 1, 0], minlength=25)
  assert min_rounds >= 2
  for r, prompt in enumerate(rows):
    assert_chi_square(counts[r], exact_distribution(target, prompt, 4, 1.0, 0, 1.0))
  first = [exact_distribution(target, prompt, 1, 1.0, 0, 1.0) for prompt in rows]
  assert_chi_square(joint, np.outer(first[0], first[1]).reshape(-1))


def test_process_logits_filters():
  logits = jnp.log(jnp.array([0.5, 0.25, 0.15, 0.1]))
  kept = np.isfinite(np.asarray(verify.process_logits(logits, 1.0, top_k=2)))
  assert kept.tolist() == [True, True, False, False]
  kept = np.isfinite(np.asarray(verify.process_logits(logits, 1.0, top_p=0.7)))
  assert kept.tolist() == [True, True, False, False]  # 0.5 < 0.7, 0.5 + 0.25 >= 0.7
  kept = np.isfinite(np.asarray(verify.process_logits(logits, 1.0, top_p=0.4)))
  assert kept.tolist() == [True, False, False, False]


def test_bad_arguments(target, heads):
  head = heads['causal']
  prompt = [1, 2, 3]
  with pytest.raises(ValueError, match='budget=0 must be >= 1'):
    js.methods.Tree(budget=0)
  with pytest.raises(ValueError, match='width=18 must be in'):
    js.generate(target, head, prompt, method=js.methods.Tree(width=18))
  with pytest.raises(ValueError, match=r'Tree\(budget=8, .*\) needs a draft head'):
    js.generate(target, None, prompt)
  with pytest.raises(TypeError, match='method must be a method value'):
    js.generate(target, head, prompt, method='tree')
  with pytest.raises(ValueError, match='cannot run a jetspec head'):
    js.generate(target, head, prompt, method=js.methods.DSpark())
  with pytest.raises(ValueError, match='exceeds the model context'):
    js.generate(target, head, np.ones(500, np.int32), max_new_tokens=8)
  other = js.testing.tiny_target(0, vocab_size=19)
  with pytest.raises(ValueError, match='vocab_size 17 != target vocab_size 19'):
    js.generate(other, head, prompt)
  with pytest.raises(ValueError, match='top_p'):
    js.generate(target, head, prompt, temperature=1.0, top_p=0.0)
  with pytest.raises(ValueError, match='algorithm'):
    js.methods.Tree(algorithm='beam')
  for method in (js.methods.AR(), js.methods.Tree()):
    for bad in (float('nan'), float('inf'), -1.0):
      with pytest.raises(ValueError, match='must be finite and >= 0'):
        js.generate(target, head, prompt, method=method, temperature=bad)
    for bad in (float('nan'), float('inf'), 1.5):
      with pytest.raises(ValueError, match='top_p'):
        js.generate(target, head, prompt, method=method, temperature=1.0, top_p=bad)
    for bad in (17, -1, (3, 40)):
      with pytest.raises(ValueError, match=r'stop ids .* must be in \[0, vocab_size=17\)'):
        js.generate(target, head, prompt, method=method, eos_id=bad)
    with pytest.raises(ValueError, match='min_capacity=32 is below what this call needs'):
      js.generate(target, head, prompt, method=method, max_new_tokens=30, min_capacity=32)
    with pytest.raises(ValueError, match='min_prompt_bucket=2 is shorter than the longest'):
      js.generate(target, head, prompt, method=method, min_prompt_bucket=2)
  with pytest.raises(ValueError, match='stop ids'):
    js.decoding.generate_with_features(target, [prompt], max_new_tokens=4, eos_id=99)
  with pytest.raises(ValueError, match='temperature'):
    js.decoding.generate_with_features(target, [prompt], max_new_tokens=4, temperature=np.nan)


def test_trace_first_round_matches_generate(target, heads):
  head = heads['causal']
  prompt = js.testing.random_ids(3, (9,), VOCAB)
  trace = decoding.trace_first_round(target, head, prompt, method=js.methods.Tree(16, 3))
  out = js.generate(
    target, head, prompt, max_new_tokens=20, method=js.methods.Tree(budget=16, width=3)
  )
  committed = [int(trace.tree.tokens[i]) for i in trace.path[1:]] + [trace.bonus]
  assert out.stats.tau[0] == len(committed)
  np.testing.assert_array_equal(out.tokens[1 : 1 + len(committed)], committed)
  assert int(trace.tree.tokens[0]) == out.tokens[0]  # the anchor is the prefill's token


@pytest.mark.parametrize('length', [0, 2, 4])
def test_forced_acceptance_accepts_exactly(target, heads, length):
  """The benchmark's chooser: forced choices accept exactly ``length`` nodes (tree deep
  enough)."""
  from experiments.tasks.round_costs import forced_choices

  ids = jnp.asarray(np.arange(15).reshape(5, 3) % VOCAB, jnp.int32)
  lps = jnp.tile(jnp.array([[-0.01, -5.0, -6.0]]), (5, 1))  # a deep rank-0 chain
  tree = jax.tree.map(lambda x: x[None], js.tree.accum_logp(ids, lps, 24, anchor=3))
  anc = js.tree.ancestor_mask(tree.parents[0], 5)[None]
  accepted = verify.accept(tree, anc, forced_choices(tree, length), 5)
  assert int(accepted.num_accepted[0]) == length
  path = np.asarray(accepted.path[0, : length + 1])
  assert (np.asarray(tree.depths[0])[path] == np.arange(length + 1)).all()


def test_round_takes_a_chooser(target, heads):
  """``choose=`` replaces the target's choices inside the one round (the benchmark's forced
  acceptance); the default chooser commits what ``generate`` commits."""
  from experiments.tasks.round_costs import forced_choices

  head = heads['causal']
  prompt, plen, capacity = decoding._prepare_prompt(target, np.arange(1, 8), 8, extra=40)
  greedy = rounds.Sampling()
  state = rounds.start_rounds(
    target, head, prompt, plen, jax.random.key(0), capacity=capacity, sampling=greedy
  )
  settings = js.methods.Tree(budget=24, width=1)  # a chain: deep enough for 3

  def forced(tree, logits, key):
    return forced_choices(tree, 3)

  _, out = js.methods.tree.speculative_round(target, head, state, greedy, settings, choose=forced)
  assert int(out.tau[0]) == 4
  _, out = js.methods.tree.speculative_round(target, head, state, greedy, settings)
  want = js.generate(
    target, head, np.arange(1, 8), max_new_tokens=8, method=js.methods.Tree(budget=24, width=1)
  )
  tau = int(out.tau[0])
  assert tau == want.stats.tau[0]
  np.testing.assert_array_equal(np.asarray(out.committed[0, :tau]), want.tokens[1 : 1 + tau])


@pytest.mark.parametrize(
  'method', [js.methods.AR(), js.methods.Chain(), js.methods.Tree(budget=24, width=4)]
)
def test_batched_generation_equals_each_sequence_alone(target, heads, method):
  """B > 1 with mixed prompt lengths and an early EOS: each row == its own ar output."""
  prompts = [js.testing.random_ids(40 + i, (n,), VOCAB) for i, n in enumerate((3, 17, 8, 1))]
  alone = [
    js.generate(target, None, p, max_new_tokens=20, method=js.methods.AR()).tokens for p in prompts
  ]
  eos = int(alone[2][4])  # ends sequence 2 early (and any other that produces it)
  want = [
    js.generate(target, None, p, max_new_tokens=20, method=js.methods.AR(), eos_id=eos).tokens
    for p in prompts
  ]
  assert len(want[2]) <= 5
  is_ar = isinstance(method, js.methods.AR)
  head = None if is_ar else heads['causal']
  outs = js.generate(target, head, prompts, max_new_tokens=20, method=method, eos_id=eos)
  assert isinstance(outs, list) and len(outs) == 4
  for out, w in zip(outs, want):
    np.testing.assert_array_equal(out.tokens, w)
    if not is_ar:
      assert out.stats.tau.sum() >= len(w) - 1 and out.stats.rounds == len(out.stats.tau)


@pytest.mark.parametrize('attn_impl', ['xla', 'pallas'])
def test_chunked_prefill_equals_one_pass(target, attn_impl):
  """A long prompt run 16 tokens at a time gives the one-pass cache, logits and taps."""
  t = target.with_attn_impl(attn_impl)
  prompts, lengths, capacity = decoding._prepare_prompts(
    t, [js.testing.random_ids(i, (n,), t.cfg.vocab_size) for i, n in enumerate((64, 37, 5))], 8
  )
  assert prompts.shape[1] == 64
  run = jax.jit(rounds.prefill, static_argnames=('capacity', 'taps', 'chunk'))
  whole = run(t, prompts, lengths, capacity=capacity, taps=(0, 2), chunk=2048)
  chunked = run(t, prompts, lengths, capacity=capacity, taps=(0, 2), chunk=16)
  np.testing.assert_array_equal(np.asarray(chunked[0].lengths), [64, 37, 5])
  close = functools.partial(np.testing.assert_allclose, atol=2e-5, rtol=1e-5)
  close(np.asarray(chunked[1]), np.asarray(whole[1]))  # last-token logits
  for b, n in enumerate((64, 37, 5)):  # what real tokens wrote and tapped (padding rows differ)
    close(np.asarray(chunked[2][b, :n]), np.asarray(whole[2][b, :n]))
    for got, want in zip(chunked[0].k + chunked[0].v, whole[0].k + whole[0].v):
      close(np.asarray(got[b, :n]), np.asarray(want[b, :n]))


def test_lossless_with_a_large_cache_and_tiled_attention(target, heads, prompts, ar_outputs):
  """At a 512-slot capacity the target and the head read only their live key tiles (256-slot
  tiles): outputs are unchanged."""
  for prompt, want in zip(prompts[:2], ar_outputs[:2]):
    out = js.generate(
      target,
      heads['causal'],
      prompt,
      max_new_tokens=30,
      method=js.methods.Tree(budget=16, width=3),
      min_capacity=512,
    )
    np.testing.assert_array_equal(out.tokens, want)


def test_a_new_method_plugs_in_without_touching_the_library(target, heads, prompts, ar_outputs):
  """A method defined outside the package (a chain of half the block) registers by its name,
  builds from a config and runs through generate, losslessly."""

  @dataclasses.dataclass(frozen=True)
  class HalfChain(js.methods.Method):
    name = 'half_chain_test'
    head_kinds = ('jetspec',)

    def make_round(self, target, head):
      tree = js.methods.Tree(budget=head.cfg.block_size // 2, width=1)
      return tree.make_round(target, head)

  try:
    method = js.methods.from_config({'name': 'half_chain_test'})
    assert isinstance(method, HalfChain)
    out = js.generate(target, heads['causal'], prompts[0], max_new_tokens=30, method=method)
    np.testing.assert_array_equal(out.tokens, ar_outputs[0])
    assert out.stats.tau.max() <= heads['causal'].cfg.block_size // 2
    with pytest.raises(ValueError, match='cannot run a dflash head'):
      js.generate(target, heads['bidirectional'], prompts[0], method=method)
  finally:
    del js.methods.REGISTRY['half_chain_test']


def test_trace_first_round_defaults_chain_and_copy_prior(target, heads):
  """``method=None`` traces the default small tree; a Chain traces its tree of width 1; a
  copy_prior tree (which reads the committed history) traces and commits what generate does."""
  head = heads['causal']
  prompt = np.tile(js.testing.random_ids(4, (5,), VOCAB), 3)
  assert decoding.trace_first_round(target, head, prompt).tree.size == 32
  for method in (js.methods.Chain(), js.methods.Tree(budget=12, width=3, copy_prior=(0.5, 0.9))):
    trace = decoding.trace_first_round(target, head, prompt, method=method)
    out = js.generate(target, head, prompt, max_new_tokens=12, method=method)
    committed = [int(trace.tree.tokens[i]) for i in trace.path[1:]] + [trace.bonus]
    assert out.stats.tau[0] == len(committed)
    np.testing.assert_array_equal(out.tokens[1 : 1 + len(committed)], committed)
  with pytest.raises(ValueError, match='Tree or Chain'):
    decoding.trace_first_round(target, head, prompt, method=js.methods.AR())


def test_many_settings_keep_a_bounded_number_of_programs(
  target, heads, prompts, ar_outputs, monkeypatch
):
  """A process that decodes with many settings holds at most MAX_LIVE_PROGRAMS compiled loops
  (the kernel's memory-map limit otherwise ends it); outputs stay exact across clears."""
  monkeypatch.setattr(rounds, 'MAX_LIVE_PROGRAMS', 3)
  rounds.speculative_loop.clear_cache()
  for budget in range(2, 10):
    out = js.generate(
      target, heads['causal'], prompts[0], max_new_tokens=12, method=js.methods.Tree(budget, 2)
    )
    np.testing.assert_array_equal(out.tokens, ar_outputs[0][:12])
    assert rounds.speculative_loop._cache_size() <= 3


def test_a_planted_near_tie_is_the_only_place_output_may_leave_ar(target, heads, prompts):
  """Greedy equality holds up to float near-ties (docs/design.md §5): a verify and a decode step
  sum in different orders, so where the target's top two logits are closer than that rounding,
  either may win. Two tokens are made to tie within ~1e-7 everywhere (the LM head's column of
  one is the other's plus a tiny perturbation); speculative decoding may then leave AR, but only
  at a position where AR's top-2 gap is such a tie, and never before."""
  prompt = prompts[1]
  ar = js.generate(target, None, prompt, max_new_tokens=30, method=js.methods.AR()).tokens
  logits = np.asarray(target.forward_logits(np.concatenate([prompt, ar[:5]])[None])[0, -1])
  a, b = np.argsort(logits)[::-1][:2]
  kernel = target.params['lm_head']['kernel']
  noise = np.random.default_rng(0).normal(size=kernel.shape[0]).astype(np.float32)
  kernel = kernel.at[:, b].set(kernel[:, a] + 1e-7 * noise / np.linalg.norm(noise))
  params = dict(target.params, lm_head={'kernel': kernel})
  tied = target.replace(params=params)
  ar = js.generate(tied, None, prompt, max_new_tokens=30, method=js.methods.AR()).tokens
  seq = np.concatenate([prompt, ar])
  full = np.asarray(tied.forward_logits(seq[None])[0, len(prompt) - 1 : -1])
  top2 = np.sort(full, axis=-1)[:, -2:]
  gap = top2[:, 1] - top2[:, 0]
  assert np.min(gap) < 1e-5  # the planted tie is met along the output
  left = 0
  for method in (js.methods.Chain(), js.methods.Tree(16, 3), js.methods.Tree(64, 7)):
    for head in (heads['causal'], heads['bidirectional']):
      out = js.generate(tied, head, prompt, max_new_tokens=30, method=method).tokens
      differ = np.flatnonzero(out != ar)
      if differ.size:
        left += 1
        assert gap[differ[0]] < 1e-5, (method, differ[0], gap[differ[0]])
  print(f'{left} of 6 settings left AR at the planted tie')
