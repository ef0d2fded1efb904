"""Memory savers on the tiny preset: exact bytes per technique, their order, merged export, resume."""

from __future__ import annotations

import json

import pytest
import torch

from bigtune.plan.base.target import Target
from bigtune.plan.planner import plan
from bigtune.plan.step.quantized import eight_bit_state_bytes
from bigtune.recipe import RecipeError, load_recipe
from bigtune.run.training import train
from conftest import read_jsonl, run_cli, tiny_overrides

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes (pip install 'bigtune[bnb]') is needed for 8-bit/4-bit")


def _run(run_dir, **over):
    s = train({}, tiny_overrides(run_dir, **{"memory.plan": False, **over}), quiet_recipe=True)
    assert s["status"] == "ok", s.get("error")
    snaps = read_jsonl(run_dir / "memory.jsonl")
    return s, {x["phase"]: x for x in snaps if x["step"] == max(y["step"] for y in snaps)}


def _adapter_numels(rank: int = 8) -> list[int]:
    # tiny-llama: hidden 64, 2 layers, q_proj 64→64, v_proj 64→32 (GQA 4 heads / 2 kv heads)
    out = []
    for _ in range(2):
        out += [rank * 64, 64 * rank]  # q_proj: A (r×64), B (64×r)
        out += [rank * 64, 32 * rank]  # v_proj: A (r×64), B (32×r)
    return out


def test_lora_gradients_and_optimizer_are_exactly_the_adapters(tmp_path):
    s, steady = _run(tmp_path / "r", **{"peft.method": "lora"})
    numels = _adapter_numels()
    adapter_bytes = 4 * sum(numels)  # peft keeps adapters in fp32
    assert s["parameters"]["trainable"] == sum(numels)
    assert steady["after_backward"]["gradients"] == adapter_bytes
    assert steady["after_optimizer"]["optimizer_device"] == 2 * adapter_bytes + 4 * len(numels)


