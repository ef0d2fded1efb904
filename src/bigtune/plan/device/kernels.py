"""Which attention kernel CUDA would run, for simulations that run on a CPU.

The planner simulates a training step on fake *CPU* tensors. For attention that is harmless as
long as CUDA would also pick a fused kernel: PyTorch's CPU flash kernel, CUDA's flash kernel and
its memory-efficient kernel all save the output and a per-row log-sum-exp, never the
sequence × sequence scores. But on some GPUs, dtypes and head layouts no fused CUDA kernel
applies, and ``scaled_dot_product_attention`` falls back to its *math* path, which materialises
the scores, upcasts 16-bit inputs to fp32 first (unless
``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)``) and saves the fp32 softmax for
backward: per layer ``batch × heads × seq² × 4`` bytes that the CPU simulation would never show.

The rules below follow PyTorch's ``sdp_utils.cpp`` (flash → memory-efficient → math; cuDNN
attention, preferred on some Hopper set-ups, saves what flash saves):

* flash: compute capability ≥ 8.0, fp16/bf16, no explicit mask, head dim ≤ 256; grouped-query
  attention (fewer key/value heads) allowed.
* memory-efficient: compute capability ≥ 5.0; fp16 and fp32 everywhere, bf16 only from 8.0;
  masks allowed; grouped-query heads only from ``MEM_EFFICIENT_GQA_TORCH`` on.
* otherwise math.

So the math path is what runs for bf16 on a V100 or T4 (no bf16 in either fused kernel below
sm80) and for fp32 on a grouped-query model (TinyLlama, Llama-3, Mistral, Qwen2) when
transformers passes ``enable_gqa`` (it does when a batch has no padding mask).

Dropout differs too (``cuda_dropout``): on a CPU, ``F.dropout`` multiplies by a noise tensor in the
input's dtype and autograd keeps that noise (4 bytes an element for fp32); on CUDA it runs the fused
``native_dropout`` kernel, which keeps a bool mask (1 byte). PyTorch's ``dropout`` takes the fused
kernel for CUDA inputs whenever ``0 < p < 1`` (``is_fused_kernel_acceptable`` in Dropout.cpp);
in-place dropout never does. LoRA's dropout, BERT's, OPT's and T5's (0.1 in their configs) run on
tensors as large as the layer inputs or the attention scores, so the difference is gigabytes.

And autocast (``cuda_autocast``): the simulation runs mixed precision under CPU autocast, whose op lists
are not CUDA's. CUDA autocast runs softmax, log_softmax, layer_norm and group_norm in fp32 (fp32
outputs); CPU autocast leaves them in bf16. An eager attention that calls ``softmax`` without a dtype
(BERT, DistilBERT, BLIP-2's vision tower and Q-Former, T5) therefore saves fp32 probabilities on a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

# PyTorch PR #191085 (July 2026) taught the CUDA memory-efficient kernel grouped-query heads; we
# assume it ships in 2.13. Before it, fp32 with enable_gqa=True falls back to math (reported on
# torch 2.11 in public issues).
MEM_EFFICIENT_GQA_TORCH = (2, 13)


def _torch_version() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int(parts[1])


def sdpa_backend(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    enable_gqa: bool,
    arch: tuple[int, int],
    torch_version: Optional[tuple[int, int]] = None,
    dtype: Optional[torch.dtype] = None,
) -> str:
    """'flash', 'efficient' or 'math': the kernel CUDA picks for these inputs on a GPU of
    compute capability ``arch`` (PyTorch's priority order, see the module docstring). ``dtype``
    overrides the query's (a simulation's stand-in dtype for the one the GPU will see)."""
    dtype = dtype or query.dtype
    head_dim = query.shape[-1]
    gqa = query.shape[-3] != key.shape[-3]
    if gqa and not enable_gqa:
        return "math"  # different head counts without enable_gqa: only the math path broadcasts
    if arch >= (8, 0) and dtype in (torch.float16, torch.bfloat16) and attn_mask is None and head_dim <= 256:
        return "flash"
    version = torch_version or _torch_version()
    efficient_dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if arch >= (8, 0) else ())
    if arch >= (5, 0) and dtype in efficient_dtypes and (not gqa or version >= MEM_EFFICIENT_GQA_TORCH):
        return "efficient"
    return "math"


def kernel_dtype(dtype: torch.dtype, bf16_is_fp16: bool = False) -> torch.dtype:
    """The dtype CUDA's SDPA kernel selection sees for a query of ``dtype`` inside the simulation.

    Autocast casts SDPA's inputs to its lower precision in the dispatcher, after this Python-level
    wrapper: under mixed precision an fp32 query (Llama's rotary embedding promotes q and k to fp32)
    reaches the kernel choice as bf16/fp16. The simulation's CPU autocast stands for CUDA's."""
    if dtype == torch.float32 and torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
    if bf16_is_fp16 and dtype == torch.bfloat16:
        dtype = torch.float16
    return dtype


@contextlib.contextmanager
def cuda_attention(arch: Optional[tuple[int, int]], bf16_is_fp16: bool = False):
    """Yields the set of kernel names chosen so far. Within this block, ``F.scaled_dot_product_attention`` takes the math path wherever CUDA on
    ``arch`` would (fused kernels stay on PyTorch's CPU flash kernel, which saves the same).
    ``bf16_is_fp16``: the simulation runs fp16 autocast as bf16 (the CPU has no fp16 autocast; the bytes are
    the same), so choose the kernel for fp16 — which, unlike bf16, the memory-efficient kernel takes below sm80."""
    used: set[str] = set()
    if arch is None:
        yield used
        return
    fused = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        backend = sdpa_backend(query, key, attn_mask, enable_gqa, arch, dtype=kernel_dtype(query.dtype, bf16_is_fp16))
        used.add(backend)
        if backend != "math":
            # CUDA's flash and memory-efficient kernels drop out inside the kernel (they keep an RNG seed,
            # no mask); PyTorch's CPU flash kernel takes no dropout and would send the fake step down the
            # math path (seq × seq scores and their noise saved). The values are fake; what is saved is not.
            return fused(
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=0.0,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )[0]

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield used
    finally:
        torch.nn.functional.scaled_dot_product_attention = fused


@contextlib.contextmanager
def cuda_dropout(enabled: bool):
    """Within this block, out-of-place training ``F.dropout`` runs ``aten.native_dropout`` as on a CUDA
    tensor: one kernel, the bool mask saved for backward (see the module docstring)."""
    if not enabled:
        yield
        return
    plain = torch.nn.functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if training and not inplace and 0 < p < 1 and input.numel() > 0:
            return torch.ops.aten.native_dropout(input, p, True)[0]
        return plain(input, p, training, inplace)

    torch.nn.functional.dropout = dropout
    try:
        yield
    finally:
        torch.nn.functional.dropout = plain


@contextlib.contextmanager
def cuda_autocast(enabled: bool):
    """Within this block, while (CPU) autocast is on, ``F.softmax``/``F.log_softmax`` without a dtype
    produce fp32 and ``F.layer_norm``/``F.group_norm`` run on fp32 inputs, as CUDA autocast's fp32 policy
    does (see the module docstring). Other ops keep CPU autocast's behaviour."""
    if not enabled:
        yield
        return
    F = torch.nn.functional
    plain = {name: getattr(F, name) for name in ("softmax", "log_softmax", "layer_norm", "group_norm")}
    low = (torch.bfloat16, torch.float16)

    def autocasting(x) -> bool:
        return isinstance(x, torch.Tensor) and x.dtype in low and torch.is_autocast_enabled("cpu")

    def to_fp32_output(name):
        def fn(input, dim=None, _stacklevel=3, dtype=None):
            if dtype is None and autocasting(input):
                dtype = torch.float32
            return plain[name](input, dim, _stacklevel, dtype)

        return fn

    def on_fp32_input(name):
        def fn(input, *args, **kwargs):
            return plain[name](input.float() if autocasting(input) else input, *args, **kwargs)

        return fn

    F.softmax, F.log_softmax = to_fp32_output("softmax"), to_fp32_output("log_softmax")
    F.layer_norm, F.group_norm = on_fp32_input("layer_norm"), on_fp32_input("group_norm")
    try:
        yield
    finally:
        for name, fn in plain.items():
            setattr(F, name, fn)
