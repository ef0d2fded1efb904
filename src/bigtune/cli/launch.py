"""cli.launch: ``bigtune launch slurm``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bigtune.recipe import load_recipe
from bigtune.run.launch import default_python, launch_shape, run_folder, slurm_script


def _strategies() -> list[str]:
    """The recipe schema's strategy choices (one list, in recipe.py)."""
    import typing

    from bigtune.recipe import Recipe

    return list(typing.get_args(typing.get_type_hints(Recipe)["strategy"]))


def add_cli(sub) -> None:
    p = sub.add_parser("launch", help="write (and optionally submit) a Slurm batch script for a recipe")
    p.add_argument("system", choices=["slurm"])
    p.add_argument("recipe", nargs="?")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--nodes", type=int, help="default: the recipe's num_nodes")
    p.add_argument("--gpus-per-node", type=int, help="tasks (one per GPU) per node; default: the recipe's devices")
    p.add_argument("--strategy", choices=_strategies(), help="default: the recipe's strategy")
    p.add_argument("--time", help="Slurm time limit, e.g. 02:00:00 (default 02:00:00; with --cluster: planned)")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--cpus-per-task", type=int, help="default: from bigtune's host plan (1 + data.num_workers)")
    p.add_argument(
        "--mem", help="memory per node, e.g. 200G (default: from bigtune's host plan: each task loads the weights once)"
    )
    p.add_argument(
        "--cluster",
        metavar="FILE",
        help="choose the partition from a cluster profile (as `bigtune plan --cluster`): the cheapest that fits, "
        "and fill --partition, --gres, --nodes, --ntasks-per-node, --cpus-per-task, --mem and --time (the "
        "estimate x 1.5 + 15 min) from the plan; refused with the reason when no partition fits",
    )
    p.add_argument(
        "--samples", type=int, metavar="N", help="with --cluster: the data's size, instead of reading it as train does"
    )
    p.add_argument("--job-name")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="train on the nodes' CPU cores: no GPUs asked for, accelerator=cpu; --gpus-per-node then counts "
        "processes (a small test job, or a cluster without GPUs)",
    )
    p.add_argument(
        "--python",
        metavar="PATH",
        help="the interpreter the job runs `-m bigtune` with on the nodes (default: $VIRTUAL_ENV/bin/python in an "
        "activated venv, else python3 on the job's PATH, which sbatch passes from the submitting shell)",
    )
    p.add_argument("--out", help="script path (default: <output_dir>/job.sbatch)")
    p.add_argument("--submit", action="store_true", help="run sbatch on the script")
    p.set_defaults(func=main_launch)


def _script(args) -> str:
    if args.cluster:
        return _cluster_script(args)
    from bigtune.plan.base.constants import PlanError

    if args.samples is not None:
        raise PlanError("--samples sizes the run for --cluster's time estimate; add --cluster FILE or drop it")
    nodes, gpus_per_node, strategy = launch_shape(
        args.recipe, args.overrides, args.nodes, args.gpus_per_node, args.strategy
    )
    return slurm_script(
        args.recipe,
        args.overrides,
        nodes,
        gpus_per_node,
        args.time or "02:00:00",
        args.partition,
        args.account,
        args.cpus_per_task,
        args.mem,
        args.job_name,
        strategy,
        python=args.python,
        cpu=args.cpu,
    )


