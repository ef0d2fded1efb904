"""`bigtune launch slurm`: a readable sbatch script for one recipe on N nodes × G GPUs.

One Slurm task per GPU (`--ntasks-per-node=G`), started by `srun`: Lightning Fabric then finds the
ranks in Slurm's environment (SLURM_PROCID, SLURM_LOCALID, SLURM_NODELIST), so bigtune spawns nothing
itself. The job asks for requeue and for SIGTERM two minutes before its time limit; bigtune answers a
SIGTERM by writing a checkpoint and exiting, and the requeued job continues with `--auto-resume`.
"""

from __future__ import annotations

import dataclasses
import shlex
import sys
from typing import Optional

from bigtune.recipe import load_recipe


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
    python: str = sys.executable,
    gres: Optional[str] = None,
    notes: Optional[list[str]] = None,
) -> str:
    """The sbatch text. ``cpus_per_task`` / ``mem`` left None are taken from bigtune's host plan
    (``infer_plan.training_host_request``, one load per task); when the model cannot be planned, 8 cores and
    no --mem. ``gres`` (e.g. ``gpu:a100``) asks for the GPUs as ``--gres=<gres>:<G>`` instead of
    ``--gpus-per-node``; ``notes`` are written as comments at the top (where the directives came from).

    Long because it writes one sbatch script in order, a few lines per directive, each with its reason.
    """
    world_over = [
        f"devices={gpus_per_node}",
        f"num_nodes={nodes}",
        f"strategy={strategy}",
        "accelerator=cuda",
        "checkpoint.enabled=true",
    ]
    # Validate now, not in the queue; this machine may have no GPU, so DeepSpeed (CUDA only) is
    # checked as DDP plus its own rules as on a GPU.
    deepspeed = strategy.startswith("deepspeed")
    check_as = [o.replace(f"strategy={strategy}", "strategy=ddp") for o in world_over] if deepspeed else world_over
    r = load_recipe(recipe, list(overrides) + check_as + ["accelerator=cpu"])
    if deepspeed:
        from bigtune.recipe import RecipeError, check_deepspeed

        problems = check_deepspeed(dataclasses.replace(r, strategy=strategy), "cuda")
        if problems:
            raise RecipeError(problems, recipe)
    out_dir = r.output_dir or f"runs/{r.name}"
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
    lines = [
        "#!/bin/bash",
        f"# bigtune: {r.name} on {nodes} node(s) x {gpus_per_node} GPU(s), strategy {strategy}",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={gpus_per_node}   # one task per GPU: Fabric reads the ranks from Slurm",
        f"#SBATCH --gres={gres}:{gpus_per_node}" if gres else f"#SBATCH --gpus-per-node={gpus_per_node}",
        f"#SBATCH --cpus-per-task={cpus_per_task}",
        f"#SBATCH --time={time}",
    ]
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
        f"#SBATCH --output={out_dir}/slurm-%j.out",
        "",
        "set -euo pipefail",
        f"mkdir -p {shlex.quote(out_dir)}",
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export MASTER_PORT=${MASTER_PORT:-29500}",
        "",
    ]
    cmd = [python, "-m", "bigtune", "train"] + ([recipe] if recipe else [])
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
    from bigtune.recipe import Recipe, RecipeError

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
