"""bigtune plan: predict per-device memory and step time before training, without a GPU or weights.

Method. The engine's own ``train_step`` runs two optimizer steps on *fake* tensors
(``FakeTensorMode``: shapes and dtypes, no data, no memory) with the same model class, the same
Fabric precision plugin, the same loss and the same optimizer, under the same ``MemoryMonitor``
that measures real CPU runs. Only a model's first one and two decoder layers are simulated; every
number is then extrapolated linearly to the real depth (exact for homogeneous stacks). So on a CPU
the plan equals the measurement by construction, and any change to the engine changes the plan.

For a CUDA target the simulation emulates what CUDA would do differently: the caching allocator
rounds each block up to 512 bytes, and ``optim.implementation: auto`` becomes foreach (PyTorch's
CUDA default, which needs a temporary the size of the parameters). What simulation cannot see is
added and labelled as such: the CUDA context (measured on an H200), the caching allocator's reserved
bytes (replayed) and, for several GPUs, sharding and communication buffers. bench/plan_accuracy.py
checks them on a GPU; the plan says which were measured.

Step time comes from the same simulated step: every operator it issues is recorded (roofline.py)
and priced on the target GPU, matmuls by their FLOPs and tile occupancy, everything else by its
bytes, the host's eager dispatch as a second queue; to that come what the simulation cannot see:
CPU-side optimizer updates and PCIe for offloading, and the communication between GPUs that compute
does not hide. Its efficiencies are assumptions too.
"""

from __future__ import annotations

import copy
import time
from typing import Optional

import torch

from bigtune.core.allocconf import AllocatorConfig
from bigtune.models.configs import resolve_config
from bigtune.plan.base.constants import CUBLAS_HANDLES, CUDA_CONTEXT_BASIS, CUDA_CONTEXT_BYTES, FIT_UNCERTAINTY, GIB
from bigtune.plan.base.target import Plan, Target, target_arch
from bigtune.plan.layout.pipeline import largest_stage, pipeline_note, with_pipeline_parallel
from bigtune.plan.layout.sharding import host_state_bytes, shard_states, side_stream_cache
from bigtune.plan.layout.tensor_parallel import tensor_parallel_layout, tokens_per_step
from bigtune.plan.layout.time import step_time
from bigtune.plan.step.quantized import EIGHT_BIT
from bigtune.plan.step.simulate import (
    FULL_DEPTH_REPLAY,
    Sim,
    config_family,
    device_peak,
    estimate_reserved,
    get_depth,
    model_stacks,
    no_init,
    replay_full_depth,
    set_depth,
    sim_key,
    simulate_full_depth,
    total_blocks,
    zero_masters,
)
from bigtune.recipe import Recipe

_CUDA_CONTEXT_NOTE = (
    f"CUDA context {CUDA_CONTEXT_BYTES / 2**20:.0f} MiB outside the allocator, {CUDA_CONTEXT_BASIS}; the allocator "
    "replay was within 2.6 % of the reserved bytes measured on that GPU (4 runs: bench/results/plan_accuracy-h200.json)"
)


