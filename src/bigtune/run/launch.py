"""`bigtune launch slurm`: a readable sbatch script for one recipe on N nodes × G GPUs.

One Slurm task per GPU (`--ntasks-per-node=G`), started by `srun`: Lightning Fabric then finds the
ranks in Slurm's environment (SLURM_PROCID, SLURM_LOCALID, SLURM_NODELIST), so bigtune spawns nothing
itself. The job asks for requeue and for SIGTERM two minutes before its time limit; bigtune answers a
SIGTERM by writing a checkpoint and exiting, and the requeued job continues with `--auto-resume`.

The script holds no path relative to where it is submitted from: the run folder, the log and the recipe
file are absolute, and the job runs in the folder `launch` ran in (`--chdir`), so paths inside the recipe
(data files, local models) resolve on the node as they did when the script was written and checked.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path
from typing import Optional

from bigtune.recipe import Recipe, load_recipe


def run_folder(r: Recipe, workdir: Path) -> Path:
    """The run's folder, absolute: ``output_dir`` (default ``runs/<name>``) taken against ``workdir``."""
    return Path(os.path.normpath(Path(workdir).absolute() / (r.output_dir or f"runs/{r.name}")))


def default_python() -> str:
    """The interpreter the job runs ``-m bigtune`` with when ``--python`` is not given.

    In an activated virtual environment (VIRTUAL_ENV set) its ``bin/python``, absolute: a job started
    with ``--export=NONE`` or a site's own job environment finds it all the same, and the venv has to sit
    on a filesystem the nodes share anyway, as the run folder does. Otherwise ``python3`` as the job's PATH
    finds it: sbatch passes the submitting shell's environment by default (``--export=ALL``), so a conda
    environment or a ``module load`` done before sbatch carries over. Not ``sys.executable``: the
    interpreter that happens to run ``launch`` (a pipx venv, a laptop's) need not exist on the nodes.
    """
    venv = os.environ.get("VIRTUAL_ENV")
    return str(Path(venv) / "bin" / "python") if venv else "python3"


