"""QDoRA under FSDP2 (issue #24): DoRA adapters on the torchao NF4 base, sharded over 2 gloo ranks: the
magnitude at load, losses against one process, the plan, resume and export."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import read_jsonl, resume_from_step_3, run_losses, train_cli

pytest.importorskip("torchao", reason="QDoRA under FSDP needs torchao: pip install 'bigtune[torchao]'")

from test_qlora_fsdp import COMMON, RESUME_RUN, merged_export_equals_adapter  # noqa: E402 - after the skip: that module needs torchao too

DORA = {**COMMON, "peft.method": "dora"}
MAGNITUDE = ".lora_magnitude_vector"


def _train(tmp_path, name, **over):
    return train_cli(tmp_path, name, DORA, **over)


def _fsdp(**over):
    return {"devices": 2, "strategy": "fsdp", "train.micro_batch_size": 2, **over}


def _single(**over):
    return {"devices": 1, "strategy": "single", "train.micro_batch_size": 4, **over}


def _nf4_dora_model(tmp_path, precision: str):
    """(the engine's NF4 + DoRA model of tiny-llama, its recipe, the weights folder it streamed from)."""
    from bigtune.core.presets import tiny_tokenizer
    from bigtune.models.build import build_model, write_base
    from bigtune.models.nf4 import build_nf4_peft_model
    from bigtune.recipe import load_recipe

    r = load_recipe({}, [f"{k}={'null' if v is None else v}" for k, v in {**DORA, "precision": precision}.items()])
    folder = tmp_path / "base"
    whole = build_model(dataclasses.replace(r.model, quantize="none"), tiny_tokenizer(), r.precision, r.seed)
    write_base(whole, tiny_tokenizer(), folder)
    model, _ = build_nf4_peft_model(r.model, r.peft, folder, r.precision, r.seed, checkpointing=False)
    return model, r, folder


def _dora_layers(model) -> dict:
    return {n: m for n, m in model.named_modules() if getattr(m, "lora_magnitude_vector", None)}


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_magnitude_at_load_is_peft_dora_on_the_dequantized_base(tmp_path, precision):
    """Every magnitude equals what peft's own DoRA computes on an fp32 model holding the dequantized NF4
    weights, bit for bit (B is zero at init, so that is each dequantized row's norm); the adapters then leave
    the logits unchanged. In fp32 the NF4 model's DoRA forward equals peft's on the dequantized base once
    the adapters hold other values."""
    from transformers import AutoModelForCausalLM

    from bigtune.models.build import apply_peft
    from bigtune.models.nf4 import dequantized_weight, is_nf4

    model, r, folder = _nf4_dora_model(tmp_path, precision)
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ref_linears = dict(ref.named_modules())
    ours = _dora_layers(model)
    assert len(ours) == 4  # q_proj and v_proj of 2 blocks (peft's default targets)
    assert all(is_nf4(mod.get_base_layer().weight) for mod in ours.values())
    for name, mod in model.named_modules():  # every NF4 weight, adapted or not, dequantized into the reference
        if isinstance(mod, torch.nn.Linear) and is_nf4(mod.weight):
            key = name.removeprefix("base_model.model.").removesuffix(".base_layer")
            ref_linears[key].weight.data = dequantized_weight(mod).float()
    ref = apply_peft(ref, r.peft, quantized=False, checkpointing=False)
    theirs = _dora_layers(ref)
    for name, mod in ours.items():
        mag = mod.lora_magnitude_vector["default"].weight
        assert mag.dtype == torch.float32 and mag.requires_grad
        assert torch.equal(mag, theirs[name].lora_magnitude_vector["default"].weight)
        assert torch.equal(mag, torch.linalg.norm(dequantized_weight(mod.get_base_layer()).float(), dim=1))
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
    assert torch.equal(adapted, plain)
    if precision != "32-true":
        return
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, mod in ours.items():  # the same trained-looking adapter in both models
            for part in ("lora_A", "lora_B", "lora_magnitude_vector"):
                w = getattr(mod, part)["default"].weight
                w.copy_(w + 0.1 * torch.randn(w.shape, generator=g))
                getattr(theirs[name], part)["default"].weight.copy_(w)
        a, b = model(input_ids=ids).logits, ref(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a, adapted, atol=1e-3)  # the adapters do change the output


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_fsdp_qdora_matches_one_process_and_the_plan(tmp_path, precision):
    """2 ranks × micro batch 2 against 1 process × 4 on the same samples, DoRA on the NF4 base: the losses
    agree (fp32 to 1e-5: only the order of the reductions differs; bf16-true to 2e-3: the bf16 matmul outputs
    round differently when the batch is split; the tolerances of test_qlora_fsdp). The plan of the 2-rank run
    (bigtune plan's simulation, re-planned at the measured batch) is within 2 % of each rank's peak."""
    one = _train(tmp_path, "one", **_single(precision=precision))
    two = _train(tmp_path, "two", **_fsdp(precision=precision, **{"memory.plan": True}))
    tol = 1e-5 if precision == "32-true" else 2e-3
    assert run_losses(two) == pytest.approx(run_losses(one), rel=tol)
    assert run_losses(two)[-1] < run_losses(two)[0]  # the adapters learn
    plan = json.loads((two / "summary.json").read_text())["plan"]
    assert abs(plan["peak_error_pct"]) < 2.0, plan["peak_error_pct"]
    for phase, cats in plan["phases"].items():
        assert cats["parameters"]["measured"] == pytest.approx(cats["parameters"]["predicted"], rel=1e-3), phase
    # per rank: each rank's peak of the last step, where it ran the batch shape the plan was re-planned at
    rows = read_jsonl(two / "memory.jsonl")
    last = max(s["step"] for s in rows)
    compared = []
    for rank in (0, 1):
        mine = [s for s in rows if s["rank"] == rank and s["step"] == last]
        if mine[0]["batch_shape"] == plan["replanned_at_batch_shape"]:
            measured = max(s["peak_allocated"] for s in mine)
            assert plan["predicted_peak_allocated_like_for_like"] == pytest.approx(measured, rel=0.02), rank
            compared.append(rank)
    assert 0 in compared  # the summary's (rank 0's) shape is the one re-planned


def test_fsdp_qdora_magnitudes_at_load_are_the_dequantized_row_norms(tmp_path):
    """Each rank computes the magnitudes from its whole block before FSDP2 keeps its half: trained at lr 0,
    the saved adapter (gathered from both ranks' shards) holds exactly the fp32 row norms of the base
    weights quantized to NF4 as the engine does and dequantized."""
    from safetensors.torch import load_file

    from bigtune.models.nf4 import to_nf4

    run = _train(
        tmp_path,
        "lr0",
        **_fsdp(
            precision="bf16-true",
            **{"optim.lr": 0.0, "train.max_steps": 1, "checkpoint.save_model": True, "memory.enabled": False},
        ),
    )
    adapter = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    base = load_file(str(run / "base" / "model.safetensors"))
    mags = {k: v for k, v in adapter.items() if k.endswith(MAGNITUDE)}
    assert len(mags) == 4
    for key, mag in mags.items():
        w = base[key.removeprefix("base_model.model.").removesuffix(MAGNITUDE) + ".weight"]
        dequantized = to_nf4(w.to(torch.bfloat16)).get_original_weight()
        assert torch.equal(mag, torch.linalg.norm(dequantized.float(), dim=1)), key


def test_fsdp_qdora_resumes_exactly_and_exports_merged(tmp_path):
    """The sharded, adapters-only checkpoint (A, B and the magnitudes with their optimizer state, no base
    weight) continues the loss curve exactly; the exported adapter carries the magnitudes, and export --merge
    folds them into the unquantized base with the logits of base + adapter."""
    from torch.distributed.checkpoint import FileSystemReader

    over = _fsdp(precision="bf16-true", **RESUME_RUN)
    ref = _train(tmp_path, "ref", **over)
    ckpt = ref / "checkpoints" / "step-000003.ckpt"
    assert ckpt.is_dir()  # FSDP: a distributed checkpoint folder
    weights = [k for k in FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert weights and all(".lora_" in k for k in weights), "adapters only, not the base"
    assert sum(MAGNITUDE in k for k in weights) == 4
    cut = resume_from_step_3(tmp_path, ref, DORA, over)
    assert run_losses(cut) == run_losses(ref)

    assert json.loads((ref / "adapter" / "adapter_config.json").read_text())["use_dora"] is True
    assert len(_dora_layers(merged_export_equals_adapter(tmp_path, ref))) == 4