def plan(
    recipe: Recipe,
    target: Target,
    variant: str = "recipe",
    overrides: Optional[dict] = None,
    config=None,
    sim: Optional[Sim] = None,
    padded: bool = False,
    workers: int = 1,
    replay: bool = True,
    sims: Optional[dict[str, Sim]] = None,
    images: Optional[tuple] = None,
) -> Plan:
    """Predict one recipe on one target, for full-length micro-batches of max_seq_length tokens.

    ``sim`` reuses a simulation of the same single-device step (reserved then comes from the replay it
    carries: the recipe's own, or its shallow traced one; none where it has none); ``padded`` plans batches that hold padding (the attention
    then gets an explicit mask, which can cost more on some kernels). ``workers`` > 1 runs the
    replay's two simulations in forked processes (never after CUDA is initialised); ``replay=False``
    skips the allocator replay (no reserved figure, FITS by peak allocated: for callers that need only
    the allocated categories). ``sims``: the simulation made here is added under its sim_key, for
    alternatives() of the same recipe and target to reuse. ``images``: a chat vision-language model's
    image grids ((t, h, w) tiles), one per row in turn; None plans every image at the processor's
    max_pixels, the worst case (chatvlm). Under tensor parallelism (the recipe's, where the target runs it) the
    simulated model is the one each rank of a group computes (tensor_parallel.py).

    Long because it is the planner's one pipeline, read top to bottom: simulate, shard, emulate CUDA, time.
    """
    t0 = time.perf_counter()
    whole = config if config is not None else resolve_config(recipe)
    target, config, sim_recipe = tensor_parallel_layout(recipe, target, whole)
    target = with_pipeline_parallel(recipe, target)
    cuda = target.device == "cuda"
    own_sim = sim is None
    stage_peaks = None  # pipeline_parallel: each stage's peak; the plan is the largest stage's (pipeline.py)
    if own_sim and target.pipeline_parallel > 1:
        sim, stage_peaks = largest_stage(sim_recipe, config, cuda, target_arch(target), workers)
    elif own_sim:
        sim = simulate_full_depth(sim_recipe, config, cuda, padded=padded, arch=target_arch(target), images=images)
        if sims is not None and not padded and not images:
            sims[sim_key(sim_recipe, sim_recipe.train.micro_batch_size)] = sim
    if stage_peaks is not None:  # one stage per GPU, nothing sharded
        phases, peak, notes = sim.phases, sim.peak_allocated, [pipeline_note(recipe, stage_peaks)]
    else:
        phases, peak, notes = shard_states(sim, recipe, target, total_blocks(config))
    notes += _simulation_notes(recipe, sim_recipe, sim, target)
    simulated_host = max((ph.get("optimizer_cpu", 0) for ph in sim.phases.values()), default=0)
    if cuda and simulated_host:
        phases, peak = _host_state_off_device(phases, peak, sim, simulated_host)
    host = max((ph.get("optimizer_cpu", 0) for ph in phases.values()), default=0)
    if cuda and host:
        notes.append(f"optimizer state in host RAM: {host / GIB:.2f} GiB per process (not in the device peak)")
    notes += _recipe_notes(recipe, sim_recipe, phases, target) + _model_notes(recipe, config, images)
    if sim.nf4 is not None:
        notes = [n for n in notes if not n.startswith("nf4 base: packed")]
        notes.append(_nf4_note(recipe, sim, target, total_blocks(config)))
    if cuda:
        phases, peak, workspaces = _with_cublas_workspaces(phases, peak, target, notes)
        # Replayed deep for the recipe's own simulation where not a certain OOM (a shared or traced one
        # brings its replay along: sim.reserved).
        cap = target.capacity_bytes
        replayed = replay and own_sim and not (cap is not None and peak > cap)
        replayed = replayed and stage_peaks is None  # the replay's traced simulations are of the whole model
        reserved, needed, needed_expandable = _reserved_and_needed(
            recipe, sim_recipe, config, sim, target, peak, workspaces, padded, workers, replayed, notes, images
        )
        overhead = CUDA_CONTEXT_BYTES
        notes.append(_CUDA_CONTEXT_NOTE)
    else:
        reserved, overhead = None, 0
        needed, needed_expandable = peak, 0
    total = (reserved if reserved is not None else peak) + overhead
    cap = target.capacity_bytes
    # FITS by what the allocator must hold at the peak, after its free-and-retry path (least capacity), with
    # the context; how sure that is is the plan's ``tight`` band (FIT_UNCERTAINTY), not a margin taken off.
    fits = None if cap is None else needed + overhead <= cap
    if fits and total > cap:
        # On a roomy card the step would reserve more; on this one the allocator frees its wholly cached
        # segments and retries instead (release_cached_blocks), so it never reserves more than there is.
        reserved, total = cap - overhead, cap
        notes.append("reserved capped at this card: the step runs on the free-and-retry path (slower steps)")
    if fits is False and needed_expandable and needed_expandable + overhead <= cap:
        notes.append(
            f"FITS with train.cuda_alloc_conf: expandable_segments:True: replayed with it the allocator needs "
            f"{needed_expandable / GIB:.2f} GiB (one growing segment per pool, nothing pinned in half-used ones)"
        )
    step, tps, tnotes = step_time(recipe, sim, target, config)
    host_per_node = None
    if cuda and sim.nf4 is not None:
        host_per_node = _nf4_host_ram(recipe, sim, target, total_blocks(config), phases, notes)
    out = Plan(
        recipe_name=recipe.name,
        target=target.label(),
        variant=variant,
        phases=phases,
        peak_allocated=peak,
        peak_reserved=reserved,
        overhead=overhead,
        peak_total=total,
        capacity=cap,
        fits=fits,
        needed_total=needed + overhead,
        parameters_total=sim.numel if whole is config and stage_peaks is None else count_parameters(whole),
        step_time_s=step,
        tokens_per_s=tps,
        tokens_per_step=tokens_per_step(recipe, target),
        notes=notes + tnotes,
        overrides=overrides or {},
        plan_seconds=time.perf_counter() - t0,
        host_bytes_per_node=host_per_node,
        image_grids=_planned_grids(recipe, config, images),
    )
    return out


