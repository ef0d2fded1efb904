"""Several devices and nodes: Fabric strategies (DDP, FSDP2, DeepSpeed ZeRO), rank helpers, full-state export.

One process per device. `bigtune train` with devices > 1 spawns them (Fabric's launcher re-runs the
command); under torchrun or Slurm the processes already exist and Fabric reads their environment.
Everything else in the engine is written once and asks this module how many ranks there are.

DeepSpeed (optional extra, CUDA only) differs from the torch strategies in four ways the engine
asks about here: the model and optimizer are set up together, gradient accumulation and clipping
are the DeepSpeed engine's (told where each window ends), the optimizer of the *_offload
strategies is DeepSpeed's CPU Adam, and the whole configuration is one dict (`deepspeed_config`).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Optional

import torch

from bigtune.models.build import decoder_blocks
from bigtune.recipe import DEEPSPEED_STRATEGIES, Recipe, RecipeError

DEEPSPEED_INSTALL = "pip install 'bigtune[deepspeed]' (or pip install deepspeed)"


def _fully_shard_kwargs(recipe: Recipe, mesh) -> dict[str, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs: dict[str, Any] = {"mesh": mesh}
    if recipe.precision in ("bf16-mixed", "16-mixed"):
        low = torch.bfloat16 if recipe.precision.startswith("bf16") else torch.float16
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
    if recipe.fsdp_cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    # full: FSDP2's default, every unit resharded after its forward except the root (embeddings,
    # head), which the backward needs at once. An explicit True would reshard the root too (torch
    # >= 2.8) and gather it again for the backward; the planner counts the root gathered throughout.
    if recipe.fsdp_sharding == "grad_op":
        kwargs["reshard_after_forward"] = False
    return kwargs


def make_parallelize_fn(recipe: Recipe):
    """fully_shard every decoder block (fsdp_wrap=block), then the root (embeddings, head) — FSDP2."""

    def parallelize(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(model, FSDPModule):  # sharded block by block while it loaded (NF4 QLoRA)
            return model
        kwargs = _fully_shard_kwargs(recipe, device_mesh["data_parallel"])
        tp = recipe.tensor_parallel
        plan = tensor_parallel_plan(model, tp, recipe.sequence_parallel) if tp > 1 else None
        if plan and recipe.sequence_parallel:  # the stack's entry and exit: the sequence split after the embeddings
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(model.get_decoder(), device_mesh["tensor_parallel"], sequence_parallel_stack_plan())
        # fsdp_wrap=none leaves the blocks to the root: one unit, the whole model gathered at once.
        for block in decoder_blocks(model) if recipe.fsdp_wrap == "block" else ():
            if plan:  # split across the tensor-parallel ranks first; FSDP2 then shards the DTensors over data_parallel
                from torch.distributed.tensor.parallel import parallelize_module

                parallelize_module(block, device_mesh["tensor_parallel"], plan)
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        return model

    return parallelize


# The block-level styles of transformers' base_model_tp_plan that bigtune applies (torch's Colwise/RowwiseParallel).
# Anything else in a block (fused projections, replicated norms whose gradients need a reduction, MoE experts)
# is refused rather than left replicated, where its gradient would silently be wrong.
_TP_STYLES = ("colwise", "rowwise")
_LLAMA_TP_PLAN = {
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "mlp.gate_proj": "colwise",
    "mlp.up_proj": "colwise",
    "mlp.down_proj": "rowwise",
}


def tensor_parallel_plan(model: torch.nn.Module, tp: int, sequence_parallel: bool = False) -> dict:
    """parallelize_module's plan for one decoder block of ``model`` split ``tp`` ways: the block entries
    (``layers.*.<name>``) of the config's base_model_tp_plan, else Llama's projection names. Embeddings, norms
    and the output layer are left whole (replicated across the group); with ``sequence_parallel`` the block's
    norms compute on the rank's share of the sequence instead (sequence_parallel_block_plan). Raises
    RecipeError naming tensor_parallel when the model cannot be split that way."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config = getattr(model, "config", None)
    config = getattr(config, "get_text_config", lambda: config)()
    name = type(model).__name__
    source = getattr(config, "base_model_tp_plan", None) or {}
    styles = {k.split(".*.", 1)[1]: v for k, v in source.items() if ".*." in k} or _LLAMA_TP_PLAN
    problems = [
        f"tensor_parallel={tp}: {name} needs tensor-parallel style {style!r} for {key}, which bigtune does not "
        f"apply (only {', '.join(_TP_STYLES)}); use tensor_parallel=1 for this model"
        for key, style in styles.items()
        if style not in _TP_STYLES
    ]
    block = decoder_blocks(model)[0]
    missing = [k for k in styles if not isinstance(_submodule(block, k), torch.nn.Linear)]
    if missing:
        problems.append(
            f"tensor_parallel={tp}: {name}'s decoder block has no nn.Linear {', '.join(missing)} to split ("
            + ("named by its config's base_model_tp_plan" if source else "no base_model_tp_plan: Llama's names tried")
            + "); use tensor_parallel=1 for this model"
        )
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        size = getattr(config, key, None)
        if size is not None and size % tp:
            problems.append(
                f"tensor_parallel={tp} does not divide the model's {key}={size}: each rank must hold whole "
                f"heads and an equal share of the MLP; pick a tensor_parallel that divides it"
            )
    if sequence_parallel and not problems:
        problems.extend(_sequence_parallel_problems(model, styles))
    if problems:
        raise RecipeError(problems)
    make = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    if sequence_parallel:
        return sequence_parallel_block_plan(styles)
    return {k: make[v]() for k, v in styles.items()}


