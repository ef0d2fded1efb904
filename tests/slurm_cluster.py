"""A real one-node Slurm cluster for the tests (Debian's slurmctld, slurmd and munge, each daemon in the foreground
of its own session): ``one_node_cluster(root)`` starts it under ``root`` and yields the environment its commands
need (SLURM_CONF); conftest.py's session fixture ``slurm`` shares one cluster among the tests that need it. Skips
with the reason where Slurm is not installed, this is not root, or the daemons do not come up (.ci/run installs
them when it runs as root with apt-get)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

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
            # A count-only resource standing in for GPUs (no device files, not named gpu: sinfo's gres shows no
            # GPUs, so the partitions stay CPU partitions for the tests that read them from sinfo), which a job
            # written from a cluster profile asks for as --gres=fakegpu:N (tests/test_serve_slurm.py).
            "GresTypes=fakegpu",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs=2 RealMemory={_real_memory_mib()} Gres=fakegpu:2 State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
            # the same node in a second partition: a cluster profile's partitions to choose between
            f"PartitionName=big Nodes={host} MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _env(conf: Path) -> dict:
    """This process's environment for the Slurm commands, with the test cluster's configuration; any SLURM_*
    variables of a job this suite itself runs in are left out (they would point the commands elsewhere)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(conf)
    return env


def tail(path: Path, n: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:]) if path.is_file() else f"({path} missing)"


@contextlib.contextmanager
def one_node_cluster(root: Path) -> Iterator[dict]:
    """A running one-node cluster under ``root``: the environment its commands need (SLURM_CONF). Every daemon is
    stopped (its whole process group) on leaving, whatever happened."""
    if MISSING:
        pytest.skip(NOT_INSTALLED)
    if os.geteuid() != 0:
        pytest.skip("slurmd starts jobs as root in this test set-up, and this is not root")
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
            state = " ".join(sorted(set(res.stdout.split())))  # one line per partition the node is in
            if state == "idle":
                break
            time.sleep(1)
        if state != "idle":
            logs = "\n".join(f"--- {n}\n{tail(root / n, 8)}" for n in ("munged.out", "slurmctld.log", "slurmd.log"))
            pytest.skip(
                f"the test's Slurm cluster did not come up within {START_S} s (node state {state!r}; "
                f"exited: {', '.join(dead) or 'none'}):\n{logs}"
            )
        yield env
    finally:
        stop()


def job_state(env: dict, job: str) -> str:
    res = subprocess.run([FOUND["scontrol"], "show", "job", job], env=env, capture_output=True, text=True, timeout=60)
    for word in res.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return "UNKNOWN"
