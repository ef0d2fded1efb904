"""Plan vs measured: the planner's prediction beside what a run's memory monitor recorded."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from bigtune.core.stepmath import GIB, human_bytes
from bigtune.recipe import Recipe, load_recipe


def target_for_device(device: torch.device, cap_bytes: Optional[int] = None):
    from bigtune.core.gpus import custom_gpu, detect_gpu
    from bigtune.plan.base.target import Target

    if device.type != "cuda":
        if cap_bytes is not None:
            return Target("cpu", custom_gpu(cap_bytes / GIB))
        return Target("cpu")
    props = torch.cuda.get_device_properties(device)
    gpu = detect_gpu(props.name, props.total_memory) or custom_gpu(props.total_memory / GIB)
    if cap_bytes is not None:
        gpu = custom_gpu(cap_bytes / GIB, gpu)
    return Target("cuda", gpu)


def plan_target(r: Recipe, device: torch.device, world: int):
    from bigtune.plan.base.target import run_strategy

    return dataclasses.replace(target_for_device(device), gpus=world, strategy=run_strategy(r.strategy, world))


def predict_for_device(r: Recipe, device: torch.device, world: int = 1, table: bool = True):
    """The planner's prediction for this run's device, printed before step 0 (None if it cannot plan);
    ``table=False`` leaves the printing of a successful plan to the caller."""
    from bigtune.plan.format import format_plan
    from bigtune.plan.planner import plan

    try:
        p = plan(r, plan_target(r, device, world))
    except Exception as e:  # noqa: BLE001 - a planning problem must never stop training
        print(f"plan: unavailable ({type(e).__name__}: {str(e)[:200]})", flush=True)
        return None
    if table:
        print(format_plan(p), flush=True)
    return p


def alternatives_for_device(r: Recipe, device: torch.device, cap_bytes: Optional[int]) -> list[str]:
    """One line per variant predicted to fit this device (single device only), fastest first."""
    from bigtune.plan.search.alternatives import alternatives

    try:
        # In-process (workers=1): forking worker processes from a process that has trained (OpenMP
        # and allocator threads mid-state) can deadlock the children; a fresh `bigtune plan` forks safely.
        # Adapters included: after an OOM, training fewer weights is a fair thing to suggest.
        alts = alternatives(r, target_for_device(device, cap_bytes), max_gpus=1, workers=1, adapters=True)
    except Exception as e:  # noqa: BLE001
        print(f"  (planner could not suggest variants: {type(e).__name__}: {str(e)[:200]})", flush=True)
        return []
    return [f"{a.variant}: predicted peak {human_bytes(a.peak_total)}" for a in alts]


def compare_with_plan(p, r: Recipe, device: torch.device, snaps: list[dict], world: int = 1) -> dict:
    """Measured vs predicted per category and phase, at the last measured step (steady state).

    The plan before training assumes full max_seq_length micro-batches (the worst case). When the
    measured step's batch was shorter, the step is planned again at that shape so the two can be
    compared like for like; both predictions are kept.
    """
    out: dict[str, Any] = {
        "target": p.target,
        "predicted_peak_allocated": p.peak_allocated,
        "predicted_peak_total": p.peak_total,
        "predicted_fits": p.fits,
        "predicted_tight": getattr(p, "tight", False),
        "notes": p.notes,
        "phases": {},
    }
    # The plan is per device: compare rank 0's; a pipeline's plan is its largest stage's, so the rank that peaks
    rank = max(snaps, key=lambda s: s["peak_allocated"]).get("rank", 0) if r.pipeline_parallel > 1 and snaps else 0
    snaps = [s for s in snaps if s.get("rank", 0) == rank]
    if not snaps:
        return out
    last = max(s["step"] for s in snaps)
    steady = {s["phase"]: s for s in snaps if s["step"] == last}
    first = steady.get("before_forward", {})
    shape, padded = first.get("batch_shape"), first.get("padded", False)
    # a chat vision-language batch's image grids (the plan before training took the worst case)
    images = tuple(tuple(g) for g in first["image_grids"]) if first.get("image_grids") else None
    # the plan's own images (photos of the size it planned, often the worst case capped by data.image_max_pixels):
    # planning again would simulate the same step, minutes of CPU for a chat VLM
    planned = getattr(p, "image_grids", None)
    other_images = bool(images) and (planned is None or [list(g) for g in images] != planned)
    like = p
    if shape and (shape[0] != r.train.micro_batch_size or shape[1] != r.data.max_seq_length or padded or other_images):
        from bigtune.plan.planner import plan

        try:
            like = plan(
                load_recipe(r.to_dict(), {"train.micro_batch_size": shape[0], "data.max_seq_length": shape[1]}),
                plan_target(r, device, world),
                padded=padded,
                images=images,
            )
            out["replanned_at_batch_shape"] = shape
        except Exception as e:  # noqa: BLE001
            out["replan_error"] = f"{type(e).__name__}: {e}"
    for ph, s in steady.items():
        if ph in like.phases:
            out["phases"][ph] = {
                c: {"measured": s[c], "predicted": like.phases[ph][c]}
                for c in (
                    "parameters",
                    "gradients",
                    "optimizer_device",
                    "optimizer_cpu",
                    "activations",
                    "allocated",
                    "peak_allocated",
                )
            }
    measured = max(s["peak_allocated"] for s in steady.values())
    out["measured_peak_allocated"] = measured
    out["measured_peak_allocated_all_steps"] = max(s["peak_allocated"] for s in snaps)
    out["predicted_peak_allocated_like_for_like"] = like.peak_allocated
    out["peak_error_pct"] = error_pct(like.peak_allocated, measured)
    # CUDA: what the allocator reserved and what the whole device had in use (nvidia-smi's figure) in
    # that step, beside the plan's analytic reserved (fragmentation) and total (+ CUDA context).
    reserved = [s["peak_reserved"] for s in steady.values() if s.get("peak_reserved") is not None]
    used = [s["device_used"] for s in steady.values() if s.get("device_used") is not None]
    out["measured_peak_reserved"] = max(reserved) if reserved else None
    out["measured_device_used"] = max(used) if used else None
    out["predicted_peak_reserved_like_for_like"] = like.peak_reserved
    out["predicted_peak_total_like_for_like"] = like.peak_total
    out["reserved_error_pct"] = error_pct(like.peak_reserved, out["measured_peak_reserved"])
    out["total_error_pct"] = error_pct(like.peak_total, out["measured_device_used"])
    # The roofline time for the same batch shape (None on a CPU): bench/plan_accuracy.py sets it
    # beside the measured step time.
    out["predicted_step_time_s"] = like.step_time_s
    out["predicted_tokens_per_s"] = like.tokens_per_s
    out["predicted_needed_like_for_like"] = getattr(like, "needed_total", None)  # what must fit (FITS/OOM)
    return out


def error_pct(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    """Signed error of a prediction in percent of the measurement (None when either is missing)."""
    if predicted is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


def format_comparison(c: dict) -> str:
    if "measured_peak_allocated" not in c:
        return "plan vs measured: nothing measured"
    shape = c.get("replanned_at_batch_shape")
    where = f"re-planned at the measured batch {shape[0]}×{shape[1]}" if shape else "as planned"
    lines = [
        f"measured / predicted, last measured step ({where}):",
        f"{'phase':<16}" + "".join(f"{h:>24}" for h in ("params", "grads", "optim", "acts", "alloc")),
    ]
    for ph, cats in c["phases"].items():
        cells = [
            f"{human_bytes(cats[k]['measured'])} / {human_bytes(cats[k]['predicted'])}"
            for k in ("parameters", "gradients", "optimizer_device", "activations", "allocated")
        ]
        lines.append(f"{ph:<16}" + "".join(f"{x:>24}" for x in cells))
    lines.append(
        f"peak allocated of that step: measured {human_bytes(c['measured_peak_allocated'])}, predicted "
        f"{human_bytes(c['predicted_peak_allocated_like_for_like'])} ({c['peak_error_pct']:+.2f}%)"
        + (f"; worst case (full max_seq_length) {human_bytes(c['predicted_peak_allocated'])}" if shape else "")
    )
    if c.get("measured_peak_reserved") is not None and c.get("predicted_peak_reserved_like_for_like") is not None:
        lines.append(
            f"peak reserved: measured {human_bytes(c['measured_peak_reserved'])}, predicted "
            f"{human_bytes(c['predicted_peak_reserved_like_for_like'])} ({c['reserved_error_pct']:+.2f}%)"
        )
    if c.get("measured_device_used") is not None and c.get("predicted_peak_total_like_for_like") is not None:
        lines.append(
            f"in use on the device (as nvidia-smi shows it): measured {human_bytes(c['measured_device_used'])}"
            f", predicted {human_bytes(c['predicted_peak_total_like_for_like'])} "
            f"({c['total_error_pct']:+.2f}%)"
        )
    return "\n".join(lines)