# The Llama decoder layer's parts sequence parallelism re-lays out: norm → sublayer → residual add, twice.
_SP_NORMS = ("input_layernorm", "post_attention_layernorm")
_SP_SUBLAYERS = ("self_attn", "mlp")


def _sequence_parallel_problems(model: torch.nn.Module, styles: dict) -> list[str]:
    """Why ``model``'s blocks cannot run sequence parallel (empty when they can): the layout assumes Llama's
    decoder layer (two norms, each feeding one sublayer whose row-wise projection ends it) and a decoder
    stack with embed_tokens and a final norm."""
    name = type(model).__name__
    block = decoder_blocks(model)[0]
    decoder = getattr(model, "get_decoder", lambda: None)()
    missing = [k for k in (*_SP_NORMS, *_SP_SUBLAYERS) if _submodule(block, k) is None]
    missing += [f"the decoder's {k}" for k in ("embed_tokens", "norm") if _submodule(decoder, k) is None]
    rowwise = sorted(k.split(".", 1)[0] for k, v in styles.items() if v == "rowwise")
    if missing or rowwise != sorted(_SP_SUBLAYERS):
        return [
            f"sequence_parallel=true: {name} is not laid out like Llama's decoder (norm → self_attn / mlp ending in "
            f"one row-wise projection each; missing: {', '.join(missing) or 'none'}; row-wise projections in: "
            f"{', '.join(rowwise)}); use sequence_parallel=false"
        ]
    return []


def sequence_parallel_block_plan(styles: dict) -> dict:
    """One decoder block under sequence parallelism (the Megatron layout torchtitan applies to Llama): the norms
    and the residual stream hold the rank's share of the sequence (Shard(1)); each sublayer's input is
    all-gathered to the whole sequence (Replicate) before its column-wise projections, and its row-wise
    projection reduce-scatters its output back to Shard(1). The hidden states stay DTensors between the
    layers (use_local_output=False): the residual add then sees two Shard(1) tensors of the global shape."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict = {norm: SequenceParallel() for norm in _SP_NORMS}
    # HF's decoder layer calls self_attn(hidden_states=...) by keyword and mlp(hidden_states) positionally.
    plan["self_attn"] = PrepareModuleInput(
        input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()}
    )
    plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    for key, style in styles.items():
        if style == "colwise":
            plan[key] = ColwiseParallel()
        else:
            plan[key] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return plan


def sequence_parallel_stack_plan() -> dict:
    """The decoder stack's entry and exit under sequence parallelism. The embeddings keep their whole weight
    and output; their output is cut to the rank's Shard(1) (a local chunk, no communication) as a DTensor of
    the global shape, so the stack's causal mask and positions cover the whole sequence. Before the final norm
    the sequence is all-gathered back: that norm, the output layer and the loss run whole as without
    sequence parallelism (full logits), at the cost of one b × s × h tensor at the end of the stack."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput

    return {
        "embed_tokens": PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        ),
        "norm": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    }


