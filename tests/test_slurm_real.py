"""The script `bigtune launch slurm` writes holds no path relative to where it is submitted from (fast, no Slurm),
and it runs on a real one-node Slurm cluster (Debian's slurmctld, slurmd and munge), set up by the
test: the script is written from a project folder, saved in another folder and submitted from a third, and the job
runs the tiny recipe to the end, its log in the run folder. Skips with the reason where Slurm is not installed or
its daemons do not come up (.ci/run installs them when it runs as root with apt-get)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import HANG_GUARD_S, ROOT, read_jsonl
from slurm_cluster import FOUND, job_state, tail

# the cluster: conftest.py's session fixture `slurm` (tests/slurm_cluster.py)


@pytest.mark.slow
def test_launch_script_runs_when_submitted_from_another_folder(slurm, tmp_path):
    # A project as a user has one: the recipe and its data side by side, the data named by a relative path.
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    shutil.copy(ROOT / "src" / "bigtune" / "assets" / "demo_alpaca.jsonl", project / "data" / "food.jsonl")
    (project / "recipe.yaml").write_text(
        "name: slurm-tiny\n"
        "model: {name: tiny-llama}\n"
        "data: {source: data/food.jsonl, max_seq_length: 64}\n"
        "train: {micro_batch_size: 4, max_steps: 3, max_epochs: null, log_every_steps: 1}\n"
        "checkpoint: {save_model: false}\n"
        "precision: 32-true\n"
        "accelerator: cpu\n"
    )
    script = tmp_path / "elsewhere" / "job.sh"
    env = dict(slurm, PYTHONPATH=str(ROOT / "src") + os.pathsep + slurm.get("PYTHONPATH", ""))
    launch = [sys.executable, "-m", "bigtune", "launch", "slurm", "recipe.yaml", "--cpu", "--out", str(script)]
    if sys.prefix != sys.base_prefix:  # as in a shell where the venv is activated: its python is the default
        env["VIRTUAL_ENV"] = sys.prefix
        env["PATH"] = str(Path(sys.prefix) / "bin") + os.pathsep + env.get("PATH", "")
    else:
        launch += ["--python", sys.executable]
    res = subprocess.run(launch, cwd=project, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)
    assert res.returncode == 0, res.stdout + res.stderr
    run = project / "runs" / "slurm-tiny"
    assert run.is_dir(), "launch makes the run folder: Slurm opens the log there before the script runs"

    submit_from = tmp_path / "somewhere" / "else"
    submit_from.mkdir(parents=True)
    res = subprocess.run(
        [FOUND["sbatch"], "--parsable", str(script)], cwd=submit_from, env=env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    job = res.stdout.strip().split(";")[0]
    deadline = time.time() + HANG_GUARD_S
    state = job_state(slurm, job)
    while state in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING") and time.time() < deadline:
        time.sleep(1)
        state = job_state(slurm, job)
    log = run / f"slurm-{job}.out"
    assert state == "COMPLETED", f"job {job}: {state}\n{tail(log)}"
    text = log.read_text()
    # the job's output went to the run folder's log, and the recipe's relative data path was read in the
    # project folder (the job runs there), not in the folder sbatch ran in
    assert "status ok; 3 steps" in text, text[-3000:]
    assert "data: data/food.jsonl (alpaca): 640 records" in text, text[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 3
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3]
    assert not (submit_from / "runs").exists() and not (script.parent / "runs").exists()


# ------------------------------------------------------------------ the script's text, no Slurm needed


def _directives(text: str) -> dict[str, str]:
    return {
        x.split("=")[0]: x.split("=", 1)[1].split()[0]
        for x in text.splitlines()
        if x.startswith("#SBATCH") and "=" in x
    }


def _launch(project: Path, monkeypatch, *args: str) -> str:
    """``bigtune launch slurm tiny.yaml ARGS`` run in ``project`` (a copy of recipes/tiny-opt.yaml there),
    in this process; host resources given, so nothing is planned. The script's text."""
    from bigtune.cli.app import main

    project.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "recipes" / "tiny-opt.yaml", project / "tiny.yaml")
    monkeypatch.chdir(project)
    assert main(["launch", "slurm", "tiny.yaml", "--cpus-per-task", "2", "--mem", "4G", *args]) == 0
    out = args[args.index("--out") + 1] if "--out" in args else "runs/tiny-opt/job.sbatch"
    return (project / out).read_text()


def test_script_paths_are_absolute_and_its_run_folder_is_made(tmp_path, monkeypatch):
    monkeypatch.delenv("VIRTUAL_ENV", raising=False)
    project = tmp_path / "project"
    text = _launch(project, monkeypatch, "--out", "../elsewhere/job.sh")
    run = project / "runs" / "tiny-opt"
    # Slurm opens the log before the script runs and makes no folder for it: launch made it, wherever the
    # script went, and the script names it absolutely, so sbatch may run in any folder
    assert run.is_dir() and (tmp_path / "elsewhere" / "job.sh").is_file()
    d = _directives(text)
    assert d["#SBATCH --output"] == f"{run}/slurm-%j.out"
    assert d["#SBATCH --chdir"] == str(project)  # the recipe's relative paths resolve where launch checked them
    srun = next(x for x in text.splitlines() if x.startswith("srun "))
    assert f" {project / 'tiny.yaml'} " in srun and f"output_dir={run} " in srun
    assert f"mkdir -p {run}" in text
    # the interpreter is the job's own, not the one that ran launch
    assert sys.executable not in text and srun.startswith("srun python3 -m bigtune train ")


def test_script_interpreter_follows_the_venv_or_python_flag(tmp_path, monkeypatch):
    monkeypatch.setenv("VIRTUAL_ENV", "/shared/envs/tune")
    text = _launch(tmp_path / "a", monkeypatch)
    assert "srun /shared/envs/tune/bin/python -m bigtune train " in text
    text = _launch(tmp_path / "b", monkeypatch, "--python", "/opt/py/bin/python3.12")
    assert "srun /opt/py/bin/python3.12 -m bigtune train " in text


def test_script_cpu_asks_for_no_gpus(tmp_path, monkeypatch):
    gpu = _launch(tmp_path / "gpu", monkeypatch)
    assert "#SBATCH --gpus-per-node=1" in gpu and "--set accelerator=cuda " in gpu
    cpu = _launch(tmp_path / "cpu", monkeypatch, "--cpu")
    assert "gpus-per-node" not in cpu and "--gres" not in cpu and "--set accelerator=cpu " in cpu
    assert "#SBATCH --ntasks-per-node=1" in cpu
