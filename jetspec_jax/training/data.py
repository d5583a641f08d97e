"""Self-distilled training data (docs/training.md §1): the target regenerates the response to
each prompt.

On disk: ``shard_00000.npz`` ... each with ``tokens [N, L]`` (prompt + response, right-padded
with 0; uint16 when the vocabulary fits, compressed: a few MB per million tokens, small enough to
commit), ``loss_mask uint8[N, L]`` (1 on response tokens) and ``lengths int32[N]``. Shards are
written atomically, so generation resumes by skipping finished shards. Training reads them through
``grain`` as one random-access source, shuffled per epoch, batched; batch ``s`` is a pure function
of ``(seed, s)``, so the data position of a resumed run is just its step.

Target features (the head's taps and the final hidden state of every token, float16) are either
collected during generation (``feature_taps``: ``shard_*.features.npy`` beside each shard) or
recomputed from the tokens by a batched teacher-forced forward (:func:`compute_features`) into a
separate cache directory, at the same relative paths: the tokens are the asset, the features a
cache that one command rebuilds.

Shards and prompt files are read and written through ``etils.epath``, so a data directory may be a
URL (``gs://bucket/data``); features are memory-mapped, so their cache is a local directory.
"""

import collections
import fnmatch
import functools
import io
import json
import os
import pathlib
import re
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Sequence

import grain
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from etils import epath
from tqdm import tqdm

from jetspec_jax import corpus, decoding, rounds, sharding
from jetspec_jax import prompts as prompts_lib
from jetspec_jax.models import decoder
from jetspec_jax.tokenizer import Tokenizer

SHARD_PATTERN = 'shard_{:05d}.npz'
FEATURE_TAPS_FILE = 'feature_taps.json'  # in a features directory: the taps its features hold
# ... and the matmul mode its forward ran in (absent: 'float32', every cache built before it).
FEATURE_COMPUTE_FILE = 'feature_compute_dtype.json'
FEATURE_COMPUTE_DTYPES = ('float32', 'bfloat16')


def shard_paths(data_dir: str | os.PathLike, prompt_rounds: int | None = None) -> list[epath.Path]:
  """Finished shards under ``data_dir`` (subdirectories too), sorted. ``prompt_rounds``: only
  those of the first that many prompt rounds (round r >= 1 lives in ``data_dir/round{r}/``,
  :func:`jetspec_jax.training.chat_data.round_dirs`); None: every shard."""
  root = epath.Path(data_dir)
  if not root.is_dir():
    return []
  paths = [
    where / name
    for where, _, names in root.walk()  # epath has no recursive glob (a URL lists by walking)
    for name in names
    if fnmatch.fnmatch(name, 'shard_*.npz') and not name.endswith('.tmp.npz')
  ]
  if prompt_rounds is not None:
    paths = [p for p in paths if prompt_round_of(p, root) < prompt_rounds]
  return sorted(paths)


def prompt_round_dir(data_dir, prompt_round: int):
  """Where a prompt round's shards go: ``data_dir`` itself for round 0, else
  ``data_dir/round{r}`` (what :func:`prompt_round_of` reads back)."""
  return data_dir if prompt_round == 0 else data_dir / f'round{prompt_round}'


def prompt_round_of(path, data_dir) -> int:
  """The prompt round a shard belongs to: r for shards under ``data_dir/round{r}/``, else 0."""
  top = epath.Path(path).relative_to(epath.Path(data_dir)).parts[0]
  match = re.fullmatch(r'round(\d+)', top)
  return int(match.group(1)) if match else 0


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


