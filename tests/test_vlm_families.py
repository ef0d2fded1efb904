"""Fixed-resolution vision-language models (issue #27), one tiny preset per family: LLaVA-1.5 (CLIP +
projector + Llama, chat template), PaliGemma and PaliGemma 2 (SigLIP + Gemma / Gemma-2, prefix LM); and the
tiling ones, SmolVLM (Idefics3) and LLaVA-NeXT (anyres: tile grids + the whole image, row newlines). Each:
its processor built locally and reloaded from a folder, the same ids as the family's own processor,
parts frozen by name, 20 steps on the bundled food photos (loss falls), `bigtune caption` on a folder,
and LoRA merged == adapter. CPU, tiny. (Qwen2-VL / Qwen2.5-VL: tests/test_vlm.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bigtune.core.stepmath import IGNORE_INDEX
from bigtune.data import vlm
from bigtune.data.images import DEMO_IMAGES, open_image
from bigtune.models.build import build_model, load_processor
from bigtune.recipe import ModelConfig
from bigtune.run.training import train
from conftest import ROOT, read_jsonl, run_cli

RECIPE = ROOT / "recipes" / "gourmetgram-qwen2-vl-demo.yaml"  # the chat-VLM demo, its model swapped
PROMPT = "Write alt text for this photo."
CAPTION = "rice in a bowl"

# preset, model class, whether it is a prefix LM
FAMILIES = [
    ("tiny-llava", "LlavaForConditionalGeneration", False),
    ("tiny-paligemma", "PaliGemmaForConditionalGeneration", True),
    ("tiny-paligemma2", "PaliGemmaForConditionalGeneration", True),
]
# ... and SmolVLM (Idefics3), whose image becomes tiles + the whole image, written out in the text
SMOLVLM = ("tiny-smolvlm", "Idefics3ForConditionalGeneration", False)
# ... and LLaVA-NeXT, whose image is fitted into one of several tile grids, its token count following its shape
LLAVA_NEXT = ("tiny-llava-next", "LlavaNextForConditionalGeneration", False)

# each architecture's vision tower, projector / connector and language model
PARTS = {
    "Idefics3ForConditionalGeneration": ("vision_model", "connector", "text_model"),
    "LlavaForConditionalGeneration": ("vision_tower", "multi_modal_projector", "language_model"),
    "LlavaNextForConditionalGeneration": ("vision_tower", "multi_modal_projector", "language_model"),
    "PaliGemmaForConditionalGeneration": ("vision_tower", "multi_modal_projector", "language_model"),
}


# tiny models gain nothing from intra-op threads on a busy 2-core machine (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _demo_images(n: int) -> list[Path]:
    return sorted((DEMO_IMAGES / "images").glob("*.png"))[:n]


def _overrides(preset: str, run: Path, **extra) -> dict:
    base = {
        "model.name": preset,
        "data.val_fraction": 0.0,
        "train.max_epochs": None,
        "train.max_steps": 20,
        "train.micro_batch_size": 8,
        "train.log_every_steps": 1,
        "optim.warmup_steps": 0,
        "memory.every_steps": 1000,
        "memory.plan": False,  # planned in tests/test_plan_vlm_families.py
        "checkpoint.save_model": True,
        "output_dir": str(run),
    }
    base.update(extra)
    return base


def _example(layout, tok, image: Path) -> dict:
    ids, labels, _ = layout.encode(tok, CAPTION, 96)
    return type("Example", (), {"image": str(image), "input_ids": ids, "labels": labels})()


# -- presets, processors, layout ------------------------------------------------------------------------------


@pytest.mark.parametrize("preset,arch,prefix_lm", FAMILIES)
def test_processor_round_trips_and_batches_match_the_processor(tmp_path, preset, arch, prefix_lm):
    cfg = ModelConfig(name=preset, family="image-to-text")
    proc = load_processor(cfg)
    model = build_model(cfg, proc, "32-true", seed=0)
    assert type(model).__name__ == arch
    tok = proc.tokenizer
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<image>")
    assert model.config.get_text_config().vocab_size == len(tok)

    # saved and loaded from a folder: the same processor class and the same ids
    proc.save_pretrained(tmp_path / "p")
    again = load_processor(ModelConfig(name=str(tmp_path / "p"), family="image-to-text"))
    assert type(again).__name__ == type(proc).__name__ and len(again.tokenizer) == len(tok)

    layout = vlm.ChatImageLayout.for_model(again, model.config, PROMPT)
    assert layout.prefix_lm == prefix_lm and layout.image_tokens == 16  # 32 px / patch 8, no class token
    ids, labels, _ = layout.encode(again.tokenizer, CAPTION, 96)
    n = len(layout.prompt_ids)
    assert labels[:n] == [IGNORE_INDEX] * n and labels[n:] == ids[n:] and ids[-1] == tok.eos_token_id
    img = _demo_images(1)[0]
    batch = vlm.ChatImageCollator(layout)(
        [vlm.ChatImageDataset([_example(layout, again.tokenizer, img)], again.image_processor, layout)[0]]
    )
    assert int((batch["input_ids"] == layout.image_token_id).sum()) == 16 and batch["pixel_values"].shape == (
        1,
        3,
        32,
        32,
    )
    if prefix_lm:
        # PaliGemma's processor with the caption as its suffix: the same ids, token types, labels and pixels
        ref = proc(images=[open_image(img)], text=[PROMPT], suffix=[CAPTION], return_tensors="pt")
        for key in ("input_ids", "token_type_ids", "labels"):
            assert batch[key].tolist() == ref[key].tolist(), key
        assert tok.decode(batch["input_ids"][0][batch["token_type_ids"][0] == 1]) == CAPTION + tok.eos_token
    else:
        # LlavaProcessor on the rendered exchange: the same ids, and bigtune's EOS after the answer, which
        # llava-hf's template does not write (without it the model would not learn to stop)
        text = tok.apply_chat_template(vlm.conversation(PROMPT, CAPTION), chat_template=layout.template, tokenize=False)
        ref = proc(images=[open_image(img)], text=[text], return_tensors="pt")
        assert batch["input_ids"][0].tolist() == ref["input_ids"][0].tolist() + [tok.eos_token_id]
        assert "token_type_ids" not in batch
    assert torch.allclose(batch["pixel_values"], ref["pixel_values"])


def test_smolvlm_splits_images_as_its_processor_does(tmp_path):
    """Idefics3Processor (SmolVLM) on the rendered exchange: the same ids for a square photo (2×2 tiles + the
    whole image) and a wide one (1×2 tiles), the same pixels, tiles padded with all-zero images; the processor
    saved and reloaded from a folder."""
    cfg = ModelConfig(name="tiny-smolvlm", family="image-to-text")
    proc = load_processor(cfg)
    proc.save_pretrained(tmp_path / "p")
    again = load_processor(ModelConfig(name=str(tmp_path / "p"), family="image-to-text"))
    assert type(again).__name__ == "Idefics3Processor" and again.image_seq_len == 4
    model = build_model(cfg, again, "32-true", seed=0)
    assert type(model).__name__ == SMOLVLM[1] and model.config.get_text_config().vocab_size == len(again.tokenizer)
    layout = vlm.ChatImageLayout.for_model(again, model.config, PROMPT)
    tok = again.tokenizer
    square = _demo_images(1)[0]
    wide = tmp_path / "wide.png"
    open_image(square).resize((100, 30)).save(wide)
    examples = [_example(layout, tok, p) for p in (square, wide)]
    batch = vlm.ChatImageCollator(layout)(list(vlm.ChatImageDataset(examples, again.image_processor, layout)))
    text = tok.apply_chat_template(vlm.conversation(PROMPT, CAPTION), chat_template=layout.template, tokenize=False)
    image_tokens = []
    for i, img in enumerate((square, wide)):
        ref = again(images=[[open_image(img)]], text=[text], return_tensors="pt")
        n = int(batch["attention_mask"][i].sum())
        assert batch["input_ids"][i, :n].tolist() == ref["input_ids"][0].tolist()  # EOS: <end_of_utterance>
        tiles = ref["pixel_values"].shape[1]
        assert torch.equal(batch["pixel_values"][i, :tiles], ref["pixel_values"][0])
        assert not batch["pixel_values"][i, tiles:].any()  # the padding images
        image_tokens.append(int((ref["input_ids"][0] == layout.image_token_id).sum()))
    assert image_tokens == [5 * 4, 3 * 4]  # (2×2 + 1) and (1×2 + 1) images of 4 tokens
    labels, ids = batch["labels"][0], batch["input_ids"][0]
    assert tok.decode(ids[labels != IGNORE_INDEX]) == f" {CAPTION}<end_of_utterance>\n"  # after "Assistant:"


def test_llava_next_tiles_images_as_its_processor_does(tmp_path):
    """LlavaNextProcessor on the rendered exchange: the same ids for a square photo (1×2 tiles + the base
    image: 36 image tokens), a wide one (30×90 px: 1×3 tiles, 68) and a tall one (70×50 px: 2×2 tiles, the
    fit's padding columns dropped: 72), the same pixels and image sizes, rows' tiles padded with all-zero
    tiles; the processor saved and reloaded from a folder; the model takes the batch (its image features
    must number the image tokens)."""
    cfg = ModelConfig(name="tiny-llava-next", family="image-to-text")
    proc = load_processor(cfg)
    proc.save_pretrained(tmp_path / "p")
    again = load_processor(ModelConfig(name=str(tmp_path / "p"), family="image-to-text"))
    assert type(again).__name__ == "LlavaNextProcessor"
    assert again.image_processor.image_grid_pinpoints == proc.image_processor.image_grid_pinpoints
    model = build_model(cfg, again, "32-true", seed=0)
    assert type(model).__name__ == LLAVA_NEXT[1] and model.config.get_text_config().vocab_size == len(again.tokenizer)
    layout = vlm.ChatImageLayout.for_model(again, model.config, PROMPT)
    tok = again.tokenizer
    photos = [_demo_images(1)[0]]
    for name, size in (("wide", (90, 30)), ("tall", (50, 70))):
        photos.append(tmp_path / f"{name}.png")
        open_image(photos[0]).resize(size).save(photos[-1])
    examples = [_example(layout, tok, p) for p in photos]
    batch = vlm.ChatImageCollator(layout)(list(vlm.ChatImageDataset(examples, again.image_processor, layout)))
    text = tok.apply_chat_template(vlm.conversation(PROMPT, CAPTION), chat_template=layout.template, tokenize=False)
    image_tokens = []
    for i, img in enumerate(photos):
        ref = again(images=[open_image(img)], text=[text], return_tensors="pt")
        n = int(batch["attention_mask"][i].sum())
        assert batch["input_ids"][i, :n].tolist() == ref["input_ids"][0].tolist() + [tok.eos_token_id]
        tiles = ref["pixel_values"].shape[1]
        assert torch.equal(batch["pixel_values"][i, :tiles], ref["pixel_values"][0])
        assert not batch["pixel_values"][i, tiles:].any()  # the padding tiles
        assert batch["image_sizes"][i].tolist() == ref["image_sizes"][0].tolist()
        image_tokens.append(int((ref["input_ids"][0] == layout.image_token_id).sum()))
    assert image_tokens == [36, 68, 72] and batch["image_tokens"] == 72
    assert [layout.anyres.tiles(*s) for s in batch["image_sizes"].tolist()] == [3, 4, 5]
    labels, ids = batch["labels"][0], batch["input_ids"][0]
    assert tok.decode(ids[labels != IGNORE_INDEX]) == f" {CAPTION}{tok.eos_token}"  # after " [/INST]"
    with torch.no_grad():
        logits = model(
            **{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "pixel_values", "image_sizes")}
        ).logits
    assert logits.shape[:2] == batch["input_ids"].shape


@pytest.mark.parametrize("preset,arch,prefix_lm", FAMILIES + [SMOLVLM, LLAVA_NEXT])
def test_parts_freeze_by_name(preset, arch, prefix_lm):
    proc = load_processor(ModelConfig(name=preset, family="image-to-text"))

    def trainable(**flags) -> dict[str, bool]:
        model = build_model(ModelConfig(name=preset, family="image-to-text", **flags), proc, "32-true", 0)
        parts = dict(zip(("vision", "projector", "language_model"), (getattr(model.model, n) for n in PARTS[arch])))
        return {k: any(p.requires_grad for p in m.parameters()) for k, m in parts.items()}

    assert trainable() == {"vision": False, "projector": True, "language_model": True}  # the defaults
    assert trainable(freeze_vision=False, freeze_qformer=True) == {
        "vision": True,
        "projector": False,
        "language_model": True,
    }
    assert trainable(freeze_language_model=True) == {"vision": False, "projector": True, "language_model": False}
    if preset == "tiny-llava-next":  # the row-end embedding belongs to the projector's side
        for flag in (False, True):
            model = build_model(
                ModelConfig(name=preset, family="image-to-text", freeze_qformer=flag), proc, "32-true", 0
            )
            assert model.model.image_newline.requires_grad is not flag


def test_paligemma_prompt_may_be_empty_and_llava_prompt_may_not():
    from bigtune.data.text import DataError
    from bigtune.models.configs import resolve_config_name

    cfg = ModelConfig(name="tiny-paligemma", family="image-to-text")
    proc = load_processor(cfg)
    layout = vlm.ChatImageLayout.for_model(proc, resolve_config_name(cfg), "")
    assert layout.prompt_ids == [layout.image_token_id, proc.tokenizer.bos_token_id] + proc.tokenizer.encode("\n")
    cfg = ModelConfig(name="tiny-llava", family="image-to-text")
    with pytest.raises(DataError, match="data.prompt is empty"):
        vlm.ChatImageLayout.for_model(load_processor(cfg), resolve_config_name(cfg), " ")


# -- training, caption, merge ----------------------------------------------------------------------------------


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r and "val_loss" not in r]


@pytest.mark.parametrize("preset,arch,prefix_lm", FAMILIES + [SMOLVLM, LLAVA_NEXT])
def test_train_caption_and_lora_merged_equals_adapter(tmp_path, preset, arch, prefix_lm):
    run = tmp_path / "full"
    s = train(str(RECIPE), _overrides(preset, run))
    assert s["status"] == "ok"
    losses = _losses(run)
    assert len(losses) == 20 and losses[-1] < 0.7 * losses[0], losses  # ~6.2 → ~3.4 (LLaVA, -NeXT), ~7.4 → ~4.3

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

    # LoRA on top of the trained model, then merged: the same greedy captions
    lora = tmp_path / "lora"
    extra = {"model.name": str(run / "model"), "peft.method": "lora", "optim.lr": 1e-2, "train.max_steps": 5}
    assert train(str(RECIPE), _overrides(preset, lora, **extra))["status"] == "ok"
    cfg = json.loads((lora / "adapter" / "adapter_config.json").read_text())
    assert PARTS[arch][2] in str(cfg["target_modules"])  # the language model's
    from bigtune.use.caption import caption_images, load_captioner
    from bigtune.use.export import export_run

    merged = export_run(lora, merge=True)
    paths = [str(p) for p in _demo_images(6)]
    adapter_model, adapter_proc = load_captioner(str(lora))
    merged_model, merged_proc = load_captioner(str(merged))
    with_adapter, _ = caption_images(adapter_model, adapter_proc, paths, batch_size=3, progress=False, prompt=PROMPT)
    from_merged, _ = caption_images(merged_model, merged_proc, paths, batch_size=3, progress=False, prompt=PROMPT)
    assert [r["caption"] for r in with_adapter] == [r["caption"] for r in from_merged]
    # the adapters changed the model (so the equality says something), and merging kept what they do
    layout = vlm.ChatImageLayout.for_model(merged_proc, merged_model.config, PROMPT)
    batch = vlm.generation_batch(layout, merged_proc.image_processor, [open_image(p) for p in paths[:2]])
    base_model, _ = load_captioner(str(run / "model"))
    with torch.no_grad():
        a, m, b = (x(**batch).logits for x in (adapter_model, merged_model, base_model))
    assert torch.allclose(a, m, atol=1e-4) and not torch.allclose(a, b, atol=1e-4)


def test_planner_refuses_clearly():
    """LLaVA / PaliGemma resize every image to the tower's size, so --image-size changes nothing: one clear
    error (exit 2), not a traceback. SmolVLM's tiles follow the size, so it plans one (tests/test_plan_vlm_families.py)."""
    res = run_cli("plan", str(RECIPE), "--set", "model.name=tiny-llava", "--image-size", "64x64", cwd=ROOT)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "fixed size" in res.stderr
