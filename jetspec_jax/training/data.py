"""Self-distilled training data (docs/training.md §1): the target regenerates the response to
each prompt, greedy and sampled, into token shards (:mod:`jetspec_jax.training.shards`).
"""

import os
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np
from absl import logging
from etils import epath
from tqdm import tqdm

from jetspec_jax import decoding, sharding
from jetspec_jax.models import decoder
from jetspec_jax.tokenizer import Tokenizer
from jetspec_jax.training import prompt_io
from jetspec_jax.training import shards as shards_lib


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
      (:class:`shards_lib.ShardClaim`): each shard is written once, by the process that claimed it.
    wait: return only once every shard of this process's share exists, the ones other
      processes claimed included (polling every ``poll_s`` seconds and taking over a shard
      whose claimer is gone); readers of the whole set need it.
    feature_taps: also store each token's target features (taps of these layers + final
      hidden state, float16) collected during generation, so training needs no target pass
      (``shard_*.features.npy``, see :func:`shards_lib.write_shard`).

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
  paths = [out_dir / shards_lib.SHARD_PATTERN.format(i) for i in range(len(chunks))]
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
    shards_lib.write_shard(
      paths[shard_idx], sequences, masks, max_len, features or None, feature_taps
    )

  # Another host's shards (multi-host: process i of n writes every n-th) are left to it.
  ours = [i for i in wanted if i % jax.process_count() == jax.process_index()]
  bar.update(sum(len(chunks[i]) for i in ours if paths[i].exists()))
  while True:
    # Processes started side by side on one directory (not one multi-host job) split its shards
    # as they go: each shard is generated by the process that claims it first, and only once.
    for shard_idx in ours:
      with shards_lib.ShardClaim(paths[shard_idx]) as claimed:
        if claimed and not paths[shard_idx].exists():
          generate_shard(shard_idx)
    missing = [i for i in ours if not paths[i].exists()]
    if not wait or not missing:
      break
    time.sleep(poll_s)  # the missing shards are another process's, being written now
  bar.close()
  return paths


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
  (:func:`prompt_io.prompts_and_stops`; or pass ``prompts`` and ``eos`` already read).
  """
  if prompts is None:
    prompts, eos = prompt_io.prompts_and_stops(config.data, target.cfg.vocab_size, load_tokenizer)
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
  return shards_lib.shard_paths(data_dir)
