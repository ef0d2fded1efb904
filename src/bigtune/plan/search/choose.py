"""Which GPU, how many, how long and at what cost: ``bigtune plan --compare-gpus`` and ``--cluster``.

For every offer (a catalog GPU with its price, or a cluster partition) and every GPU count it allows, the
fastest variant that fits, found by the same search as ``--alternatives``; the whole run's time is that
variant's step time × the run's steps (from the data's size, plan/search/runlength.py) plus its evaluations, and
its cost that time × GPUs × the price per GPU-hour. Rows are ranked by cost and by time, one row per offer.

Speed: ``alternatives()`` simulates each distinct step (precision, micro batch, optimizer...) once per
call. Across GPU types the simulation differs only in the attention kernels CUDA would pick, which
depend on the compute capability only through ``kernels.sdpa_backend``'s thresholds (8.0: flash and
bf16 in the memory-efficient kernel); ``compare`` hands every offer of one kernel class the same ``sims``,
which alternatives() reads and adds to (tests/test_choose_gpu.py checks the class against sdpa_backend).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from bigtune.core.gpus import compute_capability
from bigtune.plan.base.constants import GIB, PlanError
from bigtune.plan.base.target import Plan, Target, run_strategy
from bigtune.plan.search.offers import Offer, format_slurm_time
from bigtune.plan.search.runlength import DataSize, RunLength, hours, run_length, run_seconds
from bigtune.recipe import Recipe, load_recipe

# The Slurm --time of a chosen job: the estimate × (1 + TIME_MARGIN) + TIME_STARTUP_S. The time model is
# uncalibrated (roofline.py) and the estimate leaves out loading the weights, checkpoints and start-up.
TIME_MARGIN = 0.5
TIME_STARTUP_S = 15 * 60

_STRATEGIES = ("deepspeed_stage_2_offload", "deepspeed_stage_3_offload", "deepspeed_stage_2", "deepspeed_stage_3")


def kernel_class(arch: Optional[tuple[int, int]]) -> Optional[tuple[int, int]]:
    """The compute capability standing for every ``arch`` whose simulated step is the same (see module doc)."""
    if arch is None:
        return None
    return (8, 0) if arch >= (8, 0) else (7, 0)


@dataclass
class Choice:
    """One offer at one GPU count: its fastest fitting variant, the whole run's time and cost."""

    offer: Offer
    gpus: int
    strategy: str
    plan: Plan
    length: RunLength
    train_s: float
    eval_s: float
    host_mem_bytes: int = 0  # per node (cluster partitions)
    cpus_per_task: int = 0
    excluded: list[str] = field(default_factory=list)  # why it is not ranked (filters, host limits)
    changes: list[str] = field(default_factory=list)  # result_changes(): a different training run

    @property
    def nodes(self) -> int:
        return self.offer.nodes(self.gpus)

    @property
    def seconds(self) -> float:
        return self.train_s + self.eval_s

    @property
    def cost(self) -> Optional[float]:
        return None if self.offer.price is None else self.seconds / 3600 * self.gpus * self.offer.price

    @property
    def verdict(self) -> str:
        if self.excluded:
            return self.excluded[0]
        fits = "fits (tight)" if self.plan.tight else "fits"
        return f"{fits}, changes {', '.join(self.changes)}" if self.changes else fits

    @property
    def slurm_time_s(self) -> float:
        return self.seconds * (1 + TIME_MARGIN) + TIME_STARTUP_S

    def to_dict(self) -> dict:
        return {
            "offer": self.offer.name,
            "gpu": self.offer.gpu.key,
            "gpus": self.gpus,
            "nodes": self.nodes,
            "strategy": self.strategy,
            "variant": self.plan.variant,
            "overrides": self.plan.overrides,
            "peak_total_bytes": self.plan.peak_total,
            "capacity_bytes": self.plan.capacity,
            "tight": self.plan.tight,
            "step_time_s": self.plan.step_time_s,
            **self.length.to_dict(),
            "train_s": self.train_s,
            "eval_s": self.eval_s,
            "hours": self.seconds / 3600,
            "price_per_gpu_hour": self.offer.price,
            "cost": self.cost,
            "unit": self.offer.unit,
            "price_source": self.offer.price_source,
            "verdict": self.verdict,
            "changes": self.changes,
            "excluded": self.excluded,
        }


