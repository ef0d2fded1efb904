"""``bigtune predict``: labels and class probabilities for a file of texts with a trained classifier."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

from bigtune.use.classify import load_classifier, predict_proba, prediction_rows, read_texts


def main_predict(args) -> int:
    from bigtune.use.loading import InferError, write_text_atomically

    if args.batch_size < 1:
        raise InferError(f"--batch-size must be at least 1, got {args.batch_size}")
    kind = Path(args.out).suffix.lower() if args.out else None
    if kind not in (None, ".csv", ".jsonl"):
        raise InferError(f"--out {args.out}: use a .csv or .jsonl file")
    texts = read_texts(args.input, args.text_field)
    model, tok, names = load_classifier(args.model, dtype=args.dtype, device=args.device)
    probs = predict_proba(model, tok, texts, args.batch_size, args.max_seq_length)
    rows = prediction_rows(texts, probs, names)
    if kind == ".jsonl":
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    else:
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
        text = buf.getvalue()
    if args.out:
        write_text_atomically(Path(args.out), text)  # temp file, then rename: never half-written
        print(f"predict: {len(rows)} texts labelled ({', '.join(names)}) to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def add_cli(subparsers) -> None:
    """Add the ``predict`` verb to bigtune's argparse subparsers."""
    p = subparsers.add_parser(
        "predict", help="label texts with a trained classifier (CSV/JSONL in, labels and per-class probabilities out)"
    )
    p.add_argument("input", metavar="FILE", help="a .csv or .jsonl file with a text column")
    p.add_argument(
        "--model",
        required=True,
        metavar="RUN_OR_FOLDER",
        help="a bigtune run directory (runs/NAME), its model/ folder, or an adapter folder",
    )
    p.add_argument(
        "--out", metavar="FILE", help="labels.csv (text, label, prob_<class>...) or .jsonl (default: CSV on stdout)"
    )
    p.add_argument("--text-field", default="text", help="column holding the text (default: text)")
    p.add_argument("--batch-size", type=int, default=32, help="texts per forward pass (default 32)")
    p.add_argument("--max-seq-length", type=int, default=512, help="truncate texts to this many tokens")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="weights dtype (auto: the checkpoint's on a GPU, float32 on a CPU)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, ... (auto: a GPU if there is one)")
    p.set_defaults(func=main_predict)
