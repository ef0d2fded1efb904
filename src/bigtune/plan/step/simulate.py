"""One training step of the engine on fake tensors: the shallow model (a few blocks of each stack), the
fake Fabric, the measured phases, and the extrapolation to full depth.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional
from unittest import mock

import torch

from bigtune.core.allocconf import AllocatorConfig
from bigtune.memory.monitor import PHASES
from bigtune.plan.base.constants import CATEGORIES, FIT_UNCERTAINTY
from bigtune.plan.step import simcache
from bigtune.plan.step.quantized import (
    EIGHT_BIT,
    NF4Base,
    block_quant_constants,
    eight_bit_state_bytes,
    emulate_4bit,
    emulate_nf4,
    emulate_nf4_dora,
    nf4_base,
    nf4_parameter_delta,
    quantized_parameter_delta,
)
from bigtune.recipe import Recipe, quant_backend

EXPANDABLE = AllocatorConfig.parse("expandable_segments:True")


@dataclass
class Sim:
    """Per-phase categories of the steady step (step 1) and the peak over both simulated steps."""

    phases: dict[str, dict[str, int]]
    peak_allocated: int
    numel: int
    matmul_numel: int  # elements of the nn.Linear weights
    block_numel: int = 0  # elements inside the repeated blocks FSDP shards one by one (the rest is the root)
    attention: tuple[str, ...] = ()  # SDPA kernels CUDA would pick (cuda_kernels.sdpa_backend); () on a CPU
    reserved: int = 0  # peak reserved by the CUDA caching allocator replayed over the step (0: not replayed)
    needed: int = 0  # the least device memory on which that replay survives (what must fit; allocator.least_capacity)
    # roofline.OpCounter rows of one micro-batch's forward and backward and of one optimizer update
    ops: dict = field(default_factory=dict)
    # FSDP with *-mixed computes on 16-bit copies of fp32 shards (step_kind): the simulation's weights are
    # 16-bit, the real states are not. (simulated bytes, real bytes) of all weights and of the trainable
    # ones; () when the simulated weights are the real ones. See _shard's full_states.
    fsdp_upcast: tuple[int, ...] = ()
    fsdp_upcast_optimizer: bool = True  # False where the optimizer state does not follow the weights' dtype
    nf4: Optional[NF4Base] = None  # a torchao NF4 base (model.quant_backend=torchao): what sharding needs of it
    block_quant_constants: int = 0  # a bitsandbytes 4-bit base: one block's absmax/codes (whole under ZeRO-3)
    block_quant_numel: int = 0  # ... and the elements of its quantized weights (gathered at half a byte each)
    # ``needed`` replayed with expandable segments where the recipe keeps PyTorch's default allocator (0: not
    # replayed): what train.cuda_alloc_conf=expandable_segments:True would need instead
    needed_expandable: int = 0
    # phase -> the (peak, non-state peak) of each segment of its window as simulated (MemoryMonitor's
    # Snapshot.phase_segment_peaks, before _analytic_bytes): simulate_full_depth extrapolates them one by one
    segments: dict = field(default_factory=dict)
    # how ``reserved`` was replayed, for the plan's note ("" where simulate_full_depth did not trace), and, for
    # shallow replays, how far apart the extrapolations behind it are (replayed_over_depth)
    replay: str = ""
    replay_spread: float = 0.0


@dataclass(frozen=True)
class Stack:
    """A run of repeated blocks whose depth the simulation shrinks and extrapolates.

    ``path`` is the depth attribute inside the config; ``period`` is the number of layers that repeat
    as one unit (BLIP-2's Q-Former alternates layers with and without cross-attention, so its unit is
    ``cross_attention_frequency`` layers). ``kind``: the stack is the blocks of that kind among others at
    the same path (Qwen2.5-VL's vision tower: "window" and "full" attention blocks, each extrapolated by
    its own cost; chatvlm.set_vision_blocks places them).
    """

    path: tuple[str, ...]
    period: int = 1
    kind: str = ""


def model_stacks(config) -> list[Stack]:
    """The repeated stacks of a model: one for a decoder LM; vision, Q-Former and the language model's
    stack(s) for BLIP-2 (a T5 language model has an encoder and a decoder stack); the vision tower and
    the language model for Qwen2-VL, LLaVA, LLaVA-NeXT, PaliGemma and Idefics3 (SmolVLM); Qwen2.5-VL's window and
    full-attention vision blocks as two stacks, then its language model."""
    from bigtune.plan.step.chatvlm import (
        has_vision_block_kinds,
        is_anyres_vlm_config,
        is_chat_vlm_config,
        is_fixed_image_vlm_config,
        is_generic_vlm_config,
        is_split_image_vlm_config,
    )

    kind = getattr(config, "model_type", "")
    text = Stack(("text_config", "num_hidden_layers"))
    if is_chat_vlm_config(config) and has_vision_block_kinds(config):  # window and full-attention blocks
        return [Stack(("vision_config", "depth"), kind="window"), Stack(("vision_config", "depth"), kind="full"), text]
    if is_chat_vlm_config(config):
        return [Stack(("vision_config", "depth")), text]
    if is_fixed_image_vlm_config(config) or is_split_image_vlm_config(config) or is_anyres_vlm_config(config):
        # LLaVA, PaliGemma, Idefics3 (SmolVLM), LLaVA-NeXT: the vision tower and the language model
        return [Stack(("vision_config", "num_hidden_layers")), Stack(("text_config", "num_hidden_layers"))]
    if is_generic_vlm_config(config):  # the generic path: the vision tower (by its depth's name), the language model
        vc = getattr(config, "vision_config", None)
        depth = next((k for k in ("depth", "num_hidden_layers") if isinstance(getattr(vc, k, None), int)), None)
        return ([Stack(("vision_config", depth))] if depth else []) + [text]
    if kind != "blip-2" and getattr(config, "vision_config", None) is not None:
        from bigtune.plan.base.constants import PlanError

        raise PlanError(
            f"planning {kind} models is not supported yet (BLIP-2, Qwen2-VL, Qwen2.5-VL, LLaVA, LLaVA-NeXT, "
            "PaliGemma and SmolVLM are); train with "
            "memory.plan=false and read the measured memory"
        )
    if kind != "blip-2":
        return [Stack(("num_hidden_layers",))]
    out = [
        Stack(("vision_config", "num_hidden_layers")),
        Stack(
            ("qformer_config", "num_hidden_layers"),
            int(getattr(config.qformer_config, "cross_attention_frequency", 1) or 1),
        ),
    ]
    text = config.text_config
    if getattr(text, "is_encoder_decoder", False):
        out += [Stack(("text_config", "num_layers")), Stack(("text_config", "num_decoder_layers"))]
    else:
        out.append(Stack(("text_config", "num_hidden_layers")))
    return out


def get_depth(config, stack: Stack) -> int:
    if stack.kind:
        from bigtune.plan.step.chatvlm import vision_blocks

        return vision_blocks(config, stack.kind)
    obj = config
    for a in stack.path[:-1]:
        obj = getattr(obj, a)
    n = getattr(obj, stack.path[-1], None)
    if n is None and stack.path[-1] == "num_decoder_layers":  # T5: None means "as many as the encoder"
        n = obj.num_layers
    return int(n)


def set_depth(config, stack: Stack, n: int) -> None:
    if stack.kind:
        from bigtune.plan.step.chatvlm import set_vision_blocks

        return set_vision_blocks(config, stack.kind, n)
    obj = config
    for a in stack.path[:-1]:
        obj = getattr(obj, a)
    setattr(obj, stack.path[-1], n)


def total_blocks(config) -> int:
    """Repeated blocks in the whole model (FSDP wraps each one)."""
    return sum(get_depth(config, s) for s in model_stacks(config))


def config_family(config) -> str:
    from bigtune.plan.step.chatvlm import is_vlm_config

    image = getattr(config, "model_type", "") == "blip-2" or is_vlm_config(config)
    return "image-to-text" if image else "causal-lm"


def _sim_precision(precision: str) -> str:
    # Fabric on a CPU turns 16-mixed into bf16-mixed; the byte counts are the same (2-byte copies).
    return "bf16-mixed" if precision == "16-mixed" else precision


def _synthetic_batch(recipe: Recipe, cfg, family: str, b_size: int, padded: bool, images=None) -> dict:
    """A full-length micro-batch shaped as the collators build it, with real (tiny) token ids: the
    loss normaliser needs a concrete target count; everything computed from it is fake. ``images``: a
    chat vision-language model's image grids (chatvlm.synthetic_batch; None: the worst case)."""
    from bigtune.core.stepmath import IGNORE_INDEX
    from bigtune.plan.step import chatvlm

    seq = recipe.data.max_seq_length
    g = torch.Generator().manual_seed(0)
    if family == "image-to-text":
        chatvlm.check_image_budget(recipe, cfg)
    if family == "image-to-text" and chatvlm.is_generic_vlm_config(cfg):
        return chatvlm.generic_batch(recipe, cfg, b_size, padded, images)
    if family == "image-to-text" and chatvlm.is_chat_vlm_config(cfg):
        return chatvlm.synthetic_batch(recipe, cfg, chatvlm.image_geometry(recipe, cfg), b_size, padded, images)
    if family == "image-to-text" and chatvlm.is_fixed_image_vlm_config(cfg):
        layout = chatvlm.fixed_image_layout(recipe, cfg)
        return chatvlm.fixed_image_batch(recipe, cfg, layout, b_size, padded)
    if family == "image-to-text" and chatvlm.is_split_image_vlm_config(cfg):
        return chatvlm.split_image_batch(recipe, cfg, chatvlm.split_geometry(recipe, cfg), b_size, padded, images)
    if family == "image-to-text" and chatvlm.is_anyres_vlm_config(cfg):
        return chatvlm.anyres_batch(recipe, cfg, chatvlm.anyres_geometry(recipe, cfg), b_size, padded, images)
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
        return {
            "pixel_values": pixels,
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": caption,
            "decoder_input_ids": dec,
            "padded": padded,
        }
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


