"""Several devices and nodes: Fabric strategies (DDP, FSDP2), rank helpers, full-state export.

One process per device. `bigtune train` with devices > 1 spawns them (Fabric's launcher re-runs the
command); under torchrun or Slurm the processes already exist and Fabric reads their environment.
Everything else in the engine is written once and asks this module how many ranks there are.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from bigtune.recipe import Recipe


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks FSDP wraps one by one: the items of the model's block lists
    (``nn.ModuleList`` of one class: LlamaDecoderLayer, OPTDecoderLayer, T5Block, BLIP-2's vision
    encoder and Q-Former layers), outermost only, since a block sharded inside another sharded block
    is an overlapping mesh. HF's ``_no_split_modules`` is the fallback for models without such lists."""
    blocks = [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) and len(lst) > 0
              and len({type(x) for x in lst}) == 1 for m in lst]
    if not blocks:
        names: set[str] = set()
        for m in model.modules():
            names.update(getattr(m, "_no_split_modules", None) or [])
        blocks = [m for m in model.modules() if type(m).__name__ in names]
    inner = {id(c) for b in blocks for c in b.modules() if c is not b}
    blocks = [b for b in blocks if id(b) not in inner]
    if not blocks:
        raise ValueError(f"FSDP: found no transformer blocks to shard in {type(model).__name__} "
                         "(no block lists, no _no_split_modules); use strategy=ddp for this model")
    return blocks


def make_parallelize_fn(recipe: Recipe):
    """fully_shard every decoder block, then the root (embeddings, head) — FSDP2."""

    def parallelize(model: torch.nn.Module, device_mesh) -> torch.nn.Module:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        kwargs: dict[str, Any] = {"mesh": device_mesh["data_parallel"]}
        if recipe.precision in ("bf16-mixed", "16-mixed"):
            low = torch.bfloat16 if recipe.precision.startswith("bf16") else torch.float16
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32)
        if recipe.fsdp_cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        reshard = recipe.fsdp_sharding != "grad_op"
        for block in decoder_blocks(model):
            fully_shard(block, reshard_after_forward=reshard, **kwargs)
        fully_shard(model, reshard_after_forward=reshard, **kwargs)
        return model

    return parallelize


def make_strategy(recipe: Recipe, accelerator: str):
    """The Fabric strategy object for the recipe (or "auto" for one device)."""
    world = recipe.world_size
    strategy = recipe.strategy
    if strategy == "auto":
        strategy = "ddp" if world > 1 else "single"
    timeout = timedelta(seconds=recipe.dist_timeout_s)
    backend = "gloo" if accelerator == "cpu" else None
    if strategy == "single":
        return "auto"
    if strategy == "ddp":
        from lightning.fabric.strategies import DDPStrategy

        # Gradients live in DDP's communication buckets instead of beside them: one copy fewer.
        return DDPStrategy(gradient_as_bucket_view=True, timeout=timeout, process_group_backend=backend)
    if strategy == "fsdp":
        from lightning.fabric.strategies import ModelParallelStrategy

        return ModelParallelStrategy(parallelize_fn=make_parallelize_fn(recipe), data_parallel_size=world,
                                     tensor_parallel_size=1, timeout=timeout, process_group_backend=backend)
    raise ValueError(f"strategy: unknown {strategy!r}")


def is_sharded(fabric) -> bool:
    from lightning.fabric.strategies import ModelParallelStrategy

    return isinstance(fabric.strategy, ModelParallelStrategy)


def full_state_dict(fabric, module: torch.nn.Module) -> dict | None:
    """The unsharded state dict on CPU, on every rank's call, returned on rank 0 only (FSDP export)."""
    if not is_sharded(fabric):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if fabric.global_rank == 0 else {}


def all_sum(fabric, value: float | int) -> float:
    if fabric.world_size == 1:
        return value
    t = torch.tensor(float(value), dtype=torch.float64, device=fabric.device)
    return float(fabric.all_reduce(t, reduce_op="sum"))
