"""The training service over real HTTP on 127.0.0.1 (bigtune serve; docs/how-to/serve.md): admission by plan,
the queue on 2 slots, restarts, cancel, a killed worker, and who may do what. One CPU service is shared by the
tests (its jobs are tiny `bigtune train` subprocesses of a few steps); a second one, whose cluster is 2 × RTX 4090,
only admits (a 70B recipe is planned, never run)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from bigtune.serve.admission import Cluster
from bigtune.serve.backends import LocalBackend
from bigtune.serve.policy import Waiting, schedule
from bigtune.serve.server import InThread
from bigtune.serve.service import ServeConfig
from conftest import read_jsonl

WAIT_S = 300  # a bound on every wait for jobs: CI's 2 cores run 2 tiny trainings at once, ~25 s each

TINY = {
    "name": "tiny",
    "model": {"name": "tiny-llama"},
    "data": {"source": "demo", "max_seq_length": 64},
    "train": {"micro_batch_size": 4, "max_steps": 4, "max_epochs": None, "log_every_steps": 1},
    "checkpoint": {"save_model": False},
    "memory": {"plan": False},
    "accelerator": "cpu",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A service in a thread of this process, restartable on the same state folder and port."""

    def __init__(self, cfg: ServeConfig):
        self.cfg, self.port = cfg, _free_port()
        self.server = InThread(cfg, port=self.port).start()
        self.tokens = {u: self.server.service.add_token(u) for u in ("alice", "bob", "carol")}
        self.tokens["root"] = self.server.service.add_token("root", admin=True)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def service(self):
        return self.server.service

    def restart(self) -> None:
        self.server.stop()
        self.server = InThread(self.cfg, port=self.port).start()

    def call(self, method: str, path: str, user: str | None = "alice", **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {self.tokens[user]}"} if user else {}
        return httpx.request(method, self.url + path, headers=headers, timeout=300, **kw)

    def submit(self, user: str = "alice", recipe: dict = TINY, **kw) -> httpx.Response:
        return self.call("POST", "/v1/jobs", user, json={"recipe": recipe, **kw})

    def job(self, job_id: str, user: str = "root") -> dict:
        res = self.call("GET", f"/v1/jobs/{job_id}", user)
        assert res.status_code == 200, res.text
        return res.json()

    def wait(self, job_ids: list[str], done, what: str) -> list[dict]:
        deadline = time.monotonic() + WAIT_S
        while True:
            jobs = [self.job(i) for i in job_ids]
            if all(done(j) for j in jobs):
                return jobs
            if time.monotonic() > deadline:
                logs = [(Path(self.cfg.state_dir) / "jobs" / j["id"] / "worker.log") for j in jobs]
                tails = [p.read_text()[-1500:] for p in logs if p.is_file()]
                pytest.fail(f"not {what} within {WAIT_S} s: {[(j['id'], j['state']) for j in jobs]}\n{tails}")
            time.sleep(0.2)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    (root / "allowed").mkdir()
    cfg = ServeConfig(state_dir=root / "state", slots=2, allowed_roots=(root / "allowed",), workdir=root / "allowed",
                      retry_backoff_s=0.5, cancel_grace_s=2.0, tick_s=0.2)  # fmt: skip
    s = Served(cfg)
    try:
        yield s
    finally:
        service = s.server.service
        for job in service.store.jobs(states=("running", "cancelled")):  # nothing of a failed test left running
            if job.handle:
                service.backend.release(job.handle)
        s.server.stop()


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    """A service whose cluster is 2 × RTX 4090 (24 GB): its jobs are only admitted, held and cancelled."""
    root = tmp_path_factory.mktemp("serve-gpu")
    cfg = ServeConfig(state_dir=root / "state", slots=2, cluster=Cluster("rtx-4090", gpus_per_node=2),
                      workdir=root, tick_s=0.2)  # fmt: skip
    s = Served(cfg)
    try:
        yield s
    finally:
        s.server.stop()


def test_the_queue_policy_reserves_slots_for_the_head_and_ages_waiting_jobs():
    now = 10_000.0
    big = Waiting("big", "a", 0, slots=2, queued_at=now - 10)
    small = Waiting("small", "b", 0, slots=1, queued_at=now - 5)
    # one slot free: the big job at the head waits and the small one behind it may not take the slot
    d = schedule([small, big], free_slots=1, used_gpu_hours={}, quotas={}, now=now)
    assert d.start == [] and d.order == ["big", "small"] and "reserved" in d.blocked["small"]
    # a higher priority goes first, unless the other has waited one aging period longer per level of difference
    urgent = Waiting("urgent", "b", 1, slots=1, queued_at=now)
    assert schedule([big, urgent], 3, {}, {}, now).order == ["urgent", "big"]
    later = Waiting("later", "b", 1, slots=1, queued_at=now + 700)
    assert schedule([big, later], 3, {}, {}, now + 700, aging_s=600).order == ["big", "later"]
    # over quota: waits with the reason and holds up nobody
    hungry = Waiting("hungry", "c", 5, slots=1, queued_at=now, planned_gpu_hours=2.0)
    d = schedule([hungry, small], 1, {"c": 9.0}, {"c": 10.0}, now)
    assert d.start == ["small"] and "over quota" in d.blocked["hungry"]


def test_each_partition_is_a_pool_whose_head_reserves_only_its_own_slots():
    now = 10_000.0
    big_a = Waiting("big-a", "a", 0, slots=2, queued_at=now - 10, pool="a")
    small_a = Waiting("small-a", "b", 0, slots=1, queued_at=now - 5, pool="a")
    small_b = Waiting("small-b", "b", 0, slots=1, queued_at=now - 1, pool="b")
    # partition a has 1 slot free: its head waits and holds that slot; b's job behind it in the order starts
    d = schedule([small_b, small_a, big_a], {"a": 1, "b": 1}, {}, {}, now)
    assert d.start == ["small-b"] and d.order == ["big-a", "small-a", "small-b"]
    assert "head of the queue of partition a" in d.blocked["big-a"] and "reserved" in d.blocked["small-a"]
    # a pool with no free slots, or none at all, starts nothing of its own
    assert schedule([small_b], {"a": 2, "b": 0}, {}, {}, now).start == []
    assert schedule([small_b], {"a": 2}, {}, {}, now).start == []


def test_openapi_schema_and_401_without_a_valid_token(served):
    paths = httpx.get(served.url + "/openapi.json").json()["paths"]
    for p in ("/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/events", "/v1/jobs/{job_id}/cancel",
              "/v1/jobs/{job_id}/metrics", "/v1/jobs/{job_id}/checkpoints"):  # fmt: skip
        assert p in paths
    assert served.call("GET", "/v1/jobs", user=None).status_code == 401
    bad = httpx.get(served.url + "/v1/jobs", headers={"Authorization": "Bearer btk_not-a-token"})
    assert bad.status_code == 401


def test_the_web_page_is_one_self_contained_html_page_that_asks_for_the_token(served):
    res = httpx.get(served.url + "/")  # no token: the page has no data of its own
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/html")
    html = res.text
    for part in ('id="login"', 'type="password"', "sessionStorage", 'id="jobs"', 'class="plot loss"',
                 'class="plot memory"', 'id="output"', 'id="events"', "/v1/jobs", "Authorization", "cancel"):  # fmt: skip
        assert part in html, part
    # nothing from elsewhere (the cluster may have no internet): no external script, style, font or image
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html) and "<link" not in html
    assert "@import" not in html and "url(" not in html
    policy = res.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy and "'unsafe-inline'" not in policy
    assert "script-src 'sha256-" in policy and "frame-ancestors 'none'" in policy


