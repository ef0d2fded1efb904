"""A sweep stopped mid-variant (SIGTERM, then SIGKILL) and run again continues from that variant.

The sweep runs as a real `python -m bigtune sweep` process. Each variant is one row in sweep.json; the
finished variant before the stop must not run again, the stopped one must run again from the start
(once: no second folder, no duplicate row), and no training process may outlive a killed sweep.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from conftest import HANG_GUARD_S

SRC = Path(__file__).resolve().parents[1] / "src"
BASE = {
    "model": {"name": "tiny-llama"},
    "data": {"source": "demo", "max_seq_length": 64},
    "train": {"micro_batch_size": 4, "max_steps": 3, "max_epochs": None, "log_every_steps": 1},
    "checkpoint": {"save_model": False},
    "accelerator": "cpu",
}


def _start(path: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "bigtune", "sweep", str(path), "--out", str(out), "--no-report"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _rows(out: Path) -> dict:
    try:
        return {r["variant"]: r for r in json.loads((out / "sweep.json").read_text())["rows"]}
    except (OSError, json.JSONDecodeError):
        return {}


def _wait_mid_variant(proc: subprocess.Popen, out: Path, name: str, timeout: float = 240) -> int:
    """Wait until variant ``name`` is training (a logged step); return its process id."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        assert proc.poll() is None, f"sweep ended early: {proc.stdout.read()}"
        row = _rows(out).get(name) or {}
        if (
            row.get("status") == "running"
            and (out / name / "metrics.jsonl").is_file()
            and (out / name / "metrics.jsonl").read_text().strip()
        ):
            return row["pid"]
        time.sleep(0.1)
    raise AssertionError(f"variant {name} did not start training within {timeout} s")


def _gone(pid: int, timeout: float = 20) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_stopped_sweep_resumes_from_the_stopped_variant(tmp_path):
    path = tmp_path / "resume.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": "resume",
                "base": BASE,
                "variants": [
                    {"name": "first"},
                    {"name": "long", "overrides": {"train.max_steps": 60}},
                    {"name": "last", "overrides": {"train.micro_batch_size": 2}},
                ],
            },
            sort_keys=False,
        )
    )
    out = tmp_path / "out"

    # 1) SIGTERM while "long" trains: the sweep stops it, records it as interrupted and exits 143
    proc = _start(path, out)
    pid = _wait_mid_variant(proc, out, "long")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143
    assert _gone(pid), "the variant's process outlived the sweep"
    rows = _rows(out)
    assert rows["first"]["status"] == "ok" and rows["long"]["status"] == "interrupted"
    assert rows["last"]["status"] == "pending"
    first_done = (out / "first" / "summary.json").stat().st_mtime_ns
    stopped = out / "long" / "summary.json"  # the engine's SIGTERM handler may write a summary: not a finished one
    assert not stopped.exists() or json.loads(stopped.read_text())["status"] not in ("ok", "oom")

    # 2) SIGKILL while "long" trains again: nothing can clean up, the variant's process must die anyway
    proc = _start(path, out)
    pid = _wait_mid_variant(proc, out, "long")
    proc.kill()
    proc.wait(timeout=30)
    assert _gone(pid), "the variant's process outlived a SIGKILLed sweep"
    assert _rows(out)["long"]["status"] == "running"  # what a killed sweep leaves behind

    # 3) run to the end: "first" is not run again, "long" runs once from the start, then "last"
    proc = _start(path, out)
    text, _ = proc.communicate(timeout=HANG_GUARD_S)
    assert proc.returncode == 0, text
    doc = json.loads((out / "sweep.json").read_text())
    names = [r["variant"] for r in doc["rows"]]
    assert names == ["first", "long", "last"]  # each variant exactly once
    rows = {r["variant"]: r for r in doc["rows"]}
    assert rows["first"]["reused"] is True and (out / "first" / "summary.json").stat().st_mtime_ns == first_done
    assert rows["long"]["status"] == "ok" and rows["long"]["reused"] is False and rows["long"]["steps"] == 60
    assert rows["last"]["status"] == "ok" and rows["last"]["reused"] is False
    assert "first: already finished" in text and text.count("long: running") == 1
    metrics = [json.loads(x) for x in (out / "long" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [m["step"] for m in metrics if "loss" in m]
    assert steps == sorted(set(steps)) and steps[-1] == 60  # one clean run, not two appended
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["first", "last", "long"]
    assert not list(out.glob(".*.running.log"))
