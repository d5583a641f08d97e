"""Held-out outcomes for calibrating a DSpark head's confidences (sequential temperature scaling).

For sequences of greedy self-distilled data (the data's next token *is* the target's argmax), each
sampled anchor's block is drafted the way a greedy round drafts it (the Markov stage fed its own
argmax) and every drafted token is compared with the data: ``accepted[k]`` is the T=0 acceptance
event of token ``k`` given that tokens ``< k`` matched. No target forward runs: the data stores the
target's features. :func:`jetspec_jax.dspark.fit_temperatures` turns the records into
temperatures.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax import dspark
from jetspec_jax.models import draft_head as dh
from jetspec_jax.models import qwen3
from jetspec_jax.training import head_trainer


@functools.partial(jax.jit, static_argnames=('num_anchors',))
def _sequence_records(head: dh.DraftHead, target: qwen3.Target, item: dict, key, num_anchors: int):
  cfg = head.cfg
  num_tap = cfg.num_taps * cfg.hidden_size
  features = item['features'][:, :num_tap].astype(head.dtype)
  blk, inputs = head_trainer.dspark_blocks(
    key, item['tokens'], item['loss_mask'], item['lengths'], cfg, num_anchors
  )
  hidden = head_trainer.head_block_outputs(head.params, cfg, target, features, inputs)
  draft = dspark.draft_chain(head, target, hidden, blk.targets[:, 0], key, 0.0)
  return draft.confidence_logits, draft.tokens == blk.targets[:, 1:], blk.valid[:, 1:]


def calibration_records(
  head: dh.DraftHead, target: qwen3.Target, source, *, num_anchors: int = 16, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Confidence logits (uncalibrated), acceptance and validity ``[N, gamma]`` over ``source``.

  Args:
    source: a :class:`~jetspec_jax.training.data.TokenShards` of greedy data with features.
    num_anchors: blocks per sequence.
  """
  if head.cfg.kind != 'dspark':
    raise ValueError(f'calibration is for DSpark heads, got a {head.cfg.kind} head')
  if source.feature_taps is None:
    raise ValueError('calibration needs data with stored target features')
  if source.feature_taps != tuple(head.cfg.target_layer_ids):
    raise ValueError(
      f'the data stores taps {source.feature_taps}, the head reads {head.cfg.target_layer_ids}'
    )
  records = []
  for i in range(len(source)):
    item = {k: jnp.asarray(v) for k, v in source[i].items()}
    key = jax.random.fold_in(jax.random.key(seed), i)
    records.append(jax.device_get(_sequence_records(head, target, item, key, num_anchors)))
  logits, accepted, valid = (np.concatenate(x) for x in zip(*records))
  return logits, accepted, valid
