"""Experiment tracking: the run logged to MLflow, Weights & Biases and TensorBoard through one interface.

The engine calls one ``Trackers`` (``open_trackers``) at the points it already reports: the run's start (the
recipe and the plan), each logged step, each memory snapshot, and the end (status, summary, files). Each backend
(``tracking.backends``) is an optional extra, imported only when a run asks for it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from bigtune.engine.tracking.base import (
    MLFLOW_PARENT_ENV,
    RUNS_FILE,
    SERVE_JOB_ENV,
    SWEEP_ENV,
    Guarded,
    RunInfo,
    Tracker,
    Trackers,
    flatten,
)
from bigtune.recipe import TRACKING_BACKENDS, RecipeError, TrackingConfig

__all__ = [
    "MLFLOW_PARENT_ENV",
    "RUNS_FILE",
    "SERVE_JOB_ENV",
    "SWEEP_ENV",
    "RunInfo",
    "Tracker",
    "Trackers",
    "flatten",
    "open_trackers",
    "run_artifacts",
]

DEFAULT_EXPERIMENT = "bigtune"

# The run folder's reports uploaded at the end (those that exist), then the trained model's folder.
REPORTS = ("summary.json", "metrics.csv", "metrics.jsonl", "memory.jsonl", "eval.jsonl", "recipe.yaml")


def require(name: str) -> None:
    """Raise RecipeError naming the extra to install when backend ``name``'s package is missing."""
    if name not in TRACKING_BACKENDS:
        raise RecipeError([f"tracking.backends: {name!r} is not allowed; use any of {', '.join(TRACKING_BACKENDS)}"])
    if importlib.util.find_spec(name) is None:
        raise RecipeError(
            [
                f"tracking.backends: {name} is not installed: pip install 'bigtune[{name}]' (or pip install {name}), "
                f"or leave {name} out of tracking.backends"
            ]
        )


def open_trackers(cfg: TrackingConfig, info: RunInfo) -> Trackers:
    """The trackers ``cfg.backends`` names, each behind its guard (none: a Trackers whose calls do nothing).
    Nothing is contacted here: each backend connects from its own thread when the run starts."""
    guarded = []
    for name in dict.fromkeys(cfg.backends):
        require(name)
        if name == "mlflow":
            from bigtune.engine.tracking.mlflow_backend import MlflowTracker, describe_uri, tracking_uri

            uri = tracking_uri(cfg.mlflow_uri)
            backend = MlflowTracker(uri, cfg.experiment or DEFAULT_EXPERIMENT, cfg.register_model, info)
            where = describe_uri(uri)
        elif name == "wandb":
            from bigtune.engine.tracking.wandb_backend import WandbTracker

            project = cfg.wandb_project or cfg.experiment or DEFAULT_EXPERIMENT
            backend = WandbTracker(project, cfg.wandb_mode, cfg.log_model, info)
            where = f"project {project}" + (f", {cfg.wandb_mode}" if cfg.wandb_mode else "")
        else:
            from bigtune.engine.tracking.tensorboard_backend import TensorBoardTracker

            backend = TensorBoardTracker(info)
            where = str(backend.dir)
        guarded.append(Guarded(name, backend, where, info.run_dir))
    return Trackers(guarded, cfg.finish_timeout_s)


def run_artifacts(run_dir: Path, model_dir: Path | None) -> list[Path]:
    """What a finished run uploads: its reports, then ``model_dir`` (the model or adapter folder) if given."""
    files = [run_dir / n for n in REPORTS if (run_dir / n).is_file()]
    return files + ([model_dir] if model_dir is not None and model_dir.is_dir() else [])
