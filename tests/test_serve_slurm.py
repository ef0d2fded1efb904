"""The training service on Slurm (``bigtune serve --backend slurm``; docs/how-to/serve.md): the cluster read from
sinfo's text (fast, no Slurm), then over real HTTP on 127.0.0.1 with the real one-node Slurm of conftest.py's
``slurm`` fixture (tests/slurm_cluster.py; skips with the reason where Slurm cannot run here): a tiny job runs as
an sbatch job to the end, its Slurm output shown by the logs route; another is taken back by a restarted server by
its Slurm job id, then cancelled (SIGTERM first: it writes a checkpoint). With a cluster profile of two partitions
of which only one fits the job, the job is sent to that one, slots are counted per partition, and a job Slurm keeps
waiting shows as pending."""

from __future__ import annotations

import os
import subprocess
import time

import pytest
import yaml

from bigtune.serve.backends import BackendError
from bigtune.serve.service import ServeConfig
from bigtune.serve.slurm_backend import (
    SlurmBackend,
    exit_code,
    parse_gres,
    parse_job,
    profile_partitions,
    read_cluster,
)
from slurm_cluster import FOUND, job_state
from test_serve import TINY, WAIT_S, Served

SINFO = "|".join(["%P", "%N", "%c", "%m", "%G", "%T"])  # the columns SlurmBackend asks sinfo for


def _rows(*rows: str) -> str:
    return "\n".join(rows) + "\n"


def test_gres_and_job_fields_are_read():
    assert parse_gres("gpu:a100:4(S:0-1)") == ("a100", 4)
    assert parse_gres("gpu:2,shard:8") == (None, 2)
    assert parse_gres("(null)") == (None, 0)
    assert exit_code("0:0") == 0 and exit_code("2:0") == 2 and exit_code("0:9") == -9
    fields = parse_job("JobId=12 JobName=bigtune-job-1 JobState=RUNNING Reason=None ExitCode=0:0")
    assert fields["JobState"] == "RUNNING" and fields["JobName"] == "bigtune-job-1"


def test_a_profile_with_a_partition_or_gpu_is_refused_before_slurm_is_asked(monkeypatch):
    import bigtune.serve.slurm_backend as sb

    monkeypatch.setattr(sb, "_run", lambda *a, **k: pytest.fail("sinfo was called"))
    for extra in ({"partition": "gpu"}, {"gpu": "a100-80gb"}):
        with pytest.raises(BackendError, match="--cluster chooses each job's partition"):
            SlurmBackend(profile="cluster.yaml", **extra)


def test_the_cluster_comes_from_sinfo():
    text = _rows(
        "gpu*|n1|64|512000|gpu:h100:4(S:0-1)|idle",
        "gpu*|n2|64|256000|gpu:h100:4|mixed",
        "gpu*|n3|64|256000|gpu:h100:4|down*",
        "cpu|c1|32|128000|(null)|idle",
        "cpu|c2|16|128000|(null)|allocated",
    )
    cluster, partition, gres = read_cluster(text, None, None, None)
    # the default partition; the down node left out; RAM the smallest node's
    assert (partition, cluster.gpu, cluster.gpus_per_node, cluster.nodes, gres) == ("gpu", "h100-sxm-80gb", 4, 2,
                                                                                   "gpu:h100")  # fmt: skip
    assert cluster.host_ram_gib == 250
    cpu, partition, gres = read_cluster(text, "cpu", None, 64)
    # no GPUs: each node's CPUs stand in as slots (the smallest node's count per node)
    assert (partition, cpu.gpu, cpu.gpus_per_node, cpu.nodes, cpu.host_ram_gib, gres) == ("cpu", None, 16, 2, 64,
                                                                                           None)  # fmt: skip


@pytest.mark.parametrize(
    "text, partition, gpu, says",
    [
        (_rows("p*|n1|8|1000|gpu:a100:2|idle"), None, None, "give --gpu KIND"),  # a100: 40 or 80 GB?
        (_rows("p*|n1|8|1000|gpu:2|idle"), None, None, "no type in their gres: give --gpu KIND"),
        (_rows("p*|n1|8|1000|gpu:l4:2|idle", "p*|n2|8|1000|gpu:h100:2|idle"), None, None, "several kinds"),
        (_rows("p*|n1|8|1000|(null)|idle"), None, "h100", "has no GPUs"),
        (_rows("p*|n1|8|1000|(null)|idle"), "q", None, "no partition 'q' (it has: p): fix --partition"),
        (_rows("p*|n1|8|1000|(null)|drained"), None, None, "no node of Slurm partition 'p' takes jobs"),
    ],
)
def test_a_cluster_bigtune_cannot_plan_for_is_one_line_with_the_fix(text, partition, gpu, says):
    with pytest.raises(BackendError, match=says.replace("(", r"\(").replace(")", r"\)")) as e:
        read_cluster(text, partition, gpu, None)
    assert "\n" not in str(e.value)


