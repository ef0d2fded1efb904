"""Step time from the simulated step's own operators: one roofline per GPU kernel.

The planner already runs one training step on fake tensors to count its memory. ``OpCounter``
watches the same step and writes down what each operator would cost a GPU: the FLOPs and shape of
every matrix multiply and fused attention kernel, and the bytes every other kernel reads and writes.
``step_seconds`` then prices that record for one catalog GPU:

* a matmul takes ``FLOPs / (peak × GEMM_EFFICIENCY × tile occupancy)``, where tile occupancy is the
  wave quantization of its output tiles over the GPU's SMs (a 2048 × 256 output fills 32 of an
  A100's 108 SMs with 128 × 128 tiles), but never less than its bytes over the bandwidth;
* a fused attention kernel takes its FLOPs (half the score matrix when causal; backward 2.5 × the
  forward, as FlashAttention-2 counts it) at ``ATTENTION_EFFICIENCY`` of the peak;
* everything else (norms, activations, casts, softmax, the optimizer's foreach updates, the loss)
  is bound by memory: bytes / (bandwidth × ``BANDWIDTH_EFFICIENCY``);
* no kernel takes less than ``KERNEL_FLOOR_S``;
* the host issues every operator, views included, at ``HOST_SECONDS_PER_OP``; an eager step with no
  host sync in its loop runs as fast as the slower of the two queues.

This is what makes small models, fp32 on CUDA cores, the math attention path, LoRA's thin matmuls and
memory-bound optimizers come out at their own speed, where one assumed MFU made them all alike.
The constants are assumptions from public vendor and library figures (see each), not fitted to any
published step time; bench/published.py states the error against published rates.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# -- efficiencies: public figures, one of them checked on a GPU so far ----------------------------------
# cuBLAS reaches about 80 % of the dense tensor-core peak on large bf16/fp16 GEMMs (A100 ≈ 250-280 of 312
# TFLOPS, H100 SXM ≈ 600-750 of 989 in public GEMM benchmarks) and about 85 % of the CUDA-core peak on
# fp32 SGEMM. Checked: an 8192^3 bf16 matmul ran at 779-782 TFLOP/s on an H200 (79 % of 989.5; torch 2.11,
# CUDA 13.0, bench/results/gpu-logs/env-h200.txt). The others are not measured yet: the first GPU run's
# step times (bench/results/plan_accuracy-h200.json) were taken with memory probes in every phase of every
# step, which a plan does not price (docs/explanation/accuracy.md).
GEMM_EFFICIENCY = 0.80

SGEMM_EFFICIENCY = 0.85

# FlashAttention-2 reports 50-73 % of A100 peak forward and less backward; PyTorch's memory-efficient
# kernel is slower. One figure for both.
ATTENTION_EFFICIENCY = 0.50

# Elementwise and reduction kernels stream at about 80 % of the datasheet DRAM bandwidth.
BANDWIDTH_EFFICIENCY = 0.80

KERNEL_FLOOR_S = 3e-6  # launch and tail of the smallest kernel

# Host time per operator of an eager training step (Python modules, autograd, dispatch, launch).
# Measured on the 2-core CI machine by bench/host_overhead.py: 10.6 µs per aten operator for a tiny HF
# Llama step; a GPU node's host core is typically faster, so this is on the slow side.
HOST_SECONDS_PER_OP = 10e-6

TILES = ((128, 128, 1.0), (64, 64, 0.75))  # output tiles cuBLAS picks from, and their relative speed

_GEMMS = {"mm", "addmm", "bmm", "baddbmm"}

_NO_KERNEL = {
    "detach",
    "alias",
    "lift_fresh",
    "empty",
    "empty_strided",
    "empty_like",
    "new_empty",
    "new_empty_strided",
    "_local_scalar_dense",
    "set_",
    "resize_",
    "_unsafe_view",
    "view",
    "_reshape_alias",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "is_same_size",
}

PHASES = ("forward", "backward", "optimizer")


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    return 0


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, "other")


class OpCounter(TorchDispatchMode):
    """Records the operators of a step by phase (``state.phase``: forward, backward, optimizer): as a
    dispatch mode of its own (``with OpCounter(state):``), or through ``observe`` called by another mode.

    ``ops`` maps (kind, phase, dtype, shape) to [count, FLOPs, bytes]; kind is ``gemm`` (shape
    (batch, M, N, K)), ``attn`` (shape ()), ``mem`` (shape: the power of two of the bytes, so that
    kernels of one size class share a row) or ``host`` (views and other operators that launch no
    kernel). The rows are few (tens per phase) and add up and extrapolate linearly with depth.
    """

    def __init__(self, state: Any):
        super().__init__()
        self.state = state
        self.ops: dict[tuple, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.observe(func, args, kwargs, out)
        return out

    def observe(self, func, args, kwargs, out) -> None:
        """Record one operator; usable as a ``memory.LiveTensorTracker`` observer (no mode of its own)."""
        phase = getattr(self.state, "phase", "forward")
        if phase in PHASES:
            self._record(func, args, kwargs, out, phase)

    def _record(self, func, args, kwargs, out, phase: str) -> None:
        name, kind, writes = _meta(func)
        if kind == "skip":
            return
        outputs = (
            [out]
            if type(out) is not tuple and isinstance(out, torch.Tensor)
            else [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        )
        # Views, metadata queries (sym_size...) and allocations launch no kernel.
        if kind == "host" or not (outputs or writes):
            self.ops[("host", phase, "", ())][0] += 1
            return
        if kind == "gemm":
            a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
            batch = a.shape[0] if a.dim() == 3 else 1
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
            flops = 2.0 * batch * m * n * k
            moved = _nbytes(a) + _nbytes(b) + sum(_nbytes(t) for t in outputs)
            row = self.ops[("gemm", phase, _dtype_name(a.dtype), (int(batch), int(m), int(n), int(k)))]
        elif kind == "attn":
            named = dict(zip((a.name for a in func._schema.arguments), args))
            named.update(kwargs)
            q, key = named["query"], named["key"]
            bsz, heads, sq, d = q.shape[0], q.shape[-3], q.shape[-2], q.shape[-1]
            flops = 4.0 * bsz * heads * sq * key.shape[-2] * d  # QKᵀ and PV
            if named.get("is_causal"):
                flops /= 2
            if name.endswith("_backward"):
                flops *= 2.5
            moved = sum(_nbytes(t) for t in tree_flatten((args, out))[0])
            row = self.ops[("attn", phase, _dtype_name(q.dtype), ())]
        else:
            listed = any(type(a) in (list, tuple) for a in args)
            inputs = tree_flatten((args, kwargs))[0] if listed or kwargs else args
            seen = {id(t) for t in inputs if isinstance(t, torch.Tensor)}
            moved = sum(_nbytes(t) for t in inputs)
            # Arguments the schema marks as written (in-place ops, foreach updates) are written back.
            moved += sum(_nbytes(t) for i in writes if i < len(args) for t in tree_flatten(args[i])[0])
            moved += sum(_nbytes(t) for t in outputs if id(t) not in seen)
            flops = 0.0
            if listed and any(isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor) for a in args):
                # One operator over a list of tensors (the optimizer's foreach updates, the gradient
                # norm): its bytes grow with depth, its count does not; a row of its own keeps both
                # linear in depth.
                row = self.ops[("mem", phase, "", ("list", name))]
            else:
                row = self.ops[("mem", phase, "", (max(0, int(moved)).bit_length(),))]
        row[0] += 1
        row[1] += flops
        row[2] += moved


_META: dict = {}


def _meta(func) -> tuple[str, str, tuple[int, ...]]:
    """(name, kind, indices of written arguments) of an operator, worked out once per operator."""
    meta = _META.get(func)
    if meta is None:
        name = func.overloadpacket.__name__
        writes = tuple(
            i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        if func.namespace == "prim":  # metadata queries (prim::device) the dispatcher sees; no eager op
            kind = "skip"
        elif func.is_view or name in _NO_KERNEL:
            kind = "host"
        elif name in _GEMMS:
            kind = "gemm"
        elif "scaled_dot_product" in name and ("flash" in name or "efficient" in name or "cudnn" in name):
            kind = "attn"
        else:
            kind = "mem"
        meta = _META[func] = (name, kind, writes)
    return meta


def _occupancy(batch: int, m: int, n: int, sms: Optional[int]) -> float:
    """Best fraction of the GPU's SMs busy over the waves of output tiles, over cuBLAS's tile sizes."""
    if not sms:
        return 1.0
    best = 0.0
    for tm, tn, speed in TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / sms)
        best = max(best, speed * tiles / (waves * sms))
    return best


def step_seconds(ops: dict, gpu, half: str, allow_tf32: bool = False) -> dict[str, float]:
    """Price an ``OpCounter`` record on ``gpu``: seconds of GPU work per phase, of host work, and the
    step (the slower queue). ``half`` is the tensor-core format the simulation's bf16 stands for
    ("bf16", or "fp16" under 16-mixed, simulated as bf16). Raises ValueError where the GPU has no rate
    for a dtype the step multiplies in (bf16 on a V100 or T4).

    Also ``tensor_flops`` (the matmuls' and fused attention's FLOPs) and ``peak_s``: those FLOPs at the
    catalog's dense peak of each dtype, no efficiency applied. No run of this step on this card can take
    less, which makes ``peak_s`` a check on a published rate: one faster than it was not this step."""
    if not gpu.mem_bandwidth_gbs:
        raise ValueError(f"{gpu.name} has no memory bandwidth in the catalog")
    bandwidth = gpu.mem_bandwidth_gbs * 1e9 * BANDWIDTH_EFFICIENCY
    sms = getattr(gpu, "sms", None)

    def peak(dtype: str) -> tuple[float, float]:
        if dtype == "fp32":
            if allow_tf32 and gpu.tf32_tflops:
                return gpu.tf32_tflops * 1e12, GEMM_EFFICIENCY
            if not gpu.fp32_tflops:
                raise ValueError(f"{gpu.name} has no fp32 rate in the catalog")
            return gpu.fp32_tflops * 1e12, SGEMM_EFFICIENCY
        fmt = half if dtype == "bf16" else "fp16"
        rate = gpu.bf16_tflops if fmt == "bf16" else gpu.fp16_tflops
        if not rate:
            raise ValueError(f"{gpu.name} has no {fmt} tensor-core rate")
        return rate * 1e12, GEMM_EFFICIENCY

    gpu_s = {ph: 0.0 for ph in PHASES}
    host = tensor_flops = peak_s = 0.0
    for (kind, phase, dtype, shape), (count, flops, moved) in ops.items():
        host += count * HOST_SECONDS_PER_OP
        if kind == "host" or count <= 0:
            continue
        memory = moved / bandwidth
        if kind == "gemm":
            rate, eff = peak(dtype)
            batch, m, n, _ = shape
            compute = flops / (rate * eff * _occupancy(batch, m, n, sms))
            t = max(compute, memory, count * KERNEL_FLOOR_S)
        elif kind == "attn":
            rate, _ = peak(dtype)
            t = max(flops / (rate * ATTENTION_EFFICIENCY), memory, count * KERNEL_FLOOR_S)
        else:
            t = max(memory, count * KERNEL_FLOOR_S)
        if kind in ("gemm", "attn"):
            tensor_flops += flops
            peak_s += flops / rate
        gpu_s[phase] += t
    device = sum(gpu_s.values())
    return {
        **{f"{ph}_s": gpu_s[ph] for ph in PHASES},
        "device_s": device,
        "host_s": host,
        "step_s": max(device, host),
        "tensor_flops": tensor_flops,
        "peak_s": peak_s,
    }


def scale(ops: dict, phases: tuple[str, ...], factor: float) -> dict:
    """``ops`` with the rows of ``phases`` multiplied by ``factor`` (micro-batches → a window)."""
    return {k: ([v[0] * factor, v[1] * factor, v[2] * factor] if k[1] in phases else list(v)) for k, v in ops.items()}