def no_init():
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


@simcache.cached_by_inputs(ignore=("splice",))
def simulate(
    recipe: Recipe,
    config,
    depths: "int | dict[Stack, int]",
    cuda: bool,
    micro_batch: Optional[int] = None,
    padded: bool = False,
    arch: Optional[tuple[int, int]] = None,
    trace: bool = False,
    images: Optional[tuple] = None,
    stage: Optional[int] = None,
    expandable: bool = True,
    splice: bool = True,
) -> Sim:
    """Run one steady-state training step of ``recipe`` on fake tensors, with each repeated stack cut
    to ``depths`` blocks (an int sets every stack). ``stage``: that pipeline stage's step, holding every
    layer of the cut model (plan/layout/pipeline.py).

    The optimizer state is created first (one update with zero gradients), so the simulated step is
    like the engine's step 1 and later: its peak is the run's peak. On a CUDA target of compute
    capability ``arch`` (default 8.0), attention takes the math path wherever CUDA would
    (cuda_kernels). With ``trace`` (CUDA targets), ``Sim.reserved`` is the caching allocator's peak
    reserved over the weights and steps 0-2 (allocator.replay), and with ``expandable`` also replayed with
    expandable segments (``Sim.needed_expandable``). Accumulation windows are
    simulated with two micro-batches: from the second one on, gradients are held during forward,
    and a third micro-batch repeats the second one's memory exactly. ``images``: a chat vision-language
    model's image grids, one per row in turn (None: the worst case; see chatvlm).

    Long because every patch the fake step runs under is set up in one ``with``, where it can be read.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bigtune.plan.device.kernels import cuda_attention, cuda_autocast, cuda_dropout
    from bigtune.plan.device.roofline import scale
    from bigtune.plan.step.chatvlm import is_vlm_config, real_index_math

    cfg = _shallow_config(config, depths, recipe)
    family = recipe.model.family
    r, quantize, eight_bit = _simulated_recipe(recipe, cuda)
    fabric = _fake_fabric(r)
    batches, tokens = _batches_and_tokens(r, cfg, family, micro_batch or r.train.micro_batch_size, padded, images)
    no_packing, no_move, foreach_clip = _engine_patches(cuda)
    # Weight initialisers (truncated normal) branch on values, which fake tensors do not have.
    # arch given: choose attention kernels as CUDA on that GPU would (also on a CPU, for tests)
    on_cuda = arch if arch is not None else ((8, 0) if cuda else None)
    kernels = cuda_attention(on_cuda, bf16_is_fp16=recipe.precision == "16-mixed")
    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        no_packing,
        no_move,
        no_init(),
        _keep_every_layer(),
        kernels as attention,
        foreach_clip,
        cuda_dropout(on_cuda is not None),
        cuda_autocast(on_cuda is not None),
        _grouped_mm_any_dtype(),
        real_index_math(cfg) if is_vlm_config(cfg) else contextlib.nullcontext(),
    ):
        model, fsdp_upcast = _fake_model(r, recipe, cfg, quantize)
        if stage is not None:
            from bigtune.engine.pipeline import StageModule

            model = StageModule(model, stage, r.pipeline_parallel, layers=range(cfg.num_hidden_layers))
        numel, matmul_numel, block_numel = _model_numels(model)
        nf4 = nf4_base(model) if torchao_nf4(recipe) else None
        constants = (0, 0) if nf4 else block_quant_constants(model, quantize, recipe.model.double_quant)
        _fake_pixels(batches)
        wrapped = fabric.setup_module(model)
        pipeline = None
        if stage is not None:
            from bigtune.plan.step.emulated import emulated_runner

            pipeline = emulated_runner(r, fabric, wrapped, stage, cfg)
        try:
            snaps, counter, events, step1 = _run_steps(
                fabric, model, wrapped, r, batches, tokens, cuda, trace, pipeline, splice
            )
        except _NoSplice:
            snaps = None
    if snaps is None:  # run again with a real step 0 (outside the fake mode and patches, which it sets up anew)
        return simulate.__wrapped__(  # the same step again, not a cache lookup
            recipe, config, depths, cuda, micro_batch, padded, arch, trace, images, stage, expandable, False
        )
    steady = {s.phase: {c: getattr(s, c) for c in CATEGORIES} for s in snaps}
    segments = {s.phase: s.phase_segment_peaks for s in snaps if s.phase_segment_peaks}
    peak = max(s.peak_allocated for s in snaps)
    replayed = (0, 0, 0)  # reserved, needed, needed with expandable segments
    if events is not None:
        conf = AllocatorConfig.parse(recipe.train.cuda_alloc_conf)
        grow = _replay_steady(events, step1, EXPANDABLE)[1] if conf.is_default and expandable else 0
        replayed = (*_replay_steady(events, step1, conf), grow)
    peak, (reserved, needed, needed_expandable) = _analytic_bytes(
        steady, peak, replayed, wrapped, recipe, r, quantize, eight_bit, cuda
    )
    # Rows per micro-batch: the step ran k of them (the accumulation window is scaled in _time).
    ops = scale(dict(counter.ops), ("forward", "backward"), 1 / len(batches))
    return Sim(
        steady,
        peak,
        numel,
        matmul_numel,
        block_numel,
        tuple(sorted(attention)),
        reserved,
        needed,
        ops,
        fsdp_upcast,
        not eight_bit,
        nf4,
        *constants,
        needed_expandable=needed_expandable,
        segments=segments,
    )


def torchao_nf4(recipe: Recipe) -> bool:
    """Whether the recipe's base is torchao's NF4 (FSDP-shardable QLoRA), not bitsandbytes'."""
    return recipe.model.quantize == "nf4" and quant_backend(recipe) == "torchao"


