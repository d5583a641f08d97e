"""Tokenizers: an HF ``tokenizer.json`` directory or the vocabulary inside a GGUF file.

``js.load_tokenizer(path)`` returns a :class:`Tokenizer` with ``encode``, ``decode``,
``apply_chat_template`` (the model's own Jinja template, rendered with ``jinja2``) and ``eos_ids``
(every id that ends a turn). A GGUF file's byte-level BPE (``tokenizer.ggml.model == 'gpt2'``) is
rebuilt with the ``tokenizers`` library from the stored tokens and merges; tokens the file marks as
control become special tokens, so ``<|im_start|>`` in a rendered chat template encodes to one id.
"""

import json
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence

import jinja2.sandbox
import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from jetspec_jax.models import checkpoint_files, gguf_io
from jetspec_jax.models.checkpoint_files import CheckpointError

EOS = '<|endoftext|>'
MASK = '<|mask|>'
# End-of-turn tokens of the common chat formats; each one present in a vocabulary stops generation.
END_OF_TURN_TOKENS = (
  '<|im_end|>',
  '<|endoftext|>',
  '<|eot_id|>',
  '<|end_of_text|>',
  '<end_of_turn>',
)
_CONTROL = 3  # llama.cpp's token type for control (special) tokens
_USER_DEFINED = 4


class Tokenizer:
  """A ``tokenizers.Tokenizer`` with the ids, chat template and stop ids the project needs.

  ``Tokenizer(path)`` reads a ``tokenizer.json`` (or a directory holding one, with its
  ``tokenizer_config.json`` and ``generation_config.json`` when present).
  """

  def __init__(
    self,
    path: str | os.PathLike | None = None,
    *,
    backend: tokenizers.Tokenizer | None = None,
    chat_template: str | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
    extra_eos_ids: Iterable[int] = (),
  ):
    if (path is None) == (backend is None):
      raise ValueError('give either a tokenizer.json path or a tokenizers backend')
    if path is not None:
      backend, found = _read_hf_dir(pathlib.Path(path))
      chat_template = chat_template or found.get('chat_template')
      bos_token = bos_token or found.get('bos_token')
      eos_token = eos_token or found.get('eos_token')
      extra_eos_ids = (*extra_eos_ids, *found.get('eos_ids', ()))
    self._tok = backend
    self.chat_template = chat_template
    self.bos_token = bos_token
    self.eos_token = eos_token if eos_token is not None else self._present(EOS)
    ids = {self._tok.token_to_id(t) for t in (self.eos_token, *END_OF_TURN_TOKENS) if t}
    self.eos_ids = frozenset(int(i) for i in (ids | set(extra_eos_ids)) if i is not None)

  def _present(self, token: str) -> str | None:
    return token if self._tok.token_to_id(token) is not None else None

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size()

  @property
  def eos_id(self) -> int | None:
    """The id of the EOS token (``eos_ids`` holds every stop id)."""
    return self._tok.token_to_id(self.eos_token) if self.eos_token else None

  @property
  def mask_id(self) -> int | None:
    return self._tok.token_to_id(MASK)

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def encode(self, text: str) -> list[int]:
    """Token ids of ``text``; special tokens written in the text map to their ids."""
    return list(self._tok.encode(text, add_special_tokens=False).ids)

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def render_chat(
    self,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
    **template_kwargs,
  ) -> str:
    """The chat template rendered as text. ``template_kwargs`` go to the template as variables,
    as transformers passes them (e.g. Qwen3's ``enable_thinking=False``, ``tools=[...]``)."""
    if not self.chat_template:
      raise ValueError('this tokenizer has no chat template')
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals['raise_exception'] = _raise_template_error
    variables = dict(bos_token=self.bos_token or '', eos_token=self.eos_token or '')
    variables.update(template_kwargs)
    return env.from_string(self.chat_template).render(
      messages=list(messages), add_generation_prompt=add_generation_prompt, **variables
    )

  def apply_chat_template(
    self,
    messages: Sequence[Mapping[str, str]],
    add_generation_prompt: bool = True,
    **template_kwargs,
  ) -> list[int]:
    """Token ids of ``messages`` in the model's chat format (the model's own template, with
    ``template_kwargs`` as its variables: :meth:`render_chat`)."""
    return self.encode(self.render_chat(messages, add_generation_prompt, **template_kwargs))

  def save(self, path: str | os.PathLike) -> None:
    """Writes ``tokenizer.json`` and ``tokenizer_config.json`` into directory ``path``."""
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    self._tok.save(str(path / 'tokenizer.json'))
    config = dict(
      chat_template=self.chat_template,
      bos_token=self.bos_token,
      eos_token=self.eos_token,
      eos_ids=sorted(self.eos_ids),
    )
    (path / 'tokenizer_config.json').write_text(json.dumps(config, indent=2))


