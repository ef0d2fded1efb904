"""`bigtune plan --alternatives --adapters` for one card (issue #42): LoRA of Llama-3.1-8B at 4096 tokens, micro
batch 4, on one RTX 4090, where the recipe runs out of memory. The answer starts with what one card can do (QLoRA
among it), then more GPUs; no run is listed twice, and a row's overrides are only what changes the recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bigtune.core.gpus import custom_gpu, find_gpu
from bigtune.plan.base.target import Target
from bigtune.plan.format import format_alternatives
from bigtune.plan.search.alternatives import alternatives
from bigtune.plan.search.choose import gpus_and_strategy
from bigtune.recipe import load_recipe

# minutes of simulation on a small CPU (an 8B model's step at 4096 tokens, a few dozen variants)
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
QUESTION = ["data.max_seq_length=4096", "train.micro_batch_size=4", "accelerator=cpu"]


def recipe_value(recipe, key: str):
    value = recipe.to_dict()
    for part in key.split("."):
        value = value[part]
    return value


@pytest.fixture(scope="module")
def one_card():
    """The recipe and its alternatives on one RTX 4090 (the planner simulates the 8B step: tens of seconds)."""
    r = load_recipe(ROOT / "recipes" / "llama-3.1-8b-chat-lora.yaml", QUESTION, check=False)
    return r, alternatives(r, Target("cuda", find_gpu("rtx-4090"), 1, "single"), adapters=True, workers=2)


def test_one_card_rows_come_first_and_qlora_is_among_them(one_card):
    _, alts = one_card
    counts = [gpus_and_strategy(p)[0] for p in alts]
    assert counts[0] == 1 and counts == sorted(counts), [p.variant for p in alts]
    one = [p for p in alts if gpus_and_strategy(p)[0] == 1]
    speeds = [p.tokens_per_s for p in one]
    assert speeds == sorted(speeds, reverse=True)  # fastest first within the asked count
    qlora = [p for p in one if p.overrides.get("model.quantize") == "nf4"]
    assert qlora and all(p.fits for p in qlora), [p.variant for p in one]
    assert all("QLoRA" in p.variant for p in qlora)
    # the first lines printed are the one-card ones
    first = format_alternatives(alts).splitlines()[1]
    assert "GPUs" not in first, first


def test_no_run_is_listed_twice(one_card):
    _, alts = one_card
    runs = [(gpus_and_strategy(p), json.dumps(p.overrides, sort_keys=True, default=str)) for p in alts]
    assert len(set(runs)) == len(runs), runs
    labels = [p.variant for p in alts]
    assert len(set(labels)) == len(labels), labels


def test_overrides_hold_only_what_changes_the_recipe(one_card):
    r, alts = one_card
    for p in alts:
        name = p.overrides.get("optim.name", r.optim.name)
        if name != "sgd":
            assert "optim.momentum" not in p.overrides, (p.variant, p.overrides)
        same = {k: v for k, v in p.overrides.items() if v == recipe_value(r, k)}
        assert not same, (p.variant, same)


def test_a_checkpointed_retry_on_several_gpus_is_listed_once():
    """Without checkpointing in the recipe, several GPUs that run out of memory are tried again with it. QLoRA over
    FSDP on the same GPU count (with checkpointing but fp32 hidden states) running out too asked for the same retry
    again: identical rows. The card is sized from the plans: just below what the QLoRA rows need."""
    r = load_recipe(
        {},
        ["accelerator=cpu", "precision=bf16-true", "train.activation_checkpointing=false", "data.max_seq_length=4096"],
        check=False,
    )

    def search(memory_gib: float):
        gpu = custom_gpu(memory_gib, find_gpu("l4"))
        return alternatives(
            r, Target("cuda", gpu, 1, "single"), max_gpus=2, adapters=True, workers=1, tensor_parallel=False
        )

    roomy = search(8.0)
    qlora = [p.needed_total for p in roomy if "QLoRA" in p.variant and "2 GPUs fsdp" in p.variant]
    assert len(qlora) == 2, [p.variant for p in roomy]
    alts = search((min(qlora) - 2**20) / 2**30)  # the same simulations, read back from the cache
    labels = [p.variant for p in alts]
    assert not [v for v in labels if "QLoRA" in v and "GPUs" in v], labels  # the scenario: QLoRA over FSDP runs out
    assert any("2 GPUs fsdp, ckpt" in v for v in labels), labels  # and the plain FSDP retried with checkpointing fits
    assert len(set(labels)) == len(labels), labels
