"""The planner's assumed constants (each until calibrated on GPU runs) and its error type."""

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

# --- assumptions for CUDA targets (not seen by simulation; uncalibrated until GPU runs are committed) ---
CUDA_CONTEXT_BYTES = int(0.5 * GIB)  # CUDA context + cuBLAS/cuDNN handles outside PyTorch's allocator

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
