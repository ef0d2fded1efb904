"""Export a finished run as a Hugging Face folder that plain `transformers` loads.

A full fine-tune already is one (<run>/model); --dtype rewrites it in another precision. An adapter
run is exported as its peft adapter folder, or with --merge as one model: the base weights (the
run's <run>/base for presets and random init, else model.name) are loaded *unquantized* in the
chosen dtype, the adapters are folded in, and the result is saved. For QLoRA this means the merged
model is built on the original full-precision base, the usual choice: a dequantized 4-bit base would
carry the quantization error into every later use.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from bigtune.recipe import load_recipe


class ExportError(ValueError):
    """The run cannot be exported as asked; the message says why and what to do."""


def _dtype(name: str, precision: str) -> torch.dtype:
    if name == "auto":
        return (
            torch.bfloat16
            if precision.startswith("bf16")
            else (torch.float16 if precision.startswith("16") else torch.float32)
        )
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _replace_dir(tmp: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)


def export_run(run_dir: str | Path, merge: bool = False, dtype: str = "auto", out: Optional[str | Path] = None) -> Path:
    """Write the export and return its folder (written to a temporary name, then renamed)."""
    from transformers import AutoTokenizer

    from bigtune.core.processors import AutoImageTextProcessor
    from bigtune.models.build import auto_class

    run = Path(run_dir)
    if not (run / "recipe.yaml").is_file():
        raise ExportError(f"{run} is not a bigtune run directory (no recipe.yaml)")
    recipe = load_recipe(run / "recipe.yaml", ["accelerator=cpu"])
    AutoModelForCausalLM = auto_class(recipe.model.family)  # BLIP-2 runs: AutoModelForImageTextToText
    # image-to-text runs save a processor (image processor + tokenizer); copy all of it
    AutoTokenizer = AutoImageTextProcessor if recipe.model.family == "image-to-text" else AutoTokenizer  # noqa: N806
    torch_dtype = _dtype(dtype, recipe.precision)
    adapter, full = run / "adapter", run / "model"
    if adapter.is_dir():
        if not merge:
            dest = Path(out) if out else run / "export-adapter"
            tmp = dest.with_name(f".{dest.name}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(adapter, tmp)
            _replace_dir(tmp, dest)
            return dest
        from peft import PeftModel

        from bigtune.core.hub import hub_kwargs
        from bigtune.models.build import peft_renames_quiet, save_as_loaded, text_model_kwargs

        base = run / "base" if (run / "base").is_dir() else None
        source = str(base) if base else recipe.model.name
        try:
            model = AutoModelForCausalLM.from_pretrained(
                source,
                dtype=torch_dtype,
                use_safetensors=True,
                revision=None if base else recipe.model.revision,
                trust_remote_code=recipe.model.trust_remote_code,
                **hub_kwargs(source),
                **text_model_kwargs(source, recipe.model.family, None if base else recipe.model.revision),
            )
        except Exception as e:
            raise ExportError(
                f"could not load the base model {source!r} to merge into ({type(e).__name__}: "
                f"{str(e)[:300]}); make it reachable (local folder or hub) and retry"
            ) from e
        with peft_renames_quiet():
            model = PeftModel.from_pretrained(save_as_loaded(model), str(adapter)).merge_and_unload()
        tokenizer_src = adapter
        dest = Path(out) if out else run / "merged"
    elif full.is_dir():
        if not merge and dtype == "auto" and out is None:
            return full  # already a Hugging Face folder
        model = AutoModelForCausalLM.from_pretrained(str(full), dtype=torch_dtype, use_safetensors=True)
        tokenizer_src = full
        dest = Path(out) if out else run / f"export-{str(torch_dtype).split('.')[-1]}"
    else:
        raise ExportError(
            f"{run} holds no trained model (no model/ or adapter/): train with checkpoint.save_model=true"
        )
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(tokenizer_src)).save_pretrained(tmp)
    _replace_dir(tmp, dest)
    return dest