@dataclass
class Comparison:
    recipe: str
    size: DataSize
    choices: list[Choice]
    unfit: dict[str, str]  # offer name -> why no count fits
    offers: list[Offer]

    def ranked(self, by: str) -> list[Choice]:
        """One row per offer, the best by ``by`` ("cost" or "time") among the rows no filter excluded."""
        best: dict[str, Choice] = {}
        for c in self.choices:
            if c.excluded or (by == "cost" and c.cost is None):
                continue
            key = (c.cost, c.seconds) if by == "cost" else (c.seconds, c.cost if c.cost is not None else float("inf"))
            b = best.get(c.offer.name)
            if b is None or key < ((b.cost, b.seconds) if by == "cost" else (b.seconds, b.cost or float("inf"))):
                best[c.offer.name] = c
        rows = list(best.values())
        rows.sort(key=lambda c: (c.cost, c.seconds) if by == "cost" else (c.seconds, c.cost or float("inf")))
        return rows

    def not_ranked(self) -> dict[str, str]:
        """Offers with no ranked row, and why (the reason of their fastest row)."""
        out = dict(self.unfit)
        ranked = {c.offer.name for c in self.choices if not c.excluded}
        for c in sorted(self.choices, key=lambda c: c.seconds):
            if c.offer.name not in ranked and c.offer.name not in out:
                out[c.offer.name] = f"{c.excluded[0]} (fastest: {c.gpus}× for {hours(c.seconds)})"
        return out

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe,
            "data": self.size.to_dict(),
            "by_cost": [c.to_dict() for c in self.ranked("cost")],
            "by_time": [c.to_dict() for c in self.ranked("time")],
            "not_ranked": self.not_ranked(),
            "rows": [c.to_dict() for c in self.choices],
            "time_rule": TIME_RULE,
        }


TIME_RULE = (
    "whole run = optimizer steps × the planned step time (full max_seq_length rows: an upper bound for shorter "
    "samples) + evaluations (forward ≈ 1/3 of a training sample's time); the time model is uncalibrated "
    "(roofline.py); several nodes are timed at the in-node GPU link (optimistic)"
)


def gpus_and_strategy(p: Plan) -> tuple[int, str]:
    """(GPU count, strategy) of an alternatives() plan, from its target label ("8× h100-sxm-80gb (fsdp)",
    "8× h100-sxm-80gb (fsdp, tensor_parallel=2)")."""
    m = re.match(r"^(\d+)× \S+(?: \(([^,\s)]+)(?:, tensor_parallel=\d+)?\))?$", p.target)
    if not m:
        raise PlanError(f"cannot read the GPU count of plan target {p.target!r}")
    gpus = int(m.group(1))
    if m.group(2):
        return gpus, m.group(2)
    return gpus, next((s for s in _STRATEGIES if s in p.variant), "single")


# Recipe keys whose change makes a different training run (other numerics or another optimizer), not the
# same run laid out differently: a variant that changes one is only taken where nothing else fits.
RESULT_KEYS = (
    "precision",
    "optim.name",
    "optim.grad_clip",
    "optim.in_backward",
    "peft.method",
    "model.quantize",
    "model.upcast_unquantized",
)


def result_changes(recipe: Recipe, p: Plan) -> list[str]:
    """The RESULT_KEYS ``p``'s variant sets to other values than the recipe ("optim.name=sgd")."""
    out = []
    for key in RESULT_KEYS:
        if key in p.overrides:
            own = recipe
            for part in key.split("."):
                own = getattr(own, part)
            if p.overrides[key] != own:
                out.append(f"{key}={p.overrides[key]}")
    return out


