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
from bigtune.models.configs import resolve_config
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


def _gemma3_checkpoint(folder) -> torch.nn.Module:
    """A tiny Gemma 3 vision-language checkpoint (SigLIP tower + tiny-gemma3's text model) written as
    transformers writes one, with the bundled tokenizer: a stand-in for google/gemma-3-4b-it."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from bigtune.core.presets import preset_config, tiny_tokenizer

    tok = tiny_tokenizer()
    text = preset_config("tiny-gemma3", tok).to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    cfg = Gemma3Config(text_config=text, vision_config={**vision, "image_size": 28, "patch_size": 14})
    cfg.mm_tokens_per_image = 4
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(cfg)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return model


def test_gemma3_checkpoint_fine_tunes_its_text_model(tmp_path):
    """A Gemma 3 4B/12B checkpoint is a vision-language model; a causal-LM recipe builds its text model
    alone (no vision tower in memory), with the checkpoint's text weights, plans it, and its LoRA merge
    and generation load the same text model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

    from bigtune.models.build import build_model, load_tokenizer, text_model_kwargs
    from bigtune.recipe import load_recipe

    folder = tmp_path / "gemma-3-tiny-it"
    whole = _gemma3_checkpoint(folder)
    recipe = load_recipe({}, {"model.name": str(folder)})
    model = build_model(recipe.model, load_tokenizer(recipe.model), "32-true", 0)
    assert isinstance(model, Gemma3ForCausalLM) and not any("vision" in n for n, _ in model.named_parameters())
    text = whole.model.language_model.state_dict()
    assert all(torch.equal(v, text[k.removeprefix("model.")]) for k, v in model.model.state_dict().items())
    assert torch.equal(model.lm_head.weight, whole.lm_head.weight)

    run = tmp_path / "lora"
    over = {"peft.method": "lora", "optim.lr": 1e-2, "train.max_steps": 6, "checkpoint.save_model": True}
    s = _run(run, str(folder), **over)
    assert s["status"] == "ok" and s["final_loss"] < s["first_loss"], (s["first_loss"], s["final_loss"])
    assert abs(s["plan"]["peak_error_pct"]) < 2.0, s["plan"]["peak_error_pct"]  # planned as the text model

    merged = AutoModelForCausalLM.from_pretrained(export_run(run, merge=True, dtype="float32"))
    base = AutoModelForCausalLM.from_pretrained(str(folder), **text_model_kwargs(str(folder)))
    ref = PeftModel.from_pretrained(base, str(run / "adapter"))
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    assert isinstance(merged, Gemma3ForCausalLM)
    full = tmp_path / "full"  # a full fine-tune saves a text model's folder, in its own key names
    assert _run(full, str(folder), **{"train.max_steps": 2, "checkpoint.save_model": True})["status"] == "ok"
    from safetensors import safe_open

    with safe_open(str(full / "model" / "model.safetensors"), "pt") as f:
        assert all(k.startswith(("model.layers.", "model.embed_tokens.", "model.norm.")) for k in f.keys()), f.keys()
    assert isinstance(AutoModelForCausalLM.from_pretrained(full / "model"), Gemma3ForCausalLM)
    rows = _generate(run, tmp_path)  # the adapter run: its base is loaded as the text model again
    assert rows[0]["prompt"] == "Name a soup." and rows == _generate(run, tmp_path)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_moe_plans_on_a_gpu_in_any_precision(precision):
    """CUDA's grouped_mm runs non-bf16 experts through its per-expert fallback (GroupedBlas.cpp), so an fp32
    or mixed-precision MoE is planned for a GPU (its meta kernel alone would refuse anything but bf16). The
    GPU plan is the CPU plan (checked against measured peaks above) plus the 16 MiB of cuBLAS workspaces;
    the rest of the gap is CUDA's 512-byte rounding of this tiny model's many small tensors."""
    from bigtune.core.gpus import find_gpu
    from bigtune.plan.base.target import Target
    from bigtune.plan.planner import count_parameters, plan
    from bigtune.recipe import load_recipe

    over = {"model.name": "tiny-mixtral", "precision": precision, "data.max_seq_length": 64, "data.source": "demo"}
    gpu = plan(load_recipe({}, over), Target("cuda", find_gpu("a100-80gb")))
    cpu = plan(load_recipe({}, {**over, "accelerator": "cpu"}), Target("cpu"))
    n = count_parameters(resolve_config(load_recipe({}, over)))
    assert gpu.phases["before_forward"]["parameters"] == pytest.approx(4 * n, rel=0.01)  # fp32 weights
    assert gpu.peak_allocated - 16 * 2**20 == pytest.approx(cpu.peak_allocated, rel=0.10)


def test_gemma3_takes_the_chunked_loss_and_gemma2_does_not(tmp_path):
    """Gemma 3 leaves final_logit_softcapping unset, so its logits are lm_head's alone and the loss can be
    chunked (its 262k vocabulary makes the logits the peak at real size); Gemma 2 soft-caps them."""
    from bigtune.core.presets import preset_config, tiny_tokenizer
    from bigtune.models.build import has_plain_head

    assert has_plain_head(preset_config("tiny-gemma3", tiny_tokenizer()))
    assert not has_plain_head(preset_config("tiny-gemma2", tiny_tokenizer()))
    losses = {}
    for chunk in (None, 32):
        run = tmp_path / f"chunk{chunk}"
        s = _run(run, "tiny-gemma3", **{"train.loss_chunk_tokens": chunk, "train.max_steps": 3, "memory.plan": False})
        assert s["status"] == "ok"
        losses[chunk] = [m["loss"] for m in read_jsonl(run / "metrics.jsonl")]
    assert losses[32] == pytest.approx(losses[None], rel=1e-5)


def test_gemma3_checkpoint_streams_its_text_model_into_nf4(tmp_path):
    """QLoRA on the FSDP-shardable torchao NF4 base streams the text model's tensors out of the composite
    checkpoint by their stored names (one process here; tests/test_qlora_fsdp.py covers the sharding)."""
    pytest.importorskip("torchao", reason="the NF4 base under FSDP needs torchao: pip install 'bigtune[torchao]'")
    from transformers import Gemma3ForCausalLM

    from bigtune.models.nf4 import build_nf4_peft_model, is_nf4, to_nf4
    from bigtune.recipe import load_recipe

    folder = tmp_path / "gemma-3-tiny-it"
    whole = _gemma3_checkpoint(folder)
    over = {"model.name": str(folder), "model.quantize": "nf4", "model.quant_backend": "torchao", "peft.method": "lora"}
    r = load_recipe({}, over)
    model, _ = build_nf4_peft_model(r.model, r.peft, folder, r.precision, r.seed, checkpointing=False)
    base = model.get_base_model()
    assert isinstance(base, Gemma3ForCausalLM) and is_nf4(base.model.layers[0].mlp.up_proj.weight)
    got = base.model.layers[0].mlp.up_proj.weight  # the checkpoint's tensor, quantized the same way
    want = to_nf4(whole.model.language_model.layers[0].mlp.up_proj.weight.detach().to(got.dtype))
    assert torch.equal(got.get_original_weight(), want.get_original_weight())
    assert torch.equal(base.model.norm.weight.float(), whole.model.language_model.norm.weight.float())
    s = _run(tmp_path / "run", str(folder), **{**over, "train.max_steps": 3, "memory.plan": False})
    assert s["status"] == "ok"