def slurm_script(
    recipe: Optional[str],
    overrides: list[str],
    nodes: int,
    gpus_per_node: int,
    time: str,
    partition: Optional[str] = None,
    account: Optional[str] = None,
    cpus_per_task: Optional[int] = None,
    mem: Optional[str] = None,
    job_name: Optional[str] = None,
    strategy: str = "auto",
    python: Optional[str] = None,
    gres: Optional[str] = None,
    notes: Optional[list[str]] = None,
    workdir: Optional[Path] = None,
    cpu: bool = False,
) -> str:
    """The sbatch text. ``cpus_per_task`` / ``mem`` left None are taken from bigtune's host plan
    (``infer_plan.training_host_request``, one load per task); when the model cannot be planned, 8 cores and
    no --mem. ``gres`` (e.g. ``gpu:a100``) asks for the GPUs as ``--gres=<gres>:<G>`` instead of
    ``--gpus-per-node``; ``notes`` are written as comments at the top (where the directives came from).
    ``workdir`` (default: the current folder) is where the job runs and what relative paths are taken
    against; ``python`` the interpreter on the nodes (default ``default_python()``). ``cpu``: no GPUs, the
    G tasks per node train on CPU cores (``accelerator=cpu``).

    Long because it writes one sbatch script in order, a few lines per directive, each with its reason.
    """
    workdir = Path(workdir or Path.cwd()).absolute()
    python = python or default_python()
    world_over = [
        f"devices={gpus_per_node}",
        f"num_nodes={nodes}",
        f"strategy={strategy}",
        "accelerator=cpu" if cpu else "accelerator=cuda",
        "checkpoint.enabled=true",
    ]
    # Validate now, not in the queue; this machine may have no GPU, so DeepSpeed (CUDA only) is
    # checked as DDP plus its own rules as on a GPU. A CPU job is checked as it will run.
    deepspeed = strategy.startswith("deepspeed") and not cpu
    check_as = [o.replace(f"strategy={strategy}", "strategy=ddp") for o in world_over] if deepspeed else world_over
    r = load_recipe(recipe, list(overrides) + check_as + ["accelerator=cpu"])
    if deepspeed:
        from bigtune.recipe import RecipeError, check_deepspeed

        problems = check_deepspeed(dataclasses.replace(r, strategy=strategy), "cuda")
        if problems:
            raise RecipeError(problems, recipe)
    out_dir = str(run_folder(r, workdir))
    if not r.checkpoint.every_steps:
        world_over.append("checkpoint.every_steps=100")
    world_over.append(f"output_dir={out_dir}")
    name = job_name or f"bigtune-{r.name}"
    host_note = None
    if cpus_per_task is None or mem is None:
        from bigtune.plan.serving import training_host_request

        try:
            plan_mem, plan_cpus, rule = training_host_request(r, gpus_per_node)
            host_note = f"# --mem / --cpus-per-task from bigtune's host plan: {rule}"
            mem = mem or f"{plan_mem // 2**30}G"
            cpus_per_task = cpus_per_task or plan_cpus
        except Exception as e:  # noqa: BLE001 - no config to plan from (hub unreachable...): say so, use a default
            host_note = f"# host resources not planned ({type(e).__name__}); set --mem / --cpus-per-task yourself"
            cpus_per_task = cpus_per_task or 8
    unit = "CPU process(es)" if cpu else "GPU(s)"
    lines = [
        "#!/bin/bash",
        f"# bigtune: {r.name} on {nodes} node(s) x {gpus_per_node} {unit}, strategy {strategy}",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={gpus_per_node}   # one task per "
        + ("process: Fabric reads the ranks from Slurm" if cpu else "GPU: Fabric reads the ranks from Slurm"),
    ]
    if not cpu:
        lines.append(f"#SBATCH --gres={gres}:{gpus_per_node}" if gres else f"#SBATCH --gpus-per-node={gpus_per_node}")
    lines += [f"#SBATCH --cpus-per-task={cpus_per_task}", f"#SBATCH --time={time}"]
    if host_note:
        lines.insert(2, host_note)
    lines[2:2] = [f"# {n}" for n in notes or []]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    if mem:
        lines.append(f"#SBATCH --mem={mem}")
    lines += [
        "#SBATCH --requeue                 # preempted or timed out: back in the queue",
        "#SBATCH --signal=TERM@120         # SIGTERM to every task 2 min before the limit: checkpoint + exit",
        # Where launch ran: the recipe's relative paths (data files, local models) resolve as they did there.
        f"#SBATCH --chdir={workdir}",
        # Slurm opens the log before the script runs and makes no folder for it: launch made this one.
        f"#SBATCH --output={out_dir}/slurm-%j.out",
        "",
        "set -euo pipefail",
        f"mkdir -p {shlex.quote(out_dir)}",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_PORT=${MASTER_PORT:-29500}",
        "",
    ]
    recipe_arg = [str(Path(os.path.normpath(workdir / recipe)))] if recipe else []
    cmd = [python, "-m", "bigtune", "train"] + recipe_arg
    for o in list(overrides) + world_over:
        cmd += ["--set", o]
    cmd.append("--auto-resume")
    lines.append("srun " + " ".join(shlex.quote(c) for c in cmd))
    return "\n".join(lines) + "\n"


def launch_shape(
    recipe: Optional[str],
    overrides: list[str],
    nodes: Optional[int],
    gpus_per_node: Optional[int],
    strategy: Optional[str],
) -> tuple[int, int, str]:
    """(nodes, GPUs per node, strategy) of a job: the recipe's num_nodes, devices and strategy unless a flag
    gives them; a flag that contradicts a value the recipe sets (not its default) is a RecipeError."""
    from bigtune.recipe import RecipeError

    r = load_recipe(recipe, list(overrides) + ["accelerator=cpu"], check=False)
    default = Recipe()
    problems = []
    for flag, given, key in (
        ("--nodes", nodes, "num_nodes"),
        ("--gpus-per-node", gpus_per_node, "devices"),
        ("--strategy", strategy, "strategy"),
    ):
        own = getattr(r, key)
        if given is not None and own != getattr(default, key) and given != own:
            problems.append(
                f"{flag} {given} contradicts the recipe's {key}={own}: drop the flag, or change the recipe "
                f"(--set {key}={given})"
            )
    if problems:
        raise RecipeError(problems, recipe)
    return nodes or r.num_nodes, gpus_per_node or r.devices, strategy or r.strategy
