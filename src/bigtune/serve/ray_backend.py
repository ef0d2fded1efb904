"""``bigtune serve --backend ray --ray-address http://HEAD:8265``: each attempt of a job is one Ray job, submitted
through Ray's Job Submission API (the dashboard's address) with ``bigtune train`` as its entrypoint, asking Ray
for the job's GPUs (``entrypoint_num_gpus``; on a cluster without GPUs, ``entrypoint_num_cpus``).

Ray Jobs has no queue of its own (a job asking for more than is free waits in PENDING, in no particular order): the
service's queue decides when to submit, and submits only what its count of the cluster's free slots allows. A job
runs on one node: its ranks are the processes ``bigtune train`` starts there (Lightning Fabric), as on a
workstation; multi-node runs go through Slurm. State and exit code from ``get_job_info``, cancel by ``stop_job``
(SIGTERM to the entrypoint's processes, SIGKILL after the service's grace period), output from ``get_job_logs``.
The cluster's GPUs (kind from the nodes' ``accelerator_type:*`` resource, count per node) come from Ray's state
API on the same address.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from bigtune.serve.admission import Cluster
from bigtune.serve.backends import BackendError, SlotPool, Started, Work

NO_RAY = "the Ray backend needs Ray's job API (its dashboard): pip install 'bigtune[ray]' (or 'ray[default]')"
ALIVE = ("PENDING", "RUNNING")


def _client(address: str):
    try:
        from ray.job_submission import JobSubmissionClient
    except ImportError:
        raise BackendError(NO_RAY) from None
    try:
        return JobSubmissionClient(address)
    except Exception as e:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError or ValueError here
        raise BackendError(
            f"cannot reach Ray's job API at {address}: {str(e).splitlines()[0] if str(e) else type(e).__name__} "
            "(give the dashboard's address, e.g. --ray-address http://HEAD:8265; the head needs "
            "`ray start --head --include-dashboard=true`)"
        ) from None


def read_cluster(nodes: list[dict], gpu: Optional[str], host_ram_gib: Optional[float]) -> Cluster:
    """The cluster jobs are admitted against, from Ray's alive nodes' total resources (``{"CPU": 8, "GPU": 4,
    "accelerator_type:A100": 1, "memory": bytes}``). A job runs on one node, so its GPUs per node are the largest
    node's and the slots, every node's together; without GPUs, each node's CPUs stand in as slots."""
    from bigtune.core.gpus import UnknownGPUError, find_gpu

    if not nodes:
        raise BackendError("Ray reports no alive node: start one (ray start --head, or ray start --address HEAD)")
    gpu_nodes = [n for n in nodes if n.get("GPU", 0) >= 1]
    ram = host_ram_gib
    if ram is None and all(n.get("memory") for n in nodes):
        ram = min(n["memory"] for n in nodes) / 2**30  # what Ray lets tasks use: its own share of the node's RAM
    if not gpu_nodes:
        if gpu:
            raise BackendError(f"--gpu {gpu}: the Ray cluster has no GPUs; drop --gpu to run on its CPUs")
        per_node = [int(n.get("CPU", 0)) for n in nodes]
        return Cluster(None, max(per_node), len(nodes), ram, one_node_jobs=True)
    if gpu is None:
        kinds = sorted({k.split(":", 1)[1] for n in gpu_nodes for k in n if k.startswith("accelerator_type:")})
        if len(kinds) != 1:
            what = "GPUs of several kinds (" + ", ".join(kinds) + ")" if kinds else "GPUs of no known kind"
            raise BackendError(f"the Ray cluster has {what}: give --gpu KIND (a catalog name, bigtune gpus lists them)")
        try:
            gpu = find_gpu(kinds[0]).key
        except UnknownGPUError as e:
            raise BackendError(f"Ray names the cluster's GPUs {kinds[0]!r}, not a catalog name ({e}): give --gpu KIND")
    counts = [int(n["GPU"]) for n in gpu_nodes]
    return Cluster(gpu, max(counts), len(gpu_nodes), ram, one_node_jobs=True)


def cluster_nodes(address: str) -> list[dict]:
    """The alive nodes' total resources, from Ray's state API at the dashboard's ``address``."""
    try:
        from ray.util.state import list_nodes
    except ImportError:
        raise BackendError(NO_RAY) from None
    try:
        nodes = list_nodes(address=address, filters=[("state", "=", "ALIVE")], timeout=30)
    except Exception as e:  # noqa: BLE001 - the state API raises Ray's own errors
        raise BackendError(f"cannot read the Ray cluster's nodes at {address}: {e}") from None
    return [dict(n.resources_total or {}) for n in nodes]


