"""The comparison report of a sweep (or of one run): report.md, results.csv, report.html and the plots.

Each plot (memory, throughput, loss) is drawn once with matplotlib and saved twice: as ``<plot>.svg``,
which report.html also carries inline, and as ``<plot>.png`` for READMEs and slides, which do not all
show SVG. report.html carries its CSS and its plots inline and refers to nothing outside itself, so it
can be mailed or attached to an issue as is; hovering over a bar shows its exact figure.

Memory bars. Snapshots are taken at the boundaries of a step's phases, so no snapshot sees the
categories *at* the peak itself. A bar therefore stacks the categories at the phase boundary with
the most memory allocated (in the step with the highest peak), and tops it with ``transient``: the
peak minus that allocation (temporaries that lived only inside a phase, e.g. during backward).
The plan's bar is built the same way from its prediction for that phase.
"""

from __future__ import annotations

import csv
import html
import io
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

GIB = 1024**3

DEVICE_CATS = ("parameters", "gradients", "optimizer_device", "activations")

ALL_CATS = ("parameters", "gradients", "optimizer_device", "optimizer_cpu", "activations")

CAT_LABELS = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_device": "optimizer state",
    "optimizer_cpu": "optimizer state (CPU)",
    "activations": "activations & batch",
    "transient": "transient (peak − phase)",
}

CAT_COLORS = {
    "parameters": "#4e79a7",
    "gradients": "#f28e2b",
    "optimizer_device": "#59a14f",
    "activations": "#edc948",
    "transient": "#bab0ac",
}

SERIES = (
    "#4e79a7",
    "#e15759",
    "#59a14f",
    "#f28e2b",
    "#76b7b2",
    "#b07aa1",
    "#edc948",
    "#ff9da7",
    "#9c755f",
    "#1f77b4",
    "#2ca02c",
    "#8c564b",
)

DASHES = ((), (7, 4), (2, 3), (9, 3, 2, 3), (4, 4), (1, 4))  # on/off lengths in points; () is a solid line

OOM_COLOR = "#d62728"

FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"

FINISHED = ("ok", "oom")


class ReportError(ValueError):
    """The folder holds nothing to report on."""


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _read_jsonl(path: Path) -> list[dict]:
    out = []
    try:
        text = path.read_text()
    except OSError:
        return out
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a run killed mid-write leaves at most one partial line
    return out


def _capacity(summary: Optional[dict]) -> Optional[int]:
    if not summary:
        return None
    cap = ((summary.get("recipe") or {}).get("memory") or {}).get("cap_gib")
    if cap:
        return int(cap * GIB)
    return (summary.get("device") or {}).get("memory_bytes")


def breakdown(snaps: list[dict], summary: Optional[dict] = None) -> Optional[dict]:
    """Categories at the peak: the step with the highest peak, its phase with the most allocated."""
    source = "memory.jsonl"
    if snaps:
        peak = max(s.get("peak_allocated") or 0 for s in snaps)
        step = max(s["step"] for s in snaps if (s.get("peak_allocated") or 0) == peak)
        at = max((s for s in snaps if s["step"] == step), key=lambda s: s.get("allocated") or 0)
    else:
        last = ((summary or {}).get("oom") or {}).get("last_snapshot")
        if not last:
            return None
        at, peak, source = last, last.get("peak_allocated") or 0, "last snapshot before the OOM"
    out = {"step": at.get("step"), "phase": at.get("phase"), "source": source}
    for c in ALL_CATS:
        out[c] = at.get(c) or 0
    out["allocated"] = at.get("allocated") or 0
    out["peak_allocated"] = max(peak, out["allocated"])
    out["transient"] = max(0, out["peak_allocated"] - out["allocated"])
    return out


def predicted_breakdown(plan: Optional[dict], phase: Optional[str]) -> Optional[dict]:
    """The plan's categories at ``phase`` topped up to its like-for-like peak (or just the peak)."""
    if not plan:
        return None
    peak = plan.get("predicted_peak_allocated_like_for_like") or plan.get("predicted_peak_allocated")
    if not peak:
        return None
    phases = plan.get("phases") or {}
    cats = phases.get(phase) if phase else None
    if not cats:
        return {"peak_allocated": peak, "total": plan.get("predicted_peak_total"), "stacked": False}
    out = {c: (cats.get(c) or {}).get("predicted") or 0 for c in ALL_CATS}
    alloc = (cats.get("allocated") or {}).get("predicted") or sum(out[c] for c in DEVICE_CATS)
    out.update(
        {
            "allocated": alloc,
            "peak_allocated": peak,
            "transient": max(0, peak - alloc),
            "total": plan.get("predicted_peak_total"),
            "stacked": True,
        }
    )
    return out


def _enrich(row: dict, run_dir: Path) -> dict:
    """Add what the plots need from the run folder: snapshots, loss curve, breakdowns, capacity."""
    summary = _read_json(run_dir / "summary.json")
    snaps = _read_jsonl(run_dir / "memory.jsonl")
    metrics = _read_jsonl(run_dir / "metrics.jsonl")
    r = dict(row)
    if summary is not None and r.get("status") in (None, "pending"):
        from bigtune.sweep.ladder import row_from_summary

        r.update(row_from_summary(summary))
    if r.get("capacity_bytes") is None:
        r["capacity_bytes"] = _capacity(summary)
    if summary is not None and r.get("oom") and summary.get("oom"):
        r["oom"] = {**r["oom"], "advice": summary["oom"].get("advice") or []}
    r["snapshots"] = snaps
    r["loss_curve"] = [
        (m["step"], m["loss"])
        for m in metrics
        if isinstance(m.get("step"), (int, float))
        and isinstance(m.get("loss"), (int, float))
        and math.isfinite(m["loss"])
    ]
    r["breakdown"] = breakdown(snaps, summary)
    phase = r["breakdown"]["phase"] if r["breakdown"] else None
    r["predicted"] = predicted_breakdown(r.get("plan"), phase)
    r["summary"] = summary
    return r


