"""Models: building them from presets, folders, bundled configs or the hub; quantization, adapters,
activation checkpointing and the attention implementation.
"""
