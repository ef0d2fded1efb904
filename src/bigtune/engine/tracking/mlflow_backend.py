"""MLflow: one run per training run (nested under its ladder's run in a sweep), through ``MlflowClient``.

The client, not MLflow's fluent API: the fluent API keeps an "active run" in process-global state, which a
library that may train several runs in one process (tests, notebooks, the Python API) should not touch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Optional

from bigtune.engine.tracking.base import (
    MLFLOW_PARENT_ENV,
    RunInfo,
    final_metrics,
    final_tags,
    memory_metrics,
    warn,
)

# MLflow's HTTP client retries a failed request for minutes by default (7 retries, exponential backoff, 120 s
# timeout each). A run logs from a background thread and turns tracking off at the first failure, so it asks
# for one short try; a user's own setting of either variable wins.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}

# MLflow's status for each way a bigtune run ends
RUN_STATUS = {"ok": "FINISHED", "preempted": "KILLED", "interrupted": "KILLED"}

PARAM_VALUE_CHARS = 6000  # MLflow 3's limit on a parameter's value
BATCH = 100  # MLflow's limit on parameters per log_batch call


def tracking_uri(configured: Optional[str]) -> Optional[str]:
    """tracking.mlflow_uri, else MLFLOW_TRACKING_URI, else None (MLflow's own default, which `mlflow ui` run in
    the same folder shows)."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or None


def describe_uri(uri: Optional[str]) -> str:
    if uri:
        return uri
    try:
        from mlflow.tracking._tracking_service.utils import _get_default_tracking_uri

        return f"{_get_default_tracking_uri()} (MLflow's default)"
    except Exception:  # noqa: BLE001 - only words for a message
        return "MLflow's default tracking URI"


def client(uri: Optional[str]):
    for k, v in HTTP_DEFAULTS.items():
        os.environ.setdefault(k, v)
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def experiment_id(c, name: str) -> str:
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return c.create_experiment(name)
    except Exception:  # another process (a rung, a colleague) created it first
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


