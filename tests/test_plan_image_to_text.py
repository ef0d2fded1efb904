"""bigtune plan for BLIP-2 (image-to-text): exact on CPU against the engine's measurement, including
the per-stack depth extrapolation (vision, Q-Former, OPT or T5 encoder/decoder), and on real shapes."""

from __future__ import annotations

import json

import pytest

from bigtune.core.gpus import find_gpu
from bigtune.core.presets import preset_config, tiny_processor
from bigtune.data.images import DEMO_IMAGES
from bigtune.models.configs import resolve_config
from bigtune.plan.base.constants import GIB
from bigtune.plan.base.target import Target
from bigtune.plan.planner import count_parameters, plan
from bigtune.plan.step.simulate import model_stacks, total_blocks
from bigtune.recipe import load_recipe
from bigtune.run.training import train
from conftest import ROOT, read_jsonl, run_cli

DEMO = ROOT / "recipes" / "gourmetgram-demo.yaml"


# tiny models gain nothing from intra-op threads on a busy 2-core machine (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def long_captions(tmp_path_factory):
    """Captions longer than max_seq_length: every caption is cut to full length, no padding."""
    d = tmp_path_factory.mktemp("captions")
    images = sorted((DEMO_IMAGES / "images").glob("*.png"))
    rows = [
        {"image": str(images[i % len(images)]), "text": f"a plate {i} of tomato soup with basil and bread " * 6}
        for i in range(32)
    ]
    path = d / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _deep_model(tmp_path, preset: str):
    """A local folder with a deeper BLIP-2 config (3 vision, 4 Q-Former, 3 text layers) and its
    processor: the planner extrapolates it from shallow simulations, the engine builds it in full."""
    proc = tiny_processor()
    cfg = preset_config(preset, proc)
    cfg.vision_config.num_hidden_layers = 3
    cfg.qformer_config.num_hidden_layers = 4
    if cfg.text_config.is_encoder_decoder:
        cfg.text_config.num_layers, cfg.text_config.num_decoder_layers = 3, 4
    else:
        cfg.text_config.num_hidden_layers = 3
    folder = tmp_path / f"deep-{preset}"
    cfg.save_pretrained(folder)
    proc.save_pretrained(folder)
    return str(folder)


MATRIX = [
    # preset, precision, optimizer, checkpointing, accumulation, peft, quantize, deep
    ("tiny-blip2-opt", "32-true", "adamw", False, 1, "none", "none", False),
    ("tiny-blip2-opt", "bf16-true", "sgd", True, 2, "none", "none", False),
    ("tiny-blip2-opt", "32-true", "adamw", False, 2, "none", "none", True),
    ("tiny-blip2-opt", "bf16-true", "adamw", False, 1, "lora", "nf4", False),
    ("tiny-blip2-t5", "bf16-mixed", "adamw", False, 1, "none", "none", False),
    ("tiny-blip2-t5", "32-true", "adamw", True, 1, "lora", "none", True),
]


@pytest.mark.parametrize("preset, precision, optim, ckpt, acc, peft, quantize, deep", MATRIX)
def test_blip2_plan_matches_measurement(
    tmp_path, long_captions, preset, precision, optim, ckpt, acc, peft, quantize, deep
):
    over = {
        "model.name": _deep_model(tmp_path, preset) if deep else preset,
        "model.family": "image-to-text",
        "data.source": str(long_captions),
        "data.val_fraction": 0.0,
        "data.max_seq_length": 12,
        "train.micro_batch_size": 4,
        "train.accumulate_grad_batches": acc,
        "train.max_steps": 3,
        "train.max_epochs": None,
        "memory.every_steps": 1,
        "checkpoint.save_model": False,
        "accelerator": "cpu",
        "precision": precision,
        "optim.name": optim,
        "train.activation_checkpointing": ckpt,
        "peft.method": peft,
        "model.quantize": quantize,
        "output_dir": str(tmp_path / "run"),
        "memory.plan": False,
    }
    if deep:
        over["model.init"] = "random"
    summary = train(str(DEMO), over, quiet_recipe=True)
    r = load_recipe(str(DEMO), over)
    predicted = plan(r, Target("cpu"))
    if deep:  # the extrapolation is really exercised: every stack is deeper than one simulated unit
        cfg = resolve_config(r)
        assert total_blocks(cfg) >= 10 and len(model_stacks(cfg)) == (4 if preset.endswith("t5") else 3)
    steady = {s["phase"]: s for s in read_jsonl(tmp_path / "run" / "memory.jsonl") if s["step"] == 2}
    assert steady["before_forward"]["batch_shape"] == [4, 12]
    cats = (
        ("gradients", "optimizer_device", "optimizer_cpu")
        if quantize != "none"
        else ("parameters", "gradients", "optimizer_device", "optimizer_cpu")
    )
    for phase, s in steady.items():
        for cat in cats:
            assert s[cat] == predicted.phases[phase][cat], (phase, cat, s[cat], predicted.phases[phase][cat])
    if quantize != "none":  # analytic 4-bit bytes: within 1 % of bitsandbytes' real storage
        got, want = predicted.phases["before_forward"]["parameters"], steady["before_forward"]["parameters"]
        assert abs(got - want) / want < 0.01, (got, want)
    measured = summary["peak_allocated_bytes"]
    assert abs(predicted.peak_allocated - measured) / measured < 0.02, (predicted.peak_allocated, measured)


