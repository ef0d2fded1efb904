"""``bigtune serve --backend slurm``: each attempt of a job is one sbatch job of the script ``bigtune launch slurm``
writes (run/launch.py's ``slurm_script``: one task per GPU under srun, requeue, SIGTERM before the time limit,
``--auto-resume``). Slurm places and runs it; the service only decides when to submit (its queue's order) and
counts the slots its jobs hold.

State from ``scontrol show job`` (``sacct`` once the controller has forgotten the job, where accounting is kept),
cancel by ``scancel --signal=TERM`` to the job's steps (bigtune writes a checkpoint and stops) and a plain
``scancel`` after the grace period, the job's output from its Slurm output file in the run folder. The partition's GPUs (``sinfo``'s
gres: kind and count per node) are the cluster jobs are admitted against; a partition without GPUs offers its
nodes' CPUs as slots, as the local backend on a CPU machine.
"""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path
from typing import Optional

from bigtune.serve.admission import Cluster, Offers
from bigtune.serve.backends import BackendError, SlotPool, Started, Work, read_tail

# Slurm job states (squeue/scontrol's long names) in which the job has not ended. REQUEUED and PREEMPTED-then-
# requeued jobs come back as PENDING under the same id: `launch slurm`'s scripts ask for --requeue.
ALIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
         "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}  # fmt: skip
# Node states (sinfo %T) that take no jobs.
UNUSABLE = ("down", "drain", "fail", "inval", "not_responding")
DEFAULT_TIME = "24:00:00"  # a job's --time when its plan has no step time or step count


def _run(argv: list[str], env: Optional[dict] = None, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, cwd=cwd)
    except FileNotFoundError:
        raise BackendError(
            f"`{argv[0]}` is not on this machine's PATH: run `bigtune serve --backend slurm` where the Slurm client "
            "commands are (a login node), or use --backend local"
        ) from None
    except subprocess.TimeoutExpired:
        raise BackendError(f"`{' '.join(argv)}` did not answer within 60 s: is slurmctld up? (scontrol ping)") from None


