"""The experiments' tasks: one module per job, run by the verb binaries in experiments/."""
