"""Step time: the simulated step's kernels priced on the target GPU, plus CPU updates, PCIe and the
communication between GPUs that compute does not hide.
"""

from __future__ import annotations

from typing import Optional

from bigtune.plan.base.constants import HOST_UPDATE_GBS, PCIE_GBS
from bigtune.plan.base.target import Target
from bigtune.plan.layout.sharding import shard_layout
from bigtune.plan.step.simulate import Sim
from bigtune.recipe import Recipe


def step_time(
    recipe: Recipe, sim: Sim, target: Target, config=None
) -> tuple[Optional[float], Optional[float], list[str]]:
    """(step seconds, tokens/s over all devices, notes): the simulated step's kernels priced on the
    target GPU (roofline.py), plus what the simulation cannot see: CPU-side optimizer updates, PCIe
    traffic of offloading, the gradient all-reduce/reduce-scatter between GPUs and, under tensor
    parallelism (``config``: the model one rank computes), the all-reduces within each group.
    Under tensor parallelism ``sim`` is one rank's step and ``target.data_parallel`` ranks read different
    micro-batches."""
    from bigtune.plan.device.roofline import scale, step_seconds
    from bigtune.plan.layout.pipeline import pipeline_seconds
    from bigtune.plan.layout.tensor_parallel import tensor_parallel_seconds
    from bigtune.plan.step.simulate import total_blocks

    tokens = recipe.train.micro_batch_size * recipe.data.max_seq_length * recipe.accumulate
    if target.gpu is None:
        return None, None, []
    if not sim.ops:
        return None, None, ["time: this simulation recorded no operators"]
    states = sim.phases["after_backward"]
    fsdp_offload = target.strategy == "fsdp" and recipe.fsdp_cpu_offload and target.gpus > 1
    split, moved = shard_layout(target.strategy, fsdp_offload)
    host = states.get("optimizer_cpu", 0)
    if "optimizer_device" in moved:  # ZeRO offload: each process updates its shard on the CPU
        host += states["optimizer_device"] / target.data_parallel
    # Each device runs the whole window's micro-batches; its update covers its shard of the weights,
    # or none of them when the CPU updates (priced below instead).
    opt_share = 0.0 if host else 1.0 / target.data_parallel if "optimizer_device" in split else 1.0
    ops = scale(scale(sim.ops, ("forward", "backward"), recipe.accumulate), ("optimizer",), opt_share)
    half = "fp16" if recipe.precision.startswith("16") else "bf16"
    try:
        t = step_seconds(ops, target.gpu, half)
    except ValueError as exc:
        return None, None, [f"time: {exc}; no step time"]
    t_opt = 0.0
    if fsdp_offload:
        t_opt += _fsdp_offload_seconds(recipe, target, states, t)
        host = 0.0  # priced there, with the transfers' real count
    if host:
        # CPU-offloaded update: the CPU reads and writes its state once, gradients go down and the
        # updated weights come back over PCIe (both assumed rates, see the constants).
        shard = target.data_parallel if "gradients" in split else 1
        t_opt += 2 * host / (HOST_UPDATE_GBS * 1e9) + (states["gradients"] + states["parameters"]) / shard / (
            PCIE_GBS * 1e9
        )
    t_comm = _exposed_communication(recipe, target, states, t)
    t_tp = tensor_parallel_seconds(recipe, target, config, total_blocks(config)) if config is not None else 0.0
    t_pp, pp_note = pipeline_seconds(recipe, target, config, t) if target.pipeline_parallel > 1 else (0.0, "")
    step = t["step_s"] + t_opt + t_comm + t_tp + t_pp
    host_bound = t["host_s"] > t["device_s"]
    notes = [
        f"time: roofline over the simulated step's kernels, forward {t['forward_s']:.3g} s, backward "
        f"{t['backward_s']:.3g} s, optimizer {t['optimizer_s']:.3g} s of GPU time against {t['host_s']:.3g} s of "
        f"host dispatch (the {'host (eager dispatch)' if host_bound else 'GPU'} bounds the step); "
        f"+ {t_opt:.3g} s CPU update/PCIe, {t_comm:.3g} s communication not hidden by compute "
        "(efficiencies from public figures, the GEMM one checked on an H200: roofline.py)",
        peak_floor_note(t),
    ]
    if host_bound:
        notes.append(
            "time: the GPU waits for Python to issue kernels: a larger micro-batch (same global batch) or "
            "train.compile (fewer, fused kernels) would keep it busier"
        )
    if target.tensor_parallel > 1:
        notes.append(
            f"time: + {t_tp:.3g} s of tensor-parallel all-reduces of the hidden state ({target.tensor_parallel} "
            "ranks; two per block in the forward, two in the backward), not hidden by compute"
        )
    if pp_note:
        notes.append(pp_note)
    return step, tokens * target.data_parallel / step, notes


