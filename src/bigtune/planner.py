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

Step time comes from the same simulated step: every operator it issues is recorded (roofline.py)
and priced on the target GPU, matmuls by their FLOPs and tile occupancy, everything else by its
bytes, the host's eager dispatch as a second queue; to that come what the simulation cannot see:
CPU-side optimizer updates and PCIe for offloading, and the communication between GPUs that compute
does not hide. Its efficiencies are assumptions too.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from unittest import mock
from typing import Any, Optional

import torch

from bigtune.memory import PHASES
from bigtune.recipe import Recipe, RecipeError, load_recipe

GIB = 1024**3
CONFIG_DIR = Path(__file__).resolve().parent / "assets" / "configs"
CATEGORIES = ("parameters", "gradients", "optimizer_device", "optimizer_cpu", "activations", "allocated",
              "peak_allocated", "phase_peak", "phase_peak_activations",
              "phase_peak_activations_late", "phase_gradients_pending_late")

# --- assumptions for CUDA targets (not seen by simulation; uncalibrated until GPU runs are committed) ---
CUDA_CONTEXT_BYTES = int(0.5 * GIB)   # CUDA context + cuBLAS/cuDNN handles outside PyTorch's allocator
RESERVED_OVER_ALLOCATED = 1.05        # caching-allocator fragmentation: reserved ≈ 1.05 × peak allocated
ZERO_ALTERNATIVE = "deepspeed_stage_3_offload"  # the DeepSpeed strategy --alternatives tries on several GPUs
CUBLAS_HANDLES = 2                    # cuBLAS workspaces a training step creates (see plan())
FIT_MARGIN = 0.02                     # keep 2 % of the card free before calling a plan FITS
# Not a safety margin but a statement of what the planner knows: its median absolute error on published
# GPU peaks is about 5 % (bench/results/published-cpu-2026-11-23.json, peak allocated 5.2 %). A plan whose
# need lies within this fraction of the card of the FITS line is called tight: either verdict may turn.
FIT_UNCERTAINTY = 0.05
HOST_UPDATE_GBS = 40.0                # GB/s a many-core CPU Adam streams through its state (assumed)
PCIE_GBS = 25.0                       # GB/s one direction, PCIe 4 x16 in practice (assumed)


class PlanError(ValueError):
    """The recipe cannot be planned as given (unknown model config, unsupported family...)."""


# -- model configs ------------------------------------------------------------------------------------

def bundled_config_path(name: str) -> Optional[Path]:
    p = CONFIG_DIR / (name.replace("/", "--") + ".json")
    return p if p.is_file() else None


def resolve_config(recipe: Recipe):
    """The model's HF config, from a preset, a local folder, a bundled copy, or the hub (in that order)."""
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
        d.pop("_bigtune_source", None)  # provenance note of a composed config, not a config key
        config = AutoConfig.for_model(d.pop("model_type"), **d)
        text = d.get("text_config") or {}
        if "tie_word_embeddings" in text:  # transformers 5 forces tying on a T5 sub-config; Flan-T5 unties
            config.text_config.tie_word_embeddings = text["tie_word_embeddings"]
        return config
    from bigtune.models import hub_kwargs

    try:
        return AutoConfig.from_pretrained(name, revision=model_cfg.revision,
                                          trust_remote_code=model_cfg.trust_remote_code, **hub_kwargs(name))
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
    matmul_numel: int     # elements of the nn.Linear weights
    block_numel: int = 0  # elements inside the repeated blocks FSDP shards one by one (the rest is the root)
    attention: tuple[str, ...] = ()  # SDPA kernels CUDA would pick (cuda_kernels.sdpa_backend); () on a CPU
    reserved: int = 0         # peak reserved by the CUDA caching allocator replayed over the step (0: not replayed)
    in_use: int = 0           # its peak bytes of segments holding a live block (what must fit; see allocator.py)
    # roofline.OpCounter rows of one micro-batch's forward and backward and of one optimizer update
    ops: dict = field(default_factory=dict)
    # FSDP with *-mixed computes on 16-bit copies of fp32 shards (_step_kind): the simulation's weights are
    # 16-bit, the real states are not. (simulated bytes, real bytes) of all weights and of the trainable
    # ones; () when the simulated weights are the real ones. See _shard's full_states.
    fsdp_upcast: tuple[int, ...] = ()
    fsdp_upcast_optimizer: bool = True  # False where the optimizer state does not follow the weights' dtype


@dataclass(frozen=True)
class Stack:
    """A run of repeated blocks whose depth the simulation shrinks and extrapolates.

    ``path`` is the depth attribute inside the config; ``period`` is the number of layers that repeat
    as one unit (BLIP-2's Q-Former alternates layers with and without cross-attention, so its unit is
    ``cross_attention_frequency`` layers).
    """
    path: tuple[str, ...]
    period: int = 1


def model_stacks(config) -> list[Stack]:
    """The repeated stacks of a model: one for a decoder LM; vision, Q-Former and the language model's
    stack(s) for BLIP-2 (a T5 language model has an encoder and a decoder stack)."""
    if getattr(config, "model_type", "") != "blip-2":
        return [Stack(("num_hidden_layers",))]
    out = [Stack(("vision_config", "num_hidden_layers")),
           Stack(("qformer_config", "num_hidden_layers"), int(getattr(config.qformer_config,
                                                                      "cross_attention_frequency", 1) or 1))]
    text = config.text_config
    if getattr(text, "is_encoder_decoder", False):
        out += [Stack(("text_config", "num_layers")), Stack(("text_config", "num_decoder_layers"))]
    else:
        out.append(Stack(("text_config", "num_hidden_layers")))
    return out


def get_depth(config, stack: Stack) -> int:
    obj = config
    for a in stack.path[:-1]:
        obj = getattr(obj, a)
    n = getattr(obj, stack.path[-1], None)
    if n is None and stack.path[-1] == "num_decoder_layers":  # T5: None means "as many as the encoder"
        n = obj.num_layers
    return int(n)


def set_depth(config, stack: Stack, n: int) -> None:
    obj = config
    for a in stack.path[:-1]:
        obj = getattr(obj, a)
    setattr(obj, stack.path[-1], n)


def total_blocks(config) -> int:
    """Repeated blocks in the whole model (FSDP wraps each one)."""
    return sum(get_depth(config, s) for s in model_stacks(config))


def _family(config) -> str:
    return "image-to-text" if getattr(config, "model_type", "") == "blip-2" else "causal-lm"


def _sim_precision(precision: str) -> str:
    # Fabric on a CPU turns 16-mixed into bf16-mixed; the byte counts are the same (2-byte copies).
    return "bf16-mixed" if precision == "16-mixed" else precision


def _synthetic_batch(recipe: Recipe, cfg, family: str, b_size: int, padded: bool) -> dict:
    """A full-length micro-batch shaped as the collators build it, with real (tiny) token ids: the
    loss normaliser needs a concrete target count; everything computed from it is fake."""
    from bigtune.stepmath import IGNORE_INDEX

    seq = recipe.data.max_seq_length
    g = torch.Generator().manual_seed(0)
    if family != "image-to-text":
        ids = torch.randint(3, cfg.vocab_size, (b_size, seq), generator=g)
        mask = torch.ones_like(ids)
        if padded:  # one padded row makes the model take the explicit-mask attention path, as a real batch does
            mask[-1, -1] = 0
        # a classifier's labels are one class per sample
        labels = torch.zeros(b_size, dtype=torch.long) if family == "sequence-classification" else ids.clone()
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "padded": padded}
    # image-to-text (see imagedata's token layout): <image>×q first, then the caption (OPT), or an
    # encoder input of <image>×q + EOS and the caption as decoder labels (T5).
    q, vc = int(cfg.num_query_tokens), cfg.vision_config
    image = torch.full((b_size, q), int(cfg.image_token_index))
    caption = torch.randint(3, min(cfg.text_config.vocab_size, int(cfg.image_token_index)), (b_size, seq), generator=g)
    # A shape only: simulate() swaps in a fake tensor (see there).
    pixels = torch.empty(b_size, int(getattr(vc, "num_channels", 3)), vc.image_size, vc.image_size)
    if getattr(cfg.text_config, "is_encoder_decoder", False):
        ids = torch.cat([image, torch.ones(b_size, 1, dtype=torch.long)], 1)
        dec = torch.cat([torch.zeros(b_size, 1, dtype=torch.long), caption[:, :-1]], 1)
        return {"pixel_values": pixels, "input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": caption,
                "decoder_input_ids": dec, "padded": padded}
    ids = torch.cat([image, caption], 1)
    labels = torch.cat([torch.full_like(image, IGNORE_INDEX), caption], 1)
    mask = torch.ones_like(ids)
    if padded:
        mask[-1, -1] = 0
    return {"pixel_values": pixels, "input_ids": ids, "attention_mask": mask, "labels": labels, "padded": padded}


def _keep_every_layer():
    """LayerDrop as transformers 5.17 writes it (OPT and others) draws ``torch.rand([])`` in every training
    forward and branches on the value, which a fake tensor does not have (the plan was unavailable for
    every OPT and BLIP-2 OPT model). Here a 0-dim draw is a known 1.0 (a constant fake tensor, which
    comparisons can read): no layer is ever dropped, the worst case a plan is for."""
    real = torch.rand

    def rand(*size, **kwargs):
        shape = size[0] if len(size) == 1 and isinstance(size[0], (list, tuple, torch.Size)) else size
        if len(shape) == 0:
            return torch.tensor(1.0, dtype=kwargs.get("dtype"))
        return real(*size, **kwargs)

    return mock.patch("torch.rand", rand)


def _no_init():
    """Skip weight initialisation (truncated-normal init branches on values, which fake tensors
    lack) but keep the rest of ``init_weights``: weight tying decides what memory exists."""
    return mock.patch("transformers.modeling_utils.PreTrainedModel.initialize_weights", lambda self: None)


def _matmul_numel(model: torch.nn.Module) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


