"""Quantized weights in the simulation: packed 4-bit/8-bit bytes, emulated 4-bit matmuls, 8-bit optimizer state."""

from __future__ import annotations

import torch

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


def emulate_4bit(model: torch.nn.Module, compute: torch.dtype, upcast: bool = True) -> None:
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
    (emulate_4bit), so only the packed weights change here; int8 is analytic on top of a 16-bit
    simulation (its activations are under-counted: the real path keeps fp32 hidden states).
    """
    delta = 0
    quantized_ids = set()
    for name, mod in quantized_linears(model):
        w = mod.weight
        quantized_ids.add(id(w))
        delta += packed_weight_bytes(w, quantize, double_quant) - w.numel() * w.element_size()
    for name, p in model.named_parameters():
        if upcast and id(p) not in quantized_ids and "lora_" not in name and p.dtype in (torch.float16, torch.bfloat16):
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