def test_bad_recipes_and_paths_outside_the_allowed_roots_are_refused_with_the_reason(served, tmp_path):
    res = served.submit(recipe={**TINY, "train": {**TINY["train"], "bogus_key": 1}})
    assert res.status_code == 422 and "train.bogus_key" in res.json()["detail"]["reason"]
    outside = tmp_path / "data.jsonl"
    outside.write_text('{"instruction": "a", "output": "b"}\n')
    res = served.submit(recipe={**TINY, "data": {**TINY["data"], "source": str(outside)}})
    assert res.status_code == 403
    assert "data.source" in res.json()["detail"]["reason"] and "outside" in res.json()["detail"]["reason"]
    res = served.submit(recipe={**TINY, "model": {"name": "tiny-llama", "trust_remote_code": True}})
    assert res.status_code == 403 and "trust_remote_code" in res.json()["detail"]["reason"]


FULL_70B = {
    "name": "llama-70b-full",
    "model": {"name": "meta-llama/Llama-3.1-70B"},
    "data": {"source": "hf:mhenrichsen/alpaca_2k_test", "max_seq_length": 2048},
    "train": {"micro_batch_size": 1, "global_batch_size": 16, "max_epochs": 1},
    "precision": "bf16-true",
    "devices": 2,
    "strategy": "fsdp",
}