def collect(path: str | Path) -> dict:
    """Rows for a sweep folder (sweep.json) or a single run folder (summary.json)."""
    from bigtune.sweep.ladder import row_from_summary

    path = Path(path).resolve()
    if not path.is_dir():
        raise ReportError(
            f"{path} is not a folder; give a sweep folder (with sweep.json) or a run folder (with summary.json)"
        )
    sweep = _read_json(path / "sweep.json")
    if sweep is not None:
        rows = []
        for row in sweep.get("rows", []):
            run_dir = path / row["variant"]
            if not run_dir.is_dir() and row.get("run_dir"):
                run_dir = Path(row["run_dir"])
            rows.append(_enrich(row, run_dir))
        if not rows:
            raise ReportError(f"{path / 'sweep.json'} lists no variants")
        return {
            "kind": "sweep",
            "title": sweep.get("name") or path.name,
            "source": str(path),
            "rows": rows,
            "meta": {
                k: sweep.get(k)
                for k in ("description", "sweep_file", "base", "tiny", "command", "started_at", "updated_at")
            },
        }
    summary = _read_json(path / "summary.json")
    if summary is None:
        hint = ""
        subs = sorted(p.parent.name for p in path.glob("*/summary.json"))
        if subs:
            hint = f"; it holds run folders ({', '.join(subs[:5])}{', …' if len(subs) > 5 else ''}): report one of them"
        raise ReportError(f"{path} has neither sweep.json (a sweep folder) nor summary.json (a run folder){hint}")
    name = summary.get("name") or path.name
    row = {"variant": name, "run_dir": str(path), **row_from_summary(summary)}
    return {
        "kind": "run",
        "title": name,
        "source": str(path),
        "rows": [_enrich(row, path)],
        "meta": {
            "model": ((summary.get("recipe") or {}).get("model") or {}).get("name"),
            "precision": (summary.get("recipe") or {}).get("precision"),
        },
    }


def fmt_bytes(n: Optional[float]) -> str:
    from bigtune.core.stepmath import human_bytes  # stepmath imports torch: keep `bigtune --help` fast

    return human_bytes(n)


def _unit_for(vmax: float) -> tuple[str, float]:
    if vmax >= GIB:
        return "GiB", GIB
    if vmax >= 1024**2:
        return "MiB", 1024**2
    return "KiB", 1024


def _num(x: Optional[float], fmt: str = "{:.4g}") -> str:
    return "-" if x is None else fmt.format(x)


def _gib(n: Optional[float]) -> str:
    return "" if n is None else f"{n / GIB:.6g}"


