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
added analytically and labelled as such: the CUDA context, allocator fragmentation (reserved vs
allocated) and, for several GPUs, sharding and communication buffers. Those terms are *assumptions*
until calibrated against GPU measurements (bench/plan_accuracy.py); the plan says so.

Step time is a roofline estimate: model FLOPs at an assumed fraction of the GPU's dense peak, plus
the optimizer's memory traffic at an assumed fraction of the bandwidth, plus communication.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from unittest import mock
from typing import Any, Optional

import torch

from bigtune.memory import PHASES
from bigtune.recipe import Recipe, load_recipe

GIB = 1024**3
CONFIG_DIR = Path(__file__).resolve().parent / "assets" / "configs"
CATEGORIES = ("parameters", "gradients", "optimizer_device", "optimizer_cpu", "activations", "allocated",
              "peak_allocated")

# --- assumptions for CUDA targets (not seen by simulation; uncalibrated until GPU runs are committed) ---
CUDA_CONTEXT_BYTES = int(0.5 * GIB)   # CUDA context + cuBLAS/cuDNN handles outside PyTorch's allocator
RESERVED_OVER_ALLOCATED = 1.05        # caching-allocator fragmentation: reserved ≈ 1.05 × peak allocated
FIT_MARGIN = 0.02                     # keep 2 % of the card free before calling a plan FITS
ASSUMED_MFU = 0.45                    # fraction of dense peak FLOP/s a fine-tuning step reaches
ASSUMED_BW_EFFICIENCY = 0.7           # fraction of DRAM bandwidth the optimizer's update reaches
MICRO_TOKENS_HALF_EFFICIENCY = 256    # a micro-batch of this many tokens reaches half of ASSUMED_MFU


class PlanError(ValueError):
    """The recipe cannot be planned as given (unknown model config, unsupported family...)."""


# -- model configs ------------------------------------------------------------------------------------

def bundled_config_path(name: str) -> Optional[Path]:
    p = CONFIG_DIR / (name.replace("/", "--") + ".json")
    return p if p.is_file() else None


def resolve_config(recipe: Recipe):
    """The model's HF config, from a preset, a local folder, a bundled copy, or the hub (in that order)."""
    _refuse_image_to_text(recipe)  # before any hub lookup: the refusal is the useful message
    return resolve_config_name(recipe.model)


def resolve_config_name(model_cfg):
    from transformers import AutoConfig

    from bigtune.presets import PRESETS, preset_config, tiny_processor, tiny_tokenizer

    name = model_cfg.name
    if name in PRESETS:
        image = PRESETS[name].family == "image-to-text"
        return preset_config(name, tiny_processor() if image else tiny_tokenizer())
    local = Path(name).expanduser()
    if local.is_dir():
        return AutoConfig.from_pretrained(str(local), trust_remote_code=model_cfg.trust_remote_code)
    bundled = bundled_config_path(name)
    if bundled is not None:
        d = json.loads(bundled.read_text())
        return AutoConfig.for_model(d.pop("model_type"), **d)
    try:
        return AutoConfig.from_pretrained(name, revision=model_cfg.revision,
                                          trust_remote_code=model_cfg.trust_remote_code)
    except Exception as e:
        known = sorted(p.stem.replace("--", "/") for p in CONFIG_DIR.glob("*.json"))
        raise PlanError(f"model.name {name!r}: no config.json found (not a preset, not a local folder, not bundled, "
                        f"hub unreachable: {type(e).__name__}). Point model.name at a folder holding its "
                        f"config.json, or use a bundled one: {', '.join(known)}") from e


# -- simulation ---------------------------------------------------------------------------------------

@dataclass
class Sim:
    """Per-phase categories of the steady step (step 1) and the peak over both simulated steps."""
    phases: dict[str, dict[str, int]]
    peak_allocated: int
    numel: int
    matmul_numel: int


def _sim_precision(precision: str) -> str:
    # Fabric on a CPU turns 16-mixed into bf16-mixed; the byte counts are the same (2-byte copies).
    return "bf16-mixed" if precision == "16-mixed" else precision


