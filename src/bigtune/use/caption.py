"""``bigtune caption``: alt text for photos with a trained image-to-text model (BLIP-2, Qwen2-VL, Qwen2.5-VL).

The model can be a bigtune run directory (``model/`` for a full fine-tune, or ``adapter/`` on top of
``base/`` or the base named in adapter_config.json), a Hugging Face model folder (merged or full
model, with its processor) or a peft adapter folder. Images are files, folders (searched
recursively for image files) or glob patterns. An image that is missing or does not decode is
reported on stderr and skipped; the others are captioned greedily in batches and written to
``--out`` (.jsonl: one ``{"image", "caption"}`` object per line; .csv: columns image, caption), or
printed when there is no ``--out``.

The model input is laid out as in training (``bigtune.data.images.TokenLayout``): the image tokens,
then BOS and the optional ``--prompt`` for OPT, or the prompt and EOS for the Flan-T5 encoder. Chat
models (Qwen2-VL, Qwen2.5-VL, LLaVA, LLaVA-NeXT, SmolVLM; ``bigtune.data.vlm``) are asked ``--prompt`` (default: the run's
data.prompt) beside the image in their chat template, and answer until their end-of-turn token; PaliGemma
reads it as its prefix after the image and answers until EOS.
"""

from __future__ import annotations

import glob
import sys
from pathlib import Path

from bigtune.use.loading import (
    InferError,
    adapter_base,
    attach_adapter,
    locate_model,
    resolve_device,
    resolve_dtype,
)


def expand_images(items: list[str]) -> list[str]:
    """Files as given; folders → their image files (recursive, sorted); glob patterns → matches (sorted).
    A path that matches nothing is kept, so it is reported as missing rather than silently dropped."""
    from bigtune.data.images import IMAGE_SUFFIXES

    out: list[str] = []
    for item in items:
        p = Path(item).expanduser()
        if p.is_dir():
            out += sorted(str(f) for f in p.rglob("*") if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES)
        elif not p.exists() and any(c in item for c in "*?["):
            matches = sorted(m for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
            out += matches if matches else [item]
        else:
            out.append(str(p))
    return list(dict.fromkeys(out))  # a file named twice (a folder and a glob) is captioned once


def _load_processor(*candidates):
    from bigtune.core.processors import AutoImageTextProcessor
    from bigtune.use.loading import load_first

    return load_first(
        "an image processor + tokenizer",
        AutoImageTextProcessor,
        candidates,
        "save the model's processor next to the weights with `processor.save_pretrained(FOLDER)`",
    )


def _load_model(source: str, torch_dtype, device: str):
    from transformers import AutoModelForImageTextToText

    from bigtune.core.hub import hub_kwargs

    try:
        model = AutoModelForImageTextToText.from_pretrained(
            source, dtype=torch_dtype, use_safetensors=True, trust_remote_code=False, **hub_kwargs(source)
        )
    except Exception as e:
        raise InferError(
            f"could not load an image-to-text model from {source!r} ({type(e).__name__}: {str(e)[:300]})"
        ) from e
    return model.to(device)


def load_captioner(path_or_run: str, dtype: str = "auto", device: str = "auto"):
    """(model, processor) in eval mode from a run directory, model folder or adapter folder."""
    folder, adapter = locate_model(path_or_run)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if folder is not None:
        return _load_model(str(folder), torch_dtype, device).eval(), _load_processor(folder)
    base = adapter_base(adapter)
    model = attach_adapter(_load_model(base, torch_dtype, device), adapter, base)
    return model.to(device).eval(), _load_processor(adapter, base if Path(base).is_dir() else None)


def caption_images(
    model,
    processor,
    paths: list[str],
    batch_size: int = 8,
    max_new_tokens: int = 30,
    prompt: str = "",
    progress: bool = True,
) -> tuple[list[dict], list[dict]]:
    """([{image, caption}] for readable images, [{image, reason}] for the others), in input order.

    ``prompt``: BLIP-2: text the caption continues; chat models (Qwen2-VL): the request beside the image
    (empty: data.prompt's default), asked in the model's chat template as in training."""
    import torch

    from bigtune.data import vlm
    from bigtune.data.images import TokenLayout, check_image, open_image
    from bigtune.recipe import DataConfig

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    tok = processor.tokenizer
    chat = vlm.is_vlm(base.config)
    if chat:
        layout = vlm.ChatImageLayout.for_model(processor, base.config, prompt or DataConfig().prompt)
    else:
        layout = TokenLayout.for_model(processor, base.config)
        prompt_ids = layout.prompt_ids(tok(prompt, add_special_tokens=False)["input_ids"] if prompt else [])
    device = next(model.parameters()).device
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    good: list[str] = []
    bad: list[dict] = []
    for p in paths:
        reason = check_image(p)
        (bad.append({"image": p, "reason": reason}) if reason else good.append(p))
    for b in bad:
        print(f"caption: skipped {b['image']}: {b['reason']}", file=sys.stderr, flush=True)
    rows: list[dict] = []
    for start in range(0, len(good), batch_size):
        chunk = good[start : start + batch_size]
        images = [open_image(p) for p in chunk]
        if chat:  # each image its own number of image tokens: rows left-padded to the longest
            inputs = vlm.generation_batch(layout, processor.image_processor, images)
        else:
            ids = torch.tensor([prompt_ids] * len(chunk), dtype=torch.long)
            pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
            inputs = {"pixel_values": pixels, "input_ids": ids, "attention_mask": torch.ones_like(ids)}
        inputs = {k: v.to(device, dtype) if k == "pixel_values" else v.to(device) for k, v in inputs.items()}
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        # Decoder-only models return the prompt followed by the new tokens; T5 returns decoder tokens only.
        new = out if not chat and layout.encoder_decoder else out[:, inputs["input_ids"].shape[1] :]
        for path, seq in zip(chunk, new):
            rows.append({"image": path, "caption": tok.decode(seq, skip_special_tokens=True).strip()})
        if progress:
            print(f"caption: {len(rows)}/{len(good)} images", file=sys.stderr, flush=True)
    return rows, bad


def trained_prompt(path_or_run: str, model=None) -> str:
    """The data.prompt a bigtune run was trained with ('' when ``path_or_run`` is not a run directory
    or its recipe sets none), so a chat model is asked what it learned to answer.

    ``model``: the loaded captioner; '' unless it is a chat VLM. BLIP-2 trains on the caption alone, and every
    recipe.yaml holds data.prompt's default: continuing that text, never seen in training, the demo wrote the
    same caption for every photo (issue #42)."""
    import yaml

    from bigtune.data import vlm

    if model is not None:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if not vlm.is_vlm(base.config):
            return ""
    for folder in (Path(path_or_run), Path(path_or_run).parent):
        recipe = folder / "recipe.yaml"
        if recipe.is_file():
            data = (yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}).get("data") or {}
            return str(data.get("prompt") or "")
    return ""


