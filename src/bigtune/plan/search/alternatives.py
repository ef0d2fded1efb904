"""``bigtune plan --alternatives``: variants of a recipe (precision, checkpointing, optimizer, micro batch,
adapters, GPU counts and sharding) that fit the target, fastest first.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Optional

from bigtune.models.configs import resolve_config
from bigtune.plan.base.constants import CATEGORIES, FIT_UNCERTAINTY, ZERO_ALTERNATIVE
from bigtune.plan.base.target import Plan, Target, target_arch
from bigtune.plan.layout.tensor_parallel import SPLIT_SIZES, rank_config
from bigtune.plan.planner import count_parameters, plan, state_bytes_lower_bound
from bigtune.plan.step.simulate import (
    RESERVED_DEPTHS,
    Sim,
    estimate_reserved,
    sim_key,
    simulate_full_depth,
    simulation_recipe,
)
from bigtune.recipe import Recipe, RecipeError, load_recipe


def _strategy_refused(recipe: Recipe, strategy: str, gpus: int) -> bool:
    """Whether training would refuse ``recipe`` under ``strategy`` on ``gpus`` GPUs (this machine's installs
    aside), judged as it is planned there (simulation_recipe: ZeRO's own optimizer and gradient order)."""
    from bigtune.recipe import gpu_plan_problems

    r = copy.deepcopy(simulation_recipe(recipe, strategy))
    r.strategy, r.devices, r.num_nodes = strategy, gpus, 1
    return bool(gpu_plan_problems(r))


def _variant_recipe(recipe: Recipe, over: dict, check: bool = True, cuda: bool = False) -> Recipe:
    """``recipe`` with ``over`` applied; ``check``: refuse what the engine would refuse (RecipeError), on a
    GPU target only what concerns the GPU run (not this machine's installs: recipe.gpu_plan_problems)."""
    from bigtune.recipe import gpu_plan_problems

    if recipe.pipeline_parallel > 1 and "pipeline_parallel" not in over:  # the other variants are not pipelined
        over = {"pipeline_parallel": 1, "train.pipeline_microbatches": None, **over}
    if recipe.sequence_parallel and over.get("tensor_parallel", recipe.tensor_parallel) == 1:
        over = {"sequence_parallel": False, **over}  # it needs tensor parallelism: variants without it drop it
    r = load_recipe(recipe.to_dict(), {**over, "accelerator": "cpu"}, check=check and not cuda)
    if check and cuda and (problems := gpu_plan_problems(r)):
        raise RecipeError(problems)
    r.accelerator = recipe.accelerator
    return r


def _interpolate(lo: Sim, hi: Sim, m_lo: int, m_hi: int, m: int) -> Sim:
    """Memory at micro batch m from exact simulations at m_lo and m_hi (linear in the batch size).

    Peak memory is a maximum of lines in the batch size, hence convex: the interpolation is exact
    at both ends and errs on the safe (high) side in between.
    """
    t = (m - m_lo) / (m_hi - m_lo)

    def f(a: int, b: int) -> int:
        if a is None or b is None:
            return None
        return int(round(a + (b - a) * t))

    phases = {ph: {c: f(lo.phases[ph][c], hi.phases[ph][c]) for c in CATEGORIES} for ph in lo.phases}
    # Time per sample interpolates between the two exact ends: a micro-batch of m costs m × the blend
    # of their per-sample rows (the optimizer's rows do not depend on the batch).
    ops = {k: list(v) for k, v in hi.ops.items() if k[1] == "optimizer"}
    for sim, weight in ((lo, m * (1 - t) / m_lo), (hi, m * t / m_hi)):
        for k, v in sim.ops.items():
            if k[1] != "optimizer":
                row = ops.setdefault(k, [0, 0.0, 0.0])
                for i in range(3):
                    row[i] += v[i] * weight
    return Sim(
        phases,
        f(lo.peak_allocated, hi.peak_allocated),
        lo.numel,
        lo.matmul_numel,
        lo.block_numel,
        lo.attention,
        f(lo.reserved, hi.reserved),
        f(lo.needed, hi.needed),
        ops,
        lo.fsdp_upcast,
        lo.fsdp_upcast_optimizer,
        lo.nf4,
        replay=f"caching-allocator replays at micro batch {m_lo} and {m_hi}, interpolated" if lo.reserved else "",
        replay_spread=max(lo.replay_spread, hi.replay_spread),
    )


class _Workers:
    """The worker processes of one alternatives() call, shared by everything it runs in parallel (both rounds of
    simulations, the deeper replays, the recipe's own plan): forked at the first task, so the children inherit
    the imported libraries instead of importing them again (seconds). With one worker every task runs here,
    when submitted."""

    def __init__(self, workers: int):
        self.workers = workers
        self._ex = None

    @property
    def forked(self) -> bool:
        return self.workers > 1

    def submit(self, fn, *args):
        from concurrent.futures import Future

        if self.forked:
            if self._ex is None:
                import multiprocessing as mp
                from concurrent.futures import ProcessPoolExecutor

                self._ex = ProcessPoolExecutor(max_workers=self.workers, mp_context=mp.get_context("fork"))
            return self._ex.submit(fn, *args)
        f: Future = Future()
        try:
            f.set_result(fn(*args))
        except Exception as e:  # raised again by f.result(), as a worker's would be
            f.set_exception(e)
        return f

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self._ex is not None:
            self._ex.shutdown(cancel_futures=exc[0] is not None)


def _run_sims(
    jobs: dict[str, tuple[Recipe, int]], config, cuda: bool, ex, arch: Optional[tuple[int, int]] = None
) -> dict[str, Sim]:
    """Simulate every (recipe, micro batch) job on ``ex`` (_Workers)."""
    import sys

    # Adapter jobs need peft, which this process may not have imported (≈2 s with bitsandbytes installed):
    # in worker processes they go to one worker as one task, submitted first, so only one child pays for it.
    grouped = (
        [k for k, (r, _) in jobs.items() if r.peft.method != "none"] if ex.forked and "peft" not in sys.modules else []
    )
    if len(grouped) == len(jobs):  # every job is an adapter's (a LoRA recipe): one worker would run them all in turn
        grouped = []
    group = ex.submit(_sim_group, [(k, *jobs[k]) for k in grouped], config, cuda, arch) if grouped else None
    # the longest first (a rank's share of the batch), so no long one is left running alone at the end
    order = sorted((k for k in jobs if k not in grouped), key=lambda k: -jobs[k][1] / jobs[k][0].tensor_parallel)
    futs = {k: ex.submit(_sim_job, jobs[k][0], config, cuda, jobs[k][1], arch) for k in order}
    out = {k: f.result() for k, f in futs.items()}
    return {**out, **(group.result() if group is not None else {})}


def _sim_group(items: list, config, cuda: bool, arch: Optional[tuple[int, int]]) -> dict[str, Sim]:
    return {k: _sim_job(r, config, cuda, m, arch) for k, r, m in items}


def _sim_job(recipe: Recipe, config, cuda: bool, micro: int, arch: Optional[tuple[int, int]] = None) -> Sim:
    r = copy.deepcopy(recipe)
    r.train.micro_batch_size = micro
    # A tensor-parallel variant simulates the model one rank of its group computes (its sim_key says so).
    # On a CUDA target the shallow steps are traced: the variant's reserved and least capacity come from
    # its own allocator replay (planner._reserved_and_needed), not from a ratio assumed for every model.
    return simulate_full_depth(r, rank_config(config, r.tensor_parallel), cuda, arch=arch, trace=cuda)


def _replayed_deeper(recipe: Recipe, micro: int, sim: Sim, config, arch: Optional[tuple[int, int]]) -> Sim:
    """``sim`` with reserved and the least capacity from the deeper traced pair the recipe's own plan replays
    (estimate_reserved), for a one-device variant whose shallow replays' extrapolations disagree by more than
    the planner's typical error (a reuse jump between 1 and 2 blocks, such as a large vocabulary's loss
    segments): there the replay is the verdict. Several devices apply a ratio to a sharded peak anyway."""
    import dataclasses

    r = copy.deepcopy(recipe)
    r.train.micro_batch_size = micro
    reserved, needed, _, _ = estimate_reserved(r, rank_config(config, r.tensor_parallel), sim, arch)
    how = (
        f"a caching-allocator replay of this step {RESERVED_DEPTHS[0]} and {RESERVED_DEPTHS[1]} blocks deep, "
        f"extrapolated to full depth (the extrapolations of its replays 1 and 2 blocks deep were "
        f"{sim.replay_spread:.0%} apart)"
    )
    return dataclasses.replace(sim, reserved=reserved, needed=needed, replay=how, replay_spread=0.0)


def _run_deeper(
    jobs: dict[str, tuple[Recipe, int, Sim]], config, arch: Optional[tuple[int, int]], ex
) -> dict[str, Sim]:
    """_replayed_deeper for every (recipe, micro batch, shallow simulation) job on ``ex`` (_Workers: each replay
    is seconds of one core, 26 of them for TinyLlama on an L4)."""
    futs = {k: ex.submit(_replayed_deeper, r, m, sim, config, arch) for k, (r, m, sim) in jobs.items()}
    return {k: f.result() for k, f in futs.items()}


def _own_plan(recipe: Recipe, target: Target, config, kwargs: dict) -> tuple[Plan, dict[str, Sim]]:
    """plan() of the recipe itself, beside the variants' simulations, and the simulations it made. One process
    (workers=1): in a worker, forking workers of its own would oversubscribe the cores the others fill."""
    made: dict[str, Sim] = {}
    return plan(recipe, target, config=config, workers=1, sims=made, **kwargs), made


class Alternatives(list):
    """The fitting plans, the asked GPU count first, fastest first within a count (_ranked); ``evaluated`` counts every variant considered; ``plan``: the recipe's
    own plan where alternatives() was asked for it (``own_plan``), else None."""

    def __init__(self, plans, evaluated: int, own: Optional[Plan] = None):
        super().__init__(plans)
        self.evaluated = evaluated
        self.plan = own


@dataclass
class _Variants:
    """The variants to plan (``todo``: label, overrides, GPUs, strategy, simulation key or interpolation)
    and the simulations they need (``jobs``: sim_key → recipe, micro batch); ``several``: (GPUs, strategy,
    tensor_parallel) → (overrides, micro, label) of the multi-GPU variants, for the retry with checkpointing."""

    recipe: Recipe
    cuda: bool
    jobs: dict[str, tuple[Recipe, int]] = field(default_factory=dict)
    todo: list[tuple[str, dict, int, str, Any]] = field(default_factory=list)
    several: dict[tuple[int, str, int], tuple[dict, int, str]] = field(default_factory=dict)

    @property
    def g(self) -> int:
        return self.recipe.global_batch_size

    @property
    def m0(self) -> int:
        return self.recipe.train.micro_batch_size

    def add(self, label: str, over: dict, gpus: int, strategy: str, r_sim: Recipe, micro: int) -> str:
        """One variant simulated as ``r_sim`` at ``micro``; returns its simulation's key."""
        key = sim_key(r_sim, micro)
        self.jobs[key] = (r_sim, micro)
        self.todo.append((label, over, gpus, strategy, key))
        return key


def alternatives(
    recipe: Recipe,
    target: Target,
    max_gpus: int = 64,
    config=None,
    workers: Optional[int] = None,
    adapters: bool = False,
    sims: Optional[dict[str, Sim]] = None,
    tensor_parallel: bool = True,
    own_plan: Optional[dict] = None,
) -> Alternatives:
    """Variants of the recipe that fit: those on ``target``'s GPU count first, then the other counts from the
    fewest GPUs up; within a count fastest first (predicted tokens/s; lower peak breaks ties). Each run once,
    its overrides only the keys that change the recipe.

    Each keeps the global batch size. Single-GPU variants cross precision × activation checkpointing ×
    optimizer (AdamW, 8-bit AdamW, SGD) × micro batch, plus one GPU with ZeRO-2 and the optimizer
    offloaded, and with ``adapters`` LoRA and QLoRA (with and without checkpointing: they train
    adapters instead of every weight, a different result, so only on request); multi-GPU variants
    (DDP, FSDP, ZeRO-3 with offload) keep the recipe's precision; one that runs out of memory though its
    share of the model states fits is tried again with activation checkpointing. Micro batches
    between 1 and the recipe's own are interpolated from exact simulations at both ends (marked
    "interpolated"); everything else is simulated, except what ``sims`` (plan()'s or an earlier call's, for a
    target whose attention kernels are the same) holds; new simulations are added to ``sims``.
    ``tensor_parallel``: also FSDP2's 2-D layouts, tensor_parallel = 2, 4, 8 × FSDP over the rest.
    ``own_plan``: plan()'s keyword arguments for the recipe itself, planned in one of the same worker processes
    while the variants simulate (``plan --alternatives``: the two overlap instead of following each other); the
    result's ``plan``. Its simulations then reach ``sims`` afterwards, so the variants do not reuse them.
    """
    import os

    config = config if config is not None else resolve_config(recipe)
    cuda = target.device == "cuda"
    workers = workers if workers is not None else min(4, os.cpu_count() or 1)
    vs = _Variants(recipe, cuda)
    _single_gpu_variants(vs)
    _multi_gpu_variants(vs, max_gpus)
    if tensor_parallel:
        _tensor_parallel_variants(vs, max_gpus, config)
    if adapters:
        _adapter_variants(vs)
    _qlora_fsdp_variants(vs, max_gpus, adapters)
    _offload_variant(vs)
    _zero_grad_variant(vs)
    _in_backward_variants(vs)
    _hidden_states_variant(vs)
    _chunked_loss_variant(vs, config)
    n_evaluated = len(vs.todo)
    _drop_hopeless(vs, config, target.capacity_bytes)
    # The caller's ``sims`` (same target kernel class) is read and also receives every new simulation, so
    # a later call for another GPU of that class (plan --compare-gpus) simulates only what is new.
    sims = sims if sims is not None else {}
    arch = target_arch(target)
    todo = {k: v for k, v in vs.jobs.items() if _missing(k, sims, cuda)}
    with _Workers(workers) as ex:
        # the recipe's own plan first: with its deeper replays it is the longest task
        own = ex.submit(_own_plan, recipe, target, config, own_plan) if own_plan is not None else None
        sims.update(_run_sims(todo, config, cuda, ex, arch))
        plans, oom_several = _plan_variants(vs, target, config, sims, ex)
        # Where several GPUs were not enough though their share of the model states would fit (those were
        # simulated), the activations are what is left: the same GPUs and strategy with activation
        # checkpointing. Only there, so a model that already fits costs no more simulations.
        if oom_several and not recipe.train.activation_checkpointing:
            extra = _checkpointed_variants(vs, oom_several)
            more = {k: (r_c, m) for *_, k, r_c, m in extra if _missing(k, sims, cuda)}
            sims.update(_run_sims(more, config, cuda, ex, arch))
            n_evaluated += len(extra)
            for label, o, gpus, strategy, k, _, _ in extra:
                p = _plan_variant(recipe, o, target, gpus, strategy, label, config, sims[k])
                if p.fits is None or p.fits:
                    plans.append((p, gpus, strategy))
        own_result = own.result() if own is not None else None
    if own_result is not None:
        for k, v in own_result[1].items():
            sims.setdefault(k, v)
    pipelined = _pipeline_plans(recipe, target, config, max_gpus, workers) if tensor_parallel else []
    n_evaluated += len(pipelined)
    plans += [(p, target.gpus, "pipeline") for p in pipelined if p.fits is None or p.fits]
    ranked = _ranked(recipe, plans, target.gpus)
    return Alternatives(ranked, evaluated=n_evaluated, own=own_result[0] if own_result is not None else None)


def _ranked(recipe: Recipe, found: list[tuple[Plan, int, str]], asked_gpus: int) -> list[Plan]:
    """The (plan, GPUs, strategy) found, as the answer to the question asked: the asked GPU count first, then the
    other counts from the fewest GPUs up, fastest first within each (the lower peak breaks ties). Each plan's
    overrides keep only the keys that change the recipe, and a run found twice (the same GPUs, strategy and
    overrides under two searches) is listed once."""
    found = sorted(found, key=lambda f: (f[1] != asked_gpus, f[1], -(f[0].tokens_per_s or 0.0), f[0].peak_total))
    seen: dict[str, Plan] = {}
    out = []
    for p, gpus, strategy in found:
        p.overrides = _changes_only(recipe, p.overrides)
        # devices and strategy are in the key already (some searches also set them as overrides, some do not)
        same = {k: v for k, v in p.overrides.items() if k not in ("devices", "strategy")}
        key = json.dumps([gpus, strategy, same], sort_keys=True, default=str)
        if key not in seen:
            seen[key] = p
            out.append(p)
        elif len(p.variant) > len(seen[key].variant):
            # the same run found by two searches keeps its place and the label that says more of what it is
            # (a QLoRA recipe at another GPU count reads "QLoRA nf4 ..., 4 GPUs fsdp", not "4 GPUs fsdp")
            seen[key].variant, seen[key].overrides = p.variant, p.overrides
    # Two different runs must not read the same: a label that repeats names the overrides that tell it apart.
    first: dict[tuple[str, str], Plan] = {}
    for p in out:
        other = first.setdefault((p.target, p.variant), p)
        differ = {k: v for k, v in p.overrides.items() if other.overrides.get(k, _ABSENT) != v}
        if other is not p and differ:
            p.variant += " (" + ", ".join(f"{k}={v}" for k, v in differ.items()) + ")"
    return out


def _changes_only(recipe: Recipe, over: dict) -> dict:
    """``over`` without the keys that set the recipe's own value (the variants set every key they vary, e.g.
    precision and optimizer, also where the recipe already has that one); all of ``over`` where dropping them
    would make another recipe (a key that only holds beside another, as the accumulation beside the global batch)."""
    own = recipe.to_dict()

    def recipe_value(key: str) -> Any:
        d: Any = own
        for part in key.split("."):
            if not isinstance(d, dict) or part not in d:
                return _ABSENT
            d = d[part]
        return d

    kept = {k: v for k, v in over.items() if recipe_value(k) != v}
    if len(kept) == len(over):
        return over
    made = [load_recipe(own, {**o, "accelerator": "cpu"}, check=False).to_dict() for o in (kept, over)]
    return kept if made[0] == made[1] else over


_ABSENT = object()  # a key the recipe does not have (its value differs from any override's)


def _missing(key: str, sims: dict[str, Sim], cuda: bool) -> bool:
    """Whether ``key`` must be simulated: not yet, or (CUDA) not replayed through the caching allocator (plan()
    shares its own simulation untraced where its peak alone exceeds the card)."""
    return key not in sims or (cuda and not sims[key].reserved)


def _pipeline_plans(recipe: Recipe, target: Target, config, max_gpus: int, workers: int) -> list[Plan]:
    """Pipeline parallelism over the target's GPUs (one stage each, where training would run it: a Llama-style
    causal LM whose layers split evenly, full fine-tuning): the whole global batch in one schedule step, as
    pipeline micro-batches of one row (the smallest bubble). 1F1B only: GPipe has the same bubble and holds
    more activations. Planned stage by stage (plan/layout/pipeline.py), not through the shared simulations."""
    from bigtune.engine.pipeline import PIPELINE_MODEL_TYPES

    p, g = target.gpus, recipe.global_batch_size
    if p < 2 or p > max_gpus or config.num_hidden_layers % p or config.model_type not in PIPELINE_MODEL_TYPES:
        return []
    if getattr(config, "tie_word_embeddings", False):
        return []
    over = {
        "devices": p,
        "num_nodes": 1,
        "strategy": "auto",
        "tensor_parallel": 1,
        "pipeline_parallel": p,
        "pipeline_schedule": "1f1b",
        "train.micro_batch_size": g,
        "train.pipeline_microbatches": g,
        "train.accumulate_grad_batches": 1,
        "train.global_batch_size": None,
        "optim.in_backward": False,
    }
    try:
        r = _variant_recipe(recipe, over, cuda=target.device == "cuda")
    except RecipeError:
        return []  # training refuses pipelining this recipe (adapters, a 4-bit base, another family...)
    label = f"{recipe.precision}, {p} GPUs pipeline_parallel={p} (1f1b, {g} pipeline micro-batches of 1 row)"
    return [plan(r, Target(target.device, target.gpu, p, "ddp"), label, over, config, workers=workers)]


def _single_gpu_variants(vs: _Variants) -> None:
    """One GPU: precision × activation checkpointing × optimizer, at the recipe's micro batch and smaller ones."""
    recipe, g, m0 = vs.recipe, vs.g, vs.m0
    micro = _smaller_micros(vs)
    for precision in ("bf16-true", "bf16-mixed", "32-true"):
        for ckpt in (False, True):
            for optim in ("adamw", "adamw8bit", "sgd"):
                over = {"precision": precision, "train.activation_checkpointing": ckpt, "optim.name": optim}
                if optim == "sgd":  # plain SGD keeps no state at all; AdamW's kinds have no momentum to set
                    over["optim.momentum"] = 0.0
                base = f"{precision}, {'ckpt' if ckpt else 'no ckpt'}, {optim}"
                try:
                    r_hi = simulation_recipe(_variant_recipe(recipe, over, cuda=vs.cuda), "single")
                except RecipeError:
                    continue  # a combination training refuses (bf16 adapters in 32-true...) is no alternative
                key_hi = vs.add(f"{base}, micro {m0} × acc {g // m0}", over, 1, "single", r_hi, m0)
                _smaller_micro_variants(vs, over, base, r_hi, key_hi, micro)


def _smaller_micros(vs: _Variants) -> list[int]:
    """The micro batches below the recipe's that keep its global batch on one GPU, where they can be interpolated:
    the recipe's own accumulation regime (two micro-batches or more) must hold at both ends."""
    m0, g = vs.m0, vs.g
    if g // m0 < 2:
        return []
    return [m for m in (1, 2, 4, 8, 16, 32, 64) if m < m0 and m0 % m == 0 and g % m == 0]


def _smaller_micro_variants(vs: _Variants, over: dict, base: str, r_hi: Recipe, key_hi: str, micro: list[int]) -> None:
    """Micro batch 1 simulated, those between 1 and the recipe's interpolated (the same global batch)."""
    g = vs.g
    if not micro:
        return
    key_lo = sim_key(r_hi, 1)
    vs.jobs[key_lo] = (r_hi, 1)
    for m in micro:
        mo = {
            **over,
            "train.micro_batch_size": m,
            "train.accumulate_grad_batches": g // m,
            "train.global_batch_size": None,
        }
        how = key_lo if m == 1 else (key_lo, key_hi, m)
        tag = "" if m == 1 else " (interpolated)"
        vs.todo.append((f"{base}, micro {m} × acc {g // m}{tag}", mo, 1, "single", how))


def _multi_gpu_variants(vs: _Variants, max_gpus: int) -> None:
    """2, 4, 8... GPUs (those that divide the global batch) under DDP, FSDP and ZeRO."""
    gpus = 2
    while gpus <= max_gpus:
        if vs.g % gpus == 0:
            _gpu_count_variants(vs, gpus)
        gpus *= 2


def _gpu_count_variants(vs: _Variants, gpus: int) -> None:
    recipe = vs.recipe
    per = vs.g // gpus
    m = max(d for d in range(1, min(vs.m0, per) + 1) if per % d == 0)
    over = {
        "train.micro_batch_size": m,
        "train.accumulate_grad_batches": per // m,
        "train.global_batch_size": None,
    }
    if recipe.optim.in_backward:  # several GPUs sync the gradients: the usual step
        over["optim.in_backward"] = False
    if recipe.tensor_parallel > 1:  # these variants shard or replicate whole models (TP: _tensor_parallel_variants)
        over["tensor_parallel"] = 1
    r_g = _variant_recipe(recipe, over, cuda=vs.cuda)
    vs.jobs[sim_key(r_g, m)] = (r_g, m)
    for strategy in ("ddp", "fsdp", ZERO_ALTERNATIVE):
        if _strategy_refused(r_g, strategy, gpus):
            continue  # e.g. a bitsandbytes base under FSDP or ZeRO: training would refuse it
        # FSDP alternatives take the per-block units and per-micro-batch sync (the least memory),
        # named where the recipe asked otherwise.
        o, label = over, ""
        if strategy == "fsdp" and (r_g.fsdp_wrap, r_g.fsdp_grad_sync) != ("block", "micro_batch"):
            o = {**over, "fsdp_wrap": "block", "fsdp_grad_sync": "micro_batch"}
            label = " (fsdp_wrap=block, fsdp_grad_sync=micro_batch)"
        # DeepSpeed's step may differ from the recipe's (true 16-bit, CPU Adam): its own simulation.
        r_s = simulation_recipe(_variant_recipe(recipe, o, cuda=vs.cuda) if label else r_g, strategy)
        name = f"{recipe.precision}, {gpus} GPUs {strategy}{label}, micro {m} × acc {per // m}"
        vs.add(name, o, gpus, strategy, r_s, m)
        vs.several[(gpus, strategy, 1)] = (o, m, label)


TENSOR_PARALLEL_SIZES = (2, 4, 8)  # a tensor-parallel group within one node (its all-reduces on the GPUs' link)


def _tensor_parallel_variants(vs: _Variants, max_gpus: int, config) -> None:
    """2, 4, 8... GPUs as FSDP2's 2-D mesh: tensor_parallel = 2, 4 or 8 (one node's GPUs, dividing the
    model's heads, key/value heads and MLP width) × FSDP over the rest, each data-parallel rank with its
    share of the global batch. Only where training would run it (a causal LM, no adapters or 4-bit base)."""
    recipe = vs.recipe
    gpus = 2
    while gpus <= max_gpus:
        for tp in TENSOR_PARALLEL_SIZES:
            dp = gpus // tp
            if tp > gpus or gpus % tp or vs.g % dp or any(getattr(config, k, 1) % tp for k in SPLIT_SIZES):
                continue
            per = vs.g // dp
            m = max(d for d in range(1, min(vs.m0, per) + 1) if per % d == 0)
            over = {
                "train.micro_batch_size": m,
                "train.accumulate_grad_batches": per // m,
                "train.global_batch_size": None,
                "optim.in_backward": False,
                "strategy": "fsdp",
                "devices": gpus,
                "num_nodes": 1,
                "tensor_parallel": tp,
                "fsdp_wrap": "block",
                "fsdp_grad_sync": "micro_batch",
            }
            try:
                r_t = _variant_recipe(recipe, over, cuda=vs.cuda)
            except RecipeError:
                return  # training refuses tensor parallelism for this recipe (adapters, 4-bit base, family...)
            if _strategy_refused(r_t, "fsdp", gpus):
                return
            sp = " + sequence_parallel" if r_t.sequence_parallel else ""  # kept from the recipe
            label = f" × tensor_parallel={tp}{sp} ({dp} data-parallel)"
            name = f"{recipe.precision}, {gpus} GPUs fsdp{label}, micro {m} × acc {per // m}"
            vs.add(name, over, gpus, "fsdp", simulation_recipe(r_t, "fsdp"), m)
            vs.several[(gpus, "fsdp", tp)] = (over, m, label)
        gpus *= 2


def _adapter_variants(vs: _Variants) -> None:
    """The same model through adapters, on one GPU: LoRA (frozen 16-bit base) and QLoRA (4-bit NF4 base), AdamW
    on the adapters, with and without checkpointing, at the recipe's micro batch and the smaller ones (as the
    full variants: a 4-bit base that does not fit at the recipe's micro batch often does at half of it); from a
    LoRA recipe, its QLoRA form. Labelled by what changes: adapters train fewer weights, a choice about the
    result."""
    recipe, g, m0 = vs.recipe, vs.g, vs.m0
    micro = _smaller_micros(vs)
    if recipe.model.quantize != "none" or recipe.model.family == "sequence-classification":
        return
    kinds = [("QLoRA nf4", {"peft.method": "lora", "model.quantize": "nf4"})]
    if recipe.peft.method == "none":
        kinds.insert(0, ("LoRA", {"peft.method": "lora"}))
    half = recipe.precision if recipe.precision != "32-true" else "bf16-true"
    for name, extra in kinds:
        for ckpt in (False, True):
            over = {"precision": half, "train.activation_checkpointing": ckpt, "optim.name": "adamw", **extra}
            # (check=False: a QLoRA plan needs no bitsandbytes here)
            r_a = simulation_recipe(_variant_recipe(recipe, over, check=False), "single")
            base = f"{half}, {name} r{recipe.peft.r}, {'ckpt' if ckpt else 'no ckpt'}, adamw"
            key_hi = vs.add(f"{base}, micro {m0} × acc {g // m0}", over, 1, "single", r_a, m0)
            _smaller_micro_variants(vs, over, base, r_a, key_hi, micro)


def _qlora_fsdp_variants(vs: _Variants, max_gpus: int, adapters: bool) -> None:
    """QLoRA across GPUs: torchao's NF4 base sharded by FSDP2 (model.quant_backend=torchao), with
    checkpointing, at 2, 4 and 8 GPUs (those that divide the global batch), with and without
    fsdp_cpu_offload (the shards, gradients and optimizer state in host RAM). For a QLoRA recipe always;
    otherwise only with ``adapters`` (training adapters on a 4-bit base is a choice about the result)."""
    recipe, g = vs.recipe, vs.g
    qlora = recipe.model.quantize == "nf4" and recipe.peft.method == "lora"
    if not (qlora or adapters) or recipe.model.family != "causal-lm" or recipe.peft.method not in ("none", "lora"):
        return
    half = recipe.precision if recipe.precision != "32-true" else "bf16-true"
    gpus = 2
    while gpus <= min(8, max_gpus):
        if g % gpus == 0:
            per = g // gpus
            m = max(d for d in range(1, min(vs.m0, per) + 1) if per % d == 0)
            for offload in (False, True):
                over = {
                    "peft.method": "lora",
                    "model.quantize": "nf4",
                    "model.quant_backend": "torchao",
                    "precision": half,
                    "train.activation_checkpointing": True,
                    "optim.name": "adamw",
                    "fsdp_cpu_offload": offload,
                    "fsdp_wrap": "block",
                    "fsdp_grad_sync": "micro_batch",
                    "train.micro_batch_size": m,
                    "train.accumulate_grad_batches": per // m,
                    "train.global_batch_size": None,
                    "optim.in_backward": False,
                }
                try:
                    # (check=False: a plan needs no torchao here; GPU rules are checked by _strategy_refused)
                    r_q = _variant_recipe(recipe, {**over, "strategy": "fsdp", "devices": gpus}, check=False)
                except RecipeError:
                    return
                if _strategy_refused(r_q, "fsdp", gpus):
                    return
                label = (
                    f"{half}, QLoRA nf4 (torchao) r{recipe.peft.r}, {gpus} GPUs fsdp"
                    f"{', fsdp_cpu_offload' if offload else ''}, ckpt, adamw, micro {m} × acc {per // m}"
                )
                vs.add(
                    label,
                    {**over, "strategy": "fsdp", "devices": gpus},
                    gpus,
                    "fsdp",
                    simulation_recipe(r_q, "fsdp"),
                    m,
                )
        gpus *= 2


def _offload_variant(vs: _Variants) -> None:
    """One GPU with ZeRO-2 and the optimizer in CPU RAM (the lab's DeepSpeed rung), the recipe's micro batch."""
    recipe, g, m0 = vs.recipe, vs.g, vs.m0
    if not _strategy_refused(recipe, "deepspeed_stage_2_offload", 1):
        r_1 = simulation_recipe(recipe, "deepspeed_stage_2_offload")
        label = f"{recipe.precision}, 1 GPU deepspeed_stage_2_offload, micro {m0} × acc {g // m0}"
        vs.add(label, {}, 1, "deepspeed_stage_2_offload", r_1, m0)


def _zero_grad_variant(vs: _Variants) -> None:
    recipe, g, m0 = vs.recipe, vs.g, vs.m0
    if recipe.optim.zero_grad == "before_backward":
        # Lightning's order holds the last step's gradients through the next forward; the default frees them.
        over = {"optim.zero_grad": "after_step"}
        r_z = simulation_recipe(_variant_recipe(recipe, over, check=False), "single")
        label = (
            f"{recipe.precision}, gradients freed after the step (optim.zero_grad=after_step), micro {m0} × "
            f"acc {g // m0}"
        )
        vs.add(label, over, 1, "single", r_z, m0)


CHUNK_TOKENS = 1024  # the chunked loss's chunk: a chunk's fp32 logits, not all of them (train.loss_chunk_tokens)


def _chunked_loss_variant(vs: _Variants, config) -> None:
    """With a large vocabulary the logits (and their fp32 copy for the loss) can be the step's peak: the
    loss computed from the hidden states in chunks never holds them whole, where it applies (one device)."""
    from bigtune.engine.loop import loss_chunk_skipped

    recipe, g, m0 = vs.recipe, vs.g, vs.m0
    if recipe.train.loss_chunk_tokens:
        return
    # With activation checkpointing too: once the logits are chunked, the layers' activations are usually
    # what is left (one variant, one more simulation).
    over = {"train.loss_chunk_tokens": CHUNK_TOKENS, "train.activation_checkpointing": True}
    r_c = simulation_recipe(_variant_recipe(recipe, over, check=False), "single")
    if loss_chunk_skipped(r_c, config) is not None:
        return
    label = (
        f"{recipe.precision}, ckpt, chunked loss (train.loss_chunk_tokens={CHUNK_TOKENS}), micro {m0} × acc {g // m0}"
    )
    vs.add(label, over, 1, "single", r_c, m0)


def _in_backward_variants(vs: _Variants) -> None:
    recipe, g = vs.recipe, vs.g
    if recipe.optim.in_backward:
        return
    # Each weight stepped inside the backward, its gradient freed at once (no full set of gradients). It needs
    # one GPU, accumulation 1 (the global batch becomes the micro batch) and no global-norm clipping.
    for ckpt in (False, True):
        over = {
            "optim.in_backward": True,
            "optim.grad_clip": None,
            "train.activation_checkpointing": ckpt,
            "train.micro_batch_size": g,
            "train.accumulate_grad_batches": 1,
            "train.global_batch_size": None,
            "devices": 1,
            "num_nodes": 1,
            "strategy": "single",
        }
        try:
            r_b = simulation_recipe(_variant_recipe(recipe, over, cuda=vs.cuda), "single")
        except RecipeError:
            return  # the recipe's optimizer or precision cannot step in the backward
        label = (
            f"{recipe.precision}, optimizer in backward (optim.in_backward, no clipping), "
            f"{'ckpt' if ckpt else 'no ckpt'}, micro {g} × acc 1"
        )
        vs.add(label, over, 1, "single", r_b, g)


def _hidden_states_variant(vs: _Variants) -> None:
    recipe, g, m0 = vs.recipe, vs.g, vs.m0
    if (
        recipe.model.quantize != "none"
        and recipe.model.upcast_unquantized
        and recipe.precision.endswith("-true")
        and recipe.precision != "32-true"
    ):
        # peft's k-bit preparation runs the hidden states in fp32; keeping them 16-bit is litgpt's/torchtune's QLoRA.
        over = {"model.upcast_unquantized": False}
        r_u = simulation_recipe(_variant_recipe(recipe, over, check=False), "single")
        label = f"{recipe.precision}, 16-bit hidden states (model.upcast_unquantized=false), micro {m0} × acc {g // m0}"
        vs.add(label, over, 1, "single", r_u, m0)


def _hopeless(r: Recipe, gpus: int, strategy: str, numel: int, cap: int) -> bool:
    """Whether the model states alone of ``r`` under ``strategy`` exceed ``cap`` bytes per GPU."""
    if strategy.endswith("_offload"):  # only the 16-bit weights must stay (ZeRO-3: a shard of them)
        es = 4 if r.precision == "32-true" else 2
        return numel * es / (gpus if "stage_3" in strategy else 1) > cap
    sharded = strategy == "fsdp" or strategy.startswith("deepspeed")
    return state_bytes_lower_bound(r, numel) / (gpus if sharded else 1) > cap


def _drop_hopeless(vs: _Variants, config, cap: Optional[int]) -> None:
    """Model states alone are a lower bound on the peak: variants whose states cannot fit are
    dropped before any simulation (for a 70B model that is most single-GPU variants)."""
    recipe = vs.recipe
    numel = count_parameters(config, recipe.model.family)
    if cap is None:
        return
    vs.todo = [t for t in vs.todo if not _hopeless(_variant_recipe(recipe, t[1], check=False), t[2], t[3], numel, cap)]
    needed = {k for t in vs.todo for k in ((t[4][0], t[4][1]) if isinstance(t[4], tuple) else (t[4],))}
    vs.jobs = {k: v for k, v in vs.jobs.items() if k in needed}


def _plan_variant(
    recipe: Recipe, over: dict, target: Target, gpus: int, strategy: str, label: str, config, sim: Sim
) -> Plan:
    r = _variant_recipe(recipe, over, check=False)
    return plan(r, Target(target.device, target.gpu, gpus, strategy), label, over, config, sim=sim)


def _plan_variants(vs: _Variants, target: Target, config, sims: dict[str, Sim], ex) -> tuple[list[Plan], list]:
    """((plan, GPUs, strategy) of the variants that fit or cannot tell, (GPUs, strategy, tensor_parallel) of the
    multi-GPU variants that ran out of memory, each once)."""
    # One-device variants whose shallow replays disagree get the deeper replay first, all at once (in
    # parallel where there are cores); kept in ``sims``: other variants and later calls share them. Not
    # where the peak allocated alone (+ context) is over the card: no replay needs less than that, so the
    # variant does not fit whatever the replay says (on a small card most variants of a large model).
    deeper: set[str] = set()
    for label, over, gpus, strategy, how in vs.todo:
        used = how[:2] if isinstance(how, tuple) else (how,)
        keys = {k for k in used if sims[k].replay_spread > FIT_UNCERTAINTY} - deeper
        if gpus != 1 or not keys:
            continue
        unplayed = [dataclasses.replace(sims[k], reserved=0, needed=0) for k in used]  # allocated bytes only
        sim = _interpolate(*unplayed, 1, vs.m0, how[2]) if isinstance(how, tuple) else unplayed[0]
        if _plan_variant(vs.recipe, over, target, gpus, strategy, label, config, sim).fits is not False:
            deeper |= keys
    sims.update(_run_deeper({k: (*vs.jobs[k], sims[k]) for k in sorted(deeper)}, config, target_arch(target), ex))
    plans, oom_several = [], []
    for label, over, gpus, strategy, how in vs.todo:
        if isinstance(how, tuple):
            key_lo, key_hi, m = how
            sim = _interpolate(sims[key_lo], sims[key_hi], 1, vs.m0, m)
        else:
            sim = sims[how]
        p = _plan_variant(vs.recipe, over, target, gpus, strategy, label, config, sim)
        key = (gpus, strategy, over.get("tensor_parallel", 1))
        if p.fits is None or p.fits:
            plans.append((p, gpus, strategy))
        elif key in vs.several and vs.several[key][0] == over and key not in oom_several:
            # only the variant ``several`` holds: another one on the same GPUs and strategy (QLoRA over FSDP) that
            # runs out of memory would otherwise ask for the same checkpointed retry again, a duplicate row
            oom_several.append(key)
    return plans, oom_several


def _checkpointed_variants(vs: _Variants, oom_several: list) -> list[tuple]:
    """(label, overrides, GPUs, strategy, sim_key, simulation recipe, micro) of the multi-GPU variants
    that ran out of memory, now with activation checkpointing."""
    recipe = vs.recipe
    extra = []
    for gpus, strategy, tp in oom_several:
        o, m, label = vs.several[(gpus, strategy, tp)]
        o = {**o, "train.activation_checkpointing": True}
        try:
            r_c = simulation_recipe(_variant_recipe(recipe, o, cuda=vs.cuda), strategy)
        except RecipeError:
            continue  # a combination training refuses is no alternative
        extra.append(
            (
                f"{recipe.precision}, {gpus} GPUs {strategy}{label}, ckpt, micro {m} × acc {vs.g * tp // gpus // m}",
                o,
                gpus,
                strategy,
                sim_key(r_c, m),
                r_c,
                m,
            )
        )
    return extra
