"""The device model: the CUDA caching allocator replayed, the kernels CUDA would pick, and the roofline of
the simulated operators."""
