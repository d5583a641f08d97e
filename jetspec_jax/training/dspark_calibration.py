"""Held-out outcomes for calibrating a DSpark head's confidences (sequential temperature scaling).

For sequences of greedy self-distilled data (the data's next token *is* the target's argmax), each
sampled anchor's block is drafted the way a greedy round drafts it (the Markov stage fed its own
argmax) and every drafted token is compared with the data: ``accepted[k]`` is the T=0 acceptance
event of token ``k`` given that tokens ``< k`` matched. No target forward runs: the data stores the
target's features. :func:`fit_temperatures` turns the records into temperatures; the
statistics (ECE, survival, sequential temperature scaling) are host-side numpy, below.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.methods import dspark
from jetspec_jax.models import decoder
from jetspec_jax.models import draft_head as dh
from jetspec_jax.training import head_sums


@functools.partial(jax.jit, static_argnames=('num_anchors',))
def _sequence_records(
  head: dh.DraftHead, target: decoder.Target, item: dict, key, num_anchors: int
):
  cfg = head.cfg
  num_tap = cfg.num_taps * cfg.hidden_size
  features = item['features'][:, :num_tap].astype(head.dtype)
  blk, inputs = head_sums.dspark_blocks(
    key, item['tokens'], item['loss_mask'], item['lengths'], cfg, num_anchors
  )
  hidden = head_sums.head_block_outputs(head.params, cfg, target, features, inputs)
  draft = dspark.draft_chain(head, target, hidden, blk.targets[:, 0], key, 0.0)
  return draft.confidence_logits, draft.tokens == blk.targets[:, 1:], blk.valid[:, 1:]


def calibration_records(
  head: dh.DraftHead, target: decoder.Target, source, *, num_anchors: int = 16, seed: int = 0
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


# Calibration: sequential temperature scaling (host side, numpy).

TEMPERATURE_GRID = tuple(np.round(np.exp(np.linspace(np.log(0.1), np.log(10.0), 81)), 4))


def expected_calibration_error(prob, outcome, valid=None, num_bins: int = 15) -> float:
  """ECE of predicted probabilities against 0/1 (or soft) outcomes: the population-weighted
  mean of ``|mean(prob) - mean(outcome)|`` over ``num_bins`` equal-width bins of ``prob``."""
  prob, outcome = np.asarray(prob, np.float64).ravel(), np.asarray(outcome, np.float64).ravel()
  if valid is not None:
    keep = np.asarray(valid, bool).ravel()
    prob, outcome = prob[keep], outcome[keep]
  if prob.size == 0:
    return float('nan')
  bins = np.minimum((prob * num_bins).astype(int), num_bins - 1)
  count = np.bincount(bins, minlength=num_bins)
  gap = np.abs(
    np.bincount(bins, prob, num_bins) - np.bincount(bins, outcome, num_bins)
  )  # per bin: |sum(prob) - sum(outcome)|
  return float(gap.sum() / count.sum())


def cumulative_survival(logits, temperatures) -> np.ndarray:
  """``a_k = prod_{i<=k} sigmoid(logit_i / t_i)`` for confidence logits ``[N, gamma]``."""
  logits = np.asarray(logits, np.float64)
  return np.cumprod(1.0 / (1.0 + np.exp(-logits / np.asarray(temperatures)[None])), axis=1)


def survival_ece(logits, accepted, valid, temperatures) -> np.ndarray:
  """Per-position ECE ``[gamma]`` of the survival ``a_k`` against "x_1..x_k all accepted"."""
  accepted, valid = np.asarray(accepted, bool), np.asarray(valid, bool)
  alive = np.cumprod(accepted, axis=1)
  a = cumulative_survival(logits, temperatures)
  return np.array(
    [expected_calibration_error(a[:, k], alive[:, k], valid[:, k]) for k in range(a.shape[1])]
  )


def fit_temperatures(logits, accepted, valid, grid=TEMPERATURE_GRID) -> np.ndarray:
  """Sequential temperature scaling: position by position, left to right, the temperature (from
  ``grid``) that minimises the ECE of the cumulative product, earlier positions frozen.

  Args:
    logits: ``[N, gamma]`` confidence logits of drafted tokens (held-out data).
    accepted: ``bool[N, gamma]`` token ``k`` was accepted (meaningful where ``x_{<k}`` were).
    valid: ``bool[N, gamma]`` positions with an outcome.

  Returns:
    ``float32[gamma]`` temperatures.
  """
  logits = np.asarray(logits, np.float64)
  accepted, valid = np.asarray(accepted, bool), np.asarray(valid, bool)
  alive = np.cumprod(accepted, axis=1)
  gamma = logits.shape[1]
  temps = np.ones(gamma)
  prefix = np.ones(logits.shape[0])
  for k in range(gamma):
    best, best_ece = 1.0, np.inf
    for t in grid:
      a = prefix / (1.0 + np.exp(-logits[:, k] / t))
      ece = expected_calibration_error(a, alive[:, k], valid[:, k])
      if ece < best_ece - 1e-12:
        best, best_ece = float(t), ece
    temps[k] = best
    prefix = prefix / (1.0 + np.exp(-logits[:, k] / best))
  return temps.astype(np.float32)