def test_qlora_base_weights_are_half_a_byte_per_parameter(tmp_path):
    _, full = _run(tmp_path / "full", **{"peft.method": "lora"})
    _, q = _run(tmp_path / "q", **{"peft.method": "lora", "model.quantize": "nf4", "model.double_quant": False})
    linear_numel = 2 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 176)  # per layer q,k,v,o + mlp, ×2 layers
    saved = full["before_forward"]["parameters"] - q["before_forward"]["parameters"]
    blocks = linear_numel // 64
    n_linear = 2 * 7
    # fp32 (4 bytes) → packed 4-bit (0.5 byte) + one fp32 scale per 64 weights + a 16-entry code per layer
    expected = 4 * linear_numel - (linear_numel // 2 + 4 * blocks + 64 * n_linear)
    assert saved == expected


def test_qlora_without_upcast_keeps_16_bit_weights_and_hidden_states(tmp_path):
    """model.upcast_unquantized=false skips peft's fp32 cast of the unquantized weights: they stay bf16
    (2 bytes less each), the hidden states stay 16-bit (fewer activation bytes), and checkpointing is still
    applied (peft's preparation is what turned it on otherwise)."""
    q = {"peft.method": "lora", "model.quantize": "nf4", "precision": "bf16-true"}
    s_up, up = _run(tmp_path / "up", **q)
    s_16, b16 = _run(tmp_path / "b16", **q, **{"model.upcast_unquantized": False})
    _, ck = _run(tmp_path / "ck", **q, **{"model.upcast_unquantized": False, "train.activation_checkpointing": True})
    from bigtune.core.presets import tiny_tokenizer
    from bigtune.models.build import build_model
    from bigtune.plan.step.quantized import quantized_linears
    from bigtune.recipe import ModelConfig

    base = build_model(ModelConfig(), tiny_tokenizer(), "bf16-true", 0)
    quantized = {id(m.weight) for _, m in quantized_linears(base)}
    unquantized = sum(p.numel() for p in base.parameters() if id(p) not in quantized)  # embeddings, norms, head
    assert up["before_forward"]["parameters"] - b16["before_forward"]["parameters"] == 2 * unquantized
    acts = {k: r["after_forward"]["activations"] for k, r in (("up", up), ("b16", b16), ("ck", ck))}
    assert acts["ck"] < acts["b16"] < acts["up"], acts
    for s in (s_up, s_16):
        assert s["final_loss"] < s["first_loss"], s


def test_8bit_adam_state_is_one_byte_per_element_plus_block_scales(tmp_path):
    s, steady = _run(tmp_path / "r", **{"optim.name": "adamw8bit"})
    from bigtune.core.presets import tiny_tokenizer
    from bigtune.models.build import build_model
    from bigtune.recipe import ModelConfig

    numels = [p.numel() for p in build_model(ModelConfig(), tiny_tokenizer(), "32-true", 0).parameters()]
    assert steady["after_optimizer"]["optimizer_device"] == eight_bit_state_bytes(numels)
    adamw = 2 * 4 * sum(numels)
    assert steady["after_optimizer"]["optimizer_device"] < 0.35 * adamw


def test_cpu_offloaded_adam_keeps_no_state_on_the_device(tmp_path):
    s, steady = _run(tmp_path / "r", **{"optim.name": "cpu_offload_adamw"})
    n = s["parameters"]["total"]
    for ph in ("before_forward", "after_optimizer"):
        assert steady[ph]["optimizer_device"] == 0
    # fp32 master weights + their gradient buffers + two moments (+ one step counter per tensor)
    assert steady["after_optimizer"]["optimizer_cpu"] == pytest.approx(4 * 4 * n, rel=0.001)


LADDER = [
    (peft, opt, ckpt)
    for peft in ("full", "lora", "qlora")
    for opt in ("adamw", "adam8bit", "sgd")
    for ckpt in (False, True)
]


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    root = tmp_path_factory.mktemp("ladder")
    out = {}
    for peft, opt, ckpt in LADDER:
        over = {
            "optim.name": opt,
            "train.activation_checkpointing": ckpt,
            "data.max_seq_length": 128,
            "train.micro_batch_size": 8,
            "train.max_steps": 2,
        }
        if peft != "full":
            over["peft.method"] = "lora"
        if peft == "qlora":
            over["model.quantize"] = "nf4"
        s, steady = _run(root / f"{peft}-{opt}-{ckpt}", **over)
        out[(peft, opt, ckpt)] = (s, steady)
    return out


def _states(steady):
    b = steady["after_optimizer"]
    return b["parameters"] + b["gradients"] + b["optimizer_device"]


def test_ladder_runs_green_and_ranks_as_expected(ladder):
    assert all(s["status"] == "ok" for s, _ in ladder.values())
    for opt in ("adamw", "adam8bit", "sgd"):
        for ckpt in (False, True):
            full, lora, qlora = (_states(ladder[(p, opt, ckpt)][1]) for p in ("full", "lora", "qlora"))
            assert full > lora > qlora, (opt, ckpt, full, lora, qlora)
    for peft in ("full", "lora", "qlora"):
        for ckpt in (False, True):
            opt_bytes = {
                o: ladder[(peft, o, ckpt)][1]["after_optimizer"]["optimizer_device"]
                for o in ("adamw", "adam8bit", "sgd")
            }
            assert opt_bytes["adamw"] > opt_bytes["adam8bit"] > opt_bytes["sgd"] == 0, (peft, opt_bytes)
        for opt in ("adamw", "adam8bit", "sgd"):
            off = ladder[(peft, opt, False)][1]["after_forward"]["activations"]
            on = ladder[(peft, opt, True)][1]["after_forward"]["activations"]
            assert on < off, (peft, opt)


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"peft.method": "lora"},
        {"peft.method": "dora"},
        {"peft.method": "lora", "model.quantize": "nf4"},
        {"optim.name": "adamw8bit"},
        {"optim.name": "sgd", "optim.momentum": 0.9},
        {"optim.name": "cpu_offload_adamw"},
        {"train.activation_checkpointing": True},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "full-adamw",
)
def test_loss_falls_for_every_technique(tmp_path, over):
    if "peft.method" in over:  # adapters on a random base: adapt every linear layer, with a bigger step
        over = {**over, "peft.target_modules": ["all-linear"]}
    lr = 1e-2 if "peft.method" in over else 3e-3
    s, _ = _run(
        tmp_path / "r",
        **{
            "train.max_steps": 30,
            "optim.lr": lr,
            "memory.every_steps": 1000,
            "data.max_seq_length": 64,
            "train.micro_batch_size": 8,
            **over,
        },
    )
    assert s["final_loss"] < s["first_loss"] - 0.2, (s["first_loss"], s["final_loss"])


@pytest.mark.parametrize("over", [{"peft.method": "lora"}, {"peft.method": "lora", "optim.name": "adamw8bit"}])
def test_planner_is_exact_for_adapters_and_8bit(tmp_path, over):
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"text": "tomato soup with basil " * 40}) + "\n" for _ in range(32)))
    o = tiny_overrides(tmp_path / "r", **{"data.source": str(data), "memory.plan": False, **over})
    s = train({}, o, quiet_recipe=True)
    p = plan(load_recipe({}, o), Target("cpu"))
    snaps = read_jsonl(tmp_path / "r" / "memory.jsonl")
    steady = {x["phase"]: x for x in snaps if x["step"] == 2}
    for ph, x in steady.items():
        for c in ("parameters", "gradients", "optimizer_device", "allocated"):
            assert x[c] == p.phases[ph][c], (ph, c)
    assert p.peak_allocated == pytest.approx(s["peak_allocated_bytes"], rel=0.02)