def simulate(recipe: Recipe, config, n_layers: int, cuda: bool, micro_batch: Optional[int] = None,
             padded: bool = False) -> Sim:
    """Run one steady-state training step of ``recipe`` with ``n_layers`` decoder layers on fake tensors.

    The optimizer state is created first (one update with zero gradients), so the simulated step is
    like the engine's step 1 and later: its peak is the run's peak. Accumulation windows are
    simulated with two micro-batches: from the second one on, gradients are held during forward,
    and a third micro-batch repeats the second one's memory exactly.
    """
    from lightning.fabric import Fabric
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    from bigtune.engine import LoopState, train_step
    from bigtune.memory import MemoryMonitor
    from bigtune.models import apply_peft, enable_activation_checkpointing, weights_dtype
    from bigtune.optim import make_optimizer
    from bigtune.stepmath import target_token_count

    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = n_layers
    cfg.use_cache = False
    cfg._attn_implementation = recipe.model.attn_implementation
    r = copy.deepcopy(recipe)
    if cuda and r.optim.implementation == "auto":
        r.optim.implementation = "foreach"  # torch's default for CUDA tensors
    quantize = r.model.quantize
    r.model.quantize = "none"  # bitsandbytes cannot quantize fake tensors: simulate, then swap the bytes
    eight_bit = r.optim.name in EIGHT_BIT
    if eight_bit:
        # bitsandbytes kernels do not run on fake tensors: step with state-free SGD and add the 8-bit
        # state analytically below (its update works in place, block by block).
        r.optim.name, r.optim.momentum, r.optim.implementation = "sgd", 0.0, "for-loop"
    if r.optim.name == "deepspeed_cpu_adam":
        # DeepSpeed's C++ Adam reads raw data pointers (a segfault on fake tensors); torch's CPU
        # AdamW in the same wrapper keeps exactly the same tensors in the same places.
        r.optim.name = "cpu_offload_adamw"
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)  # no "Using bfloat16 AMP" per simulation
    fabric = Fabric(accelerator="cpu", devices=1, precision=_sim_precision(r.precision))
    # The model is built directly in its storage dtype, so Fabric's module.to(dtype) is a no-op for
    # real tensors; on fake parameters torch would try (and fail) to swap them, so skip it.
    fabric._precision.convert_module = lambda module: module
    fabric._strategy.module_to_device = lambda module: None  # already on the (fake) CPU
    b_size, seq = micro_batch or r.train.micro_batch_size, r.data.max_seq_length
    k = min(r.accumulate, 2)
    # Real (tiny) token ids: the loss normaliser needs a concrete count; everything else is fake.
    ids = torch.randint(3, cfg.vocab_size, (b_size, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:  # one padded row makes the model take the explicit-mask attention path, as a real batch does
        mask[-1, -1] = 0
    batches = [{"input_ids": ids.clone(), "attention_mask": mask.clone(), "labels": ids.clone(),
                "padded": padded} for _ in range(k)]  # distinct storages, like distinct real micro-batches
    tokens = int(target_token_count(ids)) * r.accumulate
    # transformers treats fake tensors as "tracing" and then keeps an explicit mask for packed
    # sequences, which the real run (one sequence per row, checked on real values) drops.
    no_packing = mock.patch("transformers.masking_utils.find_packed_sequence_indices", lambda position_ids: None)
    # peft moves new adapters to the base layer's device with module.to(); torch cannot swap fake
    # parameters, and everything here already lives on the one (fake) CPU: make it a no-op. No
    # dtype change goes through module.to() in the engine (Fabric's conversion is skipped there too).
    no_move = mock.patch("torch.nn.Module.to", lambda self, *a, **k: self)
    with FakeTensorMode(allow_non_fake_inputs=True), no_packing, no_move:
        model = AutoModelForCausalLM.from_config(cfg, dtype=weights_dtype(r.precision))
        model.config.use_cache = False
        model.train()
        if r.train.activation_checkpointing:
            enable_activation_checkpointing(model)
        if r.peft.method != "none":
            # A quantized base is simulated in its compute dtype; plan() then swaps in 4/8-bit bytes.
            model = apply_peft(model, r.peft, quantized=False, checkpointing=r.train.activation_checkpointing)
        numel = sum(p.numel() for p in model.parameters())
        matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
        wrapped = fabric.setup_module(model)
        opt = fabric.setup_optimizers(make_optimizer(r.optim, wrapped))
        for p in wrapped.parameters():
            if p.requires_grad:  # frozen (base) weights never get gradients
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        built = SimpleNamespace(fabric=fabric, model=wrapped, optimizer=opt, scheduler=sched, recipe=r)
        monitor = MemoryMonitor(torch.device("cpu"), round_to=512 if cuda else 1)
        _, snaps = train_step(built, batches, monitor, True, LoopState(step=1), tokens)
    steady = {s.phase: {c: getattr(s, c) for c in CATEGORIES} for s in snaps}
    peak = max(s.peak_allocated for s in snaps)
    if quantize != "none":
        delta = quantized_parameter_delta(wrapped, quantize, recipe.model.double_quant)
        for ph in steady.values():
            for c in ("parameters", "allocated", "peak_allocated"):
                ph[c] += delta
        peak += delta
    if eight_bit:
        shapes = [p.numel() for p in wrapped.parameters() if p.requires_grad]
        extra = 0 if recipe.optim.name.startswith("paged") and cuda else eight_bit_state_bytes(shapes)
        for ph in steady.values():
            for c in ("optimizer_device", "allocated", "peak_allocated"):
                ph[c] += extra
        peak += extra
    return Sim(steady, peak, numel, matmul)


EIGHT_BIT = ("adam8bit", "adamw8bit", "paged_adamw8bit")


def quantized_parameter_delta(model: torch.nn.Module, quantize: str, double_quant: bool) -> int:
    """Bytes that loading the base with bitsandbytes changes, relative to the simulated model.

    Every base nn.Linear but the output head becomes 4-bit (n/2 bytes + one scale per 64 weights:
    fp32, or uint8 with an fp32 scale per 256 scales under double quantization) or int8 (n bytes +
    an fp32 scale per row); peft's k-bit preparation then casts the remaining 16-bit weights
    (embeddings, norms, head) to fp32. Activations are taken from the unquantized simulation: the
    real k-bit path keeps hidden states in fp32 around the 4-bit matmuls, so with a 16-bit base
    the plan under-counts QLoRA activations (seen on the CPU: up to ~20 %; noted in the plan).
    """
    delta = 0
    quantized_ids = set()
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or "lora_" in name or name.endswith("lm_head") \
                or name.endswith("lm_head.base_layer"):
            continue
        w = mod.weight
        n = w.numel()
        quantized_ids.add(id(w))
        if quantize == "int8":
            new = n + w.shape[0] * 4
        else:
            blocks = -(-n // 64)
            # + the 16-entry fp32 NF4/FP4 code per layer, and the 256-entry nested code with double quant
            new = n // 2 + (blocks + 4 * -(-blocks // 256) + 1024 if double_quant else 4 * blocks) + 64
        delta += new - n * w.element_size()
    for name, p in model.named_parameters():
        if id(p) not in quantized_ids and "lora_" not in name and p.dtype in (torch.float16, torch.bfloat16):
            delta += p.numel() * (4 - p.element_size())
    return delta


def eight_bit_state_bytes(numels: list[int], min_8bit_size: int = 4096, block: int = 256) -> int:
    """bitsandbytes 8-bit Adam state: two uint8 moments + one fp32 scale per 256-element block for
    tensors of at least 4096 elements (plus the two 256-entry quantization maps, shared); smaller
    tensors keep two fp32 moments."""
    total, any8 = 0, False
    for n in numels:
        if n >= min_8bit_size:
            total += 2 * n + 2 * 4 * (-(-n // block))
            any8 = True
        else:
            total += 2 * 4 * n
    return total + (2 * 256 * 4 if any8 else 0)


def _extrapolate(a: int, b: int, n: int) -> int:
    """Value at n layers from values at 1 and 2 layers (linear in depth)."""
    return int(a + (b - a) * (n - 1))


def simulate_full_depth(recipe: Recipe, config, cuda: bool, padded: bool = False) -> Sim:
    n = int(config.num_hidden_layers)
    if n <= 2:
        return simulate(recipe, config, n, cuda, padded=padded)
    s1, s2 = simulate(recipe, config, 1, cuda, padded=padded), simulate(recipe, config, 2, cuda, padded=padded)
    phases = {ph: {c: _extrapolate(s1.phases[ph][c], s2.phases[ph][c], n) for c in CATEGORIES} for ph in s1.phases}
    return Sim(phases, _extrapolate(s1.peak_allocated, s2.peak_allocated, n), _extrapolate(s1.numel, s2.numel, n),
               _extrapolate(s1.matmul_numel, s2.matmul_numel, n))


# -- the plan -------------------------------------------------------------------------------------------

@dataclass
class Target:
    """Where the recipe would run: a CPU, or ``gpus`` × a catalog GPU."""
    device: str = "cpu"
    gpu: Any = None
    gpus: int = 1
    strategy: str = "single"     # single | ddp | fsdp | deepspeed_stage_*  (analytic on top of 1 GPU)

    @property
    def capacity_bytes(self) -> Optional[int]:
        return int(self.gpu.memory_gib * GIB) if self.gpu is not None else None

    def label(self) -> str:
        if self.gpu is None:
            return "cpu"
        return f"{self.gpus}× {self.gpu.key}" + (f" ({self.strategy})" if self.gpus > 1 else "")


@dataclass
class Plan:
    recipe_name: str
    target: str
    variant: str
    phases: dict[str, dict[str, int]]
    peak_allocated: int
    peak_reserved: Optional[int]
    overhead: int
    peak_total: int
    capacity: Optional[int]
    fits: Optional[bool]
    parameters_total: int
    step_time_s: Optional[float]
    tokens_per_s: Optional[float]
    tokens_per_step: int
    notes: list[str] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)
    plan_seconds: float = 0.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def model_states(self) -> dict[str, int]:
        p = self.phases.get("after_backward", {})
        return {c: p.get(c, 0) for c in ("parameters", "gradients", "optimizer_device", "optimizer_cpu")}


STATES = ("parameters", "gradients", "optimizer_device")


def shard_layout(strategy: str) -> tuple[set[str], set[str]]:
    """(model-state categories split across the ranks, categories moved to CPU RAM) for a strategy.

    ddp replicates everything; fsdp and ZeRO-3 split all three; ZeRO-2 splits gradients and
    optimizer state (the fp32 masters of mixed precision belong to the latter); *_offload keeps the
    optimizer state (ZeRO-3: also the parameters) in CPU RAM.
    """
    if strategy == "fsdp":
        return set(STATES), set()
    if strategy.startswith("deepspeed_stage_"):
        from bigtune.dist import zero_layout

        stage, off_opt, off_params = zero_layout(strategy)
        split = set(STATES) if stage == 3 else {"gradients", "optimizer_device"}
        moved = ({"optimizer_device"} if off_opt else set()) | ({"parameters"} if off_params else set())
        return split, moved
    return set(), set()


def _shard(sim: Sim, recipe: Recipe, target: Target, n_layers: int) -> tuple[dict, int, list[str]]:
    """Per-device phases and peak for several GPUs (analytic on top of the 1-device simulation)."""
    if target.gpus <= 1 and not target.strategy.startswith("deepspeed"):
        return sim.phases, sim.peak_allocated, []
    n = target.gpus
    notes = [f"{n} GPU(s) with {target.strategy}: planned analytically from the 1-GPU simulation"]
    split, moved = shard_layout(target.strategy)
    phases = copy.deepcopy(sim.phases)
    if not split:
        return phases, sim.peak_allocated, notes
    es = 4 if recipe.precision == "32-true" else 2
    buffers = 0
    if "parameters" in split:
        # Each rank all-gathers one block's full parameters (two in flight with prefetch) and
        # reduce-scatters its gradients: about 3 blocks of unsharded weights in compute precision.
        buffers += int(3 * sim.numel / max(1, n_layers) * es)
    if target.strategy.startswith("deepspeed"):
        from bigtune.dist import BUCKET_ELEMENTS

        # ZeRO reduces gradients through one bucket of reduce_bucket_size elements (capped by the model).
        buffers += min(BUCKET_ELEMENTS, sim.numel) * es

    def on_device(ph: dict, c: str) -> int:
        if c in moved:
            return 0
        return -(-ph[c] // n) if c in split else ph[c]

    def states(ph: dict) -> int:
        return sum(ph[c] for c in STATES)

    def device_states(ph: dict) -> int:
        return sum(on_device(ph, c) for c in STATES)

    f, b_, o = (sim.phases[x] for x in ("after_forward", "after_backward", "after_optimizer"))
    # Peaks are cumulative over the step; split each into model states (sharded / offloaded) and the rest.
    fwd = device_states(f) + (f["peak_allocated"] - states(f)) + buffers
    bwd = device_states(b_) + max(0, b_["peak_allocated"] - states(b_)) + buffers
    # The optimizer's temporaries are proportional to the state it updates: its shard, on the CPU if offloaded.
    update_tmp = 0 if "optimizer_device" in moved else -(-max(0, o["peak_allocated"] - states(o)) // n)
    opt = device_states(o) + update_tmp
    peak = max(fwd, bwd, opt)
    for ph in phases.values():
        full = states(ph)
        cpu = ph["optimizer_device"] if "optimizer_device" in moved else 0
        for c in STATES:
            ph[c] = on_device(ph, c)
        ph["optimizer_cpu"] += -(-cpu // n)
        ph["allocated"] += states(ph) - full + buffers
        ph["activations"] += buffers
        ph["peak_allocated"] = min(ph["peak_allocated"], peak)
    what = " and ".join(sorted(split))
    notes.append(f"{target.strategy}: {what} / {n}; + {buffers / GIB:.2f} GiB gather/reduce buffers")
    if moved:
        notes.append(f"{target.strategy}: {' and '.join(sorted(moved))} held in CPU RAM (not in device memory)")
    return phases, peak, notes


def _time(recipe: Recipe, sim: Sim, target: Target, config) -> tuple[Optional[float], Optional[float], list[str]]:
    from bigtune.gpus import peak_flops
    from bigtune.stepmath import decoder_flops_per_token

    tokens = recipe.train.micro_batch_size * recipe.data.max_seq_length * recipe.accumulate
    if target.gpu is None:
        return None, None, []
    peak = peak_flops(target.gpu, recipe.precision)
    if not peak:
        return None, None, [f"{target.gpu.key} has no {recipe.precision} tensor-core rate in the catalog"]
    fpt = decoder_flops_per_token(sim.matmul_numel, int(config.num_hidden_layers), int(config.hidden_size),
                                  recipe.data.max_seq_length)
    if recipe.train.activation_checkpointing:
        fpt *= 4 / 3  # one extra forward
    micro_tokens = recipe.train.micro_batch_size * recipe.data.max_seq_length
    # Small micro-batches leave the GPU under-occupied; half efficiency at 256 tokens (assumed).
    occupancy = micro_tokens / (micro_tokens + MICRO_TOKENS_HALF_EFFICIENCY)
    t_compute = tokens * fpt / (peak * ASSUMED_MFU * occupancy)  # each device computes its own tokens
    states = sim.phases["after_backward"]
    # The update reads parameters, gradients and state and writes parameters and state.
    moved = 2 * states["parameters"] + states["gradients"] + 2 * states["optimizer_device"]
    if target.strategy == "fsdp" or target.strategy.startswith("deepspeed"):
        moved /= target.gpus
    t_opt = moved / (target.gpu.mem_bandwidth_gbs * 1e9 * ASSUMED_BW_EFFICIENCY)
    t_comm = 0.0
    if target.gpus > 1 and target.gpu.interconnect_gbs:
        grad_bytes = states["gradients"]
        factor = 2 * (target.gpus - 1) / target.gpus
        volume = factor * grad_bytes * (1.5 if target.strategy == "fsdp" else 1.0)
        t_comm = volume / (target.gpu.interconnect_gbs / 2 * 1e9)  # one direction of the bidirectional figure
    step = t_compute + t_opt + t_comm
    return step, tokens * target.gpus / step, [
        f"time: roofline at {ASSUMED_MFU:.0%} of dense peak × micro-batch occupancy {occupancy:.2f} and "
        f"{ASSUMED_BW_EFFICIENCY:.0%} of bandwidth (assumed, uncalibrated)"]


def plan(recipe: Recipe, target: Target, variant: str = "recipe", overrides: Optional[dict] = None,
         config=None, sim: Optional[Sim] = None, padded: bool = False) -> Plan:
    """Predict one recipe on one target, for full-length micro-batches of max_seq_length tokens.

    ``sim`` reuses a simulation of the same single-device step; ``padded`` plans batches that hold
    padding (the attention then gets an explicit mask, which can cost more on some kernels).
    """
    t0 = time.perf_counter()
    _refuse_image_to_text(recipe)
    config = config if config is not None else resolve_config(recipe)
    cuda = target.device == "cuda"
    if sim is None:
        sim = simulate_full_depth(recipe, config, cuda, padded=padded)
    phases, peak, notes = _shard(sim, recipe, target, int(config.num_hidden_layers))
    if recipe.model.quantize != "none":
        notes.append(f"{recipe.model.quantize} base: weight bytes analytic; activations from the unquantized "
                     "simulation (the k-bit path keeps fp32 hidden states: expect more)")
    if cuda:
        reserved = int(peak * RESERVED_OVER_ALLOCATED)
        overhead = CUDA_CONTEXT_BYTES
        notes.append(f"reserved ≈ {RESERVED_OVER_ALLOCATED} × peak allocated and CUDA context "
                     f"{CUDA_CONTEXT_BYTES / GIB:.1f} GiB are assumptions until calibrated on GPU runs")
    else:
        reserved, overhead = None, 0
    total = (reserved if reserved is not None else peak) + overhead
    cap = target.capacity_bytes
    fits = None if cap is None else total <= cap * (1 - FIT_MARGIN)
    step, tps, tnotes = _time(recipe, sim, target, config)
    return Plan(recipe_name=recipe.name, target=target.label(), variant=variant, phases=phases, peak_allocated=peak,
                peak_reserved=reserved, overhead=overhead, peak_total=total, capacity=cap, fits=fits,
                parameters_total=sim.numel, step_time_s=step, tokens_per_s=tps,
                tokens_per_step=recipe.train.micro_batch_size * recipe.data.max_seq_length * recipe.accumulate
                * target.gpus, notes=notes + tnotes, overrides=overrides or {},
                plan_seconds=time.perf_counter() - t0)


# -- alternatives -------------------------------------------------------------------------------------

def count_parameters(config) -> int:
    """Parameter count from the config alone (fake 1- and 2-layer models, extrapolated)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoModelForCausalLM

    counts = []
    for n in (1, 2):
        cfg = copy.deepcopy(config)
        cfg.num_hidden_layers = n
        with FakeTensorMode():
            model = AutoModelForCausalLM.from_config(cfg)
            counts.append(sum(p.numel() for p in model.parameters()))
    return _extrapolate(counts[0], counts[1], int(config.num_hidden_layers))


def state_bytes_lower_bound(r: Recipe, numel: int) -> int:
    """Parameters + gradients + optimizer state bytes: memory no step can go below."""
    from bigtune.models import weights_dtype

    es = torch.empty((), dtype=weights_dtype(r.precision)).element_size()
    opt = {"adamw": 2.0, "sgd": 1.0 if r.optim.momentum else 0.0}[r.optim.name]
    return int(numel * es * (2 + opt))


def _variant_recipe(recipe: Recipe, over: dict) -> Recipe:
    r = load_recipe(recipe.to_dict(), {**over, "accelerator": "cpu"})
    r.accelerator = recipe.accelerator
    return r


def _interpolate(lo: Sim, hi: Sim, m_lo: int, m_hi: int, m: int) -> Sim:
    """Memory at micro batch m from exact simulations at m_lo and m_hi (linear in the batch size).

    Peak memory is a maximum of lines in the batch size, hence convex: the interpolation is exact
    at both ends and errs on the safe (high) side in between.
    """
    t = (m - m_lo) / (m_hi - m_lo)

    def f(a: int, b: int) -> int:
        return int(round(a + (b - a) * t))

    phases = {ph: {c: f(lo.phases[ph][c], hi.phases[ph][c]) for c in CATEGORIES} for ph in lo.phases}
    return Sim(phases, f(lo.peak_allocated, hi.peak_allocated), lo.numel, lo.matmul_numel)


def _sim_key(r: Recipe, micro: int) -> str:
    """Simulations depend only on these; variants that agree on them share one."""
    k = r.global_batch_size // (micro * r.devices) if r.train.global_batch_size else r.accumulate
    return json.dumps([r.precision, r.train.activation_checkpointing, r.optim.name, r.optim.momentum,
                       r.optim.implementation, r.data.max_seq_length, micro, min(k, 2)])


def _run_sims(jobs: dict[str, tuple[Recipe, int]], config, cuda: bool, workers: int) -> dict[str, Sim]:
    """Simulate every (recipe, micro batch) job, in parallel worker processes when there are several cores."""
    if workers > 1 and len(jobs) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        # fork: the children inherit the imported libraries instead of importing them again (seconds).
        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("fork")) as ex:
            futs = {k: ex.submit(_sim_job, r, config, cuda, m) for k, (r, m) in jobs.items()}
            return {k: f.result() for k, f in futs.items()}
    return {k: _sim_job(r, config, cuda, m) for k, (r, m) in jobs.items()}


def _sim_job(recipe: Recipe, config, cuda: bool, micro: int) -> Sim:
    r = copy.deepcopy(recipe)
    r.train.micro_batch_size = micro
    return simulate_full_depth(r, config, cuda)


class Alternatives(list):
    """The fitting plans, fastest first; ``evaluated`` counts every variant considered."""

    def __init__(self, plans, evaluated: int):
        super().__init__(plans)
        self.evaluated = evaluated


def _refuse_image_to_text(recipe: Recipe) -> None:
    if recipe.model.family == "image-to-text":
        raise PlanError("image-to-text models (BLIP-2) are not planned yet: the planner simulates causal LMs only. "
                        "Train with memory.enabled=true to measure instead (the table shows each category).")


def alternatives(recipe: Recipe, target: Target, max_gpus: int = 64, config=None,
                 workers: Optional[int] = None) -> list[Plan]:
    """Variants of the recipe that fit, fastest first (predicted tokens/s; lower peak breaks ties).

    Each keeps the global batch size. Single-GPU variants cross precision × activation checkpointing ×
    optimizer × micro batch; multi-GPU variants (DDP, FSDP) keep the recipe's precision. Micro batches
    between 1 and the recipe's own are interpolated from exact simulations at both ends (marked
    "interpolated"); everything else is simulated.
    """
    import os

    _refuse_image_to_text(recipe)
    config = config if config is not None else resolve_config(recipe)
    cuda = target.device == "cuda"
    workers = workers if workers is not None else min(4, os.cpu_count() or 1)
    g, m0 = recipe.global_batch_size, recipe.train.micro_batch_size
    micro = [m for m in (1, 2, 4, 8, 16, 32, 64) if m < m0 and m0 % m == 0 and g % m == 0]
    jobs: dict[str, tuple[Recipe, int]] = {}
    todo: list[tuple[str, dict, int, str, Any]] = []
    for precision in ("bf16-true", "bf16-mixed", "32-true"):
        for ckpt in (False, True):
            for optim in ("adamw", "sgd"):
                over = {"precision": precision, "train.activation_checkpointing": ckpt, "optim.name": optim,
                        "optim.momentum": 0.0}
                base = f"{precision}, {'ckpt' if ckpt else 'no ckpt'}, {optim}"
                r_hi = _variant_recipe(recipe, over)
                key_hi, key_lo = _sim_key(r_hi, m0), _sim_key(r_hi, 1)
                jobs[key_hi] = (r_hi, m0)
                todo.append((f"{base}, micro {m0} × acc {g // m0}", over, 1, "single", key_hi))
                # The recipe's own accumulation regime must hold at both ends for interpolation.
                if micro and (g // m0 >= 2):
                    jobs[key_lo] = (r_hi, 1)
                    for m in micro:
                        mo = {**over, "train.micro_batch_size": m, "train.accumulate_grad_batches": g // m,
                              "train.global_batch_size": None}
                        how = key_lo if m == 1 else (key_lo, key_hi, m)
                        tag = "" if m == 1 else " (interpolated)"
                        todo.append((f"{base}, micro {m} × acc {g // m}{tag}", mo, 1, "single", how))
    gpus = 2
    while gpus <= max_gpus:
        if g % gpus == 0:
            per = g // gpus
            m = max(d for d in range(1, min(m0, per) + 1) if per % d == 0)
            over = {"train.micro_batch_size": m, "train.accumulate_grad_batches": per // m,
                    "train.global_batch_size": None}
            r_g = _variant_recipe(recipe, over)
            key = _sim_key(r_g, m)
            jobs[key] = (r_g, m)
            for strategy in ("ddp", "fsdp"):
                todo.append((f"{recipe.precision}, {gpus} GPUs {strategy}, micro {m} × acc {per // m}", over, gpus,
                             strategy, key))
        gpus *= 2
    # Model states alone are a lower bound on the peak: variants whose states cannot fit are
    # dropped before any simulation (for a 70B model that is most single-GPU variants).
    n_evaluated = len(todo)
    numel = count_parameters(config)
    cap = target.capacity_bytes
    if cap is not None:
        def hopeless(r: Recipe, gpus: int, strategy: str) -> bool:
            return state_bytes_lower_bound(r, numel) / (gpus if strategy == "fsdp" else 1) > cap
        todo = [t for t in todo if not hopeless(_variant_recipe(recipe, t[1]), t[2], t[3])]
        needed = {k for t in todo for k in ((t[4][0], t[4][1]) if isinstance(t[4], tuple) else (t[4],))}
        jobs = {k: v for k, v in jobs.items() if k in needed}
    sims = _run_sims(jobs, config, cuda, workers)
    plans = []
    for label, over, gpus, strategy, how in todo:
        if isinstance(how, tuple):
            key_lo, key_hi, m = how
            sim = _interpolate(sims[key_lo], sims[key_hi], 1, m0, m)
        else:
            sim = sims[how]
        r = _variant_recipe(recipe, over)
        p = plan(r, Target(target.device, target.gpu, gpus, strategy), label, over, config, sim=sim)
        if p.fits is None or p.fits:
            plans.append(p)
    plans.sort(key=lambda p: (-(p.tokens_per_s or 0.0), p.peak_total))
    return Alternatives(plans, evaluated=n_evaluated)


# -- presentation -------------------------------------------------------------------------------------

def format_plan(p: Plan) -> str:
    unit, size = ("GiB", GIB) if p.peak_allocated >= GIB else ("MiB", 1024**2)

    def g(n):
        return "-" if n is None else f"{n / size:.2f}"

    cols = ("parameters", "gradients", "optimizer_device", "optimizer_cpu", "activations", "allocated",
            "peak_allocated")
    heads = ("params", "grads", "optim", "optim_cpu", "acts", "alloc", "peak")
    count = f"{p.parameters_total / 1e9:.2f} B" if p.parameters_total >= 1e8 else f"{p.parameters_total / 1e6:.2f} M"
    lines = [f"plan: {p.recipe_name} on {p.target}: {count} parameters",
             f"{'phase':<16}" + "".join(f"{h:>10}" for h in heads) + f"  ({unit}, predicted, per device)"]
    for ph in PHASES:
        if ph in p.phases:
            lines.append(f"{ph:<16}" + "".join(f"{g(p.phases[ph][c]):>10}" for c in cols))
    lines.append(f"peak allocated {p.peak_allocated / GIB:.2f} GiB"
                 + (f"; reserved ≈ {p.peak_reserved / GIB:.2f} GiB + context {p.overhead / GIB:.2f} GiB = "
                    f"{p.peak_total / GIB:.2f} GiB" if p.peak_reserved is not None else ""))
    if p.capacity is not None:
        verdict = "FITS" if p.fits else "OOM"
        lines.append(f"{verdict}: {p.peak_total / GIB:.2f} of {p.capacity / GIB:.2f} GiB "
                     f"({100 * p.peak_total / p.capacity:.0f}%, margin {FIT_MARGIN:.0%})")
    if p.step_time_s:
        lines.append(f"step ≈ {p.step_time_s:.3f} s, ≈ {p.tokens_per_s:,.0f} tokens/s "
                     f"({p.tokens_per_step:,} tokens per optimizer step)")
    for n in p.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def format_alternatives(plans: list[Plan], limit: int = 20) -> str:
    if not plans:
        return "no variant fits; try more GPUs (--gpus) or a larger card"
    lines = [f"{'#':>3} {'tokens/s':>11} {'peak GiB':>9}  variant"]
    for i, p in enumerate(plans[:limit], 1):
        tps = f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "-"
        lines.append(f"{i:>3} {tps:>11} {p.peak_total / GIB:>9.2f}  {p.variant}")
    if len(plans) > limit:
        lines.append(f"... {len(plans) - limit} more (--json lists all)")
    return "\n".join(lines)