@contextlib.contextmanager
def _quiet_lightning():
    """Lightning's info lines off for a while. Its rank-zero messages go through whichever of its
    packages was imported last (lightning.pytorch comes with `import lightning`), so quiet all of them."""
    loggers = [logging.getLogger(n) for n in ("lightning.fabric", "lightning.pytorch", "lightning_fabric")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def simulate(recipe: Recipe, config, depths: "int | dict[Stack, int]", cuda: bool,
             micro_batch: Optional[int] = None, padded: bool = False,
             arch: Optional[tuple[int, int]] = None, trace: bool = False) -> Sim:
    """Run one steady-state training step of ``recipe`` on fake tensors, with each repeated stack cut
    to ``depths`` blocks (an int sets every stack).

    The optimizer state is created first (one update with zero gradients), so the simulated step is
    like the engine's step 1 and later: its peak is the run's peak. On a CUDA target of compute
    capability ``arch`` (default 8.0), attention takes the math path wherever CUDA would
    (cuda_kernels). With ``trace`` (CUDA targets), ``Sim.reserved`` is the caching allocator's peak
    reserved over the weights and steps 0-2 (allocator.replay). Accumulation windows are
    simulated with two micro-batches: from the second one on, gradients are held during forward,
    and a third micro-batch repeats the second one's memory exactly.
    """
    from lightning.fabric import Fabric
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bigtune.cuda_kernels import cuda_attention, cuda_autocast, cuda_dropout
    from bigtune.engine import LoopState, train_step
    from bigtune.memory import LiveTensorTracker, MemoryMonitor
    from bigtune.models import _auto_class, apply_peft, compute_dtype, enable_activation_checkpointing, \
        freeze_parts, label_config, recast_parameters, weights_dtype
    from bigtune.optim import make_optimizer
    from bigtune.roofline import OpCounter, scale
    from bigtune.stepmath import target_token_count

    cfg = copy.deepcopy(config)
    for st in model_stacks(cfg):
        set_depth(cfg, st, depths if isinstance(depths, int) else depths[st])
    cfg.use_cache = False
    family = recipe.model.family
    if family == "image-to-text":
        cfg.text_config.use_cache = False
    if family == "sequence-classification":  # a head with the recipe's classes (2 when inferred at train time)
        for key, value in label_config(recipe.data.label_names or ["0", "1"]).items():
            setattr(cfg, key, value)
        if getattr(cfg, "pad_token_id", None) is None:
            cfg.pad_token_id = 0  # Llama-style heads look for padding; the simulated ids (>= 3) have none
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
    with _quiet_lightning():  # no "Using bfloat16 AMP" per simulation
        fabric = Fabric(accelerator="cpu", devices=1, precision=_sim_precision(r.precision))
    # The model is built directly in its storage dtype, so Fabric's module.to(dtype) is a no-op for
    # real tensors; on fake parameters torch would try (and fail) to swap them, so skip it.
    fabric._precision.convert_module = lambda module: module
    fabric._strategy.module_to_device = lambda module: None  # already on the (fake) CPU
    b_size = micro_batch or r.train.micro_batch_size
    k = min(r.accumulate, 2)
    # distinct storages, like distinct real micro-batches
    batches = [_synthetic_batch(r, cfg, family, b_size, padded) for _ in range(k)]
    if family == "sequence-classification":  # one label per sample: the loss is normalised by samples
        tokens = b_size * r.accumulate
    else:
        shift = family == "causal-lm" or not getattr(cfg.text_config, "is_encoder_decoder", False)
        tokens = int(target_token_count(batches[0]["labels"], shift)) * r.accumulate
    # transformers treats fake tensors as "tracing" and then keeps an explicit mask for packed
    # sequences, which the real run (one sequence per row, checked on real values) drops.
    no_packing = mock.patch("transformers.masking_utils.find_packed_sequence_indices", lambda position_ids: None)
    # peft moves new adapters to the base layer's device with module.to(); torch cannot swap fake
    # parameters, and everything here already lives on the one (fake) CPU: make it a no-op. No
    # dtype change goes through module.to() in the engine (Fabric's conversion is skipped there too).
    no_move = mock.patch("torch.nn.Module.to", lambda self, *a, **k: self)
    # Weight initialisers (truncated normal) branch on values, which fake tensors do not have.
    # arch given: choose attention kernels as CUDA on that GPU would (also on a CPU, for tests)
    on_cuda = arch if arch is not None else ((8, 0) if cuda else None)
    kernels = cuda_attention(on_cuda, bf16_is_fp16=recipe.precision == "16-mixed")
    # Gradient clipping takes its foreach kernels only for plain tensors; on a GPU it takes them (one
    # norm and one scale over all gradients, the same bytes as per tensor but far fewer launches).
    foreach_clip = mock.patch("torch.nn.utils.clip_grad._has_foreach_support",
                              lambda tensors, device: True) if cuda else contextlib.nullcontext()
    with FakeTensorMode(allow_non_fake_inputs=True), no_packing, no_move, _no_init(), _keep_every_layer(), \
            kernels as attention, foreach_clip, cuda_dropout(on_cuda is not None), \
            cuda_autocast(on_cuda is not None):
        model = _auto_class(family).from_config(cfg, dtype=weights_dtype(r.precision))
        model.config.use_cache = False
        if quantize in ("nf4", "fp4"):
            _emulate_4bit(model, compute_dtype(recipe.model, r.precision), r.model.upcast_unquantized)
        if family == "image-to-text":
            freeze_parts(model, r.model)
        model.train()
        if r.train.activation_checkpointing:
            enable_activation_checkpointing(model)
        if r.peft.method != "none":
            # A quantized base is simulated in its compute dtype; plan() then swaps in 4/8-bit bytes.
            model = apply_peft(model, r.peft, quantized=False, checkpointing=r.train.activation_checkpointing,
                               family=family)
        ds_cast, _, fsdp_mixed = _step_kind(r, r.strategy)
        if ds_cast:
            # DeepSpeed with bf16/fp16 casts the module it wraps (module.bfloat16()/half()): PEFT's fp32
            # adapters and BLIP-2's fp32 Q-Former become 16-bit, with no fp32 input copy per adapted layer.
            recast_parameters(model, weights_dtype(r.precision), lambda name, p: p.dtype == torch.float32)
        fsdp_upcast: tuple[int, ...] = ()
        if fsdp_mixed:
            # FSDP2's MixedPrecisionPolicy gathers every weight as a 16-bit copy of its shard, so the
            # forward and backward run autocast over 16-bit weights: no autocast copy of each weight,
            # a 16-bit residual stream, 16-bit norm outputs. Simulate that step on 16-bit weights and
            # keep both byte counts: the shards, gradients and optimizer state stay in the real dtypes.
            def nbytes(trainable: bool) -> int:
                return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not trainable)

            real = (nbytes(False), nbytes(True))
            low = torch.bfloat16 if r.precision.startswith("bf16") else torch.float16
            recast_parameters(model, low, lambda name, p: p.dtype == torch.float32)
            fsdp_upcast = (nbytes(False), real[0], nbytes(True), real[1])
        numel = sum(p.numel() for p in model.parameters())
        matmul_numel = _matmul_numel(model)
        from bigtune.dist import decoder_blocks

        try:
            block_numel = sum(p.numel() for blk in decoder_blocks(model) for p in blk.parameters())
        except ValueError:
            block_numel = 0
        for batch in batches:
            if "pixel_values" in batch:
                # Fake pixels: a real tensor would be really converted (Fabric casts float inputs), and
                # that parallel work starts OpenMP's threads, after which a forked worker hangs.
                batch["pixel_values"] = torch.empty(batch["pixel_values"].shape)
        wrapped = fabric.setup_module(model)
        opt = fabric.setup_optimizers(make_optimizer(r.optim, wrapped))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        built = SimpleNamespace(fabric=fabric, model=wrapped, optimizer=opt, scheduler=sched, recipe=r)
        # On a CUDA target every storage's birth and death is recorded from the weights on, through
        # a real step 0 (the optimizer state is then created where a GPU creates it: after a
        # backward), for the caching-allocator replay below.
        events: Optional[list] = [] if cuda and trace else None
        trace_mode = LiveTensorTracker(events=events) if events is not None else contextlib.nullcontext()
        if events is not None:
            trace_mode.track(list(wrapped.parameters()) + list(wrapped.buffers()))  # loaded in this order
        with trace_mode:
            if family == "image-to-text" or events is not None:
                # Some trainable weights get no gradient (BLIP-2 feeds its T5 encoder embeddings, so the
                # encoder's own token table is never used) and so no optimizer state: take a real step 0.
                train_step(built, batches, None, False, LoopState(step=0), tokens)
            else:  # every weight of a decoder LM is used: zero gradients create the same state, faster
                for p in wrapped.parameters():
                    if p.requires_grad:  # frozen (base) weights never get gradients
                        p.grad = torch.zeros_like(p)
                opt.step()
                if r.optim.zero_grad == "after_step":  # else they live into the next forward, as in the engine
                    opt.zero_grad(set_to_none=True)
            step1 = len(events) if events is not None else 0
            monitor = MemoryMonitor(torch.device("cpu"), round_to=512 if cuda else 1)
            state = LoopState(step=1)
            counter = OpCounter(state)  # what each kernel of the step costs (the time model)
            monitor.tracker.observer = counter.observe
            try:
                blocks = decoder_blocks(model)
            except ValueError:
                blocks = []
            hooks = monitor.follow_gradients(wrapped.parameters(), blocks)
            try:
                with warnings.catch_warnings():
                    # the block hooks fire on outputs alone where no block input needs a gradient (LoRA)
                    warnings.filterwarnings("ignore", message="Full backward hook is firing")
                    _, snaps = train_step(built, batches, monitor, True, state, tokens)
            finally:  # a failed simulation must not leave the tracker (and its eager compile stance) on
                monitor.end_step()
                for h in hooks:
                    h.remove()
    steady = {s.phase: {c: getattr(s, c) for c in CATEGORIES} for s in snaps}
    peak = max(s.peak_allocated for s in snaps)
    reserved = in_use = 0
    if events is not None:
        reserved, in_use = _replay_steady(events, step1)
    if quantize != "none":
        delta = quantized_parameter_delta(wrapped, quantize, recipe.model.double_quant, r.model.upcast_unquantized)
        for ph in steady.values():
            for c in ("parameters", "allocated", "peak_allocated", "phase_peak"):
                ph[c] += delta
        peak += delta
        # weights are whole long-lived blocks: the allocator holds about as much less
        reserved, in_use = (max(0, x + delta) if x else 0 for x in (reserved, in_use))
    if eight_bit:
        shapes = [p.numel() for p in wrapped.parameters() if p.requires_grad]
        extra = 0 if recipe.optim.name.startswith("paged") and cuda else eight_bit_state_bytes(shapes)
        for ph in steady.values():
            for c in ("optimizer_device", "allocated", "peak_allocated", "phase_peak"):
                ph[c] += extra
        peak += extra
        reserved, in_use = (x + extra if x else 0 for x in (reserved, in_use))
    # Rows per micro-batch: the step ran k of them (the accumulation window is scaled in _time).
    ops = scale(dict(counter.ops), ("forward", "backward"), 1 / len(batches))
    return Sim(steady, peak, numel, matmul_numel, block_numel, tuple(sorted(attention)), reserved, in_use, ops,
               fsdp_upcast, not eight_bit)


