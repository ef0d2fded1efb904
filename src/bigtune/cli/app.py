"""The command line: ``bigtune <verb> ...``. Libraries raise; only this module exits.

Exit codes: 0 ok · 1 unexpected error · 2 bad input (recipe, data, model, arguments) · 3 out of memory ·
130 stopped by Ctrl-C (SIGINT) and 143 by SIGTERM, each after writing a checkpoint (resume with --resume /
--auto-resume).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_OOM, EXIT_INTERRUPTED, EXIT_PREEMPTED = 0, 1, 2, 3, 130, 143
SERVE_VERBS = ("serve", "submit", "jobs", "logs", "cancel")  # cli/serve.py


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", help="recipe YAML (default: the built-in demo: tiny Llama, bundled data, CPU)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a recipe key, e.g. --set train.micro_batch_size=8 (repeatable; "
        "`bigtune recipe --docs` lists every key)",
    )
    p.add_argument(
        "--model",
        help="shortcut for --set model.name=...; names the run after the model (and --data) unless --set name=... "
        "is given",
    )
    p.add_argument("--data", help="shortcut for --set data.source=...; names the run as --model does")


def _overrides(args) -> list[str]:
    out = list(args.overrides)
    if getattr(args, "track", None):  # train --track NAME ...: after --set, so the flag wins
        out.append(f"tracking.backends=[{', '.join(dict.fromkeys(args.track))}]")
    model, data = getattr(args, "model", None), getattr(args, "data", None)
    if model:
        out.append(f"model.name={model}")
    if data:
        out.append(f"data.source={data}")
    if (model or data) and not any(o.split("=", 1)[0].strip() == "name" for o in args.overrides):
        # The recipe's own name describes its own model and data: a run of another model or data is named
        # after those (title of the plan, runs/<name>) instead.
        from bigtune.recipe import load_recipe, run_name_for

        model = model or load_recipe(args.recipe, out, check=False).model.name
        out.append(f"name={run_name_for(model, data)}")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The root parser of ``bigtune``: every verb with its flags and help.

    Long because it is a declarative list of flags, one call each; splitting it would only scatter the
    CLI reference (docs/reference/cli.md is generated from it).
    """
    ap = argparse.ArgumentParser(
        prog="bigtune", description="Fine-tune models that do not fit; measure where the memory goes."
    )
    ap.add_argument("--version", action="store_true", help="print the version and exit")
    sub = ap.add_subparsers(dest="verb")
    t = sub.add_parser("train", help="train a recipe (no recipe: the CPU demo)")
    _add_recipe_args(t)
    t.add_argument(
        "--resume",
        nargs="?",
        const="",
        metavar="RUN_OR_CKPT",
        help="continue from a run directory's newest checkpoint (or a .ckpt file); without a value, "
        "the recipe's output_dir",
    )
    t.add_argument(
        "--auto-resume",
        action="store_true",
        help="resume from output_dir's newest checkpoint if there is one, else start there (for requeued Slurm jobs)",
    )
    t.add_argument(
        "--track",
        action="append",
        choices=["mlflow", "wandb", "tensorboard"],
        metavar="BACKEND",
        help="also log the run to mlflow, wandb or tensorboard (repeatable; sets tracking.backends, whose other keys "
        "say where: `bigtune recipe --docs`)",
    )
    said = t.add_mutually_exclusive_group()
    said.add_argument(
        "--verbose",
        action="store_true",
        help="also print the whole resolved recipe (always written to the run folder's recipe.yaml) and the plan's "
        "phase table",
    )
    said.add_argument(
        "--quiet",
        action="store_true",
        help="for scripts: print only notices and warnings (on stderr), errors and the final summary line",
    )
    pl = sub.add_parser("plan", help="predict per-device memory and step time (no GPU, no weights needed)")
    _add_recipe_args(pl)
    pl.add_argument(
        "--gpu",
        help="GPU model from the catalog, e.g. h100-80gb, a100-80gb, rtx-4090 (default: plan for this machine's CPU)",
    )
    pl.add_argument(
        "--gpus",
        type=int,
        help="number of GPUs (several are planned analytically; default: the recipe's devices × num_nodes)",
    )
    pl.add_argument(
        "--strategy",
        choices=[
            "ddp",
            "fsdp",
            "deepspeed_stage_2",
            "deepspeed_stage_2_offload",
            "deepspeed_stage_3",
            "deepspeed_stage_3_offload",
        ],
        help="strategy when --gpus > 1 (deepspeed_*: also on one GPU, for offload; default: the "
        "recipe's strategy, auto meaning DDP as in training)",
    )
    pl.add_argument("--gpu-memory", type=float, metavar="GIB", help="override the GPU's memory (or give a custom GPU)")
    pl.add_argument(
        "--alternatives",
        action="store_true",
        help="also list the variants that fit: on the GPU count asked first, then the other counts (fewest first), "
        "fastest first within each",
    )
    pl.add_argument("--max-gpus", type=int, default=64, help="largest GPU count tried by --alternatives")
    pl.add_argument(
        "--adapters",
        action="store_true",
        help="--alternatives also tries LoRA and QLoRA (nf4) on one GPU, with and without checkpointing: "
        "they fit where full fine-tuning does not, but train adapters instead of every weight",
    )
    pl.add_argument(
        "--data-lengths",
        action="store_true",
        help="plan at the recipe data's own lengths (read and tokenized as train does): the peak at the "
        "longest sample, the time at the mean padded batch. Default: every row max_seq_length "
        "tokens, the worst case",
    )
    pl.add_argument(
        "--image-size",
        metavar="HxW",
        help="Qwen2-VL / Qwen2.5-VL, SmolVLM and LLaVA-NeXT (training and --for caption): plan every image at "
        "HEIGHTxWIDTH pixels (resized, and split into tiles, as the processor does). Default: the worst case, "
        "the processor's max_pixels (Qwen), largest tile grid (SmolVLM) or largest pinpoint (LLaVA-NeXT), or "
        "data.image_max_pixels",
    )
    pl.add_argument("--json", action="store_true", help="machine-readable output")
    pl.add_argument(
        "--verbose",
        action="store_true",
        help="every note in full, with those on how the figures were made (allocator replay, CUDA context, "
        "time model), and the reserved memory",
    )
    pl.add_argument(
        "--compare-gpus",
        nargs="?",
        const="all",
        metavar="GPU,GPU...",
        help="which GPU and how many: for every catalog GPU (or those listed) and count, the fastest variant "
        "that fits (--alternatives' search), the whole run's time and its cost, ranked by cost and by time",
    )
    pl.add_argument(
        "--cluster",
        metavar="FILE",
        help="compare the partitions of a cluster profile (YAML: partition -> GPU type, GPUs per node, CPU "
        "cores and RAM per node, wall-time limit, price or allocation units per GPU-hour) instead of the catalog",
    )
    pl.add_argument(
        "--prices",
        metavar="FILE",
        help="--compare-gpus: your prices per GPU-hour (YAML: GPU name -> price) over the bundled defaults "
        "(published on-demand list prices with their date and source)",
    )
    pl.add_argument(
        "--samples",
        type=int,
        metavar="N",
        help="--compare-gpus: the data source's size in samples, instead of reading and tokenizing it as train does",
    )
    pl.add_argument("--max-hours", type=float, metavar="H", help="--compare-gpus: leave out runs longer than H hours")
    pl.add_argument(
        "--budget", type=float, metavar="AMOUNT", help="--compare-gpus: leave out runs that cost more (price units)"
    )
    pl.add_argument(
        "--for",
        dest="for_task",
        choices=["train", "generate", "caption", "predict"],
        default="train",
        help="what to plan: a training step (default), or serving: generate (KV cache, tokens/s), "
        "caption (image-to-text), predict (one forward, no cache)",
    )
    pl.add_argument("--batch-size", type=int, help="serving: prompts/images per batch (default 8)")
    pl.add_argument(
        "--prompt-tokens",
        type=int,
        help="serving: prompt tokens per row (default: data.max_seq_length; caption: 0, after the image tokens)",
    )
    pl.add_argument("--max-new-tokens", type=int, help="serving: tokens generated per row (default 64; caption 30)")
    pl.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="serving: weights dtype (auto: the recipe precision's compute dtype)",
    )
    ex = sub.add_parser("export", help="write a run's result as a Hugging Face folder (--merge folds adapters in)")
    ex.add_argument("run", help="run directory")
    ex.add_argument("--merge", action="store_true", help="adapter runs: merge the adapters into the base weights")
    ex.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="dtype of the written weights (auto: the run's precision)",
    )
    ex.add_argument("--out", help="output folder (default: <run>/merged, <run>/export-adapter or <run>/export-<dtype>)")
    ex.add_argument(
        "--push",
        metavar="REPO_ID",
        help="then upload the folder to this Hugging Face Hub model repo (owner/name; created if missing). "
        "Token: HF_TOKEN or `hf auth login`; hub: HF_ENDPOINT",
    )
    ex.add_argument(
        "--private",
        action="store_true",
        help="with --push: create the repo private (an existing one keeps its visibility)",
    )
    r = sub.add_parser("recipe", help="validate and print the resolved recipe, or the schema reference")
    _add_recipe_args(r)
    r.add_argument("--docs", action="store_true", help="print the reference of every recipe key (Markdown)")
    from bigtune.cli.sweep import add_cli as add_sweep_cli

    add_sweep_cli(sub)  # `sweep` (a ladder of variants, one process each) and `report`
    from bigtune.cli.generate import add_cli as add_infer_cli

    add_infer_cli(sub)  # `generate` and `eval`
    from bigtune.cli.launch import add_cli as add_launch_cli

    add_launch_cli(sub)  # `launch slurm`
    from bigtune.cli.caption import add_cli as add_caption_cli

    add_caption_cli(sub)  # `caption` (alt text with an image-to-text model)
    from bigtune.cli.predict import add_cli as add_classify_cli

    add_classify_cli(sub)  # `predict` (labels and probabilities with a classifier)
    from bigtune.cli.serve import add_cli as add_serve_cli

    add_serve_cli(sub)  # `serve` (the training service) and its client: `submit`, `jobs`, `logs`, `cancel`
    return ap


