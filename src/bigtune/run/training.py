"""A training run with the planner beside it: ``bigtune train`` and ``bigtune.train``.

The engine (``bigtune.engine``) trains and measures; this layer adds what needs the planner, which
itself runs the engine's step: the plan printed before step 0, the advice and the variants predicted to
fit after an out-of-memory, and the plan vs measured table at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from bigtune.engine.loop import train as train_engine
from bigtune.recipe import Recipe
from bigtune.run.advice import oom_advice
from bigtune.run.compare import alternatives_for_device, compare_with_plan, format_comparison, predict_for_device


class PlanHooks:
    """The engine's RunHooks, backed by the planner (rank 0 only)."""

    def __init__(self) -> None:
        self.prediction = None

    def before_run(self, recipe: Recipe, device: torch.device, world: int) -> None:
        if recipe.memory.plan:
            self.prediction = predict_for_device(recipe, device, world)

    def on_oom(self, recipe: Recipe, device: torch.device, cap_bytes: Optional[int], oom: dict) -> None:
        oom["advice"] = oom_advice(recipe, oom)
        for a in oom["advice"]:
            print(f"  try: {a}", flush=True)
        fitting = alternatives_for_device(recipe, device, cap_bytes) if recipe.memory.oom_alternatives else []
        if fitting:
            oom["alternatives"] = fitting
            print("  variants the planner predicts to fit, fastest first:", flush=True)
            for line in fitting[:5]:
                print(f"    {line}", flush=True)

    def after_run(self, recipe: Recipe, device: torch.device, world: int, snaps: list[dict], summary: dict) -> None:
        if self.prediction is not None:
            summary["plan"] = compare_with_plan(self.prediction, recipe, device, snaps, world)
            print(format_comparison(summary["plan"]), flush=True)


def train(
    recipe: Recipe | dict | str | Path | None = None,
    overrides: list[str] | dict | None = None,
    resume: str | Path | None = None,
    raise_on_oom: bool = False,
    quiet_recipe: bool = False,
    reuse_dir: bool = False,
) -> dict:
    """Train one recipe; return the summary dict (also in <run>/summary.json).

    ``recipe`` is a Recipe, a dict, a YAML path or None (the built-in demo). ``resume`` is a run
    directory or checkpoint: with no recipe, the run continues with its own recipe.yaml (overrides on
    top); a recipe that does not match the checkpoint is a RecipeError. Bad input raises (RecipeError,
    DataError, ModelError) before anything is written; an out-of-memory returns a summary with status
    "oom", its phase, advice and the variants the planner predicts to fit (or raises TrainingOOM).
    """
    return train_engine(recipe, overrides, resume, raise_on_oom, quiet_recipe, reuse_dir, hooks=PlanHooks())