def _planned_grids(recipe: Recipe, config, images: Optional[tuple]) -> Optional[list[list[int]]]:
    """The image grid of each row a chat vision-language model's step was simulated with (chatvlm.grids_for:
    ``images`` in turn, else the worst case); None for every other model."""
    from bigtune.plan.step import chatvlm

    if not chatvlm.is_chat_vlm_config(config):
        return None
    geometry = chatvlm.image_geometry(recipe, config)
    return [[int(x) for x in g] for g in chatvlm.grids_for(geometry, images, recipe.train.micro_batch_size)]


def _nf4_host_ram(recipe: Recipe, sim: Sim, target: Target, n_layers: int, phases: dict, notes: list[str]) -> int:
    """Host RAM per node for a torchao NF4 base (notes to ``notes``). Each rank reads the checkpoint one
    tensor at a time, quantizes or converts it and shards each block right after loading it, so while loading
    a rank holds the biggest tensor read (16-bit) and its converted form, plus the shards loaded so far where
    they stay in host RAM (fsdp_cpu_offload); while training, the offloaded parameter, gradient and optimizer
    shards. Both on top of the runtime (interpreter, torch, data), and × the ranks on a node."""
    from bigtune.plan.base.constants import HOST_BASE_BYTES

    held = host_state_bytes(sim, recipe, target, n_layers)
    cpu_opt = max((ph.get("optimizer_cpu", 0) or 0 for ph in phases.values()), default=0)
    training = HOST_BASE_BYTES + sum(held.values()) + (0 if held else cpu_opt)
    loading = HOST_BASE_BYTES + sim.nf4.largest_load_bytes + held.get("parameters", 0)
    ranks = target.gpus if recipe.num_nodes <= 1 else max(1, target.gpus // recipe.num_nodes)
    per_node = ranks * max(loading, training)
    notes.append(
        f"host RAM per node: {ranks} rank(s) × max(loading {loading / GIB:.2f} GiB: the biggest tensor read and "
        f"converted {sim.nf4.largest_load_bytes / GIB:.2f} GiB"
        + (" + this rank's parameter shards" if held else "")
        + f", training {training / GIB:.2f} GiB"
        + (": offloaded shards" if held else "")
        + f"; each + {HOST_BASE_BYTES / GIB:.0f} GiB runtime, assumed) = {per_node / GIB:.2f} GiB; the checkpoint "
        "files' page cache comes on top and is reclaimable"
    )
    return per_node


def _simulation_notes(recipe: Recipe, sim_recipe: Recipe, sim: Sim, target: Target) -> list[str]:
    """Where the simulated step differs from the recipe's: attention's math path, DeepSpeed's CPU Adam."""
    notes = []
    if "math" in sim.attention:
        notes.append(
            "attention: no fused CUDA kernel takes these inputs on this GPU (cuda_kernels.sdpa_backend), "
            "so SDPA runs its math path: fp32 scores of seq × seq per head saved in every layer"
        )
    if sim_recipe.optim.name != recipe.optim.name:
        notes.append(
            f"{target.strategy} steps with DeepSpeed's CPU Adam, not optim.name={recipe.optim.name}: "
            "planned with Adam state"
        )
    return notes


def _host_state_off_device(phases: dict, peak: int, sim: Sim, simulated_host: int) -> tuple[dict, int]:
    """The simulation runs on one (fake) CPU, where an offloading optimizer's state shares the
    memory counters; on a GPU it lives in host RAM, so it leaves the device's allocated and peak.
    (State that shard_states moves off the device for ZeRO offload was never counted there.)"""
    phases = copy.deepcopy(phases)
    for name, ph in phases.items():
        for c in ("allocated", "peak_allocated", "phase_peak"):
            if ph.get(c) is not None:
                ph[c] -= sim.phases[name].get("optimizer_cpu", 0)
    return phases, peak - simulated_host


def _quantized_note(recipe: Recipe) -> str:
    from bigtune.models.build import weights_dtype

    fp32_hidden = recipe.model.upcast_unquantized or weights_dtype(recipe.precision) == torch.float32
    if zero_masters(recipe, recipe.strategy):  # DeepSpeed casts the module (unquantized weights too) to 16 bits
        fp32_hidden = False
    if recipe.model.quantize != "int8" and recipe.strategy.startswith("deepspeed_stage_3"):
        return (
            f"{recipe.model.quantize} base under ZeRO-3: the packed bytes (stored as 16-bit elements) partitioned "
            "with the other weights, the quantization constants whole on every rank; 4-bit matmuls emulated "
            "(16-bit hidden states), its gathers at half a byte a weight (tiny CPU check on 2 ranks: parameters exact, "
            "peak +3.4 %)"
        )
    if recipe.model.quantize != "int8":
        how = (
            f"; 4-bit matmuls emulated ({'fp32' if fp32_hidden else '16-bit'} hidden states, dequantized "
            "weight in backward)"
        )
    elif fp32_hidden:
        how = "; activations from a 16-bit simulation (the int8 path keeps fp32 hidden states: expect more)"
    else:
        how = ""
    return f"{recipe.model.quantize} base: packed weight bytes analytic{how}"


def _nf4_note(recipe: Recipe, sim: Sim, target: Target, n_layers: int) -> str:
    from bigtune.plan.step.quantized import NF4_BLOCK

    nf4 = sim.nf4
    full = n_layers * nf4.block_nf4_bytes()
    where = ""
    if target.strategy == "fsdp" and target.gpus > 1:
        rank = n_layers * nf4.block_nf4_bytes(target.gpus, 512 if target.device == "cuda" else 1)
        where = (
            f", {rank / GIB:.2f} GiB per rank under FSDP (data, scalers and factors split along dim 0, scaler mean "
            "and code table replicated); each block all-gathered as 4-bit bytes"
        )
    dora = ""
    if recipe.peft.method == "dora":
        dora = "; DoRA dequantizes each adapted weight once more in the forward, for its weight norm"
    return (
        f"nf4 base (torchao NF4Tensor, decoder-block linear weights): {full / GIB:.2f} GiB = ½ byte a weight + "
        f"an int8 scaler per {NF4_BLOCK} + a {8 * nf4.src_bytes}-bit factor per 256 scalers{where}; each matmul "
        "runs in the compute dtype on its weight dequantized into a temporary (again in backward), simulated as torchao's linear_nf4"
        f"{dora}"
    )


def _recipe_notes(recipe: Recipe, sim_recipe: Recipe, phases: dict, target: Target) -> list[str]:
    """What the recipe's settings (quantized base, in-backward optimizer, zero_grad order, compile) mean here."""
    notes = []
    if recipe.tensor_parallel > target.tensor_parallel:  # a target the recipe's tensor parallelism cannot run on
        notes.append(
            f"tensor_parallel={recipe.tensor_parallel} is not planned for {target.gpus} GPU(s) with "
            f"{target.strategy} (it needs strategy=fsdp on a multiple of it): planned without tensor parallelism"
        )
    if recipe.pipeline_parallel > target.pipeline_parallel:  # training runs one stage per GPU, nothing else
        notes.append(
            f"pipeline_parallel={recipe.pipeline_parallel} is not planned for {target.gpus} GPU(s) (it needs one GPU "
            "per stage): planned without pipeline parallelism"
        )
    if recipe.model.quantize != "none":
        notes.append(_quantized_note(recipe))
    if recipe.optim.in_backward:
        notes.append(
            "optim.in_backward: each weight steps inside the backward and its gradient is freed at once "
            "(no full set of gradients; its optimizer kernels are timed in the backward)"
        )
    if sim_recipe.optim.zero_grad == "before_backward":
        held = phases["before_forward"]["gradients"]
        notes.append(
            f"optim.zero_grad=before_backward (Lightning Trainer's order): the last step's gradients, "
            f"{held / GIB:.2f} GiB per device, live through the next forward; after_step frees them first"
        )
    if recipe.train.compile:
        notes.append(
            "train.compile: planned as the eager step (compiled blocks usually save fewer intermediates for "
            "backward, so expect the same or less activation memory; on the CPU, measured steps run eager)"
        )
    return notes


def _model_notes(recipe: Recipe, config, images: Optional[tuple] = None) -> list[str]:
    """What the model's architecture changes about the recipe: no SDPA attention, no chunked loss, the
    images a chat vision-language model was planned with."""
    from bigtune.engine.loop import loss_chunk_skipped
    from bigtune.models.build import attention_for
    from bigtune.plan.step import chatvlm

    notes = []
    if chatvlm.is_chat_vlm_config(config):
        geometry = chatvlm.image_geometry(recipe, config)
        notes.append(chatvlm.images_note(geometry, images, recipe.train.micro_batch_size))
    elif chatvlm.is_fixed_image_vlm_config(config):
        notes.append(chatvlm.fixed_images_note(config, chatvlm.fixed_image_layout(recipe, config)))
    elif chatvlm.is_split_image_vlm_config(config):
        geometry = chatvlm.split_geometry(recipe, config)
        notes.append(chatvlm.split_images_note(geometry, images, recipe.train.micro_batch_size))
    elif chatvlm.is_anyres_vlm_config(config):
        notes.append(chatvlm.anyres_images_note(chatvlm.anyres_geometry(recipe, config), images))
    elif chatvlm.is_generic_vlm_config(config):
        notes.append(chatvlm.generic_images_note(recipe, config, images))
    attn_note = attention_for(recipe.model, config)[1]
    if attn_note:
        notes.append(attn_note)
    why = loss_chunk_skipped(recipe, config)
    if why:
        notes.append(f"train.loss_chunk_tokens={recipe.train.loss_chunk_tokens} is not used: {why}")
    return notes


def _with_cublas_workspaces(phases: dict, peak: int, target: Target, notes: list[str]) -> tuple[dict, int, int]:
    """(phases, peak, workspace bytes) with the cuBLAS workspaces added under activations (a note to ``notes``).

    Forward runs on the main thread and backward on autograd's device thread: two cuBLAS handles
    on one stream, each with its own workspace from the caching allocator, alive from step 0 on."""
    from bigtune.core.gpus import cublas_workspace_bytes

    workspaces = CUBLAS_HANDLES * cublas_workspace_bytes(target.gpu)
    phases = copy.deepcopy(phases)
    for ph in phases.values():
        for c in ("activations", "allocated", "peak_allocated"):
            ph[c] += workspaces
    notes.append(
        f"cuBLAS workspaces {workspaces / 2**20:.0f} MiB ({CUBLAS_HANDLES} handles: forward and "
        "autograd threads) included under activations"
    )
    return phases, peak + workspaces, workspaces


def _reserved_and_needed(
    recipe: Recipe,
    sim_recipe: Recipe,
    config,
    sim: Sim,
    target: Target,
    peak: int,
    workspaces: int,
    padded: bool,
    workers: int,
    replayed: bool,
    notes: list[str],
    images: Optional[tuple] = None,
) -> tuple[Optional[int], int, int]:
    """(peak reserved, least capacity the replay survives on: what must fit, that capacity with expandable
    segments or 0) on a CUDA device, from an allocator replay where ``replayed``, else from the replay the
    simulation carries, else (None, the peak allocated, 0); its notes go to ``notes``."""
    conf = AllocatorConfig.parse(recipe.train.cuda_alloc_conf)
    on_device = max(1, device_peak(sim.phases, sim.peak_allocated))
    if not replayed and sim.reserved:
        # The variant's own step replayed one and two blocks deep (alternatives, pipeline stages), or a
        # variant of --alternatives sharing the recipe's replayed simulation: on one device the same step,
        # on several its ratios, as below.
        how = sim.replay or "a caching-allocator replay of this step"
        if target.gpus <= 1 and not target.strategy.startswith("deepspeed"):
            notes.append(f"reserved and least capacity from {how}")
            return sim.reserved + workspaces, sim.needed + workspaces, 0
        ratio, least_ratio = (x / on_device for x in (sim.reserved, sim.needed))
        notes.append(f"reserved/allocated ratio {ratio:.3f} from {how}")
        side, side_note = side_stream_cache(sim, recipe, target, total_blocks(config))
        notes.extend([side_note] if side else [])
        return int(peak * ratio) + side, int(peak * least_ratio), 0
    if not replayed:  # a certain OOM, or the caller asked for allocated categories only (replay=False)
        unplayed = "" if conf.is_default else f"; PYTORCH_CUDA_ALLOC_CONF={conf} not replayed"
        over = target.capacity_bytes is not None and peak > target.capacity_bytes
        why = "the peak allocated alone exceeds the card" if over else "not asked for"
        notes.append(
            f"reserved not predicted (no caching-allocator replay: {why}{unplayed}); FITS/OOM judged by peak "
            "allocated, the least any allocator needs"
        )
        return None, peak, 0
    # The single-device step replayed through the caching allocator; several devices keep its
    # reserved/allocated ratio (their sharded peak is analytic).
    arch = target_arch(target)
    replay = estimate_reserved(
        sim_recipe, config, sim, arch, padded, workers=workers, images=images, full_if_apart=True
    )
    reserved, needed, expandable, how = _from_replay(replay, recipe, config, sim, target, peak, workspaces)
    cap = target.capacity_bytes
    doubt = cap is not None and needed + CUDA_CONTEXT_BYTES > cap * (1 - FIT_UNCERTAINTY)
    if doubt and not replay[2][0].startswith(FULL_DEPTH_REPLAY):
        # Extrapolated from 4 and 8 blocks deep, the need puts the verdict within the tight band or over the
        # card while the peak allocated fits (else no replay): the whole step's replay decides instead.
        shallow = needed
        replay = replay_full_depth(sim_recipe, config, arch, padded, images=images)
        reserved, needed, expandable, how = _from_replay(replay, recipe, config, sim, target, peak, workspaces)
        how.append(
            f"replayed at full depth because the need extrapolated from 4 and 8 blocks deep, "
            f"{shallow / GIB:.2f} GiB, lay within {FIT_UNCERTAINTY:.0%} of the card or over it"
        )
    # kept on the simulation, which plan() may have shared with --alternatives (its ``sims``)
    sim.reserved, sim.needed, sim.replay = replay[0], replay[1], "the recipe's replayed step (same simulation)"
    notes.extend(how)
    if not conf.is_default:
        notes.append(f"caching allocator replayed with PYTORCH_CUDA_ALLOC_CONF={conf} (train.cuda_alloc_conf)")
    notes.append(
        f"FITS/OOM by the {needed / GIB:.2f} GiB the replayed allocator needs at least: on a device "
        "with less than the reserved peak, PyTorch frees its wholly cached segments and retries where a "
        "new one would not fit (slower steps), and later requests get segments of their own size"
    )
    if not recipe.data.packing:
        notes.append(
            "reserved replays full-length batches only; batches padded to their longest sample "
            "change shape each step and reserved creeps above this over a run (not what must "
            "fit: bench/varlen_reserved.py)"
        )
    return reserved, needed, expandable


def _from_replay(
    replay: tuple, recipe: Recipe, config, sim: Sim, target: Target, peak: int, workspaces: int
) -> tuple[int, int, int, list[str]]:
    """(reserved, needed, needed with expandable segments or 0, notes) on ``target`` from the unsharded
    step's replayed (reserved, least capacity, notes, least capacity with expandable segments)."""
    replayed_bytes, least, how, least_expandable = replay
    if target.gpus <= 1 and not target.strategy.startswith("deepspeed"):
        expandable = least_expandable + workspaces if least_expandable else 0
        return replayed_bytes + workspaces, least + workspaces, expandable, list(how)
    on_device = max(1, device_peak(sim.phases, sim.peak_allocated))
    ratio = replayed_bytes / on_device
    # several devices: the default stream's pool keeps the unsharded step's ratio; FSDP2's side streams
    # keep their own pools beside it (what they hold cached, free, at the peak is reserved on top)
    side, side_note = side_stream_cache(sim, recipe, target, total_blocks(config))
    notes = [f"reserved/allocated ratio {ratio:.3f} of the unsharded step (" + how[0] + ")"]
    notes += [side_note] if side else []
    reserved, needed = int(peak * ratio) + side, int(peak * least / on_device)
    return reserved, needed, int(peak * least_expandable / on_device), notes


def count_parameters(config, family: Optional[str] = None) -> int:
    """Parameter count from the config alone (fake shallow models, extrapolated per stack)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bigtune.models.build import auto_class

    stacks = model_stacks(config)
    full = {st: get_depth(config, st) for st in stacks}
    unit = {st: min(st.period, full[st]) for st in stacks}

    def count(depths: dict) -> int:
        cfg = copy.deepcopy(config)
        for st, n in depths.items():
            set_depth(cfg, st, n)
        with FakeTensorMode(), no_init():
            return sum(p.numel() for p in auto_class(family or config_family(cfg)).from_config(cfg).parameters())

    base = count(unit)
    total = base
    for st in stacks:
        if full[st] > unit[st]:
            total += (count({**unit, st: unit[st] + st.period}) - base) * (full[st] - unit[st]) // st.period
    return total


def state_bytes_lower_bound(r: Recipe, numel: int) -> int:
    """Parameters + gradients + optimizer state bytes: memory no step can go below."""
    from bigtune.models.build import weights_dtype

    es = torch.empty((), dtype=weights_dtype(r.precision)).element_size()
    if r.model.quantize != "none":
        return numel // 2 if r.model.quantize != "int8" else numel
    if r.peft.method != "none" or r.model.family == "image-to-text":
        return numel * es  # adapters / frozen parts: only the weights are certain
    opt = {"adamw": 2.0, "sgd": 1.0 if r.optim.momentum else 0.0}.get(r.optim.name, 0.0)
    if r.optim.name in EIGHT_BIT:
        opt = 2.0 / es  # two 1-byte moments per element
    return int(numel * es * (1 + (not r.optim.in_backward) + opt))  # in_backward: no full set of gradients
