"""QLoRA whose 4-bit base FSDP2 can shard: torchao NF4 weights, loaded one tensor at a time.

bitsandbytes' ``Params4bit`` does not survive ``fully_shard`` (measured: the shard becomes a plain uint8
DTensor and ``Linear4bit.forward`` asserts), so a sharded QLoRA base uses torchao's ``NF4Tensor``, which
implements FSDP2's all-gather extension: each rank holds a slice of the packed 4-bit data and its
quantization constants, and a block's weights are gathered as 4-bit bytes right before they are used.

The model is never whole in host RAM: built on the meta device (buffers real: rotary tables are computed
in ``__init__``), adapters added there, then each decoder block is filled from safetensors tensor by
tensor — linear weights quantized as they arrive — and handed to ``shard`` (FSDP2's ``fully_shard``,
which keeps this rank's slice and moves it to the device) before the next block is read. A rank's peak
host RAM while loading is then about one block plus the largest tensor, not the model.

DoRA (QDoRA): peft computes each magnitude vector from the base weight when the adapter is added, here on
the meta device; it is computed again, by peft's own code, once the block's weights are filled (before the
block is sharded), and DoRA's forward is handed the NF4 weight dequantized.
"""

from __future__ import annotations

import collections
import functools
import json
import math
import re
import resource
from pathlib import Path
from typing import Callable, Optional

import torch

from bigtune.models.build import (
    apply_peft,
    attention_for,
    auto_class,
    compute_dtype,
    decoder_blocks,
    enable_activation_checkpointing,
    load_hint,
    weights_dtype,
)
from bigtune.models.configs import ModelError
from bigtune.recipe import ModelConfig, PeftConfig

NF4_BLOCK = 64  # weights per absmax scaler (QLoRA's block size)
NF4_SCALER_BLOCK = 256  # scalers per double-quantization block
NF4_MAX_RANKS = 8  # tiny tensors get a smaller scaler block so that they still split over this many ranks

TORCHAO_INSTALL = "pip install 'bigtune[torchao]' (or pip install torchao)"