def test_merged_export_matches_adapter_model(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = tmp_path / "r"
    s = train(
        {},
        tiny_overrides(
            run, **{"peft.method": "lora", "checkpoint.save_model": True, "optim.lr": 1e-2, "train.max_steps": 5}
        ),
        quiet_recipe=True,
    )
    assert s["status"] == "ok" and (run / "adapter").is_dir() and (run / "base").is_dir()
    res = run_cli("export", str(run), "--merge", "--dtype", "float32", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    merged = AutoModelForCausalLM.from_pretrained(run / "merged")
    ref = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(run / "base"), str(run / "adapter"))
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = merged(input_ids=ids).logits, ref(input_ids=ids).logits
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # the adapters really changed the model: the merge is not a copy of the base
    base = AutoModelForCausalLM.from_pretrained(run / "base")
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=ids).logits, a, atol=1e-4)
    res = run_cli("export", str(run), cwd=tmp_path)
    assert res.returncode == 0 and (run / "export-adapter" / "adapter_config.json").is_file()


def test_adapter_run_resumes_identically(tmp_path):
    common = {
        "peft.method": "lora",
        "optim.lr": 1e-2,
        "train.max_steps": 6,
        "checkpoint.enabled": True,
        "checkpoint.every_steps": 3,
        "checkpoint.keep_last": 5,
        "memory.every_steps": 1000,
    }
    train({}, tiny_overrides(tmp_path / "ref", **common), quiet_recipe=True)
    ref = [m["loss"] for m in read_jsonl(tmp_path / "ref" / "metrics.jsonl")]
    ckpt = tmp_path / "ref" / "checkpoints" / "step-000003.ckpt"
    assert ckpt.exists()
    # adapter checkpoints hold only what trains, not the frozen base
    saved = torch.load(ckpt, weights_only=True)["model"]
    assert saved and all("lora_" in k for k in saved)
    import shutil

    shutil.copytree(tmp_path / "ref", tmp_path / "cut")
    (tmp_path / "cut" / "checkpoints" / "step-000006.ckpt").unlink()
    train({}, tiny_overrides(tmp_path / "cut", **common), resume=tmp_path / "cut", quiet_recipe=True)
    cut = [m["loss"] for m in read_jsonl(tmp_path / "cut" / "metrics.jsonl")]
    assert cut == pytest.approx(ref, rel=1e-6)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (["model.quantize=nf4"], "peft.method=lora"),
        (["optim.name=paged_adamw8bit", "accelerator=cpu"], "needs CUDA"),
    ],
)
def test_incompatible_saver_combinations(overrides, fragment):
    with pytest.raises(RecipeError) as e:
        load_recipe({}, overrides)
    assert any(fragment in p for p in e.value.problems), e.value.problems


def test_missing_optional_package_names_the_install(monkeypatch):
    import bigtune.recipe as rec

    monkeypatch.setattr(rec, "_installed", lambda m: False)
    with pytest.raises(RecipeError) as e:
        load_recipe({}, ["optim.name=adamw8bit"])
    assert any("pip install 'bigtune[bnb]'" in p for p in e.value.problems)
    with pytest.raises(RecipeError) as e:
        load_recipe({}, ["optim.name=deepspeed_cpu_adam"])
    assert any("pip install 'bigtune[deepspeed]'" in p for p in e.value.problems)


@pytest.mark.parametrize("backend", ["bitsandbytes", "torchao"])
def test_a_quantized_preset_leaves_no_base_folder_behind(tmp_path, monkeypatch, backend):
    """A preset or random-init model is written out once to be quantized on loading (bitsandbytes) or
    streamed into NF4 (torchao); without save_model that folder is scratch (14 GB for a 7B) and goes."""
    import tempfile

    if backend == "torchao":
        pytest.importorskip("torchao", reason="the NF4 base needs torchao: pip install 'bigtune[torchao]'")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    over = {"peft.method": "lora", "model.quantize": "nf4", "model.quant_backend": backend, "memory.plan": False}
    s = train({}, tiny_overrides(tmp_path / "run", **over), quiet_recipe=True)
    assert s["status"] == "ok"
    assert not list(scratch.glob("bigtune-base-*")), list(scratch.iterdir())
