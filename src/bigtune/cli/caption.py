"""``bigtune caption``: alt text for image files with a trained image-to-text model (parse, call, print)."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

from bigtune.use.caption import caption_images, expand_images, load_captioner, trained_prompt
from bigtune.use.loading import (
    InferError,
    write_text_atomically,
)


def main_caption(args) -> int:
    if args.batch_size < 1:
        raise InferError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.max_new_tokens < 1:
        raise InferError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    kind = None
    if args.out:
        kind = Path(args.out).suffix.lower()
        if kind not in (".jsonl", ".csv"):
            raise InferError(f"--out {args.out}: use a .jsonl or .csv file")
    paths = expand_images(args.images)
    if not paths:
        raise InferError("no images: give image files, folders or glob patterns")
    model, processor = load_captioner(args.model, dtype=args.dtype, device=args.device)
    prompt = args.prompt or trained_prompt(args.model, model)  # a chat VLM is asked what it was trained to answer
    rows, bad = caption_images(model, processor, paths, args.batch_size, args.max_new_tokens, prompt)
    if not rows:
        raise InferError(
            f"none of the {len(paths)} images could be read (first: {bad[0]['image']}: {bad[0]['reason']})"
        )
    if kind == ".jsonl":
        write_text_atomically(Path(args.out), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    elif kind == ".csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=["image", "caption"])
        w.writeheader()
        w.writerows(rows)
        write_text_atomically(Path(args.out), buf.getvalue())
    else:
        for r in rows:
            print(f"{r['image']}\t{r['caption']}")
    where = f" to {args.out}" if args.out else ""
    print(f"caption: {len(rows)} captioned{where}, {len(bad)} skipped", file=sys.stderr, flush=True)
    return 0


def add_cli(subparsers) -> None:
    """Add the ``caption`` verb to bigtune's argparse subparsers."""
    c = subparsers.add_parser("caption", help="write alt text for photos with a trained image-to-text model")
    c.add_argument("images", nargs="+", metavar="IMAGE", help="image files, folders or glob patterns (quoted)")
    c.add_argument(
        "--model",
        required=True,
        metavar="RUN_OR_FOLDER",
        help="a bigtune run directory (runs/NAME), a Hugging Face model folder or an adapter folder",
    )
    c.add_argument("--out", metavar="FILE", help="alt.jsonl ({image, caption} per line) or alt.csv (default: print)")
    c.add_argument("--batch-size", type=int, default=8, help="images per generate call (default 8)")
    c.add_argument("--max-new-tokens", type=int, default=30, help="caption tokens at most (default 30)")
    c.add_argument(
        "--prompt",
        default="",
        help="BLIP-2: text the caption continues (default: none); Qwen2-VL / Qwen2.5-VL: the request beside the "
        "image (default: the run's data.prompt, else 'Write alt text for this photo.')",
    )
    c.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="weights dtype (auto: the checkpoint's on a GPU, float32 on a CPU)",
    )
    c.add_argument("--device", default="auto", help="cpu, cuda, ... (auto: a GPU if there is one)")
    c.set_defaults(func=main_caption)