def _val(v: Any) -> str:
    """A recipe value as it would be written after --set (true, null, 1e-4)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def _oom_text(r: dict) -> str:
    o = r.get("oom") or {}
    return f"{o.get('phase')} @ step {o.get('step')}" if r.get("status") == "oom" and o else ""


CSV_COLUMNS = (
    "variant",
    "status",
    "expect",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "peak_step",
    "peak_phase",
    "parameters_gib",
    "gradients_gib",
    "optimizer_device_gib",
    "optimizer_cpu_gib",
    "activations_gib",
    "transient_gib",
    "predicted_peak_gib",
    "prediction_error_pct",
    "capacity_gib",
    "step_time_s",
    "tokens_per_s",
    "final_loss",
    "oom_phase",
    "oom_step",
    "reason",
    "note",
    "tiny_mapping",
    "run_dir",
)


def _reason(r: dict) -> str:
    """Why a variant did not finish ok: the OOM message, the refusal, or the error; empty when it did."""
    st = r.get("status")
    if st == "ok":
        return ""
    if st == "oom":
        o = r.get("oom") or {}
        return f"out of memory in {o.get('phase')} at step {o.get('step')}: {o.get('message')}"
    if st == "refused":
        return "refused (not run): " + "; ".join(r.get("reasons") or [r.get("error") or "?"])
    return str(r.get("error") or "")


def csv_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        b = r.get("breakdown") or {}
        p = r.get("plan") or {}
        pred = (r.get("predicted") or {}).get("peak_allocated")
        o = r.get("oom") or {}
        err = p.get("peak_error_pct")
        out.append(
            {
                "variant": r["variant"],
                "status": r.get("status"),
                "expect": r.get("expect") or "",
                "peak_allocated_gib": _gib(r.get("peak_allocated_bytes")),
                "peak_reserved_gib": _gib(r.get("peak_reserved_bytes")),
                "peak_step": b.get("step", ""),
                "peak_phase": b.get("phase", ""),
                **{f"{c}_gib": _gib(b.get(c)) if b else "" for c in ALL_CATS},
                "transient_gib": _gib(b.get("transient")) if b else "",
                "predicted_peak_gib": _gib(pred),
                "prediction_error_pct": "" if err is None else f"{err:.3g}",
                "capacity_gib": _gib(r.get("capacity_bytes")),
                "step_time_s": "" if r.get("step_time_s") is None else f"{r['step_time_s']:.6g}",
                "tokens_per_s": "" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.6g}",
                "final_loss": "" if r.get("final_loss") is None else f"{r['final_loss']:.6g}",
                "oom_phase": o.get("phase", "") if r.get("status") == "oom" else "",
                "oom_step": o.get("step", "") if r.get("status") == "oom" else "",
                "reason": _reason(r),
                "note": r.get("note") or "",
                "tiny_mapping": r.get("tiny_note") or "",
                "run_dir": r.get("run_dir") or "",
            }
        )
    return out


def _table_cells(r: dict) -> list[str]:
    b = r.get("breakdown") or {}
    p = r.get("plan") or {}
    pred = (r.get("predicted") or {}).get("peak_allocated")
    err = p.get("peak_error_pct")
    status = r.get("status") or "?"
    if r.get("expect") and r.get("expect_met") is False:
        status += f" (expected {r['expect']})"
    return [
        r["variant"],
        status,
        fmt_bytes(r.get("peak_allocated_bytes")),
        fmt_bytes(r.get("peak_reserved_bytes")),
        f"{b.get('phase')} @ {b.get('step')}" if b else "-",
        *[fmt_bytes(b.get(c)) if b else "-" for c in ALL_CATS],
        fmt_bytes(pred),
        "-" if err is None else f"{err:+.1f}%",
        fmt_bytes(r.get("capacity_bytes")),
        _num(r.get("step_time_s"), "{:.4f}"),
        _num(r.get("tokens_per_s"), "{:,.0f}"),
        _num(r.get("final_loss"), "{:.4f}"),
        _oom_text(r) or "-",
    ]


TABLE_HEAD = [
    "variant",
    "status",
    "peak alloc",
    "peak reserved",
    "peak at",
    "params",
    "grads",
    "optim",
    "optim (CPU)",
    "acts",
    "plan peak",
    "plan err",
    "capacity",
    "step s",
    "tokens/s",
    "final loss",
    "OOM",
]


def _e(s: Any) -> str:
    return html.escape(str(s), quote=True)


# --- Charts: each drawn once as a matplotlib Figure, then saved as SVG (standalone and inline in
# report.html) and as PNG. The figures are built without pyplot, so no backend or global state is touched.

# Text stays <text> in the SVG (searchable, and "OOM" readable by a test or a screen reader); a fixed
# hash salt gives the same ids for the same results, one salt per chart keeps the three charts' ids
# apart inside one page. A shorter sans-serif list than matplotlib's keeps every <text> short.
_SVG_RC = {"svg.fonttype": "none", "font.sans-serif": ["DejaVu Sans", "Helvetica", "Arial"]}
# No <metadata> block: its date changes on every run, its creator and type are web addresses.
_SVG_METADATA = {"Date": None, "Creator": None, "Format": None, "Type": None}


@dataclass
class Chart:
    """One chart: its figure, and the hover text of each artist given an id by ``tag``."""

    kind: str  # memory, throughput or loss: names the files and the inline SVG's class
    label: str
    fig: Any  # matplotlib.figure.Figure
    tips: dict[str, str] = field(default_factory=dict)

    def tag(self, artist: Any, variant: Optional[str], part: str, tip: Optional[str] = None) -> Any:
        """Give ``artist`` the SVG id ``variant-<variant>:<part>`` (or ``part`` alone) and a hover text."""
        gid = part if variant is None else f"variant-{variant}:{part}"  # ':' is never in a sweep's variant name
        artist.set_gid(gid)
        if tip:
            self.tips[gid] = tip
        return artist

    def svg(self) -> str:
        """The standalone SVG file's text, with a <title> (the browser's tooltip) in each tagged group."""
        from matplotlib import rc_context

        buf = io.StringIO()
        with rc_context({**_SVG_RC, "svg.hashsalt": f"bigtune-{self.kind}"}):
            self.fig.savefig(buf, format="svg", metadata=_SVG_METADATA)

        def titled(m: re.Match) -> str:
            tip = self.tips.get(html.unescape(m.group(1)))
            return m.group(0) + (f"<title>{_e(tip)}</title>" if tip else "")

        return re.sub(r'<g id="([^"]*)">', titled, buf.getvalue())

    def save_png(self, path: Path) -> None:
        tmp = path.with_name(f".{path.name}.tmp")
        self.fig.savefig(tmp, format="png")
        os.replace(tmp, path)


def inline_svg(svg: str, kind: str, label: str) -> str:
    """A chart's SVG file as an element of report.html.

    No XML prolog or namespace declarations (HTML's parser supplies the namespaces, and the page names
    no web address); the size in CSS pixels; matplotlib's automatic group ids (figure_1, axes_1, ...),
    which every chart repeats and nothing refers to, dropped so that the page's ids stay unique.
    """
    body = svg[svg.index("<svg") :]
    root_end = body.index(">") + 1
    view = re.search(r'viewBox="([^"]*)"', body[:root_end]).group(1)
    w_pt, h_pt = (float(x) for x in view.split()[2:])
    inner = re.sub(r' id="[\w.]+_\d+"', "", body[root_end:])
    px = 96 / 72  # matplotlib's SVG unit is the point
    return (
        f'<svg class="plot {kind}" width="{w_pt * px:.0f}" height="{h_pt * px:.0f}" viewBox="{view}" '
        f'role="img" aria-label="{_e(label)}">' + inner.rstrip() + "\n"
    )


def _figure(width_in: float, height_in: float) -> Any:
    from matplotlib.figure import Figure  # here: importing matplotlib would slow down `bigtune --help`

    return Figure(figsize=(width_in, height_in), dpi=100, layout="constrained")


def _short(name: str, n: int = 28) -> str:
    return name if len(name) <= n else name[: n - 1] + "…"


def _status_word(r: dict) -> str:
    st = r.get("status")
    return "OOM" if st == "oom" else (st if st not in ("ok", None) else "n/a")


def _variant_ticks(chart: Chart, ax: Any, rows: list[dict], tag: bool) -> None:
    """Variant names under the bars, red for those that did not finish ok."""
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([_short(r["variant"]) for r in rows], rotation=35, ha="right", fontsize=8)
    for lbl, r in zip(ax.get_xticklabels(), rows):
        if r.get("status") not in ("ok", None):
            lbl.set_color(OOM_COLOR)
        if tag:
            chart.tag(lbl, r["variant"], "name", f"{r['variant']}: {_reason(r) or r.get('status')}")


def memory_chart(rows: list[dict], title: str) -> Chart:
    """(a) Stacked measured categories per variant beside the plan's prediction, capacity, OOM marks.

    Long because it draws one figure bar by bar, each mark with its id and hover text.
    """
    from matplotlib.patches import Patch

    n = len(rows)
    values = [1.0]
    for r in rows:
        b, p = r.get("breakdown"), r.get("predicted")
        values += [b["peak_allocated"]] if b else []
        values += [p["peak_allocated"], p.get("total") or 0] if p else []
        values += [r.get("peak_reserved_bytes") or 0, r.get("capacity_bytes") or 0]
    unit, size = _unit_for(max(values))
    chart = Chart("memory", f"Memory per variant: {title}", _figure(max(7.0, 1.0 + 0.75 * n), 5.6))
    ax = chart.fig.subplots()
    bw = 0.36
    top = max(values) / size * 1.12
    caps = [r.get("capacity_bytes") for r in rows]
    shared_cap = caps[0] if caps and caps[0] and all(c == caps[0] for c in caps) else None
    if shared_cap:
        line = ax.axhline(shared_cap / size, color=OOM_COLOR, ls=(0, (6, 4)), lw=1.3)
        chart.tag(line, None, "capacity", f"capacity {fmt_bytes(shared_cap)}")
        ax.text(
            n - 0.5,
            shared_cap / size,
            f"capacity {fmt_bytes(shared_cap)} ",
            color=OOM_COLOR,
            fontsize=8,
            ha="right",
            va="bottom",
        )
    for i, r in enumerate(rows):
        name, b, p, st = r["variant"], r.get("breakdown"), r.get("predicted"), r.get("status")
        xm, xp = i - bw / 2 - 0.02, i + bw / 2 + 0.02
        bar_top = 0.0
        if b:
            for c in DEVICE_CATS + ("transient",):
                v = (b.get(c) or 0) / size
                if v > 0:
                    bar = ax.bar(xm, v, bw, bottom=bar_top, color=CAT_COLORS[c], edgecolor="white", linewidth=0.3)
                    tip = f"{name}: {CAT_LABELS[c]} {fmt_bytes(b[c])} ({b['phase']}, step {b['step']}; {b['source']})"
                    chart.tag(bar[0], name, f"measured:{c}", tip)
                    bar_top += v
            if b.get("optimizer_cpu"):
                ax.annotate(
                    f"+{fmt_bytes(b['optimizer_cpu'])} CPU",
                    (xm, 0),
                    xytext=(0, 2),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    color="#333",
                    rotation=90,
                )
            if r.get("peak_reserved_bytes"):
                tick = ax.hlines(
                    r["peak_reserved_bytes"] / size, xm - bw / 2 - 0.04, xm + bw / 2 + 0.04, color="#333", lw=2
                )
                chart.tag(tick, name, "reserved", f"{name}: peak reserved {fmt_bytes(r['peak_reserved_bytes'])}")
        if p:
            peak = p["peak_allocated"] / size
            if p.get("stacked"):
                acc = 0.0
                for c in DEVICE_CATS + ("transient",):
                    v = (p.get(c) or 0) / size
                    if v > 0:
                        bar = ax.bar(xp, v, bw, bottom=acc, color=CAT_COLORS[c], alpha=0.45, edgecolor="white", lw=0.3)
                        chart.tag(bar[0], name, f"plan:{c}", f"{name}: plan {CAT_LABELS[c]} {fmt_bytes(p[c])}")
                        acc += v
            else:
                bar = ax.bar(xp, peak, bw, color="#9aa5b1", alpha=0.6)
                chart.tag(bar[0], name, "plan:peak", f"{name}: plan peak allocated {fmt_bytes(p['peak_allocated'])}")
            ax.bar(xp, peak, bw, fill=False, edgecolor="#555", lw=0.8)
            err = (r.get("plan") or {}).get("peak_error_pct")
            ax.text(
                xp,
                peak,
                f"{peak:.3g}" + ("" if err is None else f"\n({err:+.1f}%)"),
                ha="center",
                va="bottom",
                fontsize=6.5,
                color="#555",
            )
            if p.get("total") and p["total"] > p["peak_allocated"] * 1.001:
                tick = ax.hlines(
                    p["total"] / size, xp - bw / 2 - 0.02, xp + bw / 2 + 0.02, color="#555", ls=(0, (2, 2)), lw=1.5
                )
                tip = f"{name}: plan total incl. reserved and CUDA context {fmt_bytes(p['total'])}"
                chart.tag(tick, name, "plan:total", tip)
        cap = r.get("capacity_bytes")
        if cap and not shared_cap:
            line = ax.hlines(cap / size, i - 0.45, i + 0.45, color=OOM_COLOR, ls=(0, (6, 4)), lw=1.3)
            chart.tag(line, name, "capacity", f"{name}: capacity {fmt_bytes(cap)}")
        if st == "oom":
            o = r.get("oom") or {}
            reach = max(cap or 0, (p or {}).get("peak_allocated") or 0) / size
            if reach > bar_top:
                bar = ax.bar(xm, reach - bar_top, bw, bottom=bar_top, fill=False, edgecolor=OOM_COLOR, ls="--", lw=1.2)
                tip = f"{name}: ran out of memory; capacity {fmt_bytes(cap)}, plan {fmt_bytes((p or {}).get('peak_allocated'))}"
                chart.tag(bar[0], name, "oom:reach", tip)
                bar_top = reach
            if not b:
                bar = ax.bar(xm, top * 0.01, bw, color=OOM_COLOR)
                chart.tag(bar[0], name, "oom:nothing-measured", f"{name}: nothing measured before the OOM")
            label = ax.text(
                xm,
                bar_top,
                f"OOM\n{o.get('phase')} @ {o.get('step')}",
                ha="center",
                va="bottom",
                fontsize=7,
                color=OOM_COLOR,
                fontweight="bold",
            )
            chart.tag(label, name, "oom", f"{name}: {_reason(r)}")
        elif b:
            ax.text(xm, bar_top, f"{b['peak_allocated'] / size:.3g}", ha="center", va="bottom", fontsize=7)
        elif st not in FINISHED:
            word = ax.text(
                i, top * 0.02, _status_word(r), rotation=90, ha="center", va="bottom", fontsize=9, color=OOM_COLOR
            )
            chart.tag(word, name, "status", f"{name}: {_reason(r) or st}")
    _variant_ticks(chart, ax, rows, tag=True)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylim(0, top)
    ax.set_ylabel(unit)
    ax.grid(axis="y", color="#e6e6e6")
    ax.set_axisbelow(True)
    planned = any(r.get("predicted") for r in rows)
    how = "left: measured, right faded: plan" if planned else "measured; no plan"
    ax.set_title(f"Peak memory per variant ({how}) — {title}", fontsize=10)
    handles = [Patch(color=CAT_COLORS[c], label=CAT_LABELS[c]) for c in DEVICE_CATS + ("transient",)]
    chart.fig.legend(handles=handles, fontsize=7, ncol=5, loc="outside lower center", frameon=False)
    return chart


def throughput_chart(rows: list[dict], title: str) -> Chart:
    """(b) Tokens per second and seconds per optimizer step, one bar per variant."""
    n = len(rows)
    chart = Chart("throughput", f"Throughput per variant: {title}", _figure(max(7.0, 1.0 + 0.7 * n), 6.0))
    axes = chart.fig.subplots(2, 1, sharex=True)
    for ax, key, label, fmt, color in (
        (axes[0], "tokens_per_s", "tokens/s (higher is better)", "{:,.0f}", "#4e79a7"),
        (axes[1], "step_time_s", "s / step (lower is better)", "{:.3g}", "#f28e2b"),
    ):
        vals = [r.get(key) for r in rows]
        present = [v for v in vals if isinstance(v, (int, float)) and v > 0]
        vmax = max(present) * 1.18 if present else 1.0
        for i, (r, v) in enumerate(zip(rows, vals)):
            if isinstance(v, (int, float)) and v > 0:
                bar = ax.bar(i, v, 0.55, color=color)
                chart.tag(bar[0], r["variant"], key, f"{r['variant']}: {label.split(' (')[0]} {fmt.format(v)}")
                ax.text(i, v, fmt.format(v), ha="center", va="bottom", fontsize=7)
            else:
                word = ax.text(
                    i,
                    vmax * 0.03,
                    _status_word(r),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    color=OOM_COLOR if r.get("status") != "ok" else "#777",
                )
                chart.tag(word, r["variant"], f"{key}:none", f"{r['variant']}: no {key} ({r.get('status')})")
        ax.set_ylim(0, vmax)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(axis="y", color="#e6e6e6")
        ax.set_axisbelow(True)
    _variant_ticks(chart, axes[1], rows, tag=False)
    axes[0].set_title(f"Throughput — {title}", fontsize=10)
    return chart


def loss_chart(rows: list[dict], title: str) -> Chart:
    """(c) Training loss against optimizer step, one curve per variant that logged any."""
    from matplotlib.ticker import MaxNLocator

    chart = Chart("loss", f"Loss curves: {title}", _figure(9.0, 4.6))
    ax = chart.fig.subplots()
    drawn = 0
    for i, r in enumerate(rows):
        curve = r.get("loss_curve") or []
        dash = DASHES[i % len(DASHES)]
        if curve:
            # Curves often coincide (activation checkpointing does not change the maths): later ones are
            # thinner and dashed so that the earlier ones stay visible underneath.
            (line,) = ax.plot(
                [s for s, _ in curve],
                [v for _, v in curve],
                color=SERIES[i % len(SERIES)],
                ls=(0, dash) if dash else "-",
                lw=max(1.2, 2.6 - 0.3 * i),
                marker="o" if len(curve) <= 40 else None,
                ms=3,
                label=_short(r["variant"]),
            )
            tip = f"{r['variant']}: loss {curve[0][1]:.4f} → {curve[-1][1]:.4f}"
            chart.tag(line, r["variant"], "loss", tip)
            drawn += 1
        else:
            ax.plot([], [], color="#bbb", label=f"{_short(r['variant'])} (no loss: {r.get('status')})")
    if not drawn:
        ax.text(0.5, 0.5, "no variant logged a loss", ha="center", va="center", transform=ax.transAxes, color="#777")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(color="#e6e6e6")
    ax.set_title(f"Training loss — {title}", fontsize=10)
    chart.fig.legend(fontsize=7, loc="outside right center", frameon=False)
    return chart


def _phase_table(r: dict) -> Optional[tuple[int, list[list[str]], str]]:
    """Per-phase measured categories (and plan) at the step with the highest peak."""
    snaps = r.get("snapshots") or []
    b = r.get("breakdown")
    if not snaps or not b:
        return None
    step = b["step"]
    in_step = [s for s in snaps if s["step"] == step]
    unit, size = _unit_for(max(s.get("peak_allocated") or 0 for s in in_step) or 1)
    phases = ((r.get("plan") or {}).get("phases")) or {}
    rows = []
    for s in in_step:
        cells = [s["phase"]] + [f"{(s.get(c) or 0) / size:.2f}" for c in ALL_CATS + ("allocated", "peak_allocated")]
        pred = phases.get(s["phase"])
        cells.append(f"{pred['allocated']['predicted'] / size:.2f}" if pred and "allocated" in pred else "-")
        cells.append("-" if s.get("reserved") is None else f"{s['reserved'] / size:.2f}")
        rows.append(cells)
    return step, rows, unit


PHASE_HEAD = ["phase", "params", "grads", "optim", "optim_cpu", "acts", "alloc", "peak", "plan alloc", "reserved"]


def text_summary(data: dict) -> str:
    """What ``bigtune report`` prints."""
    from bigtune.sweep.ladder import format_rows

    rows = data["rows"]
    if data["kind"] == "sweep":
        counts: dict[str, int] = {}
        for r in rows:
            counts[r.get("status") or "?"] = counts.get(r.get("status") or "?", 0) + 1
        head = f"sweep {data['title']} ({data['source']}): " + ", ".join(f"{v} {k}" for k, v in counts.items())
        return head + "\n" + format_rows(rows)
    r = rows[0]
    s = r.get("summary") or {}
    lines = [
        f"run {data['title']} ({data['source']}): status {r.get('status')}, {r.get('steps') or 0} of "
        f"{s.get('total_steps', '?')} steps; model {data['meta'].get('model')} "
        f"({(r.get('parameters') or 0):,} parameters), precision {data['meta'].get('precision')}, "
        f"device {(r.get('device') or {}).get('name') or (r.get('device') or {}).get('type')}"
    ]
    p = r.get("plan") or {}
    pred = (r.get("predicted") or {}).get("peak_allocated")
    err = p.get("peak_error_pct")
    lines.append(
        f"peak allocated {fmt_bytes(r.get('peak_allocated_bytes'))}, reserved "
        f"{fmt_bytes(r.get('peak_reserved_bytes'))}; plan {fmt_bytes(pred)}"
        + ("" if err is None else f" ({err:+.2f}%)")
        + (f"; capacity {fmt_bytes(r['capacity_bytes'])}" if r.get("capacity_bytes") else "")
    )
    lines.append(
        f"throughput {_num(r.get('tokens_per_s'), '{:,.0f}')} tokens/s, "
        f"{_num(r.get('step_time_s'), '{:.4f}')} s per optimizer step"
    )
    lines.append(f"loss {_num(r.get('first_loss'), '{:.4f}')} → {_num(r.get('final_loss'), '{:.4f}')}")
    if r.get("status") == "oom":
        o = r.get("oom") or {}
        lines.append(f"OUT OF MEMORY in {o.get('phase')} at step {o.get('step')}: {o.get('message')}")
        lines += [f"  try: {a}" for a in o.get("advice") or []]
    if r.get("error"):
        lines.append(f"error: {r['error']}")
    pt = _phase_table(r)
    if pt:
        step, trows, unit = pt
        lines.append(f"memory at step {step} ({unit}):")
        widths = [16] + [11] * (len(PHASE_HEAD) - 1)
        for cells in [PHASE_HEAD] + trows:
            lines.append(
                "".join(
                    f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cells, widths, strict=True))
                )
            )
    return "\n".join(lines)


def _md_table(head: list[str], rows: list[list[str]]) -> str:
    def esc(c: str) -> str:
        return str(c).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def markdown(data: dict, svg_names: dict[str, str]) -> str:
    rows = data["rows"]
    kind = "Sweep" if data["kind"] == "sweep" else "Run"
    lines = [
        f"# {kind} report: {data['title']}",
        "",
        f"Source: `{data['source']}` · generated {time.strftime('%Y-%m-%d %H:%M:%S')} by bigtune.",
        "",
    ]
    meta = data.get("meta") or {}
    if meta.get("description"):
        lines += [str(meta["description"]).strip(), ""]
    if meta.get("command"):
        lines += [f"Command: `{' '.join(meta['command'])}`", ""]
    lines += [
        _md_table(TABLE_HEAD, [_table_cells(r) for r in rows]),
        "",
        "Memory categories are taken at the phase boundary with the most memory allocated in the step with "
        "the highest peak; *transient* is the rest of the peak (temporaries inside a phase). Numbers are "
        "per device; `plan err` is (plan − measured) / measured at the measured batch shape.",
        "",
    ]
    for key, label in (("memory", "Memory per variant"), ("throughput", "Throughput"), ("loss", "Loss curves")):
        lines += [f"![{label}]({svg_names[key]})", ""]
    notes = []
    for r in rows:
        bits = []
        if r.get("note"):
            bits.append(r["note"])
        if r.get("overrides"):
            shown = {k: v for k, v in r["overrides"].items() if k != "name"}
            if shown:
                bits.append("overrides: " + ", ".join(f"`{k}={_val(v)}`" for k, v in shown.items()))
        if r.get("status") == "oom" and r.get("oom"):
            o = r["oom"]
            bits.append(f"out of memory in {o.get('phase')} at step {o.get('step')}: {o.get('message')}")
            bits += [f"try: {a}" for a in o.get("advice") or []]
        if r.get("tiny_note"):
            bits.append(f"--tiny: {r['tiny_note']}")
        if r.get("status") == "refused":
            bits.append(_reason(r))
        elif r.get("error"):
            bits.append(f"error: {r['error']}")
        if r.get("status") in ("crashed", "timeout", "interrupted"):
            bits.append(f"{r['status']} (exit code {r.get('exit_code')}); log: `{r.get('log')}`")
            if r.get("log_tail"):
                bits.append("log tail:\n\n```\n" + "\n".join(r["log_tail"].splitlines()[-12:]) + "\n```")
        if bits:
            notes.append(f"- **{r['variant']}**: " + "; ".join(bits[:1]) + "".join(f"\n  - {b}" for b in bits[1:]))
    if notes:
        lines += ["## Variants", ""] + notes + [""]
    if data["kind"] == "run":
        pt = _phase_table(rows[0])
        if pt:
            step, trows, unit = pt
            lines += [f"## Memory per phase, step {step} ({unit})", "", _md_table(PHASE_HEAD, trows), ""]
    return "\n".join(lines)


CSS = (
    """
