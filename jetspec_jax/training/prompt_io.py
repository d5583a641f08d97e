"""Prompts for self-distillation: JSON-lines files in the layouts users have (chat messages,
ShareGPT conversations, raw text, token ids), one prompt per assistant turn, and the prompt source a
config names.
"""

import functools
import json
import os
from collections.abc import Callable, Sequence

import numpy as np
from etils import epath

from jetspec_jax import corpus
from jetspec_jax import prompts as prompts_lib
from jetspec_jax.tokenizer import Tokenizer

# Conversations as users have them: the chat format (``{"messages": [{"role", "content"}]}``)
# or ShareGPT's (``{"conversations": [{"from", "value"}]}``); ShareGPT speaker names -> roles.
CONVERSATION_ROLES = {
  'system': 'system',
  'user': 'user',
  'human': 'user',
  'assistant': 'assistant',
  'gpt': 'assistant',
  'chatgpt': 'assistant',
  'model': 'assistant',
  'bing': 'assistant',
  'bard': 'assistant',
}


def conversation_messages(record: dict, where: str = 'record') -> list[dict] | None:
  """``record``'s turns as ``[{'role', 'content'}]`` (chat or ShareGPT layout); None if it has
  neither ``messages`` nor ``conversations``.

  Raises:
    ValueError: a turn without a known role or without text content.
  """
  if 'messages' in record:
    turns, role_key, text_key = record['messages'], 'role', 'content'
  elif 'conversations' in record:
    turns, role_key, text_key = record['conversations'], 'from', 'value'
  else:
    return None
  if not isinstance(turns, list) or not turns:
    raise ValueError(f'{where}: the conversation is not a non-empty list of turns')
  messages = []
  for i, turn in enumerate(turns):
    role = CONVERSATION_ROLES.get(str(turn.get(role_key, '')).lower())
    text = turn.get(text_key)
    if role is None or not isinstance(text, str):
      raise ValueError(
        f'{where}, turn {i}: want {{{role_key!r}: one of {sorted(CONVERSATION_ROLES)}, '
        f'{text_key!r}: text}}, got {turn!r:.200}'
      )
    messages.append({'role': role, 'content': text})
  return messages


def turn_prompts(messages: list[dict]) -> list[list[dict]]:
  """The prompts of one conversation, each answered by the target: for every assistant turn, the
  messages before it (earlier assistant turns as the data gives them: they are context, like the
  sampled sequences), and the whole conversation if it ends with a user turn."""
  prompts = [messages[:i] for i, m in enumerate(messages) if m['role'] == 'assistant' and i]
  if messages[-1]['role'] == 'user':
    prompts.append(messages)
  return [p for p in prompts if any(m['role'] == 'user' for m in p)]


def read_prompts_jsonl(
  path: str | os.PathLike,
  tokenize: Callable[[str], Sequence[int]] | None = None,
  *,
  chat: Callable[[list[dict]], Sequence[int]] | None = None,
) -> list[np.ndarray]:
  """Prompts from a JSON-lines file, one record per line, in any of these layouts:

  * ``{"prompt_ids": [...]}``: token ids, used as they are;
  * ``{"prompt": "text"}``: raw text, encoded by ``tokenize``;
  * ``{"messages": [{"role": ..., "content": ...}, ...]}`` or ShareGPT's
    ``{"conversations": [{"from": "human" | "gpt" | "system", "value": ...}, ...]}``: one prompt
    per assistant turn (:func:`turn_prompts`), put in the target's chat format by ``chat``
    (messages -> ids with the assistant turn opened); the target writes the answers.

  Raises:
    FileNotFoundError: no file at ``path``.
    ValueError: a record in no known layout, or text without ``tokenize`` / ``chat``.
  """
  path = epath.Path(path)
  if not path.exists() or path.is_dir():
    raise FileNotFoundError(f'prompt file {path} does not exist')
  prompts = []
  with path.open() as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f'{path}:{line_no}'
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{where} is not JSON: {e}') from e
      if not isinstance(record, dict):
        raise ValueError(f'{where} is not a JSON object')
      messages = conversation_messages(record, where)
      if messages is not None:
        if chat is None:
          raise ValueError(
            f"{where} is a conversation but no chat template (the target's) was given"
          )
        prompts.extend(np.asarray(chat(m), np.int32) for m in turn_prompts(messages))
      elif 'prompt_ids' in record:
        prompts.append(np.asarray(record['prompt_ids'], np.int32))
      elif 'prompt' in record:
        if tokenize is None:
          raise ValueError(f'{where} has a text prompt but no tokenizer was given')
        prompts.append(np.asarray(tokenize(record['prompt']), np.int32))
      else:
        raise ValueError(f'{where} has none of "prompt_ids", "prompt", "messages", "conversations"')
  return prompts


