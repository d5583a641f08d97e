"""Copy-seeded heads (``DraftHeadConfig.copy_seed``): the draft slots hold the context's copy
candidates (prompt lookup) as guessed tokens, in training and in drafting alike.

* the seed reads only tokens at or before the anchor (no label leaks into training);
* the training blocks hold the seeds drafting feeds, and the training forward equals the
  drafting path at several anchors;
* decoding with a copy-seeded head stays lossless (tree, chain, with copy branches too);
* the head saves and loads with its seed setting and ``draft_embed``; bad settings fail early;
* a copy-seeded JetSpec++ head takes copy candidates only in the slots its recycled guesses
  leave empty, in its second training blocks and in drafting, and stays lossless.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax as js
from jetspec_jax import prompt_lookup
from jetspec_jax import rounds as rounds_lib
from jetspec_jax.methods import jetspecpp
from jetspec_jax.methods import tree as tree_method
from jetspec_jax.models import draft_head as dh
from jetspec_jax.models import head_io
from jetspec_jax.training import blocks as blocks_lib
from jetspec_jax.training import head_sums
from tests.conftest import VOCAB

TAPS = (0, 1, 2)


def seeded_head(target, causal=True, copy_seed=3, refine=False):
  return dh.random_draft_head(
    target, block_size=5, causal=causal, num_layers=2, target_layer_ids=TAPS, seed=5,
    copy_seed=copy_seed, refine=refine,
  )  # fmt: skip


def repetitive_ids(seed, n):
  """Tokens from 4 ids: suffixes recur, so most anchors have copy candidates."""
  return jnp.asarray(js.testing.random_ids(seed, (n,), 4))


def test_seed_guesses_read_only_the_context_up_to_the_anchor():
  a, b, c, d, x = 1, 2, 3, 4, 9
  history = jnp.array([a, b, c, d, x, b, c, d, 7, 7, 7], jnp.int32)  # anchor at 7
  seeds = prompt_lookup.seed_guesses(history, jnp.int32(7), max_ngram=3, depth=6)
  np.testing.assert_array_equal(seeds, [x, b, c, d, -1, -1])  # 4 tokens follow the match
  tokens = repetitive_ids(1, 40)
  for anchor in (0, 5, 17, 30):
    later = tokens.at[anchor + 1 :].set(repetitive_ids(2, 40)[anchor + 1 :])
    one = prompt_lookup.seed_guesses(tokens, jnp.int32(anchor), max_ngram=3, depth=4)
    two = prompt_lookup.seed_guesses(later, jnp.int32(anchor), max_ngram=3, depth=4)
    np.testing.assert_array_equal(one, two)
  never = jnp.array([5, 6, 7, 8], jnp.int32)  # the last token never occurred before
  np.testing.assert_array_equal(
    prompt_lookup.seed_guesses(never, jnp.int32(3), max_ngram=3, depth=3), [-1, -1, -1]
  )


@pytest.mark.parametrize('causal', [True, False])
def test_training_blocks_hold_the_drafting_seeds_and_forwards_agree(target, causal):
  head = seeded_head(target, causal)
  seq_len = 40
  tokens = repetitive_ids(3, seq_len)
  _, feats = head_sums.target_pass(target, tokens[None], TAPS)
  anchors = jnp.array([6, 19, 33], jnp.int32)
  ones = jnp.ones((seq_len,), jnp.int32)
  clean = blocks_lib.blocks_at(
    anchors, jnp.ones((3,), bool), tokens, ones, jnp.int32(seq_len), 5, head.cfg.mask_token_id
  )
  blk = blocks_lib.copy_seeded_blocks(clean, tokens, head.cfg.copy_seed)
  assert blk.guessed[:, 1:].sum() >= 6 and not blk.guessed[:, 0].any()
  np.testing.assert_array_equal(blk.targets, clean.targets)
  out = head_sums.head_block_outputs(head.params, head.cfg, target, feats[0], blk)
  trained = dh.vocab_logits(target, out[:, 1:])
  unseeded = dh.vocab_logits(
    target, head_sums.head_block_outputs(head.params, head.cfg, target, feats[0], clean)[:, 1:]
  )
  assert float(jnp.abs(trained - unseeded).max()) > 1e-3  # the seeds reach the head
  for k, a in enumerate(np.asarray(anchors)):
    seeds = prompt_lookup.seed_guesses(tokens, a, max_ngram=3, depth=4)
    np.testing.assert_array_equal(blk.tokens[k, 1:], jnp.where(seeds >= 0, seeds, 0))
    cache = head.make_cache(1, seq_len)
    cache = head.extend_context(cache, feats[:, :a], jnp.array([a], jnp.int32))
    drafted = head.propose_cached(target, cache, tokens[a][None], seeds[None])[0]
    np.testing.assert_allclose(np.asarray(trained[k]), np.asarray(drafted), atol=2e-4)


def test_a_round_seeds_the_head_from_the_committed_tokens(target):
  head = seeded_head(target)
  prompt = jnp.concatenate([jnp.arange(VOCAB, dtype=jnp.int32), repetitive_ids(4, 21 - VOCAB)])
  sampling = rounds_lib.Sampling()
  state = rounds_lib.start_rounds(
    target, head, prompt[None], jnp.array([21]), jax.random.key(0), capacity=64,
    sampling=sampling,
  )  # fmt: skip
  assert state.history is not None  # kept for the head, with no copy branch asked for
  method = js.methods.Tree(budget=8, width=2)
  drafted = method.draft(target, head, state)
  context = jnp.concatenate([prompt, state.anchor])
  seeds = prompt_lookup.seed_guesses(context, jnp.int32(21), max_ngram=3, depth=4)
  assert (seeds >= 0).any()  # every id is in the prompt: the anchor has a match
  cache = head.extend_context(state.draft_cache, state.pending, state.num_pending)
  want = head.propose_cached(target, cache, state.anchor, seeds[None])
  np.testing.assert_allclose(np.asarray(drafted), np.asarray(want), atol=1e-5)


@pytest.mark.parametrize(
  'method',
  [
    js.methods.Tree(budget=12, width=3),
    js.methods.Chain(),
    js.methods.Tree(budget=12, width=3, copy_len=3),
  ],
  ids=['tree', 'chain', 'tree_copy'],
)
def test_copy_seeded_head_is_lossless(target, prompts, ar_outputs, method):
  head = seeded_head(target)
  for prompt, want in zip(prompts, ar_outputs):
    out = js.generate(target, head, prompt, max_new_tokens=30, method=method)
    np.testing.assert_array_equal(out.tokens, want)


def test_copy_seed_round_trips_and_bad_settings_fail(target, tmp_path):
  head = seeded_head(target, copy_seed=4)
  head_io.save_draft_head(head, tmp_path / 'h')
  loaded = head_io.load_draft_head(tmp_path / 'h', target)
  assert loaded.cfg == head.cfg and loaded.cfg.copy_seed == 4
  np.testing.assert_array_equal(loaded.params['draft_embed'], head.params['draft_embed'])
  assert dh.config_for_target(target.cfg, refine=True, copy_seed=3).kind == 'jetspecpp'
  with pytest.raises(ValueError, match='copy_seed'):
    dh.config_for_target(target.cfg, causal=False, markov_rank=4, copy_seed=3)
  with pytest.raises(ValueError, match='copy_seed'):
    dh.config_for_target(target.cfg, copy_seed=-1)
  plain = dh.random_draft_head(target, block_size=5, target_layer_ids=TAPS)
  with pytest.raises(ValueError, match='guessed'):
    dh.embed_block(plain.cfg, plain.params, target.embed, jnp.zeros((5,), int), jnp.ones(5, bool))


def test_jetspecpp_second_blocks_take_copy_seeds_only_where_they_have_no_guess(target):
  tokens = repetitive_ids(6, 40)
  ones = jnp.ones((40,), jnp.int32)
  clean = blocks_lib.blocks_at(
    jnp.array([4, 12, 20, 28], jnp.int32), jnp.ones((4,), bool), tokens, ones, jnp.int32(40),
    5, 0,
  )  # fmt: skip
  guesses = jnp.where(jnp.arange(4)[None] < 2, clean.targets[:, 1:], 3)  # 2 right, then wrong
  second = blocks_lib.refine_blocks(clean, guesses, tokens, ones, jnp.int32(40), 0)
  seeded = blocks_lib.copy_seeded_blocks(second, tokens, 3)
  assert second.guessed[:, 1:].any() and not second.guessed[:, 1:].all()
  kept = second.guessed
  np.testing.assert_array_equal(seeded.tokens[kept], second.tokens[kept])  # guesses stay
  for k, a in enumerate(np.asarray(second.anchors)):
    seeds = prompt_lookup.seed_guesses(tokens, jnp.int32(a), max_ngram=3, depth=4)
    empty = ~np.asarray(kept[k, 1:])
    want = np.where(seeds >= 0, seeds, 0)  # MASK is id 0 here
    np.testing.assert_array_equal(np.asarray(seeded.tokens[k, 1:])[empty], want[empty])
    np.testing.assert_array_equal(
      np.asarray(seeded.guessed[k, 1:]), np.asarray(kept[k, 1:]) | (seeds >= 0)
    )


def test_a_copy_seeded_jetspecpp_round_fills_the_empty_slots(target):
  head = seeded_head(target, refine=True)
  prompt = jnp.concatenate([jnp.arange(VOCAB, dtype=jnp.int32), repetitive_ids(7, 21 - VOCAB)])
  sampling = rounds_lib.Sampling()
  method = js.methods.JetSpecPP(budget=8, width=2)
  state = rounds_lib.start_rounds(
    target, head, prompt[None], jnp.array([21]), jax.random.key(0), capacity=64,
    sampling=sampling,
  )  # fmt: skip
  state = method.init_state(head, state)
  state, _ = method(target, head, state, sampling)  # now the state holds recycled guesses
  realigned = jetspecpp.realign(state.guesses, state.num_pending)
  seeds = tree_method.copy_seed_guesses(head, state)
  assert (realigned == jetspecpp.NO_GUESS).any() and (seeds >= 0).any()
  fed = jnp.where(realigned == jetspecpp.NO_GUESS, seeds, realigned)
  cache = head.extend_context(state.draft_cache, state.pending, state.num_pending)
  want = head.propose_cached(target, cache, state.anchor, fed)
  np.testing.assert_allclose(
    np.asarray(method.draft(target, head, state)), np.asarray(want), atol=1e-5
  )


@pytest.mark.parametrize('recycle', [True, False])
def test_copy_seeded_jetspecpp_head_is_lossless(target, prompts, ar_outputs, recycle):
  head = seeded_head(target, refine=True)
  method = js.methods.JetSpecPP(budget=10, width=3, recycle=recycle)
  for prompt, want in zip(prompts, ar_outputs):
    out = js.generate(target, head, prompt, max_new_tokens=30, method=method)
    np.testing.assert_array_equal(out.tokens, want)


def test_a_copy_seeded_jetspecpp_head_trains(target):
  head = seeded_head(target, refine=True)
  tokens = repetitive_ids(8, 40)[None]
  batch = dict(
    tokens=tokens,
    loss_mask=jnp.ones_like(tokens),
    lengths=jnp.array([40], jnp.int32),
    index=jnp.array([0], jnp.int32),
  )
  settings = head_sums.StepSettings(num_anchors=8)
  sums = head_sums.batch_sums(head.params, head.cfg, target, batch, jax.random.key(1), settings)
  assert np.isfinite(float(sums.loss)) and float(sums.weight) > 0
