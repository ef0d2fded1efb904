"""Measured memory, per category and per phase of a training step.

On CUDA the totals come from the caching allocator. On CPU there is no allocator to ask, so a
``LiveTensorTracker`` (a TorchDispatchMode) registers the storage behind every tensor an op
returns and notices, through a weak reference, when that storage dies: live bytes and their peak
are then exact for everything created while it runs, plus what it was told about at the start
(parameters, gradients, optimizer state, the batch). The same tracker runs over fake tensors in the
planner, which is why planned and measured CPU figures can be compared byte for byte.

Categories (the words are shared with the planner): parameters, gradients, optimizer state on the
device and on the CPU, activations (= allocated − the rest: saved tensors, the batch, buffers and,
with several devices, communication buffers), allocated, peak allocated, reserved.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch

from bigtune.core.stepmath import GIB, storage_bytes
from bigtune.memory.tracker import LiveTensorTracker

PHASES = ("before_forward", "after_forward", "after_backward", "after_optimizer")


@dataclass
class Snapshot:
    step: int
    phase: str
    parameters: int
    gradients: int
    optimizer_device: int
    optimizer_cpu: int
    activations: int
    allocated: int
    peak_allocated: int
    reserved: Optional[int]
    peak_reserved: Optional[int]
    device: str
    # The most allocated since the previous phase's snapshot (CPU tracker only; the planner uses it
    # to tell a forward peak from a backward one): None where the allocator cannot say.
    phase_peak: Optional[int] = None
    # The same phase's high of what is not a model state (activations, temporaries), where the tracker
    # was told which storages are states (MemoryMonitor.follow_gradients, the planner's simulation).
    phase_peak_activations: Optional[int] = None
    # ... and its high from the backward's first repeated block on (or its first stored gradient; None
    # if neither came): what remains once the loss and logits are through and the blocks begin.
    phase_peak_activations_late: Optional[int] = None
    # Of the gradients this phase newly stored, how many bytes were still to come at that late high
    # (U + G - W for U that high, G the new gradients, W the late high counting them: U + G/n - this/n
    # bounds the high of a rank holding 1/n of each gradient, exact when both highs coincide).
    phase_gradients_pending_late: Optional[int] = None
    # CUDA: bytes in use on the whole device (cudaMemGetInfo: total - free), as nvidia-smi/nvtop show
    # it: the caching allocator's reserved memory plus the CUDA context and anything outside PyTorch
    # (other processes too). None on the CPU.
    device_used: Optional[int] = None
    # CPU tracker: the (peak, non-state peak) of each segment of this phase's window, in order (the engine
    # marks the end of every micro-batch's forward and backward; the snapshot closes the last one).
    # The planner extrapolates them one by one to the model's depth (simulate.simulate_full_depth).
    phase_segment_peaks: Optional[tuple] = None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        del out["phase_segment_peaks"]  # the planner's, not a record for the run's memory.jsonl
        return out


def zero_tensors(optimizer) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """What a DeepSpeed ZeRO optimizer holds outside the parameters and torch's optimizer state:
    (fp32 master partitions, flat gradient partitions, communication buckets); empty lists otherwise.

    The masters are optimizer state; the gradient partitions (bf16/fp32 flat buffers, and a master's
    fp32 gradient while it steps) are gradients; the reduce buckets are communication buffers, which
    stay in "activations" (the lab's "Other" on several GPUs), as in the planner.
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # Fabric wraps optimizers
    masters = [
        t
        for t in (
            getattr(inner, "single_partition_of_fp32_groups", None)
            or getattr(inner, "fp32_partitioned_groups_flat", None)
            or []
        )
        if isinstance(t, torch.Tensor)
    ]
    grads = [m.grad for m in masters if m.grad is not None]
    for name in ("grads_in_partition", "grad_partitions_flat_buffer"):
        t = getattr(inner, name, None)
        if isinstance(t, torch.Tensor):
            grads.append(t)
    # Reduced gradients waiting for the step: per group a list of tensors, or a flat buffer with them.
    averaged = getattr(inner, "averaged_gradients", None)
    for group in averaged.values() if isinstance(averaged, dict) else []:
        flat = getattr(group, "flat_partition", None)
        if isinstance(group, torch.Tensor):
            grads.append(group)
        elif isinstance(flat, torch.Tensor):
            grads.append(flat)
        elif isinstance(group, (list, tuple)):
            grads += [t for t in group if isinstance(t, torch.Tensor)]
    buckets: list[torch.Tensor] = []
    for b in (getattr(inner, "ipg_buckets", None) or {}).values():
        buf = getattr(b, "buffer", None)  # ZeRO-3: one flat tensor; ZeRO-1/2: a list of them
        if isinstance(buf, torch.Tensor):
            buckets.append(buf)  # (never iterate a tensor here: that would make one view per element)
        elif isinstance(buf, (list, tuple)):
            buckets += [t for t in buf if isinstance(t, torch.Tensor)]
    return masters, grads, buckets


def model_state_bytes(
    model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], device_type: str
) -> dict[str, int]:
    """Parameters, gradients and optimizer state (split device/CPU), from the tensors themselves."""
    # ZeRO-3 leaves an empty placeholder in each parameter; its partition is `ds_tensor`.
    own = fsdp_sharded_parameters(model) or list(model.parameters())
    params = [getattr(p, "ds_tensor", p) for p in own]
    grads = [p.grad for p in own if p.grad is not None] + fsdp_unsharded_gradients(model)
    # bitsandbytes 4-bit weights keep their block scales beside the packed data, on the Parameter itself
    # (under ZeRO-3 too, where only the packed data is partitioned into ds_tensor: the scales stay whole).
    quant = [t for p in own for t in _quant_state_tensors(p)]
    opt_dev: list[torch.Tensor] = []
    opt_cpu: list[torch.Tensor] = []

    def place(t: torch.Tensor) -> list[torch.Tensor]:
        # A 0-dim CPU `step` counter, or ZeRO-offloaded state, sits in host RAM even for CUDA training.
        return opt_cpu if (t.device.type == "cpu" and device_type != "cpu") else opt_dev

    inner = getattr(optimizer, "optimizer", optimizer)  # Fabric wraps optimizers
    masters, zero_grads, _ = zero_tensors(optimizer)
    for t in masters:
        place(t).append(t)
    for t in zero_grads:  # offloaded ZeRO gradient partitions live in host RAM beside the optimizer
        (grads if place(t) is opt_dev else opt_cpu).append(t)
    if getattr(inner, "offloaded", False):
        opt_cpu += inner.cpu_state_tensors()
    elif optimizer is not None:
        for state in optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    place(v).append(v)
    return {
        "parameters": storage_bytes(params + quant),
        "gradients": storage_bytes(grads),
        "optimizer_device": storage_bytes(opt_dev),
        "optimizer_cpu": storage_bytes(opt_cpu),
    }