def _replay_steady(events: list, step1: int) -> tuple[int, int]:
    """(peak reserved, peak in-use segment bytes) of the CUDA caching allocator over the weights, step
    0, step 1 and a step 2 identical to step 1 (reserved can still grow once the cache holds step 1's
    pattern; it does not after that)."""
    from bigtune.allocator import replay

    step = events[step1:]
    born = {e[1]: e[2] for e in step if e[0] == "alloc"}
    freed = {e[1] for e in step if e[0] == "free"}
    # Storages that cross the step boundary (optim.zero_grad=before_backward: the gradients) are born in
    # one step and freed in the next. Step 2 frees step 1's where step 1 freed step 0's; a copy of step 1
    # alone would keep both. Paired in birth order among storages of the same size.
    heirs: dict[int, list[int]] = {}
    for k in sorted(k for k in born if k not in freed):
        heirs.setdefault(born[k], []).append(k)
    sizes = {e[1]: e[2] for e in events[:step1] if e[0] == "alloc"}
    heir = {}
    for k in sorted(e[1] for e in step if e[0] == "free" and e[1] not in born):
        if heirs.get(sizes.get(k)):
            heir[k] = heirs[sizes[k]].pop(0)
    offset = len(events)
    again = [(e[0], e[1] + offset, *e[2:]) if e[1] in born else ("free", heir[e[1]])
             for e in step if e[1] in born or e[1] in heir]
    stats = replay(events + again).stats
    return stats.peak_reserved, stats.peak_in_use


EIGHT_BIT = ("adam8bit", "adamw8bit", "paged_adamw8bit")


OUTPUT_HEADS = ("lm_head", "score", "classifier")  # output layers bitsandbytes loading leaves unquantized


def quantized_linears(model: torch.nn.Module):
    """(name, module) of the nn.Linear layers bitsandbytes quantizes: all but the output head, the
    adapters, and every (sub)model's _keep_in_fp32_modules (BLIP-2: the Q-Former and its queries; T5:
    the feed-forward output projections), matched by name component as transformers does."""
    keep = {k for m in model.modules() for k in (getattr(type(m), "_keep_in_fp32_modules", None) or ())}
    keep.update(OUTPUT_HEADS)
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear) or "lora_" in name or keep & set(name.split(".")):
            continue
        yield name, mod


def packed_weight_bytes(w: torch.Tensor, quantize: str, double_quant: bool) -> int:
    """Bytes of one linear weight after bitsandbytes loading: int8 = n + an fp32 scale per row; 4-bit =
    n/2 + one fp32 absmax per 64 weights (double quantization: a uint8 per 64 and an fp32 per 256 of
    those, + the 256-entry nested code) + the 16-entry fp32 NF4/FP4 code."""
    n = w.numel()
    if quantize == "int8":
        return n + w.shape[0] * 4
    blocks = -(-n // 64)
    return n // 2 + (blocks + 4 * -(-blocks // 256) + 1024 if double_quant else 4 * blocks) + 64


class _Fake4bitMatmul(torch.autograd.Function):
    """bitsandbytes' 4-bit matmul as memory sees it: the forward saves nothing but the (packed)
    weight, and the backward dequantizes the weight into a compute-dtype temporary for the input
    gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ weight.clone(), None, None


def _emulate_4bit(model: torch.nn.Module, compute: torch.dtype, upcast: bool = True) -> None:
    """Make a fake model behave like a QLoRA base for memory: peft's k-bit preparation (``upcast``,
    model.upcast_unquantized) keeps every weight that is not quantized in fp32 (so hidden states run
    in fp32 between the 4-bit matmuls), and each 4-bit layer casts its input to the compute dtype and
    its output back to the input's."""
    quantized = dict(quantized_linears(model))
    ids = {id(m.weight) for m in quantized.values()}
    for p in model.parameters():
        if upcast and id(p) not in ids and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.to(torch.float32)
    for mod in quantized.values():
        mod.weight.data = mod.weight.data.to(compute)

        def forward(x, mod=mod):
            bias = None if mod.bias is None else mod.bias.to(compute)
            return _Fake4bitMatmul.apply(x.to(compute), mod.weight, bias).to(x.dtype)

        mod.forward = forward


def quantized_parameter_delta(model: torch.nn.Module, quantize: str, double_quant: bool, upcast: bool = True) -> int:
    """Bytes that loading the base with bitsandbytes changes, relative to the simulated model.

    Every quantized nn.Linear (see quantized_linears) becomes 4-bit (n/2 bytes + one scale per 64
    weights: fp32, or uint8 with an fp32 scale per 256 scales under double quantization) or int8
    (n bytes + an fp32 scale per row); peft's k-bit preparation (``upcast``) casts the remaining 16-bit
    weights (embeddings, norms, head) to fp32. For 4-bit the simulation already ran that way
    (_emulate_4bit), so only the packed weights change here; int8 is analytic on top of a 16-bit
    simulation (its activations are under-counted: the real path keeps fp32 hidden states).
    """
    delta = 0
    quantized_ids = set()
    for name, mod in quantized_linears(model):
        w = mod.weight
        quantized_ids.add(id(w))
        delta += packed_weight_bytes(w, quantize, double_quant) - w.numel() * w.element_size()
    for name, p in model.named_parameters():
        if upcast and id(p) not in quantized_ids and "lora_" not in name and p.dtype in (torch.float16,
                                                                                       torch.bfloat16):
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


def simulate_full_depth(recipe: Recipe, config, cuda: bool, padded: bool = False,
                        micro_batch: Optional[int] = None, arch: Optional[tuple[int, int]] = None) -> Sim:
    """The step at the model's real depth, from simulations of shallow copies.

    Memory is linear in the depth of each repeated stack (every block adds the same parameters,
    states and saved activations), so one simulation with every stack at one unit of depth plus one
    per stack with that stack one unit deeper give each stack's per-block cost; the full model is
    the base plus each stack's cost times its extra depth. Small models are simulated as they are.
    """
    stacks = model_stacks(config)
    full = {st: get_depth(config, st) for st in stacks}
    if all(full[st] <= 2 * st.period for st in stacks):
        return simulate(recipe, config, full, cuda, micro_batch, padded, arch)
    unit = {st: min(st.period, full[st]) for st in stacks}
    # (Run one after the other on purpose: the first simulation of a process pays the lazy imports and
    # caches that every later one, and every worker forked later, reuses.)
    base = simulate(recipe, config, unit, cuda, micro_batch, padded, arch)
    grown = []
    for st in stacks:
        if full[st] > unit[st]:
            sim = simulate(recipe, config, {**unit, st: unit[st] + st.period}, cuda, micro_batch, padded, arch)
            grown.append((sim, (full[st] - unit[st]) / st.period))

    def ext(get) -> int:
        b0 = get(base)
        if b0 is None or any(get(sim) is None for sim, _ in grown):
            return None  # a measure not every simulation has (e.g. no gradient stored in that phase)
        return int(round(b0 + sum((get(sim) - b0) * times for sim, times in grown)))

    phases = {ph: {c: ext(lambda x, ph=ph, c=c: x.phases[ph][c]) for c in CATEGORIES} for ph in base.phases}
    # Max and extrapolation do not commute: which phase holds the step's peak can change with depth
    # (shallow, the logits' backward; deep, the optimizer's temporaries over all the weights). Each
    # phase's own high-water mark sits at the same point of the step at every depth, so it
    # extrapolates; the step's peak is the highest of them, and each phase's cumulative peak the
    # highest so far.
    running = 0
    for name in PHASES:
        if name in phases:
            ph = phases[name]
            running = max(running, ph["allocated"], ph["phase_peak"] or 0)
            ph["peak_allocated"] = max(ph["peak_allocated"], running)
    peak = max(ext(lambda x: x.peak_allocated), running)
    # Operator rows are linear in depth too (each block adds the same kernels); counts, FLOPs, bytes.
    keys = set(base.ops).union(*(sim.ops for sim, _ in grown))
    zero = (0, 0.0, 0.0)
    ops = {k: [max(0.0, base.ops.get(k, zero)[i] + sum((sim.ops.get(k, zero)[i] - base.ops.get(k, zero)[i]) * times
                                                       for sim, times in grown)) for i in range(3)]
           for k in keys}
    upcast = tuple(ext(lambda x, i=i: x.fsdp_upcast[i]) for i in range(len(base.fsdp_upcast)))
    return Sim(phases, peak, ext(lambda x: x.numel), ext(lambda x: x.matmul_numel), ext(lambda x: x.block_numel),
               base.attention, ext(lambda x: x.reserved), ext(lambda x: x.in_use), ops, upcast,
               base.fsdp_upcast_optimizer)


RESERVED_DEPTHS = (4, 8)  # units of depth per stack in the two traced simulations reserved is estimated from


