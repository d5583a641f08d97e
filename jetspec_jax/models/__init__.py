"""Target and draft-head models."""