body{font-family:%s;margin:24px auto;max-width:1280px;padding:0 16px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.meta{color:#555;font-size:13px;margin:2px 0} code{background:#f3f3f3;padding:1px 4px;border-radius:3px;font-size:12px}
table{border-collapse:collapse;font-size:12.5px;margin:8px 0}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:right;white-space:nowrap}
th{background:#f5f5f5} td:first-child,th:first-child{text-align:left} td.l{text-align:left;white-space:normal}
.st{font-weight:600;border-radius:3px;padding:0 5px} .st-ok{background:#e3f4e3;color:#1e6b1e}
.st-oom{background:#fde2e2;color:#a31515} .st-bad{background:#fff0c2;color:#7a5600}
figure{margin:16px 0;overflow-x:auto} figcaption{font-size:12px;color:#555;max-width:900px}
pre{background:#f6f6f6;padding:8px;font-size:11.5px;overflow-x:auto} .wrap{overflow-x:auto}
ul{font-size:13px}
"""
    % FONT
)


def _status_html(r: dict) -> str:
    st = r.get("status") or "?"
    cls = "st-ok" if st == "ok" else "st-oom" if st == "oom" else "st-bad"
    out = f'<span class="st {cls}">{_e(st)}</span>'
    if r.get("expect") and r.get("expect_met") is False:
        out += f' <span class="st st-bad">expected {_e(r["expect"])}</span>'
    return out


def html_report(data: dict, plots: dict[str, str]) -> str:
    """The self-contained report.html: tables, the inline SVG ``plots`` (by kind) and each run's phase table.

    Long because it writes one HTML page in reading order; each part is a few lines of markup.
    """
    rows = data["rows"]
    meta = data.get("meta") or {}
    kind = "Sweep" if data["kind"] == "sweep" else "Run"
    h = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>bigtune {kind.lower()} report: {_e(data['title'])}</title>",
        f"<style>{CSS}</style></head><body>",
        f"<h1>{kind} report: {_e(data['title'])}</h1>",
        f'<p class="meta">source <code>{_e(data["source"])}</code> · generated '
        f"{_e(time.strftime('%Y-%m-%d %H:%M:%S'))} by bigtune</p>",
    ]
    if meta.get("description"):
        h.append(f'<p class="meta">{_e(str(meta["description"]).strip())}</p>')
    if meta.get("command"):
        h.append(f'<p class="meta">command <code>{_e(" ".join(meta["command"]))}</code></p>')
    devices = {(r.get("device") or {}).get("name") or (r.get("device") or {}).get("type") for r in rows} - {None}
    if devices:
        h.append(f'<p class="meta">device {_e(", ".join(sorted(devices)))}</p>')
    h.append(
        '<h2>Results</h2><div class="wrap"><table><thead><tr>'
        + "".join(f"<th>{_e(c)}</th>" for c in TABLE_HEAD)
        + "</tr></thead><tbody>"
    )
    for r in rows:
        cells = _table_cells(r)
        tds = [f"<td>{_e(cells[0])}</td>", f"<td>{_status_html(r)}</td>"] + [f"<td>{_e(c)}</td>" for c in cells[2:]]
        h.append("<tr>" + "".join(tds) + "</tr>")
    h.append("</tbody></table></div>")
    captions = {
        "memory": "Measured memory per category (left bar) beside the plan's prediction (right bar, faded) per "
        "variant. Categories are taken at the phase boundary with the most memory allocated, in the step "
        "with the highest peak; grey <em>transient</em> is the rest of the peak. Dashed red: the device's "
        "capacity (or <code>memory.cap_gib</code>); red outline: a variant that ran out of memory, with "
        "the phase and step. A black tick marks CUDA's peak reserved memory; a dotted tick the plan's "
        "total with reserved memory and CUDA context.",
        "throughput": "Tokens per second and seconds per optimizer step over the whole run (first steps included).",
        "loss": "Training loss per logged optimizer step.",
    }
    for key, title in (("memory", "Memory"), ("throughput", "Throughput"), ("loss", "Loss")):
        h.append(f"<h2>{title}</h2><figure>{plots[key]}<figcaption>{captions[key]}</figcaption></figure>")
    details = []
    for r in rows:
        items = []
        if r.get("note"):
            items.append(_e(r["note"]))
        shown = {k: v for k, v in (r.get("overrides") or {}).items() if k != "name"}
        if shown:
            items.append("overrides " + " ".join(f"<code>{_e(k)}={_e(_val(v))}</code>" for k, v in shown.items()))
        if r.get("status") == "oom" and r.get("oom"):
            o = r["oom"]
            items.append(
                f"<strong>out of memory</strong> in {_e(o.get('phase'))} at step {_e(o.get('step'))}: "
                f"{_e(o.get('message'))}"
            )
            if o.get("advice"):
                items.append("try: " + "; ".join(_e(a) for a in o["advice"]))
        if r.get("tiny_note"):
            items.append(f"<code>--tiny</code>: {_e(r['tiny_note'])}")
        if r.get("status") == "refused":
            items.append(f"<strong>{_e(_reason(r))}</strong>")
        elif r.get("error"):
            items.append(f"error: {_e(r['error'])}")
        if r.get("status") in ("crashed", "timeout", "interrupted"):
            items.append(f"{_e(r['status'])} (exit code {_e(r.get('exit_code'))}); log <code>{_e(r.get('log'))}</code>")
            if r.get("log_tail"):
                items.append("<pre>" + _e("\n".join(r["log_tail"].splitlines()[-15:])) + "</pre>")
        if r.get("run_dir"):
            items.append(f"run folder <code>{_e(r['run_dir'])}</code>")
        if items:
            details.append(
                f"<li><strong>{_e(r['variant'])}</strong><ul>" + "".join(f"<li>{i}</li>" for i in items) + "</ul></li>"
            )
    if details:
        h.append("<h2>Variants</h2><ul>" + "".join(details) + "</ul>")
    if data["kind"] == "run":
        pt = _phase_table(rows[0])
        if pt:
            step, trows, unit = pt
            h.append(
                f"<h2>Memory per phase, step {step} ({_e(unit)})</h2><table><thead><tr>"
                + "".join(f"<th>{_e(c)}</th>" for c in PHASE_HEAD)
                + "</tr></thead><tbody>"
                + "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in cells) + "</tr>" for cells in trows)
                + "</tbody></table>"
            )
    h.append("</body></html>\n")
    return "\n".join(h)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_report(path: str | Path, out_dir: str | Path | None = None) -> dict:
    """Write report.md, results.csv, report.html and memory/throughput/loss .svg and .png for a sweep or run folder.

    Returns the paths written and ``text``, the summary ``bigtune report`` prints.
    """
    data = collect(path)
    out = Path(out_dir) if out_dir is not None else Path(path)
    out.mkdir(parents=True, exist_ok=True)
    rows, title = data["rows"], data["title"]
    charts = [memory_chart(rows, title), throughput_chart(rows, title), loss_chart(rows, title)]
    names = {c.kind: f"{c.kind}.svg" for c in charts}
    plots, written, pngs = {}, [], []
    for c in charts:
        svg = c.svg()
        _atomic_write(out / names[c.kind], svg)
        written.append(str(out / names[c.kind]))
        plots[c.kind] = inline_svg(svg, c.kind, c.label)
        c.save_png(out / f"{c.kind}.png")
        pngs.append(str(out / f"{c.kind}.png"))
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(CSV_COLUMNS), lineterminator="\n")
    w.writeheader()
    w.writerows(csv_rows(rows))
    _atomic_write(out / "results.csv", buf.getvalue())
    _atomic_write(out / "report.md", markdown(data, names))
    _atomic_write(out / "report.html", html_report(data, plots))
    return {
        "markdown": str(out / "report.md"),
        "csv": str(out / "results.csv"),
        "html": str(out / "report.html"),
        "svgs": written,
        "pngs": pngs,
        "text": text_summary(data),
        "kind": data["kind"],
    }
