"""A plan and its alternatives as text: the phase table, the verdict and the notes."""

from __future__ import annotations

from bigtune.memory.monitor import PHASES
from bigtune.plan.constants import FIT_UNCERTAINTY, GIB
from bigtune.plan.target import Plan


def format_plan(p: Plan) -> str:
    unit, size = ("GiB", GIB) if p.peak_allocated >= GIB else ("MiB", 1024**2)

    def g(n):
        return "-" if n is None else f"{n / size:.2f}"

    cols = (
        "parameters",
        "gradients",
        "optimizer_device",
        "optimizer_cpu",
        "activations",
        "allocated",
        "peak_allocated",
    )
    heads = ("params", "grads", "optim", "optim_cpu", "acts", "alloc", "peak")
    count = f"{p.parameters_total / 1e9:.2f} B" if p.parameters_total >= 1e8 else f"{p.parameters_total / 1e6:.2f} M"
    lines = [
        f"plan: {p.recipe_name} on {p.target}: {count} parameters",
        f"{'phase':<16}" + "".join(f"{h:>10}" for h in heads) + f"  ({unit}, predicted, per device)",
    ]
    for ph in PHASES:
        if ph in p.phases:
            lines.append(f"{ph:<16}" + "".join(f"{g(p.phases[ph][c]):>10}" for c in cols))
    lines.append(
        f"peak allocated {p.peak_allocated / GIB:.2f} GiB"
        + (
            f"; reserved ≈ {p.peak_reserved / GIB:.2f} GiB + context {p.overhead / GIB:.2f} GiB = "
            f"{p.peak_total / GIB:.2f} GiB"
            if p.peak_reserved is not None
            else ""
        )
    )
    if p.capacity is not None:
        verdict = "FITS" if p.fits else "OOM"
        need = p.needed_total or p.peak_total
        lines.append(
            f"{verdict}: needs {need / GIB:.2f} of {p.capacity / GIB:.2f} GiB ({100 * need / p.capacity:.0f}%)"
        )
        if p.tight:
            lines.append(tight_advice(p))
    if p.host_bytes_per_node is not None:
        lines.append(f"host RAM ≈ {p.host_bytes_per_node / GIB:.1f} GiB per node (loading and training: see notes)")
    if p.step_time_s:
        lines.append(
            f"step ≈ {p.step_time_s:.3f} s, ≈ {p.tokens_per_s:,.0f} tokens/s "
            f"({p.tokens_per_step:,} tokens per optimizer step)"
        )
    for n in p.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def tight_advice(p: Plan) -> str:
    """One line for a plan within the planner's typical error of the FITS line."""
    band = f"tight: the need is within {FIT_UNCERTAINTY:.0%} of the card of the limit, the planner's typical error"
    if p.fits:
        return (
            f"{band}, so it may still run out of memory. Keep headroom (a smaller micro batch at the same "
            "global batch, checkpointing, --alternatives) or try a few steps first (--set train.max_steps=3)"
        )
    return f"{band}, so it may still fit: try a few steps (--set train.max_steps=3) or see --alternatives"


def format_alternatives(plans: list[Plan], limit: int = 20) -> str:
    if not plans:
        return "no variant fits; try more GPUs (--gpus) or a larger card"
    lines = [f"{'#':>3} {'tokens/s':>11} {'peak GiB':>9}  variant"]
    for i, p in enumerate(plans[:limit], 1):
        tps = f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "-"
        mark = " (tight)" if p.tight else ""
        lines.append(f"{i:>3} {tps:>11} {p.peak_total / GIB:>9.2f}  {p.variant}{mark}")
    if len(plans) > limit:
        lines.append(f"... {len(plans) - limit} more (--json lists all)")
    if any(p.tight for p in plans[:limit]):
        lines.append(f"(tight: fits by less than {FIT_UNCERTAINTY:.0%} of the card, the planner's typical error)")
    return "\n".join(lines)
