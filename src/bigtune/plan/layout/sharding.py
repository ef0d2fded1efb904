"""Several devices from the one-device simulation: how DDP, FSDP and DeepSpeed ZeRO lay out (and offload)
the model states, and the gather and reduce buffers beside them, phase by phase.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from bigtune.core.stepmath import human_bytes
from bigtune.plan.base.constants import GIB
from bigtune.plan.base.target import Target
from bigtune.plan.layout.tensor_parallel import sequence_parallel_note, tensor_parallel_note
from bigtune.plan.step.simulate import Sim, zero_masters
from bigtune.recipe import Recipe

STATES = ("parameters", "gradients", "optimizer_device")


def shard_layout(strategy: str, fsdp_cpu_offload: bool = False) -> tuple[set[str], set[str]]:
    """(model-state categories split across the ranks, categories moved to CPU RAM) for a strategy.

    ddp replicates everything; fsdp and ZeRO-3 split all three; ZeRO-2 splits gradients and
    optimizer state (the fp32 masters of mixed precision belong to the latter); *_offload keeps the
    optimizer state (ZeRO-3: also the parameters) in CPU RAM. FSDP2's CPUOffloadPolicy
    (``fsdp_cpu_offload``) keeps all three shards in host RAM: each unit's parameter shard is copied
    to the device for its all-gather, each reduce-scattered gradient shard back to the host, and the
    optimizer steps on the CPU.
    """
    if strategy == "fsdp":
        return set(STATES), set(STATES) if fsdp_cpu_offload else set()
    if strategy.startswith("deepspeed_stage_"):
        from bigtune.engine.strategies import zero_layout

        stage, off_opt, off_params = zero_layout(strategy)
        split = set(STATES) if stage == 3 else {"gradients", "optimizer_device"}
        moved = ({"optimizer_device"} if off_opt else set()) | ({"parameters"} if off_params else set())
        return split, moved
    return set(), set()


def _phase_high(ph: dict) -> int:
    """A phase's own high-water mark (its cumulative peak when the simulation lacks it)."""
    return ph.get("phase_peak") or ph["peak_allocated"]


def _transient_high(ph: dict, late: bool = False) -> int:
    """A phase's high of what is not a model state (activations, temporaries, gradients on their way
    to being stored); ``late``: only from the phase's first stored gradient on (a backward past its
    loss and logits). The simulation measures both where it followed the gradients; else the phase's
    high less its end-of-phase states, which undercounts a backward whose high comes before most of
    its gradients exist."""
    got = ph.get("phase_peak_activations_late" if late else "phase_peak_activations")
    if late and got is None:
        got = ph.get("phase_peak_activations")
    if got is not None:
        return got
    return max(0, _phase_high(ph) - sum(ph[c] for c in STATES))


def _ddp_buckets(
    sim: Sim, phases: dict, notes: list[str], views_held: bool = False, views: bool = True
) -> tuple[dict, int, list[str]]:
    """DDP's reducer allocates flat gradient buckets for every trainable parameter when the model is
    wrapped and keeps them for the whole run. Without gradient_as_bucket_view (``views`` False: PyTorch's
    and Lightning's default) they are a second copy of the gradients beside every phase. With it
    (bigtune's default) a synced backward leaves each .grad a view into them, so after backward and the
    step they cost nothing extra; but zero_grad(set_to_none) drops the views, not the buckets, so from
    there until the next synced backward they sit beside whatever the step allocates: the whole forward,
    and backward from its start (gradients accumulated under no_sync are separate tensors too). Counted
    under activations ("other").
    ``views_held``: the simulated forward already holds the last synced backward's gradients, which are
    those views (optim.zero_grad=before_backward without accumulation), so the forward costs nothing extra."""
    g = sim.phases["after_backward"]["gradients"]
    if not g:
        return phases, sim.peak_allocated, notes
    f, b_, o = (sim.phases[x] for x in ("after_forward", "after_backward", "after_optimizer"))
    g_fwd = 0 if views_held and views else g
    g_opt = 0 if views else g
    fwd, bwd, opt = _phase_high(f) + g_fwd, _phase_high(b_) + g, _phase_high(o) + g_opt
    cumulative = {
        "before_forward": 0,
        "after_forward": fwd,
        "after_backward": max(fwd, bwd),
        "after_optimizer": max(fwd, bwd, opt),
    }
    for name, ph in phases.items():
        extra = g_fwd if name in ("before_forward", "after_forward") else g_opt
        ph["allocated"] += extra
        ph["activations"] += extra
        ph["phase_peak"] = ph["phase_peak_activations"] = ph["phase_peak_activations_late"] = ph[
            "phase_gradients_pending_late"
        ] = None
        ph["peak_allocated"] = max(ph["allocated"], cumulative.get(name, 0))
    if views:
        notes.append(
            f"ddp: gradient buckets {g / GIB:.2f} GiB alive from the wrap on (the gradients are views into "
            "them after a synced backward; beside the step's memory during forward and backward)"
        )
    else:
        notes.append(
            f"ddp: gradient buckets {g / GIB:.2f} GiB alive from the wrap on, a second copy of the gradients "
            "(ddp_bucket_view=false); true makes the gradients views into them"
        )
    return phases, max(fwd, bwd, opt), notes