def test_plan_cli_on_the_demo_blip2(tmp_path):
    res = run_cli("plan", str(DEMO), "--json", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    p = json.loads(res.stdout)["plan"]
    assert p["peak_allocated"] > 0 and p["phases"]["after_backward"]["gradients"] > 0


# -- real shapes (bundled configs, fake tensors) -------------------------------------------------------


def test_bundled_blip2_configs_have_the_published_sizes():
    counts = {}
    for name in ("blip2-opt-2.7b", "blip2-opt-6.7b", "blip2-flan-t5-xl", "blip2-flan-t5-xxl"):
        cfg = resolve_config(load_recipe(ROOT / "recipes" / f"{name}.yaml", {"accelerator": "cpu"}))
        counts[name] = count_parameters(cfg)
    # the checkpoints' published sizes (model cards): 3.74 B, 7.75 B, 3.94 B, 12.2 B
    published = {
        "blip2-opt-2.7b": 3.74e9,
        "blip2-opt-6.7b": 7.75e9,
        "blip2-flan-t5-xl": 3.94e9,
        "blip2-flan-t5-xxl": 12.2e9,
    }
    for name, n in published.items():
        if "t5" in name:
            # transformers 5 builds BLIP-2's Flan-T5 with the encoder and decoder token tables
            # separate from the shared one when tie_word_embeddings is false (seen on the tiny preset
            # through from_config and from_pretrained): two more vocab × d_model tables than the cards.
            t = resolve_config(load_recipe(ROOT / "recipes" / f"{name}.yaml", {"accelerator": "cpu"})).text_config
            n += 2 * t.vocab_size * t.d_model
        assert abs(counts[name] - n) / n < 0.01, (name, counts[name])


def test_blip2_physics_on_real_shapes():
    lab = load_recipe(ROOT / "recipes" / "blip2-opt-2.7b.yaml", {"accelerator": "cpu", "train.micro_batch_size": 4})
    base = load_recipe(lab.to_dict(), {"model.freeze_vision": True})
    cfg = resolve_config(base)
    target = Target("cuda", find_gpu("h100-80gb"), 1)
    # the lab trains every part (nothing frozen): all 3.74 B parameters get fp32 gradients
    # (categories only: the allocator replay is skipped for speed)
    grads = plan(lab, target, config=cfg, replay=False).phases["after_backward"]["gradients"]
    assert grads / 4 == pytest.approx(3.745e9, rel=0.01)
    fp32 = plan(base, target, config=cfg, replay=False)
    bf16 = plan(load_recipe(base.to_dict(), {"precision": "bf16-true"}), target, config=cfg, replay=False)
    lora = plan(load_recipe(base.to_dict(), {"peft.method": "lora"}), target, config=cfg, replay=False)
    ph32, ph16 = fp32.phases["after_optimizer"], bf16.phases["after_optimizer"]
    assert ph16["parameters"] == pytest.approx(ph32["parameters"] / 2, rel=0.01)
    # the frozen ViT-g (~1 B params) has no gradients and no Adam state
    trainable = ph32["gradients"] / 4
    assert 2.7e9 < trainable < 2.9e9, trainable
    assert ph32["optimizer_device"] == pytest.approx(2 * ph32["gradients"], rel=0.001)
    # LoRA on the OPT q/v projections: gradients and state are megabytes, not gigabytes
    assert lora.phases["after_optimizer"]["gradients"] < 0.05 * GIB
    assert fp32.step_time_s and bf16.step_time_s < fp32.step_time_s
