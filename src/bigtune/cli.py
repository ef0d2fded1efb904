"""The command line: ``bigtune <verb> ...``. Libraries raise; only this module exits.

Exit codes: 0 ok · 1 unexpected error · 2 bad input (recipe, data, model, arguments) · 3 out of memory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_OOM = 0, 1, 2, 3


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", help="recipe YAML (default: the built-in demo: tiny Llama, bundled data, CPU)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe key, e.g. --set train.micro_batch_size=8 (repeatable; "
                        "`bigtune recipe --docs` lists every key)")
    p.add_argument("--model", help="shortcut for --set model.name=...")
    p.add_argument("--data", help="shortcut for --set data.source=...")


def _overrides(args) -> list[str]:
    out = list(args.overrides)
    if getattr(args, "model", None):
        out.append(f"model.name={args.model}")
    if getattr(args, "data", None):
        out.append(f"data.source={args.data}")
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bigtune", description="Fine-tune models that do not fit; measure where the "
                                 "memory goes.")
    ap.add_argument("--version", action="store_true", help="print the version and exit")
    sub = ap.add_subparsers(dest="verb")
    t = sub.add_parser("train", help="train a recipe (no recipe: the CPU demo)")
    _add_recipe_args(t)
    t.add_argument("--resume", nargs="?", const="", metavar="RUN_OR_CKPT",
                   help="continue from a run directory's newest checkpoint (or a .ckpt file); without a value, "
                        "the recipe's output_dir")
    r = sub.add_parser("recipe", help="validate and print the resolved recipe, or the schema reference")
    _add_recipe_args(r)
    r.add_argument("--docs", action="store_true", help="print the reference of every recipe key (Markdown)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.version:
        from bigtune import __version__

        print(__version__)
        return EXIT_OK
    if args.verb is None:
        _parser().print_help()
        return EXIT_OK
    try:
        if args.verb == "recipe":
            return _cmd_recipe(args)
        if args.verb == "train":
            return _cmd_train(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - map known input errors to exit 2 with one clear message
        from bigtune.data import DataError
        from bigtune.models import ModelError
        from bigtune.recipe import RecipeError

        if isinstance(e, (RecipeError, DataError, ModelError, FileNotFoundError)):
            print(f"bigtune: error: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        raise
    return EXIT_ERROR


def _cmd_recipe(args) -> int:
    from bigtune.recipe import load_recipe, schema_markdown

    if args.docs:
        print(schema_markdown(), end="")
        return EXIT_OK
    print(load_recipe(args.recipe, _overrides(args)).to_yaml(), end="")
    return EXIT_OK


def _cmd_train(args) -> int:
    from bigtune.engine import train
    from bigtune.recipe import load_recipe

    resume = args.resume
    if resume == "":
        r = load_recipe(args.recipe, _overrides(args))
        resume = r.output_dir or str(Path("runs") / r.name)
    summary = train(args.recipe, _overrides(args), resume=resume)
    return {"ok": EXIT_OK, "oom": EXIT_OOM}.get(summary["status"], EXIT_ERROR)
