"""What one run holds while it trains: the built pieces (model, optimizer, data) and the loop's counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from bigtune.data.text import DataReport, EpochSampler
from bigtune.recipe import Recipe


@dataclass
class Built:
    recipe: Recipe
    fabric: Any
    tokenizer: Any
    model: Any
    optimizer: Any
    scheduler: Any
    loader: Any
    sampler: EpochSampler
    data_report: DataReport
    steps_per_epoch: int
    total_steps: int
    micro_batches_per_epoch: int
    params: dict = field(default_factory=dict)
    base_dir: Optional[Path] = None  # initial weights of a preset/random model under adapters
    val_loader: Any = None  # the held-out split, when there is one
    class_weights: Optional[torch.Tensor] = None  # sequence-classification: per-class loss weights
    pipeline: Any = None  # pipeline_parallel > 1: this rank's stage and schedule (engine/pipeline.py)


@dataclass
class LoopState:
    step: int = 0  # optimizer steps done
    tokens: int = 0  # non-padding tokens trained on
    samples: int = 0
    train_seconds: float = 0.0
    phase: str = "setup"
    losses: list = field(default_factory=list)
    # The current epoch's loss: every step's, summed (a device tensor inside the loop, read once at the epoch's
    # end) and counted; not only the logged windows', which may not line up with epochs. Checkpointed as
    # the mean over ranks, so that a resumed epoch still averages over all of its steps.
    epoch_loss_sum: Any = 0.0
    epoch_loss_steps: int = 0
    epoch_losses: list = field(default_factory=list)  # {"epoch", "loss", "steps"} of each epoch finished
    best_val_loss: Optional[float] = None
    best_score: Optional[float] = None  # eval.best_metric's best value so far (what keep_best goes by)
    last_eval_step: Optional[int] = None
    aux_loss: Optional[torch.Tensor] = None  # MoE: the last window's router aux loss (not checkpointed)
    # The last step's total gradient norm before clipping (a device tensor; None unless optim.grad_clip is set
    # and the engine clips: DeepSpeed clips inside its own step). Logged as grad_norm, not checkpointed.
    grad_norm: Optional[torch.Tensor] = None


def epoch_loss_mean(fabric, state: LoopState) -> float:
    """The mean loss of the current epoch's steps so far, averaged over ranks as the logged loss is."""
    mean = float(state.epoch_loss_sum) / max(1, state.epoch_loss_steps)
    if fabric.world_size > 1:
        from bigtune.engine.strategies import all_sum

        mean = all_sum(fabric, mean) / fabric.world_size
    return mean
