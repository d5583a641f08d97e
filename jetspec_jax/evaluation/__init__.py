"""Public benchmarks: prompt sets from packages, stored greedy responses, tree walks, results."""
