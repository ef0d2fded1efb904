"""The simulated step: one training step of the engine on fake tensors, its quantized and vision parts, the
parallel layouts emulated inside it, and the cache of simulated steps."""