def nf4_scaler_block(numel: int) -> int:
    """Scalers per double-quantization block for a weight of ``numel`` elements: 256 (every real model),
    smaller only when the tensor is too small for its scalers to split into 256-blocks across 8 ranks.
    Depends on the tensor alone, so a 1-rank and an N-rank run quantize identically."""
    return max(1, math.gcd(NF4_SCALER_BLOCK, numel // (NF4_BLOCK * NF4_MAX_RANKS)))


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """The NF4 tensor of one linear weight (torchao; dequantizes to ``weight.dtype`` in the matmul)."""
    try:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4 as _to_nf4
    except ImportError:  # torchao < 0.15 kept it elsewhere
        try:
            from torchao.dtypes.nf4tensor import to_nf4 as _to_nf4
        except ImportError as e:
            raise ModelError(f"model.quant_backend=torchao needs torchao: {TORCHAO_INSTALL}") from e
    if weight.numel() % NF4_BLOCK:
        raise ModelError(f"NF4: a weight of shape {tuple(weight.shape)} is not a multiple of {NF4_BLOCK} elements")
    return _to_nf4(weight, NF4_BLOCK, nf4_scaler_block(weight.numel()))


def _nf4_linear(mod: torch.nn.Linear, compute: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """An NF4 layer's forward: the matmul in the 4-bit compute dtype whatever the hidden states' dtype (fp32
    with model.upcast_unquantized), the result cast back, as bitsandbytes' Linear4bit does. torchao alone
    would dequantize the weight to the input's dtype and run the matmul in fp32."""
    bias = None if mod.bias is None else mod.bias.to(compute)
    return torch.nn.functional.linear(x.to(compute), mod.weight, bias).to(x.dtype)


def is_nf4(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    return type(local).__name__ == "NF4Tensor"


def weights_folder(cfg: ModelConfig) -> Path:
    """The local folder of model.name: itself, or the hub snapshot (config, tokenizer, safetensors only)."""
    p = Path(cfg.name).expanduser()
    if p.is_dir():
        return p
    from huggingface_hub import snapshot_download

    from bigtune.core.hub import hub_kwargs

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(cfg.name, revision=cfg.revision, allow_patterns=patterns, **hub_kwargs(cfg.name)))
    except Exception as e:  # noqa: BLE001 - every hub failure becomes one explained error
        raise ModelError(load_hint("model", cfg.name, e)) from e


class _Weights:
    """Tensors of a safetensors folder (one file or an index), read one at a time."""

    def __init__(self, folder: Path, key_mapping: Optional[dict] = None):
        """``key_mapping``: regex → replacement from the stored names to the model's (the text model of a
        composite checkpoint, models.configs.TEXT_MODEL_OF)."""
        index = folder / "model.safetensors.index.json"
        if index.exists():
            mapping = json.loads(index.read_text())["weight_map"]
            where = {k: folder / f for k, f in mapping.items()}
        else:
            from safetensors import safe_open

            files = sorted(folder.glob("*.safetensors"))
            if not files:
                raise ModelError(f"model folder {folder}: no .safetensors weights (bigtune loads safetensors only)")
            where = {}
            for f in files:
                with safe_open(str(f), framework="pt") as h:
                    where.update({k: f for k in h.keys()})
        self.stored = {k: k for k in where}  # the model's name → the stored name
        for pattern, repl in (key_mapping or {}).items():
            self.stored.update({re.sub(pattern, repl, k): k for k in where if re.match(pattern, k)})
        self.where = {k: where[stored] for k, stored in self.stored.items()}

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        if key not in self.where:
            raise ModelError(f"weights: tensor {key!r} is not in the model folder's safetensors")
        # Opened per tensor: a file stays memory-mapped while its handle lives, and every page read
        # through the mapping would count in this process's resident set until the handle closes.
        with safe_open(str(self.where[key]), framework="pt") as h:
            return h.get_tensor(self.stored[key]).clone()


def _checkpoint_key(name: str) -> str:
    """The safetensors key of a parameter of the PEFT-wrapped model."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer.", ".")


def _fill(module: torch.nn.Module, prefix: str, ctx: dict) -> None:
    """Give every meta parameter and buffer under ``module`` real storage: base weights from the folder
    (block linears in NF4), adapters freshly initialised by peft (in module order: the same draws on
    every rank and for any world size)."""
    fresh = [  # LoRA layers whose adapters are still empty: initialised once all of them have storage
        m for m in module.modules() if hasattr(m, "reset_lora_parameters") and any(q.is_meta for q in m.parameters())
    ]
    for mod_name, mod in module.named_modules(prefix=prefix):
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_meta:
                continue
            full = f"{mod_name}.{name}" if mod_name else name
            # A tied weight (a head sharing the embeddings) is filled once; only those are remembered, so that
            # a block's whole weights are not kept alive once the block is sharded.
            tied = ctx.setdefault("tied", {})
            if id(p) in tied:
                mod._parameters[name] = tied[id(p)]
                continue
            if "lora_" in full:
                mod._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device="cpu"), p.requires_grad)
                continue
            t = ctx["weights"].get(_checkpoint_key(full))
            if name == "weight" and id(mod) in ctx["nf4_targets"]:
                t = to_nf4(t.to(device=ctx["quantize_on"], dtype=ctx["compute"]))
                _return_freed_memory()
            else:
                t = t.to(ctx["keep"] if t.is_floating_point() else t.dtype)
            mod._parameters[name] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
            if id(p) in ctx["shared"]:
                tied[id(p)] = mod._parameters[name]
        for name, b in list(mod._buffers.items()):
            if b is not None and b.is_meta:
                full = f"{mod_name}.{name}" if mod_name else name
                mod._buffers[name] = ctx["weights"].get(_checkpoint_key(full)).to(b.dtype)
    for mod in fresh:
        for adapter in mod.active_adapters:
            mod.reset_lora_parameters(adapter, True)
            if adapter in getattr(mod, "lora_magnitude_vector", {}):
                _init_dora_magnitude(mod, adapter)


class _DequantizedLinear(torch.nn.Module):
    """An NF4 layer as peft's DoRA code can read it: the weight dequantized (a plain tensor, not a
    parameter), the bias shared. peft's ``dequantize_module_weight`` calls ``weight.dequantize()`` on any
    torchao tensor, and torchao's NF4Tensor defines ``dequantize`` as a static helper of another signature
    (value, code), so handing peft the NF4 layer itself fails; a plain tensor it uses as it is."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        super().__init__()
        self.weight = weight
        self.bias = bias


def dequantized_weight(layer: torch.nn.Module) -> torch.Tensor:
    """``layer``'s weight in its own dtype: an NF4 weight dequantized (under FSDP2, inside the forward or
    backward where the block is gathered), any other as it is."""
    w = layer.weight
    return w.get_original_weight().to(w.dtype) if is_nf4(w) else w


def dora_reads_dequantized(
    model: torch.nn.Module,
    layers: set[int],
    dequantize: Callable[[torch.nn.Module], torch.Tensor] = dequantized_weight,
) -> None:
    """Make every DoRA adapter on a base layer whose id is in ``layers`` run peft's own forward
    (``DoraLinearLayer.forward``, unchanged) over ``dequantize(base layer)`` instead of the layer itself.
    The planner passes a copy of its emulated weight, as the engine's NF4 dequantization makes one."""
    for mod in model.modules():
        if id(getattr(mod, "base_layer", None)) in layers:
            for dora in getattr(mod, "lora_magnitude_vector", {}).values():
                dora.forward = functools.partial(_dora_forward, dora, dequantize)


def _dora_forward(dora: torch.nn.Module, dequantize, x: torch.Tensor, *, base_layer: torch.nn.Module, **kwargs):
    view = _DequantizedLinear(dequantize(base_layer).detach(), base_layer.bias)
    return type(dora).forward(dora, x, base_layer=view, **kwargs)


def _init_dora_magnitude(mod: torch.nn.Module, adapter: str) -> None:
    """Set DoRA's magnitude (‖W + scaling·BA‖ per output row) as peft does when it adds the adapter, by
    peft's own ``update_layer``, now that W and the adapters hold real values: peft computed it when the
    adapters were added, on the meta device, from no values. Computed where the base weight is (the GPU
    when quantized there), kept in the dtype and on the device of the placeholder it replaces."""
    if adapter not in mod.lora_A:
        raise ModelError(
            f"peft.method=dora with model.quant_backend=torchao: DoRA on {type(mod).__name__} layers is not supported "
            "on an NF4 base (linear layers only); leave embeddings out of peft.target_modules"
        )
    dora = mod.lora_magnitude_vector[adapter]
    placeholder = dora.weight
    base = mod.get_base_layer()
    w = dequantized_weight(base).detach()
    a, b = mod.lora_A[adapter].weight, mod.lora_B[adapter].weight
    dora.update_layer(
        base_layer=_DequantizedLinear(w, base.bias),
        lora_A=a.detach().to(w.device),
        lora_B=b.detach().to(w.device),
        scaling=mod.scaling[adapter],
    )
    magnitude = dora.weight.detach().to(device=placeholder.device, dtype=placeholder.dtype)
    dora.weight = torch.nn.Parameter(magnitude, requires_grad=placeholder.requires_grad)


def _prefixes(model: torch.nn.Module) -> dict[int, str]:
    return {id(m): n for n, m in model.named_modules()}


def build_nf4_peft_model(
    cfg: ModelConfig,
    peft_cfg: PeftConfig,
    folder: Path,
    precision: str,
    seed: int,
    checkpointing: bool,
    shard: Optional[Callable[[torch.nn.Module], None]] = None,
    quantize_on: Optional[torch.device] = None,
) -> tuple[torch.nn.Module, dict]:
    """(PEFT model with NF4 base, load report) from the safetensors in ``folder``.

    ``shard(module)`` is called on each decoder block once it is filled, then on the root (FSDP2's
    ``fully_shard``); without it the model stays whole on the CPU for Fabric to move. ``quantize_on``: the
    device that quantizes (the GPU when there is one: torchao's quantizer needs 16 × 2 B of workspace per
    element of the weight, 7.5 GB for a Llama-3-70B MLP weight, better spent on an empty GPU than per rank
    in host RAM); the NF4 weight stays there.
    The report holds this process's peak host RSS while loading and the NF4 base's bytes."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from bigtune.models.configs import text_model_of

    whole = AutoConfig.from_pretrained(str(folder), trust_remote_code=cfg.trust_remote_code)
    config, key_mapping = text_model_of(whole, cfg.family)  # Gemma 3: its text model alone
    attn, note = attention_for(cfg, config)
    if note:
        print(f"note: {note}", flush=True)
    config._attn_implementation = attn
    config.use_cache = False
    compute = compute_dtype(cfg, precision)
    keep = torch.float32 if cfg.upcast_unquantized else weights_dtype(precision)
    with init_empty_weights(include_buffers=False):
        model = auto_class(cfg.family).from_config(config, dtype=compute)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()  # a tied head shares the embeddings' (meta) parameter, filled once from the folder
    if checkpointing:
        enable_activation_checkpointing(model)
    blocks = decoder_blocks(model)
    nf4_targets = {id(m) for b in blocks for m in b.modules() if isinstance(m, torch.nn.Linear)}
    for mod in (m for b in blocks for m in b.modules() if isinstance(m, torch.nn.Linear)):
        mod.forward = functools.partial(_nf4_linear, mod, compute)
    model = apply_peft(model, peft_cfg, quantized=False, checkpointing=False, family=cfg.family)
    dora_reads_dequantized(model, nf4_targets)
    rss_before = _current_rss()  # code imported, model skeleton built: what follows is weights
    _reset_peak_rss()
    seen = collections.Counter(id(q) for _, q in model.named_parameters(remove_duplicate=False))
    ctx = {"shared": {i for i, n in seen.items() if n > 1}}
    ctx |= {"weights": _Weights(folder, key_mapping), "nf4_targets": nf4_targets, "compute": compute, "keep": keep}
    ctx["quantize_on"] = quantize_on or torch.device("cpu")
    names = _prefixes(model)
    torch.manual_seed(seed)
    for block in blocks:
        _fill(block, names[id(block)], ctx)
        if shard is not None:
            shard(block)
        _return_freed_memory()
    _fill(model, "", ctx)
    if shard is not None:
        shard(model)
    model.train()
    base = sum(_nf4_bytes(p) for p in model.parameters() if is_nf4(p))
    rss = _peak_rss()
    return model, {"rss_before_weights_bytes": rss_before, "load_peak_rss_bytes": rss, "nf4_base_bytes_this_rank": base}


def _return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS (glibc). Quantizing a tensor makes fp32 temporaries of
    several times its size; freed, they stay in glibc's arenas, fragmented, and a rank's resident set grew
    by ~80 MB per 134 M-parameter model block without this (measured: 8 blocks, +520 MB; trimmed, +90 MB)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _reset_peak_rss() -> None:
    """Start a new high-water mark of the resident set (Linux ≥ 4.0: writing 5 to clear_refs), so the
    peak read after loading is the loading's, not whatever the process did before."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_rss() -> Optional[int]:
    """Peak resident set since the last reset (VmHWM); the lifetime peak where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux units: KiB


def _current_rss() -> Optional[int]:
    """This process's resident set now (Linux /proc; None elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    import os

    return pages * os.sysconf("SC_PAGE_SIZE")


def _nf4_bytes(p: torch.Tensor) -> int:
    """Bytes this rank holds for one NF4 weight (its slice of the packed data and constants)."""
    from torch.distributed.tensor import DTensor

    t = p._local_tensor if isinstance(p, DTensor) else p
    names, _ = t.__tensor_flatten__()
    return sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)
