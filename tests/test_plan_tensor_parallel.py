"""Tensor parallelism in the plan (plan/layout/tensor_parallel.py): one rank of a tensor-parallel group simulated as the
model with heads and MLP width / tp, FSDP over the data-parallel ranks; checked against the engine's own
measurement of a TP=2 run on two gloo ranks, the per-rank weights against the model's own projections, and
the 2-D variants --alternatives lists for the 13B recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bigtune.recipe import load_recipe
from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
TINY = {"model.name": "tiny-llama", "accelerator": "cpu", "data.max_seq_length": 64, "train.micro_batch_size": 4}
SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _recipe(**over):
    return load_recipe(None, {**TINY, **over})


def _split_linear_bytes(recipe) -> int:
    """Bytes of the decoder blocks' projections that tensor parallelism splits (fp32), from the real model."""
    from transformers import AutoModelForCausalLM

    from bigtune.models.configs import resolve_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(resolve_config(recipe))
    return sum(
        p.numel() * 4 for name, p in model.named_parameters() if ".layers." in name and name.split(".")[-2] in SPLIT
    )


def test_each_rank_holds_1_over_tp_of_the_block_projections():
    from bigtune.plan.base.target import Target
    from bigtune.plan.planner import plan

    whole = plan(_recipe(), Target("cpu"))
    split = _split_linear_bytes(_recipe())
    assert 0 < split < whole.model_states["parameters"]
    tp2 = plan(_recipe(devices=2, strategy="fsdp", tensor_parallel=2), Target("cpu", None, 2, "fsdp"))
    # the projections halved, embeddings, norms and output layer whole (one data-parallel rank: no FSDP split)
    for c in ("parameters", "gradients"):
        assert tp2.model_states[c] == whole.model_states[c] - split // 2
    assert tp2.model_states["optimizer_device"] == whole.model_states["optimizer_device"] - split  # AdamW: 2 moments
    assert tp2.parameters_total == whole.parameters_total  # the whole model's count, not one rank's
    assert tp2.tokens_per_step == whole.tokens_per_step  # both ranks read the same micro-batch
    assert not any("NOT planned" in n for n in tp2.notes)
    # 2 data-parallel × 2 tensor-parallel: FSDP halves that again
    dp2 = plan(_recipe(devices=4, strategy="fsdp", tensor_parallel=2), Target("cpu", None, 4, "fsdp"))
    assert dp2.model_states["parameters"] == -(-tp2.model_states["parameters"] // 2)
    assert dp2.tokens_per_step == 2 * whole.tokens_per_step
    # tensor_parallel must divide the model's key/value heads (tiny-llama has 2)
    from bigtune.plan.base.constants import PlanError

    with pytest.raises(PlanError, match="num_key_value_heads"):
        plan(_recipe(devices=4, strategy="fsdp", tensor_parallel=4), Target("cpu", None, 4, "fsdp"))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_plan_matches_the_measured_two_rank_run(tmp_path, sequence_parallel):
    # The engine measures rank 0 of a TP=2 run (DTensor local shards: core/stepmath.plain_tensors) and compares
    # with the plan re-made at the measured batch shape (summary.json "plan").
    over = {
        **TINY,
        "devices": 2,
        "strategy": "fsdp",
        "tensor_parallel": 2,
        "sequence_parallel": sequence_parallel,
        "memory.plan": True,
        "memory.every_steps": 1,
        "train.max_steps": 3,
        "train.max_epochs": None,
        "output_dir": str(tmp_path / "run"),
    }
    args = [x for k, v in over.items() for x in ("--set", f"{k}={'null' if v is None else v}")]
    res = run_cli("train", *args, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    cmp = json.loads((tmp_path / "run" / "summary.json").read_text())["plan"]
    assert abs(cmp["peak_error_pct"]) < 5  # measured 0.04 % (sequence_parallel: 0.00 %)
    for phase, cats in cmp["phases"].items():
        for c in ("parameters", "gradients", "optimizer_device"):
            assert cats[c]["predicted"] == cats[c]["measured"], (phase, c)
        m, p = cats["activations"]["measured"], cats["activations"]["predicted"]
        # Under load (fresh-clone CI, once) the after-backward snapshot still held one fp32 b×s×h tensor
        # (4 × 64 × 64 × 4 B = 64 KiB): a tensor-parallel all-reduce's buffer whose release under gloo's async
        # collectives is timing-dependent. At most that one buffer is forgiven, and only above the plan.
        late = 4 * 64 * 64 * 4 if phase in ("after_backward", "after_optimizer") and m > p else 0
        assert abs(p - (m - min(late, m - p))) <= 0.05 * max(m, 1 << 20), (phase, m, p)


def test_sequence_parallel_plans_fewer_activations_than_tensor_parallel():
    """The same TP=2 recipe with and without sequence parallelism: the same states, fewer activations (the norms
    and the residual stream at half the rows)."""
    from bigtune.core.gpus import find_gpu
    from bigtune.plan.base.target import Target
    from bigtune.plan.planner import plan

    target = Target("cuda", find_gpu("a100-40gb"), 2, "fsdp")
    tp, sp = (
        plan(_recipe(devices=2, strategy="fsdp", tensor_parallel=2, sequence_parallel=s), target) for s in (False, True)
    )
    assert sp.model_states == tp.model_states
    b, s, h = 4, 64, 64
    saved = tp.phases["after_forward"]["activations"] - sp.phases["after_forward"]["activations"]
    # at least one bf16 b × s/2 × h tensor per block's norm input: the tiny Llama has 2 blocks
    assert saved >= 2 * b * s // 2 * h * 2, (saved, tp.phases["after_forward"], sp.phases["after_forward"])
    assert sp.peak_allocated < tp.peak_allocated
    assert any(n.startswith("sequence_parallel: ") for n in sp.notes)


def test_alternatives_list_tensor_parallel_variants_for_the_13b_recipe():
    from bigtune.core.gpus import find_gpu
    from bigtune.plan.base.target import Target
    from bigtune.plan.search.alternatives import alternatives

    r = load_recipe(ROOT / "recipes" / "open-llama-13b-full.yaml", ["accelerator=cpu"], check=False)
    alts = alternatives(r, Target("cuda", find_gpu("a100-40gb"), 8, "ddp"), workers=1)
    tp = {a.variant: a for a in alts if "tensor_parallel=" in a.variant}
    for size in (2, 4, 8):
        assert any(f"8 GPUs fsdp × tensor_parallel={size} " in v for v in tp), sorted(tp)
    fsdp8 = next(a for a in alts if a.variant.startswith("bf16-true, 8 GPUs fsdp, "))
    for a in tp.values():
        assert a.fits and a.tokens_per_s and a.step_time_s
        assert a.tokens_per_step == fsdp8.tokens_per_step == 16 * 512  # the global batch, counted once
        assert any("tensor-parallel all-reduces" in n for n in a.notes)
    # the same 8 GPUs hold less per GPU with the blocks split 2 ways and the root 4 ways than the root 8 ways
    two = tp[next(v for v in tp if "8 GPUs fsdp × tensor_parallel=2 " in v)]
    assert two.peak_allocated < fsdp8.peak_allocated
