"""Memory measurement: per-category snapshots at four phases of a step, from CUDA's allocator or, on a
CPU, from a tracker of live tensor storages.
"""