def peak_floor_note(t: dict) -> str:
    """The note of a priced step's (roofline.step_seconds) dense-peak floor; bench/published.py reads it back."""
    # The floor no efficiency can beat: a published rate faster than it was not this step on this card.
    return (
        f"time: {t['tensor_flops'] / 1e12:.4g} TFLOP of matmuls and attention per device and step, "
        f"{t['peak_s']:.4g} s at the card's dense peak (the least any run of this step can take)"
    )


def _fsdp_offload_seconds(recipe: Recipe, target: Target, states: dict, t: dict) -> float:
    """FSDP2 with CPUOffloadPolicy: the CPU's update of this rank's shard, and the PCIe traffic that
    compute does not hide. Each micro-batch copies every unit's parameter shard to the device for its
    forward all-gather and again for its backward one (once with fsdp_sharding=grad_op), and each
    reduce-scattered gradient shard back (once per window with fsdp_grad_sync=step). The copies run on
    FSDP2's own streams ahead of the compute that needs them (prefetch), so only what exceeds the
    forward and backward is counted (an assumption, like the rates: constants.py)."""
    n, k = target.data_parallel, recipe.accumulate
    update = 2 * (states["optimizer_device"] / n) / (HOST_UPDATE_GBS * 1e9)
    gathers = 1 if recipe.fsdp_sharding == "grad_op" else 2
    reduces = 1 if recipe.fsdp_grad_sync == "step" else k
    pcie_bytes = (k * gathers * states["parameters"] + reduces * states["gradients"]) / n
    pcie = pcie_bytes / (PCIE_GBS * 1e9)
    return update + max(0.0, pcie - (t["forward_s"] + t["backward_s"]))


DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket: the last one is reduced after backward ends


def _exposed_communication(recipe: Recipe, target: Target, states: dict, t: dict) -> float:
    """Seconds of gradient/parameter traffic between the GPUs that compute does not hide.

    Ring collectives move (n−1)/n of the bytes per GPU each way (an all-reduce twice that), at one
    direction of the catalog's bidirectional link. What runs where, per accumulation window of k
    micro-batches (gradients are synced only on the last one, dist.micro_batch_context):
    * DDP: one all-reduce of the gradients, overlapped with the last micro-batch's backward except its
      last bucket;
    * FSDP and ZeRO-3: the parameters gathered for every micro-batch's forward and again for its
      backward (FSDP with fsdp_sharding=grad_op: once), the gradients reduce-scattered on every
      micro-batch (each keeps only its partition; fsdp_grad_sync=step: on the last one only),
      overlapped with that micro-batch's forward and backward (prefetching); with fsdp_wrap=none
      nothing overlaps: the one unit is gathered before the forward starts and reduced after the
      backward ends;
    * ZeRO-2: gradients reduce-scattered after every micro-batch's backward (overlapped with it) and
      the updated parameters all-gathered once after the step (not overlapped).
    """
    n = target.data_parallel  # under tensor parallelism each rank gathers and reduces its own block shards
    if n <= 1 or not target.gpu.interconnect_gbs:
        return 0.0
    bw = target.gpu.interconnect_gbs / 2 * 1e9
    f = (n - 1) / n
    grads, params = states["gradients"], states["parameters"]
    k = recipe.accumulate
    fwd, bwd = t["forward_s"] / k, t["backward_s"] / k  # one micro-batch's GPU time
    strategy = target.strategy
    if strategy == "ddp":
        reduce = 2 * f * grads / bw
        return max(0.0, reduce - bwd) + 2 * f * min(grads, DDP_BUCKET_BYTES) / bw
    if strategy == "fsdp" or strategy.startswith("deepspeed_stage_3"):
        fsdp = strategy == "fsdp"
        gathers = 1 if fsdp and (recipe.fsdp_sharding == "grad_op" or recipe.fsdp_wrap == "none") else 2
        gather, scatter = gathers * f * params / bw, f * grads / bw
        # fsdp_grad_sync=step: the reduce-scatter only on the window's last micro-batch
        every = 1 if fsdp and recipe.fsdp_grad_sync == "step" else k
        if fsdp and recipe.fsdp_wrap == "none":
            return k * gather + every * scatter
        return (k - every) * max(0.0, gather - fwd - bwd) + every * max(0.0, gather + scatter - fwd - bwd)
    if strategy.startswith("deepspeed"):  # ZeRO-1/2: reduce every micro-batch, gather the new weights once
        return k * max(0.0, f * grads / bw - bwd) + f * params / bw
    return 0.0
