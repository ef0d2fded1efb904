"""Where a job's process runs. A backend is one small class: start, poll, cancel, release, adopt (after a server
restart), output (the job's own log), the slots it has free and, for an engine with a queue of its own, why a job
it was handed has not started there yet (``queued_reason``). The queue's order is the service's (policy.py); a
backend only runs what it is given, when it is given it.

``LocalBackend`` (here): each job one ``python -m bigtune train`` subprocess on this machine, in its own process
group (its data workers and ranks too), on slots that stand for this machine's GPUs (CUDA_VISIBLE_DEVICES names them
on a GPU machine; on a CPU machine they only count). ``SlurmBackend`` (slurm_backend.py) and ``RayBackend``
(ray_backend.py) hand the same job to an existing cluster's engine.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional


class BackendError(Exception):
    """The backend's engine refused or could not be reached: one line, what and how to fix it."""


@dataclass
class Work:
    """One attempt of a job, as every backend is handed it: ``bigtune train`` of the job's recipe file with its
    ``--set`` overrides (the user's, the variant's, output_dir and checkpointing), run in ``cwd``."""

    job_id: str
    attempt: int
    recipe: Path
    sets: list[str]
    run_dir: Path
    slots: int
    cwd: Path
    python: str
    job_dir: Path  # the job's folder in the service's state: its recipe, the local backend's log, Slurm's scripts
    env: dict = field(default_factory=dict)  # the service's environment less its secrets (local, Slurm)
    extra_env: dict = field(default_factory=dict)  # what the service adds: the only variables a Ray job is given
    planned_s: Optional[float] = None  # the plan's step time x steps: a Slurm --time
    # The Slurm partition admission chose from a cluster profile and what it asks there (partition, gres, time,
    # mem_gib, cpus_per_task); None: the backend's own partition
    placement: Optional[dict] = None
    cancel_grace_s: float = 5.0

    @property
    def log_path(self) -> Path:
        """Where the local backend writes the process's output (every attempt appends)."""
        return self.job_dir / "worker.log"

    def argv(self) -> list[str]:
        """``python -m bigtune train RECIPE --auto-resume --quiet --set ...``: the first attempt starts in run_dir,
        a retry resumes from its newest checkpoint."""
        argv = [self.python, "-m", "bigtune", "train", str(self.recipe), "--auto-resume", "--quiet"]
        return argv + [x for s in self.sets for x in ("--set", s)]

    def shell_command(self) -> str:
        return f"cd {shlex.quote(str(self.cwd))} && exec {shlex.join(self.argv())}"


@dataclass
class Started:
    handle: str  # what poll, cancel and adopt take: the process id, the Slurm job id, the Ray submission id
    slot_ids: list[int]
    where: str = ""  # how the service's event names it: "on slot(s) [0]", "as Slurm job 12"


class SlotPool:
    """The service's count of a cluster's slots: which ones each running job holds. Slot ids are indices; on the
    local backend they name the GPUs, elsewhere they only count (the engine places the job)."""

    def __init__(self, slots: int):
        self.slots = slots
        self._held: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def free(self) -> int:
        with self._lock:
            return self.slots - sum(len(s) for s in self._held.values())

    def handles(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def take(self, n: int) -> list[int]:
        """``n`` free slot ids, not yet held by anyone: hold() them under the job's handle once it has one."""
        with self._lock:
            used = {i for s in self._held.values() for i in s}
            free = [i for i in range(self.slots) if i not in used]
            if len(free) < n:
                raise RuntimeError(f"asked to start a job on {n} slots with {len(free)} free")
            return free[:n]

    def hold(self, handle: str, slot_ids: list[int]) -> None:
        with self._lock:
            self._held[handle] = list(slot_ids)

    def give_back(self, handle: str) -> None:
        with self._lock:
            self._held.pop(handle, None)


def read_tail(path: Path, max_bytes: int) -> str:
    """The last ``max_bytes`` of a text file ("" when it is missing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is left (zombies aside)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _proc_state(pid: int) -> Optional[str]:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


class LocalBackend:
    name = "local"

    def __init__(self, slots: int, gpus: bool = False):
        self.slots = slots
        self.gpus = gpus
        self._procs: dict[str, Optional[subprocess.Popen]] = {}  # handle → process (None: adopted after a restart)
        self._pool = SlotPool(slots)

    def free_slots(self) -> int:
        return self._pool.free()

    def handles(self) -> list[str]:
        """The jobs' processes this backend holds slots for."""
        return self._pool.handles()

    def queued_reason(self, handle: str) -> Optional[str]:
        """Never queued: a local process runs from its start."""
        return None

    def start(self, work: Work) -> Started:
        slot_ids = self._pool.take(work.slots)
        env = {**work.env, **work.extra_env}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slot_ids))
        with open(work.log_path, "ab") as log:
            # start_new_session: its own process group, so cancel reaches every process it starts
            proc = subprocess.Popen(work.argv(), cwd=work.cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        handle = str(proc.pid)
        self._procs[handle] = proc
        self._pool.hold(handle, slot_ids)
        return Started(handle, slot_ids, f"on slot(s) {slot_ids}")

    def output(self, handles: list[str], job_dir: Path, run_dir: Path, max_bytes: int) -> str:
        """The job's output, every attempt's (they append to one file): its last ``max_bytes``."""
        return read_tail(job_dir / "worker.log", max_bytes)

    def poll(self, handle: str) -> tuple[bool, Optional[int]]:
        """(still running, exit code): the code is negative for a signal, None where it cannot be known (a process
        adopted from an earlier server that another process reaped)."""
        pid = int(handle)
        proc = self._procs.get(handle)
        if proc is not None:
            rc = proc.poll()
            return (rc is None, rc)
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done == 0:
                return True, None
            return False, os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # not our child (an earlier server started it): look it up
            state = _proc_state(pid)
            return state is not None and state != "Z", None

    def release(self, handle: str) -> None:
        """The job's process has ended: end whatever it left in its group, free its slots."""
        try:
            os.killpg(int(handle), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._procs.pop(handle, None)
        self._pool.give_back(handle)

    def cancel(self, handle: str, grace_s: float = 5.0) -> None:
        """SIGTERM to the job's whole process group (training writes a checkpoint and stops), SIGKILL to what is
        left after ``grace_s``. Returns at once; poll() then sees the process end."""
        pgid = int(handle)
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return

        def kill_rest() -> None:
            if _group_alive(pgid):
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        timer = threading.Timer(grace_s, kill_rest)
        timer.daemon = True
        timer.start()

    def adopt(self, handle: str, slot_ids: list[int], job_id: str) -> bool:
        """After a server restart: take back a job's process if it still runs (and is that job's: its command line
        names the job's folder), with its slots. False when it is gone."""
        pid = int(handle)
        state = _proc_state(pid)
        if state is None or state == "Z":
            if state == "Z":
                self._reap(pid)
            return False
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            return False
        if job_id not in cmdline:
            return False  # the id was reused by another process
        self._procs[handle] = None
        self._pool.hold(handle, slot_ids)
        return True

    @staticmethod
    def _reap(pid: int) -> None:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass

    @staticmethod
    def group_alive(handle: str) -> bool:
        return _group_alive(int(handle))
