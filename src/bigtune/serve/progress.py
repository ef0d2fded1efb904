"""What a job's run folder says while it trains and after: progress, ETA, measured memory, checkpoints, and its
metrics as events. Read-only, and tolerant of a folder that does not exist yet or of a line being written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from bigtune.core.rundir import RunDir
from bigtune.engine.checkpoints import checkpoint_step
from bigtune.engine.tracking.base import RUNS_FILE


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


def _thin(rows: list[dict], max_points: int) -> list[dict]:
    """At most ``max_points`` of ``rows``, evenly spaced, the last one kept."""
    if len(rows) <= max_points:
        return rows
    stride = -(-len(rows) // max_points)
    return rows[::-1][::stride][::-1]


MEMORY_FIELDS = ("step", "phase", "allocated", "peak_allocated", "reserved", "peak_reserved")


def series(run_dir: str | Path, max_points: int = 1000) -> dict:
    """The run's plots' data: each logged step's loss and throughput, and each memory snapshot's allocated and
    reserved bytes (per device), thinned to ``max_points`` each."""
    steps = [{k: r.get(k) for k in ("step", "loss", "tokens_per_s", "step_time_s")} for r in metrics(run_dir)]
    snaps = [{k: s.get(k) for k in MEMORY_FIELDS} for s in _read_jsonl(Path(run_dir) / "memory.jsonl")]
    return {"steps": _thin(steps, max_points), "memory": _thin(snaps, max_points)}


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


def mlflow_run(run_dir: str | Path) -> Optional[dict]:
    """The run's MLflow run, as its run folder's tracking.json records it (written when the run starts tracking):
    run id, experiment, tracking URI, and the run's page in the MLflow UI where the URI is a server's. None when
    the run is not tracked in MLflow (yet)."""
    try:
        entry = json.loads((Path(run_dir) / RUNS_FILE).read_text()).get("mlflow")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(entry, dict) or not entry.get("run_id"):
        return None
    uri, run_id, exp_id = without_login(entry.get("tracking_uri")), entry["run_id"], entry.get("experiment_id")
    url = None
    if uri and uri.startswith(("http://", "https://")):
        # the MLflow UI's own addresses of a run (hash routes)
        base = uri.rstrip("/")
        url = f"{base}/#/experiments/{exp_id}/runs/{run_id}" if exp_id else f"{base}/#/runs/{run_id}"
    return {"run_id": run_id, "experiment": entry.get("experiment"), "experiment_id": exp_id, "tracking_uri": uri,
            "url": url}  # fmt: skip


def without_login(uri: Optional[str]) -> Optional[str]:
    """``uri`` less any user:password in it: a job's view must not show a tracking server's credentials."""
    from urllib.parse import urlsplit, urlunsplit

    if not uri:
        return uri
    parts = urlsplit(uri)
    if parts.username is None and parts.password is None:
        return uri
    host = parts.hostname or ""
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
