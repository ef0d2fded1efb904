"""The arithmetic of a training step, in one tested place.

Loss normalisation over accumulation, token counts, throughput, FLOPs/MFU and byte formatting are
used by the engine, the planner and the benchmarks alike; keeping them here stops them drifting.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch

IGNORE_INDEX = -100

GIB = 1024**3


def target_token_count(labels: torch.Tensor, shift: bool = True) -> torch.Tensor:
    """Tokens that contribute to the loss: -100 is ignored; a causal LM's labels are shifted by one
    (``shift=False`` for encoder-decoder models, whose decoder labels are already aligned)."""
    return ((labels[..., 1:] if shift else labels) != IGNORE_INDEX).sum()


def causal_lm_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, shift: bool = True, class_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over all target tokens, computed in fp32.

    Summing lets the caller divide by the token count of the *whole* accumulated batch, so k
    micro-batches of b samples give exactly the loss and gradients of one batch of k·b samples,
    whatever the padding (a per-micro-batch mean would weight short micro-batches more).

    Sequence classification is the ``shift=False`` case with one target per sample: logits
    (batch, classes) against labels (batch,), so the "token count" is the sample count.
    ``class_weights`` (one per class) multiplies each target's cross-entropy by its class's weight;
    the sum is still divided by the target count (not by the summed weights, as torch's weighted
    mean would), so a weight of 2 counts a sample twice in every step.
    """
    if shift:
        # Shift the labels, not the logits (Hugging Face's loss does the same): slicing T-1 of T rows
        # would copy the whole logits tensor once more, and that copy's blocks round to another size
        # than the T-row logits and their gradient, so the caching allocator could reuse none of them
        # for the other and reserved grew by a logits-sized segment (issue #25, item 1).
        pad = torch.full_like(labels[..., :1], IGNORE_INDEX)
        labels = torch.cat([labels[..., 1:], pad], dim=-1)
    logits = logits.float()  # a no-op when the logits already are fp32 (Fabric's bf16-true output)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        labels.reshape(-1),
        weight=class_weights,
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def _chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Fabric hands a bf16-true model's outputs back in fp32: back to the weight's dtype (exact), so the
    # matmul runs as the output layer's would (autocast still applies under bf16-mixed).
    logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight).float()
    return torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_lm_loss_sum(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int, shift: bool = True
) -> torch.Tensor:
    """``causal_lm_loss_sum(hidden @ weight.T, labels)`` without ever holding the whole logits.

    ``hidden`` is what the output layer (a bias-free Linear with ``weight``) would receive. The
    logits and their fp32 copy exist for ``chunk_tokens`` tokens at a time, in forward and in
    backward: each chunk is checkpointed, so backward recomputes its logits (one extra output-layer
    matmul, vocab × hidden FLOPs ×2 per token) instead of keeping tokens × vocab × 10 bytes alive.
    """
    if shift:
        # Shift the labels rather than the hidden states: a view, not a copy; the last position
        # gets IGNORE_INDEX and contributes nothing.
        pad = torch.full_like(labels[..., :1], IGNORE_INDEX)
        labels = torch.cat([labels[..., 1:], pad], dim=-1)
    h = hidden.reshape(-1, hidden.size(-1))
    y = labels.reshape(-1)
    from torch.utils.checkpoint import checkpoint

    total = None
    for start in range(0, h.size(0), chunk_tokens):
        part = checkpoint(
            _chunk_loss_sum,
            h[start : start + chunk_tokens],
            weight,
            y[start : start + chunk_tokens],
            use_reentrant=False,
        )
        total = part if total is None else total + part
    return total


def loss_normaliser(
    micro_batch_labels: Iterable[torch.Tensor],
    world_size: int = 1,
    global_token_count: int | None = None,
    shift: bool = True,
) -> float:
    """Factor to multiply each micro-batch's summed loss by before backward.

    One optimizer step sees the target tokens of every micro-batch on every rank; the mean over
    all of them is sum/N. DDP then *averages* gradients over ranks, so each rank scales by
    world_size/N to end with the true global mean. ``world_size`` counts data-parallel ranks (those
    whose gradients are averaged; a tensor-parallel group is one), and N their tokens, each once.
    ``global_token_count`` is N when the caller already all-reduced it; otherwise N is counted from
    this rank's micro-batches.
    """
    n = global_token_count
    if n is None:
        n = int(sum(int(target_token_count(lb, shift)) for lb in micro_batch_labels))
    return world_size / max(n, 1)


