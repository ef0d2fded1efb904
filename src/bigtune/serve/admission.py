"""Admission: a submitted recipe is validated, checked against the admin's rules and planned against the cluster's
GPUs before it is queued. A job that can never fit is refused at once with the plan's reason and the variants that
would fit; ``auto`` takes the fastest of those instead.

On a cluster described by a cluster profile (Slurm partitions, ``Offers``), ``admit_to_partition`` plans the job
on every partition and takes the one ``bigtune launch slurm --cluster`` would (plan/search/choose.py: the cheapest
that fits, the faster on a tie, training what the recipe trains; with ``auto`` a variant that changes the training
where nothing else fits).

Nothing here knows HTTP: problems are raised as ``Refused`` with a status the API passes on.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from bigtune.plan.base.constants import GIB


@dataclass(frozen=True)
class Cluster:
    """The GPUs jobs run on: ``gpu`` a catalog name (None: this machine's CPU, its slots standing in for GPUs),
    ``gpus_per_node`` × ``nodes`` of them, and each node's host RAM where known."""

    gpu: Optional[str] = None
    gpus_per_node: int = 1
    nodes: int = 1
    host_ram_gib: Optional[float] = None
    one_node_jobs: bool = False  # each job runs on one node (Ray: see docs/how-to/serve.md, several GPUs under Ray)

    @property
    def most_gpus_per_job(self) -> int:
        return self.gpus_per_node if self.one_node_jobs else self.total_gpus

    @property
    def total_gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def label(self) -> str:
        what = self.gpu or "CPU slots"
        return f"{self.nodes} node(s) × {self.gpus_per_node} {what}"


@dataclass(frozen=True)
class Offers:
    """A cluster profile's partitions (plan/search/offers.py's ``Offer``, one per partition) and where it was read."""

    name: str
    path: str
    offers: tuple


@dataclass(frozen=True)
class Rules:
    """What the admin allows: the folders recipe paths may name, and code shipped with hub models."""

    allowed_roots: tuple[Path, ...]
    allow_trust_remote_code: bool = False


class Refused(Exception):
    """A submission the service will not queue. ``status``: 422 a bad recipe, 403 against the admin's rules,
    409 it can never fit this cluster (``plan`` and ``alternatives`` say why and what would)."""

    def __init__(self, status: int, reason: str, problems: list[str] | None = None, plan: dict | None = None,
                 alternatives: list[dict] | None = None):  # fmt: skip
        super().__init__(reason)
        self.status, self.reason = status, reason
        self.problems = problems or []
        self.plan = plan
        self.alternatives = alternatives or []

    def to_dict(self) -> dict:
        return {"reason": self.reason, "problems": self.problems, "plan": self.plan,
                "alternatives": self.alternatives}  # fmt: skip


@dataclass
class Admitted:
    """A job the service will queue: its recipe tree, the overrides to run it with (the user's, then the chosen
    variant's), the plan it was admitted by and what that plan says it needs."""

    tree: dict
    overrides: list[str]
    plan: dict
    slots: int
    name: str
    total_steps: Optional[int] = None
    planned_gpu_hours: Optional[float] = None
    variant: Optional[str] = None
    output_dir: Optional[str] = None  # the user's output_dir: each job's run folder is <output_dir>/<job id>
    placement: Optional[dict] = None  # admit_to_partition's choice: the partition and what the job asks of it


def recipe_tree(recipe: str | dict) -> dict:
    """A submitted recipe (YAML text or a mapping) as a mapping of keys."""
    if isinstance(recipe, dict):
        return dict(recipe)
    try:
        tree = yaml.safe_load(recipe) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        raise Refused(422, f"the recipe is not valid YAML{at}: {getattr(e, 'problem', e)}") from None
    if not isinstance(tree, dict):
        raise Refused(422, "the recipe's top level must be a mapping of keys")
    return tree


def _is_local(name: str, base: Path) -> bool:
    """A model or tokenizer name that names a folder (./x, /x, ~/x, a/b/c or an existing path), not a hub id."""
    return name.startswith((".", "/", "~")) or name.count("/") >= 2 or (base / name).expanduser().exists()


def _resolve(path: str, base: Path) -> Path:
    p = Path(path).expanduser()
    return (p if p.is_absolute() else base / p).resolve()


def path_problems(r, rules: Rules, base: Path) -> list[str]:
    """Recipe paths (model and tokenizer folders, data sources, output_dir) outside the allowed roots; relative
    paths count from ``base``, the folder jobs run in. Symlinks are followed before the check."""
    named: list[tuple[str, str]] = []
    if _is_local(r.model.name, base):
        named.append(("model.name", r.model.name))
    if r.model.tokenizer and _is_local(r.model.tokenizer, base):
        named.append(("model.tokenizer", r.model.tokenizer))
    for key, src in [("data.source", r.data.source), ("data.val_source", r.data.val_source)] + [
        (f"data.sources[{i}].source", e.get("source"))
        for i, e in enumerate(r.data.sources or [])
        if isinstance(e, dict)
    ]:
        if isinstance(src, str) and src and src != "demo" and not src.startswith("hf:"):
            named.append((key, src))
    if r.output_dir:
        named.append(("output_dir", r.output_dir))
    roots = ", ".join(str(x) for x in rules.allowed_roots) or "(none)"
    out = []
    for key, value in named:
        where = _resolve(value, base)
        if not any(where == root or where.is_relative_to(root) for root in rules.allowed_roots):
            out.append(f"{key}: {value} ({where}) is outside the folders this service allows: {roots}")
    if r.model.trust_remote_code and not rules.allow_trust_remote_code:
        out.append(
            "model.trust_remote_code: this service does not run code shipped with hub models; an admin can allow it "
            "(bigtune serve --allow-trust-remote-code)"
        )
    return out


# The planner simulates under torch's fake-tensor mode, whose state is global to the process: one plan at a time.
# Plans are kept (most recent 32): a job refused as too big and sent again with auto does not plan twice.
_PLAN_LOCK = threading.Lock()
_PLANS: OrderedDict = OrderedDict()


def _plan_with_alternatives(r, target, max_gpus: int, want_alternatives: bool) -> tuple[Any, Optional[list]]:
    from bigtune.models.configs import resolve_config
    from bigtune.plan.planner import plan
    from bigtune.plan.search.alternatives import alternatives

    key = (yaml.safe_dump(r.to_dict(), sort_keys=True), target.label(), max_gpus, want_alternatives)
    with _PLAN_LOCK:
        if key in _PLANS:
            _PLANS.move_to_end(key)
            return _PLANS[key]
        config = resolve_config(r)
        # workers=1: the planner's workers are forked processes, and a server's threads must not be forked
        p = plan(r, target, config=config, workers=1)
        alts = None
        if want_alternatives and p.fits is False:
            alts = list(alternatives(r, target, max_gpus=max_gpus, config=config, workers=1, adapters=True))
        _PLANS[key] = (p, alts)
        while len(_PLANS) > 32:
            _PLANS.popitem(last=False)
        return p, alts


def _override_text(key: str, value: Any) -> str:
    if isinstance(value, str):
        return f"{key}={value}"
    return f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"


def _variant_gpus(alt, asked: int) -> int:
    return int(alt.overrides.get("devices", asked))


def _host_ram_problem(p, cluster: Cluster) -> Optional[str]:
    if cluster.host_ram_gib is None or not p.host_bytes_per_node:
        return None
    need = p.host_bytes_per_node / GIB
    if need <= cluster.host_ram_gib:
        return None
    return f"needs {need:.1f} GiB of host RAM per node; the cluster's nodes have {cluster.host_ram_gib:.1f} GiB"


def _checked(recipe: str | dict, overrides: list[str], for_gpu: bool, rules: Rules, base: Path) -> tuple[dict, Any]:
    """(the recipe's tree, the Recipe) once valid and within the admin's rules; else Refused."""
    from bigtune.recipe import RecipeError, gpu_plan_problems, load_recipe

    tree = recipe_tree(recipe)
    tree.setdefault("name", "job")
    try:
        # As it will run: on a CPU cluster every rule (data present, precision this machine runs); for GPUs,
        # the rules a GPU node would apply (the planner's, as `bigtune plan --gpu`).
        r = load_recipe(tree, overrides, check=not for_gpu)
        if for_gpu and (problems := gpu_plan_problems(r)):
            raise RecipeError(problems)
    except RecipeError as e:
        raise Refused(422, "invalid recipe: " + "; ".join(e.problems), problems=e.problems) from None
    if problems := path_problems(r, rules, base):
        raise Refused(403, "; ".join(problems), problems=problems)
    return tree, r


def admit(recipe: str | dict, overrides: list[str], auto: bool, cluster: Cluster, rules: Rules, base: Path) -> Admitted:
    """Validate, check and plan one submission (see the module's docstring); raise Refused when it is not admitted.

    Long because it is admission's one sequence, read top to bottom: parse, validate, check the rules, plan,
    and where the plan does not fit, refuse or take the fastest variant that does.
    """
    from bigtune.core.gpus import UnknownGPUError, find_gpu
    from bigtune.plan.base.target import Target, run_strategy
    from bigtune.recipe import RecipeError, load_recipe

    for_gpu = cluster.gpu is not None
    tree, r = _checked(recipe, overrides, for_gpu, rules, base)
    slots = r.world_size
    if cluster.one_node_jobs and r.num_nodes > 1:
        raise Refused(409, f"the recipe asks for num_nodes={r.num_nodes}; this service runs each job on one node "
                           f"of its cluster ({cluster.label()}): set num_nodes=1 and devices to at most "
                           f"{cluster.gpus_per_node}, or run it on Slurm")  # fmt: skip
    if slots > cluster.most_gpus_per_job:
        per_job = " on one node" if cluster.one_node_jobs else ""
        raise Refused(
            409,
            f"the recipe asks for {slots} GPUs (devices × num_nodes); a job gets at most {cluster.most_gpus_per_job}"
            f"{per_job} ({cluster.label()}): set devices (and num_nodes) to at most that",
        )
    try:
        gpu = find_gpu(cluster.gpu) if for_gpu else None
    except UnknownGPUError as e:  # the server's own --gpu: checked at start, so only a changed catalog
        raise Refused(409, str(e)) from None
    r_plan = load_recipe(tree, [*overrides, "accelerator=cpu"], check=False)
    target = Target("cuda" if for_gpu else "cpu", gpu, slots, run_strategy(r_plan.strategy, slots))
    p, alts = _plan_with_alternatives(r_plan, target, cluster.most_gpus_per_job, want_alternatives=True)
    why = None
    if p.fits is False:
        need = (p.needed_total or p.peak_total) / GIB
        why = f"does not fit: needs {need:.1f} GiB per GPU of {p.capacity / GIB:.1f} GiB on {p.target}"
    elif host := _host_ram_problem(p, cluster):
        why = f"does not fit: {host}"
    chosen, variant = overrides, None
    if why is not None:
        fitting = [a for a in alts or [] if _variant_gpus(a, slots) <= cluster.most_gpus_per_job]
        if cluster.one_node_jobs:
            fitting = [a for a in fitting if int(a.overrides.get("num_nodes", 1)) == 1]
        fitting = [a for a in fitting if _host_ram_problem(a, cluster) is None]
        if not auto or not fitting:
            more = " and none of its variants fits this cluster" if not fitting else "; submit with auto to take one"
            raise Refused(409, why + more, plan=p.to_dict(), alternatives=[a.to_dict() for a in fitting])
        best = max(fitting, key=lambda a: a.tokens_per_s or 0.0)
        chosen = [*overrides, *(_override_text(k, v) for k, v in best.overrides.items())]
        variant = best.variant
        try:
            r = load_recipe(tree, chosen, check=not for_gpu)
        except RecipeError as e:
            raise Refused(409, why + f"; its fitting variant {variant!r} is not valid here: {e}") from None
        p, slots = best, r.world_size
    steps = r.train.max_steps
    hours = p.step_time_s * steps * slots / 3600 if (p.step_time_s and steps) else None
    return Admitted(tree=tree, overrides=list(chosen), plan=p.to_dict(), slots=slots, name=str(tree["name"]),
                    total_steps=steps, planned_gpu_hours=hours, variant=variant, output_dir=r.output_dir)  # fmt: skip


def _run_size(r):
    """The run's data size as ``train`` reads it; where it cannot be read here (a path only the nodes see, a
    tokenizer not downloaded) and the recipe sets max_steps, a size that gives max_steps steps (no evaluations
    counted), else Refused."""
    from bigtune.plan.base.constants import PlanError
    from bigtune.plan.search.runlength import DataSize, data_size

    try:
        return data_size(r)
    except PlanError as e:
        if not r.train.max_steps:
            raise Refused(422, f"{e}; or set train.max_steps, which fixes the run's length") from None
        rows = r.train.max_steps * r.global_batch_size
        return DataSize(rows, None, f"train.max_steps (the data could not be read here: {e})")


def _deepspeed_missing(strategy: str) -> Optional[str]:
    """As ``launch slurm --cluster``: a DeepSpeed strategy only where DeepSpeed is installed (here, and so,
    as a rule, on the nodes that share this environment)."""
    import importlib.util

    if strategy.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed (pip install 'bigtune[deepspeed]')"
    return None


_COMPARES: OrderedDict = OrderedDict()


def admit_to_partition(recipe: str | dict, overrides: list[str], auto: bool, offers: Offers, rules: Rules,
                       base: Path) -> Admitted:  # fmt: skip
    """Validate, check and plan one submission on every partition of ``offers``; queue it for the partition
    choose.py picks (see the module's docstring), or raise Refused with each partition's reason."""
    from bigtune.plan.base.constants import PlanError
    from bigtune.plan.search.choose import compare, pick_partition
    from bigtune.plan.search.offers import format_slurm_time
    from bigtune.recipe import load_recipe

    tree, r = _checked(recipe, overrides, True, rules, base)
    r_plan = load_recipe(tree, [*overrides, "accelerator=cpu"], check=False)
    key = (yaml.safe_dump(r_plan.to_dict(), sort_keys=True), offers)
    with _PLAN_LOCK:  # the planner's fake-tensor mode is global to the process: one plan at a time
        if key not in _COMPARES:
            _COMPARES[key] = compare(r_plan, list(offers.offers), _run_size(r_plan), skip=_deepspeed_missing)
            while len(_COMPARES) > 8:
                _COMPARES.popitem(last=False)
        cmp = _COMPARES[key]
        try:
            c = pick_partition(cmp, r_plan)
        except PlanError as e:
            changing = [x for x in cmp.choices if x.changes and not x.excluded]
            if not auto or not changing:
                more = "; submit with auto to take one of the variants that fit" if changing else ""
                raise Refused(409, f"{e}{more}", alternatives=[x.to_dict() for x in changing]) from None
            # auto: the same choice with the variants that change the training allowed
            c = pick_partition(dataclasses.replace(cmp, choices=[dataclasses.replace(x, changes=[])
                                                                 for x in changing]), r_plan)  # fmt: skip
            c = next(x for x in changing if x.offer.name == c.offer.name and x.gpus == c.gpus)
    layout = {"devices": c.gpus // c.nodes, "num_nodes": c.nodes, "strategy": c.strategy}
    variant = {k: v for k, v in c.plan.overrides.items() if k not in layout}
    chosen = [*overrides, *(_override_text(k, v) for k, v in {**variant, **layout}.items())]
    cost = "" if c.cost is None else f", {c.cost:,.2f} {c.offer.unit}"
    why = (f"the cheapest partition that fits{' (a variant: ' + ', '.join(c.changes) + ')' if c.changes else ''}: "
           f"{c.gpus} × {c.offer.gpu.key} on {c.nodes} node(s), {c.plan.variant}, {c.seconds / 60:.1f} min{cost}")  # fmt: skip
    placement = {
        "partition": c.offer.name, "gres": c.offer.partition.gres, "time": format_slurm_time(c.slurm_time_s),
        "mem_gib": -(-c.host_mem_bytes // GIB) or None, "cpus_per_task": c.cpus_per_task or None, "why": why,
        "cluster": offers.name, "ranked": [x.to_dict() for x in cmp.ranked("cost")],
        "not_ranked": cmp.not_ranked(),
    }  # fmt: skip
    return Admitted(tree=tree, overrides=chosen, plan={**c.plan.to_dict(), "partition": placement}, slots=c.gpus,
                    name=str(tree["name"]), total_steps=c.length.steps, planned_gpu_hours=c.seconds * c.gpus / 3600,
                    variant=c.plan.variant if (variant or c.changes) else None, output_dir=r.output_dir,
                    placement=placement)  # fmt: skip
