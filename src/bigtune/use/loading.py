"""Loading what a user points at for inference: a Hugging Face folder, a bigtune run directory (its model
or its base plus adapter) or an adapter folder; safetensors only, no remote code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


class InferError(ValueError):
    """The model, prompts or options cannot be used as given; the message says what is wrong and the fix."""


def resolve_dtype(dtype: str, device: str):
    """``auto``: the checkpoint's own dtype on a GPU, float32 on a CPU (half-precision CPU matmuls are slow)."""
    import torch

    if dtype not in DTYPE_NAMES:
        raise InferError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPE_NAMES)}")
    if dtype == "auto":
        return "auto" if device.startswith("cuda") else torch.float32
    return getattr(torch, dtype)


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InferError(f"device {device!r} was asked for but PyTorch sees no CUDA GPU; use --device cpu (or auto)")
    return device


def _has_safetensors(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file()


def _check_model_folder(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise InferError(
            f"{folder} has no config.json, so it is not a Hugging Face model folder; point at the "
            "folder that holds config.json and the *.safetensors weights"
        )
    if not _has_safetensors(folder):
        pickles = [p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
        if pickles:
            raise InferError(
                f"{folder} holds only pickle weights ({', '.join(sorted(pickles)[:3])}); bigtune loads safetensors "
                'only, because unpickling can run code. Convert once with `python -c "from transformers import '
                f"AutoModelForCausalLM as M; M.from_pretrained('{folder}').save_pretrained('{folder}-st')\"` and "
                "use the new folder"
            )
        raise InferError(
            f"{folder} has a config.json but no *.safetensors weights; copy the weights in or point "
            "at a complete model folder"
        )


def _load_model(source: str, torch_dtype, device: str):
    from transformers import AutoModelForCausalLM

    from bigtune.core.hub import hub_kwargs
    from bigtune.models.build import text_model_kwargs

    try:
        model = AutoModelForCausalLM.from_pretrained(
            source,
            dtype=torch_dtype,
            use_safetensors=True,
            trust_remote_code=False,
            **hub_kwargs(source),
            **text_model_kwargs(source),
        )
    except Exception as e:  # transformers raises OSError/ValueError/hub errors
        local = Path(source).expanduser().exists()
        hint = (
            "check that the folder is complete"
            if local
            else "without internet, download it elsewhere (`huggingface-cli download ...`) and use the local folder"
        )
        raise InferError(
            f"could not load the model from {source!r} ({type(e).__name__}: {str(e)[:300]}); {hint}"
        ) from e
    return model.to(device)


def load_first(what: str, loader, candidates, hint: str):
    """``loader.from_pretrained`` on the first candidate folder that works (remote code off)."""
    from bigtune.core.hub import hub_kwargs

    errors = []
    for src in candidates:
        if src is None:
            continue
        try:
            return loader.from_pretrained(str(src), trust_remote_code=False, **hub_kwargs(str(src)))
        except Exception as e:  # noqa: BLE001 - try the next place it may live
            errors.append(f"{src}: {type(e).__name__}: {str(e)[:200]}")
    raise InferError(f"could not load {what} (" + "; ".join(errors) + f"); {hint}")


def load_saved_tokenizer(*candidates: Path | str):
    from transformers import AutoTokenizer

    return load_first(
        "a tokenizer",
        AutoTokenizer,
        candidates,
        "save one next to the weights with `tokenizer.save_pretrained(FOLDER)`",
    )


def adapter_base(adapter: Path) -> str:
    """Where an adapter's base weights are: the run's base/ if it has one, else what adapter_config names."""
    run = adapter.parent
    if (run / "base").is_dir() and (run / "base" / "config.json").is_file():
        return str(run / "base")
    try:
        cfg = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise InferError(f"{adapter / 'adapter_config.json'} cannot be read ({e}); re-export the adapter") from e
    base = cfg.get("base_model_name_or_path")
    if not base and (run / "recipe.yaml").is_file():
        import yaml

        recipe = yaml.safe_load((run / "recipe.yaml").read_text(encoding="utf-8")) or {}
        base = (recipe.get("model") or {}).get("name")
    if not base:
        raise InferError(
            f"adapter {adapter} does not say which base model it belongs to (no "
            "base_model_name_or_path in adapter_config.json); set it there to the base model's folder "
            "or hub id"
        )
    from bigtune.core.presets import PRESETS

    if base in PRESETS:
        raise InferError(
            f"adapter {adapter} was trained on the random-init preset {base!r}, whose weights were not "
            "kept; retrain with checkpoint.save_model=true (the run then keeps <run>/base)"
        )
    p = Path(base).expanduser()
    if p.is_absolute() and not p.exists():
        raise InferError(
            f"adapter {adapter} names base model folder {base}, which no longer exists; put the base "
            "weights back there or edit base_model_name_or_path in adapter_config.json"
        )
    if p.is_dir():
        _check_model_folder(p)
    return base


def _finish(model, tokenizer):
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    tokenizer.padding_side = "left"
    model.eval()
    return model, tokenizer


def locate_model(path_or_run: str) -> tuple[Optional[Path], Optional[Path]]:
    """(model folder, None) or (None, adapter folder) for what ``--model`` names: a Hugging Face model
    folder, a peft adapter folder, or a bigtune run directory (its ``model/``, else its ``adapter/``).
    One clear error otherwise. Shared by generate/eval, caption and predict."""
    path = Path(path_or_run).expanduser()
    if not path.exists():
        raise InferError(
            f"{path_or_run}: no such file or folder; give a Hugging Face model folder, a bigtune run "
            "directory (runs/NAME) or an adapter folder"
        )
    if not path.is_dir():
        raise InferError(
            f"{path_or_run} is a file; give the folder that holds config.json (a model), "
            "adapter_config.json (an adapter) or recipe.yaml (a bigtune run)"
        )
    if (path / "adapter_config.json").is_file():
        return None, path
    for folder in (path, path / "model"):
        if (folder / "config.json").is_file():
            _check_model_folder(folder)
            return folder, None
    if (path / "adapter" / "adapter_config.json").is_file():
        return None, path / "adapter"
    if (path / "recipe.yaml").is_file() or (path / "summary.json").is_file():
        raise InferError(
            f"run {path} holds no trained model (no model/ or adapter/ folder); train it with "
            "checkpoint.save_model=true"
        )
    raise InferError(
        f"{path} is neither a model folder (config.json + *.safetensors), an adapter folder "
        "(adapter_config.json) nor a bigtune run directory (model/ or adapter/); point at one of "
        "those"
    )


def attach_adapter(model, adapter: Path, base: str):
    """``model`` (the base) with the peft adapter at ``adapter`` attached, not merged."""
    from peft import PeftModel

    from bigtune.models.build import peft_renames_quiet

    try:
        with peft_renames_quiet():
            return PeftModel.from_pretrained(model, str(adapter), is_trainable=False)
    except Exception as e:
        raise InferError(
            f"could not attach adapter {adapter} to base {base} ({type(e).__name__}: {str(e)[:300]}); "
            "check that the adapter was trained on this base model"
        ) from e


def load_for_inference(path_or_run: str, dtype: str = "auto", device: str = "auto"):
    """(model, tokenizer) ready for ``generate``/``evaluate``, in eval mode, tokenizer padding on the left.

    ``path_or_run``: a Hugging Face model folder (config.json + safetensors), a bigtune run directory
    (``model/``, or ``adapter/`` on top of ``base/`` or the base named in adapter_config.json), or a
    peft adapter folder. Adapters are attached with peft and not merged.
    """
    folder, adapter = locate_model(path_or_run)
    device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, device)
    if folder is not None:
        return _finish(_load_model(str(folder), torch_dtype, device), load_saved_tokenizer(folder))
    base = adapter_base(adapter)
    model = attach_adapter(_load_model(base, torch_dtype, device), adapter, base)
    model.to(device)
    base_dir = Path(base) if Path(base).is_dir() else base
    return _finish(model, load_saved_tokenizer(adapter, base_dir))


def device_of(model):
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover - a model without parameters
        import torch

        return torch.device("cpu")


def write_text_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as fh:
        fh.write(text)
    os.replace(tmp, path)


def model_family(path_or_run: str) -> str:
    """causal-lm, image-to-text or sequence-classification, from the config.json (or adapter config)
    of a model folder, run directory or adapter folder; causal-lm when nothing says otherwise."""
    path = Path(path_or_run).expanduser()
    for folder in (path, path / "model", path / "adapter"):
        adapter = folder / "adapter_config.json"
        config = folder / "config.json"
        if adapter.is_file():
            try:
                task = json.loads(adapter.read_text(encoding="utf-8")).get("task_type")
            except (OSError, json.JSONDecodeError):
                task = None
            if task == "SEQ_CLS":
                return "sequence-classification"
            base = folder.parent / "base" / "config.json"
            config = base if base.is_file() else config
        if config.is_file():
            try:
                cfg = json.loads(config.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError):
                return "causal-lm"
            archs = [str(a) for a in cfg.get("architectures") or []]
            if any(a.endswith("ForSequenceClassification") for a in archs):
                return "sequence-classification"
            if "vision_config" in cfg:
                return "image-to-text"
            return "causal-lm"
    return "causal-lm"
