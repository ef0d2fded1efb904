"""Export a finished run as a Hugging Face folder that plain `transformers` loads.

A full fine-tune already is one (<run>/model); --dtype rewrites it in another precision. An adapter
run is exported as its peft adapter folder, or with --merge as one model: the base weights (the
run's <run>/base for presets and random init, else model.name) are loaded *unquantized* in the
chosen dtype, the adapters are folded in, and the result is saved. For QLoRA this means the merged
model is built on the original full-precision base, the usual choice: a dequantized 4-bit base would
carry the quantization error into every later use.

``push_folder`` uploads the written folder to a Hugging Face Hub model repository (``export --push``),
with huggingface_hub's own client: the repository is created when missing, then the folder is
committed; the token is huggingface_hub's (HF_TOKEN or `hf auth login`), the hub its HF_ENDPOINT.
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


def check_push(repo_id: str, api=None):
    """The HfApi to push with, once ``repo_id`` is a valid repository id and a token is there (checked before
    the export, which can take minutes, and before any request). Raises ExportError naming the fix."""
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ExportError(
            f"--push {repo_id!r}: not a Hub repository id ({e}); give owner/name, e.g. me/my-lora"
        ) from None
    api = api if api is not None else HfApi()
    if not (api.token or get_token()):
        raise ExportError(
            f"--push {repo_id}: no Hugging Face token; set HF_TOKEN to a token with write access or run "
            "`hf auth login`, then export again"
        )
    return api


def push_folder(folder: str | Path, repo_id: str, private: bool = False, api=None) -> str:
    """Upload ``folder`` to the model repository ``repo_id`` (created if missing, private if asked);
    returns the commit's URL. ``api``: a huggingface_hub ``HfApi`` (default: one with the user's token)."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    folder = Path(folder)
    api = check_push(repo_id, api)
    later = f"or upload it later with `hf upload {repo_id} {folder}`"
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(
            folder_path=str(folder),
            repo_id=repo_id,
            repo_type="model",
            commit_message=f"Upload {folder.name} (bigtune export)",
        )
    except OfflineModeIsEnabled:
        raise ExportError(f"--push {repo_id}: HF_HUB_OFFLINE is set; unset it to push, {later}") from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else None
        first = str(e).splitlines()[0][:200]
        if status in (401, 403):
            fix = "the token cannot write there: use a token with write access to it (HF_TOKEN or `hf auth login`)"
        else:
            fix = "check the repository id (owner/name) and your access to it"
        raise ExportError(f"--push {repo_id}: the hub at {api.endpoint} refused ({first}); {fix}, {later}") from None
    except (OSError, *_http_errors()) as e:  # refused or timed-out connections, a failed name lookup
        reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}" if str(e) else type(e).__name__
        raise ExportError(
            f"--push {repo_id}: could not reach the Hugging Face Hub at {api.endpoint} ({reason}); check the "
            f"network, a proxy or HF_ENDPOINT, {later}"
        ) from None
    return str(getattr(commit, "commit_url", commit))


def _http_errors() -> tuple[type, ...]:
    """The HTTP client's own error base (connection refused, timeouts): huggingface_hub's HTTP error derives
    from it, whichever client its version uses (httpx-style clients: HTTPError, not an OSError)."""
    from huggingface_hub.errors import HfHubHTTPError

    return tuple(b for b in HfHubHTTPError.__bases__ if b is not OSError and issubclass(b, Exception))