def generate_dataset(
  target: decoder.Target,
  prompts: Sequence[Sequence[int]] | Callable[[], Iterable[Sequence[int]]],
  out_dir: str | os.PathLike,
  *,
  max_len: int,
  max_new_tokens: int,
  shard_size: int = 64,
  batch_size: int = 16,
  temperature: float = 0.0,
  top_p: float = 1.0,
  seed: int = 0,
  eos=None,
  progress: bool = True,
  shard_indices: Iterable[int] | None = None,
  feature_taps: tuple[int, ...] = (),
  wait: bool = False,
  poll_s: float = 2.0,
) -> list[epath.Path]:
  """Regenerates responses for ``prompts`` and writes token shards (skipping finished ones).

  Args:
    target: the frozen target.
    prompts: token-id prompts, or a callable returning them.
    out_dir: shard directory.
    max_len: sequences (prompt + response) are cut to this many tokens.
    max_new_tokens: most response tokens per prompt.
    shard_size: prompts per shard.
    batch_size: prompts generated together.
    temperature: 0 for greedy regeneration.
    top_p: nucleus filtering when sampling.
    seed: sampling seed (folded with the shard index).
    eos: stop token id or ids (defaults to the target's).
    shard_indices: generate only these shards (default: all). With several processes
      (multi-host), process ``i`` of ``n`` writes shards ``i, i + n, ...`` of those, on its own
      devices; callers wait for the others (:func:`generate_from_config` does).
      Processes started side by side on one directory claim shards as they go
      (:class:`ShardClaim`): each shard is written once, by the process that claimed it.
    wait: return only once every shard of this process's share exists, the ones other
      processes claimed included (polling every ``poll_s`` seconds and taking over a shard
      whose claimer is gone); readers of the whole set need it.
    feature_taps: also store each token's target features (taps of these layers + final
      hidden state, float16) collected during generation, so training needs no target pass
      (``shard_*.features.npy``, see :func:`write_shard`).

  Returns:
    The shard paths, in order.
  """
  if callable(prompts):
    prompts = list(prompts())
  prompts = [np.asarray(p, np.int32) for p in prompts]
  out_dir = epath.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  eos = target.cfg.eos_token_id if eos is None else eos
  only = None if shard_indices is None else set(shard_indices)
  chunks = [prompts[i : i + shard_size] for i in range(0, len(prompts), shard_size)]
  paths = [out_dir / SHARD_PATTERN.format(i) for i in range(len(chunks))]
  wanted = [i for i in range(len(chunks)) if only is None or i in only]
  total = sum(len(chunks[i]) for i in wanted)
  bar = tqdm(total=total, desc='generate', unit='prompt', disable=not progress)
  progress_state = {'tokens': 0, 'start': time.perf_counter()}

  def generate_shard(shard_idx: int) -> None:
    sequences, masks, features = [], [], []
    chunk = chunks[shard_idx]
    for b in range(0, len(chunk), batch_size):
      batch = chunk[b : b + batch_size]
      results = decoding.generate_with_features(  # batched, jitted AR; rows stop at their EOS
        target,
        list(batch),
        feature_taps=tuple(feature_taps),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed * 100_003 + shard_idx * 1_009 + b,
        eos_id=eos,
      )
      if feature_taps:
        features.extend(feats[:max_len] for _, feats in results)
      for prompt, (response, _) in zip(batch, results):
        seq = np.concatenate([prompt, response])[:max_len]
        mask = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(response), np.uint8)])
        sequences.append(seq)
        masks.append(mask[:max_len])
        progress_state['tokens'] += len(response)
      bar.update(len(batch))
      rate = progress_state['tokens'] / (time.perf_counter() - progress_state['start'])
      bar.set_postfix(tokens_per_s=f'{rate:.0f}')
    write_shard(paths[shard_idx], sequences, masks, max_len, features or None, feature_taps)

  # Another host's shards (multi-host: process i of n writes every n-th) are left to it.
  ours = [i for i in wanted if i % jax.process_count() == jax.process_index()]
  bar.update(sum(len(chunks[i]) for i in ours if paths[i].exists()))
  while True:
    # Processes started side by side on one directory (not one multi-host job) split its shards
    # as they go: each shard is generated by the process that claims it first, and only once.
    for shard_idx in ours:
      with ShardClaim(paths[shard_idx]) as claimed:
        if claimed and not paths[shard_idx].exists():
          generate_shard(shard_idx)
    missing = [i for i in ours if not paths[i].exists()]
    if not wait or not missing:
      break
    time.sleep(poll_s)  # the missing shards are another process's, being written now
  bar.close()
  return paths