def test_an_untyped_gres_is_named_by_gpu():
    cluster, _, gres = read_cluster(_rows("p*|n1|8|1000|gpu:a100:2|idle"), None, "a100-sxm-80gb", None)
    assert (cluster.gpu, cluster.gpus_per_node, gres) == ("a100-sxm-80gb", 2, "gpu:a100")


# Two partitions of the same card, the cheaper one too small for anything (0.25 GiB: less than the CUDA context),
# asked for as the test cluster's count-only gres (tests/slurm_cluster.py): the plan must choose "big".
PROFILE = {
    "name": "two-partitions",
    "units": "SU",
    "partitions": {
        name: {"gpu": "rtx-4090", "gpus_per_node": 1, "cpus_per_node": 2, "mem_per_node_gib": 8,
               "max_time": "1:00:00", "gres": "fakegpu", "units_per_gpu_hour": price, **extra}
        for name, price, extra in [("debug", 1.0, {"gpu_memory_gib": 0.25}), ("big", 2.0, {})]
    },
}  # fmt: skip


def test_a_cluster_profiles_partitions_are_checked_against_sinfo(tmp_path):
    profile = tmp_path / "cluster.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    text = _rows("debug*|n1|2|8000|(null)|idle", "big|n1|2|8000|(null)|idle", "big|n2|2|8000|(null)|down*")
    offers, slots = profile_partitions(text, str(profile))
    assert sorted(o.name for o in offers.offers) == ["big", "debug"] and slots == {"debug": 1, "big": 1}
    with pytest.raises(BackendError, match=r"partition 'big', which Slurm does not have \(sinfo lists: debug\)"):
        profile_partitions(_rows("debug*|n1|2|8000|(null)|idle"), str(profile))
    with pytest.raises(BackendError, match="no node of Slurm partition 'big'"):
        profile_partitions(_rows("debug*|n1|2|8000|(null)|idle", "big|n2|2|8000|(null)|drained"), str(profile))


# ------------------------------------------------------------------ on the real one-node Slurm


@pytest.fixture(scope="module")
def slurm_served(slurm, tmp_path_factory):
    """The service with ``backend=slurm`` on the test cluster (its environment: SLURM_CONF), 127.0.0.1 only."""
    mp = pytest.MonkeyPatch()
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        mp.delenv(key)
    mp.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    root = tmp_path_factory.mktemp("serve-slurm")
    (root / "allowed").mkdir()
    cfg = ServeConfig(state_dir=root / "state", backend="slurm", allowed_roots=(root / "allowed",),
                      workdir=root / "allowed", cancel_grace_s=5.0, tick_s=0.3)  # fmt: skip
    s = None
    try:
        s = Served(cfg)
        yield s
    finally:
        if s is not None:
            s.server.stop()
        mp.undo()


def _wait(s: Served, job_id: str, done, what: str) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        job = s.job(job_id)
        if done(job):
            return job
        if time.monotonic() > deadline:
            out = s.call("GET", f"/v1/jobs/{job_id}/logs", "root").json().get("text", "")
            pytest.fail(f"job {job_id} not {what} within {WAIT_S} s: {job['state']}\n{out[-2000:]}")
        time.sleep(0.3)


@pytest.mark.slow
def test_a_job_runs_as_a_slurm_job_to_the_end_and_another_is_taken_back_then_cancelled(slurm, slurm_served):
    s = slurm_served
    assert s.service.backend.name == "slurm" and s.service.cfg.slots == 2  # the node's 2 CPUs stand in as slots

    res = s.submit(recipe={**TINY, "train": {**TINY["train"], "max_steps": 2}})
    assert res.status_code == 201, res.text
    done = _wait(s, res.json()["id"], lambda j: j["state"] in ("succeeded", "failed", "cancelled"), "ended")
    assert done["state"] == "succeeded", done
    slurm_id = done["backend_job_id"]
    assert done["backend"] == "slurm" and slurm_id.isdigit()
    assert job_state(slurm, slurm_id) == "COMPLETED"
    listed = {j["id"]: j for j in s.call("GET", "/v1/jobs").json()["data"]}
    assert listed[done["id"]]["backend_job_id"] == slurm_id  # the job list shows Slurm's job id
    logs = s.call("GET", f"/v1/jobs/{done['id']}/logs").json()
    assert logs["backend"] == "slurm" and "status ok; 2 steps" in logs["text"], logs["text"][-2000:]
    events = [e["message"] for e in s.call("GET", f"/v1/jobs/{done['id']}/events").json()["data"]]
    assert any(f"as Slurm job {slurm_id}" in m for m in events), events

    # A long job: running under Slurm, the server restarts and takes it back by its Slurm job id; then cancel.
    res = s.submit(recipe={**TINY, "train": {**TINY["train"], "max_steps": 100000}})
    assert res.status_code == 201, res.text
    job_id = res.json()["id"]
    running = _wait(s, job_id, lambda j: j["state"] == "running" and j["progress"]["step"] >= 1, "training")
    slurm_id = running["backend_job_id"]
    assert job_state(slurm, slurm_id) == "RUNNING"
    s.restart()
    events = [e["message"] for e in s.call("GET", f"/v1/jobs/{job_id}/events").json()["data"]]
    assert "server restarted: its process still runs; taken back" in events, events
    assert s.job(job_id)["backend_job_id"] == slurm_id and s.service.backend.free_slots() == 1

    res = s.call("POST", f"/v1/jobs/{job_id}/cancel")
    assert res.status_code == 200 and res.json()["state"] == "cancelled", res.text
    deadline = time.monotonic() + WAIT_S
    ended = ("CANCELLED", "COMPLETED", "FAILED")
    while job_state(slurm, slurm_id) not in ended and time.monotonic() < deadline:
        time.sleep(0.5)
    # Slurm records a job that stopped on the SIGTERM as FAILED (its exit status), as CANCELLED when the plain
    # scancel after the grace period found it still running
    assert job_state(slurm, slurm_id) in ("CANCELLED", "FAILED")
    _wait(s, job_id, lambda j: s.service.store.job(job_id).handle is None, "released")
    assert s.service.backend.free_slots() == 2
    # SIGTERM came first: training wrote a checkpoint before it stopped
    assert s.call("GET", f"/v1/jobs/{job_id}/checkpoints").json()["data"], "no checkpoint written on SIGTERM"


