"""Loading models and tokenizers: built-in presets, local Hugging Face folders, hub ids.

Weights load from safetensors only (a folder with just pickle ``.bin`` files is refused with the
conversion to run), and remote code runs only when the recipe says ``trust_remote_code: true``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bigtune.presets import PRESETS, preset_config, tiny_tokenizer
from bigtune.recipe import ModelConfig

DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16, "bf16-mixed": torch.float32,
          "16-mixed": torch.float32, "16-true": torch.float16}


class ModelError(RuntimeError):
    """The model or tokenizer could not be loaded; the message says why and what to do."""


def weights_dtype(precision: str) -> torch.dtype:
    """Dtype the weights are stored in: *-true precisions keep them low, mixed keeps fp32 masters."""
    return DTYPES[precision]


def load_tokenizer(cfg: ModelConfig):
    if cfg.name in PRESETS and cfg.tokenizer is None:
        return tiny_tokenizer()
    if cfg.init == "random" and cfg.tokenizer is None and not Path(cfg.name).expanduser().is_dir():
        # Random weights are for memory/speed work: any token ids below the vocabulary size do, so the
        # bundled tokenizer stands in rather than a hub download (set model.tokenizer to use another).
        print(f"model: random init of {cfg.name}; tokenizing with bigtune's tiny tokenizer (ids < 512)", flush=True)
        return tiny_tokenizer()
    from transformers import AutoTokenizer

    src = cfg.tokenizer or cfg.name
    try:
        tok = AutoTokenizer.from_pretrained(_local_or_id(src), revision=cfg.revision,
                                            trust_remote_code=cfg.trust_remote_code)
    except Exception as e:  # transformers raises OSError/ValueError/HF hub errors
        raise ModelError(_load_hint("tokenizer", src, e)) from e
    if tok.pad_token is None:
        # Llama-family tokenizers ship without a pad token; padding positions are masked out of the
        # loss and attention anyway, so reusing EOS is safe.
        tok.pad_token = tok.eos_token or tok.unk_token
    tok.padding_side = "right"
    return tok


def _local_or_id(name: str) -> str:
    p = Path(name).expanduser()
    return str(p) if p.exists() else name


def _load_hint(what: str, name: str, e: Exception) -> str:
    local = Path(name).expanduser().exists()
    if local:
        return f"could not load the {what} from folder {name}: {e}"
    return (f"could not load the {what} {name!r} from the Hugging Face hub ({type(e).__name__}: {str(e)[:300]}). "
            "Without internet, download it elsewhere (`huggingface-cli download ...`) and set model.name to the "
            "local folder; for a gated model, log in with `huggingface-cli login`.")


def build_model(cfg: ModelConfig, tokenizer, precision: str, seed: int) -> torch.nn.Module:
    """The model in the dtype its precision stores weights in, in train mode."""
    from transformers import AutoModelForCausalLM

    dtype = weights_dtype(precision)
    if cfg.name in PRESETS or cfg.init == "random":
        if cfg.name in PRESETS:
            config = preset_config(cfg.name, tokenizer)
        else:
            from bigtune.planner import resolve_config_name

            config = resolve_config_name(cfg)
        config._attn_implementation = cfg.attn_implementation
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        name = _local_or_id(cfg.name)
        local = Path(name).is_dir()
        if local:
            files = {p.suffix for p in Path(name).iterdir()}
            if ".safetensors" not in files and (".bin" in files or ".pt" in files):
                raise ModelError(
                    f"model folder {name} has only pickle weights (.bin/.pt); bigtune loads safetensors only, because "
                    "unpickling can run code. Convert once: `python -c \"from transformers import "
                    "AutoModelForCausalLM as M; M.from_pretrained('" + name + "').save_pretrained('" + name +
                    "-st')\"` and point model.name at the new folder.")
        try:
            model = AutoModelForCausalLM.from_pretrained(
                name, dtype=dtype, revision=cfg.revision, trust_remote_code=cfg.trust_remote_code,
                use_safetensors=True, attn_implementation=cfg.attn_implementation)
        except Exception as e:
            raise ModelError(_load_hint("model", cfg.name, e)) from e
    model.config.use_cache = False  # the KV cache is useless in training and costs memory
    model.train()
    return model


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """HF per-layer checkpointing, non-reentrant (works with frozen inputs and keeps autograd hooks)."""
    kwargs = {"use_reentrant": False}
    # transformers >= 5.23 renamed the method (and its argument); 5.17 has only the old name.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        trainable += p.numel() if p.requires_grad else 0
    return {"total": total, "trainable": trainable}
