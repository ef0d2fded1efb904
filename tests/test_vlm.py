"""Chat vision-language models (issue #27): Qwen2-VL / Qwen2.5-VL presets and their local processor, the
caption as the answer to data.prompt (loss on the answer only), image-token counts that follow the image
size, training on the bundled food photos, `bigtune caption`, and LoRA merged == adapter. CPU, tiny."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bigtune.core.stepmath import IGNORE_INDEX
from bigtune.data import vlm
from bigtune.data.images import DEMO_IMAGES, build_image_examples, open_image
from bigtune.data.text import DataError
from bigtune.models.build import build_model, load_processor
from bigtune.models.configs import resolve_config_name
from bigtune.recipe import DataConfig, ModelConfig
from bigtune.run.training import train
from conftest import ROOT, read_jsonl, run_cli

DEMO = ROOT / "recipes" / "gourmetgram-qwen2-vl-demo.yaml"
PROMPT = "Write alt text for this photo."


# tiny models gain nothing from intra-op threads on a busy 2-core machine (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _demo_images(n: int) -> list[Path]:
    return sorted((DEMO_IMAGES / "images").glob("*.png"))[:n]


def _overrides(run: Path, **extra) -> dict:
    base = {
        "data.val_fraction": 0.0,
        "train.max_epochs": None,
        "train.max_steps": 3,
        "train.micro_batch_size": 8,
        "train.log_every_steps": 1,
        "optim.warmup_steps": 0,
        "memory.every_steps": 1000,
        "checkpoint.save_model": False,
        "output_dir": str(run),
    }
    base.update(extra)
    return base


def _layout(preset: str = "tiny-qwen2-vl", prompt: str = PROMPT):
    cfg = ModelConfig(name=preset, family="image-to-text")
    proc = load_processor(cfg)
    return proc, vlm.ChatImageLayout.for_model(proc, resolve_config_name(cfg), prompt)


# -- presets and processor --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset,arch", [("tiny-qwen2-vl", "Qwen2VLForConditionalGeneration"), ("tiny-qwen2.5-vl", "Qwen2_5_VL")]
)
def test_preset_processor_round_trips_and_parts_freeze(tmp_path, preset, arch):
    cfg = ModelConfig(name=preset, family="image-to-text")
    proc = load_processor(cfg)
    model = build_model(cfg, proc, "32-true", seed=0)
    assert type(model).__name__.startswith(arch)
    tok = proc.tokenizer
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert model.config.vision_start_token_id == tok.convert_tokens_to_ids("<|vision_start|>")
    assert model.config.text_config.vocab_size == len(tok)
    assert tok.eos_token == "<|im_end|>" and model.config.text_config.eos_token_id == tok.eos_token_id

    # saved and loaded from a folder (no torchvision here: the image-only processor), same inputs
    proc.save_pretrained(tmp_path / "m")
    again = load_processor(ModelConfig(name=str(tmp_path / "m"), family="image-to-text"))
    assert type(again).__name__ == type(proc).__name__
    text = proc.tokenizer.apply_chat_template(
        vlm.conversation(PROMPT), chat_template=again.chat_template, tokenize=False
    )
    img = open_image(_demo_images(1)[0])
    a, b = proc(images=[img], text=[text], return_tensors="pt"), again(images=[img], text=[text], return_tensors="pt")
    for key in ("input_ids", "pixel_values", "image_grid_thw"):
        assert torch.equal(a[key], b[key]), key
    # a 32×32 photo: 56×56 pixels at the smallest size, 4×4 patches of 14, 2×2 merged: 4 image tokens
    assert a["image_grid_thw"].tolist() == [[1, 4, 4]]
    assert int((a["input_ids"] == model.config.image_token_id).sum()) == 4

    # freeze defaults: the vision encoder frozen; the merger (freeze_qformer) and the language model train
    visual = model.model.visual
    assert not any(p.requires_grad for n, p in visual.named_parameters() if not n.startswith("merger."))
    assert all(p.requires_grad for p in visual.merger.parameters())
    assert all(p.requires_grad for p in model.model.language_model.parameters())
    merger_only = build_model(
        ModelConfig(name=preset, family="image-to-text", freeze_vision=False, freeze_qformer=True), proc, "32-true", 0
    )
    assert all(p.requires_grad for n, p in merger_only.model.visual.named_parameters() if not n.startswith("merger."))
    assert not any(p.requires_grad for p in merger_only.model.visual.merger.parameters())
    lm_frozen = build_model(
        ModelConfig(name=preset, family="image-to-text", freeze_language_model=True), proc, "32-true", 0
    )
    assert not any(p.requires_grad for p in lm_frozen.model.language_model.parameters())
    assert not lm_frozen.lm_head.weight.requires_grad
    assert all(p.requires_grad for p in lm_frozen.model.visual.merger.parameters())


# -- data -------------------------------------------------------------------------------------------------


def test_loss_on_the_answer_only_and_truncation():
    proc, layout = _layout()
    tok = proc.tokenizer
    ids, labels, truncated = layout.encode(tok, "rice in a bowl", 200)
    n = len(layout.prompt_ids)
    assert not truncated and ids[:n] == layout.prompt_ids and labels[:n] == [IGNORE_INDEX] * n
    # the answer is what the generation prompt is followed by: the caption and the template's end of turn
    assert tok.decode(ids[n:]) == "rice in a bowl<|im_end|>\n" and labels[n:] == ids[n:]
    prompt_text = tok.apply_chat_template(
        vlm.conversation(PROMPT), chat_template=layout.template, tokenize=False, add_generation_prompt=True
    )
    assert tok.decode(layout.prompt_ids) == prompt_text and prompt_text.endswith("<|im_start|>assistant\n")
    assert layout.prompt_ids.count(layout.image_token_id) == 1  # expanded per image by the dataset

    cut, cut_labels, truncated = layout.encode(tok, "rice in a bowl on a wooden table", n + 3)
    assert truncated and len(cut) == n + 3 and sum(x != IGNORE_INDEX for x in cut_labels) == 3
    with pytest.raises(DataError, match="data.max_seq_length"):
        layout.encode(tok, "rice", n)
    with pytest.raises(DataError, match="data.prompt is empty"):
        _layout(prompt="  ")


def _sized_source(tmp_path: Path) -> Path:
    """A JSONL of two photos: one 32×32 (4 image tokens), one stretched to 96×32 (8 image tokens)."""
    from PIL import Image

    a, b = _demo_images(2)
    wide = tmp_path / "wide.png"
    Image.open(b).convert("RGB").resize((96, 32)).save(wide)
    src = tmp_path / "pairs.jsonl"
    rows = [{"image": str(a), "text": "rice in a bowl"}, {"image": str(wide), "text": "a wide plate of strawberries"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src


def test_two_image_sizes_give_different_token_counts_and_train(tmp_path):
    proc, layout = _layout()
    src = _sized_source(tmp_path)
    examples, _ = build_image_examples(DataConfig(source=str(src), max_seq_length=96), proc, layout, seed=0)
    examples.sort(key=lambda e: len(e.input_ids))  # (the builder shuffles)
    ds = vlm.ChatImageDataset(examples, proc.image_processor, layout)
    items = [ds[0], ds[1]]
    counts = sorted(int((torch.tensor(x["input_ids"]) == layout.image_token_id).sum()) for x in items)
    assert counts == [4, 8]
    batch = vlm.ChatImageCollator(layout)(items)
    assert sorted(batch["mm_token_type_ids"].sum(1).tolist()) == [4, 8]
    assert batch["pixel_values"].shape[0] == 4 * 4 + 4 * 8  # the images' patches, concatenated
    assert batch["padded"] and bool((batch["attention_mask"] == 0).any())
    # image and padding positions carry no loss
    assert bool((batch["labels"][batch["mm_token_type_ids"] == 1] == IGNORE_INDEX).all())
    assert bool((batch["labels"][batch["attention_mask"] == 0] == IGNORE_INDEX).all())

    # and the engine trains on such batches (two sizes in one micro-batch, padded per batch)
    s = train(
        str(DEMO),
        _overrides(tmp_path / "run", **{"data.source": str(src), "train.micro_batch_size": 2, "train.max_steps": 3}),
    )
    assert s["status"] == "ok" and torch.isfinite(torch.tensor(s["final_loss"]))


# -- training, caption, merge -------------------------------------------------------------------------------


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r and "val_loss" not in r]


def test_train_caption_and_lora_merged_equals_adapter(tmp_path):
    run = tmp_path / "full"
    s = train(str(DEMO), _overrides(run, **{"train.max_steps": 20, "checkpoint.save_model": True}))
    assert s["status"] == "ok"
    losses = _losses(run)
    assert len(losses) == 20 and losses[-1] < 0.6 * losses[0], losses  # ~6.1 → ~2.6 on the bundled photos

    photos = tmp_path / "photos"
    photos.mkdir()
    for p in _demo_images(4):
        shutil.copy(p, photos / p.name)
    out = tmp_path / "alt.jsonl"
    res = run_cli(
        "caption", str(photos), "--model", str(run), "--out", str(out), "--max-new-tokens", "12", cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    rows = read_jsonl(out)
    assert [Path(r["image"]).name for r in rows] == [p.name for p in _demo_images(4)]
    assert all(r["caption"].strip() for r in rows) and "4 captioned" in res.stderr

    # LoRA on top of the trained model (as on a pretrained one), then merged: the same greedy captions
    lora = tmp_path / "lora"
    s = train(
        str(DEMO),
        _overrides(
            lora,
            **{
                "model.name": str(run / "model"),
                "peft.method": "lora",
                "optim.lr": 1e-2,
                "train.max_steps": 5,
                "checkpoint.save_model": True,
            },
        ),
    )
    assert s["status"] == "ok"
    cfg = json.loads((lora / "adapter" / "adapter_config.json").read_text())
    assert "language_model" in str(cfg["target_modules"])
    from bigtune.use.caption import caption_images, load_captioner
    from bigtune.use.export import export_run

    merged = export_run(lora, merge=True)
    paths = [str(p) for p in _demo_images(6)]
    adapter_model, adapter_proc = load_captioner(str(lora))
    merged_model, merged_proc = load_captioner(str(merged))
    with_adapter, _ = caption_images(adapter_model, adapter_proc, paths, batch_size=3, progress=False)
    from_merged, _ = caption_images(merged_model, merged_proc, paths, batch_size=3, progress=False)
    assert [r["caption"] for r in with_adapter] == [r["caption"] for r in from_merged]
    # the adapters changed the model (so the equality says something), and merging kept what they do
    batch = vlm.generation_batch(
        vlm.ChatImageLayout.for_model(merged_proc, merged_model.config, PROMPT),
        merged_proc.image_processor,
        [open_image(p) for p in paths[:2]],
    )
    base_model, _ = load_captioner(str(run / "model"))
    with torch.no_grad():
        a, m, b = (x(**batch).logits for x in (adapter_model, merged_model, base_model))
    assert torch.allclose(a, m, atol=1e-4) and not torch.allclose(a, b, atol=1e-4)
