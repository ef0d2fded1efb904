"""Pipeline parallelism (recipe ``pipeline_parallel``) in the plan: what each stage holds, and the bubble.

The engine (engine/pipeline.py) gives each of the p ranks an even share of the decoder layers, the first stage
the embeddings, the last the final norm, the output layer and the loss, and runs torch's ScheduleGPipe or
Schedule1F1B over m pipeline micro-batches of b/m rows. Each stage is simulated as the rest of the planner
simulates a step: the engine's own stage module and step on fake tensors under the MemoryMonitor, one and two
layers deep and extrapolated to the stage's depth, with torch's schedule replaced by ``EmulatedSchedule``, which
issues the same forwards and backwards in the same order on one process and holds what torch's stage holds:

- GPipe: every micro-batch's forward, then every backward, so a stage holds the saved activations of all m at
  once (the last stage also their logits, which the stage keeps as outputs until their backward);
- 1F1B: min(m, p − i) forwards on stage i before its first backward, then one forward per backward, so stage i
  holds at most p − i micro-batches' activations (the last stage one);
- the receive buffers torch allocates once per micro-batch (activations from the previous stage, gradients
  from the next: b/m × s × h each, float32 under every precision: boundary_dtype), and the input gradients on
  their way to the previous stage.

Time: a stage's compute for the whole step, stretched by the bubble ((p − 1) / (m + p − 1) of the step idle),
plus the point-to-point sends a stage waits for: b/m × s × h per micro-batch and boundary, both directions.
"""

from __future__ import annotations

import copy
import dataclasses

from bigtune.plan.step.emulated import boundary_dtype
from bigtune.recipe import Recipe


def stage_config(config, stages: int):
    """A copy of ``config`` with one stage's share of the decoder layers: the depth a stage's simulation
    extrapolates to."""
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = config.num_hidden_layers // stages
    return cfg


def planned_stages(stages: int) -> list[int]:
    """The stages simulated: the first, the second (of the middle stages the one 1F1B keeps the most
    micro-batches in flight on; under GPipe all hold the same) and the last. Stages 2 … p − 2 hold what the
    second holds, or fewer micro-batches in flight: its plan bounds theirs."""
    return sorted({0, min(1, stages - 1), stages - 1})


def stage_sims(recipe: Recipe, config, cuda: bool, arch=None, workers: int = 1) -> dict:
    """{stage: its full-depth simulation (plan.simulate.Sim)} for the planned_stages of ``recipe``.

    1F1B stage i runs w = min(m, p − i) forwards, then alternates a backward and a forward; from the first
    forward after a backward (its (w + 1)-th) on, each step of that steady state repeats what the stage holds (w
    in flight, the gradients, the sends). So with more than w + 1 pipeline micro-batches the stage is simulated
    with w + 1 of them, of the same rows, and what the others add is exact without simulating them: their
    receive buffers (kept from the first step) and their operators (the same as each simulated one's);
    tests/test_plan_pipeline_parallel.py checks this against the full emulation. ``workers`` > 1: the stages
    in forked processes (never after CUDA is initialised)."""
    p, m = recipe.pipeline_parallel, recipe.pipeline_microbatches
    cfg = stage_config(config, p)
    stages = planned_stages(p)
    counts = [min(m, p - i + 1) if recipe.pipeline_schedule == "1f1b" else m for i in stages]
    args = [
        (_fewer_pipeline_microbatches(recipe, n) if n < m else recipe, cfg, cuda, arch, i)
        for i, n in zip(stages, counts)
    ]
    if workers > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=min(workers, len(args)), mp_context=mp.get_context("fork")) as ex:
            done = list(ex.map(_stage_sim, args))
    else:
        done = [_stage_sim(a) for a in args]
    return {i: _more_pipeline_microbatches(sim, recipe, config, i, m - n) for i, n, sim in zip(stages, counts, done)}


def _stage_sim(args: tuple):
    from bigtune.plan.step.simulate import simulate_full_depth

    recipe, cfg, cuda, arch, stage = args
    return simulate_full_depth(recipe, cfg, cuda, arch=arch, stage=stage, trace=cuda)


# The monitor's phase highs of what is not a model state (the receive buffers and inputs are among it).
UNHELD_PEAKS = ("phase_peak_activations", "phase_peak_activations_late")


def _more_pipeline_microbatches(sim, recipe: Recipe, config, stage: int, more: int):
    """``sim`` (of stage ``stage`` in its 1F1B steady state) with ``more`` pipeline micro-batches: their receive
    buffers, their rows of the padded input ids and labels the engine's step makes (int64), their losses (the
    last stage's float32 scalars, kept from their forward to the step's end) and their operators."""
    if not more:
        return sim
    from bigtune.plan.device.roofline import scale

    p, m = recipe.pipeline_parallel, recipe.pipeline_microbatches
    rows = recipe.train.micro_batch_size // m
    buffer = rows * recipe.data.max_seq_length * config.hidden_size * boundary_dtype().itemsize
    extra = more * buffer * ((stage > 0) + (stage < p - 1))  # activations in, gradients in
    extra += more * rows * recipe.data.max_seq_length * 2 * 8  # input ids and labels
    losses = more * 4 if stage == p - 1 else 0
    phases = {ph: {**v} for ph, v in sim.phases.items()}
    for ph, v in phases.items():
        for key in ("activations", "allocated", "peak_allocated", "phase_peak", *UNHELD_PEAKS):
            if v.get(key) is not None:
                v[key] += extra + (losses if ph != "before_forward" else 0)
    ops = scale(sim.ops, ("forward", "backward"), m / (m - more))
    return dataclasses.replace(sim, phases=phases, peak_allocated=sim.peak_allocated + extra + losses, ops=ops)