def _engine_patches(cuda: bool) -> tuple:
    """(no_packing, no_move, foreach_clip): patches that make the engine's code take, on fake tensors,
    the path it takes on real ones."""
    # transformers treats fake tensors as "tracing" and then keeps an explicit mask for packed
    # sequences, which the real run (one sequence per row, checked on real values) drops.
    no_packing = mock.patch("transformers.masking_utils.find_packed_sequence_indices", lambda position_ids: None)
    # peft moves new adapters to the base layer's device with module.to(); torch cannot swap fake
    # parameters, and everything here already lives on the one (fake) CPU: make it a no-op. No
    # dtype change goes through module.to() in the engine (Fabric's conversion is skipped there too).
    no_move = mock.patch("torch.nn.Module.to", lambda self, *a, **k: self)
    # Gradient clipping takes its foreach kernels only for plain tensors; on a GPU it takes them (one
    # norm and one scale over all gradients, the same bytes as per tensor but far fewer launches).
    foreach_clip = (
        mock.patch("torch.nn.utils.clip_grad._has_foreach_support", lambda tensors, device: True)
        if cuda
        else contextlib.nullcontext()
    )
    return no_packing, no_move, foreach_clip


def _grouped_mm_any_dtype():
    """MoE experts (Mixtral, Qwen3-MoE) multiply through ``grouped_mm``. Its meta kernel checks for
    bfloat16, stricter than the kernels that run: the CPU kernel takes any float dtype, and the CUDA one
    (``_grouped_mm_cuda``, aten/src/ATen/native/cuda/GroupedBlas.cpp, torch 2.9 on) runs bf16 through
    CUTLASS and any other dtype through ``_grouped_mm_fallback``, a per-expert ``mm_out`` into the same
    output tensor. So for non-bf16 weights the simulation routes through transformers' own fallback op,
    whose fake kernel gives that output and whose backward saves the same input and weight."""
    try:
        from transformers.integrations import moe
    except ImportError:  # an older transformers: its experts are plain per-expert Linear layers
        return contextlib.nullcontext()
    check = getattr(moe, "_can_use_grouped_mm", None)
    if check is None:
        return contextlib.nullcontext()
    return mock.patch.object(
        moe,
        "_can_use_grouped_mm",
        lambda input, weight, offs: weight.dtype == torch.bfloat16 and check(input, weight, offs),
    )


def _fake_pixels(batches: list[dict]) -> None:
    """Fake pixels: a real tensor would be really converted (Fabric casts float inputs), and that
    parallel work starts OpenMP's threads, after which a forked worker hangs. Call under FakeTensorMode."""
    for batch in batches:
        if "pixel_values" in batch:
            batch["pixel_values"] = torch.empty(batch["pixel_values"].shape)


def _analytic_bytes(
    steady: dict,
    peak: int,
    replayed: tuple[int, ...],
    wrapped,
    recipe: Recipe,
    r: Recipe,
    quantize: str,
    eight_bit: bool,
    cuda: bool,
) -> tuple[int, tuple[int, ...]]:
    """(peak, replayed bytes) with what fake tensors could not hold added to ``steady`` and to each of the
    allocator replay's figures (0: not replayed): the quantized base's packed bytes in place of its
    simulated 16-bit weights, and the 8-bit optimizer's state."""
    if quantize != "none":
        if torchao_nf4(recipe):
            delta = nf4_parameter_delta(wrapped, 512 if cuda else 1)
        else:
            delta = quantized_parameter_delta(wrapped, quantize, recipe.model.double_quant, r.model.upcast_unquantized)
        peak = _add_bytes(steady, peak, ("parameters", "allocated", "peak_allocated", "phase_peak"), delta)
        # weights are whole long-lived blocks: the allocator holds about as much less
        replayed = tuple(max(0, x + delta) if x else 0 for x in replayed)
    if eight_bit:
        shapes = [p.numel() for p in wrapped.parameters() if p.requires_grad]
        extra = 0 if recipe.optim.name.startswith("paged") and cuda else eight_bit_state_bytes(shapes)
        peak = _add_bytes(steady, peak, ("optimizer_device", "allocated", "peak_allocated", "phase_peak"), extra)
        replayed = tuple(x + extra if x else 0 for x in replayed)
    return peak, replayed


