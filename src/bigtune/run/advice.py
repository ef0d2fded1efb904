"""What to change after an out-of-memory: the recipe keys that usually free the most, most effective first."""

from __future__ import annotations

from typing import Optional

from bigtune.recipe import Recipe

FRAGMENTED_BYTES = 2**30  # cached but unusable at the failure: from this much on, the allocator setting is advised


def oom_advice(r: Recipe, oom: Optional[dict] = None) -> list[str]:
    """What usually frees the most memory for this recipe, most effective first; ``oom`` (the run's
    record of the failure) adds what the failure itself showed: bytes cached but unusable."""
    out = []
    cached = (oom or {}).get("cached_unallocated_bytes")
    if (
        cached is not None
        and cached >= FRAGMENTED_BYTES
        and "expandable_segments:true" not in (r.train.cuda_alloc_conf.replace(" ", "").lower())
    ):
        out.append(
            f"train.cuda_alloc_conf=expandable_segments:True ({cached / 2**30:.2f} GiB were cached but unusable "
            "when the allocation failed: pieces of half-used segments; one growing segment per pool does not "
            "pin them, and `bigtune plan` replays that setting)"
        )
    if r.strategy == "fsdp" and r.fsdp_wrap == "none" and r.world_size > 1:
        out.append(
            "fsdp_wrap=block (one FSDP unit per decoder block: the whole model is no longer gathered at "
            "once, nor every gradient held unsharded until the backward ends)"
        )
    if r.strategy == "fsdp" and r.fsdp_grad_sync == "step" and r.accumulate > 1:
        out.append(
            "fsdp_grad_sync=micro_batch (gradients reduce-scattered after every micro-batch: each rank keeps "
            "only its shard, not every unsharded gradient through the window)"
        )
    if r.model.quantize == "nf4" and r.strategy == "fsdp" and not r.fsdp_cpu_offload and r.world_size > 1:
        out.append(
            "fsdp_cpu_offload=true (QLoRA under FSDP: the NF4 base's shards, the adapters' gradients and "
            "optimizer state move to host RAM; each block's 4-bit shard is copied back for its all-gather)"
        )
    elif r.model.quantize == "nf4" and r.world_size == 1 and r.peft.method == "lora":
        out.append(
            "strategy=fsdp with devices=2 or more (QLoRA across GPUs: torchao's NF4 base split by FSDP2, "
            "model.quant_backend=torchao; `bigtune plan RECIPE --alternatives` lists the counts that fit)"
        )
    if r.train.micro_batch_size > 1:
        half = max(1, r.train.micro_batch_size // 2)
        if r.optim.in_backward:  # it cannot accumulate: the global batch shrinks with it
            out.append(
                f"train.micro_batch_size={half} (roughly half the activations; optim.in_backward cannot "
                "accumulate, so the batch halves too)"
            )
        else:
            out.append(
                f"train.micro_batch_size={half} with train.accumulate_grad_batches={r.accumulate * 2} "
                "(same global batch, roughly half the activations)"
            )
    if not r.train.activation_checkpointing:
        out.append("train.activation_checkpointing=true (activations drop to about one layer input per layer)")
    if r.precision in ("32-true", "bf16-mixed", "16-mixed"):
        out.append("precision=bf16-true (halves parameters, gradients and optimizer state)")
    if r.optim.name == "adamw":
        out.append("optim.name=sgd (no optimizer state; expect slower convergence)")
    if not r.optim.in_backward and r.world_size == 1 and r.optim.name in ("adamw", "sgd", "adamw8bit", "adam8bit"):
        out.append(
            "optim.in_backward=true (each weight steps inside the backward: no full set of gradients; needs "
            "train.accumulate_grad_batches=1 and optim.grad_clip=null)"
        )
    return out
