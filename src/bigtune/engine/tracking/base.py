"""The tracking interface the engine calls, and the guard every backend runs behind.

A backend is a plain class with ``start``, ``log_step``, ``log_memory`` and ``finish`` (the ``Tracker``
protocol). The engine never calls one directly: each runs behind a ``Guarded`` worker thread fed by a bounded
queue, so a slow or hung tracking server cannot stall a training step, and the first failure disables that
backend with one warning instead of stopping the run (the run folder's own files are the record that counts).
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

from bigtune.core.rundir import atomic_write_text
from bigtune.core.stepmath import GIB
from bigtune.memory.monitor import CATEGORIES

# What a memory snapshot (memory.jsonl) measures, in bytes; logged per phase as GiB.
MEMORY_CATEGORIES = CATEGORIES

# Records a backend may fall behind by before it is judged too slow and turned off: a run logs a few records a
# step, so this is minutes of a hung server at a step a second, while the queue's memory stays small.
QUEUE_SIZE = 2000

# The environment a sweep sets for its rungs' processes: the ladder's name (W&B group, MLflow tag) and the
# MLflow run of the whole ladder, which each rung's run is nested under.
SWEEP_ENV = "BIGTUNE_SWEEP_NAME"
MLFLOW_PARENT_ENV = "BIGTUNE_MLFLOW_PARENT_RUN_ID"
# The environment the training service (bigtune serve) sets for a job's process: the job's id, which names its
# tracked run (its run folder is only "run") and tags it.
SERVE_JOB_ENV = "BIGTUNE_SERVE_JOB"

# In the run folder: each backend's run (MLflow run id, W&B run id, where they live), so that a resumed run
# logs into the same tracked run.
RUNS_FILE = "tracking.json"
_RUNS_FILE_LOCK = threading.Lock()  # the backends' threads each record their own entry


class Tracker(Protocol):
    """One experiment tracker. Called from one thread, in order: start, then any log_*, then finish."""

    def start(self, params: dict[str, Any], plan: Optional[dict]) -> None:
        """The run begins: ``params`` are the flattened recipe (and the plan's headline figures), ``plan`` the
        planner's whole prediction (None when the run was not planned)."""

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        """One logged window's (or evaluation's) numbers at optimizer step ``step``."""

    def log_memory(self, step: int, phase: str, categories: dict[str, int]) -> None:
        """One memory snapshot: bytes per category at ``phase`` of step ``step``."""

    def finish(self, status: str, summary: dict, artifacts: list[Path]) -> None:
        """The run ended with ``status`` (ok, oom, preempted, interrupted, error); ``summary`` is summary.json's
        content, ``artifacts`` the run folder's files and folders to upload."""


@dataclass
class RunInfo:
    """What every backend names and tags a run with."""

    name: str  # the run folder's name
    run_dir: Path
    tags: dict[str, str] = field(default_factory=dict)  # device, strategy, world size...
    group: Optional[str] = None  # the sweep (ladder) this run is a rung of
    resumed_at: Optional[int] = None  # the checkpoint's step when the run continues one (None: a fresh run)

    def saved_run(self, backend: str) -> Optional[dict]:
        """What ``backend`` recorded of its run in the run folder (``record_run``), when this run is resumed;
        None for a fresh run or when nothing (readable) was recorded."""
        if self.resumed_at is None:
            return None
        try:
            entry = json.loads((self.run_dir / RUNS_FILE).read_text()).get(backend)
        except (OSError, ValueError, AttributeError):
            return None
        return entry if isinstance(entry, dict) else None

    def record_run(self, backend: str, entry: dict) -> None:
        """Keep ``backend``'s run (its id and where it lives) in the run folder's tracking.json."""
        path = self.run_dir / RUNS_FILE
        with _RUNS_FILE_LOCK:
            try:
                runs = json.loads(path.read_text())
            except (OSError, ValueError):
                runs = {}
            runs = runs if isinstance(runs, dict) else {}
            runs[backend] = entry
            atomic_write_text(path, json.dumps(runs, indent=2) + "\n")  # a temporary name, then a rename


def warn(msg: str) -> None:
    # stderr: seen under --quiet too, and apart from the training log on stdout
    print(f"bigtune: warning: {msg}", file=sys.stderr, flush=True)


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"max_steps": 3}} -> {"train.max_steps": 3}: the recipe as a tracker's flat parameters."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def numbers(rec: dict, skip: tuple[str, ...] = ("step", "epoch")) -> dict[str, float]:
    """The numeric entries of a record (None, text and booleans left out)."""
    return {
        k: float(v) for k, v in rec.items() if k not in skip and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def memory_metrics(phase: str, categories: dict[str, Any]) -> dict[str, float]:
    """``memory/<phase>/<category>_gib`` for each category measured (None where the device cannot say)."""
    return {
        f"memory/{phase}/{c}_gib": categories[c] / GIB
        for c in MEMORY_CATEGORIES
        if isinstance(categories.get(c), (int, float))
    }


def plan_params(plan: Optional[dict]) -> dict[str, Any]:
    """The plan's headline figures as parameters: what was predicted before step 0."""
    if not plan:
        return {}
    verdict = "unknown" if plan.get("fits") is None else ("FITS" if plan["fits"] else "OOM")
    gib = lambda v: None if v is None else round(v / GIB, 4)  # noqa: E731
    return {
        "plan.target": plan.get("target"),
        "plan.verdict": verdict,
        "plan.peak_allocated_gib": gib(plan.get("peak_allocated")),
        "plan.peak_reserved_gib": gib(plan.get("peak_reserved")),
        "plan.peak_total_gib": gib(plan.get("peak_total")),
        "plan.step_time_s": plan.get("step_time_s"),
        "plan.tokens_per_s": plan.get("tokens_per_s"),
    }


def final_metrics(summary: dict) -> dict[str, float]:
    """The run's end figures (``summary/...``: loss, speed, memory) and, where the run was planned, planned vs
    measured (``plan_vs_measured/...``); apart from the per-step names so a chart's last point stays a step's."""
    out = {
        f"summary/{k}": v
        for k, v in numbers(
            {
                k: summary.get(k)
                for k in ("steps", "final_loss", "tokens_per_s", "samples_per_s", "step_time_s", "mfu", "wall_seconds")
            },
            skip=(),
        ).items()
    }
    for k in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_device_used_bytes"):
        if summary.get(k) is not None:
            out["summary/" + k.replace("_bytes", "_gib")] = summary[k] / GIB
    cmp = summary.get("plan") or {}
    for k in ("measured_peak_allocated", "predicted_peak_allocated_like_for_like", "predicted_peak_allocated"):
        if cmp.get(k) is not None:
            out[f"plan_vs_measured/{k}_gib"] = cmp[k] / GIB
    for k in ("peak_error_pct", "reserved_error_pct", "predicted_step_time_s"):
        if cmp.get(k) is not None:
            out[f"plan_vs_measured/{k}"] = float(cmp[k])
    return out


def final_tags(status: str, summary: dict) -> dict[str, str]:
    """How the run ended, in words: status, and where and why it ran out of memory with the advice."""
    tags = {"bigtune.status": status}
    oom = summary.get("oom")
    if oom:
        tags["bigtune.oom"] = f"step {oom.get('step')} during {oom.get('phase')}: {oom.get('message', '')}"[:5000]
        if oom.get("advice"):
            tags["bigtune.oom_advice"] = "\n".join(oom["advice"])[:5000]
    if summary.get("error"):
        tags["bigtune.error"] = str(summary["error"])[:5000]
    return tags


class Guarded:
    """A backend on a worker thread of its own behind a bounded queue.

    Why a thread: tracking clients call their servers synchronously (MLflow's client is plain HTTP per call),
    so a server that accepts connections but does not answer would hold every step for its timeout. Here the
    loop only queues; the worker sends. The first exception (or a queue that stays full) prints one warning and
    turns the backend off for the rest of the run. ``close`` waits for the backlog, bounded by a deadline."""

    def __init__(self, name: str, backend: Tracker, where: str, run_dir: Path, queue_size: int = QUEUE_SIZE):
        self.name, self.backend, self.where, self.run_dir = name, backend, where, run_dir
        self.failed = False
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._work, name=f"bigtune-track-{name}", daemon=True)
        self._thread.start()

    def call(self, method: str, *args: Any) -> None:
        if self.failed:
            return
        try:
            self._queue.put_nowait((method, args))
        except queue.Full:
            self._fail(f"it is not keeping up: {self._queue.maxsize} records are waiting to be sent")

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.failed:
                continue  # drain what was queued before the failure
            method, args = item
            try:
                getattr(self.backend, method)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker must never stop training
                first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
                self._fail(f"{method} raised {type(e).__name__}: {first}")

    def _fail(self, why: str) -> None:
        with self._lock:
            if self.failed:
                return
            self.failed = True
        warn(
            f"tracking to {self.name} ({self.where}) failed: {why}. {self.name} is off for the rest of this run; "
            f"training goes on and the run folder {self.run_dir} has every record (metrics.jsonl, memory.jsonl, "
            "summary.json)"
        )

    def close(self, deadline: float) -> None:
        """Let the worker finish its backlog until ``deadline`` (time.monotonic()); then leave it behind."""
        try:
            self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive() and not self.failed:
            self.failed = True
            warn(
                f"tracking to {self.name} ({self.where}) had not finished sending when tracking.finish_timeout_s ran "
                f"out; the run ends without waiting for it. The run folder {self.run_dir} is complete"
            )


