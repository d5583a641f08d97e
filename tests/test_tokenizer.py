"""``js.load_tokenizer``: the packaged SmolLM2 GGUF's tokenizer against transformers' own reading
of the same file, GGUF pre-tokenizer types (tiny files written by the tests), an HF directory,
stop ids, bad paths, and a transformers-saved directory with chat_template.jinja."""

import json

import numpy as np
import pytest
import tokenizers
from tokenizers import pre_tokenizers

import jetspec_jax as js
from jetspec_jax.training import chat_prompts

TEXTS = (
  'Hello world!',
  'def add(a, b):\n    return a + b  # 12345 and 3.14',
  '  leading spaces\n\n\ttabs and trailing   ',
  'unicode: café, naïve, 日本語, emoji 🙂',
  "It's 2024; we've seen 100's of them.",
  '<|im_start|>user\nhi<|im_end|>\n',
)
MESSAGES = (
  [{'role': 'user', 'content': 'Write a function that adds two numbers.'}],
  [
    {'role': 'system', 'content': 'You are terse.'},
    {'role': 'user', 'content': 'What is 2 + 2?'},
    {'role': 'assistant', 'content': '4.'},
    {'role': 'user', 'content': 'And 3 + 3?'},
  ],
)


@pytest.fixture(scope='module')
def smollm2_path():
  try:
    return js.model_cache.smollm2_135m_instruct_path()
  except FileNotFoundError as e:
    pytest.skip(str(e))


@pytest.fixture(scope='module')
def tok(smollm2_path):
  return js.load_tokenizer(smollm2_path)


@pytest.fixture(scope='module')
def hf_tok(smollm2_path):
  transformers = pytest.importorskip('transformers')
  return transformers.AutoTokenizer.from_pretrained(
    str(smollm2_path.parent), gguf_file=smollm2_path.name
  )


def test_encode_decode_match_transformers(tok, hf_tok):
  for text in TEXTS:
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False), text
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids(tok):
  ids = tok.encode('<|im_start|>assistant\n')
  assert ids[0] == tok.token_to_id('<|im_start|>') == 1
  assert tok.eos_ids == {0, 2}  # <|endoftext|> and <|im_end|> (the GGUF's EOS)
  assert tok.decode(tok.encode('<|im_end|>'), skip_special_tokens=True) == ''


def test_chat_template_matches_transformers(tok, hf_tok):
  for messages in MESSAGES:
    for add_prompt in (True, False):
      want = hf_tok.apply_chat_template(messages, add_generation_prompt=add_prompt, tokenize=False)
      assert tok.render_chat(messages, add_prompt) == want
      want_ids = hf_tok.encode(want, add_special_tokens=False)
      assert tok.apply_chat_template(messages, add_prompt) == want_ids


def test_hf_directory_round_trip_and_generation_config_stops(tok, tmp_path):
  tok.save(tmp_path)
  (tmp_path / 'generation_config.json').write_text(json.dumps({'eos_token_id': [2, 7]}))
  again = js.load_tokenizer(tmp_path)
  assert again.eos_ids == {0, 2, 7}
  assert again.chat_template == tok.chat_template
  for text in TEXTS:
    assert again.encode(text) == tok.encode(text)
  assert again.apply_chat_template(MESSAGES[1]) == tok.apply_chat_template(MESSAGES[1])


def test_generate_accepts_a_collection_of_stop_ids():
  target = js.testing.tiny_target(3)
  prompt = js.testing.random_ids(0, (5,), target.cfg.vocab_size)
  free = js.generate(target, None, prompt, max_new_tokens=24, method=js.methods.AR(), eos_id=())
  a, b = int(free.tokens[5]), int(free.tokens[9])
  first_stop = min(i for i, t in enumerate(free.tokens) if t in (a, b))
  out = js.generate(target, None, prompt, max_new_tokens=24, method=js.methods.AR(), eos_id={a, b})
  np.testing.assert_array_equal(out.tokens, free.tokens[: first_stop + 1])


def test_bad_paths(tmp_path):
  with pytest.raises(FileNotFoundError):
    js.load_tokenizer(tmp_path / 'missing.gguf')
  with pytest.raises(FileNotFoundError):
    js.load_tokenizer(tmp_path / 'no_dir')
  with pytest.raises(FileNotFoundError, match='tokenizer.json'):
    js.load_tokenizer(tmp_path)


def test_eval_prompt_groups_are_chat_formatted(tok):
  groups = chat_prompts.eval_prompt_groups(tok, num_code=4, num_math=3)
  assert {k: len(v) for k, v in groups.items()} == {'code': 4, 'chat': 16, 'math': 3}
  opening = tok.encode('<|im_start|>assistant\n')
  for ids in (ids for group in groups.values() for ids in group):
    assert ids[0] == tok.token_to_id('<|im_start|>') and ids[-len(opening) :] == opening


