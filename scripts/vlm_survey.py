"""Which image-text-to-text families transformers ships bigtune can build and train tiny, offline (issue #46).

For every model type in transformers' image-text-to-text auto mapping: build a tiny config and an offline
processor (bigtune.core.tiny_vlm: the bundled tokenizer, the family's PIL image processor at a small size),
the model from the config, and one training step's forward and backward on a food photo laid out by the
generic chat-VLM path (bigtune.data.vlm). Prints one row per family: how far it got, and why not further.

    .venv/bin/python scripts/vlm_survey.py [--only qwen3_vl,gemma3] [--json out.json]

No hub, no training run: a few seconds per family on a CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

STAGES = ("config", "processor", "model", "data", "step")
MAX_PARAMETERS = 20_000_000  # a tiny model is well under 1 M; the rest is embedding tables of the vocabulary


def survey_one(model_type: str) -> dict:
    """How far ``model_type`` gets: the last stage passed and, if one failed, the reason."""
    import torch

    from bigtune.core.tiny_vlm import TinyVlmError, tiny_vlm, tiny_vlm_config
    from bigtune.data import vlm
    from bigtune.data.images import DEMO_IMAGES, open_image

    row = {"model_type": model_type, "passed": [], "why": ""}

    def fail(stage: str, e: BaseException) -> dict:
        row["why"] = f"{stage}: {e if isinstance(e, TinyVlmError) else f'{type(e).__name__}: {e}'}"
        row["why"] = " ".join(row["why"].split())[:300]
        return row

    try:
        tiny_vlm_config(model_type, 1024, {})
    except Exception as e:  # noqa: BLE001 - a survey reports every failure as a row
        return fail("config", e)
    row["passed"].append("config")
    try:
        proc, config = tiny_vlm(model_type)
    except Exception as e:  # noqa: BLE001
        return fail("processor", e)
    row["passed"].append("processor")
    try:
        from transformers import AutoModelForImageTextToText

        with torch.device("meta"):  # counted first: a sub-config the shrink missed would not fit in memory
            n = sum(p.numel() for p in AutoModelForImageTextToText.from_config(config).parameters())
        if n > MAX_PARAMETERS:
            raise ValueError(f"{n / 1e6:.0f} M parameters: a sub-config kept its full size")
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config)
        model.train()
    except Exception as e:  # noqa: BLE001
        return fail("model", e)
    row["passed"].append("model")
    row["parameters"] = sum(p.numel() for p in model.parameters())
    try:
        vlm.check_supported(config, proc)
        layout = vlm.ChatImageLayout.for_model(proc, config, "Write alt text for this photo.")
        photos = sorted((DEMO_IMAGES / "images").glob("*.png"))[:2]
        items = []
        for p in photos:
            ids, labels, _ = layout.encode(proc.tokenizer, "rice in a bowl", 96)
            items.append(vlm.image_item(layout, proc.image_processor, open_image(p), ids, labels))
        batch = vlm.collate_chat_images(items, layout)
    except Exception as e:  # noqa: BLE001
        return fail("data", e)
    row["passed"].append("data")
    row["image_tokens"] = batch.get("image_tokens")
    try:
        from bigtune.models.build import forward_inputs

        out = model(**forward_inputs(batch, True), labels=batch["labels"])
        out.loss.backward()
        if not torch.isfinite(out.loss):
            raise ValueError(f"loss {out.loss.item()}")
        row["loss"] = round(float(out.loss), 3)
    except Exception as e:  # noqa: BLE001
        return fail("step", e)
    row["passed"].append("step")
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model types (default: every image-text-to-text type)")
    ap.add_argument("--json", help="write the rows here as JSON")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import logging

    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    torch.set_num_threads(1)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    types = args.only.split(",") if args.only else list(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    rows = []
    for mt in types:
        t0 = time.perf_counter()
        row = survey_one(mt)
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        last = row["passed"][-1] if row["passed"] else "-"
        print(f"{mt:28s} {last:9s} {row['seconds']:6.2f}s  {row.get('loss', '')!s:7s} {row['why']}", flush=True)
    counts = {stage: sum(stage in r["passed"] for r in rows) for stage in STAGES}
    print(f"\n{len(rows)} families: " + ", ".join(f"{counts[s]} {s}" for s in STAGES))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