def _micro_and_accumulate(recipe: Recipe, p: Plan, gpus: int) -> tuple[int, int]:
    micro = int(p.overrides.get("train.micro_batch_size", recipe.train.micro_batch_size))
    return micro, max(1, recipe.global_batch_size // (micro * gpus))


def _variant_recipe(recipe: Recipe, p: Plan) -> Recipe:
    over = {k: v for k, v in p.overrides.items() if k not in ("devices", "num_nodes", "strategy")}
    return load_recipe(recipe.to_dict(), {**over, "accelerator": "cpu"}, check=False)


def _host_request(recipe: Recipe, p: Plan, tasks: int) -> tuple[int, int]:
    """(host RAM per node, CPU cores per task): bigtune's host plan plus any optimizer state in CPU RAM."""
    from bigtune.plan.serving import training_host_request

    mem, cpus, _ = training_host_request(_variant_recipe(recipe, p), tasks)
    cpu_state = max((ph.get("optimizer_cpu", 0) or 0 for ph in p.phases.values()), default=0)
    return mem + -(-tasks * cpu_state // GIB) * GIB, cpus


def limits(c: Choice, max_hours: Optional[float], budget: Optional[float]) -> list[str]:
    """Why ``c`` is not ranked: the user's filters and, on a cluster, the partition's limits."""
    out = []
    part = c.offer.partition
    if part is not None:
        tasks = c.gpus // c.nodes
        if c.nodes > part.max_nodes:
            out.append(f"needs {c.nodes} nodes, partition allows {part.max_nodes}")
        if c.host_mem_bytes > part.mem_per_node_bytes:
            out.append(
                f"host RAM: needs {c.host_mem_bytes / GIB:.0f} of {part.mem_per_node_bytes / GIB:.0f} GiB per node"
            )
        if c.cpus_per_task * tasks > part.cpus_per_node:
            out.append(f"CPU cores: needs {c.cpus_per_task * tasks} of {part.cpus_per_node} per node")
        if part.max_time_s is not None and c.slurm_time_s > part.max_time_s:
            out.append(
                f"over the wall-time limit ({format_slurm_time(c.slurm_time_s)} with margin > "
                f"{format_slurm_time(part.max_time_s)})"
            )
    if max_hours is not None and c.seconds > max_hours * 3600:
        out.append(f"over --max-hours ({c.seconds / 3600:.1f} h)")
    if budget is not None:
        if c.cost is None:
            out.append("no price (--budget needs one)")
        elif c.cost > budget:
            out.append(f"over --budget ({c.cost:,.2f} {c.offer.unit})")
    return out


def _offer_choices(
    recipe: Recipe, offer: Offer, size: DataSize, adapters: bool, alts: list[Plan], skip: Callable[[str], Optional[str]]
) -> tuple[list[Choice], Optional[str]]:
    """At each count ``offer`` allows, the fastest fitting variant with a step time that keeps the recipe's
    training result (result_changes), else the fastest that changes it; or why none fits."""
    allowed = set(offer.counts())
    out: dict[int, Choice] = {}
    untimed = None
    for p in alts:  # fastest first
        # Tensor-parallel variants are not offered here yet: the run length and the job written would count
        # every GPU as a data-parallel rank.
        if not p.fits or p.overrides.get("tensor_parallel", 1) > 1:
            continue
        gpus, strategy = gpus_and_strategy(p)
        if why_not := skip(strategy):
            untimed = untimed or why_not
            continue
        changes = result_changes(recipe, p)
        if gpus not in allowed or (gpus in out and (changes or not out[gpus].changes)):
            continue
        if p.step_time_s is None:
            untimed = untimed or next((n for n in p.notes if n.startswith("time:")), "no step time")
            continue
        micro, acc = _micro_and_accumulate(recipe, p, gpus)
        length = run_length(recipe, size, gpus, micro, acc)
        train_s, eval_s = run_seconds(recipe, length, p.step_time_s, micro, acc)
        c = Choice(offer, gpus, strategy, p, length, train_s, eval_s, changes=changes)
        if offer.partition is not None:
            c.host_mem_bytes, c.cpus_per_task = _host_request(recipe, p, gpus // c.nodes)
        out[gpus] = c
    if out:
        return [out[g] for g in sorted(out)], None
    if untimed:
        return [], f"fits only as variants it cannot use ({untimed})"
    return [], f"does not fit on 1-{offer.max_gpus} GPUs (--alternatives' search{', adapters too' if adapters else ''})"


def compare(
    recipe: Recipe,
    offers: list[Offer],
    size: DataSize,
    config=None,
    adapters: bool = False,
    max_hours: Optional[float] = None,
    budget: Optional[float] = None,
    skip: Callable[[str], Optional[str]] = lambda strategy: None,
) -> Comparison:
    """Every offer × GPU count: the fastest fitting variant, the whole run's time and cost (see module doc).
    ``skip``: why a strategy cannot be used (e.g. DeepSpeed not installed where the job is written), or None."""
    from bigtune.models.configs import resolve_config
    from bigtune.plan.search.alternatives import alternatives

    config = config if config is not None else resolve_config(recipe)
    choices, unfit = [], {}
    # Largest memory first within each kernel class: it simulates the most variants, which the smaller
    # cards of its class then reuse.
    order = sorted(offers, key=lambda o: (kernel_class(compute_capability(o.gpu)), -o.gpu.memory_gib))
    sims: dict = {}  # kernel class -> its simulations, which alternatives() reads and adds to
    for offer in order:
        target = Target("cuda", offer.gpu, 1, "single")
        shared = sims.setdefault(kernel_class(compute_capability(offer.gpu)), {})
        # (no tensor-parallel layouts: _offer_choices does not lay them out yet)
        alts = alternatives(
            recipe,
            target,
            max_gpus=offer.max_gpus,
            config=config,
            adapters=adapters,
            sims=shared,
            tensor_parallel=False,
        )
        rows, why = _offer_choices(recipe, offer, size, adapters, alts, skip)
        for c in rows:
            c.excluded = limits(c, max_hours, budget)
        choices += rows
        if why:
            unfit[offer.name] = why
    rank = {o.name: i for i, o in enumerate(offers)}
    choices.sort(key=lambda c: (rank[c.offer.name], c.gpus))
    return Comparison(recipe.name, size, choices, unfit, offers)


def pick_partition(cmp: Comparison, recipe: Recipe, config=None) -> Choice:
    """The cheapest row (the faster on a tie) that no filter excluded, trains what the recipe trains (no
    result_changes: a job script does not switch the optimizer silently) and agrees with the recipe's own
    devices, num_nodes and strategy where it sets them; else PlanError with the largest partition's shortfall."""
    rows = [c for c in cmp.choices if not c.excluded and not c.changes and _agrees(c, recipe)]
    rows.sort(key=lambda c: (c.cost if c.cost is not None else float("inf"), c.seconds))
    if rows:
        return rows[0]
    raise PlanError(_refusal(cmp, recipe, config))


def _agrees(c: Choice, recipe: Recipe) -> bool:
    if recipe.world_size > 1 and (c.gpus != recipe.world_size or c.gpus // c.nodes != recipe.devices):
        return False
    return recipe.strategy == "auto" or c.strategy == run_strategy(recipe.strategy, c.gpus)


def _refusal(cmp: Comparison, recipe: Recipe, config) -> str:
    """Why no partition fits: each partition's reason, and the recipe planned on the largest one."""
    from bigtune.plan.planner import plan

    left = cmp.not_ranked()
    for c in cmp.choices:
        if c.changes and not c.excluded and c.offer.name not in left:
            left[c.offer.name] = f"fits only by changing {', '.join(c.changes)} (accept with --set)"
    reasons = "; ".join(f"{k}: {v}" for k, v in left.items())
    if recipe.world_size > 1 or recipe.strategy != "auto":
        reasons += (
            f" (the recipe sets devices={recipe.devices}, num_nodes={recipe.num_nodes}, strategy={recipe.strategy}:"
            " only rows that match were considered)"
        )
    big = max(cmp.offers, key=lambda o: (o.gpu.memory_gib, o.max_gpus))
    n = big.gpus_per_node if recipe.world_size == 1 else recipe.world_size
    strategy = run_strategy(recipe.strategy if recipe.strategy != "auto" else "fsdp", n)
    p = plan(recipe, Target("cuda", big.gpu, n, strategy), config=config)
    need, cap = (p.needed_total or p.peak_total), p.capacity
    return (
        f"no partition of the cluster fits {cmp.recipe}: {reasons}. On the largest, {big.name} ({n}× {big.gpu.key}, "
        f"{strategy}), the recipe as written needs {need / GIB:.2f} GiB per GPU of {cap / GIB:.2f} "
        f"(short by {max(0.0, need - cap * 0.98) / GIB:.2f} GiB). Try `bigtune plan --alternatives` on it, adapters "
        "(--adapters), or a cluster with larger GPUs"
    )


def format_comparison(cmp: Comparison, prices_label: str, top: int = 12) -> str:
    """The text answer: both rankings, one row per offer, and the offers left out with their reason."""
    unit = cmp.offers[0].unit if cmp.offers else ""
    kind = "partition" if cmp.offers and cmp.offers[0].partition is not None else "GPU type"
    lines = [
        f"compare: {cmp.recipe} on {len(cmp.offers)} {kind}(s); data: {cmp.size.source}; {cmp.size.train:,} "
        f"training rows, {cmp.size.validation or 0:,} validation",
        f"time: {TIME_RULE}",
        f"prices: {prices_label}",
    ]
    for by in ("cost", "time"):
        rows = cmp.ranked(by)
        lines.append(f"\nby {by} ({'cheapest' if by == 'cost' else 'fastest'} count per {kind}):")
        if not rows:
            lines.append("  (none: see below)")
            continue
        head = f"  {'#':>2}  {'gpu':<22} {'gpus':>4} {'nodes':>5} {'steps':>7} {'time':>8} {'cost ' + unit:>12}"
        lines.append(head + "  verdict       variant")
        for i, c in enumerate(rows[:top], 1):
            cost = "-" if c.cost is None else f"{c.cost:,.2f}"
            lines.append(
                f"  {i:>2}  {c.offer.name:<22} {c.gpus:>4} {c.nodes:>5} {c.length.steps:>7,} {hours(c.seconds):>8} "
                f"{cost:>12}  {c.verdict:<12}  {c.plan.variant}"
            )
        if len(rows) > top:
            lines.append(f"  ... {len(rows) - top} more (--json lists every GPU type and count)")
    left = cmp.not_ranked()
    if left:
        lines.append("\nnot ranked:")
        lines += [f"  {k}: {v}" for k, v in left.items()]
    no_price = [o.name for o in cmp.offers if o.price is None and o.name not in left]
    if no_price:
        lines.append(f"no price (ranked by time only; give one with --prices FILE): {', '.join(no_price)}")
    return "\n".join(lines)
