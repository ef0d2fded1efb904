"""The planner: predicts per-device memory and step time by running the engine's step on fake tensors,
then adds what simulation cannot see (sharding, the caching allocator, CUDA kernels, communication).
"""
