"""Searches over plans: the alternatives that fit, the GPUs and clusters to run on and what they cost, the
run's length, plans at the data's own lengths."""
