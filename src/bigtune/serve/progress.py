"""What a job's run folder says while it trains and after: progress, ETA, measured memory, checkpoints, and its
metrics as events. Read-only, and tolerant of a folder that does not exist yet or of a line being written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from bigtune.core.rundir import RunDir
from bigtune.engine.checkpoints import checkpoint_step


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the line the trainer is writing now
            break
    return out


def summary(run_dir: str | Path) -> Optional[dict]:
    path = Path(run_dir) / "summary.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None


def metrics(run_dir: str | Path) -> list[dict]:
    return _read_jsonl(Path(run_dir) / "metrics.jsonl")


def progress(run_dir: str | Path, total_steps: Optional[int]) -> dict:
    """step, total, fraction, and the ETA (seconds) from the mean logged step time; a finished run's summary
    has the last word on its steps."""
    rows = metrics(run_dir)
    done = summary(run_dir)
    step = rows[-1]["step"] if rows else 0
    if done and done.get("steps") is not None:
        step = done["steps"]
    times = [r["step_time_s"] for r in rows if r.get("step_time_s")]
    eta = None
    if total_steps and times and step < total_steps:
        eta = (total_steps - step) * sum(times) / len(times)
    elif total_steps and step >= total_steps:
        eta = 0.0
    return {
        "step": step,
        "total_steps": total_steps,
        "fraction": (step / total_steps) if total_steps else None,
        "eta_s": eta,
        "loss": rows[-1].get("loss") if rows else None,
    }


def measured_peak_bytes(run_dir: str | Path) -> Optional[int]:
    """The run's peak allocated memory: the summary's when it has ended, else the largest snapshot so far."""
    done = summary(run_dir)
    if done and done.get("peak_allocated_bytes") is not None:
        return done["peak_allocated_bytes"]
    peaks = [s.get("peak_allocated") for s in _read_jsonl(Path(run_dir) / "memory.jsonl")]
    peaks = [p for p in peaks if p is not None]
    return max(peaks) if peaks else None


def checkpoints(run_dir: str | Path) -> list[dict]:
    """The run's resumable checkpoints, oldest first: step, path, bytes, written at."""
    out = []
    for path in RunDir(Path(run_dir), writer=False).list_checkpoints():
        try:
            st = path.stat()
        except FileNotFoundError:  # pruned (checkpoint.keep_last) while listing
            continue
        size = st.st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        out.append({"step": checkpoint_step(path), "path": str(path), "bytes": size, "created_at": st.st_mtime})
    return out


def newest_checkpoint(run_dir: str | Path) -> Optional[str]:
    found = checkpoints(run_dir)
    return Path(found[-1]["path"]).name if found else None
