"""absl experiment binaries; run as ``python -m experiments.<binary> --config=...``."""