def _library_bars_off() -> None:
    """transformers' own tqdm bars ("Loading weights", "Writing model shards") off for this command, as train
    turns them off for a run: the verbs say what they load and write; the bars only interleave on stderr."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    # Plans on the command line keep their simulated steps on disk (plan/step/simcache.py): planning the same step
    # again, here or in a later train, sweep or launch, reads it back. BIGTUNE_SIM_CACHE=off turns that off.
    os.environ.setdefault("BIGTUNE_SIM_CACHE", "on")
    args = build_parser().parse_args(argv)
    if args.version:
        from bigtune import __version__

        print(__version__)
        return EXIT_OK
    if args.verb is None:
        build_parser().print_help()
        return EXIT_OK
    try:
        if args.verb == "recipe":
            return _cmd_recipe(args)
        if args.verb == "train":
            return _cmd_train(args)
        if args.verb == "plan":
            return _cmd_plan(args)
        if args.verb in ("generate", "eval", "caption", "predict", "export"):
            _library_bars_off()
        if args.verb in ("sweep", "report", "generate", "eval", "launch", "caption", "predict", *SERVE_VERBS):
            return args.func(args)
        if args.verb == "export":
            from bigtune.use.export import check_push, export_run, push_folder

            if args.private and not args.push:
                print("bigtune: error: --private applies to --push REPO_ID only; add --push", file=sys.stderr)
                return EXIT_BAD_INPUT
            if args.push:
                check_push(args.push)  # a bad repo id or no token: said before the export, not after
            folder = export_run(args.run, merge=args.merge, dtype=args.dtype, out=args.out)
            print(folder)
            if args.push:
                print(f"pushed to {push_folder(folder, args.push, private=args.private)}")
            return EXIT_OK
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - map known input errors to exit 2 with one clear message
        from bigtune.core.gpus import UnknownGPUError
        from bigtune.data.text import DataError
        from bigtune.models.configs import ModelError
        from bigtune.plan.base.constants import PlanError
        from bigtune.recipe import RecipeError
        from bigtune.use.export import ExportError
        from bigtune.use.loading import InferError

        if isinstance(
            e,
            (
                RecipeError,
                DataError,
                ModelError,
                FileNotFoundError,
                PlanError,
                UnknownGPUError,
                ExportError,
                InferError,
            ),
        ):
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
    from bigtune.recipe import load_recipe
    from bigtune.run.training import train

    resume = args.resume
    if resume == "" or args.auto_resume:
        r = load_recipe(args.recipe, _overrides(args))
        out = r.output_dir or str(Path("runs") / r.name)
        has_ckpt = any((Path(out) / "checkpoints").glob("step-*.ckpt"))
        resume = out if (resume == "" or has_ckpt) else None
    verbosity = "verbose" if args.verbose else "quiet" if args.quiet else "normal"
    summary = train(args.recipe, _overrides(args), resume=resume, reuse_dir=args.auto_resume, verbosity=verbosity)
    codes = {"ok": EXIT_OK, "oom": EXIT_OOM, "preempted": EXIT_PREEMPTED, "interrupted": EXIT_INTERRUPTED}
    return codes.get(summary["status"], EXIT_ERROR)


def _cmd_plan(args) -> int:
    import json

    from bigtune.core.gpus import custom_gpu, find_gpu
    from bigtune.models.configs import resolve_config
    from bigtune.plan.base.constants import PlanError
    from bigtune.plan.base.target import Target, run_strategy
    from bigtune.plan.format import format_alternatives, format_plan
    from bigtune.plan.planner import plan
    from bigtune.plan.search.alternatives import alternatives
    from bigtune.recipe import RecipeError, gpu_plan_problems, load_recipe

    if args.compare_gpus or args.cluster:
        return _cmd_compare(args)
    compare_only = ("prices", "samples", "max_hours", "budget")
    if given := [f"--{k.replace('_', '-')}" for k in compare_only if getattr(args, k) is not None]:
        raise PlanError(f"{', '.join(given)} belong(s) to --compare-gpus or --cluster; add one")
    if args.adapters and not args.alternatives:
        raise PlanError("--adapters widens --alternatives or --compare-gpus; add one")
    for_gpu = bool(args.gpu or args.gpu_memory)
    # The plan simulates on this machine (accelerator=cpu); for a GPU target, rules that only say this
    # machine could not run the recipe (16-mixed without CUDA, DeepSpeed not installed...) do not apply.
    r = load_recipe(args.recipe, _overrides(args) + ["accelerator=cpu"], check=not for_gpu)
    if for_gpu and (problems := gpu_plan_problems(r)):
        raise RecipeError(problems, args.recipe)
    if args.gpus is not None and args.gpus < 1:
        raise PlanError("--gpus must be at least 1")
    if args.gpus is not None and args.gpus > 1 and not for_gpu:
        raise PlanError("--gpus needs --gpu NAME (which GPU?)")
    # What the recipe itself would run on, unless the command line says otherwise (a CPU plan of a
    # several-process recipe plans its CPU ranks, as training does).
    gpus = args.gpus if args.gpus is not None else r.world_size if args.for_task == "train" else 1
    strategy = run_strategy(args.strategy or r.strategy, gpus)
    if args.for_task == "train" and gpus != r.world_size:
        # --gpus N plans the recipe as `--set devices=N` would train it: the global batch, the accumulation
        # derived from it and the lr scaling follow the data-parallel ranks (else N GPUs would each run the
        # one-GPU accumulation and the step would hold N times the tokens)
        over = [f"devices={gpus}", "num_nodes=1", f"strategy={strategy}"]
        r = load_recipe(args.recipe, _overrides(args) + ["accelerator=cpu", *over], check=not for_gpu)
    if for_gpu:
        gpu = find_gpu(args.gpu) if args.gpu else None
        if args.gpu_memory:
            gpu = custom_gpu(args.gpu_memory, gpu)
        target = Target("cuda", gpu, gpus, strategy)
    else:
        target = Target("cpu", None, gpus, strategy)
    if args.for_task != "train":
        from bigtune.plan.serving import main_plan_inference

        return main_plan_inference(args, r, target)
    config = resolve_config(r)
    workers = min(2, os.cpu_count() or 1)
    images = _image_grids(args, r, config)
    search = {"max_gpus": args.max_gpus, "config": config, "adapters": args.adapters}
    if args.data_lengths:
        from bigtune.plan.search.lengths import plan_at_data_lengths

        p = plan_at_data_lengths(r, target, config=config, workers=workers)
        alts = alternatives(r, target, **search) if args.alternatives else None
    elif args.alternatives:  # the recipe's own plan in the same workers as the variants' simulations, beside them
        alts = alternatives(r, target, **search, own_plan={"images": images})
        p = alts.plan
    else:
        alts, p = None, plan(r, target, config=config, workers=workers, images=images)
    if args.json:
        out = {"plan": p.to_dict()}
        if alts is not None:
            out["plan"]["variants_evaluated"] = alts.evaluated
            out["alternatives"] = [a.to_dict() for a in alts]
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(p, verbose=args.verbose))
        if alts is not None:
            print(
                f"\n{len(alts)} of {alts.evaluated} variants fit on {target.gpu.key if target.gpu else 'cpu'}, "
                f"{target.gpus} GPU{'s' if target.gpus > 1 else ''} as asked first, then other counts; fastest first "
                "within each:"
            )
            print(format_alternatives(alts))
    return EXIT_OK


def _image_grids(args, r, config) -> "tuple | None":
    """--image-size as the image grid the model's processor makes of it (one per row), or None."""
    if not args.image_size:
        return None
    from bigtune.plan.base.constants import PlanError
    from bigtune.plan.step.chatvlm import (
        image_geometry,
        is_anyres_vlm_config,
        is_chat_vlm_config,
        is_generic_vlm_config,
        is_split_image_vlm_config,
        parse_image_size,
        split_geometry,
    )

    if is_generic_vlm_config(config):  # the processor lays out an image of that size (chatvlm.generic_batch)
        try:
            return (parse_image_size(args.image_size),)
        except ValueError as e:
            raise PlanError(str(e)) from None
    split = is_split_image_vlm_config(config)  # SmolVLM: its tiles follow the size
    anyres = is_anyres_vlm_config(config)  # LLaVA-NeXT: its tiles and tokens follow the size
    if not is_chat_vlm_config(config) and not split and not anyres:
        why = "sees images at a fixed size"
        raise PlanError(
            f"--image-size is for Qwen2-VL / Qwen2.5-VL, SmolVLM and LLaVA-NeXT models; {r.model.name} {why}"
        )
    if args.alternatives or args.data_lengths:
        raise PlanError("--image-size plans the recipe itself; leave out --alternatives and --data-lengths")
    try:
        height, width = parse_image_size(args.image_size)
    except ValueError as e:
        raise PlanError(str(e)) from None
    if anyres:  # the image's size itself, as the processor's image_sizes holds it (the engine records those)
        return ((height, width),)
    return ((split_geometry if split else image_geometry)(r, config).grid(height, width),)


