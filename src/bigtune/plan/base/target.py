"""What a plan is for (a device, a GPU model, a count, a strategy) and what it predicts (``Plan``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from bigtune.plan.base.constants import FIT_UNCERTAINTY, GIB


@dataclass
class Target:
    """Where the recipe would run: a CPU, or ``gpus`` × a catalog GPU."""

    device: str = "cpu"
    gpu: Any = None
    gpus: int = 1
    strategy: str = "single"  # single | ddp | fsdp | deepspeed_stage_*  (analytic on top of 1 GPU)
    # GPUs of a tensor-parallel group (strategy fsdp: FSDP2's 2-D mesh); the planner sets it from the recipe
    tensor_parallel: int = 1
    # pipeline stages, one per GPU (recipe pipeline_parallel = gpus); the planner sets it from the recipe
    pipeline_parallel: int = 1

    @property
    def data_parallel(self) -> int:
        """Ranks that read different micro-batches (and FSDP shards the model states over)."""
        return max(1, self.gpus // (self.tensor_parallel * self.pipeline_parallel))

    @property
    def capacity_bytes(self) -> Optional[int]:
        return int(self.gpu.memory_gib * GIB) if self.gpu is not None else None

    def label(self) -> str:
        if self.gpu is None:
            return "cpu"
        tp = f", tensor_parallel={self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        if self.pipeline_parallel > 1:
            return f"{self.gpus}× {self.gpu.key} (pipeline_parallel={self.pipeline_parallel})"
        return f"{self.gpus}× {self.gpu.key}" + (f" ({self.strategy}{tp})" if self.gpus > 1 else "")


def run_strategy(strategy: str, gpus: int) -> str:
    """The strategy a recipe's ``strategy`` runs with on ``gpus`` devices, as a Target names it: DeepSpeed
    as given (also on one GPU, for offload), ddp/fsdp as given on several, auto/single → ddp on several
    (what the engine does), else single."""
    if strategy.startswith("deepspeed"):
        return strategy
    if gpus <= 1:
        return "single"
    return strategy if strategy in ("ddp", "fsdp") else "ddp"


def target_arch(target: "Target") -> Optional[tuple[int, int]]:
    """The compute capability a CUDA target's kernels are chosen for (None on a CPU)."""
    from bigtune.core.gpus import compute_capability

    return compute_capability(target.gpu) if target.device == "cuda" else None


@dataclass
class Plan:
    recipe_name: str
    target: str
    variant: str
    phases: dict[str, dict[str, int]]
    peak_allocated: int
    peak_reserved: Optional[int]
    overhead: int
    peak_total: int
    capacity: Optional[int]
    fits: Optional[bool]
    parameters_total: int
    step_time_s: Optional[float]
    tokens_per_s: Optional[float]
    tokens_per_step: int
    notes: list[str] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)
    plan_seconds: float = 0.0
    # What must fit the device (FITS/OOM): the allocator's in-use segments at the peak + context; less
    # than peak_total, which is what a device with room to spare ends up reserving.
    needed_total: Optional[int] = None
    # `plan --data-lengths` (datalengths.py): the data's longest sample, mean padded batch, mean tokens.
    data_lengths: Optional[dict] = None
    # Host RAM per node a GPU run needs (the larger of loading and training), where the planner models it
    # (a torchao NF4 base: loaded tensor by tensor, shards in host RAM with fsdp_cpu_offload); None elsewhere.
    host_bytes_per_node: Optional[int] = None
    # A chat vision-language model (Qwen2-VL kind): the (t, h, w) image grid of each row of the micro-batch it
    # was simulated with (the processor's worst case unless given), so that a measured batch of the same
    # images compares with this plan instead of planning the same step again (run/compare.py).
    image_grids: Optional[list[list[int]]] = None

    def to_dict(self) -> dict:
        """The plan as JSON data (``plan --json``). On a CUDA target ``peak_reserved`` is always a number, and
        ``peak_reserved_basis`` says which: "replayed" (the caching-allocator replay's figure) or "at least"
        (no replay was run: the peak allocated alone exceeds the card, so no replay could change the OOM; the
        allocator reserves at least the peak allocated, and the figure is that lower bound). On a CPU both are
        null (no caching allocator)."""
        out = {**dataclasses.asdict(self), "tight": self.tight, "peak_reserved_basis": self.reserved_basis}
        if self.reserved_basis == "at least":
            out["peak_reserved"] = self.peak_allocated
        return out

    @property
    def reserved_basis(self) -> Optional[str]:
        """ "replayed", "at least" (a CUDA plan without a replay: the peak allocated bounds reserved from below)
        or None (a CPU plan)."""
        if self.peak_reserved is not None:
            return "replayed"
        return "at least" if self.overhead else None  # the CUDA context (overhead) is counted on CUDA only

    @property
    def tight(self) -> bool:
        """FITS or OOM by less than the planner's typical error (FIT_UNCERTAINTY of the card)."""
        if self.capacity is None:
            return False
        need = self.needed_total or self.peak_total
        return abs(need - self.capacity) <= FIT_UNCERTAINTY * self.capacity

    @property
    def model_states(self) -> dict[str, int]:
        p = self.phases.get("after_backward", {})
        return {c: p.get(c, 0) for c in ("parameters", "gradients", "optimizer_device", "optimizer_cpu")}
