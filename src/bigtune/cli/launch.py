"""cli.launch."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from bigtune.recipe import load_recipe
from bigtune.run.launch import slurm_script


def add_cli(sub) -> None:
    p = sub.add_parser("launch", help="write (and optionally submit) a Slurm batch script for a recipe")
    p.add_argument("system", choices=["slurm"])
    p.add_argument("recipe", nargs="?")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=1)
    p.add_argument(
        "--strategy",
        choices=[
            "ddp",
            "fsdp",
            "deepspeed_stage_2",
            "deepspeed_stage_2_offload",
            "deepspeed_stage_3",
            "deepspeed_stage_3_offload",
        ],
        default="fsdp",
    )
    p.add_argument("--time", default="02:00:00", help="Slurm time limit, e.g. 02:00:00")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--cpus-per-task", type=int, help="default: from bigtune's host plan (1 + data.num_workers)")
    p.add_argument(
        "--mem", help="memory per node, e.g. 200G (default: from bigtune's host plan: each task loads the weights once)"
    )
    p.add_argument("--job-name")
    p.add_argument("--out", help="script path (default: <output_dir>/job.sbatch)")
    p.add_argument("--submit", action="store_true", help="run sbatch on the script")
    p.set_defaults(func=main_launch)


def main_launch(args) -> int:
    text = slurm_script(
        args.recipe,
        args.overrides,
        args.nodes,
        args.gpus_per_node,
        args.time,
        args.partition,
        args.account,
        args.cpus_per_task,
        args.mem,
        args.job_name,
        args.strategy,
    )
    r = load_recipe(args.recipe, list(args.overrides) + ["accelerator=cpu", "strategy=ddp"])  # for output_dir only
    path = Path(args.out or Path(r.output_dir or f"runs/{r.name}") / "job.sbatch")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    print(f"wrote {path}")
    if args.submit:
        return subprocess.run(["sbatch", str(path)]).returncode
    print(f"submit with: sbatch {path}")
    return 0