class Trackers:
    """The engine's one tracker: fans each call out to the chosen backends (none: every call is a no-op)."""

    def __init__(self, guarded: list[Guarded], finish_timeout_s: float = 300.0):
        self.guarded = guarded
        self.finish_timeout_s = finish_timeout_s
        self._finished = False

    @property
    def names(self) -> list[str]:
        return [g.name for g in self.guarded]

    def start(self, params: dict[str, Any], plan: Optional[dict]) -> None:
        params = {**params, **plan_params(plan)}
        for g in self.guarded:
            g.call("start", params, plan)

    def log_step(self, step: int, metrics: dict) -> None:
        values = numbers(metrics)
        if values:
            for g in self.guarded:
                g.call("log_step", step, values)

    def log_memory(self, step: int, phase: str, categories: dict) -> None:
        for g in self.guarded:
            g.call("log_memory", step, phase, categories)

    def finish(self, status: str, summary: dict, artifacts: list[Path], timeout_s: Optional[float] = None) -> None:
        """Queue the end of the run on every backend and wait for them (at most tracking.finish_timeout_s)."""
        if self._finished:
            return
        self._finished = True
        for g in self.guarded:
            g.call("finish", status, summary, list(artifacts))
        deadline = time.monotonic() + (self.finish_timeout_s if timeout_s is None else timeout_s)
        for g in self.guarded:
            g.close(deadline)

    def close(self) -> None:
        """A run that ends by an exception the engine does not record (a second Ctrl-C mid-step): its runs are
        marked interrupted, waiting a few seconds at most."""
        self.finish("interrupted", {}, [], timeout_s=min(10.0, self.finish_timeout_s))