# The template's own file beside tokenizer_config.json, as current transformers saves it (it then
# leaves ``chat_template`` out of the config); it wins over a template in the config.
CHAT_TEMPLATE_FILE = 'chat_template.jinja'


def _raise_template_error(message):
  raise jinja2.exceptions.TemplateError(message)


def _read_hf_dir(path: pathlib.Path) -> tuple[tokenizers.Tokenizer, dict]:
  """``tokenizer.json`` plus what ``tokenizer_config.json`` / ``generation_config.json`` add."""
  directory = path if path.is_dir() else path.parent
  file = path / 'tokenizer.json' if path.is_dir() else path
  if not file.exists():
    raise FileNotFoundError(f'no tokenizer at {file}')
  backend = tokenizers.Tokenizer.from_file(str(file))
  found: dict = {}
  config_file = directory / 'tokenizer_config.json'
  if config_file.exists():
    config = json.loads(config_file.read_text())
    for key in ('chat_template', 'bos_token', 'eos_token'):
      value = config.get(key)
      if isinstance(value, Mapping):  # an AddedToken written out as a dict
        value = value.get('content')
      if key == 'chat_template' and isinstance(value, list):  # named templates: the default one
        value = next((t['template'] for t in value if t.get('name') == 'default'), None)
      if value is not None:
        found[key] = value
    found['eos_ids'] = list(config.get('eos_ids', ()))
  template_file = directory / CHAT_TEMPLATE_FILE
  if template_file.exists():  # where transformers (>= 4.50) saves the template
    found['chat_template'] = template_file.read_text()
  for name in ('generation_config.json', 'config.json'):
    cfg_file = directory / name
    if cfg_file.exists():
      eos = json.loads(cfg_file.read_text()).get('eos_token_id')
      found['eos_ids'] = [*found.get('eos_ids', ()), *np.atleast_1d(eos if eos is not None else [])]
  return backend, found


# How text is split before BPE, by GGUF ``tokenizer.ggml.pre`` type (llama.cpp's names). The
# splits are the models' own: Llama-3 keeps numbers in runs of up to 3 digits and attaches one
# leading non-letter to a word; Qwen2 does the same with single digits. Both match contractions
# case-insensitively and keep newline runs apart from other whitespace.
_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
  r'| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+'
)
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
  r'| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+'
)
PRE_TOKENIZER_SPLITS = {
  'llama-bpe': _LLAMA3_SPLIT,
  'llama3': _LLAMA3_SPLIT,
  'llama-v3': _LLAMA3_SPLIT,
  'qwen2': _QWEN2_SPLIT,
  'deepseek-r1-qwen': _QWEN2_SPLIT,
}
# GPT-2's own split (byte-level BPE's built-in regex): 'gpt2', and 'default' / no key at all,
# which llama.cpp reads as GPT-2's; 'smollm' adds a split before every digit.
GPT2_PRE_TYPES = (None, 'default', 'gpt2', 'smollm')


