"""The training service with an MLflow tracking server beside it (bigtune serve --mlflow-uri): each job is an MLflow
run, named by the job and linked from its view. One service on 127.0.0.1 (1 slot) and one tiny job of 2 steps are
shared by the tests; the MLflow server is the session's (conftest.py, SQLite store)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from bigtune.serve.service import ServeConfig, Service
from bigtune.serve.store import TERMINAL, Job
from conftest import read_jsonl
from test_serve import TINY, Served

TWO_STEPS = {**TINY, "name": "tiny-web", "train": {**TINY["train"], "max_steps": 2}}


@pytest.fixture(scope="module")
def tracked(tmp_path_factory, mlflow_server):
    root = tmp_path_factory.mktemp("serve-web")
    cfg = ServeConfig(state_dir=root / "state", slots=1, workdir=root, allowed_roots=(root,), tick_s=0.2,
                      mlflow_uri=mlflow_server.url, mlflow_experiment="serve-web")  # fmt: skip
    s = Served(cfg)
    try:
        yield s
    finally:
        service = s.server.service
        for job in service.store.jobs(states=("running",)):  # nothing of a failed test left running
            if job.handle:
                service.backend.release(job.handle)
        s.server.stop()


@pytest.fixture(scope="module")
def job_id(tracked) -> str:
    """alice's tiny job, submitted once for the module (the tests follow it while it runs, or wait for its end)."""
    res = tracked.submit("alice", recipe=TWO_STEPS)
    assert res.status_code == 201, res.text
    return res.json()["id"]


def _ended(job: dict) -> bool:
    return job["state"] in TERMINAL


def test_each_job_is_an_mlflow_run_named_by_the_job_and_linked_from_its_view(tracked, job_id, mlflow_server):
    import mlflow

    (job,) = tracked.wait([job_id], _ended, "finished")
    assert job["state"] == "succeeded", job["error"]
    url = tracked.cfg.mlflow_uri
    seen = job["mlflow"]
    assert seen and seen["tracking_uri"] == url and seen["experiment"] == "serve-web"
    c = mlflow.MlflowClient(tracking_uri=url)
    run = c.get_run(seen["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == job_id
    assert run.data.tags["bigtune.serve_job"] == job_id
    assert c.get_experiment(run.info.experiment_id).name == "serve-web"
    assert seen["experiment_id"] == run.info.experiment_id
    assert seen["url"] == f"{url}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}"
    losses = [m["loss"] for m in read_jsonl(Path(job["run_dir"]) / "metrics.jsonl")]
    history = c.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [1, 2] and [m.value for m in history] == pytest.approx(losses)
    with urllib.request.urlopen(seen["url"].split("#")[0], timeout=30) as page:  # the MLflow UI at that address
        assert page.status == 200
    # the list shows it too (the web page reads the list)
    listed = tracked.call("GET", "/v1/jobs", "alice").json()["data"]
    assert [j["mlflow"]["run_id"] for j in listed if j["id"] == job_id] == [run.info.run_id]


def _job(recipe: dict, overrides: list[str]) -> Job:
    import yaml

    return Job(id="job-x", recipe_yaml=yaml.safe_dump(recipe), overrides_json=json.dumps(overrides))


def test_the_tracking_overrides_keep_the_recipes_trackers_and_experiment(tmp_path):
    service = Service(ServeConfig(state_dir=tmp_path, mlflow_uri="http://mlflow.lab:5000", mlflow_experiment="team"))
    try:
        assert service._tracking_sets(_job(TINY, [])) == [
            'tracking.backends=["mlflow"]',
            'tracking.mlflow_uri="http://mlflow.lab:5000"',
            'tracking.experiment="team"',
        ]
        own = {**TINY, "tracking": {"backends": ["tensorboard"], "experiment": "mine"}}
        assert service._tracking_sets(_job(own, [])) == [
            'tracking.backends=["tensorboard", "mlflow"]',
            'tracking.mlflow_uri="http://mlflow.lab:5000"',
        ]
        assert service._tracking_sets(_job(TINY, ["tracking.backends=[mlflow, wandb]"]))[0] == (
            'tracking.backends=["mlflow", "wandb"]'
        )
    finally:
        service.store.close()
    untracked = Service(ServeConfig(state_dir=tmp_path / "b"))
    assert untracked._tracking_sets(_job(TINY, [])) == []
    untracked.store.close()


def test_a_views_mlflow_link_never_shows_the_servers_login(tmp_path):
    from bigtune.serve.progress import mlflow_run

    entry = {"run_id": "r1", "tracking_uri": "https://bob:secret@mlflow.lab:8443", "experiment_id": "7"}
    (tmp_path / "tracking.json").write_text(json.dumps({"mlflow": entry}))
    seen = mlflow_run(tmp_path)
    assert seen["url"] == "https://mlflow.lab:8443/#/experiments/7/runs/r1" and "secret" not in json.dumps(seen)
    (tmp_path / "tracking.json").write_text(json.dumps({"mlflow": {"run_id": "r2", "tracking_uri": "sqlite:///m.db"}}))
    assert mlflow_run(tmp_path)["url"] is None  # no server, no page
    assert mlflow_run(tmp_path / "nowhere") is None
