"""TensorBoard: event files in the run folder's tensorboard/ (`tensorboard --logdir runs`); a resumed run adds
its own beside them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from bigtune.engine.tracking.base import RunInfo, final_metrics, final_tags, memory_metrics


class TensorBoardTracker:
    def __init__(self, info: RunInfo):
        self.info = info
        self.dir = info.run_dir / "tensorboard"
        self.writer: Any = None

    def start(self, params: dict[str, Any], plan: Optional[dict]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run appends to the same folder; purge_step makes TensorBoard drop what the stopped attempt
        # logged after its last checkpoint, which this run logs again.
        resumed = self.info.resumed_at
        self.writer = SummaryWriter(str(self.dir), purge_step=None if resumed is None else resumed + 1)
        table = "\n".join(f"| {k} | {v} |" for k, v in params.items())
        self.writer.add_text("recipe", "| key | value |\n|---|---|\n" + table)
        if plan:
            self.writer.add_text("plan", "```\n" + json.dumps(plan, indent=2, default=str) + "\n```")

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():  # train/<name>: the tags bigtune wrote before tracking.backends existed
            self.writer.add_scalar(f"train/{k}", v, step)
        self.writer.flush()

    def log_memory(self, step: int, phase: str, categories: dict[str, int]) -> None:
        for k, v in memory_metrics(phase, categories).items():
            self.writer.add_scalar(k, v, step)

    def finish(self, status: str, summary: dict, artifacts: list[Path]) -> None:
        if self.writer is None:
            return
        step = int(summary.get("steps") or 0)
        for k, v in final_metrics(summary).items():
            self.writer.add_scalar(k, v, step)
        self.writer.add_text("status", "\n\n".join(f"{k}: {v}" for k, v in final_tags(status, summary).items()), step)
        self.writer.close()
