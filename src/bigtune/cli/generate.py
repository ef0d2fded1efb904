"""cli.generate."""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Any, Optional

from bigtune.use.generate import check_generate_args, evaluate, format_eval, generate, read_prompt_file
from bigtune.use.loading import DTYPE_NAMES, InferError, load_for_inference, model_family, write_text_atomically


def _out_kind(out: Optional[str]) -> Optional[str]:
    if out is None:
        return None
    suffix = Path(out).suffix.lower()
    if suffix not in (".jsonl", ".csv"):
        raise InferError(
            f"--out {out}: unknown extension {suffix!r}; use .jsonl (one {{prompt, output}} object per line) or .csv"
        )
    return suffix[1:]


def main_generate(args) -> int:
    """``bigtune generate``: continue each prompt; print the outputs or write them to --out."""
    if args.chat and args.instruction:
        raise InferError("--chat and --instruction exclude each other: a prompt gets one template")
    if (args.system or args.chat_template) and not args.chat:
        raise InferError("--system and --chat-template apply to chat prompts; add --chat")
    items: list[tuple[str, Any]] = []
    if args.instruction:
        from bigtune.data.text import format_prompt

        items += [(p, format_prompt(p)) for p in args.prompts]
    else:
        items += [(p, p) for p in args.prompts]
    if args.file:
        items += read_prompt_file(args.file, instruction=args.instruction, chat=args.chat)
    if not items:
        raise InferError(
            'no prompts: give them as arguments (bigtune generate --model M "Once upon") or with --file FILE'
        )
    kind = _out_kind(args.out)
    check_generate_args(args.max_new_tokens, args.batch_size, args.sample, args.temperature, args.top_p, args.top_k)
    model, tok = load_for_inference(args.model, dtype=args.dtype, device=args.device)
    outputs = generate(
        model,
        tok,
        [text for _, text in items],
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        do_sample=args.sample,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        instruction_format=False,
        chat=args.chat,
        system=args.system,
        chat_template=args.chat_template,
    )
    rows = [{"prompt": shown, "output": out} for (shown, _), out in zip(items, outputs)]
    if kind == "jsonl":
        write_text_atomically(Path(args.out), "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        print(f"generate: {len(rows)} outputs written to {args.out}", file=sys.stderr)
    elif kind == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=["prompt", "output"])
        w.writeheader()
        w.writerows(rows)
        write_text_atomically(Path(args.out), buf.getvalue())
        print(f"generate: {len(rows)} outputs written to {args.out}", file=sys.stderr)
    elif len(rows) == 1:
        print(rows[0]["output"])
    else:
        for i, r in enumerate(rows):
            print(f"=== [{i}] {r['prompt']}\n{r['output']}\n")
    return 0


def main_eval(args) -> int:
    """``bigtune eval``: loss and perplexity of a language model on a data source; for a classifier
    accuracy, macro-F1 and the confusion matrix; for an image-to-text model BLEU, ROUGE-L, CIDEr-D and caption
    lengths of its greedy captions against the source's reference captions."""
    if args.batch_size < 1:
        raise InferError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.max_seq_length < 2:
        raise InferError(f"--max-seq-length must be at least 2, got {args.max_seq_length}")
    family = model_family(args.model)
    if family == "sequence-classification":
        from bigtune.core.metrics import format_classification
        from bigtune.use.classify import evaluate_classifier, load_classifier

        model, tok, names = load_classifier(args.model, dtype=args.dtype, device=args.device)
        res = evaluate_classifier(
            model,
            tok,
            names,
            args.data,
            text_field=args.text_field,
            label_field=args.label_field,
            batch_size=args.batch_size,
            max_seq_length=args.max_seq_length,
        )
        print(
            json.dumps(res, indent=2)
            if args.json
            else format_classification(res, prefix=f"eval: {res['source']}")
            + f"\nmajority-class baseline {res['majority_baseline']:.4f}; loss {res['loss']:.4f}; "
            f"{res['skipped']} records skipped"
        )
        return 0
    if family == "image-to-text":
        from bigtune.use.caption import evaluate_captions, format_caption_eval, load_captioner

        model, processor = load_captioner(args.model, dtype=args.dtype, device=args.device)
        res = evaluate_captions(
            model,
            processor,
            args.data,
            text_field=args.text_field,
            batch_size=args.batch_size,
            max_new_tokens=args.max_new_tokens,
        )
        print(json.dumps(res, indent=2) if args.json else format_caption_eval(res))
        return 0
    model, tok = load_for_inference(args.model, dtype=args.dtype, device=args.device)
    result = evaluate(
        model,
        tok,
        args.data,
        max_seq_length=args.max_seq_length,
        batch_size=args.batch_size,
        mask_prompt=not args.no_mask_prompt,
    )
    print(json.dumps(result, indent=2) if args.json else format_eval(result))
    return 0


