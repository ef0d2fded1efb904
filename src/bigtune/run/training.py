"""A training run with the planner beside it: ``bigtune train`` and ``bigtune.train``.

The engine (``bigtune.engine``) trains and measures; this layer adds what needs the planner, which
itself runs the engine's step: the plan printed before step 0, the advice and the variants predicted to
fit after an out-of-memory, and the plan vs measured table at the end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from bigtune.core.stepmath import GIB, human_bytes
from bigtune.engine.loop import notice
from bigtune.engine.loop import train as train_engine
from bigtune.recipe import Recipe
from bigtune.run.advice import oom_advice
from bigtune.run.compare import alternatives_for_device, compare_with_plan, format_comparison, predict_for_device


class PlanHooks:
    """The engine's RunHooks, backed by the planner (rank 0 only). ``verbose``: the plan's whole table
    before step 0 rather than its verdict in one line."""

    def __init__(self, verbose: bool = False) -> None:
        self.prediction = None
        self.verbose = verbose

    def before_run(self, recipe: Recipe, device: torch.device, world: int) -> Optional[dict]:
        if recipe.memory.plan:
            self.prediction = predict_for_device(recipe, device, world, table=self.verbose)
            if self.prediction is not None and not self.verbose:
                print(plan_verdict(self.prediction), flush=True)
        return self.prediction.to_dict() if self.prediction is not None else None

    def on_oom(self, recipe: Recipe, device: torch.device, cap_bytes: Optional[int], oom: dict) -> None:
        oom["advice"] = oom_advice(recipe, oom)
        for a in oom["advice"]:
            notice(f"  try: {a}")
        fitting = alternatives_for_device(recipe, device, cap_bytes) if recipe.memory.oom_alternatives else []
        if fitting:
            oom["alternatives"] = fitting
            notice("  variants the planner predicts to fit, fastest first:")
            for line in fitting[:5]:
                notice(f"    {line}")

    def after_run(self, recipe: Recipe, device: torch.device, world: int, snaps: list[dict], summary: dict) -> None:
        if self.prediction is not None:
            summary["plan"] = compare_with_plan(self.prediction, recipe, device, snaps, world)
            print(format_comparison(summary["plan"]), flush=True)


def plan_verdict(p) -> str:
    """The plan before step 0 in one line: the predicted peak, and against the device's memory when it has a
    known size (``bigtune plan`` and --verbose show the phase table)."""
    line = f"plan ({p.target}): predicted peak {human_bytes(p.peak_allocated)} allocated per device"
    if p.capacity is not None:
        need = p.needed_total or p.peak_total
        verdict = "FITS" if p.fits else "OOM"
        line += f"; {verdict}: needs {need / GIB:.2f} of {p.capacity / GIB:.2f} GiB ({100 * need / p.capacity:.0f}%)"
    return line


def train(
    recipe: Recipe | dict | str | Path | None = None,
    overrides: list[str] | dict | None = None,
    resume: str | Path | None = None,
    raise_on_oom: bool = False,
    quiet_recipe: bool = False,
    reuse_dir: bool = False,
    verbosity: str = "normal",
) -> dict:
    """Train one recipe; return the summary dict (also in <run>/summary.json).

    ``recipe`` is a Recipe, a dict, a YAML path or None (the built-in demo). ``resume`` is a run
    directory or checkpoint: with no recipe, the run continues with its own recipe.yaml (overrides on
    top); a recipe that does not match the checkpoint is a RecipeError. Bad input raises (RecipeError,
    DataError, ModelError) before anything is written; an out-of-memory returns a summary with status
    "oom", its phase, advice and the variants the planner predicts to fit (or raises TrainingOOM).
    ``verbosity``: "quiet", "normal" or "verbose" (the whole recipe and the plan's table), as
    ``bigtune train --quiet / --verbose``.
    """
    hooks = PlanHooks(verbose=verbosity == "verbose")
    return train_engine(
        recipe, overrides, resume, raise_on_oom, quiet_recipe, reuse_dir, hooks=hooks, verbosity=verbosity
    )