def estimate_reserved(recipe: Recipe, config, sim: Sim, arch: Optional[tuple[int, int]],
                      padded: bool = False, micro_batch: Optional[int] = None,
                      workers: int = 1) -> tuple[int, int, list[str]]:
    """(peak reserved, peak in-use segment bytes, notes) on a CUDA device for the full-depth step
    ``sim``, from the caching allocator replayed over traced simulations (allocator.py).

    Which cached block each request reuses depends on the whole sequence, so reserved is not exactly
    linear in depth the way allocated bytes are: between 1 and 2 layers its increment can be off by
    half a layer's activations. Two deeper traced simulations (every stack at 4 and at 8 units) average
    that out. On TinyLlama shapes the estimate came within 3 % of a replay of the full-depth step
    (tests/test_allocator.py; within 1 % for bf16-true, bf16-mixed and checkpointing at 22 layers).
    """
    stacks = model_stacks(config)
    full = {st: get_depth(config, st) for st in stacks}

    def at(units: int) -> dict:
        return {st: min(full[st], units * st.period) for st in stacks}

    a_depths, b_depths = (at(u) for u in RESERVED_DEPTHS)
    how = f"caching-allocator replay of a step simulated {b_depths[stacks[-1]]} blocks deep"
    if b_depths == full:
        b = simulate(recipe, config, b_depths, True, micro_batch, padded, arch, trace=True)
        return b.reserved, b.in_use, [how.replace(f"{b_depths[stacks[-1]]} blocks deep", "at full depth")]
    args = [(recipe, config, d, True, micro_batch, padded, arch, True) for d in (a_depths, b_depths)]
    if workers > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("fork")) as ex:
            a, b = ex.map(_traced_sim, args)
    else:
        a, b = map(_traced_sim, args)

    def extrapolate(get) -> int:
        # Two extrapolations that err differently when reuse jumps between depths: growing with
        # allocated at the rate seen between the two depths, and the deeper one's ratio to allocated.
        # Each added block adds its own bytes; cached blocks can absorb a few blocks' growth between
        # the two traced depths (a slope below 1), never the growth of every block to full depth.
        slope = max(1.0, (get(b) - get(a)) / max(1, b.peak_allocated - a.peak_allocated))
        by_slope = get(b) + slope * (sim.peak_allocated - b.peak_allocated)
        by_ratio = sim.peak_allocated * get(b) / max(1, b.peak_allocated)
        return max(sim.peak_allocated, int((by_slope + by_ratio) / 2))

    reserved, in_use = extrapolate(lambda x: x.reserved), extrapolate(lambda x: x.in_use)
    return reserved, min(in_use, reserved), [f"reserved from a {how} and one {a_depths[stacks[-1]]} deep, "
                                             "extrapolated to full depth"]


def _traced_sim(args: tuple) -> Sim:
    return simulate(*args[:7], trace=args[7])


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


def run_strategy(strategy: str, gpus: int) -> str:
    """The strategy a recipe's ``strategy`` runs with on ``gpus`` devices, as a Target names it: DeepSpeed
    as given (also on one GPU, for offload), ddp/fsdp as given on several, auto/single → ddp on several
    (what the engine does), else single."""
    if strategy.startswith("deepspeed"):
        return strategy
    if gpus <= 1:
        return "single"
    return strategy if strategy in ("ddp", "fsdp") else "ddp"


def target_arch(target: "Target") -> Optional[tuple[int, int]]:
    """The compute capability a CUDA target's kernels are chosen for (None on a CPU)."""
    from bigtune.gpus import compute_capability

    return compute_capability(target.gpu) if target.device == "cuda" else None


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
    # What must fit the device (FITS/OOM): the allocator's in-use segments at the peak + context; less
    # than peak_total, which is what a device with room to spare ends up reserving.
    needed_total: Optional[int] = None
    # `plan --data-lengths` (datalengths.py): the data's longest sample, mean padded batch, mean tokens.
    data_lengths: Optional[dict] = None

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "tight": self.tight}

    @property
    def tight(self) -> bool:
        """FITS or OOM by less than the planner's typical error (FIT_UNCERTAINTY of the card)."""
        if self.capacity is None:
            return False
        need = self.needed_total or self.peak_total
        return abs(need - self.capacity * (1 - FIT_MARGIN)) <= FIT_UNCERTAINTY * self.capacity

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


def zero_masters(recipe: Recipe, strategy: str) -> bool:
    """DeepSpeed with a 16-bit precision keeps fp32 master weights and fp32 optimizer state.

    DeepSpeed casts the module to bf16/fp16 itself and runs no autocast, so for it "-mixed" and
    "-true" are the same step: 16-bit weights, activations and gradients; the ZeRO optimizer
    holds an fp32 copy of its partition of the weights, steps fp32 state on it (from an fp32 copy
    of the gradient partition) and writes the 16-bit weights back.
    """
    return strategy.startswith("deepspeed") and recipe.precision != "32-true"


def _step_kind(recipe: Recipe, strategy: str) -> tuple[bool, bool, bool]:
    """What ``strategy`` changes in the engine's single-device step: DeepSpeed with a 16-bit precision
    casts the whole module to 16 bits, which changes the step where some weights are fp32 (PEFT's fp32
    adapters, BLIP-2's fp32 Q-Former), the chunked loss is off under FSDP and DeepSpeed
    (engine.chunked_loss_head), and FSDP with a *-mixed precision computes on 16-bit gathered copies
    (dist.make_parallelize_fn). Equal kinds share one simulation."""
    sharded = strategy == "fsdp" or strategy.startswith("deepspeed")
    fp32_weights = (recipe.peft.method != "none" and recipe.peft.adapter_dtype == "float32") \
        or recipe.model.family == "image-to-text"
    fsdp_mixed = strategy == "fsdp" and recipe.precision.endswith("-mixed")
    return (zero_masters(recipe, strategy) and fp32_weights, bool(recipe.train.loss_chunk_tokens) and not sharded,
            fsdp_mixed)


def simulation_recipe(recipe: Recipe, strategy: str) -> Recipe:
    """The recipe whose single-device step the simulation runs for ``strategy``.

    Under DeepSpeed a 16-bit mixed precision runs as true 16-bit (see zero_masters), and an
    offloaded ZeRO always steps with DeepSpeed's CPU Adam (the engine allows nothing else there).
    Where the strategy changes the step itself (_step_kind), the copy carries it: simulate() reads it.
    """
    mixed = zero_masters(recipe, strategy) and recipe.precision.endswith("-mixed")
    adam = strategy.startswith("deepspeed") and strategy.endswith("_offload") and recipe.optim.name != "adamw"
    # ZeRO frees its gradients in its own step, whatever order optim.zero_grad asks for.
    late = strategy.startswith("deepspeed") and recipe.optim.zero_grad != "after_step"
    same_step = _step_kind(recipe, recipe.strategy) == _step_kind(recipe, strategy)
    if not (mixed or adam or late) and same_step:
        return recipe
    r = copy.deepcopy(recipe)
    r.strategy = strategy
    if mixed:
        r.precision = "bf16-true"  # fp16 and bf16 have the same sizes
    if adam:
        r.optim.name = "adamw"
    if late:
        r.optim.zero_grad = "after_step"
    return r


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


def _ddp_buckets(sim: Sim, phases: dict, notes: list[str], views_held: bool = False,
                 views: bool = True) -> tuple[dict, int, list[str]]:
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
    cumulative = {"before_forward": 0, "after_forward": fwd, "after_backward": max(fwd, bwd),
                  "after_optimizer": max(fwd, bwd, opt)}
    for name, ph in phases.items():
        extra = g_fwd if name in ("before_forward", "after_forward") else g_opt
        ph["allocated"] += extra
        ph["activations"] += extra
        ph["phase_peak"] = ph["phase_peak_activations"] = ph["phase_peak_activations_late"] = \
            ph["phase_gradients_pending_late"] = None
        ph["peak_allocated"] = max(ph["allocated"], cumulative.get(name, 0))
    if views:
        notes.append(f"ddp: gradient buckets {g / GIB:.2f} GiB alive from the wrap on (the gradients are views into "
                     "them after a synced backward; beside the step's memory during forward and backward)")
    else:
        notes.append(f"ddp: gradient buckets {g / GIB:.2f} GiB alive from the wrap on, a second copy of the gradients "
                     "(ddp_bucket_view=false); true makes the gradients views into them")
    return phases, max(fwd, bwd, opt), notes


def fsdp_unit_grad_elements(sim: Sim, trainable: int) -> int:
    """Gradient elements FSDP keeps for ``trainable`` trainable elements: exactly those under FSDP2,
    which shards parameter by parameter. (FSDP1 with use_orig_params gives a flat unit that holds any
    trainable weight a gradient for the whole unit: bench/published.py plans litgpt's 2023 runs so.)"""
    return trainable