def _one_line(text: str) -> str:
    lines = [x.strip() for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else "(no message)"


def parse_gres(gres: str) -> tuple[Optional[str], int]:
    """(GPU type or None, GPU count) of a node's sinfo %G text: ``gpu:a100:4(S:0-1)``, ``gpu:4``, ``(null)``."""
    kind, count = None, 0
    for item in gres.split(","):
        parts = item.split("(")[0].strip().split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        try:
            n = int(parts[-1])
        except ValueError:
            continue
        count += n
        if len(parts) >= 3:
            kind = parts[1]
    return kind, count


def read_cluster(sinfo_text: str, partition: Optional[str], gpu: Optional[str],
                 host_ram_gib: Optional[float]) -> tuple[Cluster, str, Optional[str]]:  # fmt: skip
    """(the cluster jobs are admitted against, the partition, the gres to ask for) from ``sinfo -h -N -o
    '%P|%N|%c|%m|%G|%T'``. ``partition`` None: Slurm's default one. ``gpu`` (a catalog name) names the card where
    Slurm's gres type is missing or not a catalog name; ``host_ram_gib`` replaces the nodes' memory."""
    from bigtune.core.gpus import UnknownGPUError, find_gpu

    rows = [line.split("|") for line in sinfo_text.strip().splitlines() if line.count("|") == 5]
    if partition is None:
        defaults = sorted({r[0].rstrip("*") for r in rows if r[0].endswith("*")})
        if not defaults:
            raise BackendError("Slurm has no default partition: give --partition NAME (sinfo lists them)")
        partition = defaults[0]
    nodes = [r for r in rows if r[0].rstrip("*") == partition]
    if not nodes:
        names = ", ".join(sorted({r[0].rstrip("*") for r in rows})) or "none"
        raise BackendError(f"Slurm has no partition {partition!r} (it has: {names}): fix --partition")
    usable = [r for r in nodes if not r[5].lower().rstrip("*~#!%$@^-+").startswith(UNUSABLE) and "*" not in r[5]]
    if not usable:
        states = ", ".join(sorted({f"{r[1]} {r[5]}" for r in nodes}))
        raise BackendError(f"no node of Slurm partition {partition!r} takes jobs ({states}): resume them "
                           "(scontrol update nodename=... state=resume) or choose another --partition")  # fmt: skip
    mem_gib = min(int(r[3].rstrip("+")) for r in usable) / 1024
    host_ram = host_ram_gib if host_ram_gib is not None else mem_gib
    gres = [(r, *parse_gres(r[4])) for r in usable]
    gpu_nodes = [(r, kind, n) for r, kind, n in gres if n > 0]
    if not gpu_nodes:
        if gpu:
            raise BackendError(f"--gpu {gpu}: Slurm partition {partition!r} has no GPUs in its nodes' gres; drop "
                               "--gpu to run on its CPUs, or choose a GPU --partition")  # fmt: skip
        cpus = min(int(r[2].rstrip("+")) for r in usable)  # a CPU partition: each node's CPUs stand in as slots
        return Cluster(None, cpus, len(usable), host_ram), partition, None
    kinds = sorted({k for _, k, _ in gpu_nodes if k})
    if gpu is None:
        if len(kinds) != 1:
            what = "GPUs of several kinds (" + ", ".join(kinds) + ")" if kinds else "GPUs with no type in their gres"
            raise BackendError(f"Slurm partition {partition!r} has {what}: give --gpu KIND (a catalog name, "
                               "bigtune gpus lists them)")  # fmt: skip
        try:
            gpu = find_gpu(kinds[0]).key
        except UnknownGPUError as e:
            raise BackendError(f"Slurm names the GPUs of partition {partition!r} {kinds[0]!r}, not a catalog name "
                               f"({e}): give --gpu KIND") from None  # fmt: skip
    else:
        want = find_gpu(gpu).key  # checked by the CLI already
        same = []
        for r, k, n in gpu_nodes:
            try:
                same.append(k is None or find_gpu(k).key == want)
            except UnknownGPUError:
                same.append(len(kinds) <= 1)  # the only kind there is: --gpu names it
        gpu_nodes = [x for x, keep in zip(gpu_nodes, same) if keep] or gpu_nodes
        gpu, kinds = want, sorted({k for _, k, _ in gpu_nodes if k})
    ask_gres = f"gpu:{kinds[0]}" if len(kinds) == 1 else None
    per_node = min(n for _, _, n in gpu_nodes)
    return Cluster(gpu, per_node, len(gpu_nodes), host_ram), partition, ask_gres


def parse_job(text: str) -> dict[str, str]:
    """``scontrol show job -o`` text as its KEY=VALUE fields (values without spaces are all this reads)."""
    out = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if sep:
            out.setdefault(key, value)
    return out


def exit_code(text: str) -> Optional[int]:
    """Slurm's ``EXIT:SIGNAL`` as one code: the signal negated (as Popen's), else the exit status."""
    code, _, sig = text.partition(":")
    try:
        return -int(sig) if sig and int(sig) else int(code)
    except ValueError:
        return None


def profile_partitions(sinfo_text: str, profile: str) -> tuple[Offers, dict[str, int]]:
    """(the profile's partitions as the planner's offers, each one's slots: its GPUs per node × the nodes sinfo
    shows taking jobs; the profile's max_nodes limits one job, not the partition). A profile partition Slurm does
    not have, or whose nodes are all down, is an error naming the fix."""
    from bigtune.plan.base.constants import PlanError
    from bigtune.plan.search.offers import load_cluster

    try:
        name, offers = load_cluster(profile)
    except PlanError as e:
        raise BackendError(f"--cluster {profile}: {e}") from None
    rows = [line.split("|") for line in sinfo_text.strip().splitlines() if line.count("|") == 5]
    have = sorted({r[0].rstrip("*") for r in rows})
    slots = {}
    for o in offers:
        nodes = [r for r in rows if r[0].rstrip("*") == o.name]
        if not nodes:
            raise BackendError(f"cluster profile {profile} names partition {o.name!r}, which Slurm does not have "
                               f"(sinfo lists: {', '.join(have) or 'none'}): fix the profile")  # fmt: skip
        up = {r[1] for r in nodes if not r[5].lower().rstrip("*~#!%$@^-+").startswith(UNUSABLE) and "*" not in r[5]}
        if not up:
            raise BackendError(f"no node of Slurm partition {o.name!r} (cluster profile {profile}) takes jobs: "
                               "resume them or leave the partition out of the profile")  # fmt: skip
        slots[o.name] = o.gpus_per_node * len(up)
    return Offers(name, profile, tuple(offers)), slots


class SlurmBackend:
    name = "slurm"

    def __init__(self, partition: Optional[str] = None, gpu: Optional[str] = None,
                 host_ram_gib: Optional[float] = None, time_limit: Optional[str] = None,
                 profile: Optional[str] = None):  # fmt: skip
        if profile is not None and (partition or gpu):  # the arguments' error first, whatever Slurm's state
            raise BackendError("--cluster chooses each job's partition and names its GPUs: drop --partition "
                               "and --gpu, or drop --cluster")  # fmt: skip
        res = _run(["sinfo", "-h", "-N", "-o", "%P|%N|%c|%m|%G|%T"])
        if res.returncode != 0:
            raise BackendError(f"sinfo failed: {_one_line(res.stderr)} (is slurmctld up? SLURM_CONF set?)")
        self.offers: Optional[Offers] = None
        if profile is not None:
            self.offers, pools = profile_partitions(res.stdout, profile)
            big = max(self.offers.offers, key=lambda o: (o.gpu.memory_gib, o.gpus_per_node))
            # what the job views name as the cluster; admission plans on each partition instead
            self.cluster = Cluster(big.gpu.key, big.gpus_per_node, pools[big.name] // big.gpus_per_node, host_ram_gib)
            self.partition, self.gres = None, None
        else:
            self.cluster, self.partition, self.gres = read_cluster(res.stdout, partition, gpu, host_ram_gib)
            pools = {"": self.cluster.total_gpus}
        self.slots = sum(pools.values())
        self.time_limit = time_limit
        self._pools = {name: SlotPool(n) for name, n in pools.items()}
        self._pool_of: dict[str, str] = {}  # handle → its pool
        self._pending: dict[str, str] = {}  # handle → Slurm's reason, for jobs PENDING at the last poll

    def free_slots(self) -> int | dict[str, int]:
        """Free slots: one number, or each partition's with a cluster profile (policy.py's pools)."""
        if self.offers is None:
            return self._pools[""].free()
        return {name: pool.free() for name, pool in self._pools.items()}

    def handles(self) -> list[str]:
        return [h for pool in self._pools.values() for h in pool.handles()]

    def queued_reason(self, handle: str) -> Optional[str]:
        """Why Slurm had not started the job at the last poll (PENDING and Slurm's Reason), or None."""
        why = self._pending.get(handle)
        return None if why is None else f"PENDING in Slurm's queue ({why})"

    def _time(self, work: Work) -> str:
        if self.time_limit:
            return self.time_limit
        if not work.planned_s:
            return DEFAULT_TIME
        from bigtune.plan.search.choose import TIME_MARGIN, TIME_STARTUP_S
        from bigtune.plan.search.offers import format_slurm_time

        return format_slurm_time(work.planned_s * (1 + TIME_MARGIN) + TIME_STARTUP_S)

    def start(self, work: Work) -> Started:
        """Write the attempt's script with launch's builder into the job's folder and sbatch it."""
        from bigtune.run.launch import launch_shape, slurm_script

        place = work.placement or {}
        pool = place.get("partition", "") if self.offers is not None else ""
        if pool not in self._pools:
            raise BackendError(f"job {work.job_id} was admitted to partition {pool!r}, which the service's cluster "
                               f"profile no longer has ({', '.join(self._pools)}): submit it again")  # fmt: skip
        slot_ids = self._pools[pool].take(work.slots)
        nodes, per_node, strategy = launch_shape(str(work.recipe), work.sets, None, None, None)
        cpu = self.cluster.gpu is None
        partition = place.get("partition", self.partition)
        notes = [f"bigtune serve: job {work.job_id}, attempt {work.attempt}"]
        if place:
            notes.append(f"partition chosen by bigtune serve from cluster profile {self.offers.path}: {place['why']}")
        mem = f"{place['mem_gib']}G" if place.get("mem_gib") else None
        text = slurm_script(str(work.recipe), work.sets, nodes, per_node, self.time_limit or place.get("time") or
                            self._time(work), partition, cpus_per_task=1 if cpu else place.get("cpus_per_task"),
                            mem=mem, job_name=f"bigtune-{work.job_id}", strategy=strategy, python=work.python,
                            gres=place.get("gres", self.gres), workdir=work.cwd, cpu=cpu, notes=notes)  # fmt: skip
        script = work.job_dir / f"attempt-{work.attempt}.sbatch"
        script.write_text(text)
        Path(work.run_dir).mkdir(parents=True, exist_ok=True)  # Slurm opens the output file there, makes no folder
        res = _run(["sbatch", "--parsable", str(script)], env={**work.env, **work.extra_env}, cwd=work.cwd)
        if res.returncode != 0:
            raise BackendError(f"sbatch refused job {work.job_id}: {_one_line(res.stderr)} (its script: {script})")
        handle = res.stdout.strip().split(";")[0]
        self._pools[pool].hold(handle, slot_ids)
        self._pool_of[handle] = pool
        return Started(handle, slot_ids, f"as Slurm job {handle} (partition {partition})")

    def _state(self, handle: str) -> tuple[Optional[str], Optional[int], dict]:
        """(Slurm's state, its exit code, scontrol's fields) of a job; (None, None, {}) when Slurm no longer
        knows it."""
        res = _run(["scontrol", "show", "job", "-o", handle])
        if res.returncode == 0 and res.stdout.strip():
            fields = parse_job(res.stdout)
            return fields.get("JobState"), exit_code(fields.get("ExitCode", "")), fields
        # Forgotten by the controller (MinJobAge passed): accounting, where it is kept
        res = _run(["sacct", "-n", "-X", "-P", "-j", handle, "-o", "State,ExitCode"])
        line = res.stdout.strip().splitlines()[0] if res.returncode == 0 and res.stdout.strip() else ""
        if "|" not in line:
            return None, None, {}
        state, code = line.split("|", 1)
        return state.split()[0], exit_code(code), {}

    def poll(self, handle: str) -> tuple[bool, Optional[int]]:
        """(still queued or running in Slurm, exit code): None when Slurm has forgotten the job."""
        state, code, fields = self._state(handle)
        if state == "PENDING":
            self._pending[handle] = fields.get("Reason", "no reason given")
        else:
            self._pending.pop(handle, None)
        if state in ALIVE:
            return True, None
        return False, code

    def cancel(self, handle: str, grace_s: float = 5.0) -> None:
        """SIGTERM to the job's steps, that is to bigtune's ranks (they write a checkpoint and stop), a plain
        scancel after ``grace_s``. A job still pending has nothing to signal: it is cancelled at once.

        Not ``--full``: that signals the batch script's shell and srun too, and an srun that gets SIGTERM ends its
        step at once (``srun: forcing job termination``), killing the ranks before their checkpoint is written
        (seen on Slurm 22.05)."""
        if self._state(handle)[0] == "PENDING":
            # a pending job has no process to signal, and `scancel --signal` of one did not return within 60 s
            # (seen on Slurm 22.05)
            _run(["scancel", handle])
            return
        res = _run(["scancel", "--signal=TERM", handle])
        if res.returncode != 0:
            _run(["scancel", handle])
            return
        timer = threading.Timer(grace_s, _run, args=(["scancel", handle],))
        timer.daemon = True
        timer.start()

    def release(self, handle: str) -> None:
        """Forget the job's slots; a job Slurm still runs (cancelled while the service was down) is cancelled."""
        state, _, _ = self._state(handle)
        if state in ALIVE:
            _run(["scancel", handle])
        self._pending.pop(handle, None)
        pool = self._pool_of.pop(handle, None)
        if pool in self._pools:
            self._pools[pool].give_back(handle)

    def adopt(self, handle: str, slot_ids: list[int], job_id: str) -> bool:
        """After a server restart: take back a Slurm job that is still queued or running (and is this job's: its
        name is bigtune-<job id>)."""
        state, _, fields = self._state(handle)
        if state not in ALIVE or job_id not in fields.get("JobName", ""):
            return False
        pool = fields.get("Partition", "") if self.offers is not None else ""
        if pool not in self._pools:  # left the profile since: counted nowhere, Slurm runs it all the same
            return True
        self._pools[pool].hold(handle, slot_ids)
        self._pool_of[handle] = pool
        return True

    def output(self, handles: list[str], job_dir: Path, run_dir: Path, max_bytes: int) -> str:
        """Each attempt's Slurm output file (``<run folder>/slurm-<job id>.out``), the last ``max_bytes`` of all."""
        parts = []
        for h in handles:
            text = read_tail(Path(run_dir) / f"slurm-{h}.out", max_bytes)
            parts.append(f"--- Slurm job {h} ---\n{text}" if len(handles) > 1 else text)
        return "\n".join(parts)[-max_bytes:]