@dataclass(frozen=True)
class FlopShape:
    """The sizes a decoder's training FLOPs depend on."""

    n_layers: int
    attn_dim: int  # num_attention_heads × head_dim
    trainable_matmul_params: int  # weights of Linear layers that receive gradients
    frozen_matmul_params: int  # Linear weights that only pass gradients through


def training_flops(shape: FlopShape, tokens: int | float, causal_pairs: int | float, backward: bool = True) -> float:
    """Model FLOPs of a forward (+ backward) over ``tokens`` tokens attending ``causal_pairs`` pairs."""
    matmul = 2.0 * (shape.trainable_matmul_params + shape.frozen_matmul_params) * tokens
    attention = 4.0 * shape.n_layers * shape.attn_dim * causal_pairs
    if not backward:
        return matmul + attention
    matmul_bwd = (4.0 * shape.trainable_matmul_params + 2.0 * shape.frozen_matmul_params) * tokens
    return matmul + matmul_bwd + 3.0 * attention


def causal_pairs(attention_mask: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> int:
    """(query, key) pairs a causal model attends in a batch: each real token sees itself and the
    earlier tokens of its own document, i.e. its position + 1. Padding (mask 0) attends nothing."""
    mask = attention_mask.long()
    pos = position_ids if position_ids is not None else mask.cumsum(-1) - 1
    return int(((pos + 1) * mask).sum())


def flop_shape(model: torch.nn.Module) -> Optional[FlopShape]:
    """FlopShape of a Hugging Face decoder (wrapped or not); None when its config lacks the sizes."""
    m = model
    while not hasattr(m, "config") and hasattr(m, "module"):
        m = m.module
    cfg = getattr(m, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    layers = getattr(cfg, "num_hidden_layers", None)
    heads = getattr(cfg, "num_attention_heads", None)
    hidden = getattr(cfg, "hidden_size", None)
    if not layers or not heads or not hidden:
        return None
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    trainable = frozen = 0
    for mod in model.modules():
        # Every Linear weight does a matmul per token; the input embedding is a lookup, not a matmul.
        if isinstance(mod, torch.nn.Linear):
            # ZeRO-3 leaves an empty placeholder in each weight and records the real size as ds_numel.
            n = getattr(mod.weight, "ds_numel", None) or mod.weight.numel()
            if mod.weight.requires_grad:
                trainable += n
            else:
                frozen += n
    return FlopShape(int(layers), int(heads * head_dim), trainable, frozen)


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float | None:
    """FLOPs per trained token on full rows of ``seq_len`` tokens (None when the shape is unknown)."""
    shape = flop_shape(model)
    if shape is None:
        return None
    return training_flops(shape, seq_len, seq_len * (seq_len + 1) / 2) / seq_len


def throughput(tokens: int, samples: int, seconds: float) -> dict[str, float]:
    seconds = max(seconds, 1e-12)
    return {"tokens_per_s": tokens / seconds, "samples_per_s": samples / seconds}


def mfu(flops_per_s: float | None, peak_flops: float | None, n_devices: int = 1) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak (None when unknown)."""
    if not flops_per_s or not peak_flops:
        return None
    return flops_per_s / (peak_flops * n_devices)


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that own memory behind ``t``: itself, or for a wrapper subclass (a DTensor's local
    shard, torchao's NF4Tensor: packed data + quantization constants) its inner tensors, recursively."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None:
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = [getattr(t, n) for n in names]
    return [leaf for x in inner if isinstance(x, torch.Tensor) for leaf in plain_tensors(x)]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by the distinct storages behind ``tensors`` (views and tied weights counted once;
    a DTensor (FSDP2 shard) counts this rank's piece, a wrapper subclass its inner tensors)."""
    seen: set[int] = set()
    keep = []  # hold the storage objects so their ids cannot be reused during the loop
    total = 0
    for t in (leaf for x in tensors if x is not None for leaf in plain_tensors(x)):
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            continue
        key = id(st)
        if key in seen:
            continue
        seen.add(key)
        keep.append(st)
        total += st.nbytes()
    return total


def numel_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """numel × element size, the byte count a tensor needs on its own (what tests compare against)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.3f}"


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