def byte_level_vocab() -> tuple[list[str], list[str]]:
  """Every byte as GPT-2's byte-level character, then merges that cross the places where the
  pre-tokenizers split differently: digit runs, whitespace and newline runs, a punctuation mark
  before a word, contractions, a multi-byte character."""
  tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
  merges = [
    '1 2', '12 3', '123 4', 'Ġ 1', '3 .', '. 1', '1 4',
    'Ġ Ġ', 'ĠĠ Ġ', 'ĠĠĠ Ġ', 'Ċ Ċ', 'Ġ Ċ', 'ĉ t',
    'h e', 'l l', 'he ll', 'hell o', 'Ġ w', 'o r', 'Ġw or', 'Ġwor l', 'Ġworl d',
    '. x', '_ f', 'Ġ (',
    "' s", "' S", "' ve", 'v e', 'I t', 'It \'', 'Ã ©', 'c a', 'ca f', 'caf Ã©',
    'd e', 'de f', '( a', ': Ċ', 'Ġ =', '= =', 'Ġ +', 'r e', 're t',
  ]  # fmt: skip
  for merge in merges:
    tokens.append(merge.replace(' ', ''))
  return tokens + ['<|endoftext|>'], merges


TOKENIZER_TEXTS = TEXTS + (
  'x = 1234567 + 12 + 3.14159\n\n\n    y = x.x_f\n',
  "HE'S here, it'S ok; they've 1,000,000 café\r\n\r\n  \t end",
)


def tiny_gguf_with_tokenizer(path, pre):
  from tests.test_gguf import TINY_LLAMA, random_llama_tensors

  tokens, merges = byte_level_vocab()
  cfg = dict(TINY_LLAMA, vocab_size=len(tokens))
  meta = {
    'tokenizer.ggml.model': 'gpt2',
    'tokenizer.ggml.tokens': tokens,
    'tokenizer.ggml.merges': merges,
    'tokenizer.ggml.token_type': [1] * (len(tokens) - 1) + [3],
    'tokenizer.ggml.eos_token_id': len(tokens) - 1,
  }
  if pre is not None:
    meta['tokenizer.ggml.pre'] = pre
  js.gguf_io.write_gguf(path, cfg, random_llama_tensors(cfg), tokenizer_metadata=meta)
  return path


@pytest.mark.parametrize('pre', [None, 'gpt2', 'llama-bpe', 'qwen2'])
def test_gguf_pre_tokenizers_match_transformers(pre, tmp_path):
  """Each supported GGUF pre-tokenizer type is rebuilt exactly: the same ids as transformers'
  own GGUF tokenizer on digits, whitespace runs, unicode and code."""
  transformers = pytest.importorskip('transformers')
  path = tiny_gguf_with_tokenizer(tmp_path / 'tok.gguf', pre)
  ours = js.load_tokenizer(path)
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
  for text in TOKENIZER_TEXTS:
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False), (pre, text)
    assert ours.decode(ids) == text


def test_gguf_pre_tokenizers_differ_and_unknown_types_are_errors(tmp_path):
  """The types really split differently on these texts (so the test above can fail), and a type
  this loader does not know is an error naming it, not a guess."""
  encodings = {}
  for pre in ('gpt2', 'smollm', 'llama-bpe', 'qwen2'):
    path = tiny_gguf_with_tokenizer(tmp_path / f'{pre}.gguf', pre)
    encodings[pre] = [js.load_tokenizer(path).encode(t) for t in TOKENIZER_TEXTS]
  kinds = list(encodings)
  for i, a in enumerate(kinds):
    for b in kinds[i + 1 :]:
      assert encodings[a] != encodings[b], (a, b)
  path = tiny_gguf_with_tokenizer(tmp_path / 'falcon.gguf', 'falcon')
  with pytest.raises(js.CheckpointError, match="pre-tokenizer type 'falcon' is not supported"):
    js.load_tokenizer(path)


# A template that reads a variable beyond the standard ones, as Qwen3's reads enable_thinking.
THINKING_TEMPLATE = (
  '{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}'
  '{% if add_generation_prompt %}<|assistant|>'
  '{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}'
  '{% endif %}'
)


def test_a_transformers_saved_directory_reads_chat_template_jinja(tmp_path):
  """Current transformers saves the template as ``chat_template.jinja`` (not in
  tokenizer_config.json); the loader reads it, and template keyword arguments reach the template
  as transformers passes them."""
  transformers = pytest.importorskip('transformers')
  tokens, merges = byte_level_vocab()
  backend = tokenizers.Tokenizer(
    tokenizers.models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split()) for m in merges])
  )
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = tokenizers.decoders.ByteLevel()
  theirs = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token='<|endoftext|>')
  theirs.chat_template = THINKING_TEMPLATE
  theirs.save_pretrained(tmp_path)
  assert (tmp_path / 'chat_template.jinja').exists()
  assert 'chat_template' not in json.loads((tmp_path / 'tokenizer_config.json').read_text())
  ours = js.load_tokenizer(tmp_path)
  assert ours.chat_template == THINKING_TEMPLATE
  messages = [{'role': 'user', 'content': 'hello world'}]
  for kwargs in ({}, {'enable_thinking': False}, {'enable_thinking': True}):
    want = theirs.apply_chat_template(
      messages, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert ours.render_chat(messages, **kwargs) == want
    assert ours.apply_chat_template(messages, **kwargs) == theirs.encode(
      want, add_special_tokens=False
    )
  assert '<think></think>' in ours.render_chat(messages, enable_thinking=False)
  assert '<think>' not in ours.render_chat(messages)