def test_a_70b_full_fine_tune_on_two_24gb_cards_is_refused_with_alternatives_and_auto_takes_qlora(gpu_cluster):
    t0 = time.monotonic()
    res = gpu_cluster.submit(recipe=FULL_70B)
    refused_s = time.monotonic() - t0
    assert res.status_code == 409, res.text
    detail = res.json()["detail"]
    assert "does not fit" in detail["reason"] and "rtx-4090" in detail["reason"]
    assert detail["plan"]["fits"] is False and detail["alternatives"], detail
    assert refused_s < 120  # planned, not run: seconds on a GPU-less 2-core machine with the simulation cached
    res = gpu_cluster.submit(recipe=FULL_70B, auto=True, hold=True)
    assert res.status_code == 201, res.text
    job = res.json()
    assert job["state"] == "held" and "QLoRA" in job["variant"]
    assert {"peft.method=lora", "model.quantize=nf4"} <= set(job["overrides"])
    assert job["plan"]["fits"] is True and job["memory"]["planned_needed_bytes"] <= job["memory"]["capacity_bytes"]
    assert gpu_cluster.call("POST", f"/v1/jobs/{job['id']}/cancel").json()["state"] == "cancelled"


def _steps(job: dict) -> list[int]:
    return [m["step"] for m in read_jsonl(Path(job["run_dir"]) / "metrics.jsonl")]


def _most_at_once(attempts: list[dict]) -> int:
    edges = sorted([(a["started_at"], 1) for a in attempts] + [(a["ended_at"], -1) for a in attempts],
                   key=lambda e: (e[0], e[1]))  # fmt: skip
    most = now = 0
    for _, d in edges:
        now += d
        most = max(most, now)
    return most


def test_jobs_of_three_users_on_two_slots_survive_a_restart_and_run_once_each(served):
    users = ["alice", "bob", "alice", "carol"]
    ids = []
    for i, user in enumerate(users):
        res = served.submit(user, recipe={**TINY, "name": f"tiny-{i}"})
        assert res.status_code == 201, res.text
        ids.append(res.json()["id"])
    # mid-queue: two running, two waiting → restart the server
    served.wait(ids, lambda j: j["state"] != "queued" or j["queue_position"], "placed")
    served.wait(ids[:1], lambda j: j["state"] in ("running", "succeeded"), "started")
    served.restart()
    jobs = served.wait(ids, lambda j: j["state"] in ("succeeded", "failed", "cancelled"), "finished")
    assert [j["state"] for j in jobs] == ["succeeded"] * 4, [j["error"] for j in jobs]
    for job in jobs:
        assert len(job["attempts"]) == 1 and job["retries"] == 0  # none run twice
        assert _steps(job) == [1, 2, 3, 4] and job["progress"]["step"] == 4
        mem = job["memory"]
        assert mem["measured_peak_allocated_bytes"] and mem["planned_peak_allocated_bytes"]
        assert 0.5 < mem["measured_peak_allocated_bytes"] / mem["planned_peak_allocated_bytes"] < 2
    attempts = [a for j in jobs for a in j["attempts"]]
    assert _most_at_once(attempts) <= 2 and {s for a in attempts for s in a["slot_ids"]} <= {0, 1}
    # who sees what: each user their own, an admin everyone's; another user's job is 403
    assert {j["id"] for j in served.call("GET", "/v1/jobs", "bob").json()["data"]} == {ids[1]}
    assert set(ids) <= {j["id"] for j in served.call("GET", "/v1/jobs", "root").json()["data"]}
    assert served.call("GET", f"/v1/jobs/{ids[0]}", "bob").status_code == 403
    assert served.call("POST", f"/v1/jobs/{ids[0]}/cancel", "carol").status_code == 403
    events = served.call("GET", f"/v1/jobs/{ids[0]}/events").json()["data"]
    assert any(e["message"].startswith("step 4/4") for e in events)