def _pre_tokenizer(pre: str | None):
  """The pre-tokenizer of GGUF pre-tokenizer type ``pre``; an unknown type is an error (a guess
  would tokenize digits and whitespace differently from the model's own tokenizer)."""
  if pre in PRE_TOKENIZER_SPLITS:
    return pre_tokenizers.Sequence(
      [
        pre_tokenizers.Split(tokenizers.Regex(PRE_TOKENIZER_SPLITS[pre]), behavior='isolated'),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
      ]
    )
  if pre not in GPT2_PRE_TYPES:
    known = sorted(PRE_TOKENIZER_SPLITS) + [t for t in GPT2_PRE_TYPES if t]
    raise CheckpointError(
      f'GGUF pre-tokenizer type {pre!r} is not supported (supported: {", ".join(sorted(known))})'
    )
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  if pre == 'smollm':  # SmolLM's own pre-tokenizer: every digit is a piece of its own
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
  return byte_level


def _byte_level_backend(tokens: list[str], merges: list[str], pre: str | None):
  """A byte-level BPE ``tokenizers.Tokenizer`` from GGUF's token list, merges and
  pre-tokenizer type."""
  pre_tokenizer = _pre_tokenizer(pre)
  vocab = {token: i for i, token in enumerate(tokens)}
  pairs = [tuple(m.split(' ', 1)) for m in merges]
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
  backend.pre_tokenizer = pre_tokenizer
  backend.decoder = decoders.ByteLevel()
  return backend


def tokenizer_from_gguf(path: str | os.PathLike) -> Tokenizer:
  """The tokenizer stored in a GGUF file's metadata (byte-level BPE vocabularies)."""
  keys = (
    'tokenizer.ggml.model',
    'tokenizer.ggml.pre',
    'tokenizer.ggml.tokens',
    'tokenizer.ggml.merges',
    'tokenizer.ggml.token_type',
    'tokenizer.ggml.bos_token_id',
    'tokenizer.ggml.eos_token_id',
    'tokenizer.chat_template',
  )
  meta = gguf_io.read_metadata(path, keys)
  kind = meta.get('tokenizer.ggml.model')
  if kind != 'gpt2':
    raise CheckpointError(
      f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
    )
  tokens = list(meta['tokenizer.ggml.tokens'])
  if 'tokenizer.ggml.merges' not in meta:
    raise CheckpointError(f'{path} stores no tokenizer.ggml.merges')
  backend = _byte_level_backend(
    tokens, list(meta['tokenizer.ggml.merges']), meta.get('tokenizer.ggml.pre')
  )
  types = list(meta.get('tokenizer.ggml.token_type') or [])
  special = [t for t, kind in zip(tokens, types) if kind == _CONTROL]
  added = [t for t, kind in zip(tokens, types) if kind == _USER_DEFINED]
  backend.add_special_tokens(
    [tokenizers.AddedToken(t, normalized=False, special=True) for t in special]
  )
  if added:
    backend.add_tokens([tokenizers.AddedToken(t, normalized=False) for t in added])

  def token(key):
    i = meta.get(key)
    return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

  return Tokenizer(
    backend=backend,
    chat_template=meta.get('tokenizer.chat_template'),
    bos_token=token('tokenizer.ggml.bos_token_id'),
    eos_token=token('tokenizer.ggml.eos_token_id'),
  )


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
  """A :class:`Tokenizer` from a GGUF file, an HF directory / ``tokenizer.json``, or a Hugging
  Face model id in the local Hugging Face cache.

  Raises:
    FileNotFoundError: nothing at ``path`` (for a model id: not in the local cache).
    CheckpointError: a GGUF file with an unsupported tokenizer model.
  """
  path = checkpoint_files.resolve(path)
  if path.suffix == '.gguf':
    if not path.is_file():
      raise FileNotFoundError(f'GGUF file {path} does not exist')
    return tokenizer_from_gguf(path)
  if not path.exists():
    raise FileNotFoundError(f'no tokenizer at {path}')
  return Tokenizer(path)
