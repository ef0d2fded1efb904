"""Where a job's process runs. A backend is one small class: start, poll, cancel, adopt (after a server restart),
and the slots it has free. The queue's order is the service's (policy.py); a backend only runs what it is given.

``LocalBackend``: each job one ``python -m bigtune train`` subprocess on this machine, in its own process group
(its data workers and ranks too), on slots that stand for this machine's GPUs (CUDA_VISIBLE_DEVICES names them on a
GPU machine; on a CPU machine they only count).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass
class Started:
    handle: str  # what poll, cancel and adopt take: here the process id (= its process group's id)
    slot_ids: list[int]


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
        self._slots_of: dict[str, list[int]] = {}
        self._lock = threading.Lock()

    def free_slots(self) -> int:
        with self._lock:
            return self.slots - sum(len(s) for s in self._slots_of.values())

    def handles(self) -> list[str]:
        """The jobs' processes this backend holds slots for."""
        with self._lock:
            return list(self._slots_of)

    def _take(self, n: int) -> list[int]:
        used = {i for s in self._slots_of.values() for i in s}
        free = [i for i in range(self.slots) if i not in used]
        if len(free) < n:
            raise RuntimeError(f"asked to start a job on {n} slots with {len(free)} free")
        return free[:n]

    def start(self, job_id: str, argv: list[str], cwd: Path, env: dict, log_path: Path, slots: int) -> Started:
        with self._lock:
            slot_ids = self._take(slots)
            if self.gpus:
                env = {**env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, slot_ids))}
            with open(log_path, "ab") as log:
                # start_new_session: its own process group, so cancel reaches every process it starts
                proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
            handle = str(proc.pid)
            self._procs[handle] = proc
            self._slots_of[handle] = slot_ids
            return Started(handle, slot_ids)

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
        with self._lock:
            self._procs.pop(handle, None)
            self._slots_of.pop(handle, None)

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
        with self._lock:
            self._procs[handle] = None
            self._slots_of[handle] = list(slot_ids)
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