def _fsdp_params(model: torch.nn.Module) -> Optional[list]:
    """FSDP2's per-parameter records of every unit (private state: None where a torch renames it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return []
    out: list = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        try:
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                one = getattr(state, "_fsdp_param_group", None)
                groups = [one] if one is not None else []
            out += [fp for g in groups for fp in g.fsdp_params]
        except AttributeError:
            return None
    return out


def fsdp_unsharded_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """FSDP2 between reduce-scatters (fsdp_grad_sync=step): the unsharded gradients it accumulates, on
    the gathered weight or, in the reduce dtype, beside it. Gradients, though no parameter shows them."""
    out = []
    for fp in _fsdp_params(model) or []:
        acc = getattr(fp, "unsharded_accumulated_grad", None)
        if acc is not None:
            out.append(acc)
        unsharded = fp.__dict__.get("_unsharded_param")
        if unsharded is not None and unsharded.grad is not None:
            out.append(unsharded.grad)
    return out


def fsdp_sharded_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """FSDP2: every parameter's own shard, also while its unit is gathered; [] for other models.

    While a unit is gathered its module holds the full weights, and model.parameters() yields them:
    they are communication buffers that the backward frees again, so the memory table counts them
    under activations, as the planner does, and only the shard as parameters. (FSDP2's per-module
    state is private; a torch that renames it falls back to model.parameters().)
    """
    return [fp.sharded_param for fp in _fsdp_params(model) or []]


def _quant_state_tensors(p: torch.Tensor) -> list[torch.Tensor]:
    qs = getattr(p, "quant_state", None)
    if qs is None:
        return []
    out = [qs.absmax, getattr(qs, "code", None)]
    nested = getattr(qs, "state2", None)
    if nested is not None:
        out += [nested.absmax, getattr(nested, "code", None)]
    return [t for t in out if isinstance(t, torch.Tensor)]


class MemoryMonitor:
    """Takes categorised snapshots at the four phases of the steps it is told to measure."""

    def __init__(self, device: torch.device, cap_bytes: Optional[int] = None, round_to: int = 1):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.tracker = None if self.is_cuda else LiveTensorTracker(cap_bytes, round_to)
        self.cap_bytes = cap_bytes
        self._active = False
        self._following = False  # follow_gradients() was called: phase_peak_activations is meaningful
        self._eager: Any = None  # torch.compiler.set_stance("force_eager") while the CPU tracker is on
        self.last: Optional[Snapshot] = None
        if self.is_cuda and cap_bytes is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)

    def begin_step(self, model: torch.nn.Module, optimizer, extra: Iterable[torch.Tensor] = ()) -> None:
        """Start measuring a step: reset peaks (and on CPU register what already exists)."""
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        assert self.tracker is not None
        self.tracker.clear()
        existing: list[Any] = [getattr(p, "ds_tensor", p) for p in model.parameters()]
        existing += [t for group in zero_tensors(optimizer) for t in group]  # DeepSpeed's own buffers
        existing += [p.grad for p in model.parameters() if p.grad is not None]
        existing += [t for p in model.parameters() for t in _quant_state_tensors(p)]
        inner = getattr(optimizer, "optimizer", optimizer)
        if getattr(inner, "offloaded", False):
            existing += inner.cpu_state_tensors()
        elif optimizer is not None:
            for state in optimizer.state.values():
                existing += [v for v in state.values() if isinstance(v, torch.Tensor)]
        self.tracker.hold(existing)  # the model states (what the engine reports as such)
        self.tracker.track(list(model.buffers()) + list(extra))
        self.tracker.reset_peak()
        if self._eager is None:
            # The tracker cannot see inside compiled code (train.compile), and torch.compile does not run
            # under a TorchDispatchMode anyway: it falls back to eager and (torch 2.13) marks the skipped code
            # as never to be compiled again, so one measured step would leave the rest of the run eager
            # (pytorch/pytorch#190286). Measured CPU steps run eager instead, their memory exact.
            self._eager = torch.compiler.set_stance("force_eager")
        if not self._active:
            self.tracker.__enter__()
            self._active = True

    def follow_gradients(self, params: Iterable[torch.Tensor], blocks: Iterable[torch.nn.Module] = ()) -> list:
        """Count each new gradient of ``params`` as a model state once autograd stores it, so that
        ``phase_peak_activations`` sees the backward's activations apart from the gradients growing
        beside them. The late high starts when the backward reaches the first of ``blocks`` (the
        repeated blocks: so that it grows by the same amount per block), or without blocks at the first
        stored gradient. Returns the hook handles (remove them when done)."""
        self._following = True
        blocks = list(blocks)

        def held(p: torch.Tensor) -> None:
            if self.tracker is not None and p.grad is not None:
                self.tracker.gradient_stored(p.grad, starts_late=not blocks)

        def reached(module, grad_output) -> None:
            if self.tracker is not None:
                self.tracker.late_start()

        return [p.register_post_accumulate_grad_hook(held) for p in params if p.requires_grad] + [
            b.register_full_backward_pre_hook(reached) for b in blocks
        ]

    def mark_segment(self) -> None:
        """The engine ends a micro-batch's forward or backward: a segment of the phase's window (CPU
        tracker only; see Snapshot.phase_segment_peaks)."""
        if self._active and self.tracker is not None:
            self.tracker.mark_segment()

    def end_step(self) -> None:
        if self._active and self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            self._active = False
        if self._eager is not None:
            self._eager.__exit__(None, None, None)  # back to the stance before begin_step
            self._eager = None

    def snapshot(self, step: int, phase: str, model: torch.nn.Module, optimizer) -> Snapshot:
        states = model_state_bytes(model, optimizer, self.device.type)
        phase_peak = unheld_peak = unheld_late = pending = segments = None
        if self.is_cuda:
            allocated = torch.cuda.memory_allocated(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.memory_reserved(self.device)
            peak_reserved = torch.cuda.max_memory_reserved(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            device_used = total - free
        else:
            assert self.tracker is not None
            allocated, peak = self.tracker.live_bytes, self.tracker.peak_bytes
            self.tracker.mark_segment()
            segments = tuple(self.tracker.segment_peaks)
            phase_peak = self.tracker.window_peak
            unheld_peak = self.tracker.window_unheld_peak if self._following else None
            unheld_late = self.tracker.window_unheld_late if self._following else None
            pending = None
            if unheld_late is not None:
                new_grads = max(0, self.tracker.held_bytes - self.tracker.window_held_start)
                pending = max(0, unheld_late + new_grads - self.tracker.window_live_late)
            self.tracker.reset_window()
            reserved = peak_reserved = device_used = None  # no caching allocator on the CPU
        on_device = states["parameters"] + states["gradients"] + states["optimizer_device"]
        if not self.is_cuda:
            on_device += states["optimizer_cpu"]  # on a CPU run, "offloaded" state shares the same memory
        snap = Snapshot(
            step=step,
            phase=phase,
            activations=max(0, allocated - on_device),
            allocated=allocated,
            peak_allocated=peak,
            reserved=reserved,
            peak_reserved=peak_reserved,
            device=str(self.device),
            phase_peak=phase_peak,
            device_used=device_used,
            phase_peak_activations=unheld_peak,
            phase_peak_activations_late=unheld_late,
            phase_gradients_pending_late=pending,
            phase_segment_peaks=segments,
            **states,
        )
        self.last = snap
        return snap


def format_table(snaps: list[Snapshot], capacity_bytes: Optional[int] = None) -> str:
    """The compact per-phase table printed after measured steps (GiB, or MiB for small runs)."""
    peak = max((s.peak_allocated for s in snaps), default=0)
    unit, size = ("GiB", GIB) if peak >= GIB else ("MiB", 1024**2)

    def g(n: Optional[int]) -> str:
        return "-" if n is None else f"{n / size:.2f}"

    cols = ("params", "grads", "optim", "optim_cpu", "acts", "alloc", "peak", "reserved")
    lines = [f"{'step':>5} {'phase':<16}" + "".join(f"{c:>10}" for c in cols) + f"  ({unit})"]
    for s in snaps:
        vals = (
            s.parameters,
            s.gradients,
            s.optimizer_device,
            s.optimizer_cpu,
            s.activations,
            s.allocated,
            s.peak_allocated,
            s.reserved,
        )
        lines.append(f"{s.step:>5} {s.phase:<16}" + "".join(f"{g(v):>10}" for v in vals))
    if capacity_bytes and snaps:
        lines.append(
            f"peak {peak / GIB:.3f} GiB = {100 * peak / capacity_bytes:.1f}% of {capacity_bytes / GIB:.1f} GiB"
        )
    return "\n".join(lines)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


# PyTorch's CUDA out-of-memory message states the cache's unused bytes at the failing request
# (CUDACachingAllocator.cpp, malloc's OOM path): "... and 3.45 GiB is reserved by PyTorch but unallocated."
_UNALLOCATED = re.compile(r"([\d.]+) (GiB|MiB|KiB|B) is reserved by PyTorch but unallocated")
_UNITS = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}


def unallocated_at_oom(exc: BaseException) -> Optional[int]:
    """Bytes PyTorch held cached but unallocated when a CUDA allocation failed (fragmentation: free pieces
    of segments, none large enough), read from its message; None where the message does not say."""
    m = _UNALLOCATED.search(str(exc))
    return int(float(m.group(1)) * _UNITS[m.group(2)]) if m else None


# What a snapshot (a line of memory.jsonl) measures, in bytes, per phase: what trackers log
CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_device",
    "optimizer_cpu",
    "activations",
    "allocated",
    "peak_allocated",
    "reserved",
    "peak_reserved",
    "device_used",
)
_FIELDS = (*CATEGORIES, "phase_peak")  # what ranks exchange in gather_snapshots


def gather_snapshots(fabric, snaps: list[Snapshot]) -> list[list[Snapshot]]:
    """Every rank's snapshots of this step, on every rank (one collective); [snaps] on one device."""
    if fabric.world_size == 1:
        return [snaps]
    rows = [[float(-1 if getattr(s, f) is None else getattr(s, f)) for f in _FIELDS] for s in snaps]
    t = torch.tensor(rows, dtype=torch.float64, device=fabric.device)
    gathered = fabric.all_gather(t).cpu()
    out = []
    for rank in range(gathered.shape[0]):
        rank_snaps = []
        for s, row in zip(snaps, gathered[rank].tolist()):
            vals = {f: (None if v < 0 else int(v)) for f, v in zip(_FIELDS, row)}
            rank_snaps.append(Snapshot(step=s.step, phase=s.phase, device=s.device, **vals))
        out.append(rank_snaps)
    return out


def format_rank_spread(per_rank: list[list[Snapshot]]) -> str:
    """Min / max across ranks of allocated and peak per phase (the lab calls acts 'Other' here)."""
    lines = [
        f"{'across ' + str(len(per_rank)) + ' ranks':<22}{'alloc min':>12}{'alloc max':>12}{'peak min':>12}"
        f"{'peak max':>12}  (MiB)"
    ]
    for i, s in enumerate(per_rank[0]):
        alloc = [r[i].allocated for r in per_rank]
        peak = [r[i].peak_allocated for r in per_rank]
        lines.append(
            f"{s.phase:<22}{min(alloc) / 2**20:>12.2f}{max(alloc) / 2**20:>12.2f}"
            f"{min(peak) / 2**20:>12.2f}{max(peak) / 2**20:>12.2f}"
        )
    return "\n".join(lines)
