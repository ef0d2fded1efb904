"""Several nodes and failures, on one host with gloo: two torchrun "nodes", a fake Slurm job, a
killed rank and a hung rank (bounded by dist_timeout_s)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from conftest import HANG_GUARD_S, ROOT, read_jsonl, run_cli

COMMON = {
    "train.max_steps": 3,
    "train.max_epochs": None,
    "train.log_every_steps": 1,
    "memory.every_steps": 1000,
    "data.max_seq_length": 64,
    "accelerator": "cpu",
    "optim.name": "adamw",
    "optim.lr": 1e-3,
    "optim.lr_scaling": "linear",
    "train.micro_batch_size": 4,
    "checkpoint.save_model": False,
    "memory.plan": False,
}


def _args(over: dict) -> list[str]:
    return [x for k, v in over.items() for x in ("--set", f"{k}={'null' if v is None else v}")]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC", "MASTER_"))}
    return {**env, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", **extra}


def _metrics(run):
    """loss and lr of every step, flat (pytest.approx compares flat lists)."""
    return [x for m in read_jsonl(run / "metrics.jsonl") for x in (m["loss"], m["lr"])]


def _wait_all(procs, timeout=HANG_GUARD_S):
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return outs


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """The reference: one node, two processes spawned by bigtune."""
    tmp = tmp_path_factory.mktemp("one")
    res = run_cli("train", *_args({**COMMON, "devices": 2, "strategy": "ddp", "output_dir": str(tmp / "run")}), cwd=tmp)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return tmp / "run"


def test_lr_scaling_is_applied_and_logged(one_node):
    # optim.lr 1e-3 × 2 ranks; the demo warms up over 10 steps and each step logs the lr it leaves for the next
    assert _metrics(one_node)[1::2] == pytest.approx([2e-3 * f for f in (0.2, 0.3, 0.4)])
    recipe = (one_node / "recipe.yaml").read_text()
    assert "lr_scaling: linear" in recipe


def test_two_torchrun_nodes_agree_with_one_node(tmp_path, one_node):
    port = _port()
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc_per_node",
            "1",
            "--node_rank",
            str(node),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            "-m",
            "bigtune",
            "train",
            *_args(
                {**COMMON, "devices": 1, "num_nodes": 2, "strategy": "ddp", "output_dir": str(tmp_path / f"node{node}")}
            ),
        ]
        procs.append(
            subprocess.Popen(cmd, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = _wait_all(procs)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    # Rank 0 picks the run dir and broadcasts it: node 1 writes nothing of its own.
    assert not (tmp_path / "node1" / "metrics.jsonl").exists()
    assert _metrics(tmp_path / "node0") == pytest.approx(_metrics(one_node), rel=1e-6)


def test_fake_slurm_job_of_two_nodes_agrees_with_one_node(tmp_path, one_node):
    port = str(_port())
    procs = []
    for rank in (0, 1):
        env = _env(
            SLURM_NTASKS="2",
            SLURM_NTASKS_PER_NODE="1",
            SLURM_NNODES="2",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID="0",
            SLURM_NODEID=str(rank),
            SLURM_JOB_NODELIST="127.0.0.1",
            SLURM_NODELIST="127.0.0.1",
            SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="bigtune-test",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        cmd = [
            sys.executable,
            "-m",
            "bigtune",
            "train",
            *_args({**COMMON, "devices": 1, "num_nodes": 2, "strategy": "ddp", "output_dir": str(tmp_path / "run")}),
        ]
        procs.append(
            subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = _wait_all(procs)
    assert [p.returncode for p in procs] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 3
    assert _metrics(tmp_path / "run") == pytest.approx(_metrics(one_node), rel=1e-6)


def _torchrun_long(tmp_path, timeout_s: int):
    over = {
        **COMMON,
        "train.max_steps": 100000,
        "devices": 2,
        "strategy": "ddp",
        "dist_timeout_s": timeout_s,
        "output_dir": str(tmp_path / "run"),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_port()),
        "-m",
        "bigtune",
        "train",
        *_args(over),
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + HANG_GUARD_S
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        time.sleep(0.1)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    return proc, [int(w) for w in workers]


def _finish(proc, workers, limit_s: float):
    t0 = time.time()
    try:
        out = proc.communicate(timeout=limit_s)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        for w in workers:  # a stopped worker may have left the group's signal behind
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"the job did not end within {limit_s} s")
    return out, time.time() - t0


def test_a_killed_rank_ends_the_job_with_an_error(tmp_path):
    proc, workers = _torchrun_long(tmp_path, timeout_s=30)
    os.kill(workers[1], signal.SIGKILL)
    out, took = _finish(proc, workers, 60)
    assert proc.returncode != 0, out[-2000:]
    assert took < 60


def test_a_hung_rank_is_bounded_by_dist_timeout(tmp_path):
    """Rank 1 stops (SIGSTOP: alive but silent, like a hang): rank 0 gives up in its next collective
    after dist_timeout_s, exits with an error, and torchrun ends the job."""
    proc, workers = _torchrun_long(tmp_path, timeout_s=10)
    os.kill(workers[1], signal.SIGSTOP)
    try:
        out, took = _finish(proc, workers, 60)
    finally:
        for w in workers:
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert proc.returncode != 0, out[-2000:]
    assert took < 60
    assert "gave up after dist_timeout_s=10 s" in out, out[-3000:]  # the error names the knob and its value
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "error" and "dist_timeout_s" in summary["error_hint"]