@pytest.fixture(scope="module")
def long_jobs(served):
    """Two jobs started together, so that their start-ups overlap: bob's runs until cancelled, carol's checkpoints
    every 10 of its 100 steps and has its worker killed."""
    forever = {**TINY, "train": {**TINY["train"], "max_steps": 100_000}}
    killed = {
        **TINY,
        "train": {**TINY["train"], "max_steps": 100},
        "checkpoint": {"save_model": False, "every_steps": 10},
    }
    ids = {user: served.submit(user, recipe=r).json()["id"] for user, r in (("bob", forever), ("carol", killed))}
    served.wait(list(ids.values()), lambda j: j["state"] == "running", "running")
    return ids


def test_cancel_ends_every_process_of_the_job(served, long_jobs):
    job_id = long_jobs["bob"]
    pgid = int(served.service.store.job(job_id).handle)
    assert served.call("POST", f"/v1/jobs/{job_id}/cancel", "bob").json()["state"] == "cancelled"
    deadline = time.monotonic() + 60
    while LocalBackend.group_alive(str(pgid)) or str(pgid) in served.service.backend.handles():
        assert time.monotonic() < deadline, "the job's processes outlived its cancel, or its slot was not freed"
        time.sleep(0.1)
    assert served.call("POST", f"/v1/jobs/{job_id}/cancel", "bob").status_code == 409  # already ended


def test_a_worker_killed_with_sigkill_resumes_from_its_checkpoint_to_the_same_final_step(served, long_jobs):
    job_id = long_jobs["carol"]
    checkpoints = Path(served.job(job_id)["run_dir"]) / "checkpoints"
    deadline = time.monotonic() + WAIT_S
    while not list(checkpoints.glob("step-*.ckpt")):
        assert time.monotonic() < deadline and served.job(job_id)["state"] == "running"
        time.sleep(0.01)
    os.kill(int(served.service.store.job(job_id).handle), signal.SIGKILL)
    (job,) = served.wait([job_id], lambda j: j["state"] in ("succeeded", "failed"), "finished")
    assert job["state"] == "succeeded", job["error"]
    assert job["retries"] == 1 and len(job["attempts"]) == 2
    assert job["attempts"][0]["exit_code"] == -signal.SIGKILL
    assert job["attempts"][1]["resumed_from"].startswith("step-")
    assert _steps(job) == list(range(1, 101)) and job["progress"]["step"] == 100
    summary = json.loads((Path(job["run_dir"]) / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 100
    listed = served.call("GET", f"/v1/jobs/{job_id}/checkpoints", "carol").json()["data"]
    assert listed and listed[-1]["step"] == 100


def test_the_command_line_client_says_a_refusal_in_one_line_and_exits_2(served, tmp_path, monkeypatch, capsys):
    from bigtune.cli.app import main

    monkeypatch.setenv("BIGTUNE_SERVER", served.url)
    monkeypatch.setenv("BIGTUNE_TOKEN", served.tokens["alice"])
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(json.dumps(TINY))  # JSON is YAML
    assert main(["submit", str(recipe), "--set", "train.bogus_key=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("bigtune: error: 422") and "train.bogus_key" in err[0]
    assert main(["submit", str(recipe), "--hold"]) == 0
    job_id = capsys.readouterr().out.split()[0]
    assert main(["jobs"]) == 0 and job_id in capsys.readouterr().out
    assert main(["logs", job_id]) == 0 and "held" in capsys.readouterr().out
    assert main(["cancel", job_id]) == 0
    assert main(["cancel", job_id, "--token", "btk_wrong"]) == 2
    assert capsys.readouterr().err.strip() == "bigtune: error: 401: no valid bearer token"
