"""Experiment tracking (tracking.backends, `bigtune train --track`): a run logged to a real MLflow server, to W&B
(offline) and to TensorBoard, read back with each tool's own reader; a tracking server that is down or dies
mid-run costs one warning and nothing else; a 2-rank run is one tracked run; a sweep is a parent run with a
child per rung.

Runs are the tiny recipe in-process (2 steps); the session's MLflow server (conftest.py, a subprocess) serves the
whole module and is asked for first, so it boots while the tests that do not need it train.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pytest
import yaml

from conftest import read_jsonl, run_cli, set_args, tiny_overrides

mlflow = pytest.importorskip("mlflow", reason="pip install -e '.[test]' (or 'bigtune[mlflow]')")

import bigtune  # noqa: E402
from bigtune.engine.tracking import MLFLOW_PARENT_ENV, SWEEP_ENV  # noqa: E402
from bigtune.engine.tracking.mlflow_backend import end_parent_run, start_parent_run  # noqa: E402

QUICK = {"train.max_steps": 2, "memory.plan": False}
WARNING = "bigtune: warning: tracking to mlflow"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", autouse=True)
def server(mlflow_server):
    """The session's MLflow server (conftest.py), asked for first: it boots while the tests that need none train."""
    return mlflow_server


def _client(url: str):
    return mlflow.MlflowClient(tracking_uri=url)


def _runs(url: str, experiment: str) -> list:
    c = _client(url)
    exp = c.get_experiment_by_name(experiment)
    return c.search_runs([exp.experiment_id]) if exp else []


def _train(run_dir: Path, **over):
    return bigtune.train({}, tiny_overrides(run_dir, **{**QUICK, **over}))


# -- no server needed: these run while it boots --------------------------------------------------------------