class ShardClaim:
  """An exclusive claim on writing a shard: ``PATH.claim`` created with ``O_EXCL`` (local
  directories), holding the claimer's host and process id, removed on exit. A claim left by a
  process of this host that is gone is stale and taken over. Other file systems have no
  exclusive create: the claim is then always granted (multi-host jobs split shards by process
  index instead)."""

  def __init__(self, path):
    self.path = epath.Path(path)
    self.claim = self.path.with_name(self.path.name + '.claim')
    self.held = False

  def _local(self) -> bool:
    return '://' not in os.fspath(self.claim)

  def _stale(self) -> bool:
    try:
      host, pid = self.claim.read_text().split()
    except (FileNotFoundError, ValueError):
      return False
    if host != socket.gethostname():
      return False
    try:
      os.kill(int(pid), 0)
    except ProcessLookupError:
      return True
    except PermissionError:
      return False
    return False

  def __enter__(self) -> bool:
    if not self._local():
      return True
    self.claim.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
      try:
        fd = os.open(os.fspath(self.claim), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
      except FileExistsError:
        if not self._stale():
          return False
        self.claim.unlink(missing_ok=True)
        continue
      with os.fdopen(fd, 'w') as f:
        f.write(f'{socket.gethostname()} {os.getpid()}')
      self.held = True
      return True
    return False

  def __exit__(self, *exc) -> None:
    if self.held:
      self.claim.unlink(missing_ok=True)
      self.held = False


def parse_only_shards(spec: str, num_shards: dict[str, int]) -> set[tuple[str, int]] | None:
  """``'greedy:35,36'`` -> {('greedy', 35), ('greedy', 36)}; ``''`` -> None (every shard)."""
  if not spec:
    return None
  kind, _, indices = spec.partition(':')
  bad = ValueError(
    f"only_shards must look like 'greedy:35,36' (kinds {list(num_shards)}), got {spec!r}"
  )
  if kind not in num_shards or not indices:
    raise bad
  try:
    wanted = {(kind, int(i)) for i in indices.split(',')}
  except ValueError:
    raise bad from None
  if any(not 0 <= i < num_shards[kind] for _, i in wanted):
    raise ValueError(f'only_shards {spec!r}: {kind} has shards 0..{num_shards[kind] - 1}')
  return wanted


def generate_greedy_and_sampled(
  target: decoder.Target, prompts: Sequence[np.ndarray], data_dir, data_config, *, seed: int, eos
) -> dict[str, int]:
  """Answers ``prompts`` into ``data_dir/greedy`` and ``data_dir/sampled``: every
  ``sampled_every``-th prompt sampled at ``temperature`` (top-p ``top_p``), the rest greedily.

  Shards of the two kinds are produced alternately, so a partial dataset already mixes both; a
  re-run skips finished shards. ``data_config.only_shards`` (e.g. ``'greedy:35,36'``; empty: all)
  generates just those shards of one kind. Returns the number of prompts of each kind.
  """
  data_dir = epath.Path(data_dir)
  every = data_config.sampled_every
  kinds = {
    'greedy': ([p for i, p in enumerate(prompts) if i % every], 0.0),
    'sampled': ([p for i, p in enumerate(prompts) if not i % every], data_config.temperature),
  }
  size = data_config.shard_size
  num_shards = {k: -(-len(p) // size) for k, (p, _) in kinds.items()}
  wanted = parse_only_shards(data_config.get('only_shards', ''), num_shards)
  for shard in range(max(num_shards.values())):
    for kind, (kind_prompts, temperature) in kinds.items():
      if shard >= num_shards[kind] or (wanted is not None and (kind, shard) not in wanted):
        continue
      generate_dataset(
        target,
        kind_prompts,
        data_dir / kind,
        max_len=data_config.max_len,
        max_new_tokens=data_config.max_new_tokens,
        shard_size=size,
        batch_size=data_config.generate_batch,
        temperature=temperature,
        top_p=data_config.get('top_p', 1.0) if temperature else 1.0,
        seed=seed,
        eos=eos,
        progress=False,
        shard_indices=[shard],
        # With a features directory the features are recomputed from the tokens later
        # (compute_features), so generation stores tokens only.
        feature_taps=()
        if data_config.get('features_dir')
        else tuple(data_config.get('feature_taps') or ()),
      )
    logging.info('shard %d of %d done', shard + 1, max(num_shards.values()))
  return {f'{k}_prompts': len(p) for k, (p, _) in kinds.items()}


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


def generate_from_config(
  config,
  target: decoder.Target,
  data_dir,
  load_tokenizer: Callable[[], Tokenizer] | None = None,
  *,
  prompts: Sequence[np.ndarray] | None = None,
  eos=None,
) -> list[epath.Path]:
  """:func:`generate_dataset` with the prompts and settings of an experiment config.

  With ``data.sampled_every`` set, the responses are split greedy / sampled
  (:func:`generate_greedy_and_sampled`). Text and conversation prompts use the target's
  tokenizer (``load_tokenizer``), whose end-of-turn ids also stop the responses
  (:func:`prompts_and_stops`; or pass ``prompts`` and ``eos`` already read).
  """
  if prompts is None:
    prompts, eos = prompts_and_stops(config.data, target.cfg.vocab_size, load_tokenizer)
  if config.data.get('sampled_every'):
    generate_greedy_and_sampled(target, prompts, data_dir, config.data, seed=config.seed, eos=eos)
  else:
    generate_dataset(
      target,
      prompts,
      data_dir,
      max_len=config.data.max_len,
      max_new_tokens=config.data.max_new_tokens,
      shard_size=config.data.shard_size,
      batch_size=config.data.generate_batch,
      temperature=config.data.temperature,
      seed=config.seed,
      eos=eos,
    )
  sharding.sync('data generated')  # every host's shards are written
  return shard_paths(data_dir)


def select_shards(
  paths: list[epath.Path], shards_per_dir: int | None = None, skip_per_dir: int = 0
) -> list[epath.Path]:
  """Of each directory's shards (``paths`` sorted, as :func:`shard_paths` returns them), the
  ``shards_per_dir`` after its first ``skip_per_dir`` (``None``: all after them)."""
  seen = collections.Counter()
  kept = []
  for p in paths:
    i = seen[p.parent]
    seen[p.parent] += 1
    if i >= skip_per_dir and (shards_per_dir is None or i < skip_per_dir + shards_per_dir):
      kept.append(p)
  return kept


def features_path(
  shard: epath.Path, data_dir=None, features_dir=None, kind: str = 'features'
) -> epath.Path | pathlib.Path:
  """A shard's features (``kind='labels'``: its target-argmax labels): beside it, or at its
  relative path under ``features_dir`` (a local cache)."""
  beside = shard.with_name(shard.name.removesuffix('.npz') + f'.{kind}.npy')
  if features_dir is None:
    return beside
  return pathlib.Path(features_dir) / os.fspath(beside.relative_to(epath.Path(data_dir)))


_FEATURE_WIDTH_STEP = 64


def feature_taps(features_dir) -> tuple[int, ...] | None:
  """The target layers a features directory's features were tapped at; None where none are
  recorded (no features computed there yet)."""
  taps_file = pathlib.Path(features_dir) / FEATURE_TAPS_FILE
  return tuple(json.loads(taps_file.read_text())) if taps_file.exists() else None


def feature_compute_dtype(features_dir) -> str | None:
  """The matmul mode a features directory's forward ran in: ``'float32'`` for one filled before
  the mode was recorded (features but no mode file), None for one without features."""
  features_dir = pathlib.Path(features_dir)
  mode_file = features_dir / FEATURE_COMPUTE_FILE
  if mode_file.exists():
    return json.loads(mode_file.read_text())
  return 'float32' if next(features_dir.rglob('*.features.npy'), None) else None


def _pin_feature_meta(features_dir: pathlib.Path, name: str, value, stored, what: str) -> None:
  """Records ``value`` as a features directory's ``name`` file when none is stored yet (``stored``
  None), else refuses a different one: a directory holds features of one kind only."""
  if stored is None:
    # Workers of experiments/build_features.py start together: each writes a whole file under
    # its own temporary name, so none reads another's half-written one.
    _write_atomically(epath.Path(features_dir / name), json.dumps(value).encode(), '.tmp')
  elif stored != value:
    raise ValueError(
      f'{features_dir} holds features {what}{stored}, not {value}: use another features directory'
    )


def compute_features(
  target: decoder.Target,
  data_dir: str | os.PathLike,
  features_dir: str | os.PathLike,
  taps: tuple[int, ...],
  *,
  batch_size: int = 8,
  progress: bool = True,
  shards_per_dir: int | None = None,
  prompt_rounds: int | None = None,
  part: int = 0,
  parts: int = 1,
  compute_dtype: str = 'float32',
) -> int:
  """Recomputes the target features of every shard under ``data_dir`` (``shards_per_dir``: of
  the first that many of each directory, the ones a run reads; ``prompt_rounds``: of the first
  that many prompt rounds, :func:`shard_paths`) that has none in
  ``features_dir`` (a batched teacher-forced forward over prompt + response, the same rows that
  generation collects: taps, then the final-normed hidden state; the last token's row is zeros,
  as the target never reads it). Beside each shard's features go its labels
  (``shard_*.labels.npy``, int32 ``[sum of lengths]``): the target's argmax at every position
  (the greedy next token after it), from the same forward. Resumable: finished shards are
  skipped. ``part`` of ``parts``: every ``parts``-th of those shards from the ``part``-th, so
  that processes split the work (``experiments/build_features.py``). ``compute_dtype``
  ``'bfloat16'``: the forward's matmuls take bfloat16 inputs with float32 accumulation, about 1.7x
  faster on a CPU with AMX; features and labels are then close to the float32 forward's, not equal
  (on SmolLM2-135M: 0.6% mean relative feature difference, 99.7% of labels equal; assets/README.md).
  A features directory holds one mode: another one is refused.

  Returns:
    How many shards were computed.
  """
  if not 0 <= part < parts:
    raise ValueError(f'part {part} of {parts}: need 0 <= part < parts')
  data_dir, features_dir = epath.Path(data_dir), pathlib.Path(features_dir)
  features_dir.mkdir(parents=True, exist_ok=True)
  if compute_dtype not in FEATURE_COMPUTE_DTYPES:
    raise ValueError(
      f'compute_dtype must be one of {FEATURE_COMPUTE_DTYPES}, got {compute_dtype!r}'
    )
  taps = tuple(taps)
  _pin_feature_meta(features_dir, FEATURE_TAPS_FILE, taps, feature_taps(features_dir), 'of taps ')
  stored_mode = feature_compute_dtype(features_dir)
  _pin_feature_meta(features_dir, FEATURE_COMPUTE_FILE, compute_dtype, stored_mode, 'computed in ')
  if compute_dtype == 'bfloat16':
    target = target.with_compute_dtype('bfloat16')
  hidden_size = target.cfg.hidden_size

  @jax.jit
  def forward(tokens, lengths):
    feats = rounds.prefill(target, tokens, lengths, tokens.shape[1], taps=taps, with_hidden=True)[2]
    argmax = jnp.argmax(target.lm_logits(feats[..., -hidden_size:]), axis=-1)
    return feats, argmax.astype(jnp.int32)

  def done(p):
    return all(features_path(p, data_dir, features_dir, k).exists() for k in ('features', 'labels'))

  paths = select_shards(shard_paths(data_dir, prompt_rounds), shards_per_dir)[part::parts]
  todo = [p for p in paths if not done(p)]
  for path in tqdm(todo, desc='features', unit='shard', disable=not progress):
    shard = load_shard(path)
    tokens, lengths = shard['tokens'].astype(np.int32), shard['lengths']
    rows, labels = [None] * len(lengths), [None] * len(lengths)
    # Shortest first, each batch as wide as its longest row rounded up to 64 (a few shapes, so a
    # few compiles): on the SmolLM2 data this forwards 1.07M positions for 0.90M tokens, where
    # file order and power-of-two widths forwarded 1.78M. Measured there on 2 cores: 68 s per
    # shard after the compiles, against 76 (the forward's cost is not proportional to width).
    order = np.argsort(lengths, kind='stable')
    for b in range(0, len(order), batch_size):
      idx = order[b : b + batch_size]
      lens = lengths[idx]
      width = min(-(-int(lens.max()) // _FEATURE_WIDTH_STEP) * _FEATURE_WIDTH_STEP, tokens.shape[1])
      batch = np.zeros((batch_size, width), np.int32)
      batch[: len(idx)] = tokens[idx, :width]
      padded_lens = np.concatenate([lens, np.ones(batch_size - len(lens), lens.dtype)])
      feats, argmax = forward(jnp.asarray(batch), jnp.asarray(padded_lens, jnp.int32))
      feats, argmax = np.asarray(feats), np.asarray(argmax)
      for i, (j, n) in enumerate(zip(idx, lens, strict=True)):
        row = feats[i, :n].astype(np.float16)
        row[n - 1] = 0
        rows[j], labels[j] = row, argmax[i, :n]
    out = features_path(path, data_dir, features_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    _save_rows(features_path(path, data_dir, features_dir, 'labels'), labels, np.int32)
    _save_features(out, rows)
  return len(todo)


def _save_features(path, rows) -> None:
  """One float16 ``[sum of lengths, F]`` array, written atomically (temp file + rename)."""
  _save_rows(path, rows, np.float16)


def _save_rows(path, rows, dtype) -> None:
  """Per-sequence rows as one ``dtype`` array, written atomically (temp file + rename)."""
  buf = io.BytesIO()
  np.save(buf, np.concatenate(rows).astype(dtype))
  _write_atomically(epath.Path(path), buf.getvalue(), '.tmp.npy')


def _write_atomically(path: epath.Path, data: bytes, suffix: str) -> None:
  """Writes ``data`` to a temporary file of this process's own (process id + random suffix, so
  concurrent writers never share one) and renames it over ``path``: a reader sees the old file
  or the whole new one, and of two writers of one path the last rename wins."""
  tmp = path.with_name(f'{path.name}.{os.getpid()}.{secrets.token_hex(6)}{suffix}')
  try:
    tmp.write_bytes(data)
    tmp.replace(path)
  except BaseException:
    if tmp.exists():
      tmp.unlink()
    raise


def load_shard(path) -> dict[str, np.ndarray]:
  """A token shard's arrays (read whole: a URL cannot be memory-mapped)."""
  with np.load(io.BytesIO(epath.Path(path).read_bytes())) as shard:
    return dict(shard)


def write_shard(
  path: epath.Path, sequences, masks, max_len: int, features=None, feature_taps=()
) -> None:
  """Writes one shard atomically (temp file + rename).

  ``features`` (one ``[len(seq), F]`` array per sequence) go first, to
  ``shard_*.features.npy`` as one float16 ``[sum of lengths, F]`` array (memory-mappable;
  sequence ``i`` owns the ``lengths[i]`` rows after those of the sequences before it), so a
  shard whose ``.npz`` exists is complete.
  """
  n = len(sequences)
  fits_16 = all(len(s) == 0 or int(np.max(s)) < 1 << 16 for s in sequences)
  tokens = np.zeros((n, max_len), np.uint16 if fits_16 else np.int32)
  loss_mask = np.zeros((n, max_len), np.uint8)
  lengths = np.array([len(s) for s in sequences], np.int32)
  for i, (seq, mask) in enumerate(zip(sequences, masks)):
    tokens[i, : len(seq)] = seq
    loss_mask[i, : len(mask)] = mask
  extra = {}
  if features is not None:
    for seq, feats in zip(sequences, features):
      if len(feats) != len(seq):
        raise ValueError(f'{len(feats)} feature rows for a sequence of {len(seq)} tokens')
    _save_features(features_path(path), features)
    extra['feature_taps'] = np.asarray(feature_taps, np.int32)
  buf = io.BytesIO()
  np.savez_compressed(buf, tokens=tokens, loss_mask=loss_mask, lengths=lengths, **extra)
  _write_atomically(epath.Path(path), buf.getvalue(), '.tmp.npz')


class TokenShards:
  """All shards under a directory (subdirectories included) as one random-access source.

  Follows grain's data-source protocol. When every shard has target features
  (``shard_*.features.npy``, memory-mapped; beside the shards, or in ``features_dir`` as
  :func:`compute_features` writes them), items carry ``features [max_len, F]`` (float32,
  zero-padded) and ``feature_taps`` names the tapped layers they were collected with.
  """

  def __init__(
    self,
    data_dir: str | os.PathLike,
    max_len: int | None = None,
    shards_per_dir: int | None = None,
    skip_per_dir: int = 0,
    features_dir: str | os.PathLike | None = None,
    target_labels: bool = False,
    subdir: str | None = None,
    prompt_rounds: int | None = None,
  ):
    """``shards_per_dir`` keeps only the first that many shards of each directory (a fixed
    prefix of data that is still being generated) after skipping its first ``skip_per_dir``
    (held-out data: e.g. ``skip_per_dir=6, shards_per_dir=1`` is each directory's 7th shard).
    ``target_labels``: items carry ``labels [max_len]``, the target's greedy next token at every
    position (``labels[p]`` = argmax of the target at ``p - 1``; :func:`compute_features`).
    ``subdir``: only the shards under ``data_dir/subdir`` (features still found relative to
    ``data_dir``). ``prompt_rounds``: only the shards of the first that many prompt rounds
    (:func:`shard_paths`)."""
    paths = select_shards(
      shard_paths(epath.Path(data_dir) / subdir if subdir else data_dir, prompt_rounds),
      shards_per_dir,
      skip_per_dir,
    )
    if not paths:
      raise FileNotFoundError(f'no shard_*.npz files in {data_dir}')
    loaded = [load_shard(p) for p in paths]
    width = max(d['tokens'].shape[1] for d in loaded) if max_len is None else max_len
    self.width = width
    self.feature_taps: tuple[int, ...] | None = None
    self._features = None
    feature_files = [features_path(p, data_dir, features_dir) for p in paths]
    have_features = all(f.exists() for f in feature_files)
    if features_dir is not None and have_features:
      recorded = feature_taps(features_dir)
      if recorded is None:
        raise FileNotFoundError(
          f'{features_dir} holds features but no {FEATURE_TAPS_FILE}: recompute them with '
          'data.compute_features (experiments/build_features.py)'
        )
      taps = {recorded}
    else:
      taps = {tuple(int(i) for i in d['feature_taps']) for d in loaded if 'feature_taps' in d}
    if taps and have_features:
      if len(taps) != 1:
        raise ValueError(f'shards under {data_dir} were collected with different taps: {taps}')
      self.feature_taps = taps.pop()
      starts = [np.concatenate([[0], np.cumsum(d['lengths'])[:-1]]) for d in loaded]
      self._features = [(_memory_map(f), start) for f, start in zip(feature_files, starts)]
      self._where = [(s, j) for s, d in enumerate(loaded) for j in range(len(d['lengths']))]
    self._labels = None
    if target_labels:
      label_files = [features_path(p, data_dir, features_dir, 'labels') for p in paths]
      missing = [str(f) for f in label_files if not f.exists()]
      if missing or self._features is None:
        raise FileNotFoundError(
          f'target labels asked for, but {len(missing)} label files are missing (first: '
          f'{(missing or ["features"])[0]}); compute them with data.compute_features'
        )
      self._labels = [_memory_map(f) for f in label_files]

    def fit(x):
      x = x[:, :width]
      return np.pad(x, ((0, 0), (0, width - x.shape[1])))

    self.tokens = np.concatenate([fit(d['tokens']).astype(np.int32) for d in loaded])
    self.loss_mask = np.concatenate([fit(d['loss_mask']) for d in loaded])
    self.lengths = np.minimum(np.concatenate([d['lengths'] for d in loaded]), width)

  def __len__(self) -> int:
    return len(self.tokens)

  def __getitem__(self, i: int) -> dict:
    item = dict(tokens=self.tokens[i], loss_mask=self.loss_mask[i], lengths=self.lengths[i])
    if self._features is not None:
      shard, j = self._where[i]
      rows, offsets = self._features[shard]
      n = int(self.lengths[i])
      feats = np.zeros((self.width, rows.shape[1]), np.float32)
      feats[:n] = rows[offsets[j] : offsets[j] + n]
      item['features'] = feats
      if self._labels is not None:
        labels = np.array(self.tokens[i])  # position 0 has no prediction: its own token
        labels[1:n] = self._labels[shard][offsets[j] : offsets[j] + n - 1]
        item['labels'] = labels
    return item

  def response_token_counts(self, vocab_size: int) -> np.ndarray:
    """How often each token id occurs among the response tokens (``[vocab_size]``)."""
    return np.bincount(self.tokens[self.loss_mask > 0], minlength=vocab_size)[:vocab_size]

  @property
  def num_tokens(self) -> int:
    return int(self.lengths.sum())


def _memory_map(path) -> np.ndarray:
  if '://' in str(path):
    raise ValueError(
      f'features are memory-mapped from a local disk, not {path}: set data.features_dir to a '
      'local directory (a cache that compute_features rebuilds from the shards)'
    )
  return np.load(os.fspath(path), mmap_mode='r')


def make_batches(source: TokenShards, global_batch: int, seed: int) -> grain.MapDataset:
  """Shuffled (per epoch), repeated, batched; ``ds[step]`` is the batch of that step.

  Each batch carries ``index = arange(global_batch)``: the position of each sequence in the
  global batch, from which its anchor-sampling key is derived (so a sharded step draws the same
  anchors as a single-device one).
  """
  if len(source) < 1:
    raise ValueError('empty dataset')

  def with_index(batch):
    return {**batch, 'index': np.arange(global_batch, dtype=np.int32)}

  ds = grain.MapDataset.source(source).shuffle(seed=seed).repeat(None)
  return ds.batch(global_batch, drop_remainder=True).map(with_index)
