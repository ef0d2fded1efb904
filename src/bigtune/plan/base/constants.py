"""The planner's constants for what simulation cannot see (measured where a GPU run has, else assumed) and its
error type."""

from __future__ import annotations

GIB = 1024**3

CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_device",
    "optimizer_cpu",
    "activations",
    "allocated",
    "peak_allocated",
    "phase_peak",
    "phase_peak_activations",
    "phase_peak_activations_late",
    "phase_gradients_pending_late",
)

# --- CUDA targets: what the device holds outside PyTorch's caching allocator ---
# Measured: cudaMemGetInfo's used bytes minus torch's reserved at the peak of a training step, 766.9 MiB in
# three runs and 768.9 MiB in a fourth (BLIP-2, whose vision tower loads more kernels) on an H200 with torch
# 2.11 and CUDA 13.0 (bench/results/plan_accuracy-h200.json, measured_outside_allocator). It is the CUDA
# context with the kernel modules a step loads lazily (0.51 GiB before the first kernel). Other cards and
# CUDA versions are not measured yet: a card with fewer SMs holds somewhat less.
CUDA_CONTEXT_BYTES = 767 * 2**20
CUDA_CONTEXT_BASIS = "measured on an H200 with CUDA 13.0 (other cards not yet)"

ZERO_ALTERNATIVE = "deepspeed_stage_3_offload"  # the DeepSpeed strategy --alternatives tries on several GPUs

CUBLAS_HANDLES = 2  # cuBLAS workspaces a training step creates (see plan())

# Not a safety margin but a statement of what the planner knows: its median absolute error on published
# GPU peaks is about 5 % (bench/results/published-cpu-2026-11-23.json, peak allocated 5.2 %). A plan whose
# need lies within this fraction of the card of the FITS line is called tight: either verdict may turn.
FIT_UNCERTAINTY = 0.05

HOST_UPDATE_GBS = 40.0  # GB/s a many-core CPU Adam streams through its state (assumed)

PCIE_GBS = 25.0  # GB/s one direction, PCIe 4 x16 in practice (assumed)


class PlanError(ValueError):
    """The recipe cannot be planned as given (unknown model config, unsupported family...)."""


HOST_BASE_BYTES = 2 * GIB  # interpreter, torch, tokenizer/processor, data
