"""Self-distilled training data (spec §C.1): the target regenerates the response to each prompt.

On disk: ``shard_00000.npz`` ... each with ``tokens int32[N, L]`` (prompt + response, right-padded
with 0), ``loss_mask uint8[N, L]`` (1 on response tokens) and ``lengths int32[N]``. Shards are
written atomically, so generation resumes by skipping finished shards. Training reads them through
``grain`` as one random-access source, shuffled per epoch, batched; batch ``s`` is a pure function
of ``(seed, s)``, so the data position of a resumed run is just its step.
"""

import json
import os
import pathlib
import time
from collections.abc import Callable, Iterable, Sequence

import grain
import numpy as np
from tqdm import tqdm

from jetspec_jax import decoding
from jetspec_jax.models import qwen3

SHARD_PATTERN = 'shard_{:05d}.npz'


def read_prompts_jsonl(
  path: str | os.PathLike, tokenize: Callable[[str], Sequence[int]] | None = None
):
  """Prompts from a JSON-lines file: ``{"prompt_ids": [...]}`` or ``{"prompt": "text"}``.

  Text prompts need ``tokenize``.
  """
  prompts = []
  with open(path) as f:
    for line_no, line in enumerate(f, 1):
      if not line.strip():
        continue
      record = json.loads(line)
      if 'prompt_ids' in record:
        prompts.append(np.asarray(record['prompt_ids'], np.int32))
      elif 'prompt' in record:
        if tokenize is None:
          raise ValueError(f'{path}:{line_no} has a text prompt but no tokenizer was given')
        prompts.append(np.asarray(tokenize(record['prompt']), np.int32))
      else:
        raise ValueError(f'{path}:{line_no} has neither "prompt_ids" nor "prompt"')
  return prompts


def prompts_from_config(data_config, vocab_size: int) -> list[np.ndarray]:
  """Training prompts from ``data_config.prompts``.

  * ``'random'``: ``num_prompts`` random prompts with lengths in ``prompt_len``;
  * ``'stdlib_functions'``: signatures + docstrings of documented functions in the standard
    library's training split (not the held-out ``validation_modules``), tokenized with the
    tokenizer at ``tokenizer``;
  * otherwise a JSON-lines path (see :func:`read_prompts_jsonl`).
  """
  if data_config.prompts == 'stdlib_functions':
    from jetspec_jax import prompts as prompts_lib
    from jetspec_jax.tokenizer import Tokenizer
    from jetspec_jax.training import lm

    train_files, _ = lm.stdlib_files(tuple(data_config.validation_modules))
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
  return read_prompts_jsonl(data_config.prompts)[: data_config.num_prompts or None]


def generate_dataset(
  target: qwen3.Target,
  prompts: Sequence[Sequence[int]] | Callable[[], Iterable[Sequence[int]]],
  out_dir: str | os.PathLike,
  *,
  max_len: int,
  max_new_tokens: int,
  shard_size: int = 64,
  batch_size: int = 16,
  temperature: float = 0.0,
  seed: int = 0,
  eos: int | None = None,
  progress: bool = True,
) -> list[pathlib.Path]:
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
    seed: sampling seed (folded with the shard index).
    eos: stop token (defaults to the target's).

  Returns:
    The shard paths, in order.
  """
  if callable(prompts):
    prompts = list(prompts())
  prompts = [np.asarray(p, np.int32) for p in prompts]
  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  eos = target.cfg.eos_token_id if eos is None else eos
  paths = []
  bar = tqdm(total=len(prompts), desc='generate', unit='prompt', disable=not progress)
  tokens_done, start = 0, time.perf_counter()
  for shard_idx, first in enumerate(range(0, len(prompts), shard_size)):
    path = out_dir / SHARD_PATTERN.format(shard_idx)
    paths.append(path)
    chunk = prompts[first : first + shard_size]
    if path.exists():  # finished by an earlier run
      bar.update(len(chunk))
      continue
    sequences, masks = [], []
    for b in range(0, len(chunk), batch_size):
      batch = chunk[b : b + batch_size]
      outputs = decoding.generate(  # batched, jitted AR; each row stops at its own EOS
        target,
        None,
        list(batch),
        method='ar',
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        seed=seed * 100_003 + shard_idx * 1_009 + b,
        eos_id=eos,
      )
      responses = [o.tokens for o in outputs]
      for prompt, response in zip(batch, responses):
        seq = np.concatenate([prompt, response])[:max_len]
        mask = np.concatenate([np.zeros(len(prompt), np.uint8), np.ones(len(response), np.uint8)])
        sequences.append(seq)
        masks.append(mask[:max_len])
        tokens_done += len(response)
      bar.update(len(batch))
      bar.set_postfix(tokens_per_s=f'{tokens_done / (time.perf_counter() - start):.0f}')
    write_shard(path, sequences, masks, max_len)
  bar.close()
  return paths


def generate_from_config(config, target: qwen3.Target, data_dir) -> list[pathlib.Path]:
  """:func:`generate_dataset` with the prompts and settings of an experiment config."""
  return generate_dataset(
    target,
    prompts_from_config(config.data, target.cfg.vocab_size),
    data_dir,
    max_len=config.data.max_len,
    max_new_tokens=config.data.max_new_tokens,
    shard_size=config.data.shard_size,
    batch_size=config.data.generate_batch,
    temperature=config.data.temperature,
    seed=config.seed,
  )


def write_shard(path: pathlib.Path, sequences, masks, max_len: int) -> None:
  """Writes one shard atomically (temp file + rename)."""
  n = len(sequences)
  tokens = np.zeros((n, max_len), np.int32)
  loss_mask = np.zeros((n, max_len), np.uint8)
  lengths = np.array([len(s) for s in sequences], np.int32)
  for i, (seq, mask) in enumerate(zip(sequences, masks)):
    tokens[i, : len(seq)] = seq
    loss_mask[i, : len(mask)] = mask
  tmp = path.with_name(path.name + '.tmp.npz')
  np.savez(tmp, tokens=tokens, loss_mask=loss_mask, lengths=lengths)
  os.replace(tmp, path)


class TokenShards:
  """All shards of a directory as one random-access source (grain's data-source protocol)."""

  def __init__(self, data_dir: str | os.PathLike, max_len: int | None = None):
    paths = sorted(pathlib.Path(data_dir).glob('shard_*.npz'))
    paths = [p for p in paths if not p.name.endswith('.tmp.npz')]
    if not paths:
      raise FileNotFoundError(f'no shard_*.npz files in {data_dir}')
    loaded = [np.load(p) for p in paths]
    width = max(d['tokens'].shape[1] for d in loaded) if max_len is None else max_len

    def fit(x):
      x = x[:, :width]
      return np.pad(x, ((0, 0), (0, width - x.shape[1])))

    self.tokens = np.concatenate([fit(d['tokens']) for d in loaded])
    self.loss_mask = np.concatenate([fit(d['loss_mask']) for d in loaded])
    self.lengths = np.minimum(np.concatenate([d['lengths'] for d in loaded]), width)

  def __len__(self) -> int:
    return len(self.tokens)

  def __getitem__(self, i: int) -> dict:
    return dict(tokens=self.tokens[i], loss_mask=self.loss_mask[i], lengths=self.lengths[i])

  @property
  def num_tokens(self) -> int:
    return int(self.lengths.sum())


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