@pytest.mark.slow
def test_the_cluster_profile_sends_a_job_to_the_partition_that_fits_where_slurm_keeps_it_pending(slurm, tmp_path):
    mp = pytest.MonkeyPatch()
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        mp.delenv(key)
    mp.setenv("SLURM_CONF", slurm["SLURM_CONF"])
    (tmp_path / "allowed").mkdir()
    profile = tmp_path / "cluster.yaml"
    profile.write_text(yaml.safe_dump(PROFILE))
    cfg = ServeConfig(state_dir=tmp_path / "state", backend="slurm", cluster_profile=str(profile),
                      allowed_roots=(tmp_path / "allowed",), workdir=tmp_path / "allowed", tick_s=0.3)  # fmt: skip
    # Both of the node's CPUs taken by a job from outside the service: what the service hands Slurm waits there.
    blocker = subprocess.run([FOUND["sbatch"], "--parsable", "-p", "debug", "-c", "2", "-o", "/dev/null", "--wrap",
                              "sleep 300"], env=slurm, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert blocker.returncode == 0, blocker.stderr
    blocker_id = blocker.stdout.strip().split(";")[0]
    s = None
    try:
        s = Served(cfg)
        assert s.service.backend.free_slots() == {"debug": 1, "big": 1}
        res = s.submit(recipe=TINY)
        assert res.status_code == 201, res.text
        job_id = res.json()["id"]
        job = s.call("GET", f"/v1/jobs/{job_id}").json()
        assert job["partition"] == "big", job
        placed = job["plan"]["partition"]
        assert placed["gres"] == "fakegpu" and "does not fit" in placed["not_ranked"]["debug"], placed
        events = [e["message"] for e in s.call("GET", f"/v1/jobs/{job_id}/events").json()["data"]]
        assert any("of partition big (the cheapest partition that fits" in m for m in events), events

        # Started by the service (it holds big's one slot), held in Slurm's queue behind the blocker: pending
        pending = _wait(s, job_id, lambda j: j["state"] == "pending", "pending")
        slurm_id = pending["backend_job_id"]
        assert "PENDING in Slurm's queue" in pending["waiting_because"], pending
        fields = parse_job(subprocess.run([FOUND["scontrol"], "show", "job", "-o", slurm_id], env=slurm,
                                          capture_output=True, text=True, timeout=60).stdout)  # fmt: skip
        assert fields["Partition"] == "big" and fields["JobState"] == "PENDING", fields
        script = (tmp_path / "state" / "jobs" / job_id / "attempt-1.sbatch").read_text()
        assert "#SBATCH --partition=big" in script and "#SBATCH --gres=fakegpu:1" in script, script
        assert s.service.backend.free_slots() == {"debug": 1, "big": 0}

        # The same job again (its plan kept: no second search) waits for big's slot, though debug's is free
        res = s.submit(recipe=TINY)
        assert res.status_code == 201, res.text
        second = _wait(s, res.json()["id"], lambda j: j["queue_position"] == 1, "queued")
        assert second["state"] == "queued" and "of partition big" in second["waiting_because"], second

        for j in (job_id, second["id"]):
            assert s.call("POST", f"/v1/jobs/{j}/cancel").status_code == 200
        _wait(s, job_id, lambda j: s.service.store.job(job_id).handle is None, "released")
        assert s.service.backend.free_slots() == {"debug": 1, "big": 1}
        assert job_state(slurm, slurm_id) == "CANCELLED"
    finally:
        if s is not None:
            s.server.stop()
        subprocess.run([FOUND["scancel"], blocker_id], env=slurm, capture_output=True, timeout=60)
        mp.undo()