def _fewer_pipeline_microbatches(recipe: Recipe, n: int) -> Recipe:
    """``recipe`` with ``n`` pipeline micro-batches of the same rows and the same accumulation."""
    r = copy.deepcopy(recipe)
    t = r.train
    rows = t.micro_batch_size // recipe.pipeline_microbatches
    t.accumulate_grad_batches, t.global_batch_size = recipe.accumulate, None
    t.micro_batch_size, t.pipeline_microbatches = n * rows, n
    return r


def largest_stage(recipe: Recipe, config, cuda: bool, arch=None, workers: int = 1) -> tuple:
    """(the simulation of the stage with the highest peak, {stage: peak allocated})."""
    sims = stage_sims(recipe, config, cuda, arch, workers)
    peaks = {i: sim.peak_allocated for i, sim in sims.items()}
    return sims[max(peaks, key=peaks.get)], peaks


def with_pipeline_parallel(recipe: Recipe, target):
    """``target`` with the recipe's pipeline stages where it has one GPU per stage (else none: training refuses
    the rest)."""
    pp = recipe.pipeline_parallel if recipe.pipeline_parallel > 1 and target.gpus == recipe.pipeline_parallel else 1
    return target if pp == target.pipeline_parallel else dataclasses.replace(target, pipeline_parallel=pp)


def in_flight(stages: int, micro: int, schedule: str, index: int) -> int:
    """Pipeline micro-batches whose activations stage ``index`` holds at once."""
    return micro if schedule == "gpipe" else min(micro, stages - index)


def bubble_fraction(stages: int, micro: int) -> float:
    """The share of a pipelined step each stage is idle: (p − 1) / (m + p − 1), for GPipe and 1F1B alike."""
    return (stages - 1) / (micro + stages - 1)


def p2p_seconds(recipe: Recipe, config, link_bytes_per_s: float) -> float:
    """Seconds per optimizer step of the sends a stage waits for: one b/m × s × h activation forward and one
    gradient backward per pipeline micro-batch at each of its (up to two) boundaries; the middle of the pipeline
    receives from one side while it sends to the other, so two transfers per micro-batch and direction."""
    if recipe.pipeline_parallel <= 1 or not link_bytes_per_s:
        return 0.0
    es = boundary_dtype().itemsize
    per_micro = recipe.train.micro_batch_size * recipe.data.max_seq_length * config.hidden_size * es
    sends = 2 * recipe.accumulate  # activations forward, gradients backward, per engine micro-batch (m pieces)
    return sends * per_micro / link_bytes_per_s


def pipeline_note(recipe: Recipe, peaks: dict) -> str:
    from bigtune.core.stepmath import human_bytes

    p, m = recipe.pipeline_parallel, recipe.pipeline_microbatches
    per = ", ".join(f"stage {i}: {human_bytes(x)}" for i, x in peaks.items())
    if p > 3:
        per += f" (stages 2-{p - 2}: at most stage 1's)"
    flight = ", ".join(str(in_flight(p, m, recipe.pipeline_schedule, i)) for i in range(p))
    return (
        f"pipeline_parallel={p} ({recipe.pipeline_schedule}, {m} pipeline micro-batches of "
        f"{recipe.train.micro_batch_size // m} row(s)): each stage simulated on its own, the plan is the largest; "
        f"peak allocated per stage: {per}; micro-batches in flight per stage: {flight}; bubble "
        f"{bubble_fraction(p, m):.0%} of the step"
    )


def pipeline_seconds(recipe: Recipe, target, config, t: dict) -> tuple[float, str]:
    """(seconds a stage adds to its own compute per optimizer step, note): the bubble, (p − 1) / m of the
    stage's forward and backward time (so that they take (m + p − 1) / m of it), and the point-to-point
    sends (p2p_seconds) at one direction of the catalog's intra-node link, not overlapped with compute (torch's
    schedules wait for each send or receive before the compute that follows it)."""
    p, m = recipe.pipeline_parallel, recipe.pipeline_microbatches
    bubble = (t["forward_s"] + t["backward_s"]) * (p - 1) / m
    link = target.gpu.interconnect_gbs / 2 * 1e9 if target.gpu is not None and target.gpu.interconnect_gbs else 0
    p2p = p2p_seconds(recipe, config, link)
    note = (
        f"time: + {bubble:.3g} s pipeline bubble ({p} stages, {m} pipeline micro-batches: "
        f"{bubble_fraction(p, m):.0%} of the step idle) and {p2p:.3g} s of point-to-point sends of the "
        "hidden state between stages; the forward and backward are one stage's (an even share of the layers)"
    )
    return bubble + p2p, note
