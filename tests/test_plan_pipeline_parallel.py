"""The plan of pipeline parallelism (pipeline_parallel > 1): what each schedule holds, the steady-state shortcut,
and `bigtune plan` with its alternatives. Each rank's plan against its measurement is checked on the runs of
tests/test_pipeline_parallel.py (test_each_rank_measured_within_five_percent_of_its_stage_plan).
"""

from __future__ import annotations

import json

import pytest

from bigtune.models.configs import resolve_config
from bigtune.plan.layout.pipeline import bubble_fraction, in_flight, stage_sims
from bigtune.recipe import load_recipe


def _recipe(schedule: str, micro: int, **over):
    sets = {
        "accelerator": "cpu",
        "devices": 2,
        "pipeline_parallel": 2,
        "pipeline_schedule": schedule,
        "train.micro_batch_size": micro,
        "train.pipeline_microbatches": micro,
        "data.max_seq_length": 64,
        **over,
    }
    return load_recipe(None, [f"{k}={v}" for k, v in sets.items()])


def test_one_f_one_b_holds_fewer_micro_batches_than_gpipe():
    assert [in_flight(4, 8, "gpipe", i) for i in range(4)] == [8, 8, 8, 8]
    assert [in_flight(4, 8, "1f1b", i) for i in range(4)] == [4, 3, 2, 1]
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    config = resolve_config(_recipe("gpipe", 8))
    gpipe = stage_sims(_recipe("gpipe", 8), config, cuda=False)
    one_f = stage_sims(_recipe("1f1b", 8), config, cuda=False)
    for stage in (0, 1):
        assert one_f[stage].peak_allocated < gpipe[stage].peak_allocated, f"stage {stage}"
    # GPipe's first stage holds 8 micro-batches' activations at once, 1F1B's 2: the difference grows with the
    # micro-batches GPipe keeps, so 16 of them (same rows each) widen it
    gpipe16 = stage_sims(_recipe("gpipe", 16), config, cuda=False)
    one_f16 = stage_sims(_recipe("1f1b", 16), config, cuda=False)
    gap8 = gpipe[0].peak_allocated - one_f[0].peak_allocated
    gap16 = gpipe16[0].peak_allocated - one_f16[0].peak_allocated
    assert gap16 > 1.8 * gap8


def test_steady_state_shortcut_equals_the_full_emulation():
    """stage_sims simulates 1F1B stage i with p − i + 1 pipeline micro-batches and adds the rest's buffers and
    operators; simulating all of them gives the same memory and the same operators."""
    from bigtune.plan.layout.pipeline import stage_config
    from bigtune.plan.step.simulate import simulate_full_depth

    r = _recipe("1f1b", 8, **{"optim.name": "adamw"})
    config = resolve_config(r)
    short = stage_sims(r, config, cuda=False)
    for stage in (0, 1):
        full = simulate_full_depth(r, stage_config(config, 2), False, stage=stage)
        assert short[stage].peak_allocated == full.peak_allocated, f"stage {stage}"
        assert short[stage].phases == full.phases
        flops = lambda sim: sum(v[1] for v in sim.ops.values())  # noqa: E731
        assert flops(short[stage]) == pytest.approx(flops(full), rel=1e-9)


def test_plan_cli_names_the_stages_and_lists_a_pipeline_alternative(tmp_path):
    from conftest import run_cli

    res = run_cli(
        "plan",
        *("--set", "pipeline_parallel=2", "--set", "devices=2", "--set", "train.pipeline_microbatches=2"),
        *("--set", "train.global_batch_size=8"),
        *("--gpu", "a100-40gb", "--gpus", "2", "--alternatives", "--max-gpus", "2", "--json"),
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["plan"]["target"] == "2× a100-sxm-40gb (pipeline_parallel=2)"
    notes = " ".join(out["plan"]["notes"])
    assert "peak allocated per stage: stage 0:" in notes and "pipeline bubble" in notes
    pipelined = [p for p in out["alternatives"] if "pipeline_parallel=2" in p["variant"]]
    assert [p["variant"] for p in pipelined] == [
        "32-true, 2 GPUs pipeline_parallel=2 (1f1b, 8 pipeline micro-batches of 1 row)"
    ]
    assert pipelined[0]["peak_total"] > 0 and pipelined[0]["tokens_per_s"] > 0