def _shard(sim: Sim, recipe: Recipe, target: Target, n_layers: int) -> tuple[dict, int, list[str]]:
    """Per-device phases and peak for several GPUs (analytic on top of the 1-device simulation)."""
    if target.gpus <= 1 and not target.strategy.startswith("deepspeed") and not sim.fsdp_upcast:
        return sim.phases, sim.peak_allocated, []
    n = target.gpus
    notes = [f"{n} GPU(s) with {target.strategy}: planned analytically from the 1-GPU simulation"]
    split, moved = shard_layout(target.strategy)
    zero_offload = target.strategy.startswith("deepspeed") and "optimizer_device" in moved
    if target.device != "cuda":
        moved = set()  # on a CPU, "offloaded" state shares the one memory (and the engine counts it so)
    phases = copy.deepcopy(sim.phases)
    if not split:
        # The CPU tracker registers parameters, gradients and optimizer state, not the reducer's buckets
        # (born at the wrap, invisible while no .grad views them), so a CPU plan leaves them out as the
        # CPU measurement does; CUDA's allocator counts every byte.
        if target.strategy == "ddp" and target.device == "cuda":
            return _ddp_buckets(sim, phases, notes,
                                views_held=recipe.optim.zero_grad == "before_backward" and recipe.accumulate == 1,
                                views=recipe.ddp_bucket_view)
        return phases, sim.peak_allocated, notes
    es = 4 if recipe.precision == "32-true" else 2
    gather = gathered_after_forward = bucket = persistent_bucket = 0
    deepspeed = target.strategy.startswith("deepspeed")
    flat = target.strategy == "fsdp" and recipe.fsdp_wrap == "none"  # one FSDP unit: the whole model
    if "parameters" in split:
        # Each rank all-gathers one block's full parameters at a time (two in flight with prefetch)
        # and reduce-scatters its gradients block by block; the root's own weights (embeddings, final
        # norm, head) stay gathered from the root's forward through its backward: FSDP2 never
        # reshards the root after its forward, nor (fsdp_sharding=grad_op) any block. With
        # fsdp_wrap=none the root is everything. ZeRO-3 releases every gather after its use.
        per_block = sim.block_numel / max(1, n_layers) if sim.block_numel else sim.numel / max(1, n_layers)
        root = max(0, sim.numel - sim.block_numel) if sim.block_numel else per_block
        if flat:
            gather = gathered_after_forward = int(sim.numel * es)
        else:
            gather = int((root + 2 * per_block) * es)
            gathered_after_forward = gather if deepspeed else int(
                (root + (n_layers * per_block if recipe.fsdp_sharding == "grad_op" else 0)) * es)
    if deepspeed:
        from bigtune.dist import BUCKET_ELEMENTS

        # ZeRO reduces gradients through buckets of reduce_bucket_size elements (capped by the model):
        # ZeRO-3 keeps one for the whole run; ZeRO-2 allocates its buckets for each backward and
        # frees them after it. (ZeRO-2 with overlap_comm asks for two, but meanwhile frees each
        # weight's gradient once copied: one bucket's worth matched 2-rank runs, two overshot by 10 %.)
        # ZeRO-3's all-gathered weights live only from a block's forward to its backward.
        one = min(BUCKET_ELEMENTS, sim.numel) * es
        if "parameters" in split:
            persistent_bucket = one
        else:
            bucket = one
    masters = zero_masters(recipe, target.strategy)
    trainable = sim.phases["after_backward"]["gradients"] // es  # elements that get gradients
    offload = "optimizer_device" in moved
    # ZeRO-2 keeps a gradient partition from backward to the step; ZeRO-3 one persistent flat
    # buffer; with the optimizer offloaded, reduced gradients go straight to pinned fp32 host memory.
    grads_persist = deepspeed and ("parameters" in split or zero_offload)
    persistent_grads = 4 * trainable if zero_offload else es * trainable
    fsdp = target.strategy == "fsdp"
    grad_elements = fsdp_unit_grad_elements(sim, trainable) if fsdp else trainable
    # fsdp_grad_sync=step: every rank holds every unsharded gradient (fp32 under *-mixed, FSDP2 accumulates
    # in the reduce dtype) from the window's first backward until the last one reduce-scatters them.
    window_grads = grad_elements * (4 if recipe.precision.endswith("-mixed") else es) \
        if fsdp and recipe.fsdp_grad_sync == "step" and recipe.accumulate > 1 else 0

    def full_states(ph: dict) -> dict[str, int]:
        """The model states of one unsharded device under this strategy's precision handling."""
        st = {c: ph[c] for c in STATES}
        if sim.fsdp_upcast:
            # FSDP *-mixed: simulated on 16-bit weights; the shards, their gradients (reduced in fp32,
            # kept in the weights' dtype) and the optimizer state are in the real (fp32) dtypes.
            sim_all, real_all, sim_train, real_train = sim.fsdp_upcast
            st["parameters"] += real_all - sim_all
            st["gradients"] = -(-st["gradients"] * real_train // max(1, sim_train))
            if sim.fsdp_upcast_optimizer:
                st["optimizer_device"] = -(-st["optimizer_device"] * real_train // max(1, sim_train))
        if grad_elements != trainable and st["gradients"]:
            st["gradients"] = grad_elements * es  # whole units' gradients (fsdp_unit_grad_elements)
        if grads_persist:
            st["gradients"] = persistent_grads
        if masters:
            # fp32 state: twice the simulated 16-bit optimizer state, plus the fp32 master weights
            st["optimizer_device"] = 2 * ph["optimizer_device"] + 4 * trainable
        return st

    def on_device(st: dict, c: str) -> int:
        if c in moved or (c == "gradients" and deepspeed and offload):
            return 0
        return -(-st[c] // n) if c in split else st[c]

    def device_states(ph: dict) -> int:
        st = full_states(ph)
        return sum(on_device(st, c) for c in STATES)

    def states(ph: dict) -> int:
        return sum(ph[c] for c in STATES)

    f, b_, o = (sim.phases[x] for x in ("after_forward", "after_backward", "after_optimizer"))
    # the last micro-batch's forward holds the window's unsharded gradients, not shards of them
    fwd_grads = window_grads - on_device(full_states(f), "gradients") if window_grads else 0

    # Split each phase's high-water mark into model states (sharded / offloaded) and the rest.
    # The forward peaks at its end (logits and loss), where FSDP holds only what stays gathered.
    fwd = device_states(f) + fwd_grads + _transient_high(f) + gathered_after_forward + persistent_bucket
    if target.strategy == "fsdp" and "parameters" in split:
        # The root's first all-gather (the whole model with fsdp_wrap=none): NCCL's output buffer, the
        # unsharded weights it is copied into and this rank's input shard, before any activation.
        first = gathered_after_forward
        fwd = max(fwd, device_states(f) + 2 * first + -(-first // n))
    if flat:
        # Measured (CPU, gloo, 2 ranks, micro-batches 2-8): the forward of one flat unit peaks a whole
        # model's gathered size above its own end, whatever the batch; per-block units do not. Where
        # FSDP2 allocates it is not identified, and it is not yet checked on a GPU.
        fwd = max(fwd, device_states(f) + (f["allocated"] - states(f)) + 2 * gathered_after_forward
                  + persistent_bucket)
    # The backward has two highs. At its start (the loss and the logits' gradient, before any weight's
    # gradient is stored) the states are the forward's and only what the forward left gathered is
    # there; from the first stored gradient on, blocks are gathered and reduced one by one and at most
    # all of this rank's gradient shards exist.
    bwd_start = device_states(f) + fwd_grads + _transient_high(b_) + gathered_after_forward + persistent_bucket
    late = _transient_high(b_, late=True)
    pending = b_.get("phase_gradients_pending_late") or 0
    if flat:
        # One unit: every gradient stays unsharded until the backward ends, growing as in the simulation
        # (so its late high, gradients included, with the whole model gathered); FSDP2 then frees the
        # gathered weights and copies the gradients into one reduce-scatter input (fp32 for *-mixed).
        unsharded = trainable * es
        scatter_in = trainable * (4 if recipe.precision.endswith("-mixed") else es)
        bwd = max(device_states(f) + late + max(0, unsharded - pending) + gather,
                  device_states(b_) + unsharded + scatter_in)
    else:
        if "gradients" in split and not grads_persist:
            # Not every gradient shard exists yet at that high: each rank lacks 1/n of those to come.
            late -= pending // n
        # fsdp_grad_sync=step: the unsharded gradients until each unit reduces them (then its shards
        # replace them): at most all of them and no shard.
        shards = on_device(full_states(b_), "gradients") if window_grads else 0
        bwd = device_states(b_) - shards + window_grads + late + gather + bucket + persistent_bucket
    bwd = max(bwd_start, bwd)
    # The optimizer's temporaries are proportional to the state it updates: its shard, on the CPU if offloaded.
    update_tmp = 0 if "optimizer_device" in moved else -(-_transient_high(o) // n)
    if masters and "optimizer_device" not in moved:
        # The update runs on fp32 state (temporaries twice the size) from an fp32 copy of the
        # gradient partition, made while the 16-bit partition still exists.
        update_tmp = 2 * update_tmp + -(-4 * trainable // n)
    opt = device_states(o) + update_tmp + persistent_bucket
    peak = max(fwd, bwd, opt)
    # Each phase's peak is the highest point of the step so far.
    cumulative = {"after_forward": fwd, "after_backward": max(fwd, bwd), "after_optimizer": peak}
    for name, ph in phases.items():
        full = states(ph)
        st = full_states(ph)
        cpu = st["optimizer_device"] if offload else 0
        if deepspeed and offload:
            cpu += persistent_grads  # the fp32 gradient partition the CPU update reads, pinned in host RAM
        for c in STATES:
            ph[c] = on_device(st, c)
        if deepspeed and not grads_persist and name in ("before_forward", "after_optimizer"):
            ph["gradients"] = 0  # ZeRO-2 frees its gradient partition in the step
        ph["optimizer_cpu"] += -(-cpu // n)
        # Buffers alive at this phase boundary: what the forward leaves gathered, until the backward
        # reshards it; ZeRO-3 keeps its bucket throughout.
        live = (gathered_after_forward if name == "after_forward" else 0) + persistent_bucket
        if name == "after_forward" and fwd_grads:
            ph["gradients"] += fwd_grads
        ph["allocated"] += states(ph) - full + live
        ph["activations"] += live
        ph["phase_peak"] = ph["phase_peak_activations"] = ph["phase_peak_activations_late"] = \
            ph["phase_gradients_pending_late"] = None  # not meaningful after the analytic split
        ph["peak_allocated"] = max(ph["allocated"], cumulative.get(name, 0))
    what = " and ".join(sorted(split))
    notes.append(f"{target.strategy}: {what} / {n}; + {(gather + bucket + persistent_bucket) / GIB:.2f} GiB "
                 "gather/reduce buffers")
    if window_grads:
        notes.append(f"fsdp_grad_sync=step: {window_grads / GIB:.2f} GiB of unsharded gradients on every rank "
                     f"through each window of {recipe.accumulate} micro-batches; micro_batch keeps only shards")
    if flat:
        notes.append(f"fsdp_wrap=none: one FSDP unit, the whole model ({gather / GIB:.2f} GiB) gathered from the "
                     f"forward through the backward and every gradient unsharded before one reduce-scatter; "
                     "fsdp_wrap=block gathers and reduces one decoder block at a time")
    if masters:
        notes.append(f"{target.strategy} with {recipe.precision}: 16-bit weights and gradients, fp32 master "
                     "weights and optimizer state (DeepSpeed's mixed precision; no autocast)")
    if moved:
        notes.append(f"{target.strategy}: {' and '.join(sorted(moved))} held in CPU RAM (not in device memory)")
    return phases, peak, notes


def _time(recipe: Recipe, sim: Sim, target: Target) -> tuple[Optional[float], Optional[float], list[str]]:
    """(step seconds, tokens/s over all devices, notes): the simulated step's kernels priced on the
    target GPU (roofline.py), plus what the simulation cannot see: CPU-side optimizer updates, PCIe
    traffic of offloading and the gradient all-reduce/reduce-scatter between GPUs."""
    from bigtune.roofline import step_seconds, scale

    tokens = recipe.train.micro_batch_size * recipe.data.max_seq_length * recipe.accumulate
    if target.gpu is None:
        return None, None, []
    if not sim.ops:
        return None, None, ["time: this simulation recorded no operators"]
    states = sim.phases["after_backward"]
    split, moved = shard_layout(target.strategy)
    host = states.get("optimizer_cpu", 0)
    if "optimizer_device" in moved:  # ZeRO offload: each process updates its shard on the CPU
        host += states["optimizer_device"] / target.gpus
    # Each device runs the whole window's micro-batches; its update covers its shard of the weights,
    # or none of them when the CPU updates (priced below instead).
    opt_share = 0.0 if host else 1.0 / target.gpus if "optimizer_device" in split else 1.0
    ops = scale(scale(sim.ops, ("forward", "backward"), recipe.accumulate), ("optimizer",), opt_share)
    half = "fp16" if recipe.precision.startswith("16") else "bf16"
    try:
        t = step_seconds(ops, target.gpu, half)
    except ValueError as exc:
        return None, None, [f"time: {exc}; no step time"]
    t_opt = 0.0
    if host:
        # CPU-offloaded update: the CPU reads and writes its state once, gradients go down and the
        # updated weights come back over PCIe (both assumed rates, see the constants).
        shard = target.gpus if "gradients" in split else 1
        t_opt += 2 * host / (HOST_UPDATE_GBS * 1e9) + \
            (states["gradients"] + states["parameters"]) / shard / (PCIE_GBS * 1e9)
    t_comm = _exposed_communication(recipe, target, states, t)
    step = t["step_s"] + t_opt + t_comm
    host_bound = t["host_s"] > t["device_s"]
    notes = [
        f"time: roofline over the simulated step's kernels, forward {t['forward_s']:.3g} s, backward "
        f"{t['backward_s']:.3g} s, optimizer {t['optimizer_s']:.3g} s of GPU time against {t['host_s']:.3g} s of "
        f"host dispatch (the {'host (eager dispatch)' if host_bound else 'GPU'} bounds the step); "
        f"+ {t_opt:.3g} s CPU update/PCIe, {t_comm:.3g} s communication not hidden by compute "
        "(efficiencies assumed, uncalibrated: roofline.py)"]
    if host_bound:
        notes.append("time: the GPU waits for Python to issue kernels: a larger micro-batch (same global batch) or "
                     "train.compile (fewer, fused kernels) would keep it busier")
    return step, tokens * target.gpus / step, notes


DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket: the last one is reduced after backward ends


def _exposed_communication(recipe: Recipe, target: Target, states: dict, t: dict) -> float:
    """Seconds of gradient/parameter traffic between the GPUs that compute does not hide.

    Ring collectives move (n−1)/n of the bytes per GPU each way (an all-reduce twice that), at one
    direction of the catalog's bidirectional link. What runs where, per accumulation window of k
    micro-batches (gradients are synced only on the last one, dist.micro_batch_context):
    * DDP: one all-reduce of the gradients, overlapped with the last micro-batch's backward except its
      last bucket;
    * FSDP and ZeRO-3: the parameters gathered for every micro-batch's forward and again for its
      backward (FSDP with fsdp_sharding=grad_op: once), the gradients reduce-scattered on every
      micro-batch (each keeps only its partition; fsdp_grad_sync=step: on the last one only),
      overlapped with that micro-batch's forward and backward (prefetching); with fsdp_wrap=none
      nothing overlaps: the one unit is gathered before the forward starts and reduced after the
      backward ends;
    * ZeRO-2: gradients reduce-scattered after every micro-batch's backward (overlapped with it) and
      the updated parameters all-gathered once after the step (not overlapped).
    """
    n = target.gpus
    if n <= 1 or not target.gpu.interconnect_gbs:
        return 0.0
    bw = target.gpu.interconnect_gbs / 2 * 1e9
    f = (n - 1) / n
    grads, params = states["gradients"], states["parameters"]
    k = recipe.accumulate
    fwd, bwd = t["forward_s"] / k, t["backward_s"] / k  # one micro-batch's GPU time
    strategy = target.strategy
    if strategy == "ddp":
        reduce = 2 * f * grads / bw
        return max(0.0, reduce - bwd) + 2 * f * min(grads, DDP_BUCKET_BYTES) / bw
    if strategy == "fsdp" or strategy.startswith("deepspeed_stage_3"):
        fsdp = strategy == "fsdp"
        gathers = 1 if fsdp and (recipe.fsdp_sharding == "grad_op" or recipe.fsdp_wrap == "none") else 2
        gather, scatter = gathers * f * params / bw, f * grads / bw
        # fsdp_grad_sync=step: the reduce-scatter only on the window's last micro-batch
        every = 1 if fsdp and recipe.fsdp_grad_sync == "step" else k
        if fsdp and recipe.fsdp_wrap == "none":
            return k * gather + every * scatter
        return (k - every) * max(0.0, gather - fwd - bwd) + every * max(0.0, gather + scatter - fwd - bwd)
    if strategy.startswith("deepspeed"):  # ZeRO-1/2: reduce every micro-batch, gather the new weights once
        return k * max(0.0, f * grads / bw - bwd) + f * params / bw
    return 0.0


def plan(recipe: Recipe, target: Target, variant: str = "recipe", overrides: Optional[dict] = None,
         config=None, sim: Optional[Sim] = None, padded: bool = False, workers: int = 1,
         replay: bool = True, sims: Optional[dict[str, Sim]] = None) -> Plan:
    """Predict one recipe on one target, for full-length micro-batches of max_seq_length tokens.

    ``sim`` reuses a simulation of the same single-device step (reserved then comes from a fixed
    ratio instead of an allocator replay); ``padded`` plans batches that hold padding (the attention
    then gets an explicit mask, which can cost more on some kernels). ``workers`` > 1 runs the
    replay's two simulations in forked processes (never after CUDA is initialised); ``replay=False``
    skips the allocator replay (reserved then from the fixed ratio: for callers that need only the
    allocated categories). ``sims``: the simulation made here is added under its _sim_key, for
    alternatives() of the same recipe and target to reuse.
    """
    t0 = time.perf_counter()
    config = config if config is not None else resolve_config(recipe)
    cuda = target.device == "cuda"
    sim_recipe = simulation_recipe(recipe, target.strategy)
    own_sim = sim is None
    if own_sim:
        sim = simulate_full_depth(sim_recipe, config, cuda, padded=padded, arch=target_arch(target))
        if sims is not None and not padded:
            sims[_sim_key(sim_recipe, sim_recipe.train.micro_batch_size)] = sim
    phases, peak, notes = _shard(sim, recipe, target, total_blocks(config))
    if "math" in sim.attention:
        notes.append("attention: no fused CUDA kernel takes these inputs on this GPU (cuda_kernels.sdpa_backend), "
                     "so SDPA runs its math path: fp32 scores of seq × seq per head saved in every layer")
    if sim_recipe.optim.name != recipe.optim.name:
        notes.append(f"{target.strategy} steps with DeepSpeed's CPU Adam, not optim.name={recipe.optim.name}: "
                     "planned with Adam state")
    simulated_host = max((ph.get("optimizer_cpu", 0) for ph in sim.phases.values()), default=0)
    if cuda and simulated_host:
        # The simulation runs on one (fake) CPU, where an offloading optimizer's state shares the
        # memory counters; on a GPU it lives in host RAM, so it leaves the device's allocated and peak.
        # (State that _shard moves off the device for ZeRO offload was never counted there.)
        phases = copy.deepcopy(phases)
        for name, ph in phases.items():
            for c in ("allocated", "peak_allocated", "phase_peak"):
                if ph.get(c) is not None:
                    ph[c] -= sim.phases[name].get("optimizer_cpu", 0)
        peak -= simulated_host
    host = max((ph.get("optimizer_cpu", 0) for ph in phases.values()), default=0)
    if cuda and host:
        notes.append(f"optimizer state in host RAM: {host / GIB:.2f} GiB per process (not in the device peak)")
    if recipe.model.quantize != "none":
        from bigtune.models import weights_dtype

        fp32_hidden = recipe.model.upcast_unquantized or weights_dtype(recipe.precision) == torch.float32
        if recipe.model.quantize != "int8":
            how = (f"; 4-bit matmuls emulated ({'fp32' if fp32_hidden else '16-bit'} hidden states, dequantized "
                   "weight in backward)")
        elif fp32_hidden:
            how = "; activations from a 16-bit simulation (the int8 path keeps fp32 hidden states: expect more)"
        else:
            how = ""
        notes.append(f"{recipe.model.quantize} base: packed weight bytes analytic{how}")
    if recipe.optim.in_backward:
        notes.append("optim.in_backward: each weight steps inside the backward and its gradient is freed at once "
                     "(no full set of gradients; its optimizer kernels are timed in the backward)")
    if sim_recipe.optim.zero_grad == "before_backward":
        held = phases["before_forward"]["gradients"]
        notes.append(f"optim.zero_grad=before_backward (Lightning Trainer's order): the last step's gradients, "
                     f"{held / GIB:.2f} GiB per device, live through the next forward; after_step frees them first")
    if recipe.train.compile:
        notes.append("train.compile: planned as the eager step (compiled blocks usually save fewer intermediates for "
                     "backward, so expect the same or less activation memory; on the CPU, measured steps run eager)")
    if cuda:
        # Forward runs on the main thread and backward on autograd's device thread: two cuBLAS handles
        # on one stream, each with its own workspace from the caching allocator, alive from step 0 on.
        from bigtune.gpus import cublas_workspace_bytes

        workspaces = CUBLAS_HANDLES * cublas_workspace_bytes(target.gpu)
        phases = copy.deepcopy(phases)
        for ph in phases.values():
            for c in ("activations", "allocated", "peak_allocated"):
                ph[c] += workspaces
        peak += workspaces
        notes.append(f"cuBLAS workspaces {workspaces / 2**20:.0f} MiB ({CUBLAS_HANDLES} handles: forward and "
                     "autograd threads) included under activations")
        cap = target.capacity_bytes
        if replay and own_sim and not simulated_host and not (cap is not None and peak > cap):
            # The single-device step replayed through the caching allocator; several devices keep its
            # reserved/allocated ratio (their sharded peak is analytic).
            replayed, in_use, how = estimate_reserved(sim_recipe, config, sim, target_arch(target), padded,
                                                      workers=workers)
            if target.gpus <= 1 and not target.strategy.startswith("deepspeed"):
                reserved, needed = replayed + workspaces, in_use + workspaces
            else:
                ratio = replayed / max(1, sim.peak_allocated)
                reserved, needed = int(peak * ratio), int(peak * in_use / max(1, sim.peak_allocated))
                how = [f"reserved/allocated ratio {ratio:.3f} of the unsharded step (" + how[0] + ")"]
            notes.extend(how)
            notes.append(f"FITS/OOM by the {needed / GIB:.2f} GiB of segments in use at the peak: near the capacity "
                         "PyTorch frees its wholly cached segments and retries, so the rest of reserved need not fit")
            if not recipe.data.packing:
                notes.append("reserved replays full-length batches only; batches padded to their longest sample "
                             "change shape each step and reserved creeps above this over a run (not what must "
                             "fit: bench/varlen_reserved.py)")
        else:  # variants of --alternatives, CPU-offloaded optimizers, certain OOMs: a fixed ratio, assumed
            reserved = needed = int(peak * RESERVED_OVER_ALLOCATED)
            notes.append(f"reserved ≈ {RESERVED_OVER_ALLOCATED} × peak allocated (assumed, not replayed)")
        overhead = CUDA_CONTEXT_BYTES
        notes.append(f"CUDA context {CUDA_CONTEXT_BYTES / GIB:.1f} GiB is an assumption until calibrated on GPU "
                     "runs; the allocator replay has not been checked against a GPU yet")
    else:
        reserved, overhead = None, 0
        needed = peak
    total = (reserved if reserved is not None else peak) + overhead
    cap = target.capacity_bytes
    fits = None if cap is None else needed + overhead <= cap * (1 - FIT_MARGIN)
    step, tps, tnotes = _time(recipe, sim, target)
    out = Plan(recipe_name=recipe.name, target=target.label(), variant=variant, phases=phases, peak_allocated=peak,
                peak_reserved=reserved, overhead=overhead, peak_total=total, capacity=cap, fits=fits,
                needed_total=needed + overhead,
                parameters_total=sim.numel, step_time_s=step, tokens_per_s=tps,
                tokens_per_step=recipe.train.micro_batch_size * recipe.data.max_seq_length * recipe.accumulate
                * target.gpus, notes=notes + tnotes, overrides=overrides or {},
                plan_seconds=time.perf_counter() - t0)
    return out


# -- alternatives -------------------------------------------------------------------------------------

def count_parameters(config, family: Optional[str] = None) -> int:
    """Parameter count from the config alone (fake shallow models, extrapolated per stack)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bigtune.models import _auto_class

    stacks = model_stacks(config)
    full = {st: get_depth(config, st) for st in stacks}
    unit = {st: min(st.period, full[st]) for st in stacks}

    def count(depths: dict) -> int:
        cfg = copy.deepcopy(config)
        for st, n in depths.items():
            set_depth(cfg, st, n)
        with FakeTensorMode(), _no_init():
            return sum(p.numel() for p in _auto_class(family or _family(cfg)).from_config(cfg).parameters())

    base = count(unit)
    total = base
    for st in stacks:
        if full[st] > unit[st]:
            total += (count({**unit, st: unit[st] + st.period}) - base) * (full[st] - unit[st]) // st.period
    return total


def state_bytes_lower_bound(r: Recipe, numel: int) -> int:
    """Parameters + gradients + optimizer state bytes: memory no step can go below."""
    from bigtune.models import weights_dtype

    es = torch.empty((), dtype=weights_dtype(r.precision)).element_size()
    if r.model.quantize != "none":
        return numel // 2 if r.model.quantize != "int8" else numel
    if r.peft.method != "none" or r.model.family == "image-to-text":
        return numel * es  # adapters / frozen parts: only the weights are certain
    opt = {"adamw": 2.0, "sgd": 1.0 if r.optim.momentum else 0.0}.get(r.optim.name, 0.0)
    if r.optim.name in EIGHT_BIT:
        opt = 2.0 / es  # two 1-byte moments per element
    return int(numel * es * (1 + (not r.optim.in_backward) + opt))  # in_backward: no full set of gradients


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
    return Sim(phases, f(lo.peak_allocated, hi.peak_allocated), lo.numel, lo.matmul_numel, lo.block_numel,
               lo.attention, f(lo.reserved, hi.reserved), f(lo.in_use, hi.in_use), ops, lo.fsdp_upcast,
               lo.fsdp_upcast_optimizer)


def _sim_key(r: Recipe, micro: int) -> str:
    """Simulations depend only on these; variants that agree on them share one."""
    k = r.global_batch_size // (micro * r.devices) if r.train.global_batch_size else r.accumulate
    return json.dumps([r.precision, r.train.activation_checkpointing, r.optim.name, r.optim.momentum,
                       r.optim.implementation, r.optim.in_backward, r.data.max_seq_length, micro, min(k, 2),
                       r.peft.method, r.peft.adapter_dtype, r.model.quantize, r.model.upcast_unquantized,
                       r.optim.zero_grad, _step_kind(r, r.strategy)])


def _run_sims(jobs: dict[str, tuple[Recipe, int]], config, cuda: bool, workers: int,
              arch: Optional[tuple[int, int]] = None) -> dict[str, Sim]:
    """Simulate every (recipe, micro batch) job, in parallel worker processes when there are several cores."""
    if workers > 1 and len(jobs) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        # fork: the children inherit the imported libraries instead of importing them again (seconds).
        # Adapter jobs need peft, which this process may not have imported (≈2 s with bitsandbytes
        # installed): they go to one worker as one task, submitted first, so only one child pays for it.
        import sys

        grouped = [k for k, (r, _) in jobs.items() if r.peft.method != "none"] if "peft" not in sys.modules else []
        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("fork")) as ex:
            group = ex.submit(_sim_group, [(k, *jobs[k]) for k in grouped], config, cuda, arch) if grouped else None
            futs = {k: ex.submit(_sim_job, r, config, cuda, m, arch) for k, (r, m) in jobs.items() if k not in grouped}
            out = {k: f.result() for k, f in futs.items()}
            return {**out, **(group.result() if group is not None else {})}
    return {k: _sim_job(r, config, cuda, m, arch) for k, (r, m) in jobs.items()}


def _sim_group(items: list, config, cuda: bool, arch: Optional[tuple[int, int]]) -> dict[str, Sim]:
    return {k: _sim_job(r, config, cuda, m, arch) for k, r, m in items}


def _sim_job(recipe: Recipe, config, cuda: bool, micro: int, arch: Optional[tuple[int, int]] = None) -> Sim:
    r = copy.deepcopy(recipe)
    r.train.micro_batch_size = micro
    return simulate_full_depth(r, config, cuda, arch=arch)


class Alternatives(list):
    """The fitting plans, fastest first; ``evaluated`` counts every variant considered."""

    def __init__(self, plans, evaluated: int):
        super().__init__(plans)
        self.evaluated = evaluated


def alternatives(recipe: Recipe, target: Target, max_gpus: int = 64, config=None,
                 workers: Optional[int] = None, adapters: bool = False,
                 sims: Optional[dict[str, Sim]] = None) -> list[Plan]:
    """Variants of the recipe that fit, fastest first (predicted tokens/s; lower peak breaks ties).

    Each keeps the global batch size. Single-GPU variants cross precision × activation checkpointing ×
    optimizer (AdamW, 8-bit AdamW, SGD) × micro batch, plus one GPU with ZeRO-2 and the optimizer
    offloaded, and with ``adapters`` LoRA and QLoRA (with and without checkpointing: they train
    adapters instead of every weight, a different result, so only on request); multi-GPU variants
    (DDP, FSDP, ZeRO-3 with offload) keep the recipe's precision; one that runs out of memory though its
    share of the model states fits is tried again with activation checkpointing. Micro batches
    between 1 and the recipe's own are interpolated from exact simulations at both ends (marked
    "interpolated"); everything else is simulated, except what ``sims`` (plan()'s, same target) holds.
    """
    import os

    config = config if config is not None else resolve_config(recipe)
    cuda = target.device == "cuda"
    workers = workers if workers is not None else min(4, os.cpu_count() or 1)
    g, m0 = recipe.global_batch_size, recipe.train.micro_batch_size
    micro = [m for m in (1, 2, 4, 8, 16, 32, 64) if m < m0 and m0 % m == 0 and g % m == 0]
    jobs: dict[str, tuple[Recipe, int]] = {}
    todo: list[tuple[str, dict, int, str, Any]] = []
    for precision in ("bf16-true", "bf16-mixed", "32-true"):
        for ckpt in (False, True):
            for optim in ("adamw", "adamw8bit", "sgd"):
                over = {"precision": precision, "train.activation_checkpointing": ckpt, "optim.name": optim,
                        "optim.momentum": 0.0}
                base = f"{precision}, {'ckpt' if ckpt else 'no ckpt'}, {optim}"
                try:
                    r_hi = simulation_recipe(_variant_recipe(recipe, over, cuda=cuda), "single")
                except RecipeError:
                    continue  # a combination training refuses (bf16 adapters in 32-true...) is no alternative
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
    several: dict[tuple[int, str], tuple[dict, int, str]] = {}  # (GPUs, strategy): (overrides, micro, label)
    while gpus <= max_gpus:
        if g % gpus == 0:
            per = g // gpus
            m = max(d for d in range(1, min(m0, per) + 1) if per % d == 0)
            over = {"train.micro_batch_size": m, "train.accumulate_grad_batches": per // m,
                    "train.global_batch_size": None}
            if recipe.optim.in_backward:  # several GPUs sync the gradients: the usual step
                over["optim.in_backward"] = False
            r_g = _variant_recipe(recipe, over, cuda=cuda)
            key = _sim_key(r_g, m)
            jobs[key] = (r_g, m)
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
                r_s = simulation_recipe(_variant_recipe(recipe, o, cuda=cuda) if label else r_g, strategy)
                k_s = _sim_key(r_s, m)
                jobs[k_s] = (r_s, m)
                todo.append((f"{recipe.precision}, {gpus} GPUs {strategy}{label}, micro {m} × acc {per // m}", o,
                             gpus, strategy, k_s))
                several[(gpus, strategy)] = (o, m, label)
        gpus *= 2
    # The same model through adapters, on one GPU, the recipe's micro batch: LoRA (frozen 16-bit base) and
    # QLoRA (4-bit NF4 base), AdamW on the adapters, with and without checkpointing; from a LoRA recipe, its
    # QLoRA form. Labelled by what changes: adapters train fewer weights, which is a choice about the result.
    if adapters and recipe.model.quantize == "none" and recipe.model.family != "sequence-classification":
        adapters = [("QLoRA nf4", {"peft.method": "lora", "model.quantize": "nf4"})]
        if recipe.peft.method == "none":
            adapters.insert(0, ("LoRA", {"peft.method": "lora"}))
        half = recipe.precision if recipe.precision != "32-true" else "bf16-true"
        for name, extra in adapters:
            for ckpt in (False, True):
                over = {"precision": half, "train.activation_checkpointing": ckpt, "optim.name": "adamw", **extra}
                # (check=False: a QLoRA plan needs no bitsandbytes here)
                r_a = simulation_recipe(_variant_recipe(recipe, over, check=False), "single")
                key = _sim_key(r_a, m0)
                jobs[key] = (r_a, m0)
                todo.append((f"{half}, {name} r{recipe.peft.r}, {'ckpt' if ckpt else 'no ckpt'}, adamw, micro {m0} × "
                             f"acc {g // m0}", over, 1, "single", key))
    # One GPU with ZeRO-2 and the optimizer in CPU RAM (the lab's DeepSpeed rung), the recipe's micro batch.
    if not _strategy_refused(recipe, "deepspeed_stage_2_offload", 1):
        r_1 = simulation_recipe(recipe, "deepspeed_stage_2_offload")
        k_1 = _sim_key(r_1, m0)
        jobs[k_1] = (r_1, m0)
        todo.append((f"{recipe.precision}, 1 GPU deepspeed_stage_2_offload, micro {m0} × acc {g // m0}", {}, 1,
                     "deepspeed_stage_2_offload", k_1))
    if recipe.optim.zero_grad == "before_backward":
        # Lightning's order holds the last step's gradients through the next forward; the default frees them.
        over = {"optim.zero_grad": "after_step"}
        r_z = simulation_recipe(_variant_recipe(recipe, over, check=False), "single")
        k_z = _sim_key(r_z, m0)
        jobs[k_z] = (r_z, m0)
        todo.append((f"{recipe.precision}, gradients freed after the step (optim.zero_grad=after_step), micro {m0} × "
                     f"acc {g // m0}", over, 1, "single", k_z))
    if not recipe.optim.in_backward:
        # Each weight stepped inside the backward, its gradient freed at once (no full set of gradients). It needs
        # one GPU, accumulation 1 (the global batch becomes the micro batch) and no global-norm clipping.
        for ckpt in (False, True):
            over = {"optim.in_backward": True, "optim.grad_clip": None, "train.activation_checkpointing": ckpt,
                    "train.micro_batch_size": g, "train.accumulate_grad_batches": 1, "train.global_batch_size": None,
                    "devices": 1, "num_nodes": 1, "strategy": "single"}
            try:
                r_b = simulation_recipe(_variant_recipe(recipe, over, cuda=cuda), "single")
            except RecipeError:
                break  # the recipe's optimizer or precision cannot step in the backward
            key = _sim_key(r_b, g)
            jobs[key] = (r_b, g)
            todo.append((f"{recipe.precision}, optimizer in backward (optim.in_backward, no clipping), "
                         f"{'ckpt' if ckpt else 'no ckpt'}, micro {g} × acc 1", over, 1, "single", key))
    if recipe.model.quantize != "none" and recipe.model.upcast_unquantized and recipe.precision.endswith("-true") \
            and recipe.precision != "32-true":
        # peft's k-bit preparation runs the hidden states in fp32; keeping them 16-bit is litgpt's/torchtune's QLoRA.
        over = {"model.upcast_unquantized": False}
        r_u = simulation_recipe(_variant_recipe(recipe, over, check=False), "single")
        k_u = _sim_key(r_u, m0)
        jobs[k_u] = (r_u, m0)
        todo.append((f"{recipe.precision}, 16-bit hidden states (model.upcast_unquantized=false), micro {m0} × "
                     f"acc {g // m0}", over, 1, "single", k_u))
    # Model states alone are a lower bound on the peak: variants whose states cannot fit are
    # dropped before any simulation (for a 70B model that is most single-GPU variants).
    n_evaluated = len(todo)
    numel = count_parameters(config, recipe.model.family)
    cap = target.capacity_bytes
    if cap is not None:
        def hopeless(r: Recipe, gpus: int, strategy: str) -> bool:
            if strategy.endswith("_offload"):  # only the 16-bit weights must stay (ZeRO-3: a shard of them)
                es = 4 if r.precision == "32-true" else 2
                return numel * es / (gpus if "stage_3" in strategy else 1) > cap
            sharded = strategy == "fsdp" or strategy.startswith("deepspeed")
            return state_bytes_lower_bound(r, numel) / (gpus if sharded else 1) > cap
        todo = [t for t in todo if not hopeless(_variant_recipe(recipe, t[1], check=False), t[2], t[3])]
        needed = {k for t in todo for k in ((t[4][0], t[4][1]) if isinstance(t[4], tuple) else (t[4],))}
        jobs = {k: v for k, v in jobs.items() if k in needed}
    known = sims or {}
    sims = {**_run_sims({k: v for k, v in jobs.items() if k not in known}, config, cuda, workers, target_arch(target)),
            **{k: known[k] for k in jobs if k in known}}
    plans, oom_several = [], []
    for label, over, gpus, strategy, how in todo:
        if isinstance(how, tuple):
            key_lo, key_hi, m = how
            sim = _interpolate(sims[key_lo], sims[key_hi], 1, m0, m)
        else:
            sim = sims[how]
        r = _variant_recipe(recipe, over, check=False)
        p = plan(r, Target(target.device, target.gpu, gpus, strategy), label, over, config, sim=sim)
        if p.fits is None or p.fits:
            plans.append(p)
        elif (gpus, strategy) in several:
            oom_several.append((gpus, strategy))
    # Where several GPUs were not enough though their share of the model states would fit (those were
    # simulated), the activations are what is left: the same GPUs and strategy with activation
    # checkpointing. Only there, so a model that already fits costs no more simulations.
    if oom_several and not recipe.train.activation_checkpointing:
        extra = []
        for gpus, strategy in oom_several:
            o, m, label = several[(gpus, strategy)]
            o = {**o, "train.activation_checkpointing": True}
            try:
                r_c = simulation_recipe(_variant_recipe(recipe, o, cuda=cuda), strategy)
            except RecipeError:
                continue  # a combination training refuses is no alternative
            extra.append((f"{recipe.precision}, {gpus} GPUs {strategy}{label}, ckpt, micro {m} × acc {g // gpus // m}",
                          o, gpus, strategy, _sim_key(r_c, m), r_c, m))
        sims.update(_run_sims({k: (r_c, m) for *_, k, r_c, m in extra if k not in sims}, config, cuda, workers,
                              target_arch(target)))
        n_evaluated += len(extra)
        for label, o, gpus, strategy, k, _, _ in extra:
            p = plan(_variant_recipe(recipe, o, check=False), Target(target.device, target.gpu, gpus, strategy), label,
                     o, config, sim=sims[k])
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
        need = p.needed_total or p.peak_total
        lines.append(f"{verdict}: needs {need / GIB:.2f} of {p.capacity / GIB:.2f} GiB "
                     f"({100 * need / p.capacity:.0f}%, margin {FIT_MARGIN:.0%})")
        if p.tight:
            lines.append(tight_advice(p))
    if p.step_time_s:
        lines.append(f"step ≈ {p.step_time_s:.3f} s, ≈ {p.tokens_per_s:,.0f} tokens/s "
                     f"({p.tokens_per_step:,} tokens per optimizer step)")
    for n in p.notes:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def tight_advice(p: Plan) -> str:
    """One line for a plan within the planner's typical error of the FITS line."""
    band = f"tight: the need is within {FIT_UNCERTAINTY:.0%} of the card of the limit, the planner's typical error"
    if p.fits:
        return (f"{band}, so it may still run out of memory. Keep headroom (a smaller micro batch at the same "
                "global batch, checkpointing, --alternatives) or try a few steps first (--set train.max_steps=3)")
    return f"{band}, so it may still fit: try a few steps (--set train.max_steps=3) or see --alternatives"


def format_alternatives(plans: list[Plan], limit: int = 20) -> str:
    if not plans:
        return "no variant fits; try more GPUs (--gpus) or a larger card"
    lines = [f"{'#':>3} {'tokens/s':>11} {'peak GiB':>9}  variant"]
    for i, p in enumerate(plans[:limit], 1):
        tps = f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "-"
        mark = " (tight)" if p.tight else ""
        lines.append(f"{i:>3} {tps:>11} {p.peak_total / GIB:>9.2f}  {p.variant}{mark}")
    if len(plans) > limit:
        lines.append(f"... {len(plans) - limit} more (--json lists all)")
    if any(p.tight for p in plans[:limit]):
        lines.append(f"(tight: fits by less than {FIT_UNCERTAINTY:.0%} of the card, the planner's typical error)")
    return "\n".join(lines)
