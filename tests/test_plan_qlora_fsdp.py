"""QLoRA under FSDP (issue #24): the planner's torchao NF4 bytes, their per-rank split, the 70B recipes on
two 24 GB cards, host RAM, the alternatives and the out-of-memory advice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bigtune.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(4096, 4096), (11008, 4096), (256, 512), (128, 64)]


def _storages(t) -> list[int]:
    """Bytes of an NF4Tensor's inner storages (what its memory is)."""
    names, _ = t.__tensor_flatten__()
    return sorted(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nf4_formula_equals_torchao_storages(shape):
    pytest.importorskip("torchao")
    from bigtune.models.nf4 import nf4_scaler_block, to_nf4
    from bigtune.plan.step.quantized import nf4_storage_bytes, nf4_weight_bytes

    t = to_nf4(torch.randn(shape, dtype=torch.bfloat16))
    numel = shape[0] * shape[1]
    assert sorted(nf4_storage_bytes(numel, nf4_scaler_block(numel), 2)) == _storages(t)
    assert nf4_weight_bytes(shape) == sum(_storages(t))
    # CUDA's allocator rounds every one of the five storages up to 512 bytes
    assert nf4_weight_bytes(shape, round_to=512) == sum(-(-b // 512) * 512 for b in _storages(t))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_nf4_rank_bytes_are_torchaos_dim0_shard_plus_replicated_pieces(shape):
    pytest.importorskip("torchao")
    from bigtune.models.nf4 import to_nf4
    from bigtune.plan.step.quantized import nf4_weight_bytes

    t = to_nf4(torch.randn(shape, dtype=torch.bfloat16))
    shard = torch.chunk(t, 2, dim=0)[0]  # what fully_shard keeps on rank 0 of 2
    assert nf4_weight_bytes(shape, ranks=2) == sum(_storages(shard))
    replicated = 2 + 16 * 2  # scaler_mean and the code table, in bf16, on every rank
    assert nf4_weight_bytes(shape, ranks=2) == (nf4_weight_bytes(shape) - replicated) // 2 + replicated


def _tiny_qlora_fsdp(**over):
    base = {
        "model.name": "tiny-llama",
        "model.quantize": "nf4",
        "model.quant_backend": "torchao",
        "peft.method": "lora",
        "precision": "bf16-true",
        "strategy": "fsdp",
        "devices": 2,
        "accelerator": "cpu",
        "data.max_seq_length": 64,
        "train.micro_batch_size": 2,
    }
    return load_recipe({}, [f"{k}={v}" for k, v in {**base, **over}.items()], check=False)


def test_simulation_swaps_in_nf4_bytes_and_fsdp_splits_them():
    from bigtune.core.gpus import find_gpu
    from bigtune.models.configs import resolve_config
    from bigtune.plan.base.target import Target
    from bigtune.plan.planner import plan
    from bigtune.plan.step.simulate import simulate_full_depth, total_blocks

    r = _tiny_qlora_fsdp()
    config = resolve_config(r)
    sim = simulate_full_depth(r, config, True)
    one = plan(r, Target("cuda", find_gpu("a100-sxm-80gb"), 1, "fsdp"), config=config, sim=sim, replay=False)
    two = plan(r, Target("cuda", find_gpu("a100-sxm-80gb"), 2, "fsdp"), config=config, sim=sim, replay=False)
    # the NF4 base of the simulation: one block's weights, times the depth, 512-byte CUDA storages
    blocks = total_blocks(config)
    nf4_full = blocks * sim.nf4.block_nf4_bytes(1, 512)
    nf4_rank = blocks * sim.nf4.block_nf4_bytes(2, 512)
    assert sim.nf4.block_shapes and all(len(s) == 2 for s in sim.nf4.block_shapes)
    p1 = one.phases["after_backward"]["parameters"]
    p2 = two.phases["after_backward"]["parameters"]
    assert p2 == -(-(p1 - nf4_full) // 2) + nf4_rank
    assert nf4_rank > nf4_full // 2  # the replicated pieces and the rounding of every shard
    assert any(n.startswith("nf4 base (torchao NF4Tensor") for n in two.notes)


def test_simulated_parameters_hold_4bit_not_16bit_weights():
    """The FSDP all-gather and offload terms of the step time price states['parameters']: for an NF4 base the
    measured parameters must be the NF4 bytes and the other weights as they are, not 16-bit weights."""
    from bigtune.models.configs import resolve_config
    from bigtune.plan.step.simulate import simulate_full_depth, total_blocks

    q = _tiny_qlora_fsdp()
    config = resolve_config(q)
    sim = simulate_full_depth(q, config, False)  # a CPU simulation: storages unrounded
    blocks = total_blocks(config)
    nf4 = sim.nf4
    expected = nf4.root_bytes + blocks * (nf4.block_other_bytes + nf4.block_nf4_bytes())
    assert sim.phases["after_backward"]["parameters"] == expected
    sixteen = sum(2 * a * b for a, b in nf4.block_shapes)
    assert nf4.block_nf4_bytes() < sixteen / 3  # ½ byte a weight + constants, against 2


def _cli_plan(args: list[str]) -> str:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "bigtune", "plan", *args], capture_output=True, text=True, cwd=ROOT, check=False
    )
    return out.stdout + out.stderr


def test_70b_on_two_24gb_cards_fits_with_offload_and_not_without():
    recipe = "recipes/llama-2-70b-qlora-fsdp-2x24gb.yaml"
    out = _cli_plan([recipe, "--gpu", "rtx-3090"])
    assert "\nFITS: " in out, out
    assert "host RAM ≈" in out and "GiB per node" in out
    oom = _cli_plan([recipe, "--gpu", "rtx-3090", "--set", "fsdp_cpu_offload=false"])
    assert "\nOOM: " in oom, oom


@pytest.mark.parametrize(
    "name",
    [
        "llama-2-70b-qlora-fsdp-2x24gb",
        "llama-3.1-70b-qlora-fsdp-2x24gb",
        "llama-2-70b-qlora-fsdp-2x80gb",
        "llama-3.1-70b-qlora-fsdp-2x80gb",
        "llama-2-7b-qlora-fsdp-2x16gb",
    ],
)
def test_qlora_fsdp_recipes_fit_their_cards(name):
    from bigtune.core.gpus import find_gpu
    from bigtune.plan.base.target import Target
    from bigtune.plan.planner import plan

    r = load_recipe(ROOT / "recipes" / f"{name}.yaml", check=False)
    card = {"24gb": "rtx-3090", "80gb": "h100-sxm-80gb", "16gb": "t4-16gb"}[name.rsplit("x", 1)[1]]
    p = plan(r, Target("cuda", find_gpu(card), r.devices, "fsdp"), replay=False)
    assert p.fits, p.notes
    assert p.host_bytes_per_node and p.host_bytes_per_node > 2 * 2**30 * r.devices  # the runtime at least
    if r.fsdp_cpu_offload:  # the rank's NF4 shards live in host RAM
        assert p.host_bytes_per_node > p.parameters_total * 0.5 / 2


def test_alternatives_list_qlora_fsdp_variants():
    out = _cli_plan(["recipes/llama-2-70b-qlora-fsdp-2x24gb.yaml", "--gpu", "rtx-3090", "--alternatives", "--adapters"])
    assert "QLoRA nf4 (torchao) r16, 2 GPUs fsdp, fsdp_cpu_offload" in out, out


def test_oom_advice_names_qlora_fsdp():
    from bigtune.run.advice import oom_advice

    sharded = _tiny_qlora_fsdp(fsdp_cpu_offload=False)
    assert any(a.startswith("fsdp_cpu_offload=true") for a in oom_advice(sharded))
    single = _tiny_qlora_fsdp(strategy="single", devices=1, **{"model.quant_backend": "auto"})
    assert any(a.startswith("strategy=fsdp") for a in oom_advice(single))
