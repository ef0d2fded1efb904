"""The arithmetic of a training step, in one tested place.

Loss normalisation over accumulation, token counts, throughput, FLOPs/MFU and byte formatting are
used by the engine, the planner and the benchmarks alike; keeping them here stops them drifting.
"""

from __future__ import annotations

from typing import Iterable

import torch

IGNORE_INDEX = -100
GIB = 1024**3


def target_token_count(labels: torch.Tensor, shift: bool = True) -> torch.Tensor:
    """Tokens that contribute to the loss: -100 is ignored; a causal LM's labels are shifted by one
    (``shift=False`` for encoder-decoder models, whose decoder labels are already aligned)."""
    return ((labels[..., 1:] if shift else labels) != IGNORE_INDEX).sum()


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor, shift: bool = True,
                       class_weights: torch.Tensor | None = None) -> torch.Tensor:
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
    shift_logits = (logits[..., :-1, :] if shift else logits).float()
    shift_labels = labels[..., 1:] if shift else labels
    return torch.nn.functional.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1), weight=class_weights,
        ignore_index=IGNORE_INDEX, reduction="sum")


def loss_normaliser(micro_batch_labels: Iterable[torch.Tensor], world_size: int = 1,
                    global_token_count: int | None = None, shift: bool = True) -> float:
    """Factor to multiply each micro-batch's summed loss by before backward.

    One optimizer step sees the target tokens of every micro-batch on every rank; the mean over
    all of them is sum/N. DDP then *averages* gradients over ranks, so each rank scales by
    world_size/N to end with the true global mean. ``global_token_count`` is N when the caller
    already all-reduced it; otherwise N is counted from this rank's micro-batches.
    """
    n = global_token_count
    if n is None:
        n = int(sum(int(target_token_count(lb, shift)) for lb in micro_batch_labels))
    return world_size / max(n, 1)


def decoder_flops_per_token(n_matmul_params: int, n_layers: int, hidden: int, seq_len: int,
                            backward: bool = True) -> float:
    """Model FLOPs per token of a decoder-only transformer (forward, or forward + backward).

    2 FLOPs per weight per token for every matmul weight, plus causal attention scores and their
    weighted sum: 2·2·s·h per layer for full attention, halved because only the lower triangle is
    useful work. Backward costs twice the forward. This is the MFU convention (no recomputation).
    """
    forward = 2.0 * n_matmul_params + 2.0 * n_layers * seq_len * hidden
    return forward * (3.0 if backward else 1.0)


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float | None:
    """FLOPs per trained token for a Hugging Face decoder model (None when the shape is unknown)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    layers = getattr(cfg, "num_hidden_layers", None)
    hidden = getattr(cfg, "hidden_size", None)
    if not layers or not hidden:
        return None
    # Every Linear weight does a matmul per token; the input embedding is a lookup, not a matmul.
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return decoder_flops_per_token(n, layers, hidden, seq_len)


def throughput(tokens: int, samples: int, seconds: float) -> dict[str, float]:
    seconds = max(seconds, 1e-12)
    return {"tokens_per_s": tokens / seconds, "samples_per_s": samples / seconds}


def mfu(tokens_per_s: float, flops_per_token: float | None, peak_flops: float | None, n_devices: int = 1) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak (None when unknown)."""
    if not flops_per_token or not peak_flops:
        return None
    return tokens_per_s * flops_per_token / (peak_flops * n_devices)


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by the distinct storages behind ``tensors`` (views and tied weights counted once)."""
    seen: set[int] = set()
    keep = []  # hold the storage objects so their ids cannot be reused during the loop
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = getattr(t, "_local_tensor", None)  # a DTensor (FSDP2 shard): count this rank's piece
        if local is not None:
            t = local
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
