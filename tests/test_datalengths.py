"""plan --data-lengths: the peak at the data's longest sample, measured against a real epoch on the CPU."""

from __future__ import annotations

import pytest

from bigtune.plan.base.constants import GIB
from bigtune.plan.base.target import Target
from bigtune.plan.planner import plan
from bigtune.plan.search.lengths import data_lengths, epoch_batch_lengths, plan_at_data_lengths
from bigtune.recipe import load_recipe
from bigtune.run.training import train
from conftest import ROOT, run_cli

DEMO_BLIP = ROOT / "recipes" / "gourmetgram-demo.yaml"


def _two_epochs(tmp_path, base, extra: dict) -> tuple[dict, dict]:
    # Two epochs, memory measured at every step: the batch holding the longest sample comes after step 0
    # at least once (step 0 has no optimizer state yet; the plan is for the steady step).
    over = {
        "train.max_epochs": 2,
        "train.max_steps": None,
        "memory.every_steps": 1,
        "checkpoint.save_model": False,
        "accelerator": "cpu",
        "output_dir": str(tmp_path / "run"),
        "memory.plan": False,
        "data.val_fraction": 0.0,
        **extra,
    }
    return train(base, over, quiet_recipe=True), over


@pytest.mark.parametrize(
    "base, extra",
    [
        ({}, {"train.micro_batch_size": 8, "data.num_train_samples": 64}),
        (str(DEMO_BLIP), {"train.micro_batch_size": 8, "data.num_train_samples": 32}),
        (str(DEMO_BLIP), {"model.name": "tiny-blip2-t5", "train.micro_batch_size": 8, "data.num_train_samples": 32}),
    ],
    ids=["llama-instructions", "blip2-opt-captions", "blip2-t5-captions"],
)
def test_peak_at_the_longest_sample_matches_training(tmp_path, base, extra):
    summary, over = _two_epochs(tmp_path, base, extra)
    r = load_recipe(base, over)
    d = data_lengths(r)
    # the same samples, tokenized the same way: the epoch trained exactly the real tokens counted here
    assert 2 * d.samples == summary["samples"]
    assert round(2 * d.samples * d.mean_tokens) == summary["tokens"], (d, summary["tokens"])
    assert d.longest < r.data.max_seq_length and d.truncated == 0
    at_data = plan_at_data_lengths(r, Target("cpu"), lengths=d)
    measured = summary["peak_allocated_bytes"]
    assert abs(at_data.peak_allocated - measured) / measured < 0.02, (at_data.peak_allocated, measured)
    # the worst case (every row max_seq_length tokens) is what a plain plan says: more than the data needs
    assert plan(r, Target("cpu")).peak_allocated > 1.02 * measured
    assert (
        at_data.data_lengths["longest"] == d.longest
        and at_data.tokens_per_step < plan(r, Target("cpu")).tokens_per_step
    )


def test_epoch_batch_lengths_follow_the_engine_sampler():
    r = load_recipe({}, {"train.micro_batch_size": 3})
    lengths = [5, 9, 2, 7, 7, 1, 4]
    got = epoch_batch_lengths(lengths, r)
    assert len(got) == 3 and max(got) == 9 and all(g in lengths for g in got)
    # grouping by length sorts within groups: no more padding than the plain order
    grouped = epoch_batch_lengths(lengths, load_recipe({}, {"train.micro_batch_size": 3, "data.group_by_length": True}))
    assert sum(grouped) <= sum(got)


def test_packing_is_planned_at_full_rows():
    r = load_recipe({}, {"data.packing": True, "accelerator": "cpu"})
    p = plan_at_data_lengths(r, Target("cpu"))
    assert p.peak_allocated == plan(r, Target("cpu")).peak_allocated and any("packing" in n for n in p.notes)


def test_cli_data_lengths(tmp_path):
    res = run_cli("plan", "--set", "train.micro_batch_size=8", "--data-lengths", "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    import json

    out = json.loads(res.stdout)["plan"]
    assert out["data_lengths"]["longest"] > 0 and out["peak_allocated"] < 1 * GIB
    assert "planned at the data's lengths" in out["notes"][0]
