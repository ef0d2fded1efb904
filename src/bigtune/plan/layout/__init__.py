"""Parallel layouts over the simulated step: what each rank holds under sharding, tensor and pipeline
parallelism, and the step time on the target."""
