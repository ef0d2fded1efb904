"""A model's Hugging Face config from a preset, a local folder, a bundled copy (assets/configs) or the hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from bigtune.core.hub import hub_kwargs
from bigtune.core.presets import PRESETS, preset_config, preset_processor, tiny_tokenizer
from bigtune.recipe import Recipe


class ModelError(RuntimeError):
    """The model or tokenizer could not be loaded; the message says why and what to do."""


CONFIG_DIR = Path(__file__).resolve().parents[1] / "assets" / "configs"


def bundled_config_path(name: str) -> Optional[Path]:
    p = CONFIG_DIR / (name.replace("/", "--") + ".json")
    return p if p.is_file() else None


def resolve_config(recipe: Recipe):
    """The model's HF config, from a preset, a local folder, a bundled copy, or the hub (in that order)."""
    return resolve_config_name(recipe.model)


def resolve_config_name(model_cfg):
    from transformers import AutoConfig

    name = model_cfg.name
    if name in PRESETS:
        image = PRESETS[name].family == "image-to-text"
        return preset_config(name, preset_processor(name) if image else tiny_tokenizer())
    local = Path(name).expanduser()
    if local.is_dir():
        return AutoConfig.from_pretrained(str(local), trust_remote_code=model_cfg.trust_remote_code)
    bundled = bundled_config_path(name)
    if bundled is not None:
        d = json.loads(bundled.read_text())
        d.pop("_bigtune_source", None)  # provenance note of a composed config, not a config key
        config = AutoConfig.for_model(d.pop("model_type"), **d)
        text = d.get("text_config") or {}
        if "tie_word_embeddings" in text:  # transformers 5 forces tying on a T5 sub-config; Flan-T5 unties
            config.text_config.tie_word_embeddings = text["tie_word_embeddings"]
        return config

    try:
        return AutoConfig.from_pretrained(
            name, revision=model_cfg.revision, trust_remote_code=model_cfg.trust_remote_code, **hub_kwargs(name)
        )
    except Exception as e:
        known = sorted(p.stem.replace("--", "/") for p in CONFIG_DIR.glob("*.json"))
        raise ModelError(
            f"model.name {name!r}: no config.json found (not a preset, not a local folder, not bundled, "
            f"hub unreachable: {type(e).__name__}). Point model.name at a folder holding its "
            f"config.json, or use a bundled one: {', '.join(known)}"
        ) from e
