"""Resuming a run as a user does it: `--resume RUN` alone, a recipe that does not match, Ctrl-C, run length."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bigtune.engine.build import total_steps
from conftest import HANG_GUARD_S, ROOT, read_jsonl, run_cli

TINY_OPT = str(ROOT / "recipes" / "tiny-opt.yaml")


def _finished_run(tmp_path, steps: int = 6):
    run = tmp_path / "run"
    args = ["--set", f"output_dir={run}", "--set", f"train.max_steps={steps}", "--set", "checkpoint.enabled=true"]
    res = run_cli("train", TINY_OPT, *args, "--set", "checkpoint.every_steps=3", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    return run


def test_resume_alone_continues_the_run_with_its_own_recipe(tmp_path):
    run = _finished_run(tmp_path)
    recipe_before = (run / "recipe.yaml").read_text()
    stamp = (run / "recipe.yaml").stat().st_mtime_ns

    # The run is complete: nothing to do, said so, nothing rewritten (the built-in demo is not loaded).
    res = run_cli("train", "--resume", str(run), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "finished at step 6 of 6" in res.stdout and "train.max_steps=N" in res.stdout
    assert (run / "recipe.yaml").stat().st_mtime_ns == stamp

    # Longer: the run's own model (tiny-opt, not the demo's tiny-llama) continues from its checkpoint.
    res = run_cli("train", "--resume", str(run), "--set", "train.max_steps=9", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resumed from" in res.stdout and "at step 6" in res.stdout and "model: tiny-opt" in res.stdout
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")][-1] == 9
    assert "tiny-opt" in (run / "recipe.yaml").read_text() and recipe_before != (run / "recipe.yaml").read_text()


def test_a_recipe_that_does_not_match_the_checkpoint_is_one_clear_error(tmp_path):
    run = _finished_run(tmp_path)
    stamp = (run / "recipe.yaml").stat().st_mtime_ns
    res = run_cli("train", TINY_OPT, "--resume", str(run), "--set", "model.name=tiny-llama", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "does not match the checkpoint" in res.stderr and "model.name" in res.stderr
    # a step limit the checkpoint has already passed: nothing trained, nothing overwritten
    res = run_cli("train", "--resume", str(run), "--set", "train.max_steps=4", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "at step 6" in res.stderr and "train.max_steps=N with N > 6" in res.stderr
    assert (run / "recipe.yaml").stat().st_mtime_ns == stamp
    assert json.loads((run / "summary.json").read_text())["steps"] == 6


def test_ctrl_c_writes_a_checkpoint_and_the_run_resumes(tmp_path):
    run = tmp_path / "run"
    over = {
        "output_dir": run,
        "train.max_steps": 100_000,
        "checkpoint.enabled": "true",
        "checkpoint.every_steps": 100_000,
        "memory.every_steps": 100_000,
    }
    args = [a for k, v in over.items() for a in ("--set", f"{k}={v}")]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "bigtune", "train", TINY_OPT, *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + HANG_GUARD_S
    while not (run / "metrics.jsonl").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)  # training has started: the stop handlers are in place
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=HANG_GUARD_S)[0]
    assert proc.returncode == 130, out[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["stopped_by"] == "SIGINT"
    step = summary["preempted_at_step"]
    assert (run / "checkpoints" / f"step-{step:06d}.ckpt").is_file()
    assert f"SIGINT: checkpoint written at step {step}" in out
    res = run_cli("train", "--resume", str(run), "--set", f"train.max_steps={step + 2}", cwd=tmp_path)
    assert res.returncode == 0 and f"at step {step}" in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize(
    "max_epochs, max_steps, per_epoch, total",
    [(None, None, 7, 7), (None, 20, 7, 20), (2, None, 7, 14), (2, 20, 7, 14), (3, 5, 7, 5)],
)
def test_run_length(max_epochs, max_steps, per_epoch, total):
    assert total_steps(max_epochs, max_steps, per_epoch) == total


def test_max_steps_is_not_capped_by_one_epoch(tmp_path):
    # 8 samples in micro-batches of 4: two steps an epoch; max_steps 5 runs five (three epochs).
    run = tmp_path / "run"
    over = ["--set", f"output_dir={run}", "--set", "data.num_train_samples=8", "--set", "train.max_steps=5"]
    res = run_cli("train", TINY_OPT, *over, "--set", "train.micro_batch_size=4", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 5