def test_wandb_offline_and_tensorboard_files_hold_the_run(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # everything W&B writes (the run, its artifact staging and cache, its settings) under tmp_path
    for var, sub in (("WANDB_DIR", "wb"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "wb").mkdir()
    s = _train(
        tmp_path / "run",
        **{"tracking.backends": ["wandb", "tensorboard"], "tracking.wandb_mode": "offline", "tracking.experiment": "t"},
    )
    assert s["status"] == "ok"
    losses = [m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2]
    assert [e.value for e in loss] == pytest.approx(losses)
    grads = events.Scalars("memory/after_backward/gradients_gib")
    assert [e.step for e in grads] == [0, 1] and grads[0].value > 0
    assert events.Scalars("summary/final_loss")[0].value == pytest.approx(losses[-1])

    (offline,) = (tmp_path / "wb" / "wandb").glob("offline-run-*")
    (record,) = offline.glob("run-*.wandb")  # what `wandb sync` uploads later
    blob = _wandb_record(record, b"train/loss", b"memory/after_backward/gradients_gib", b"run-files")
    assert b"train/loss" in blob and b"memory/after_backward/gradients_gib" in blob and b"run-files" in blob


def _wandb_record(record: Path, *wanted: bytes) -> bytes:
    """The offline record's bytes once they hold ``wanted``, or as they are after 60 s: W&B's service process
    writes it, and now and then has not flushed it when ``finish()`` returns."""
    deadline = time.monotonic() + 60
    while True:
        blob = record.read_bytes()
        if all(w in blob for w in wanted) or time.monotonic() > deadline:
            return blob
        time.sleep(0.2)


def test_a_resumed_run_continues_its_wandb_run_and_tensorboard_log(tmp_path, tmp_path_factory, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for var, sub in (("WANDB_DIR", "wb"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "wb").mkdir()
    run = tmp_path / "run"
    track = {
        "tracking.backends": ["wandb", "tensorboard"],
        "tracking.wandb_mode": "offline",
        "checkpoint.enabled": True,
    }
    assert _train(run, **track)["steps"] == 2
    wandb_id = json.loads((run / "tracking.json").read_text())["wandb"]["id"]
    assert bigtune.train(None, {"train.max_steps": 4}, resume=run)["steps"] == 4
    assert json.loads((run / "tracking.json").read_text())["wandb"]["id"] == wandb_id
    # offline, the parts are kept for `wandb sync` under the one run's id (a folder each, or one when both
    # started in the same second; W&B keeps its settings for the process: the folder may be an earlier test's
    # WANDB_DIR)
    parts = list(tmp_path_factory.getbasetemp().rglob(f"offline-run-*-{wandb_id}/run-{wandb_id}.wandb"))
    assert parts and b"train/loss" in _wandb_record(max(parts, key=lambda p: p.stat().st_mtime), b"train/loss")

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    losses = [m["loss"] for m in read_jsonl(run / "metrics.jsonl")]
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(losses)
    assert [e.step for e in events.Scalars("memory/after_backward/gradients_gib")] == [0, 1, 2, 3]


def test_tracking_backends_are_checked_by_name():
    with pytest.raises(bigtune.RecipeError) as e:
        bigtune.load_recipe(None, {"tracking.backends": ["mlfow"]})
    assert "tracking.backends: 'mlfow' is not allowed; use any of mlflow, wandb, tensorboard" in str(e.value)
    assert "did you mean 'mlflow'" in str(e.value)


def test_a_closed_port_costs_one_warning_and_no_records(tmp_path, capsys):
    t0 = time.monotonic()
    s = _train(
        tmp_path / "run", **{"tracking.backends": ["mlflow"], "tracking.mlflow_uri": f"http://127.0.0.1:{_free_port()}"}
    )
    assert s["status"] == "ok" and s["steps"] == 2
    assert time.monotonic() - t0 < 60  # no retry loop: MLflow's client gives up at once (MLFLOW_HTTP_* defaults)
    err = capsys.readouterr().err
    assert err.count(WARNING) == 1, err
    assert "is off for the rest of this run" in err and "127.0.0.1" in err
    assert len(read_jsonl(tmp_path / "run" / "metrics.jsonl")) == 2
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "ok"


# -- against the server ----------------------------------------------------------------------------------------


def test_mlflow_run_holds_recipe_plan_steps_memory_and_files(tmp_path, server):
    url = server.url
    s = _train(
        tmp_path / "run",
        **{
            "tracking.backends": ["mlflow"],
            "tracking.mlflow_uri": url,
            "tracking.experiment": "e2e",
            "tracking.register_model": "tiny-demo",
            "checkpoint.save_model": True,
            "memory.plan": True,
            "optim.grad_clip": 1.0,
        },
    )
    assert s["status"] == "ok"
    (run,) = _runs(url, "e2e")
    c, rid = _client(url), run.info.run_id
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    p = run.data.params
    assert p["model.name"] == "tiny-llama" and p["train.max_steps"] == "2" and p["run.world_size"] == "1"
    assert p["plan.target"] == "cpu" and float(p["plan.peak_allocated_gib"]) > 0
    losses = [m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    history = c.get_metric_history(rid, "loss")
    assert [m.step for m in history] == [1, 2] and [m.value for m in history] == pytest.approx(losses)
    assert [m.step for m in c.get_metric_history(rid, "tokens_per_s")] == [1, 2]
    norms = [m["grad_norm"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert all(n > 0 for n in norms)  # the norm before clipping, one per logged step
    assert [m.value for m in c.get_metric_history(rid, "grad_norm")] == pytest.approx(norms)
    snaps = {(x["step"], x["phase"]): x for x in read_jsonl(tmp_path / "run" / "memory.jsonl")}
    acts = c.get_metric_history(rid, "memory/after_forward/activations_gib")
    assert [m.step for m in acts] == [0, 1]
    assert [m.value for m in acts] == pytest.approx(
        [snaps[(i, "after_forward")]["activations"] / 2**30 for i in (0, 1)]
    )
    m = run.data.metrics
    cmp = s["plan"]
    assert m["plan_vs_measured/peak_error_pct"] == pytest.approx(cmp["peak_error_pct"])
    assert m["plan_vs_measured/measured_peak_allocated_gib"] == pytest.approx(cmp["measured_peak_allocated"] / 2**30)
    assert run.data.tags["bigtune.status"] == "ok"
    assert run.data.tags["bigtune.device_type"] == "cpu" and run.data.tags["bigtune.strategy"] == "single"
    names = {a.path for a in c.list_artifacts(rid)}
    assert {"summary.json", "metrics.csv", "memory.jsonl", "recipe.yaml", "plan.json", "model"} <= names
    assert "model/model.safetensors" in {a.path for a in c.list_artifacts(rid, "model")}
    (version,) = c.search_model_versions("name='tiny-demo'")
    assert version.run_id == rid


def test_a_resumed_run_logs_into_the_same_mlflow_run(tmp_path, server):
    url = server.url
    run = tmp_path / "run"
    track = {"tracking.backends": ["mlflow"], "tracking.mlflow_uri": url, "tracking.experiment": "resume"}
    s = _train(run, **track, **{"checkpoint.enabled": True})  # stops at train.max_steps=2 with a checkpoint
    assert s["status"] == "ok" and s["steps"] == 2
    saved = json.loads((run / "tracking.json").read_text())["mlflow"]
    s = bigtune.train(None, {"train.max_steps": 4}, resume=run)  # two more steps
    assert s["status"] == "ok" and s["steps"] == 4

    (tracked,) = _runs(url, "resume")
    rid = tracked.info.run_id
    assert rid == saved["run_id"] and tracked.info.status == "FINISHED"
    c = _client(url)
    losses = [m["loss"] for m in read_jsonl(run / "metrics.jsonl")]
    history = c.get_metric_history(rid, "loss")
    assert [m.step for m in history] == [1, 2, 3, 4]  # both parts, no step twice
    assert [m.value for m in history] == pytest.approx(losses)
    assert [m.step for m in c.get_metric_history(rid, "memory/after_forward/activations_gib")] == [0, 1, 2, 3]
    assert tracked.data.metrics["summary/steps"] == 4
    # MLflow keeps a parameter's first value; the resume says what it changed
    assert tracked.data.params["train.max_steps"] == "2"
    assert "train.max_steps: 2 -> 4" in tracked.data.tags["bigtune.resumed_at_step_2"]


def test_an_oom_is_logged_with_its_status_and_advice(tmp_path, server):
    url = server.url
    s = _train(
        tmp_path / "run",
        **{"tracking.backends": ["mlflow"], "tracking.mlflow_uri": url, "tracking.experiment": "oom"},
        **{"memory.cap_gib": 0.004, "memory.oom_alternatives": False},
    )
    assert s["status"] == "oom" and s["oom"]["advice"]
    (run,) = _runs(url, "oom")
    assert run.info.status == "FAILED" and run.data.tags["bigtune.status"] == "oom"
    assert run.data.tags["bigtune.oom_advice"].splitlines()[0] == s["oom"]["advice"][0]


def test_a_sweep_is_one_parent_run_with_a_child_per_rung(tmp_path, server, monkeypatch):
    # The sweep runs each rung in a process of its own (~10 s each here); the rungs run in-process instead, as
    # `bigtune train` with the environment the sweep gives its children: the rest is the sweep's own code.
    from bigtune.cli.app import main
    from bigtune.sweep import ladder

    url = server.url

    def in_process(run, idx, v, args, limit, live_log):
        live_log.write_text("in-process rung\n")
        with monkeypatch.context() as m:
            for k in (SWEEP_ENV, MLFLOW_PARENT_ENV):
                m.setenv(k, run.env[k])
            return main(args[3:]), None  # args: python -m bigtune train ...

    monkeypatch.setattr(ladder, "_run_child", in_process)
    base = {k: v for k, v in tiny_overrides(tmp_path / "unused", **QUICK).items() if k != "output_dir"}
    base.update({"tracking.mlflow_uri": url, "tracking.experiment": "ladder"})
    sweep = {
        "name": "lr-ladder",
        "base": {"name": "lr-ladder"},
        "common": base,
        "variants": [
            {"name": "lr-small", "overrides": {"optim.lr": 1e-4}},
            {"name": "lr-big", "overrides": {"optim.lr": 1e-3}},
        ],
    }
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    out = tmp_path / "out"
    assert main(["sweep", str(tmp_path / "sweep.yaml"), "--track", "mlflow", "--out", str(out), "--no-report"]) == 0
    assert [json.loads(p.read_text())["status"] for p in sorted(out.glob("*/summary.json"))] == ["ok", "ok"]
    runs = _runs(url, "ladder")
    (parent,) = [r for r in runs if r.info.run_name == "lr-ladder"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.info.run_name for r in children) == ["lr-big", "lr-small"]
    assert {r.data.params["optim.lr"] for r in children} == {"0.0001", "0.001"}
    assert all(r.data.tags["bigtune.sweep"] == "lr-ladder" for r in children)
    assert parent.info.status == "FINISHED" and parent.data.metrics["rungs_ok"] == 2
    assert len(runs) == 3


def test_parent_run_helpers_warn_and_carry_on_without_a_server(capsys):
    uri = f"http://127.0.0.1:{_free_port()}"
    assert start_parent_run(uri, "x", "ladder", {}) is None
    end_parent_run(uri, "no-such-run", [], True)  # must not raise either
    err = capsys.readouterr().err
    assert err.count(WARNING) == 2 and "the sweep runs untracked" in err


@pytest.mark.slow  # two rank processes: ~22 s of the file's ~55 s on 2 cores
def test_two_ranks_log_one_run(tmp_path, server):
    url = server.url
    over = tiny_overrides(tmp_path / "ddp", **QUICK, devices=2, strategy="ddp")
    over.update({"tracking.mlflow_uri": url, "tracking.experiment": "ddp", "train.micro_batch_size": 2})
    res = run_cli("train", "--track", "mlflow", *set_args(over), cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (run,) = _runs(url, "ddp")  # rank 1 tracks nothing
    assert run.data.params["run.world_size"] == "2" and run.data.tags["bigtune.strategy"] == "ddp"
    assert [m.step for m in _client(url).get_metric_history(run.info.run_id, "loss")] == [1, 2]


def test_a_server_that_dies_mid_run_costs_one_warning(tmp_path, server, capsys, monkeypatch):
    # Last: it stops the module's server (a test after it would start a new one).
    from bigtune.engine.tracking import base

    url = server.url
    calls = []
    real = base.Trackers.log_step

    def log_then_kill(self, step, metrics):
        real(self, step, metrics)
        calls.append(step)
        if len(calls) == 1:  # after the first logged step
            time.sleep(1.0)  # let the worker send it
            server.stop()

    monkeypatch.setattr(base.Trackers, "log_step", log_then_kill)
    s = _train(tmp_path / "run", **{"tracking.backends": ["mlflow"], "tracking.mlflow_uri": url, "train.max_steps": 3})
    assert s["status"] == "ok" and s["steps"] == 3
    err = capsys.readouterr().err
    assert err.count(WARNING) == 1, err
    assert f"127.0.0.1:{server.port}" in err and "metrics.jsonl" in err
    run = tmp_path / "run"
    assert len(read_jsonl(run / "metrics.jsonl")) == 3
    assert {"summary.json", "metrics.csv", "memory.jsonl", "recipe.yaml"} <= {p.name for p in run.iterdir()}