def _add_bytes(steady: dict, peak: int, categories: tuple[str, ...], extra: int) -> int:
    """Add ``extra`` bytes to ``categories`` of every phase of ``steady``; returns the peak so raised."""
    for ph in steady.values():
        for c in categories:
            ph[c] += extra
    return peak + extra


def _shallow_config(config, depths: "int | dict[Stack, int]", recipe: Recipe):
    """A copy of ``config`` with each repeated stack cut to ``depths`` blocks, no KV cache, and the
    recipe's attention implementation (and classification head)."""
    from bigtune.models.build import attention_for, label_config

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
    cfg._attn_implementation = attention_for(recipe.model, config)[0]  # eager where there is no SDPA
    return cfg


def _simulated_recipe(recipe: Recipe, cuda: bool) -> tuple[Recipe, str, bool]:
    """(the recipe the fake step runs, the real base quantization, whether the real optimizer is 8-bit):
    what fake tensors cannot run is swapped for what keeps the same tensors, and added back analytically."""
    r = copy.deepcopy(recipe)
    if cuda and r.optim.implementation == "auto":
        r.optim.implementation = "foreach"  # torch's default for CUDA tensors
    quantize = r.model.quantize
    r.model.quantize = "none"  # bitsandbytes cannot quantize fake tensors: simulate, then swap the bytes
    if quantize != "none" and zero_masters(recipe, recipe.strategy):
        # DeepSpeed casts the whole module to 16 bits: no fp32 upcast of the unquantized weights survives
        r.model.upcast_unquantized = False
    eight_bit = r.optim.name in EIGHT_BIT
    if eight_bit:
        # bitsandbytes kernels do not run on fake tensors: step with state-free SGD and add the 8-bit
        # state analytically below (its update works in place, block by block).
        r.optim.name, r.optim.momentum, r.optim.implementation = "sgd", 0.0, "for-loop"
    if r.optim.name == "deepspeed_cpu_adam":
        # DeepSpeed's C++ Adam reads raw data pointers (a segfault on fake tensors); torch's CPU
        # AdamW in the same wrapper keeps exactly the same tensors in the same places.
        r.optim.name = "cpu_offload_adamw"
    return r, quantize, eight_bit


def _fake_fabric(r: Recipe):
    """A one-CPU Fabric with the recipe's precision plugin, that leaves fake modules where they are."""
    from lightning.fabric import Fabric

    with _quiet_lightning():  # no "Using bfloat16 AMP" per simulation
        fabric = Fabric(accelerator="cpu", devices=1, precision=_sim_precision(r.precision))
    # The model is built directly in its storage dtype, so Fabric's module.to(dtype) is a no-op for
    # real tensors; on fake parameters torch would try (and fail) to swap them, so skip it.
    fabric._precision.convert_module = lambda module: module
    fabric._strategy.module_to_device = lambda module: None  # already on the (fake) CPU
    return fabric


def _batches_and_tokens(
    r: Recipe, cfg, family: str, b_size: int, padded: bool, images: Optional[tuple] = None
) -> tuple[list[dict], int]:
    """The micro-batches of one simulated window (at most two) and the window's target token count."""
    from bigtune.core.stepmath import target_token_count

    k = min(r.accumulate, 2)
    # distinct storages, like distinct real micro-batches
    batches = [_synthetic_batch(r, cfg, family, b_size, padded, images) for _ in range(k)]
    if family == "sequence-classification":  # one label per sample: the loss is normalised by samples
        tokens = b_size * r.accumulate
    else:
        shift = family == "causal-lm" or not getattr(cfg.text_config, "is_encoder_decoder", False)
        tokens = int(target_token_count(batches[0]["labels"], shift)) * r.accumulate
    return batches, tokens


def _fake_model(r: Recipe, recipe: Recipe, cfg, quantize: str) -> tuple[torch.nn.Module, tuple[int, ...]]:
    """(the model as the engine builds it, on fake tensors, fsdp_upcast: see Sim). Call under FakeTensorMode."""
    from bigtune.models.build import (
        apply_peft,
        auto_class,
        compute_dtype,
        enable_activation_checkpointing,
        freeze_parts,
        recast_parameters,
        weights_dtype,
    )

    family = recipe.model.family
    model = auto_class(family).from_config(cfg, dtype=weights_dtype(r.precision))
    model.config.use_cache = False
    if torchao_nf4(recipe):
        emulate_nf4(model, compute_dtype(recipe.model, r.precision), r.model.upcast_unquantized)
    elif quantize in ("nf4", "fp4"):
        emulate_4bit(model, compute_dtype(recipe.model, r.precision), r.model.upcast_unquantized)
    if family == "image-to-text":
        freeze_parts(model, r.model)
    model.train()
    if (
        r.tensor_parallel > 1 and r.sequence_parallel
    ):  # one rank's layout of the sequence (plan/layout/tensor_parallel.py)
        from bigtune.plan.step.emulated import emulate_sequence_parallel

        emulate_sequence_parallel(model, r.tensor_parallel)
    if r.train.activation_checkpointing:
        enable_activation_checkpointing(model)
    if r.peft.method != "none":
        # A quantized base is simulated in its compute dtype; plan() then swaps in 4/8-bit bytes.
        model = apply_peft(
            model, r.peft, quantized=False, checkpointing=r.train.activation_checkpointing, family=family
        )
        if torchao_nf4(recipe):
            emulate_nf4_dora(model)
    ds_cast, _, fsdp_mixed = step_kind(r, r.strategy)
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
        real = (_parameter_bytes(model, False), _parameter_bytes(model, True))
        low = torch.bfloat16 if r.precision.startswith("bf16") else torch.float16
        recast_parameters(model, low, lambda name, p: p.dtype == torch.float32)
        fsdp_upcast = (_parameter_bytes(model, False), real[0], _parameter_bytes(model, True), real[1])
    return model, fsdp_upcast


def _parameter_bytes(model: torch.nn.Module, trainable: bool) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not trainable)


def _model_numels(model: torch.nn.Module) -> tuple[int, int, int]:
    """(elements of all weights, of the nn.Linear weights, inside the repeated blocks)."""
    from bigtune.models.build import decoder_blocks

    numel = sum(p.numel() for p in model.parameters())
    matmul_numel = _matmul_numel(model)
    try:
        block_numel = sum(p.numel() for blk in decoder_blocks(model) for p in blk.parameters())
    except ValueError:
        block_numel = 0
    return numel, matmul_numel, block_numel


