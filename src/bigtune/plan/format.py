"""A plan and its alternatives as text: the headline figure against the card, the phase table and the sum that
makes the headline, the notes grouped (the few that matter; ``--verbose`` all of them)."""

from __future__ import annotations

from bigtune.memory.monitor import PHASES
from bigtune.plan.base.constants import FIT_UNCERTAINTY, GIB
from bigtune.plan.base.target import Plan

# Notes on how the figures were made (allocator replay, CUDA context, roofline...): the same kinds on every
# GPU plan, so the default view leaves them to --verbose and --json; the notes left are what this recipe
# or card changes (offload, quantization, images, attention fallbacks, advice).
METHOD_NOTES = (
    "cuBLAS workspaces",
    "reserved from ",
    "reserved and least capacity from",
    "reserved/allocated ratio",
    "reserved not predicted",
    "reserved replays full-length",
    "replayed at full depth",
    "FITS/OOM by the",
    "CUDA context",
    "caching allocator replayed with",
    "fsdp side streams",
    "time: roofline over",
)

NOTE_WIDTH = 120  # a shortened note fits one terminal line


def is_method_note(note: str) -> bool:
    return note.startswith(METHOD_NOTES) or "at the card's dense peak" in note


def _short(note: str, width: int = NOTE_WIDTH) -> str:
    """The note's first clause (notes say what, then "; " and the detail), cut between words to ``width``."""
    if len(note) <= width:
        return note
    first = note.split("; ", 1)[0]
    if len(first) > width:
        first = first[: first.rfind(" ", 0, width)].rstrip(" ,;:(")
    return first if first == note else first + " …"


def format_plan(p: Plan, verbose: bool = False) -> str:
    """The plan as a person reads it: the title, one headline figure against the card, the phase table with
    the sum that makes the headline, then the notes (the few that matter; ``verbose``: all, in full)."""
    unit, size = ("GiB", GIB) if p.peak_allocated >= GIB else ("MiB", 1024**2)

    count = f"{p.parameters_total / 1e9:.2f} B" if p.parameters_total >= 1e8 else f"{p.parameters_total / 1e6:.2f} M"
    lines = [f"plan: {p.recipe_name}, {count} parameters", _headline(p, unit, size)]
    if p.tight:
        lines.append(tight_advice(p))
    if p.host_bytes_per_node is not None:
        lines.append(f"host RAM ≈ {p.host_bytes_per_node / GIB:.1f} GiB per node (loading and training: see notes)")
    if p.step_time_s:
        lines.append(
            f"step ≈ {p.step_time_s:.3f} s, ≈ {p.tokens_per_s:,.0f} tokens/s "
            f"({p.tokens_per_step:,} tokens per optimizer step)"
        )
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
    lines += ["", f"{unit + ' per device':<16}" + "".join(f"{h:>10}" for h in heads)]
    for ph in PHASES:
        if ph in p.phases:
            lines.append(f"{ph:<16}" + "".join(f"{_n(p.phases[ph][c], size):>10}" for c in cols))
    lines += _sum_lines(p, unit, size, verbose)
    lines += _note_lines(p.notes, verbose)
    return "\n".join(lines)


def _n(n: int | None, size: int) -> str:
    return "-" if n is None else f"{n / size:.2f}"


def _headline(p: Plan, unit: str, size: int) -> str:
    """One figure against the card: what must fit (the allocator's segments in use at the peak + context)."""
    need = p.needed_total or p.peak_total
    if p.capacity is None:
        return f"needs {need / size:.1f} {unit} per device on {p.target} (no card to compare with: --gpu NAME)"
    verdict = ("FITS" if p.fits else "OOM") + (" (tight)" if p.tight else "")
    # in GiB, as cards are sold; a small need keeps two decimals rather than read 0.0
    figure = f"{need / GIB:.1f}" if need >= GIB else f"{need / GIB:.2f}"
    share = f"{100 * need / p.capacity:.0f} %"
    return f"{verdict}: {figure} of {p.capacity / GIB:.1f} GiB ({share}) on {p.target}"


def _sum_lines(p: Plan, unit: str, size: int, verbose: bool) -> list[str]:
    """The headline's figure as a sum under the table: peak allocated + the allocator's slack + context."""
    need = p.needed_total or p.peak_total
    if p.overhead == 0 and need == p.peak_allocated:
        return [f"peak allocated {_n(p.peak_allocated, size)} {unit}"]
    slack = max(0, need - p.overhead - p.peak_allocated)
    w = len(_n(need, size))
    out = [f"  {_n(p.peak_allocated, size):>{w}}  peak allocated"]
    if p.peak_reserved is not None:  # replayed: the segments the allocator holds in use at the peak
        out.append(f"+ {_n(slack, size):>{w}}  allocator rounding and fragmentation at the peak")
    if p.overhead:
        out.append(f"+ {_n(p.overhead, size):>{w}}  CUDA context (measured on an H200)")
    total = f"= {_n(need, size):>{w}}  {unit} needed"
    out.append(total + (f" of {_n(p.capacity, size)} {unit}" if p.capacity is not None else ""))
    if verbose and p.peak_reserved is not None:
        out.append(
            f"  (with memory to spare the allocator keeps freed segments cached: reserved ≈ "
            f"{_n(p.peak_reserved + p.overhead, size)} {unit} with the context; it frees them before running out)"
        )
    return out


def _note_lines(notes: list[str], verbose: bool) -> list[str]:
    """Notes grouped (memory, time; with ``verbose`` also how the figures were made), shortened unless
    ``verbose``."""
    method = [n for n in notes if is_method_note(n)]
    shown = [n for n in notes if not is_method_note(n)]
    groups = {
        "memory": [n for n in shown if not n.startswith("time:")],
        "time": [n.removeprefix("time: ") for n in shown if n.startswith("time:")],
    }
    if verbose:
        groups["how these figures were made"] = [n.removeprefix("time: ") for n in method]
    out: list[str] = []
    for title, group in groups.items():
        if group:
            out += ["", f"{title}:"] + [f"  - {n if verbose else _short(n)}" for n in group]
    if not verbose and (method or any(len(n) > NOTE_WIDTH for n in shown)):
        more = f"{len(method)} more notes on how these figures were made, " if method else ""
        out += ["", f"({more}every note in full: bigtune plan --verbose; all data: --json)"]
    return out


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
