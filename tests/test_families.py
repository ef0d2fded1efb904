"""Model families (issue #26): one tiny random-init preset per architecture trains, is planned to within
2 % of its measured CPU peak, generates, and exports a LoRA merge equal to the adapter model. The two
mixture-of-experts presets also train their router's load-balancing loss and log it as ``aux_loss``."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from bigtune.cli.generate import add_cli
from bigtune.core.presets import PRESETS
from bigtune.run.training import train
from bigtune.use.export import export_run
from conftest import read_jsonl, tiny_overrides

FAMILIES = [
    "tiny-llama3",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-mistral",
    "tiny-phi3",
    "tiny-gpt-neox",
    "tiny-stablelm",
    "tiny-falcon",
    "tiny-bloom",
    "tiny-mixtral",
    "tiny-qwen3-moe",
]
MOE = {"tiny-mixtral", "tiny-qwen3-moe"}


def _run(tmp_path, name: str, **extra) -> dict:
    over = {"model.name": name, "checkpoint.save_model": True, "memory.every_steps": 10, **extra}
    return train({}, tiny_overrides(tmp_path, **over), quiet_recipe=True)


def _generate(model_dir, tmp_path) -> list[dict]:
    ap = argparse.ArgumentParser(prog="bigtune")
    add_cli(ap.add_subparsers(dest="verb"))
    out = tmp_path / "gen.jsonl"
    args = ap.parse_args(
        ["generate", "--model", str(model_dir), "Name a soup.", "--max-new-tokens", "6", "--device", "cpu"]
        + ["--out", str(out)]
    )
    assert args.func(args) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_every_family_preset_is_listed():
    assert set(FAMILIES) <= set(PRESETS) and all(PRESETS[n].family == "causal-lm" for n in FAMILIES)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_trains_plans_generates_and_merges(tmp_path, name):
    run = tmp_path / "full"
    s = _run(run, name, **{"train.max_steps": 20, "train.log_every_steps": 5, "optim.lr": 1e-2})
    assert s["status"] == "ok" and s["final_loss"] < s["first_loss"] - 0.5, (s["first_loss"], s["final_loss"])
    # the plan printed before step 0 simulated this family's step on fake tensors: it matches the CPU peak
    assert abs(s["plan"]["peak_error_pct"]) < 2.0, s["plan"]["peak_error_pct"]
    metrics = read_jsonl(run / "metrics.jsonl")
    if name in MOE:  # the router's load-balancing loss trains with the LM loss and is logged beside it
        aux = [m["aux_loss"] for m in metrics]
        # Switch-style aux loss: top_k (2) when routing is balanced, up to top_k × experts when collapsed
        assert all(math.isfinite(a) and 1.0 < a < 8.0 for a in aux), aux
    else:
        assert all("aux_loss" not in m for m in metrics)

    # greedy generation from the trained run: deterministic, and it produces text
    rows = _generate(run, tmp_path)
    assert rows[0]["prompt"] == "Name a soup." and rows == _generate(run, tmp_path)

    # a LoRA run's merged export computes the adapter model's logits
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = tmp_path / "lora"
    s = _run(lora, name, **{"peft.method": "lora", "optim.lr": 1e-2, "train.max_steps": 4, "memory.plan": False})
    assert s["status"] == "ok"
    merged = AutoModelForCausalLM.from_pretrained(export_run(lora, merge=True, dtype="float32"))
    base = AutoModelForCausalLM.from_pretrained(lora / "base")
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lora / "base"), str(lora / "adapter"))
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b, c = merged(input_ids=ids).logits, ref(input_ids=ids).logits, base(input_ids=ids).logits
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(a, c, atol=1e-4)  # the adapters changed the model: the merge is not the base


@pytest.mark.parametrize("name", sorted(MOE))
def test_moe_plan_with_accumulation_and_aux_loss(tmp_path, name):
    """Two micro-batches per step: the aux loss adds per micro-batch, and the plan still matches the peak."""
    run = tmp_path / "acc"
    s = _run(run, name, **{"train.max_steps": 4, "train.micro_batch_size": 2, "train.accumulate_grad_batches": 2})
    assert s["status"] == "ok" and abs(s["plan"]["peak_error_pct"]) < 3.0, s["plan"]["peak_error_pct"]
    assert all("aux_loss" in m for m in read_jsonl(run / "metrics.jsonl"))