def _run_steps(
    fabric, model, wrapped, r: Recipe, batches: list, tokens: int, cuda: bool, trace: bool, pipeline=None, splice=True
) -> tuple:
    """Step 0 (creates the optimizer state) and the measured step 1 on the fake model: (step 1's
    snapshots, its OpCounter, the storage events traced from the weights on or None, where step 1's begin).

    On a CUDA target with ``trace`` every storage's birth and death is recorded from the weights on, through
    step 0 (the optimizer state is then created where a GPU creates it: after a backward), for the
    caching-allocator replay. Step 0 is run for real only where the zero-gradient shortcut cannot stand in
    (image-to-text models, the optimizer step in the backward, pipeline stages); elsewhere its events are
    spliced from step 1's (_spliced_step0), which saves a forward and backward per traced simulation.
    Call under FakeTensorMode."""
    from bigtune.engine.loop import LoopState, train_step
    from bigtune.engine.optim import make_optimizer
    from bigtune.memory.tracker import LiveTensorTracker

    raw = make_optimizer(r.optim, wrapped)
    opt = fabric.setup_optimizers(raw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    built = SimpleNamespace(fabric=fabric, model=wrapped, optimizer=opt, scheduler=sched, recipe=r, pipeline=pipeline)
    events: Optional[list] = [] if cuda and trace else None
    trace_mode = LiveTensorTracker(events=events) if events is not None else contextlib.nullcontext()
    if events is not None and getattr(raw, "offloaded", False):
        # A CPU-offloaded optimizer updates its host copies in host RAM (its state is born there, in its
        # first step): none of that is the GPU's caching allocator's, so the replay does not see it.
        host_step = raw.inner.step
        raw.inner.step = lambda *a, **k: _untraced_call(trace_mode, host_step, *a, **k)
    if events is not None:
        trace_mode.track(list(wrapped.parameters()) + list(wrapped.buffers()))  # loaded in this order
    # Where step 0 is not run for real under the trace, its events are made from step 1's (_spliced_step0);
    # marks: where the zero gradients are born, where each optimizer step begins and ends.
    splice = events is not None and splice and splices_step0(r, pipeline)
    marks: list[int] = []
    if splice:
        opt_step = raw.step
        raw.step = lambda *a, **k: (marks.append(len(events)), opt_step(*a, **k), marks.append(len(events)))[1]
    with trace_mode:
        if r.model.family == "image-to-text" or (events is not None and not splice):
            # Some trainable weights get no gradient (BLIP-2 feeds its T5 encoder embeddings, so the
            # encoder's own token table is never used) and so no optimizer state: take a real step 0.
            train_step(built, batches, None, False, LoopState(step=0), tokens)
        else:  # every weight of a decoder LM is used: zero gradients create the same state, faster
            marks.append(len(events) if events is not None else 0)
            for p in wrapped.parameters():
                if p.requires_grad:  # frozen (base) weights never get gradients
                    p.grad = torch.zeros_like(p)
            opt.step()
            if r.optim.zero_grad == "after_step":  # else they live into the next forward, as in the engine
                opt.zero_grad(set_to_none=True)
        step1 = len(events) if events is not None else 0
        snaps, counter = _measured_step(built, model, wrapped, batches, tokens, round_to=512 if cuda else 1)
    if splice:
        raw.step = opt_step
        spliced = _spliced_step0(events, step1, *marks[:4])
        if spliced is None:
            raise _NoSplice
        events, step1 = spliced
    return snaps, counter, events, step1


class _NoSplice(Exception):
    """This trace's step 0 cannot be spliced from its step 1 (_spliced_step0): simulate again, running it."""


def splices_step0(r: Recipe, pipeline) -> bool:
    """Whether a traced simulation takes step 0's events from step 1's (_spliced_step0) instead of running it:
    where the zero-gradient shortcut creates the optimizer state a real step 0 would (not for image-to-text
    models, whose unused weights get no state; not with the optimizer step inside the backward; not for a
    pipeline stage, whose step is scheduled otherwise)."""
    return r.model.family != "image-to-text" and not r.optim.in_backward and not pipeline


def _spliced_step0(
    events: list, step1: int, zeros: int, opt0: int, opt0_end: int, opt1: int
) -> Optional[tuple[list, int]]:
    """(events, where step 1 begins) as a real step 0 would have traced them, from a trace whose step 0 took
    the zero-gradient shortcut: the weights (``events[:zeros]``), step 1's forward and backward
    (``events[step1:opt1]``) copied under new keys, the shortcut's optimizer step (``events[opt0:opt0_end]``:
    the state is born there, after a backward, as on a GPU), the rest of the shortcut's step, then step 1.

    The shortcut's zero gradients (``events[zeros:opt0]``) are not born; the copy's own gradients (born in
    the copied backward and still alive at its end) stand in for them, paired by size in birth order, wherever
    the trace frees a zero gradient; None where step 1 allocated not every gradient again. What else the copy leaves alive dies at the end of step 0, as step 1's
    did in its optimizer step. Frees of storages older than step 1 are not copied (step 0 has none to free).
    The replay then sees what a traced real step 0 gives, without running its forward and backward."""
    fwd = events[step1:opt1]
    new_key = {e[1]: -1 - e[1] for e in fwd if e[0] == "alloc"}  # negative: never a serial, nor a later copy's
    copy0 = [(e[0], new_key[e[1]], *e[2:]) for e in fwd if e[1] in new_key]  # frees of older storages dropped
    freed0 = {e[1] for e in copy0 if e[0] == "free"}
    alive = [e for e in copy0 if e[0] == "alloc" and e[1] not in freed0]  # in birth order
    zero_grads = [e for e in events[zeros:opt0] if e[0] == "alloc"]
    by_size: dict[int, list] = {}
    for e in alive:
        by_size.setdefault(e[2], []).append(e[1])
    stand_in = {}
    for e in zero_grads:
        if by_size.get(e[2]):
            stand_in[e[1]] = by_size[e[2]].pop(0)
    left = [k for keys in by_size.values() for k in keys]
    if any(e[1] not in stand_in for e in zero_grads):
        # Step 1 did not allocate every gradient again (zero_grad without set_to_none keeps them, zeroed in
        # place): where a first backward creates them is not in its trace, so no splice (the caller runs it).
        return None

    def mapped(evs: list) -> list:  # a zero gradient's free frees its stand-in
        return [("free", stand_in[e[1]]) if e[1] in stand_in else e for e in evs]

    step0 = copy0 + events[opt0:opt0_end] + [("free", k) for k in left] + mapped(events[opt0_end:step1])
    return events[:zeros] + step0 + mapped(events[step1:]), zeros + len(step0)


def _untraced_call(tracker, fn, *args, **kwargs):
    with tracker.untraced():
        return fn(*args, **kwargs)


def _measured_step(built, model, wrapped, batches: list, tokens: int, round_to: int) -> tuple:
    """Step 1 under the MemoryMonitor, its operators counted: (phase snapshots, OpCounter)."""
    from bigtune.engine.loop import LoopState, train_step
    from bigtune.memory.monitor import MemoryMonitor
    from bigtune.models.build import decoder_blocks
    from bigtune.plan.device.roofline import OpCounter

    monitor = MemoryMonitor(torch.device("cpu"), round_to=round_to)
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
    return snaps, counter


def _replay_steady(events: list, step1: int, config: Optional[AllocatorConfig] = None) -> tuple[int, int]:
    """(peak reserved, least capacity) of the CUDA caching allocator over the weights, step 0, step 1
    and a step 2 identical to step 1 (reserved can still grow once the cache holds step 1's pattern; it
    does not after that). The least capacity is the smallest device on which that sequence runs, the
    allocator emptying its cache and retrying where it must (allocator.least_capacity). ``config``: the
    PYTORCH_CUDA_ALLOC_CONF settings replayed (train.cuda_alloc_conf; None: PyTorch's defaults)."""
    from bigtune.plan.device.allocator import least_capacity, replay

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
    again = [
        (e[0], e[1] + offset, *e[2:]) if e[1] in born else ("free", heir[e[1]])
        for e in step
        if e[1] in born or e[1] in heir
    ]
    full = events + again
    stats = replay(full, config=config).stats
    return stats.peak_reserved, least_capacity(full, config)


def simulate_full_depth(
    recipe: Recipe,
    config,
    cuda: bool,
    padded: bool = False,
    micro_batch: Optional[int] = None,
    arch: Optional[tuple[int, int]] = None,
    images: Optional[tuple] = None,
    stage: Optional[int] = None,
    trace: bool = False,
) -> Sim:
    """The step at the model's real depth, from simulations of shallow copies (``stage``: a pipeline stage's).
    With ``trace`` (CUDA targets) the shallow steps are also replayed through the caching allocator and
    ``Sim.reserved`` / ``Sim.needed`` extrapolated from them (replayed_over_depth; ``Sim.replay`` says how):
    cheaper than estimate_reserved's deeper pair, for plans that do not get their own.

    Memory is linear in the depth of each repeated stack (every block adds the same parameters,
    states and saved activations), so one simulation with every stack at one unit of depth plus one
    per stack with that stack one unit deeper give each stack's per-block cost; the full model is
    the base plus each stack's cost times its extra depth. Small models are simulated as they are.
    """
    stacks = model_stacks(config)
    full = {st: get_depth(config, st) for st in stacks}
    kw = dict(images=images, stage=stage, trace=trace, expandable=False)
    if all(full[st] <= 2 * st.period for st in stacks):
        sim = simulate(recipe, config, full, cuda, micro_batch, padded, arch, **kw)
        sim.replay = "a caching-allocator replay of this step at full depth" if sim.reserved else ""
        return sim
    unit = {st: min(st.period, full[st]) for st in stacks}
    # (Run one after the other on purpose: the first simulation of a process pays the lazy imports and
    # caches that every later one, and every worker forked later, reuses.)
    base = simulate(recipe, config, unit, cuda, micro_batch, padded, arch, **kw)
    grown = []
    for st in stacks:
        if full[st] > unit[st]:
            deeper = {**unit, st: unit[st] + st.period}
            sim = simulate(recipe, config, deeper, cuda, micro_batch, padded, arch, **kw)
            grown.append((sim, (full[st] - unit[st]) / st.period))

    def ext(get) -> int:
        b0 = get(base)
        if b0 is None or any(get(sim) is None for sim, _ in grown):
            return None  # a measure not every simulation has (e.g. no gradient stored in that phase)
        return int(round(b0 + sum((get(sim) - b0) * times for sim, times in grown)))

    phases, running = _full_depth_phases(base, grown, ext)
    peak = max(ext(lambda x: x.peak_allocated), running)
    ops = _ops_at_depth(base, grown)
    upcast = tuple(ext(lambda x, i=i: x.fsdp_upcast[i]) for i in range(len(base.fsdp_upcast)))
    reserved, needed, spread = _shallow_replays_at_depth(base, grown, device_peak(phases, peak))
    out = Sim(
        phases,
        peak,
        ext(lambda x: x.numel),
        ext(lambda x: x.matmul_numel),
        ext(lambda x: x.block_numel),
        base.attention,
        reserved,
        needed,
        ops,
        upcast,
        base.fsdp_upcast_optimizer,
        base.nf4,
    )
    if reserved:
        out.replay = "a caching-allocator replay of this step one and two blocks deep, extrapolated to full depth"
        if spread > FIT_UNCERTAINTY:
            out.replay += f" (uncertain: two extrapolations {spread:.0%} apart)"
        out.replay_spread = spread
    return out


def _ops_at_depth(base: Sim, grown: list) -> dict:
    """simulate_full_depth's operator rows: linear in depth too (each block adds the same kernels); counts,
    FLOPs, bytes."""
    # In the simulations' own order (dicts keep it, and so does the simulation cache), not a set's, whose order
    # follows the process's string hashing: the time model's sums then come out the same to the last bit.
    keys = list(dict.fromkeys([*base.ops, *(k for sim, _ in grown for k in sim.ops)]))
    zero = (0, 0.0, 0.0)
    return {
        k: [
            max(
                0.0,
                base.ops.get(k, zero)[i]
                + sum((sim.ops.get(k, zero)[i] - base.ops.get(k, zero)[i]) * times for sim, times in grown),
            )
            for i in range(3)
        ]
        for k in keys
    }


def _shallow_replays_at_depth(base: Sim, grown: list, on_device: int) -> tuple[int, int, float]:
    """(reserved, least capacity, how far apart their extrapolations are) at the depth whose device peak is
    ``on_device``, from simulate_full_depth's traced ``base`` and ``grown`` simulations ((0, 0, 0.0) where they
    were not traced): each stack one unit deeper at once, against the base (replayed_over_depth)."""
    if not base.reserved:
        return 0, 0, 0.0
    deeper = [base.reserved + sum(s.reserved - base.reserved for s, _ in grown)]
    deeper += [base.needed + sum(s.needed - base.needed for s, _ in grown)]
    allocated = [device_peak(x.phases, x.peak_allocated) for x in [base] + [s for s, _ in grown]]
    alloc_deeper = allocated[0] + sum(a - allocated[0] for a in allocated[1:])
    (reserved, spread), (needed, spread_needed) = (
        replayed_over_depth((r0, allocated[0]), (r1, alloc_deeper), on_device)
        for r0, r1 in ((base.reserved, deeper[0]), (base.needed, deeper[1]))
    )
    return reserved, min(needed, reserved), max(spread, spread_needed)


def device_peak(phases: dict, peak: int) -> int:
    """``peak`` less the host-RAM state a CPU-offloaded optimizer keeps (the fake step counts it with the
    rest; a GPU never holds it): the allocated peak a caching-allocator replay is compared with."""
    return peak - max((ph.get("optimizer_cpu", 0) for ph in phases.values()), default=0)


def replayed_over_depth(shallow: tuple[int, int], deeper: tuple[int, int], allocated: int) -> tuple[int, float]:
    """(a replayed figure: peak reserved or the least capacity, at the depth whose peak allocated is
    ``allocated``; how far apart the two extrapolations behind it are, over it), from (replayed,
    allocated) at a shallow depth and a deeper one.

    Which cached block each request reuses depends on the whole sequence, so the replayed figure is not
    exactly linear in depth the way allocated bytes are. Two extrapolations that err in opposite ways when
    reuse jumps between the two depths are averaged: growing with allocated at the rate seen between
    them (never below 1: cached blocks can absorb a few blocks' growth, not every block's to full depth),
    and the deeper one's ratio to allocated. Never below ``allocated``. Where they lie far apart, a jump
    between the two depths (a large fixed tensor's segment reused at one depth and not at the other)
    dominates, and neither is to be trusted: the caller replays deeper steps (estimate_reserved)."""
    (r_a, a_a), (r_b, a_b) = shallow, deeper
    slope = max(1.0, (r_b - r_a) / max(1, a_b - a_a))
    by_slope = r_b + slope * (allocated - a_b)
    by_ratio = allocated * r_b / max(1, a_b)
    value = max(allocated, int((by_slope + by_ratio) / 2))
    return value, abs(by_slope - by_ratio) / value


def _full_depth_phases(base: Sim, grown: list, ext) -> tuple[dict, int]:
    """simulate_full_depth's phases at full depth and the step's running high over them (``ext``: its
    linear extrapolation over ``base`` and the ``grown`` simulations)."""
    phases = {ph: {c: ext(lambda x, ph=ph, c=c: x.phases[ph][c]) for c in CATEGORIES} for ph in base.phases}
    for name, ph in phases.items():
        lift, lift_unheld = _segment_lift(name, [base] + [sim for sim, _ in grown], ext)
        if ph.get("phase_peak") is not None:
            ph["phase_peak"] += lift
        if ph.get("phase_peak_activations") is not None:
            ph["phase_peak_activations"] += lift_unheld
    # Max and extrapolation do not commute: which phase holds the step's peak can change with depth
    # (shallow, the logits' backward; deep, the optimizer's temporaries over all the weights). Each
    # phase's own high is extrapolated (segment by segment where its point moves too, _segment_lift);
    # the step's peak is the highest of them, and each phase's cumulative peak the highest so far.
    running = 0
    for name in PHASES:
        if name in phases:
            ph = phases[name]
            running = max(running, ph["allocated"], ph["phase_peak"] or 0)
            ph["peak_allocated"] = max(ph["peak_allocated"], running)
    return phases, running


def _segment_lift(phase: str, sims: list[Sim], ext) -> tuple[int, int]:
    """What a phase's high (and its non-state high) gains when each segment of its window is extrapolated
    to full depth on its own rather than the window's high as one (``ext``: simulate_full_depth's linear
    extrapolation over ``sims``, the shallow simulations).

    A window's high is the highest of several points of the step (the end of a micro-batch's forward,
    a gradient's allocation in its backward, ...), each linear in depth; their maximum is convex in
    depth, so a line through its values at two shallow depths lies below it further on wherever the
    highest point changes: at one or two blocks a fixed temporary can stand highest where, at full depth,
    the end of the forward does (autocast's cached 16-bit weights under checkpointing grow with every
    block). The segments (each micro-batch's forward and backward) separate such points; the gain is
    never negative (the highest segment's own line passes at least as high), and 0 where the segments
    are missing or do not match across the simulations."""
    segs = [s.segments.get(phase) for s in sims]
    if not all(segs) or len({len(x) for x in segs}) != 1:
        return 0, 0
    lifts = []
    for k in (0, 1):  # the peak, the non-state peak
        each = max(ext(lambda s, i=i, k=k: s.segments[phase][i][k]) for i in range(len(segs[0])))
        whole = ext(lambda s, k=k: max(x[k] for x in s.segments[phase]))
        lifts.append(max(0, each - whole))
    return lifts[0], lifts[1]


RESERVED_DEPTHS = (4, 8)  # units of depth per stack in the two traced simulations reserved is estimated from
FULL_DEPTH_REPLAY = (
    "reserved from a caching-allocator replay of a step simulated at full depth"  # replay_full_depth's note
)


def estimate_reserved(
    recipe: Recipe,
    config,
    sim: Sim,
    arch: Optional[tuple[int, int]],
    padded: bool = False,
    micro_batch: Optional[int] = None,
    workers: int = 1,
    images: Optional[tuple] = None,
    full_if_apart: bool = False,
) -> tuple[int, int, list[str], int]:
    """(peak reserved, least capacity, notes, least capacity with expandable segments or 0) on a CUDA
    device for the full-depth step ``sim``, from the caching allocator replayed over traced simulations
    (allocator.py). ``full_if_apart``: where the two extrapolations of reserved or of the least capacity
    lie more than FIT_UNCERTAINTY apart, replay the whole step instead (replay_full_depth).

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
        return replay_full_depth(recipe, config, arch, padded, micro_batch, images)
    args = [(recipe, config, d, True, micro_batch, padded, arch, True, images) for d in (a_depths, b_depths)]
    if workers > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("fork")) as ex:
            a, b = ex.map(_traced_sim, args)
    else:
        a, b = map(_traced_sim, args)

    on_device = [device_peak(x.phases, x.peak_allocated) for x in (a, b, sim)]

    def spread(get) -> float:
        return replayed_over_depth((get(a), on_device[0]), (get(b), on_device[1]), on_device[2])[1]

    def extrapolate(get) -> int:
        return replayed_over_depth((get(a), on_device[0]), (get(b), on_device[1]), on_device[2])[0]

    apart = max(spread(lambda x: x.reserved), spread(lambda x: x.needed))
    if full_if_apart and apart > FIT_UNCERTAINTY:
        # A reuse jump between 4 and 8 blocks deep (a fixed-size tensor's segment, like the logits', reused
        # at one depth and not at the other) makes both extrapolations unreliable: on Mistral-7B at
        # 4 x 4096 they lay 13 % apart and reserved came out 6 % above the full-depth replay.
        full_bytes, full_least, notes, full_expandable = replay_full_depth(
            recipe, config, arch, padded, micro_batch, images
        )
        notes = [
            notes[0] + f" (extrapolations from {RESERVED_DEPTHS[0]} and {RESERVED_DEPTHS[1]} blocks deep "
            f"lay {apart:.0%} apart)"
        ]
        return full_bytes, full_least, notes, full_expandable
    reserved, needed = extrapolate(lambda x: x.reserved), extrapolate(lambda x: x.needed)
    expandable = min(extrapolate(lambda x: x.needed_expandable), reserved) if b.needed_expandable else 0
    return (
        reserved,
        min(needed, reserved),
        [f"reserved from a {how} and one {a_depths[stacks[-1]]} deep, extrapolated to full depth"],
        expandable,
    )


def replay_full_depth(
    recipe: Recipe,
    config,
    arch: Optional[tuple[int, int]],
    padded: bool = False,
    micro_batch: Optional[int] = None,
    images: Optional[tuple] = None,
) -> tuple[int, int, list[str], int]:
    """estimate_reserved's figures from one traced simulation of the whole model: no extrapolation.

    Costs a simulation of every layer, so the planner asks for it only where the extrapolated figure
    decides the verdict (planner._reserved_and_needed). What the extrapolation cannot see: a fixed-size
    tensor's cached segment (the logits') pinned by a few activations at 4 and 8 blocks deep is a large
    share of a shallow step and none of a deep one, whose optimizer temporaries leave holes enough for
    those activations (Mistral-7B full fine-tune, 8 × 4096, bf16: 79.4 GiB needed from 4 and 8 blocks deep,
    67.8 GiB at full depth, where fms-acceleration's A100 80GB run reserved about 70 GiB)."""
    full = {st: get_depth(config, st) for st in model_stacks(config)}
    b = simulate(recipe, config, full, True, micro_batch, padded, arch, trace=True, images=images)
    return b.reserved, b.needed, [FULL_DEPTH_REPLAY], b.needed_expandable


def _traced_sim(args: tuple) -> Sim:
    return simulate(*args[:7], trace=args[7], images=args[8])


def step_kind(recipe: Recipe, strategy: str) -> tuple[bool, bool, bool]:
    """What ``strategy`` changes in the engine's single-device step: DeepSpeed with a 16-bit precision
    casts the whole module to 16 bits, which changes the step where some weights are fp32 (PEFT's fp32
    adapters, BLIP-2's fp32 Q-Former), the chunked loss is off under FSDP and DeepSpeed
    (engine.chunked_loss_head), and FSDP with a *-mixed precision computes on 16-bit gathered copies
    (dist.make_parallelize_fn). Equal kinds share one simulation."""
    sharded = strategy == "fsdp" or strategy.startswith("deepspeed")
    fp32_weights = (
        (recipe.peft.method != "none" and recipe.peft.adapter_dtype == "float32")
        or recipe.model.family == "image-to-text"
        or (recipe.model.quantize != "none" and recipe.model.upcast_unquantized)
    )
    fsdp_mixed = strategy == "fsdp" and recipe.precision.endswith("-mixed")
    return (
        zero_masters(recipe, strategy) and fp32_weights,
        bool(recipe.train.loss_chunk_tokens) and not sharded,
        fsdp_mixed,
    )


def sim_key(r: Recipe, micro: int) -> str:
    """Simulations depend only on these; variants that agree on them share one."""
    k = r.global_batch_size // (micro * r.devices) if r.train.global_batch_size else r.accumulate
    return json.dumps(
        [
            r.precision,
            r.train.activation_checkpointing,
            r.optim.name,
            r.optim.momentum,
            r.optim.implementation,
            r.optim.in_backward,
            r.data.max_seq_length,
            micro,
            min(k, 2),
            r.peft.method,
            r.peft.adapter_dtype,
            r.model.quantize,
            quant_backend(r) if r.model.quantize != "none" else None,
            r.model.upcast_unquantized,
            r.optim.zero_grad,
            step_kind(r, r.strategy),
            r.train.loss_chunk_tokens,
            r.tensor_parallel,  # one tensor-parallel rank's model (plan/tensor_parallel.rank_config)
            r.tensor_parallel > 1 and r.sequence_parallel,
        ]
    )


def zero_masters(recipe: Recipe, strategy: str) -> bool:
    """DeepSpeed with a 16-bit precision keeps fp32 master weights and fp32 optimizer state.

    DeepSpeed casts the module to bf16/fp16 itself and runs no autocast, so for it "-mixed" and
    "-true" are the same step: 16-bit weights, activations and gradients; the ZeRO optimizer
    holds an fp32 copy of its partition of the weights, steps fp32 state on it (from an fp32 copy
    of the gradient partition) and writes the 16-bit weights back.
    """
    return strategy.startswith("deepspeed") and recipe.precision != "32-true"


def simulation_recipe(recipe: Recipe, strategy: str) -> Recipe:
    """The recipe whose single-device step the simulation runs for ``strategy``.

    Under DeepSpeed a 16-bit mixed precision runs as true 16-bit (see zero_masters), and an
    offloaded ZeRO always steps with DeepSpeed's CPU Adam (the engine allows nothing else there).
    Where the strategy changes the step itself (step_kind), the copy carries it: simulate() reads it.
    """
    mixed = zero_masters(recipe, strategy) and recipe.precision.endswith("-mixed")
    adam = strategy.startswith("deepspeed") and strategy.endswith("_offload") and recipe.optim.name != "adamw"
    # ZeRO frees its gradients in its own step, whatever order optim.zero_grad asks for.
    late = strategy.startswith("deepspeed") and recipe.optim.zero_grad != "after_step"
    same_step = step_kind(recipe, recipe.strategy) == step_kind(recipe, strategy) and _same_base(recipe, strategy)
    # Tensor parallelism runs on FSDP2's mesh only: under any other strategy the whole model is simulated.
    whole = strategy != "fsdp" and recipe.tensor_parallel > 1
    if not (mixed or adam or late or whole) and same_step:
        return recipe
    r = copy.deepcopy(recipe)
    r.strategy = strategy
    if whole:
        r.tensor_parallel = 1
    if mixed:
        r.precision = "bf16-true"  # fp16 and bf16 have the same sizes
    if adam:
        r.optim.name = "adamw"
    if late:
        r.optim.zero_grad = "after_step"
    return r


def _same_base(recipe: Recipe, strategy: str) -> bool:
    """Whether ``strategy`` keeps the recipe's quantized base (model.quant_backend=auto: torchao's NF4 under
    FSDP, bitsandbytes elsewhere)."""
    if recipe.model.quantize == "none":
        return True
    other = copy.copy(recipe)
    other.strategy = strategy
    return quant_backend(recipe) == quant_backend(other)
