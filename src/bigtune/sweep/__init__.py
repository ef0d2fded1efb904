"""Ladders of variants, each run in its own process so an out-of-memory is a result, and their report."""