def _image_key(ref) -> str:
    """One key per image, so several reference captions of the same photo are scored together."""
    if isinstance(ref, (bytes, bytearray)):
        import hashlib

        return "sha256:" + hashlib.sha256(ref).hexdigest()
    return str(ref)


def evaluate_captions(
    model,
    processor,
    data_source: str,
    text_field: str = "text",
    image_field: str = "image",
    split: str = "train",
    batch_size: int = 8,
    max_new_tokens: int = 30,
    examples: int = 5,
) -> dict:
    """Caption every distinct image of an image + caption source greedily and score the captions against
    its reference captions (all captions of the same image are its references): corpus BLEU, ROUGE-L,
    CIDEr-D and caption length stats (``bigtune.metrics.caption_metrics``). Records without an image or a
    caption, and images that do not decode, are skipped and counted."""
    from bigtune.core.metrics import caption_metrics
    from bigtune.data.images import read_image_source
    from bigtune.recipe import DataConfig

    label, rows = read_image_source(
        DataConfig(source=data_source, text_field=text_field, image_field=image_field, split=split)
    )
    refs: dict[str, list[str]] = {}
    images: dict[str, object] = {}
    skipped = 0
    for ref, text in rows:
        if isinstance(ref, dict):
            ref = ref.get("bytes") or ref.get("path")
        if ref in (None, "") or not isinstance(text, str) or not text.strip():
            skipped += 1
            continue
        key = _image_key(ref)
        images.setdefault(key, ref)
        refs.setdefault(key, []).append(text.strip())
    if not images:
        raise InferError(f"{label}: no records with both an image and a caption to score against")
    done, bad = caption_images(
        model, processor, list(images.values()), batch_size=batch_size, max_new_tokens=max_new_tokens
    )
    if not done:
        raise InferError(f"{label}: none of the {len(images)} images could be read (first: {bad[0]['reason']})")
    keys = [_image_key(r["image"]) for r in done]
    preds = [r["caption"] for r in done]
    out = caption_metrics(preds, [refs[k] for k in keys])
    out.update(
        source=label,
        images=len(images),
        unreadable_images=len(bad),
        skipped_records=skipped,
        examples=[
            {"image": k if not k.startswith("sha256:") else k[:19], "caption": p, "references": refs[k]}
            for k, p in list(zip(keys, preds))[:examples]
        ],
    )
    return out


def format_caption_eval(res: dict) -> str:
    c, r = res["caption_length_words"], res["reference_length_words"]
    cider = "n/a (one image)" if res.get("cider_d") is None else f"{res['cider_d']:.3f}"
    lines = [
        f"eval: {res['source']}: BLEU {res['bleu']:.2f}, ROUGE-L {res['rouge_l']:.4f}, CIDEr-D {cider} over "
        f"{res['captions']} "
        f"images ({res['references_per_caption']:.2f} references each; {res['unreadable_images']} unreadable "
        f"images, {res['skipped_records']} records skipped)",
        f"caption length (words): mean {c['mean']:.1f}, min {c['min']}, max {c['max']}; references: mean "
        f"{r['mean']:.1f}",
        f"BLEU signature: {res['bleu_signature']}",
    ]
    for ex in res["examples"]:
        lines.append(f"  {ex['image']}: {ex['caption']!r} (reference: {ex['references'][0]!r})")
    return "\n".join(lines)
