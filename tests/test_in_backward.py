"""optim.in_backward: each weight is stepped from its own backward hook, and its gradient freed at once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bigtune.core.gpus import find_gpu
from bigtune.plan.base.target import Target
from bigtune.plan.planner import plan
from bigtune.plan.search.alternatives import alternatives
from bigtune.recipe import RecipeError, load_recipe
from bigtune.run.training import train
from conftest import read_jsonl, tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
COMMON = {"optim.lr": 1e-2, "train.max_steps": 4, "memory.plan": False}


def _losses(run: Path) -> list[float]:
    return [m["loss"] for m in read_jsonl(run / "metrics.jsonl")]


def _steady(run: Path) -> dict:
    snaps = read_jsonl(run / "memory.jsonl")
    last = max(s["step"] for s in snaps)
    return {s["phase"]: s for s in snaps if s["step"] == last}


@pytest.mark.parametrize(
    "extra",
    [
        {"optim.name": "adamw"},
        {"optim.name": "sgd", "optim.momentum": 0.9},
        {"optim.name": "adamw", "peft.method": "lora"},
    ],
)
def test_in_backward_trains_like_the_usual_step_and_never_holds_the_gradients(tmp_path, extra):
    ref = train({}, tiny_overrides(tmp_path / "ref", **COMMON, **extra), quiet_recipe=True)
    ib = train({}, tiny_overrides(tmp_path / "ib", **COMMON, **extra, **{"optim.in_backward": True}), quiet_recipe=True)
    assert ref["status"] == ib["status"] == "ok"
    assert _losses(tmp_path / "ib") == pytest.approx(_losses(tmp_path / "ref"), rel=1e-5)
    r, i = _steady(tmp_path / "ref"), _steady(tmp_path / "ib")
    assert r["after_backward"]["gradients"] > 0
    assert all(i[ph]["gradients"] == 0 for ph in i)
    assert i["after_optimizer"]["optimizer_device"] == r["after_optimizer"]["optimizer_device"]
    assert i["after_backward"]["allocated"] == r["after_backward"]["allocated"] - r["after_backward"]["gradients"]
    # (this tiny model peaks at the loss, before any gradient exists: the whole-step peak can only fall)
    assert ib["peak_allocated_bytes"] <= ref["peak_allocated_bytes"]


@pytest.mark.parametrize("extra", [{}, {"precision": "bf16-true", "train.activation_checkpointing": True}])
def test_plan_matches_the_in_backward_measurement(tmp_path, extra):
    data = tmp_path / "long.jsonl"  # longer than max_seq_length: every batch is full length, as planned
    data.write_text("".join(json.dumps({"text": f"bowl {i} of pho with herbs " * 40}) + "\n" for i in range(32)))
    over = tiny_overrides(tmp_path / "run", **COMMON, **extra, **{"optim.in_backward": True, "data.source": str(data)})
    s = train({}, over, quiet_recipe=True)
    p = plan(load_recipe({}, over), Target("cpu"))
    for phase, snap in _steady(tmp_path / "run").items():
        for cat in ("parameters", "gradients", "optimizer_device"):
            assert snap[cat] == p.phases[phase][cat], (phase, cat)
    assert abs(p.peak_allocated - s["peak_allocated_bytes"]) / s["peak_allocated_bytes"] < 0.02


def test_gpu_plan_drops_the_gradients_and_alternatives_offer_it():
    """TinyLlama-1.1B on an A100: the plan's peak falls by about the bf16 gradients (2 bytes/parameter);
    --alternatives offers the fused step (at accumulation 1, so with the global batch as micro batch)."""
    target = Target("cuda", find_gpu("a100-80gb"), 1)
    over = {
        "train.micro_batch_size": 2,
        "train.global_batch_size": None,
        "train.accumulate_grad_batches": 1,
        "data.max_seq_length": 256,
        "optim.grad_clip": None,
    }
    r = load_recipe(ROOT / "recipes" / "tinyllama-full.yaml", over)
    usual = plan(r, target, replay=False)
    ib = plan(
        load_recipe(ROOT / "recipes" / "tinyllama-full.yaml", {**over, "optim.in_backward": True}), target, replay=False
    )
    grads = usual.model_states["gradients"]
    assert ib.model_states["gradients"] == 0 and grads > 2e9
    assert any(n.startswith("optim.in_backward") for n in ib.notes)
    assert usual.peak_allocated - ib.peak_allocated > 0.8 * grads
    alts = alternatives(r, target, max_gpus=1)
    fused = [a for a in alts if a.overrides.get("optim.in_backward")]
    assert fused and all("in_backward" in a.variant for a in fused)
    assert min(a.peak_allocated for a in fused) < usual.peak_allocated


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"train.accumulate_grad_batches": 2}, "accumulate"),
        ({"optim.grad_clip": 1.0}, "grad_clip"),
        ({"devices": 2, "strategy": "ddp"}, "devices"),
        ({"optim.name": "cpu_offload_adamw"}, "cpu_offload_adamw"),
    ],
)
def test_in_backward_refuses_what_needs_every_gradient_at_once(overrides, fragment):
    with pytest.raises(RecipeError) as e:
        load_recipe({}, {"optim.in_backward": True, "accelerator": "cpu", **overrides})
    assert any("optim.in_backward" in p and fragment in p for p in e.value.problems), e.value.problems


def test_in_backward_run_resumes_identically(tmp_path):
    common = {
        **COMMON,
        "optim.in_backward": True,
        "train.max_steps": 6,
        "checkpoint.enabled": True,
        "checkpoint.every_steps": 3,
        "checkpoint.keep_last": 5,
        "memory.every_steps": 1000,
    }
    train({}, tiny_overrides(tmp_path / "ref", **common), quiet_recipe=True)
    shutil.copytree(tmp_path / "ref", tmp_path / "cut")
    (tmp_path / "cut" / "checkpoints" / "step-000006.ckpt").unlink()
    train({}, tiny_overrides(tmp_path / "cut", **common), resume=tmp_path / "cut", quiet_recipe=True)
    assert _losses(tmp_path / "cut") == pytest.approx(_losses(tmp_path / "ref"), rel=1e-6)