def _cmd_compare(args) -> int:
    """``plan --compare-gpus`` / ``--cluster``: which GPU, how many, how long, what cost."""
    import json

    from bigtune.plan.base.constants import PlanError
    from bigtune.plan.search.choose import compare, format_comparison
    from bigtune.plan.search.offers import catalog_offers, load_cluster, load_prices
    from bigtune.plan.search.runlength import data_size
    from bigtune.recipe import RecipeError, gpu_plan_problems, load_recipe

    clash = [f for f, on in (("--gpu", args.gpu), ("--gpus", args.gpus), ("--strategy", args.strategy),
             ("--gpu-memory", args.gpu_memory), ("--alternatives", args.alternatives),
             ("--data-lengths", args.data_lengths), ("--for", args.for_task != "train")) if on]  # fmt: skip
    if args.compare_gpus and args.cluster:
        clash.append("--compare-gpus with --cluster")
    if clash:
        raise PlanError(
            f"--compare-gpus/--cluster choose the GPUs themselves; drop {', '.join(clash)} "
            "(a cluster profile's partitions replace --compare-gpus)"
        )
    r = load_recipe(args.recipe, _overrides(args) + ["accelerator=cpu"], check=False)
    if problems := gpu_plan_problems(r):
        raise RecipeError(problems, args.recipe)
    if args.cluster:
        if args.prices:
            raise PlanError("a cluster profile prices its own partitions; drop --prices")
        name, offers = load_cluster(args.cluster, args.max_gpus)
        label = f"cluster {name} ({args.cluster}), per partition"
    else:
        prices = load_prices(args.prices)
        names = None if args.compare_gpus == "all" else [n.strip() for n in args.compare_gpus.split(",") if n.strip()]
        offers = catalog_offers(names, prices, args.max_gpus)
        label = prices.label
    cmp = compare(r, offers, data_size(r, args.samples), adapters=args.adapters, max_hours=args.max_hours,
                  budget=args.budget)  # fmt: skip
    if args.json:
        print(json.dumps({**cmp.to_dict(), "prices": label}, indent=2))
    else:
        print(format_comparison(cmp, label))
    return EXIT_OK