def _submodule(module: torch.nn.Module, dotted: str) -> Optional[torch.nn.Module]:
    try:
        return module.get_submodule(dotted)
    except AttributeError:
        return None


def shard_while_loading(recipe: Recipe, fabric):
    """``fully_shard`` with the recipe's FSDP2 settings on Fabric's mesh, for a builder that shards each
    block as soon as it is filled (None unless strategy=fsdp). Fabric's setup then finds the model
    already sharded and keeps it."""
    if recipe.strategy != "fsdp":
        return None
    from torch.distributed.fsdp import fully_shard

    kwargs = _fully_shard_kwargs(recipe, fabric.strategy.device_mesh["data_parallel"])
    return lambda module: fully_shard(module, **kwargs)


def is_deepspeed(recipe: Recipe) -> bool:
    return recipe.strategy in DEEPSPEED_STRATEGIES


def zero_layout(strategy: str) -> tuple[int, bool, bool]:
    """(ZeRO stage, optimizer state offloaded to CPU, parameters offloaded to CPU) of a deepspeed_* name."""
    if strategy not in DEEPSPEED_STRATEGIES:
        raise ValueError(f"strategy: {strategy!r} is not a DeepSpeed strategy ({', '.join(DEEPSPEED_STRATEGIES)})")
    stage = int(strategy.split("_")[2])
    offload = strategy.endswith("_offload")
    return stage, offload, offload and stage == 3


# Parameters below this many elements stay whole on every rank under ZeRO-3 (norms, biases): gathering
# thousands of tiny tensors costs more in latency than the memory they would save.
PARAM_PERSISTENCE_THRESHOLD = 100_000

# Communication buckets (elements): big enough to keep NCCL busy, small enough not to dominate memory.
BUCKET_ELEMENTS = 200_000_000