def fsdp_unit_grad_elements(sim: Sim, trainable: int) -> int:
    """Gradient elements FSDP keeps for ``trainable`` trainable elements: exactly those under FSDP2,
    which shards parameter by parameter. (FSDP1 with use_orig_params gives a flat unit that holds any
    trainable weight a gradient for the whole unit: bench/published.py plans litgpt's 2023 runs so.)"""
    return trainable


@dataclass
class _Sharding:
    """How a strategy lays one device's model states (of the 1-device simulation ``sim``) over ``n`` devices:
    the categories ``split`` across them and ``moved`` to CPU RAM, in ``es``-byte elements, and the
    gather/reduce buffers beside them."""

    sim: Sim
    n: int
    split: set[str]
    moved: set[str]
    es: int
    deepspeed: bool
    flat: bool  # one FSDP unit: the whole model
    masters: bool  # ZeRO's fp32 master weights and optimizer state (zero_masters)
    trainable: int  # elements that get gradients
    grads_persist: bool
    persistent_grads: int
    grad_elements: int
    window_grads: int
    gather: int = 0
    gathered_after_forward: int = 0
    bucket: int = 0
    persistent_bucket: int = 0
    # A torchao NF4 base: its bytes as the unsharded step holds them, and one rank's (dim-0 shards, padded
    # to the world size, plus the replicated scaler mean and code table of every weight)
    nf4_full: int = 0
    nf4_rank: int = 0
    # A bitsandbytes 4-bit base under ZeRO-3: its quantization constants, which every rank keeps whole
    replicated: int = 0

    @property
    def offload(self) -> bool:
        return "optimizer_device" in self.moved

    def full_states(self, ph: dict) -> dict[str, int]:
        """The model states of one unsharded device under this strategy's precision handling."""
        sim = self.sim
        st = {c: ph[c] for c in STATES}
        if sim.fsdp_upcast:
            # FSDP *-mixed: simulated on 16-bit weights; the shards, their gradients (reduced in fp32,
            # kept in the weights' dtype) and the optimizer state are in the real (fp32) dtypes.
            sim_all, real_all, sim_train, real_train = sim.fsdp_upcast
            st["parameters"] += real_all - sim_all
            st["gradients"] = -(-st["gradients"] * real_train // max(1, sim_train))
            if sim.fsdp_upcast_optimizer:
                st["optimizer_device"] = -(-st["optimizer_device"] * real_train // max(1, sim_train))
        if self.grad_elements != self.trainable and st["gradients"]:
            st["gradients"] = self.grad_elements * self.es  # whole units' gradients (fsdp_unit_grad_elements)
        if self.grads_persist:
            st["gradients"] = self.persistent_grads
        if self.masters:
            # fp32 state: twice the simulated 16-bit optimizer state, plus the fp32 master weights
            st["optimizer_device"] = 2 * ph["optimizer_device"] + 4 * self.trainable
        return st

    def on_device(self, st: dict, c: str) -> int:
        if c in self.moved or (c == "gradients" and self.deepspeed and self.offload):
            return 0
        return self.on_device_if_kept(st, c)

    def on_device_if_kept(self, st: dict, c: str) -> int:
        """This rank's bytes of category ``c`` wherever they live (its shard where ``c`` is split)."""
        if c not in self.split:
            return st[c]
        if c == "parameters" and self.nf4_full:
            return -(-(st[c] - self.nf4_full) // self.n) + self.nf4_rank
        if c == "parameters" and self.replicated:
            return -(-(st[c] - self.replicated) // self.n) + self.replicated
        return -(-st[c] // self.n)

    def device_states(self, ph: dict) -> int:
        st = self.full_states(ph)
        return sum(self.on_device(st, c) for c in STATES)


def _states(ph: dict) -> int:
    return sum(ph[c] for c in STATES)


def shard_states(sim: Sim, recipe: Recipe, target: Target, n_layers: int) -> tuple[dict, int, list[str]]:
    """Per-device phases and peak for several GPUs (analytic on top of the 1-device simulation)."""
    if target.gpus <= 1 and not target.strategy.startswith("deepspeed") and not sim.fsdp_upcast:
        return sim.phases, sim.peak_allocated, []
    n = target.data_parallel  # FSDP shards over the data-parallel ranks (a tensor-parallel rank's own states)
    if target.tensor_parallel > 1:
        notes = [
            f"{target.gpus} GPU(s) with {target.strategy} over {n} data-parallel × {target.tensor_parallel} "
            "tensor-parallel ranks: planned analytically from the simulation of one tensor-parallel rank",
            tensor_parallel_note(target),
            *([sequence_parallel_note(target.tensor_parallel)] if recipe.sequence_parallel else []),
        ]
    else:
        notes = [f"{n} GPU(s) with {target.strategy}: planned analytically from the 1-GPU simulation"]
    split, moved = shard_layout(target.strategy, recipe.fsdp_cpu_offload)
    zero_offload = target.strategy.startswith("deepspeed") and "optimizer_device" in moved
    if target.device != "cuda":
        moved = set()  # on a CPU, "offloaded" state shares the one memory (and the engine counts it so)
    phases = copy.deepcopy(sim.phases)
    if not split:
        # The CPU tracker registers parameters, gradients and optimizer state, not the reducer's buckets
        # (born at the wrap, invisible while no .grad views them), so a CPU plan leaves them out as the
        # CPU measurement does; CUDA's allocator counts every byte.
        if target.strategy == "ddp" and target.device == "cuda":
            return _ddp_buckets(
                sim,
                phases,
                notes,
                views_held=recipe.optim.zero_grad == "before_backward" and recipe.accumulate == 1,
                views=recipe.ddp_bucket_view,
            )
        return phases, sim.peak_allocated, notes
    s = _sharding(sim, recipe, target, n_layers, split, moved, zero_offload)
    f = sim.phases["after_forward"]
    # the last micro-batch's forward holds the window's unsharded gradients, not shards of them
    fwd_grads = s.window_grads - s.on_device(s.full_states(f), "gradients") if s.window_grads else 0
    # Split each phase's high-water mark into model states (sharded / offloaded) and the rest.
    fwd = _forward_high(s, target, fwd_grads)
    bwd = _backward_high(s, recipe, fwd_grads)
    opt = _optimizer_high(s)
    peak = max(fwd, bwd, opt)
    # Each phase's peak is the highest point of the step so far.
    cumulative = {"after_forward": fwd, "after_backward": max(fwd, bwd), "after_optimizer": peak}
    _split_phases(s, phases, cumulative, fwd_grads)
    return phases, peak, notes + _sharding_notes(s, recipe, target)


def _sharding(
    sim: Sim, recipe: Recipe, target: Target, n_layers: int, split: set[str], moved: set[str], zero_offload: bool
) -> _Sharding:
    es = 4 if recipe.precision == "32-true" else 2
    deepspeed = target.strategy.startswith("deepspeed")
    trainable = sim.phases["after_backward"]["gradients"] // es  # elements that get gradients
    fsdp = target.strategy == "fsdp"
    # fsdp_grad_sync=step: every rank holds every unsharded gradient (fp32 under *-mixed, FSDP2 accumulates
    # in the reduce dtype) from the window's first backward until the last one reduce-scatters them.
    grad_elements = fsdp_unit_grad_elements(sim, trainable) if fsdp else trainable
    window_grads = (
        grad_elements * (4 if recipe.precision.endswith("-mixed") else es)
        if fsdp and recipe.fsdp_grad_sync == "step" and recipe.accumulate > 1
        else 0
    )
    s = _Sharding(
        sim=sim,
        n=target.data_parallel,
        split=split,
        moved=moved,
        es=es,
        deepspeed=deepspeed,
        flat=fsdp and recipe.fsdp_wrap == "none",
        masters=zero_masters(recipe, target.strategy),
        trainable=trainable,
        # ZeRO-2 keeps a gradient partition from backward to the step; ZeRO-3 one persistent flat
        # buffer; with the optimizer offloaded, reduced gradients go straight to pinned fp32 host memory.
        grads_persist=deepspeed and ("parameters" in split or zero_offload),
        persistent_grads=4 * trainable if zero_offload else es * trainable,
        grad_elements=grad_elements,
        window_grads=window_grads,
    )
    if sim.nf4 is not None and fsdp:
        round_to = 512 if target.device == "cuda" else 1
        s.nf4_full = n_layers * sim.nf4.block_nf4_bytes(1, round_to)
        s.nf4_rank = n_layers * sim.nf4.block_nf4_bytes(target.data_parallel, round_to)
    if deepspeed and "parameters" in split:
        s.replicated = n_layers * sim.block_quant_constants
    if "parameters" in split:
        s.gather, s.gathered_after_forward = _gathered(s, recipe, n_layers)
    if deepspeed:
        from bigtune.engine.strategies import BUCKET_ELEMENTS

        # ZeRO reduces gradients through buckets of reduce_bucket_size elements (capped by the model):
        # ZeRO-3 keeps one for the whole run; ZeRO-2 allocates its buckets for each backward and
        # frees them after it. (ZeRO-2 with overlap_comm asks for two, but meanwhile frees each
        # weight's gradient once copied: one bucket's worth matched 2-rank runs, two overshot by 10 %.)
        # ZeRO-3's all-gathered weights live only from a block's forward to its backward.
        one = min(BUCKET_ELEMENTS, sim.numel) * es
        if "parameters" in split:
            s.persistent_bucket = one
        else:
            s.bucket = one
    return s


def _gathered(s: _Sharding, recipe: Recipe, n_layers: int) -> tuple[int, int]:
    """(bytes gathered at most, bytes still gathered after the forward) where the parameters are split.

    Each rank all-gathers one block's full parameters at a time (two in flight with prefetch)
    and reduce-scatters its gradients block by block; the root's own weights (embeddings, final
    norm, head) stay gathered from the root's forward through its backward: FSDP2 never
    reshards the root after its forward, nor (fsdp_sharding=grad_op) any block. With
    fsdp_wrap=none the root is everything. ZeRO-3 releases every gather after its use."""
    sim, es = s.sim, s.es
    if s.nf4_full:
        return _gathered_nf4(s, recipe, n_layers)
    per_block = sim.block_numel / max(1, n_layers) if sim.block_numel else sim.numel / max(1, n_layers)
    root = max(0, sim.numel - sim.block_numel) if sim.block_numel else per_block
    if s.flat:
        return int(sim.numel * es), int(sim.numel * es)
    gather = int((root + 2 * per_block) * es)
    if s.deepspeed:
        if sim.block_quant_numel:  # a 4-bit base: its packed bytes (stored as 16-bit elements) are gathered
            q = sim.block_quant_numel
            gather = int(root * es + 2 * ((per_block - q) * es + q // 2))
        return gather, gather
    return gather, int((root + (n_layers * per_block if recipe.fsdp_sharding == "grad_op" else 0)) * es)


def _unit_bytes(s: _Sharding, n_layers: int) -> tuple[int, int]:
    """(the root unit's, one block's) unsharded bytes as they are all-gathered (as _gathered counts them)."""
    sim = s.sim
    if s.nf4_full:
        return sim.nf4.root_bytes, s.nf4_full // max(1, n_layers) + sim.nf4.block_other_bytes
    per_block = sim.block_numel / max(1, n_layers) if sim.block_numel else sim.numel / max(1, n_layers)
    root = max(0, sim.numel - sim.block_numel) if sim.block_numel else per_block
    return int(root * s.es), int(per_block * s.es)


def _gathered_nf4(s: _Sharding, recipe: Recipe, n_layers: int) -> tuple[int, int]:
    """_gathered for a torchao NF4 base, in bytes as they are: a block gathers its NF4 weights' packed 4-bit
    data and constants (NF4Tensor's all-gather extension; not 16-bit weights) and its other parameters (norms,
    adapters) in their own dtypes; the root its embeddings, head and final norm (fp32 under
    model.upcast_unquantized). The dequantized compute-dtype copy each matmul makes is the simulated step's."""
    nf4 = s.sim.nf4
    block = s.nf4_full // max(1, n_layers) + nf4.block_other_bytes
    if s.flat:
        return nf4.root_bytes + n_layers * block, nf4.root_bytes + n_layers * block
    after = nf4.root_bytes + (n_layers * block if recipe.fsdp_sharding == "grad_op" else 0)
    return nf4.root_bytes + 2 * block, after


def host_state_bytes(sim: Sim, recipe: Recipe, target: Target, n_layers: int) -> dict[str, int]:
    """One rank's model-state bytes that live in host RAM on a GPU target (fsdp_cpu_offload, ZeRO offload),
    by category; {} where none do."""
    if target.gpus <= 1 and not target.strategy.startswith("deepspeed"):
        return {}
    split, moved = shard_layout(target.strategy, recipe.fsdp_cpu_offload)
    if not moved or target.device != "cuda":
        return {}
    zero_offload = target.strategy.startswith("deepspeed") and "optimizer_device" in moved
    s = _sharding(sim, recipe, target, n_layers, split, moved, zero_offload)
    st = s.full_states(sim.phases["after_backward"])
    return {c: s.on_device_if_kept(st, c) for c in sorted(moved)}


def _forward_high(s: _Sharding, target: Target, fwd_grads: int) -> int:
    """The forward's high on one device. It peaks at its end (logits and loss), where FSDP holds only
    what stays gathered."""
    f = s.sim.phases["after_forward"]
    fwd = s.device_states(f) + fwd_grads + _transient_high(f) + s.gathered_after_forward + s.persistent_bucket
    if target.strategy == "fsdp" and "parameters" in s.split:
        # The root's first all-gather (the whole model with fsdp_wrap=none): NCCL's output buffer, the
        # unsharded weights it is copied into and this rank's input shard, before any activation.
        first = s.gathered_after_forward
        fwd = max(fwd, s.device_states(f) + 2 * first + -(-first // s.n))
    if s.flat:
        # Measured (CPU, gloo, 2 ranks, micro-batches 2-8): the forward of one flat unit peaks a whole
        # model's gathered size above its own end, whatever the batch; per-block units do not. Where
        # FSDP2 allocates it is not identified, and it is not yet checked on a GPU.
        fwd = max(
            fwd,
            s.device_states(f) + (f["allocated"] - _states(f)) + 2 * s.gathered_after_forward + s.persistent_bucket,
        )
    return fwd


def _backward_high(s: _Sharding, recipe: Recipe, fwd_grads: int) -> int:
    """The backward's high on one device. It has two. At its start (the loss and the logits' gradient,
    before any weight's gradient is stored) the states are the forward's and only what the forward left
    gathered is there; from the first stored gradient on, blocks are gathered and reduced one by one and
    at most all of this rank's gradient shards exist."""
    f, b_ = s.sim.phases["after_forward"], s.sim.phases["after_backward"]
    bwd_start = s.device_states(f) + fwd_grads + _transient_high(b_) + s.gathered_after_forward + s.persistent_bucket
    late = _transient_high(b_, late=True)
    pending = b_.get("phase_gradients_pending_late") or 0
    if s.flat:
        # One unit: every gradient stays unsharded until the backward ends, growing as in the simulation
        # (so its late high, gradients included, with the whole model gathered); FSDP2 then frees the
        # gathered weights and copies the gradients into one reduce-scatter input (fp32 for *-mixed).
        unsharded = s.trainable * s.es
        scatter_in = s.trainable * (4 if recipe.precision.endswith("-mixed") else s.es)
        bwd = max(
            s.device_states(f) + late + max(0, unsharded - pending) + s.gather,
            s.device_states(b_) + unsharded + scatter_in,
        )
    else:
        if "gradients" in s.split and not s.grads_persist and "gradients" not in s.moved:
            # Not every gradient shard exists yet at that high: each rank lacks 1/n of those to come.
            # (Offloaded shards go to the host as each unit reduces: none of them is on the device.)
            late -= pending // s.n
        # fsdp_grad_sync=step: the unsharded gradients until each unit reduces them (then its shards
        # replace them): at most all of them and no shard.
        shards = s.on_device(s.full_states(b_), "gradients") if s.window_grads else 0
        bwd = s.device_states(b_) - shards + s.window_grads + late + s.gather + s.bucket + s.persistent_bucket
    return max(bwd_start, bwd)


def side_stream_cache(
    sim: Sim, recipe: Recipe, target: Target, n_layers: int, gather_buffers: bool = True
) -> tuple[int, str]:
    """(bytes, note): what FSDP2's side-stream pools keep cached, free, beyond what they hold at the step's
    peak, on a CUDA device; reserved holds them on top of the default stream's own replayed pool.

    PyTorch's caching allocator gives a freed block back to the pool of the stream it was allocated on
    and serves a request only from its own stream's blocks (CUDACachingAllocator.cpp: BlockComparator
    orders by stream first, get_free_block searches the request's stream). FSDP2
    (_fully_shard/_fsdp_collectives.py) allocates each unit's all-gather input and output in its
    all-gather copy-in stream (foreach_all_gather) and every gradient shard as a view of a reduce-scatter
    output allocated in its reduce-scatter stream (foreach_reduce). So the gradient shards, once freed by
    zero_grad, stay cached in that stream's pool through the next forward, where the default stream's
    activations cannot reuse them; and the all-gather buffers (the largest unit's, or two blocks' in flight
    with backward prefetch) stay cached beside the forward's end. Neither counts towards what must fit:
    the free-and-retry path releases wholly cached segments of every stream before an out-of-memory.
    ``gather_buffers=False`` leaves the all-gather buffers out (FSDP1 gathers into the flat parameter itself)."""
    split, moved = shard_layout(target.strategy, recipe.fsdp_cpu_offload)
    if target.strategy != "fsdp" or target.device != "cuda" or target.data_parallel <= 1 or "parameters" not in split:
        return 0, ""
    s = _sharding(sim, recipe, target, n_layers, split, moved, False)
    f, b_ = sim.phases["after_forward"], sim.phases["after_backward"]
    fwd_grads = s.window_grads - s.on_device(s.full_states(f), "gradients") if s.window_grads else 0
    highs = {"forward": _forward_high(s, target, fwd_grads), "optimizer": _optimizer_high(s)}
    highs["backward"] = _backward_high(s, recipe, fwd_grads)
    at = max(highs, key=highs.get)
    # gradient shards: all of them after the backward; at a forward's end those the phase kept
    shards = s.on_device(s.full_states(b_), "gradients")
    shards_at = {"forward": s.on_device(s.full_states(f), "gradients"), "backward": shards, "optimizer": shards}[at]
    if s.window_grads:
        shards_at = shards if at == "optimizer" else 0  # the window's gradients are unsharded ones
    if at == "backward":
        # one unit: its single reduce-scatter comes after the backward's high. Blocks: the high is at the
        # backward's start or past its first reduce-scatter, counted as the latter (fewer shards cached
        # free there than at the start, so this is the smaller figure)
        shards_at = 0 if s.flat else max(0, shards - (b_.get("phase_gradients_pending_late") or 0) // s.n)
    # all-gather buffers (output + this rank's input): the whole model in one unit, else the larger of the
    # root's and two blocks' in flight; in use at the backward's high of per-block units
    per_unit = 1 + 1 / s.n
    if not gather_buffers:
        buffers = buffers_at = 0
    elif s.flat:
        buffers, buffers_at = int(s.gather * per_unit), 0
    else:
        root, block = _unit_bytes(s, n_layers)
        buffers = int(max(root, 2 * block) * per_unit)
        buffers_at = int(2 * block * per_unit) if at == "backward" else 0
    extra = max(0, shards - shards_at) + max(0, buffers - buffers_at)
    if not extra:
        return 0, ""
    return extra, (
        f"fsdp side streams: + {human_bytes(extra)} reserved, cached free in FSDP2's all-gather and reduce-scatter "
        "streams' own pools (gradient shards after zero_grad, all-gather buffers), which the default stream "
        "cannot reuse; not part of what must fit (an out-of-memory retry releases them)"
    )


def _optimizer_high(s: _Sharding) -> int:
    """The optimizer step's high on one device. Its temporaries are proportional to the state it
    updates: its shard, on the CPU if offloaded."""
    o = s.sim.phases["after_optimizer"]
    update_tmp = 0 if "optimizer_device" in s.moved else -(-_transient_high(o) // s.n)
    if s.masters and "optimizer_device" not in s.moved:
        # The update runs on fp32 state (temporaries twice the size) from an fp32 copy of the
        # gradient partition, made while the 16-bit partition still exists.
        update_tmp = 2 * update_tmp + -(-4 * s.trainable // s.n)
    return s.device_states(o) + update_tmp + s.persistent_bucket


def _split_phases(s: _Sharding, phases: dict, cumulative: dict[str, int], fwd_grads: int) -> None:
    """Each phase of ``phases`` (a copy of the simulation's) as one device holds it; ``cumulative``:
    the step's highest point up to each phase."""
    for name, ph in phases.items():
        full = _states(ph)
        st = s.full_states(ph)
        cpu = st["optimizer_device"] if s.offload else 0
        if s.deepspeed and s.offload:
            cpu += s.persistent_grads  # the fp32 gradient partition the CPU update reads, pinned in host RAM
        for c in STATES:
            ph[c] = s.on_device(st, c)
        if s.deepspeed and not s.grads_persist and name in ("before_forward", "after_optimizer"):
            ph["gradients"] = 0  # ZeRO-2 frees its gradient partition in the step
        ph["optimizer_cpu"] += -(-cpu // s.n)
        # Buffers alive at this phase boundary: what the forward leaves gathered, until the backward
        # reshards it; ZeRO-3 keeps its bucket throughout.
        live = (s.gathered_after_forward if name == "after_forward" else 0) + s.persistent_bucket
        if name == "after_forward" and fwd_grads:
            ph["gradients"] += fwd_grads
        ph["allocated"] += _states(ph) - full + live
        ph["activations"] += live
        ph["phase_peak"] = ph["phase_peak_activations"] = ph["phase_peak_activations_late"] = ph[
            "phase_gradients_pending_late"
        ] = None  # not meaningful after the analytic split
        ph["peak_allocated"] = max(ph["allocated"], cumulative.get(name, 0))


def _sharding_notes(s: _Sharding, recipe: Recipe, target: Target) -> list[str]:
    what = " and ".join(sorted(s.split))
    notes = [
        f"{target.strategy}: {what} / {s.n}; + {(s.gather + s.bucket + s.persistent_bucket) / GIB:.2f} GiB "
        "gather/reduce buffers"
    ]
    if s.window_grads:
        notes.append(
            f"fsdp_grad_sync=step: {s.window_grads / GIB:.2f} GiB of unsharded gradients on every rank "
            f"through each window of {recipe.accumulate} micro-batches; micro_batch keeps only shards"
        )
    if s.flat:
        notes.append(
            f"fsdp_wrap=none: one FSDP unit, the whole model ({s.gather / GIB:.2f} GiB) gathered from the "
            f"forward through the backward and every gradient unsharded before one reduce-scatter; "
            "fsdp_wrap=block gathers and reduces one decoder block at a time"
        )
    if s.masters:
        notes.append(
            f"{target.strategy} with {recipe.precision}: 16-bit weights and gradients, fp32 master "
            "weights and optimizer state (DeepSpeed's mixed precision; no autocast)"
        )
    if s.moved and not s.deepspeed:
        host = sum(s.on_device_if_kept(s.full_states(s.sim.phases["after_backward"]), c) for c in sorted(s.moved))
        notes.append(
            f"fsdp_cpu_offload: parameter, gradient and optimizer-state shards in pinned host RAM, {host / GIB:.2f} "
            "GiB per rank (not in device memory); each unit's shard is copied to the device for its all-gather "
            "and each gradient shard back, and the optimizer steps on the CPU"
        )
    elif s.moved:
        notes.append(f"{target.strategy}: {' and '.join(sorted(s.moved))} held in CPU RAM (not in device memory)")
    return notes
