"""The training service on Ray (``bigtune serve --backend ray --ray-address URL``; docs/how-to/serve.md): the cluster
read from Ray's node resources (fast, no Ray), then over real HTTP on 127.0.0.1 with a real local Ray head that
the test starts (2 CPUs, dashboard on 127.0.0.1, its own temp folder; stopped at the end, every process of it):
a tiny job runs as a Ray job to the end, its logs from Ray shown by the logs route. Skips with the reason where
Ray is not installed or its head does not come up."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bigtune.serve.admission import Refused, Rules, admit
from bigtune.serve.backends import BackendError
from bigtune.serve.ray_backend import read_cluster
from bigtune.serve.service import ServeConfig
from test_serve import TINY, WAIT_S, Served, _free_port

START_S = 120  # how long Ray's head gets to answer on its job API before the test skips (the machine's, not ours)


def test_the_cluster_comes_from_rays_node_resources():
    a100 = {"CPU": 32, "GPU": 4, "accelerator_type:A100-80GB": 1, "memory": 200 * 2**30}
    head = {"CPU": 8, "memory": 16 * 2**30}  # a CPU-only head beside GPU workers: its GPUs are none
    cluster = read_cluster([head, a100, dict(a100, GPU=2)], None, None)
    # a job runs on one node: GPUs per node the largest node's; the slots every GPU node's
    assert (cluster.gpu, cluster.gpus_per_node, cluster.nodes) == ("a100-sxm-80gb", 4, 2)
    assert cluster.host_ram_gib == 16
    cpu = read_cluster([{"CPU": 2}, {"CPU": 4}], None, 8)
    assert (cpu.gpu, cpu.gpus_per_node, cpu.nodes, cpu.host_ram_gib) == (None, 4, 2, 8)
    named = read_cluster([{"CPU": 8, "GPU": 2}], "rtx-4090", None)
    assert (named.gpu, named.total_gpus) == ("rtx-4090", 2)


@pytest.mark.parametrize(
    "nodes, gpu, says",
    [
        ([{"CPU": 8, "GPU": 2, "accelerator_type:A100": 1}], None, "give --gpu KIND"),  # 40 or 80 GB?
        ([{"CPU": 8, "GPU": 2}], None, "GPUs of no known kind: give --gpu KIND"),
        ([{"CPU": 8, "GPU": 1, "accelerator_type:L4": 1}, {"GPU": 1, "accelerator_type:H100": 1}], None, "several"),
        ([{"CPU": 8}], "h100", "has no GPUs"),
        ([], None, "no alive node"),
    ],
)
def test_a_cluster_bigtune_cannot_plan_for_is_one_line_with_the_fix(nodes, gpu, says):
    with pytest.raises(BackendError, match=says) as e:
        read_cluster(nodes, gpu, None)
    assert "\n" not in str(e.value)


def test_a_job_over_one_node_is_refused_on_ray_with_the_reason(tmp_path):
    cluster = read_cluster([{"CPU": 2}, {"CPU": 2}], None, None)  # 4 slots, 2 on each node
    rules = Rules((tmp_path,))
    with pytest.raises(Refused, match="runs each job on one node .* set num_nodes=1 .* or run it on Slurm"):
        admit({**TINY, "num_nodes": 2}, [], False, cluster, rules, tmp_path)
    with pytest.raises(Refused, match="asks for 3 GPUs .* at most 2 on one node"):
        admit({**TINY, "devices": 3}, [], False, cluster, rules, tmp_path)


# ------------------------------------------------------------------ on a real local Ray head


def _ours(temp_dir: str) -> list[int]:
    """Processes whose command line names this head's own temp folder: what `ray start` left."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if temp_dir.encode() in cmdline.read_bytes():
                out.append(int(cmdline.parent.name))
        except (OSError, ValueError):
            continue
    return [p for p in out if p != os.getpid()]


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head on 127.0.0.1 with 2 CPUs and its job API (the dashboard): its address. Stopped at the end by its
    own processes' ids: SIGTERM to `ray start --block` (it drains the node and stops what it started, in order),
    then SIGKILL to whatever is left of its session or names its temp folder. Not `ray stop`, which would stop
    every Ray on this machine."""
    ray_cmd = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
    try:
        import ray.job_submission  # noqa: F401
    except ImportError:
        pytest.skip("Ray's job API is not installed: pip install 'ray[default]'")
    if ray_cmd is None:
        pytest.skip("the `ray` command is not on PATH: pip install 'ray[default]'")
    temp_dir = tempfile.mkdtemp(prefix="bt-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    port = _free_port()
    address = f"http://127.0.0.1:{port}"
    argv = [ray_cmd, "start", "--head", "--port=0", "--node-ip-address=127.0.0.1", "--include-dashboard=true",
            "--dashboard-host=127.0.0.1", f"--dashboard-port={port}", "--num-cpus=2", "--num-gpus=0",
            f"--temp-dir={temp_dir}", "--object-store-memory=100000000", "--disable-usage-stats", "--block"]  # fmt: skip
    log = Path(temp_dir) / "ray-start.out"
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "wb") as out:
        head = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        from ray.job_submission import JobSubmissionClient
        from ray.util.state import list_nodes

        deadline, error = time.monotonic() + START_S, ""
        while True:
            if head.poll() is not None:
                pytest.skip(f"`ray start --head` exited ({head.returncode}): {log.read_text()[-1500:]}")
            try:
                # the job API answers before the head's node is listed: wait for both
                JobSubmissionClient(address).list_jobs()
                if list_nodes(address=address, filters=[("state", "=", "ALIVE")], timeout=10):
                    break
                error = "no alive node listed yet"
            except Exception as e:  # noqa: BLE001 - not up yet: Ray raises ConnectionError or RuntimeError
                error = str(e)[:300]
            if time.monotonic() > deadline:
                pytest.skip(f"Ray's head did not answer on {address} within {START_S} s ({error}): "
                            f"{log.read_text()[-1500:]}")  # fmt: skip
            time.sleep(1)
        yield address
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(timeout=10)
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in _ours(temp_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_a_job_runs_as_a_ray_job_to_the_end(ray_head, tmp_path):
    (tmp_path / "allowed").mkdir()
    cfg = ServeConfig(state_dir=tmp_path / "state", backend="ray", ray_address=ray_head,
                      allowed_roots=(tmp_path / "allowed",), workdir=tmp_path / "allowed", tick_s=0.3)  # fmt: skip
    s = Served(cfg)
    try:
        assert s.service.backend.name == "ray" and s.service.cfg.slots == 2  # the head's 2 CPUs stand in as slots
        res = s.submit(recipe={**TINY, "train": {**TINY["train"], "max_steps": 2}})
        assert res.status_code == 201, res.text
        job_id = res.json()["id"]
        deadline = time.monotonic() + WAIT_S
        while (job := s.job(job_id))["state"] not in ("succeeded", "failed", "cancelled"):
            if time.monotonic() > deadline:
                out = s.call("GET", f"/v1/jobs/{job_id}/logs").json()["text"]
                pytest.fail(f"job {job_id} not ended within {WAIT_S} s: {job['state']}\n{out[-2000:]}")
            time.sleep(0.3)
        out = s.call("GET", f"/v1/jobs/{job_id}/logs").json()
        assert job["state"] == "succeeded", (job, out["text"][-2000:])
        assert job["backend"] == "ray" and job["backend_job_id"] == f"{job_id}-a1"  # Ray's submission id
        assert out["backend"] == "ray" and "status ok; 2 steps" in out["text"], out["text"][-2000:]
        from ray.job_submission import JobSubmissionClient

        info = JobSubmissionClient(ray_head).get_job_info(job["backend_job_id"])
        assert str(info.status.value) == "SUCCEEDED" and info.metadata["bigtune_job"] == job_id
        assert s.service.backend.free_slots() == 2
    finally:
        s.server.stop()


def _job_processes(job_id: str) -> list[int]:
    """Live processes (zombies aside) whose command line names the job: its `bigtune train` and what that started."""
    out = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if job_id.encode() in cmdline.read_bytes():
                state = (cmdline.parent / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    out.append(int(cmdline.parent.name))
        except (OSError, IndexError):
            continue
    return [p for p in out if p != os.getpid()]


@pytest.mark.slow
def test_a_running_ray_job_cancelled_leaves_no_process_and_frees_its_slot(ray_head, tmp_path):
    (tmp_path / "allowed").mkdir()
    cfg = ServeConfig(state_dir=tmp_path / "state", backend="ray", ray_address=ray_head, cancel_grace_s=5.0,
                      allowed_roots=(tmp_path / "allowed",), workdir=tmp_path / "allowed", tick_s=0.3)  # fmt: skip
    s = Served(cfg)
    try:
        res = s.submit(recipe={**TINY, "train": {**TINY["train"], "max_steps": 100_000}})
        assert res.status_code == 201, res.text
        job_id = res.json()["id"]
        deadline = time.monotonic() + WAIT_S
        while not ((job := s.job(job_id))["state"] == "running" and job["progress"]["step"] >= 1):
            if time.monotonic() > deadline or job["state"] in ("succeeded", "failed", "cancelled"):
                out = s.call("GET", f"/v1/jobs/{job_id}/logs").json()["text"]
                pytest.fail(f"job {job_id} not training within {WAIT_S} s: {job['state']}\n{out[-2000:]}")
            time.sleep(0.3)
        assert _job_processes(job_id), "the running job's processes are not visible by its id"
        assert s.service.backend.free_slots() == 1

        res = s.call("POST", f"/v1/jobs/{job_id}/cancel")
        assert res.status_code == 200 and res.json()["state"] == "cancelled", res.text
        deadline = time.monotonic() + 60  # Ray's stop: SIGTERM, SIGKILL after the 5 s grace submitted with it
        while _job_processes(job_id) or s.service.store.job(job_id).handle is not None:
            if time.monotonic() > deadline:
                pytest.fail(f"after cancel: processes {_job_processes(job_id)}, handle "
                            f"{s.service.store.job(job_id).handle}")  # fmt: skip
            time.sleep(0.3)
        assert s.service.backend.free_slots() == 2
        from ray.job_submission import JobSubmissionClient

        info = JobSubmissionClient(ray_head).get_job_info(f"{job_id}-a1")
        assert str(info.status.value) == "STOPPED", info
        # SIGTERM came first: training wrote a checkpoint before it stopped
        assert s.call("GET", f"/v1/jobs/{job_id}/checkpoints").json()["data"], "no checkpoint written on SIGTERM"
    finally:
        s.server.stop()
