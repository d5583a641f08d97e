"""absl experiment binaries, one per verb (train, data, evaluate, benchmark, microbench,
demo); run as ``python -m experiments.<verb> [--task=NAME] --config=... --workdir=...``.
Their jobs live in ``experiments/tasks/``; the index is experiments/README.md."""
