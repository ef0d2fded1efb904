"""The script `bigtune launch slurm` writes holds no path relative to where it is submitted from (fast, no Slurm),
and it runs on a real one-node Slurm cluster (Debian's slurmctld, slurmd and munge), set up by the
test: the script is written from a project folder, saved in another folder and submitted from a third, and the job
runs the tiny recipe to the end, its log in the run folder. Skips with the reason where Slurm is not installed or
its daemons do not come up (.ci/run installs them when it runs as root with apt-get)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import HANG_GUARD_S, ROOT, read_jsonl

# The daemons live in sbin, which a non-login PATH may leave out.
_SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin", "/usr/local/sbin"])
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "sinfo", "scontrol", "scancel")
FOUND = {name: shutil.which(name, path=_SEARCH) for name in PROGRAMS}
MISSING = [name for name, path in FOUND.items() if path is None]
NOT_INSTALLED = (
    f"Slurm is not installed here (missing {', '.join(MISSING)}): apt-get install slurmctld slurmd munge "
    "(.ci/run installs them when it runs as root with apt-get)"
)
# How long the daemons get to come up before the test gives up on them (a skip, not a failure: they are the
# machine's, not bigtune's).
START_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_memory_mib() -> int:
    """Most of this machine's RAM, for the node's RealMemory: slurmd marks a node that has less than its
    configuration says invalid, and a job's --mem above it is refused at sbatch."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024 * 9 // 10
    return 2048


def _slurm_conf(root: Path, host: str) -> str:
    return "\n".join(
        [
            "ClusterName=bigtune-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'slurmd.log'}",
            # no cgroups (a container may not delegate them), no accounting database, no GPUs
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "ReturnToService=2",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory={_real_memory_mib()} State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _env(conf: Path) -> dict:
    """This process's environment for the Slurm commands, with the test cluster's configuration; any SLURM_*
    variables of a job this suite itself runs in are left out (they would point the commands elsewhere)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(conf)
    return env


def _tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.is_file() else f"({path} missing)"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-node cluster: the environment its commands need (SLURM_CONF). Every daemon is stopped
    (its whole process group) when the module's tests are done, whatever happened."""
    if MISSING:
        pytest.skip(NOT_INSTALLED)
    if os.geteuid() != 0:
        pytest.skip("slurmd starts jobs as root in this test set-up, and this is not root")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool"):
        (root / sub).mkdir(mode=0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = root / "slurm.conf"
    host = socket.gethostname().split(".")[0]
    conf.write_text(_slurm_conf(root, host))
    env = _env(conf)
    daemons: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> None:
        # Foreground (-F / -D), each in its own session, so the finalizer can stop it and all it started.
        with open(root / f"{name}.out", "wb") as out:
            daemons.append(
                subprocess.Popen(
                    [FOUND[name], *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            )

    def stop() -> None:
        subprocess.run([FOUND["scancel"], "--user=root"], env=env, capture_output=True, timeout=60)
        for proc in reversed(daemons):  # slurmd, slurmctld, then munged
            for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue

    try:
        m = root / "munge"
        start(
            "munged",
            "-F",
            "--force",
            f"--socket={m / 'munge.socket'}",
            f"--key-file={key}",
            f"--pid-file={m / 'munged.pid'}",
            f"--log-file={m / 'munged.log'}",
            f"--seed-file={m / 'munged.seed'}",
        )
        start("slurmctld", "-D", "-f", str(conf))
        start("slurmd", "-D", "-f", str(conf))
        deadline = time.time() + START_S
        state, dead = "", []
        while time.time() < deadline:
            if dead := [p.args[0] for p in daemons if p.poll() is not None]:
                break
            res = subprocess.run(
                [FOUND["sinfo"], "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True, timeout=60
            )
            state = res.stdout.strip()
            if state == "idle":
                break
            time.sleep(1)
        if state != "idle":
            logs = "\n".join(f"--- {n}\n{_tail(root / n, 8)}" for n in ("munged.out", "slurmctld.log", "slurmd.log"))
            pytest.skip(
                f"the test's Slurm cluster did not come up within {START_S} s (node state {state!r}; "
                f"exited: {', '.join(dead) or 'none'}):\n{logs}"
            )
        yield env
    finally:
        stop()


def _job_state(env: dict, job: str) -> str:
    res = subprocess.run([FOUND["scontrol"], "show", "job", job], env=env, capture_output=True, text=True, timeout=60)
    for word in res.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return "UNKNOWN"


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
    state = _job_state(slurm, job)
    while state in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING") and time.time() < deadline:
        time.sleep(1)
        state = _job_state(slurm, job)
    log = run / f"slurm-{job}.out"
    assert state == "COMPLETED", f"job {job}: {state}\n{_tail(log)}"
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
