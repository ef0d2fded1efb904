"""Quantized weights in the simulation: packed 4-bit/8-bit bytes, emulated 4-bit matmuls, 8-bit optimizer state."""

from __future__ import annotations

from dataclasses import dataclass

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


def block_quant_constants(model: torch.nn.Module, quantize: str, double_quant: bool) -> tuple[int, int]:
    """(bytes of bitsandbytes' quantization constants, elements of the quantized weights) of one decoder block.
    The constants are absmax, nested absmax and codes: everything but the packed data. ZeRO-3 partitions and
    gathers the packed data (half a byte a weight) with the other parameters, but the constants live on each
    Parameter's quant_state, whole on every rank."""
    from bigtune.models.build import decoder_blocks

    if quantize not in ("nf4", "fp4"):
        return 0, 0
    try:
        block = decoder_blocks(model)[0]
    except ValueError:
        return 0, 0
    ids = {id(m) for _, m in quantized_linears(model)}
    weights = [m.weight for m in block.modules() if id(m) in ids]
    constants = sum(packed_weight_bytes(w, quantize, double_quant) - w.numel() // 2 for w in weights)
    return constants, sum(w.numel() for w in weights)


# bitsandbytes' CUDA gemm_4bit (backends/cuda/ops.py, 0.50): for more than 1536 rows (tokens) it dequantizes the
# weight into a compute-dtype temporary and calls F.linear; for fewer, a per-architecture heuristic may pick a
# fused kernel that reads the packed weight (its fallback dequantizes too: at most one weight's bytes more).
DEQUANTIZED_ABOVE_ROWS = 1536


class _Fake4bitMatmul(torch.autograd.Function):
    """bitsandbytes' 4-bit matmul as memory sees it: the forward saves nothing but the (packed)
    weight and, past DEQUANTIZED_ABOVE_ROWS tokens, multiplies by a dequantized compute-dtype temporary;
    the backward dequantizes the weight into such a temporary for the input gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        rows = x.numel() // max(1, x.shape[-1])
        return torch.nn.functional.linear(x, weight.clone() if rows > DEQUANTIZED_ABOVE_ROWS else weight, bias)

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


# --- torchao NF4 (model.quant_backend=torchao: QLoRA that FSDP2 shards) -------------------------------------
NF4_BLOCK = 64  # weights per int8 scaler; torchao's quantization_factor: one per scaler block of those
NF4_LOOKUP = 16  # entries of the NF4 code table every NF4Tensor carries (in the source dtype)


def nf4_storage_bytes(numel: int, scaler_block: int, src_bytes: int = 2) -> tuple[int, int, int, int, int]:
    """Bytes of the five storages of one torchao NF4Tensor of ``numel`` weights made from ``src_bytes``-byte
    elements: (quantized_data: 4 bits a weight, quantized_scalers: one int8 per 64, quantization_factor: one
    source-dtype element per ``scaler_block`` scalers, scaler_mean: one element, nf4: the 16-entry code)."""
    return (
        numel // 2,
        numel // NF4_BLOCK,
        numel // (NF4_BLOCK * scaler_block) * src_bytes,
        src_bytes,
        NF4_LOOKUP * src_bytes,
    )


def _round(n: int, round_to: int) -> int:
    return -(-n // round_to) * round_to


def nf4_weight_bytes(shape: tuple[int, ...], src_bytes: int = 2, ranks: int = 1, round_to: int = 1) -> int:
    """One rank's bytes of one NF4 weight of ``shape`` split over ``ranks`` by FSDP2.

    fully_shard splits quantized_data, quantized_scalers and quantization_factor along dim 0, padded to a
    multiple of the world size (so every rank holds ceil(rows / ranks) rows' worth); scaler_mean and the
    code table are replicated. Each storage is rounded up to ``round_to`` (512: CUDA's caching allocator).
    The scaler block is the engine's own (models.nf4.nf4_scaler_block), chosen from the whole tensor."""
    from bigtune.models.nf4 import nf4_scaler_block

    numel = 1
    for d in shape:
        numel *= d
    rows = -(-shape[0] // ranks)
    local = numel // shape[0] * rows
    data, scalers, factor, mean, lookup = nf4_storage_bytes(local, nf4_scaler_block(numel), src_bytes)
    return sum(_round(b, round_to) for b in (data, scalers, factor, mean, lookup))


@dataclass(frozen=True)
class NF4Base:
    """What the planner needs of a torchao NF4 base beyond the simulated step: the NF4 weights of one
    decoder block (every block has the same), the other parameters' bytes in a block and outside the
    blocks (FSDP gathers those as they are), the NF4 source dtype's element size, and the host RAM the
    biggest single tensor takes while loading (read in the checkpoint's 16 bits, then converted)."""

    block_shapes: tuple[tuple[int, ...], ...]
    block_other_bytes: int
    root_bytes: int
    src_bytes: int
    largest_load_bytes: int

    def block_nf4_bytes(self, ranks: int = 1, round_to: int = 1) -> int:
        return sum(nf4_weight_bytes(s, self.src_bytes, ranks, round_to) for s in self.block_shapes)


def nf4_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    """The nn.Linear layers whose weights the torchao path stores in NF4: those inside the decoder blocks
    (not the embeddings, the output head or the norms), adapters excluded."""
    from bigtune.models.build import decoder_blocks

    out = []
    for block in decoder_blocks(model):
        for name, mod in block.named_modules():
            if isinstance(mod, torch.nn.Linear) and "lora_" not in name:
                out.append(mod)
    return out


def nf4_dequantized(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` dequantized as torchao's ``NF4Tensor.get_original_weight`` (torchao 0.18) does it, with the
    same temporaries in the same order, so that the allocator sees its transient peak: for n = numel/2
    packed bytes, the high and low nibbles (uint8, n) widened to int64 (8n each, alive to the end),
    each looked up in the 16-entry code (n values each), each scaled by a flattened copy of its block
    scalers (n values, then freed) into n values, and the two stacked into the result (2n values):
    14 bytes a weight at the stack for a 16-bit dtype, against 2 for the result alone."""
    n = weight.numel() // 2
    f = torch.empty(n, dtype=torch.uint8, device=weight.device)
    first = f.to(torch.long)
    del f
    f = torch.empty(n, dtype=torch.uint8, device=weight.device)
    second = f.to(torch.long)
    del f
    looked_up = [torch.empty(n, dtype=dtype, device=weight.device) for _ in (first, second)]
    scaled = []
    for _ in looked_up:
        repeated = torch.empty(n, dtype=dtype, device=weight.device)  # the scalers, expanded and flattened
        scaled.append(torch.empty(n, dtype=dtype, device=weight.device))
        del repeated
    out = torch.empty(weight.shape, dtype=dtype, device=weight.device)  # torch.stack(...).reshape(shape)
    del first, second, looked_up, scaled
    return out


class _FakeNF4Matmul(torch.autograd.Function):
    """torchao's LinearNF4 as memory sees it, called as the engine calls it (models/nf4.py: input cast to
    the compute dtype, the weight's dtype here, result cast back outside): the forward dequantizes the
    weight into a temporary for the matmul and saves only the (NF4) weight; the backward dequantizes it
    again for the input gradient (no weight gradient)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(weight)
        out = torch.nn.functional.linear(x, nf4_dequantized(weight, x.dtype))
        return out if bias is None else out + bias.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad @ nf4_dequantized(weight, grad.dtype), None, None


def emulate_nf4(model: torch.nn.Module, compute: torch.dtype, upcast: bool = True) -> list[torch.nn.Linear]:
    """Make a fake model behave like the torchao NF4 base for memory (the NF4 weights' own bytes are swapped
    in afterwards, nf4_parameter_delta): decoder-block linear weights in the compute dtype NF4 is made from,
    every other 16-bit weight in fp32 where ``upcast`` (model.upcast_unquantized), and each NF4 layer's
    matmul as torchao's. Returns the NF4 layers."""
    layers = nf4_linears(model)
    ids = {id(m.weight) for m in layers}
    for p in model.parameters():
        if upcast and id(p) not in ids and p.dtype in (torch.float16, torch.bfloat16):
            p.data = p.data.to(torch.float32)
    for mod in layers:
        mod.weight.data = mod.weight.data.to(compute)

        def forward(x, mod=mod):
            return _FakeNF4Matmul.apply(x.to(compute), mod.weight, mod.bias).to(x.dtype)

        mod.forward = forward
    return layers


def emulate_nf4_dora(model: torch.nn.Module) -> None:
    """DoRA on the emulated NF4 layers as the engine runs it (models/nf4.py): peft's DoRA forward over the
    weight dequantized into a compute-dtype temporary, alive while the adapter's weight norm is computed
    (nf4_dequantized, as _FakeNF4Matmul makes one for the matmul)."""
    from bigtune.models.nf4 import dora_reads_dequantized

    layers = {id(m) for m in nf4_linears(model)}
    dora_reads_dequantized(model, layers, lambda layer: nf4_dequantized(layer.weight, layer.weight.dtype))


def nf4_parameter_delta(model: torch.nn.Module, round_to: int = 1) -> int:
    """Bytes that storing the emulated NF4 layers' weights as NF4Tensors changes (their simulated weights
    are in the compute dtype; every storage rounded up to ``round_to`` as the simulation's tracker does)."""
    delta = 0
    for mod in nf4_linears(model):
        w = mod.weight
        delta += nf4_weight_bytes(tuple(w.shape), w.element_size(), 1, round_to) - _round(
            w.numel() * w.element_size(), round_to
        )
    return delta


def nf4_base(model: torch.nn.Module) -> NF4Base:
    """The NF4Base of a model made by emulate_nf4 (with its adapters)."""
    from bigtune.models.build import decoder_blocks

    blocks = decoder_blocks(model)
    layers = nf4_linears(model)
    nf4_ids = {id(m.weight) for m in layers}
    first = [m for m in blocks[0].modules() if isinstance(m, torch.nn.Linear) and id(m.weight) in nf4_ids]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    src = layers[0].weight.element_size() if layers else 2

    def load(p: torch.Tensor) -> int:
        # Read from the checkpoint in 16 bits, then converted: to NF4, or to the kept dtype (a copy where it differs).
        read = p.numel() * 2
        if id(p) in nf4_ids:
            return read + nf4_weight_bytes(tuple(p.shape), src)
        return read + (p.numel() * p.element_size() if p.element_size() != 2 else 0)

    return NF4Base(
        block_shapes=tuple(tuple(m.weight.shape) for m in first),
        block_other_bytes=sum(p.numel() * p.element_size() for p in blocks[0].parameters() if id(p) not in nf4_ids),
        root_bytes=sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_blocks),
        src_bytes=src,
        largest_load_bytes=max((load(p) for n, p in model.named_parameters() if "lora_" not in n), default=0),
    )
