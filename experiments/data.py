"""Data: self-distilled token shards, their target-feature cache, and what is calibrated on them.

  python -m experiments.data --config=experiments/configs/train/draft_smollm2.py \
      --workdir=data/smollm2_135m

Tasks (``--task``): ``generate`` (default; the target answers each prompt,
``tasks/generate_data.py``),
``features`` (the feature cache in parallel processes, ``tasks/build_features.py``),
``copy_priors`` (how often copy candidates are right, ``tasks/copy_priors.py``),
``dspark_calibration`` (a DSpark head's confidence temperatures, ``tasks/dspark_calibration.py``).
"""

from experiments.tasks import verb

TASKS = dict(
  generate='experiments.tasks.generate_data',
  features='experiments.tasks.build_features',
  copy_priors='experiments.tasks.copy_priors',
  dspark_calibration='experiments.tasks.dspark_calibration',
)

if __name__ == '__main__':
  verb.run(TASKS, default='generate', compile_cache=True)
