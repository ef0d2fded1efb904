"""Weights & Biases: one W&B run per training run, grouped by ladder in a sweep; the run's files as artifacts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

from bigtune.engine.tracking.base import RunInfo, final_metrics, final_tags, memory_metrics


class WandbTracker:
    def __init__(self, project: str, mode: Optional[str], log_model: bool, info: RunInfo):
        self.project, self.mode, self.log_model, self.info = project, mode, log_model, info
        self.run: Any = None

    def start(self, params: dict[str, Any], plan: Optional[dict]) -> None:
        import wandb

        config = dict(params)
        if plan:
            config["plan"] = plan  # the whole prediction, kept with the run's config
        saved = self.info.saved_run("wandb") or {}
        resume_id = saved.get("id") if saved.get("project") == self.project else None
        self.run = wandb.init(
            # a resumed run continues its W&B run ("allow": a new one if W&B no longer has it)
            id=resume_id,
            resume="allow" if resume_id else None,
            project=self.project,
            name=self.info.name,
            group=self.info.group,
            job_type="train",
            mode=self.mode,
            config=config,
            tags=[f"{k}={v}"[:64] for k, v in self.info.tags.items() if k in ("bigtune.device", "bigtune.strategy")],
            # W&B would otherwise wrap this process's stdout and stderr to copy the console, which the engine
            # redirects itself (quiet ranks, --quiet); the run folder keeps the log that matters
            settings=wandb.Settings(console="off"),
            reinit="create_new",  # several runs in one process (the Python API) each get their own
        )
        self.info.record_run("wandb", {"id": self.run.id, "project": self.project})

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log({f"train/{k}": v for k, v in metrics.items()}, step=step)

    def log_memory(self, step: int, phase: str, categories: dict[str, int]) -> None:
        self.run.log(memory_metrics(phase, categories), step=step)

    def finish(self, status: str, summary: dict, artifacts: list[Path]) -> None:
        if self.run is None:
            return
        import wandb

        self.run.summary.update({**final_metrics(summary), **final_tags(status, summary)})
        safe = re.sub(r"[^A-Za-z0-9._-]", "-", self.info.name)
        files = wandb.Artifact(f"{safe}-run", type="run-files", description="bigtune run folder reports")
        for path in artifacts:
            if path.is_file():
                files.add_file(str(path))
            elif path.is_dir() and path.name not in ("model", "adapter"):
                files.add_dir(str(path), name=path.name)
        self.run.log_artifact(files)
        model = next((p for p in artifacts if p.is_dir() and p.name in ("model", "adapter")), None)
        if model is not None and self.log_model:
            art = wandb.Artifact(f"{safe}-{model.name}", type="model")
            art.add_dir(str(model))
            self.run.log_artifact(art)
        self.run.finish(exit_code=0 if status == "ok" else 1)
