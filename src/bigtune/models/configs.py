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


# A bundled vision-language checkpoint's published processor settings (preprocessor_config.json and
# processor_config.json, with their source), beside its config: enough to plan it without the hub
PROCESSOR_DIR = CONFIG_DIR.parent / "processors"


# Checkpoints whose published image-processor settings are another's, file for file: the settings are
# bundled once. Qwen3-VL-2B/8B-Instruct ship the 4B's preprocessor_config.json (size 65,536 to 16,777,216
# px, patch 16, merge 2, as public copies of the 2B's and 8B's quote it).
SAME_PROCESSOR_AS = {
    "Qwen/Qwen3-VL-2B-Instruct": "Qwen/Qwen3-VL-4B-Instruct",
    "Qwen/Qwen3-VL-8B-Instruct": "Qwen/Qwen3-VL-4B-Instruct",
}


def bundled_processor_path(name: str) -> Optional[Path]:
    name = SAME_PROCESSOR_AS.get(name, name)
    p = PROCESSOR_DIR / (name.replace("/", "--") + ".json")
    return p if p.is_file() else None


def bundled_processor(model_cfg):
    """For planning offline: ``model_cfg``'s processor class at its checkpoint's bundled published settings,
    over a stand-in tokenizer with the config's special-token ids (core.tiny_vlm.standin_processor); None
    when no settings are bundled for it."""
    path = bundled_processor_path(model_cfg.name)
    if path is None or model_cfg.tokenizer is not None:
        return None
    from bigtune.core.tiny_vlm import standin_processor

    return standin_processor(_resolve_whole_config(model_cfg), json.loads(path.read_text(encoding="utf-8")))


def resolve_config(recipe: Recipe):
    """The model's HF config, from a preset, a local folder, a bundled copy, or the hub (in that order)."""
    return resolve_config_name(recipe.model)


# Checkpoints that hold a vision-language model whose text model is also a causal LM on its own. Fine-tuned
# as model.family causal-lm, bigtune builds the text model only (Gemma3ForCausalLM for a Gemma 3 4B/12B/27B
# checkpoint), so the vision tower (417 M parameters for Gemma 3) takes no memory, and loads the text weights
# under their names in the checkpoint: "language_model.model.*" as released, "model.language_model.*" as
# transformers 5 writes them.
TEXT_MODEL_OF = {
    "gemma3": {
        r"^language_model\.model\.": "model.",
        r"^model\.language_model\.": "model.",
        r"^language_model\.lm_head\.": "lm_head.",  # an untied head, as a checkpoint would store it
    },
}


def text_model_of(config, family: str):
    """(the config to build, the checkpoint key mapping or None) for ``family``: the text model's config
    and its key mapping when a causal LM is asked of a composite checkpoint listed in TEXT_MODEL_OF."""
    mapping = TEXT_MODEL_OF.get(getattr(config, "model_type", ""))
    if family != "causal-lm" or mapping is None:
        return config, None
    import copy

    text = copy.deepcopy(config.text_config)
    # the composite model decides whether its head is tied to the embeddings (stored once) or not
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", text.tie_word_embeddings)
    return text, mapping


def resolve_config_name(model_cfg):
    """The config bigtune builds for ``model_cfg`` (see ``text_model_of``)."""
    config = _resolve_whole_config(model_cfg)
    return text_model_of(config, model_cfg.family)[0]


def _resolve_whole_config(model_cfg):
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