def deepspeed_config(recipe: Recipe, numel: Optional[int] = None) -> dict[str, Any]:
    """The complete DeepSpeed config for a recipe (pure: no DeepSpeed import, no GPU).

    Batch sizes match the engine's loop (micro-batch per GPU, accumulation, global batch), clipping
    is DeepSpeed's (Fabric cannot clip under DeepSpeed), precision comes from the recipe, and the
    ZeRO section from the strategy name. Offloaded tensors are pinned for fast host-device copies.
    ``numel`` (the model's parameter count, when known) caps the communication buckets: DeepSpeed
    allocates them whole, and a bucket larger than the model is only wasted memory.
    """
    stage, offload_optimizer, offload_params = zero_layout(recipe.strategy)
    bucket = min(BUCKET_ELEMENTS, numel) if numel else BUCKET_ELEMENTS
    zero: dict[str, Any] = {
        "stage": stage,
        "contiguous_gradients": True,  # gradients copied into one flat buffer as they are reduced: no fragmentation
        "overlap_comm": True,  # reduce gradients while backward still runs
        "reduce_scatter": True,
        "reduce_bucket_size": bucket,
    }
    if stage == 2:
        zero["allgather_partitions"] = True
        zero["allgather_bucket_size"] = bucket
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = PARAM_PERSISTENCE_THRESHOLD
        zero["stage3_prefetch_bucket_size"] = max(1, bucket // 4)
        zero["stage3_max_live_parameters"] = 1_000_000_000
        zero["stage3_max_reuse_distance"] = 1_000_000_000
        # `bigtune` exports through save_pretrained on rank 0: gather the full 16-bit weights for it.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": recipe.train.micro_batch_size,
        "gradient_accumulation_steps": recipe.accumulate,
        "train_batch_size": recipe.global_batch_size,
        "zero_optimization": zero,
        # The engine's optimizers are torch's (or DeepSpeed's CPU Adam for offload): allow them.
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,  # bigtune logs; DeepSpeed's own prints would interleave
        "wall_clock_breakdown": False,
    }
    if recipe.optim.grad_clip is not None:
        cfg["gradient_clipping"] = recipe.optim.grad_clip
    if recipe.precision.startswith("bf16"):
        cfg["bf16"] = {"enabled": True}
    elif recipe.precision.startswith("16"):
        # Dynamic loss scaling (loss_scale 0), starting at 2^16 and halving on overflow.
        cfg["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    return cfg


def require_deepspeed():
    """Import DeepSpeed or raise one clear error naming the install."""
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError(
            f"DeepSpeed strategies need DeepSpeed: {DEEPSPEED_INSTALL}; or use strategy=fsdp ({type(e).__name__}: {e})"
        ) from None
    return deepspeed


def make_deepspeed_optimizer(recipe: Recipe, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer handed to DeepSpeed: the recipe's, except that offloaded ZeRO steps on the CPU
    with DeepSpeed's vectorised CPU Adam (DeepSpeed refuses other optimizers with offload)."""
    from bigtune.engine.optim import make_optimizer

    _, offload_optimizer, _ = zero_layout(recipe.strategy)
    if not offload_optimizer:
        return make_optimizer(recipe.optim, model, lr=recipe.lr)
    require_deepspeed()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    o = recipe.optim
    return DeepSpeedCPUAdam(
        [p for p in model.parameters() if p.requires_grad],
        lr=recipe.lr,
        betas=tuple(o.betas),
        eps=o.eps,
        weight_decay=o.weight_decay,
        adamw_mode=True,
    )


def micro_batch_context(fabric, model, last: bool, fsdp_grad_sync: str = "micro_batch"):
    """Around one micro-batch's forward/backward: no gradient sync before the window's last one.

    DDP: Fabric's no_backward_sync. FSDP reduce-scatters every micro-batch (fsdp_grad_sync=micro_batch):
    without the sync each rank would hold every weight's unsharded gradient through the window, as
    much as DDP, which is what sharding is for avoiding; fsdp_grad_sync=step asks for exactly that
    trade (less traffic). DeepSpeed: its engine reduces gradients itself and is told whether this
    micro-batch ends the accumulation window (a short last window then still steps).
    """
    if is_sharded(fabric):
        if fsdp_grad_sync == "step":
            return fabric.no_backward_sync(model, enabled=not last)
        return contextlib.nullcontext()
    engine = _deepspeed_engine(fabric)
    if engine is None:
        return fabric.no_backward_sync(model, enabled=not last)
    engine.set_gradient_accumulation_boundary(last)
    return contextlib.nullcontext()


def backward_kwargs(fabric) -> dict[str, Any]:
    """Extra arguments for fabric.backward: the engine's loss is already normalised over the whole
    window (stepmath.loss_normaliser), so DeepSpeed must not divide it by the accumulation steps again."""
    return {"scale_wrt_gas": False} if _deepspeed_engine(fabric) is not None else {}


def clips_itself(fabric) -> bool:
    """DeepSpeed clips inside its step (config gradient_clipping); Fabric refuses to clip there."""
    return _deepspeed_engine(fabric) is not None


def _deepspeed_engine(fabric):
    strategy = getattr(fabric, "strategy", None)
    if type(strategy).__name__ != "DeepSpeedStrategy":
        return None
    return strategy.model


MEMORY_NOTE_DEEPSPEED = (
    "memory: under DeepSpeed ZeRO parameters count their own partition and optimizer state includes the fp32 "
    "master partitions, but gradients live in DeepSpeed's flat reduce buffers, which the per-category tracker "
    "does not see: they appear under 'activations' (= allocated - the rest). allocated, peak and reserved come "
    "from the CUDA allocator and stay exact."
)


def make_strategy(recipe: Recipe, accelerator: str):
    """The Fabric strategy object for the recipe (or "auto" for one device)."""
    world = recipe.world_size
    strategy = recipe.strategy
    if strategy == "auto":
        strategy = "ddp" if world > 1 else "single"
    timeout = timedelta(seconds=recipe.dist_timeout_s)
    backend = "gloo" if accelerator == "cpu" else None
    if recipe.pipeline_parallel > 1:
        from bigtune.engine.pipeline import make_pipeline_strategy

        return make_pipeline_strategy(timeout, backend)
    if strategy == "single":
        return "auto"
    if strategy == "ddp":
        from lightning.fabric.strategies import DDPStrategy

        # ddp_bucket_view: gradients live in DDP's communication buckets instead of beside them, one copy fewer.
        return DDPStrategy(
            gradient_as_bucket_view=recipe.ddp_bucket_view, timeout=timeout, process_group_backend=backend
        )
    if strategy == "fsdp":
        from lightning.fabric.strategies import ModelParallelStrategy

        return ModelParallelStrategy(
            parallelize_fn=make_parallelize_fn(recipe),
            data_parallel_size=world // recipe.tensor_parallel,
            tensor_parallel_size=recipe.tensor_parallel,
            timeout=timeout,
            process_group_backend=backend,
        )
    if strategy in DEEPSPEED_STRATEGIES:
        require_deepspeed()
        from lightning.fabric.strategies import DeepSpeedStrategy

        # Adapter runs checkpoint only what trains, as with the other strategies.
        return DeepSpeedStrategy(
            config=deepspeed_config(recipe),
            timeout=timeout,
            process_group_backend=backend,
            exclude_frozen_parameters=recipe.peft.method != "none",
        )
    raise ValueError(f"strategy: unknown {strategy!r}")


def is_sharded(fabric) -> bool:
    from lightning.fabric.strategies import ModelParallelStrategy

    return isinstance(fabric.strategy, ModelParallelStrategy)


def full_state_dict(fabric, module: torch.nn.Module, trainable_only: bool = False) -> dict | None:
    """The unsharded state dict on CPU, on every rank's call, returned on rank 0 only (FSDP and
    ZeRO-3 export); None when every rank already holds the whole model."""
    engine = _deepspeed_engine(fabric)
    if engine is not None:
        if engine.zero_optimization_stage() != 3:
            return None
        # A collective: every rank gathers its partitions (config stage3_gather_16bit_weights_on_model_save).
        sd = engine._zero3_consolidated_16bit_state_dict()
        return {k: v.cpu() for k, v in sd.items()} if fabric.global_rank == 0 else {}
    from bigtune.engine.pipeline import gather_state_dict, is_pipeline

    if is_pipeline(fabric):  # each rank holds one stage: gathered piece by piece
        return gather_state_dict(fabric, module)
    if not is_sharded(fabric):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # An adapter run saves only what trains: its frozen (possibly NF4) base is never gathered whole.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    sd = get_model_state_dict(module, options=options)
    return sd if fabric.global_rank == 0 else {}


TRAINABLE_STATE_FILE = "bigtune_state.pt"


def save_sharded_trainable(fabric, path, module: torch.nn.Module, optimizer, rest: dict) -> None:
    """FSDP2 adapter runs: a distributed checkpoint of what trains only (adapters and their optimizer state),
    which Fabric's ModelParallelStrategy refuses to write (it cannot load filtered checkpoints). Every rank
    writes its shards; rank 0 adds ``rest`` (scheduler, loop counters, RNG) beside them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(ignore_frozen_params=True)
    model_sd, optim_sd = get_state_dict(module, optimizer, options=opts)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))
    if fabric.global_rank == 0:
        torch.save(rest, str(path / TRAINABLE_STATE_FILE))
    fabric.barrier()


def load_sharded_trainable(path, module: torch.nn.Module, optimizer) -> dict:
    """The inverse of ``save_sharded_trainable``: adapters and optimizer state back into the sharded model
    (the frozen base came from its source); returns ``rest``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    opts = StateDictOptions(ignore_frozen_params=True)
    model_sd, optim_sd = get_state_dict(module, optimizer, options=opts)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    # strict=False: the frozen base is absent from the checkpoint by design
    opts = StateDictOptions(ignore_frozen_params=True, strict=False)
    set_state_dict(
        module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=opts
    )
    return torch.load(str(path / TRAINABLE_STATE_FILE), weights_only=True)


_PEER_FAILURE_SIGNS = (
    "timed out",
    "timeout",
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "nccl error",
    "nccl communicator was aborted",
)


def collective_failure_hint(error: BaseException, recipe: Recipe, world_size: int) -> Optional[str]:
    """One line explaining a failed collective (another rank died or hung), naming dist_timeout_s."""
    text = str(error).lower()
    if world_size <= 1 or not any(sign in text for sign in _PEER_FAILURE_SIGNS):
        return None
    return (
        f"distributed: a collective failed ({str(error).splitlines()[0][:160]}): another rank crashed, was "
        f"killed or hung, and this rank gave up after dist_timeout_s={recipe.dist_timeout_s} s; see the other "
        "ranks' logs for the first failure. If ranks legitimately wait longer (a slow checkpoint write, data "
        "loading on one rank), raise dist_timeout_s."
    )


def data_parallel(fabric) -> tuple[int, int]:
    """(this rank's index, number of ranks) in the data-parallel dimension: the ranks that read different
    micro-batches. Every rank of a tensor-parallel group has the same index (it reads the same batches), and
    so has every stage of a pipeline (one data-parallel rank)."""
    from bigtune.engine.pipeline import is_pipeline

    if is_pipeline(fabric):
        return 0, 1
    if is_sharded(fabric):
        mesh = fabric.strategy.device_mesh["data_parallel"]
        return mesh.get_local_rank(), mesh.size()
    return fabric.global_rank, fabric.world_size


def tensor_parallel_size(fabric) -> int:
    return fabric.strategy.device_mesh["tensor_parallel"].size() if is_sharded(fabric) else 1


def all_sum(fabric, value: float | int, data_parallel_only: bool = False) -> float:
    """``value`` summed over every rank, or over this rank's data-parallel group only (counts of what the ranks
    read: under tensor parallelism each group reads the same batches, so a sum over all ranks would count
    them tensor_parallel times)."""
    from bigtune.engine.pipeline import is_pipeline

    if fabric.world_size == 1 or data_parallel_only and is_pipeline(fabric):  # the stages read the same batches
        return value
    group = None
    if data_parallel_only and tensor_parallel_size(fabric) > 1:
        mesh = fabric.strategy.device_mesh["data_parallel"]
        if mesh.size() == 1:
            return value
        group = mesh.get_group()
    t = torch.tensor(float(value), dtype=torch.float64, device=fabric.device)
    return float(fabric.all_reduce(t, group=group, reduce_op="sum"))


def clip_gradients(fabric, model: torch.nn.Module, optimizer, max_norm: float) -> torch.Tensor:
    """Clip to a global gradient norm. Under tensor parallelism the gradients are DTensors on two meshes (the
    split projections on data_parallel × tensor_parallel, the replicated rest on data_parallel only), which
    torch's clip_grad_norm_ cannot stack: each mesh's norm is reduced to a full one, then combined. Pipeline
    stages combine their norms likewise. Returns the total norm before clipping (a 0-dim device tensor)."""
    from bigtune.engine.pipeline import global_grad_norm_clip, is_pipeline

    if is_pipeline(fabric):
        return global_grad_norm_clip(model, max_norm)
    if tensor_parallel_size(fabric) == 1:
        # error_if_nonfinite would sync with the host every step; a non-finite loss is caught at logging.
        return fabric.clip_gradients(model, optimizer, max_norm=max_norm, error_if_nonfinite=False)
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    # As Fabric does before its clip (a 16-mixed loss scaler); .optimizer: the torch one under Fabric's wrapper.
    fabric.strategy.precision.unscale_gradients(getattr(optimizer, "optimizer", optimizer))
    groups: dict = {}
    for p in model.parameters():
        if p.grad is not None:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for params in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in params])
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack(norms))
    # implicit_replication: the plain total norm multiplies each DTensor gradient as if replicated (it is).
    with implicit_replication():
        for params in groups.values():  # one mesh per call: a foreach op across meshes is refused
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
