"""Image-to-text (BLIP-2): presets, image data sources, frozen parts in the memory table, training
(OPT and Flan-T5 text models, full and LoRA), the caption CLI. CPU, tiny."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest
import torch

from bigtune.core.stepmath import IGNORE_INDEX
from bigtune.data.images import DEMO_IMAGES, ImageCollator, TokenLayout, build_image_examples
from bigtune.data.text import DataError
from bigtune.models.build import build_model, freeze_parts, load_processor
from bigtune.recipe import DataConfig, ModelConfig, RecipeError, load_recipe
from bigtune.run.training import train
from conftest import HANG_GUARD_S, ROOT, read_jsonl, run_cli

DEMO = ROOT / "recipes" / "gourmetgram-demo.yaml"


# tiny models gain nothing from intra-op threads on a busy 2-core machine (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _overrides(run_dir: Path, **extra) -> dict:
    base = {
        "data.val_fraction": 0.0,
        "train.max_epochs": None,
        "train.max_steps": 3,
        "train.micro_batch_size": 8,
        "train.log_every_steps": 1,
        "memory.every_steps": 1,
        "checkpoint.save_model": False,
        "output_dir": str(run_dir),
        "name": "blip2-test",
    }
    base.update(extra)
    return base


def _demo_images(n: int) -> list[Path]:
    return sorted((DEMO_IMAGES / "images").glob("*.png"))[:n]


# -- presets and loading ------------------------------------------------------------------------------


@pytest.mark.parametrize("preset,decoder_only", [("tiny-blip2-opt", True), ("tiny-blip2-t5", False)])
def test_presets_build_and_processor_round_trips(tmp_path, preset, decoder_only):
    cfg = ModelConfig(name=preset, family="image-to-text")
    proc = load_processor(cfg)
    model = build_model(cfg, proc, "32-true", seed=0)
    assert type(model).__name__ == "Blip2ForConditionalGeneration"
    assert model.config.use_decoder_only_language_model is decoder_only
    tok = proc.tokenizer
    assert model.config.image_token_index == tok.convert_tokens_to_ids("<image>") == len(tok) - 1
    assert model.config.text_config.vocab_size == len(tok)
    # freeze_vision defaults to true: the vision encoder gets no gradients
    assert not any(p.requires_grad for p in model.vision_model.parameters())
    assert all(p.requires_grad for p in model.qformer.parameters())

    proc.save_pretrained(tmp_path / "m")
    model.save_pretrained(tmp_path / "m", safe_serialization=True)
    again = load_processor(ModelConfig(name=str(tmp_path / "m"), family="image-to-text"))
    assert again.num_query_tokens == proc.num_query_tokens
    assert again.tokenizer.convert_tokens_to_ids("<image>") == model.config.image_token_index
    from bigtune.data.images import open_image

    img = open_image(_demo_images(1)[0])
    a = proc(images=[img], text=["a bowl of rice"], return_tensors="pt")
    b = again(images=[img], text=["a bowl of rice"], return_tensors="pt")
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["pixel_values"], b["pixel_values"])
    assert a["input_ids"][0, : proc.num_query_tokens].tolist() == [model.config.image_token_index] * 4

    # a local folder loads the real way (from_pretrained, safetensors), frozen parts applied again
    loaded = build_model(
        ModelConfig(name=str(tmp_path / "m"), family="image-to-text", freeze_vision=False, freeze_language_model=True),
        again,
        "32-true",
        seed=0,
    )
    for (n, p), (n2, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n == n2 and torch.equal(p, q), n
    assert all(p.requires_grad for p in loaded.vision_model.parameters())
    assert not any(p.requires_grad for p in loaded.language_model.parameters())


# -- data -------------------------------------------------------------------------------------------------


def _records(tmp_path: Path) -> list[tuple[str | None, str]]:
    """Six records: 0, 2, 5 good; 1 a truncated image; 3 a missing file; 4 an empty caption."""
    imgs = _demo_images(4)
    (tmp_path / "img").mkdir()
    for p in imgs:
        shutil.copy(p, tmp_path / "img" / p.name)
    (tmp_path / "img" / "broken.png").write_bytes(imgs[1].read_bytes()[:60])
    return [
        (f"img/{imgs[0].name}", "a bowl of rice on a wooden table"),
        ("img/broken.png", "a plate of rice"),
        (f"img/{imgs[2].name}", "tomato soup in a bowl"),
        ("img/gone.png", "a plate of cake"),
        (f"img/{imgs[3].name}", "   "),
        (f"img/{imgs[0].name}", "the same photo, another caption"),
    ]


def _layout(proc, preset="tiny-blip2-opt"):
    from bigtune.models.configs import resolve_config_name

    return TokenLayout.for_model(proc, resolve_config_name(ModelConfig(name=preset, family="image-to-text")))


def _check_report(report, source_kind):
    assert report.records == 6 and report.used == 3, report
    reasons = dict(report.skipped)
    if source_kind == "disk":  # no file paths in a save_to_disk dataset: record 3 holds no image at all
        assert set(reasons) == {1, 3, 4}
        assert "missing image" in reasons[3]
    else:
        assert set(reasons) == {1, 3, 4}
        assert "missing image file" in reasons[3]
    assert "unreadable image" in reasons[1] and "truncated" in reasons[1]
    assert reasons[4] == "empty caption"


@pytest.mark.parametrize("kind", ["disk", "folder-jsonl", "folder-csv", "jsonl"])
def test_image_sources_skip_bad_records_by_index(tmp_path, kind):
    recs = _records(tmp_path)
    if kind == "disk":
        import datasets

        rows = {"image": [], "text": []}
        for rel, text in recs:
            p = tmp_path / rel
            rows["image"].append({"bytes": p.read_bytes(), "path": None} if p.exists() else None)
            rows["text"].append(text)
        ds = datasets.Dataset.from_dict(
            rows, features=datasets.Features({"image": datasets.Image(), "text": datasets.Value("string")})
        )
        datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "ds"))
        source = tmp_path / "ds"
    elif kind.startswith("folder"):
        if kind == "folder-jsonl":
            (tmp_path / "metadata.jsonl").write_text(
                "".join(json.dumps({"file_name": r, "text": t}) + "\n" for r, t in recs)
            )
        else:
            with (tmp_path / "metadata.csv").open("w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(["file_name", "text"])
                w.writerows(recs)
        source = tmp_path
    else:
        (tmp_path / "sub").mkdir()
        source = tmp_path / "sub" / "captions.jsonl"
        source.write_text("".join(json.dumps({"image": f"../{r}", "text": t}) + "\n" for r, t in recs))
    proc = load_processor(ModelConfig(name="tiny-blip2-opt", family="image-to-text"))
    lay = _layout(proc)
    cfg = DataConfig(source=str(source), max_seq_length=6)
    examples, report = build_image_examples(cfg, proc, lay, seed=0)
    _check_report(report, kind)
    assert report.truncated >= 1  # "the same photo, another caption" is longer than 6 tokens
    for e in examples:
        assert e.input_ids[:4] == [lay.image_token_id] * 4
        assert e.labels[:4] == [IGNORE_INDEX] * 4 and e.labels[4:] == e.input_ids[4:]
        assert len(e.input_ids) <= 4 + 6
    with pytest.raises(DataError, match="record 1"):
        build_image_examples(DataConfig(source=str(source), skip_bad_records=False), proc, lay, seed=0)


def test_num_train_samples_and_val_split_on_images():
    proc = load_processor(ModelConfig(name="tiny-blip2-opt", family="image-to-text"))
    cfg = DataConfig(source="demo", val_fraction=0.25, num_train_samples=50)
    ex, rep = build_image_examples(cfg, proc, _layout(proc), seed=3)
    assert rep.records == 320 and rep.validation == 80 and rep.used == len(ex) == 50
    train_imgs = {e.image for e in ex}
    assert not train_imgs & {e.image for e in rep.val_examples}
    ex2, _ = build_image_examples(cfg, proc, _layout(proc), seed=3)
    assert [e.image for e in ex2] == [e.image for e in ex]  # seeded


def test_t5_collator_builds_decoder_inputs_from_labels():
    proc = load_processor(ModelConfig(name="tiny-blip2-t5", family="image-to-text"))
    lay = _layout(proc, "tiny-blip2-t5")
    assert lay.encoder_decoder
    ids, labels, _ = lay.example([50, 60, 70], 10)
    assert ids == [lay.image_token_id] * 4 + [lay.eos_id] and labels == [50, 60, 70, lay.eos_id]
    _, labels2, _ = lay.example([80], 10)
    px = torch.zeros(3, 32, 32)
    from bigtune.data.images import ImageExample

    batch = ImageCollator(lay)([(px, ImageExample("x", ids, labels)), (px, ImageExample("y", ids, labels2))])
    assert batch["pixel_values"].shape == (2, 3, 32, 32)
    start, pad = lay.decoder_start_id, lay.pad_id
    assert batch["decoder_input_ids"].tolist() == [[start, 50, 60, 70], [start, 80, lay.eos_id, pad]]
    assert batch["labels"][1].tolist() == [80, lay.eos_id, IGNORE_INDEX, IGNORE_INDEX]


# -- recipes -------------------------------------------------------------------------------------------


def test_recipe_rules_for_image_to_text():
    with pytest.raises(RecipeError) as e:
        load_recipe(DEMO, {"model.family": "causal-lm"})
    assert "image-to-text preset" in str(e.value)
    with pytest.raises(RecipeError) as e:
        load_recipe(
            DEMO,
            {
                "data.source": "hf:some/dataset",
                "model.freeze_vision": True,
                "model.freeze_qformer": True,
                "model.freeze_language_model": True,
            },
        )
    msg = str(e.value)
    assert "hf:<id> is not supported" in msg and "all frozen" in msg
    with pytest.raises(RecipeError, match="only image-to-text"):
        load_recipe(None, {"model.freeze_qformer": True})
    for name in ("blip2-opt-2.7b", "blip2-opt-6.7b", "blip2-flan-t5-xl", "blip2-flan-t5-xxl"):
        r = load_recipe(ROOT / "recipes" / f"{name}.yaml", {"accelerator": "cpu"})
        # the lab's script trains every part (AdamW over model.parameters(), nothing frozen)
        assert r.model.family == "image-to-text" and r.optim.lr == 5e-6 and not r.model.freeze_vision


# -- training -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("freeze_qformer", [False, True])
def test_frozen_parts_have_no_gradients_or_optimizer_state(tmp_path, freeze_qformer):
    run = tmp_path / "run"
    s = train(
        str(DEMO),
        _overrides(run, **{"model.freeze_vision": True, "model.freeze_qformer": freeze_qformer, "train.max_steps": 2}),
    )
    assert s["status"] == "ok"
    cfg = ModelConfig(name="tiny-blip2-opt", family="image-to-text", freeze_vision=True, freeze_qformer=freeze_qformer)
    model = build_model(cfg, load_processor(cfg), "32-true", seed=0)
    frozen = freeze_parts(model, cfg)
    trainable = [p for p in model.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in trainable)
    total = sum(p.numel() for p in model.parameters())
    assert frozen["vision"] > 0 and (frozen["qformer"] > 0) == freeze_qformer
    assert numel == total - frozen["vision"] - frozen["qformer"] == s["parameters"]["trainable"]
    snaps = read_jsonl(run / "memory.jsonl")
    for snap in snaps:
        assert snap["parameters"] == total * 4
        if snap["phase"] in ("after_backward", "after_optimizer"):
            assert snap["gradients"] == numel * 4
        if snap["step"] >= 1 or snap["phase"] == "after_optimizer":
            # AdamW: exp_avg + exp_avg_sq for trainable parameters only, plus a float32 step per tensor
            assert snap["optimizer_device"] == 2 * numel * 4 + 4 * len(trainable)


def test_loss_falls_on_the_demo_recipe(tmp_path):
    run = tmp_path / "run"
    s = train(
        str(DEMO), _overrides(run, **{"train.max_steps": 30, "train.micro_batch_size": 16, "memory.every_steps": 100})
    )
    losses = [m["loss"] for m in read_jsonl(run / "metrics.jsonl")]
    assert s["status"] == "ok" and len(losses) == 30
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < losses[0] - 2.5, losses


def test_t5_variant_trains(tmp_path):
    run = tmp_path / "run"
    s = train(
        str(DEMO),
        _overrides(
            run,
            **{
                "model.name": "tiny-blip2-t5",
                "train.max_steps": 12,
                "memory.every_steps": 100,
                "optim.warmup_steps": 2,
            },
        ),
    )
    losses = [m["loss"] for m in read_jsonl(run / "metrics.jsonl")]
    assert s["status"] == "ok" and all(map(lambda x: x == x, losses))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses


def test_lora_blip2_trains_and_captions_from_the_run(tmp_path):
    run = tmp_path / "run"
    s = train(
        str(DEMO),
        _overrides(
            run, **{"peft.method": "lora", "train.max_steps": 4, "checkpoint.save_model": True, "optim.lr": 1e-2}
        ),
    )
    assert s["status"] == "ok"
    # default targets: the OPT language model's q_proj and v_proj only (2 layers × 2 × (64·8 + 8·64))
    assert s["parameters"]["trainable"] == 2 * 2 * (64 * 8 + 8 * 64)
    assert (run / "adapter" / "adapter_config.json").is_file() and (run / "base" / "config.json").is_file()
    cfg = json.loads((run / "adapter" / "adapter_config.json").read_text())
    assert "language_model" in str(cfg["target_modules"])
    imgs = tmp_path / "photos"
    imgs.mkdir()
    for p in _demo_images(3):
        shutil.copy(p, imgs / p.name)
    (imgs / "corrupt.jpg").write_bytes(b"not an image at all")
    out = tmp_path / "alt.csv"
    res = run_cli(
        "caption",
        str(imgs),
        "--model",
        str(run),
        "--out",
        str(out),
        "--batch-size",
        "2",
        "--max-new-tokens",
        "8",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert [Path(r["image"]).name for r in rows] == [p.name for p in _demo_images(3)]
    assert "skipped" in res.stderr and "corrupt.jpg" in res.stderr and "unreadable image" in res.stderr
    assert "3 captioned" in res.stderr


def test_caption_cli_full_model_jsonl(tmp_path):
    run = tmp_path / "run"
    s = train(str(DEMO), _overrides(run, **{"train.max_steps": 2, "checkpoint.save_model": True}))
    assert s["status"] == "ok" and (run / "model" / "config.json").is_file()
    good = _demo_images(2)
    bad = tmp_path / "trunc.png"
    bad.write_bytes(good[0].read_bytes()[:80])
    out = tmp_path / "alt.jsonl"
    res = run_cli(
        "caption",
        *map(str, good),
        str(bad),
        str(tmp_path / "missing.png"),
        "--model",
        str(run / "model"),
        "--out",
        str(out),
        "--max-new-tokens",
        "6",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    rows = read_jsonl(out)
    assert [r["image"] for r in rows] == [str(p) for p in good]
    assert all(isinstance(r["caption"], str) for r in rows)
    assert "trunc.png" in res.stderr and "missing image file" in res.stderr
    assert "caption: 2/2 images" in res.stderr


def test_export_merges_blip2_lora_into_a_captioning_model(tmp_path):
    from bigtune.use.export import export_run

    run = tmp_path / "run"
    train(
        str(DEMO),
        _overrides(
            run, **{"peft.method": "lora", "train.max_steps": 2, "checkpoint.save_model": True, "optim.lr": 1e-2}
        ),
    )
    merged = export_run(run, merge=True)
    assert (merged / "config.json").is_file() and (merged / "processor_config.json").is_file()
    from bigtune.use.caption import caption_images, load_captioner

    model, proc = load_captioner(str(merged), device="cpu")
    assert not any("lora" in n for n, _ in model.named_parameters())
    rows, bad = caption_images(model, proc, [str(p) for p in _demo_images(2)], max_new_tokens=4, progress=False)
    assert len(rows) == 2 and not bad


def test_caption_a_folder_twice_is_identical_and_skips_the_corrupt_image(tmp_path):
    import shutil

    run = tmp_path / "run"
    s = train(str(DEMO), _overrides(run, **{"train.max_steps": 2, "checkpoint.save_model": True}))
    assert s["status"] == "ok"
    folder = tmp_path / "photos"
    folder.mkdir()
    for p in _demo_images(3):
        shutil.copy(p, folder / p.name)
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really an image")
    outs = []
    for i in range(2):
        out = tmp_path / f"alt{i}.jsonl"
        res = run_cli(
            "caption",
            str(folder),
            "--model",
            str(run / "model"),
            "--out",
            str(out),
            "--max-new-tokens",
            "6",
            cwd=tmp_path,
        )
        assert res.returncode == 0, res.stderr
        assert "broken.png" in res.stderr
        outs.append(read_jsonl(out))
    assert len(outs[0]) == 3 and outs[0] == outs[1]


def test_real_hub_recipe_validates_and_fails_clearly_offline(tmp_path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1")
    recipe = ROOT / "recipes" / "blip2-opt-2.7b.yaml"
    ok = subprocess.run(
        [sys.executable, "-m", "bigtune", "recipe", str(recipe)], env=env, capture_output=True, text=True, cwd=tmp_path
    )
    assert ok.returncode == 0, ok.stderr
    res = subprocess.run(
        [sys.executable, "-m", "bigtune", "train", str(recipe), "--set", "train.max_steps=1"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=HANG_GUARD_S,
    )
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-2000:]
    assert res.stderr.startswith("bigtune: error:") and "Traceback" not in res.stderr
    assert "Salesforce/blip2-opt-2.7b" in res.stderr and "local folder" in res.stderr
    assert not (tmp_path / "runs").exists()