def prompts_from_config(
  data_config, vocab_size: int, load_tokenizer: Callable[[], Tokenizer] | None = None
) -> list[np.ndarray]:
  """Training prompts from ``data_config.prompts``.

  * ``'random'``: ``num_prompts`` random prompts with lengths in ``prompt_len``;
  * ``'stdlib_functions'``: signatures + docstrings of documented functions in the standard
    library's training split (not the held-out ``validation_modules``), tokenized with the
    tokenizer at ``tokenizer``;
  * otherwise a JSON-lines path (see :func:`read_prompts_jsonl`): text and conversations are
    encoded by the target's tokenizer (``load_tokenizer``, called only if the file has text)
    and its chat template, rendered with ``data_config.chat_template_kwargs`` (e.g.
    ``enable_thinking=False`` for Qwen3). Prompts longer than ``max_prompt_len`` (if set) are
    dropped.
  """
  if data_config.prompts == 'stdlib_functions':
    train_files, _ = corpus.stdlib_files(tuple(data_config.validation_modules))
    texts = prompts_lib.function_prompts(train_files)
    rng = np.random.default_rng(data_config.prompt_seed)
    order = rng.permutation(len(texts))[: data_config.num_prompts]
    tok = Tokenizer(data_config.tokenizer)
    return [tok.encode(texts[i][1]) for i in order]
  if data_config.prompts == 'random':
    rng = np.random.default_rng(data_config.prompt_seed)
    lo, hi = data_config.prompt_len
    return [
      rng.integers(0, vocab_size, size=rng.integers(lo, hi + 1), dtype=np.int32)
      for _ in range(data_config.num_prompts)
    ]
  tokenize = chat = None
  if load_tokenizer is not None:
    tokenizer = functools.cache(load_tokenizer)
    kwargs = dict(data_config.get('chat_template_kwargs') or {})
    tokenize = lambda text: tokenizer().encode(text)  # noqa: E731
    chat = lambda messages: tokenizer().apply_chat_template(messages, True, **kwargs)  # noqa: E731
  prompts = read_prompts_jsonl(data_config.prompts, tokenize, chat=chat)
  longest = data_config.get('max_prompt_len') or 0
  if longest:
    prompts = [p for p in prompts if len(p) <= longest]
  prompts = [p for p in prompts if len(p)]
  if not prompts:
    raise ValueError(
      f'{data_config.prompts} gives no prompt (of at most {longest or "any"} tokens)'
    )
  return prompts[: data_config.get('num_prompts') or None]


def prompts_and_stops(
  data_config, vocab_size: int, load_tokenizer: Callable[[], Tokenizer] | None = None
) -> tuple[list[np.ndarray], tuple[int, ...] | None]:
  """:func:`prompts_from_config`, and the tokenizer's end-of-turn ids when the prompts needed
  the tokenizer (text and conversations: their answers stop there), else None."""
  tokenizer = functools.cache(load_tokenizer) if load_tokenizer is not None else None
  prompts = prompts_from_config(data_config, vocab_size, tokenizer)
  eos = None
  if tokenizer is not None and tokenizer.cache_info().currsize:  # it was needed: chat prompts
    eos = tokenizer().eos_ids
  return prompts, eos