class RayBackend:
    name = "ray"

    def __init__(self, address: str, gpu: Optional[str] = None, host_ram_gib: Optional[float] = None):
        self.address = address
        self.client = _client(address)
        self.cluster = read_cluster(cluster_nodes(address), gpu, host_ram_gib)
        # Slots: every node's GPUs (or CPUs) together, a job taking its own on one node.
        self.slots = self.cluster.total_gpus
        self._pool = SlotPool(self.slots)
        self._pending: dict[str, str] = {}  # handle → Ray's message, for jobs Ray had not started at the last poll

    def free_slots(self) -> int:
        return self._pool.free()

    def handles(self) -> list[str]:
        return self._pool.handles()

    def start(self, work: Work) -> Started:
        slot_ids = self._pool.take(work.slots)
        handle = f"{work.job_id}-a{work.attempt}"  # Ray's submission id: unique per attempt, names the job
        gpus = self.cluster.gpu is not None
        # The stop's grace (SIGTERM, then SIGKILL) is the job supervisor's environment: set per job.
        env = {**work.extra_env, "RAY_JOB_STOP_WAIT_TIME_S": str(max(1, round(work.cancel_grace_s)))}
        try:
            self.client.submit_job(
                entrypoint=work.shell_command(),
                submission_id=handle,
                runtime_env={"env_vars": env},
                entrypoint_num_gpus=work.slots if gpus else None,
                entrypoint_num_cpus=None if gpus else work.slots,
                metadata={"bigtune_job": work.job_id, "attempt": str(work.attempt)},
            )
        except Exception as e:  # noqa: BLE001 - Ray's client raises RuntimeError with the server's message
            raise BackendError(f"Ray refused job {work.job_id}: {str(e).splitlines()[0]}") from None
        self._pool.hold(handle, slot_ids)
        what = f"{work.slots} GPU(s)" if gpus else f"{work.slots} CPU(s)"
        return Started(handle, slot_ids, f"as Ray job {handle} ({what})")

    def _info(self, handle: str):
        """Ray's JobInfo, or None when Ray does not know the job (the cluster was restarted)."""
        try:
            return self.client.get_job_info(handle)
        except RuntimeError as e:
            if "does not exist" in str(e) or "404" in str(e):
                return None
            raise BackendError(f"Ray's job API at {self.address} failed: {str(e).splitlines()[0]}") from None

    def poll(self, handle: str) -> tuple[bool, Optional[int]]:
        """(pending or running in Ray, exit code): the entrypoint's exit code where Ray has it."""
        info = self._info(handle)
        if info is None:
            return False, None
        status = str(getattr(info.status, "value", info.status))
        if status == "PENDING":
            self._pending[handle] = getattr(info, "message", None) or "waiting for its resources"
        else:
            self._pending.pop(handle, None)
        if status in ALIVE:
            return True, None
        code = getattr(info, "driver_exit_code", None)
        if code is None:
            code = {"SUCCEEDED": 0, "STOPPED": -15}.get(status)
        return False, code

    def queued_reason(self, handle: str) -> Optional[str]:
        """Why Ray had not started the job at the last poll (Ray's PENDING and its message), or None."""
        why = self._pending.get(handle)
        return None if why is None else f"PENDING in Ray: {why}"

    def cancel(self, handle: str, grace_s: float = 5.0) -> None:
        """Ray's stop: SIGTERM to the entrypoint's processes (bigtune writes a checkpoint), SIGKILL after the
        grace period submitted with the job."""
        try:
            self.client.stop_job(handle)
        except RuntimeError:
            pass  # already ended, or unknown to Ray

    def release(self, handle: str) -> None:
        info = self._info(handle)
        if info is not None and str(getattr(info.status, "value", info.status)) in ALIVE:
            self.cancel(handle)
        self._pending.pop(handle, None)
        self._pool.give_back(handle)

    def adopt(self, handle: str, slot_ids: list[int], job_id: str) -> bool:
        """After a server restart: take back a Ray job that is still pending or running (its submission id names
        the job)."""
        if not handle.startswith(job_id):
            return False
        info = self._info(handle)
        if info is None or str(getattr(info.status, "value", info.status)) not in ALIVE:
            return False
        self._pool.hold(handle, slot_ids)
        return True

    def output(self, handles: list[str], job_dir: Path, run_dir: Path, max_bytes: int) -> str:
        """Each attempt's logs as Ray keeps them (the entrypoint's stdout and stderr), the last ``max_bytes``."""
        parts = []
        for h in handles:
            try:
                text = self.client.get_job_logs(h)
            except RuntimeError as e:
                text = f"(Ray has no logs of {h}: {str(e).splitlines()[0]})"
            parts.append(f"--- Ray job {h} ---\n{text}" if len(handles) > 1 else text)
        return "\n".join(parts)[-max_bytes:]