class MlflowTracker:
    def __init__(self, uri: Optional[str], experiment: str, register_model: Optional[str], info: RunInfo):
        self.uri, self.experiment, self.register_model, self.info = uri, experiment, register_model, info
        self.client: Any = None
        self.run_id: Optional[str] = None
        self.experiment_id: Optional[str] = None  # the MLflow UI's address of the run names it

    def start(self, params: dict[str, Any], plan: Optional[dict]) -> None:
        from mlflow.entities import Param

        self.client = client(self.uri)
        tags = {**self.info.tags}
        if self.info.group:
            tags["bigtune.sweep"] = self.info.group
        parent = os.environ.get(MLFLOW_PARENT_ENV)
        if parent:
            tags["mlflow.parentRunId"] = parent  # the MLflow UI shows this run under its ladder's run
        values = {k: "None" if v is None else str(v)[:PARAM_VALUE_CHARS] for k, v in params.items()}
        self.run_id, logged = self._reopen(values)
        resumed = self.run_id is not None
        if not resumed:
            run = self.client.create_run(
                experiment_id(self.client, self.experiment), run_name=self.info.name, tags=tags
            )
            self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
        self.info.record_run("mlflow", {"run_id": self.run_id, "tracking_uri": self.uri, "experiment": self.experiment,
                                        "experiment_id": self.experiment_id})  # fmt: skip
        items = [Param(k, v) for k, v in values.items() if k not in logged]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + BATCH], synchronous=True)
        if plan:
            self.client.log_dict(self.run_id, plan, "plan.json")
        how = "continues run" if resumed else "run"
        print(f"tracking: mlflow {how} {self.info.name} ({self.run_id}), experiment {self.experiment!r}", flush=True)

    def _reopen(self, values: dict[str, str]) -> tuple[Optional[str], dict[str, str]]:
        """A resumed run's MLflow run, marked running again, and the parameters it already has: (run id, params),
        or (None, {}) for a new run (a fresh run, another server or experiment, a run deleted meanwhile).

        The client's update_run does what ``mlflow.start_run(run_id=...)`` does, without the fluent API's
        process-global active run. MLflow keeps a parameter's first value: one the resumed recipe changes
        (train.max_steps, to run longer) is noted in a tag instead."""
        saved = self.info.saved_run("mlflow")
        if not saved or not saved.get("run_id"):
            return None, {}
        if (saved.get("tracking_uri"), saved.get("experiment")) != (self.uri, self.experiment):
            print(
                f"tracking: mlflow: the run was logged to {saved.get('tracking_uri') or 'the default URI'}, experiment "
                f"{saved.get('experiment')!r}; this part starts a new run where the recipe now points",
                flush=True,
            )
            return None, {}
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(saved["run_id"])
        except MlflowException:
            run = None
        if run is None or run.info.lifecycle_stage != "active":
            print(f"tracking: mlflow run {saved['run_id']} is gone from the server; starting a new run", flush=True)
            return None, {}
        self.client.update_run(run.info.run_id, status="RUNNING")
        self.experiment_id = run.info.experiment_id
        logged = dict(run.data.params)
        changed = [f"{k}: {logged[k]} -> {v}" for k, v in values.items() if k in logged and logged[k] != v]
        if changed:
            self.client.set_tag(run.info.run_id, f"bigtune.resumed_at_step_{self.info.resumed_at}", "; ".join(changed))
        return run.info.run_id, logged

    def _metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in values.items()]
        for i in range(0, len(batch), 1000):  # MLflow's limit on metrics per call
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000], synchronous=True)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        self._metrics(step, metrics)

    def log_memory(self, step: int, phase: str, categories: dict[str, int]) -> None:
        self._metrics(step, memory_metrics(phase, categories))

    def finish(self, status: str, summary: dict, artifacts: list[Path]) -> None:
        if self.run_id is None:
            return
        end = final_metrics(summary)
        if end:
            self._metrics(int(summary.get("steps") or 0), end)
        for k, v in final_tags(status, summary).items():
            self.client.set_tag(self.run_id, k, v)
        for path in artifacts:
            if path.is_dir():
                self.client.log_artifacts(self.run_id, str(path), artifact_path=path.name)
            elif path.is_file():
                self.client.log_artifact(self.run_id, str(path))
        model = next((p for p in artifacts if p.is_dir() and p.name in ("model", "adapter")), None)
        if self.register_model and status == "ok" and model is not None:
            self._register(model.name)
        self.client.set_terminated(self.run_id, status=RUN_STATUS.get(status, "FAILED"))

    def _register(self, folder: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(self.register_model)
        except MlflowException as e:
            if "ALREADY_EXISTS" not in str(e.error_code):
                raise
        source = f"{self.client.get_run(self.run_id).info.artifact_uri}/{folder}"
        version = self.client.create_model_version(self.register_model, source, run_id=self.run_id)
        print(f"tracking: registered {self.register_model!r} version {version.version} from {folder}/", flush=True)


def start_parent_run(uri: Optional[str], experiment: str, name: str, params: dict[str, Any]) -> Optional[str]:
    """A sweep's own MLflow run, which each rung's run nests under; its id (None, after a warning, when MLflow
    cannot be reached: the rungs then log on their own)."""
    try:
        c = client(uri)
        run = c.create_run(experiment_id(c, experiment), run_name=name, tags={"bigtune.sweep": name})
        c.log_dict(run.info.run_id, params, "sweep.json")
        return run.info.run_id
    except Exception as e:  # noqa: BLE001 - tracking must never stop a sweep
        warn(f"tracking to mlflow ({describe_uri(uri)}) failed: {type(e).__name__}: {e}; the sweep runs untracked")
        return None


def end_parent_run(uri: Optional[str], run_id: str, rows: list[dict], ok: bool) -> None:
    """Close a sweep's run: its rows as an artifact, each rung's status counted."""
    try:
        c = client(uri)
        statuses: dict[str, int] = {}
        for r in rows:
            statuses[r.get("status", "?")] = statuses.get(r.get("status", "?"), 0) + 1
        c.log_text(run_id, json.dumps(rows, indent=2, default=str), "rows.json")
        for s, n in statuses.items():
            c.log_metric(run_id, f"rungs_{s}", n)
        c.set_terminated(run_id, status="FINISHED" if ok else "KILLED")
    except Exception as e:  # noqa: BLE001
        warn(f"tracking to mlflow ({describe_uri(uri)}) failed closing the sweep's run: {type(e).__name__}: {e}")
