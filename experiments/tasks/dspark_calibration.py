"""Calibrates a DSpark head's confidences by sequential temperature scaling on held-out data.

  python -m experiments.data --task=dspark_calibration --head=$HOME/jetspec_runs/dspark/export \
      --data_dir=$HOME/jetspec_runs/smollm2_data/data/greedy --fit_shards=6,1 --eval_shards=7,1 \
      --out=assets/dspark_head_smollm2_135m --dtype=bfloat16

Greedy self-distilled shards the head never trained on (``SKIP,COUNT``: skip the first SKIP
shards, take COUNT) give, per drafted token, its confidence logit and whether greedy verification
would accept it (:mod:`jetspec_jax.training.dspark_calibration`). Temperatures are fitted on the
``fit`` shards; the per-position ECE of the survival ``prod c_k`` is reported on the ``eval``
shards before and after. Writes the head to ``--out`` with its temperatures if they lower the
held-out mean ECE (else uncalibrated, unless ``--keep_worse``) and the numbers to
``--out/calibration.json``.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags, logging

import jetspec_jax as js
from jetspec_jax.training import dspark_calibration
from jetspec_jax.training import shards as shards_lib

FLAGS = flags.FLAGS


def shards(spec: str):
  skip, count = (int(x) for x in spec.split(','))
  return shards_lib.TokenShards(
    FLAGS.data_dir,
    FLAGS.max_len,
    shards_per_dir=count,
    skip_per_dir=skip,
    features_dir=FLAGS.features_dir,
    subdir=FLAGS.subdir,
  )


def calibrate(head, target, fit_source, eval_source, num_anchors: int) -> tuple[np.ndarray, dict]:
  fit = dspark_calibration.calibration_records(head, target, fit_source, num_anchors=num_anchors)
  held = dspark_calibration.calibration_records(
    head, target, eval_source, num_anchors=num_anchors, seed=1
  )
  temps = dspark_calibration.fit_temperatures(*fit)
  gamma = head.cfg.block_size
  before = dspark_calibration.survival_ece(*held, np.ones(gamma))
  after = dspark_calibration.survival_ece(*held, temps)
  logits, accepted, valid = held
  alive = np.cumprod(accepted, axis=1)
  report = dict(
    temperatures=temps.tolist(),
    ece_before=before.tolist(),
    ece_after=after.tolist(),
    mean_ece_before=float(np.nanmean(before)),
    mean_ece_after=float(np.nanmean(after)),
    acceptance_rate=[float(alive[valid[:, k], k].mean()) for k in range(gamma)],
    fit_blocks=int(fit[2][:, 0].sum()),
    eval_blocks=int(valid[:, 0].sum()),
  )
  return temps, report


def main(argv):
  del argv
  path = FLAGS.target
  if path in js.model_cache.PACKAGED_MODELS:
    path = js.model_cache.resolve_model_path(path)
  target = js.load_target(path)
  head = js.load_draft_head(FLAGS.head, target, dtype=jnp.float32)
  temps, report = calibrate(
    head, target, shards(FLAGS.fit_shards), shards(FLAGS.eval_shards), FLAGS.num_anchors
  )
  report.update(
    head=FLAGS.head,
    data_dir=FLAGS.data_dir,
    subdir=FLAGS.subdir,
    fit_shards=FLAGS.fit_shards,
    eval_shards=FLAGS.eval_shards,
    device=jax.devices()[0].device_kind,
  )
  applied = FLAGS.keep_worse or report['mean_ece_after'] < report['mean_ece_before']
  report['applied'] = bool(applied)
  out = pathlib.Path(FLAGS.out)
  calibrated = head.replace(calibration=jnp.asarray(temps) if applied else None)
  js.save_draft_head(calibrated, out, dtype=jnp.dtype(FLAGS.dtype))
  (out / 'calibration.json').write_text(json.dumps(report, indent=2))
  logging.info('ECE per position before %s after %s', report['ece_before'], report['ece_after'])
  print(json.dumps(report, indent=2))


def define_flags() -> None:
  """This task's command-line flags (the verb binary defines them before parsing)."""
  flags.DEFINE_string('head', None, 'The DSpark head to calibrate (released layout).')
  flags.DEFINE_string('target', 'smollm2_135m_instruct', 'Packaged model name or checkpoint path.')
  flags.DEFINE_string('data_dir', None, 'Greedy self-distilled shards with stored features.')
  flags.DEFINE_string('features_dir', None, 'Where their features are, if not beside the shards.')
  flags.DEFINE_string('subdir', None, "Only the shards under data_dir/subdir (e.g. 'greedy').")
  flags.DEFINE_string('fit_shards', '6,1', 'SKIP,COUNT of the shards the temperatures are fit on.')
  flags.DEFINE_string('eval_shards', '7,1', 'SKIP,COUNT of the shards the ECE is reported on.')
  flags.DEFINE_integer('num_anchors', 16, 'Blocks per sequence.')
  flags.DEFINE_integer('max_len', 480, 'Sequence length of the data.')
  flags.DEFINE_string('out', None, 'Where the calibrated head goes.')
  flags.DEFINE_enum('dtype', 'bfloat16', ['bfloat16', 'float32'], 'Parameter dtype written.')
  flags.DEFINE_bool('keep_worse', False, 'Store the temperatures even if held-out ECE got worse.')
  flags.mark_flags_as_required(['head', 'data_dir', 'out'])