def _add_load_args(p) -> None:
    p.add_argument(
        "--model",
        required=True,
        metavar="PATH",
        help="a Hugging Face model folder, a bigtune run directory (runs/NAME) or an adapter folder",
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPE_NAMES),
        default="auto",
        help="weights dtype (auto: the checkpoint's on a GPU, float32 on a CPU)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (auto: a GPU if there is one)")


def add_cli(subparsers) -> None:
    """Add the ``generate`` and ``eval`` verbs to bigtune's argparse subparsers."""
    g = subparsers.add_parser("generate", help="generate text from a trained model (greedy unless --sample)")
    _add_load_args(g)
    g.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts to continue (quote each one)")
    g.add_argument(
        "--file",
        metavar="FILE",
        help='more prompts: one per line, or a .jsonl with an "instruction" '
        '(optional "input") or "prompt" field per line',
    )
    g.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt at most (default 64)")
    g.add_argument("--batch-size", type=int, default=8, help="prompts per forward pass (default 8)")
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (with --sample)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (with --sample; 1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (with --sample; 0: off)")
    g.add_argument("--seed", type=int, default=0, help="random seed for --sample (same seed, same outputs)")
    g.add_argument(
        "--instruction",
        action="store_true",
        help="wrap each prompt in the instruction template bigtune trains alpaca data with",
    )
    g.add_argument(
        "--chat",
        action="store_true",
        help="render each prompt as a user turn with the model's chat template and its generation prompt "
        '(a --file .jsonl line may hold a whole conversation: "messages" ending with the user\'s turn)',
    )
    g.add_argument("--system", metavar="TEXT", help="with --chat: a system prompt before each prompt")
    g.add_argument(
        "--chat-template",
        metavar="NAME|FILE",
        help="with --chat: a built-in template (chatml, qwen, llama-3, gemma, mistral, phi-3, zephyr) or a Jinja "
        "file, instead of the tokenizer's own",
    )
    g.add_argument(
        "--out",
        metavar="FILE",
        help="write the results to FILE (.jsonl: {prompt, output} per line, or .csv) instead of printing them",
    )
    g.set_defaults(func=main_generate)
    e = subparsers.add_parser(
        "eval",
        help="score a trained model on a data source: loss and perplexity; "
        "classifiers: accuracy, macro-F1, confusion matrix; image-to-text: BLEU, ROUGE-L, CIDEr-D",
    )
    _add_load_args(e)
    e.add_argument(
        "--data",
        default="demo",
        metavar="SOURCE",
        help="data source, as data.source in a recipe (default: the bundled demo set of the model's kind)",
    )
    e.add_argument("--max-seq-length", type=int, default=512, help="truncate samples to this many tokens")
    e.add_argument("--batch-size", type=int, default=8, help="samples per forward pass (default 8)")
    e.add_argument(
        "--no-mask-prompt",
        action="store_true",
        help="alpaca data: score the prompt tokens too (default: the response only, as in training)",
    )
    e.add_argument(
        "--text-field",
        default="text",
        help="classification / image-to-text data: the text or caption column (default: text)",
    )
    e.add_argument("--label-field", default="label", help="classification data: the label column (default: label)")
    e.add_argument("--max-new-tokens", type=int, default=30, help="image-to-text: caption tokens at most (default 30)")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    e.set_defaults(func=main_eval)