def _set_value(v) -> str:
    """A recipe value as --set text (YAML)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return "null" if v is None else str(v)


def _not_here(strategy: str) -> str | None:
    """Why a strategy cannot be launched from here: the script is validated on this machine (as without
    --cluster), and DeepSpeed strategies need DeepSpeed installed."""
    import importlib.util

    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed here (pip install 'bigtune[deepspeed]')"
    return None


def _cluster_script(args) -> str:
    """The script for the cheapest partition of ``args.cluster`` that fits (plan/search/choose.py)."""
    from bigtune.plan.base.constants import GIB, PlanError
    from bigtune.plan.search.choose import TIME_MARGIN, TIME_STARTUP_S, compare, pick_partition
    from bigtune.plan.search.offers import format_slurm_time, load_cluster
    from bigtune.plan.search.runlength import data_size, hours
    from bigtune.recipe import RecipeError, gpu_plan_problems

    flags = ("partition", "nodes", "gpus_per_node", "strategy", "time", "mem", "cpus_per_task")
    if given := [f"--{f.replace('_', '-')}" for f in flags if getattr(args, f) is not None]:
        raise PlanError(f"--cluster fills {', '.join(given)} from the plan; drop them, or drop --cluster")
    if args.cpu:
        raise PlanError("--cluster chooses a GPU partition; drop --cpu, or drop --cluster")
    r = load_recipe(args.recipe, list(args.overrides) + ["accelerator=cpu"], check=False)
    if problems := gpu_plan_problems(r):
        raise RecipeError(problems, args.recipe)
    name, offers = load_cluster(args.cluster)
    c = pick_partition(compare(r, offers, data_size(r, args.samples), skip=_not_here), r)
    variant = [
        f"{k}={_set_value(v)}" for k, v in c.plan.overrides.items() if k not in ("devices", "num_nodes", "strategy")
    ]
    cost = "" if c.cost is None else f", cost {c.cost:,.2f} {c.offer.unit}"
    notes = [
        f"partition chosen by bigtune from cluster {name} ({args.cluster}): the cheapest that fits; "
        f"{c.gpus} x {c.offer.gpu.key}, variant: {c.plan.variant}",
        f"estimate {hours(c.seconds)} ({c.length.steps} steps x {c.plan.step_time_s:.3g} s + evaluation){cost}; "
        f"--time = estimate x {1 + TIME_MARGIN:g} + {TIME_STARTUP_S // 60} min (the time model is uncalibrated)",
        "--mem / --cpus-per-task from bigtune's host plan: each task loads the weights once (+ any optimizer "
        "state in CPU RAM); cpus = 1 + data.num_workers, at least 2",
    ]
    print(f"cluster {name}: {c.offer.name}, {c.nodes} node(s) x {c.gpus // c.nodes} GPU(s), {hours(c.seconds)}{cost}")
    return slurm_script(
        args.recipe,
        list(args.overrides) + variant,
        c.nodes,
        c.gpus // c.nodes,
        format_slurm_time(c.slurm_time_s),
        c.offer.name,
        args.account,
        c.cpus_per_task,
        f"{-(-c.host_mem_bytes // GIB)}G",
        args.job_name,
        c.strategy,
        gres=c.offer.partition.gres,
        notes=notes,
        python=args.python,
    )


def _python_warning(python: str) -> str | None:
    """Why ``python`` here looks unable to run bigtune (None when it can): the job runs ``python -m bigtune``
    on the nodes, which usually see the same environment. Only a warning: a node's PATH may differ."""
    probe = "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('bigtune', 'torch')))"
    try:
        ok = subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} does not run here ({type(e).__name__})"
    return None if ok else f"{python} here cannot import bigtune and torch"


def main_launch(args) -> int:
    text = _script(args)
    r = load_recipe(args.recipe, list(args.overrides) + ["accelerator=cpu", "strategy=ddp"])  # for output_dir only
    # Slurm opens the job's log in the run folder before the script runs and makes no folder for it: make it
    # now, wherever the script itself goes.
    folder = run_folder(r, Path.cwd())
    folder.mkdir(parents=True, exist_ok=True)
    path = Path(args.out or Path(r.output_dir or f"runs/{r.name}") / "job.sbatch")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    print(f"wrote {path}")
    if problem := _python_warning(args.python or default_python()):
        print(
            f"warning: {problem}; the job runs it on the nodes: activate the environment bigtune is installed in "
            f"before launch, or pass --python (this launch runs under {sys.executable})",
            file=sys.stderr,
        )
    if args.submit:
        return subprocess.run(["sbatch", str(path)]).returncode
    print(f"submit with: sbatch {path}")
    return 0
