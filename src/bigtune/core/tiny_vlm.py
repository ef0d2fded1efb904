"""Tiny random-init vision-language models of any image-text-to-text family transformers ships (issue #46).

The decoder-family presets (``presets._family``) take a config class at its defaults and shrink its size
keys; this does the same for a composite vision-language config: its text model and its vision tower shrink
to a few layers of width 32-64, every per-layer list cut to the new depth. The processor is built offline as
the other tiny presets build theirs: the family's processor class over the bundled tokenizer, with the
special tokens that processor asks for added to it, the family's image processor (its PIL variant where
there is one) at a small image size, and a neutral chat template that writes the image as the processor's
own placeholder (``processor.image_token``), which the processor then expands. A real checkpoint brings
its own chat template; this template only stands in for it.

Where a family's processor takes geometry the model must agree with (tokens per image, patch sizes) it is
read from the tiny config (``_PROCESSOR_GEOMETRY``), each with the reason.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Optional

# the bundled tokenizer (core.presets.TOKENIZER_FILE; named here again so that presets can build its
# generic-path presets from this module without an import circle)
TOKENIZER_FILE = Path(__file__).resolve().parents[1] / "assets" / "tiny_tokenizer.json"

# The bundled tokenizer's turns in Zephyr's layout (as TINY_CHAT_TEMPLATE), content given as parts: an image
# part is written as the processor's placeholder (IMAGE_PLACEHOLDER is replaced with it), a text part as is.
IMAGE_PLACEHOLDER = "@@IMAGE@@"
GENERIC_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '" + IMAGE_PLACEHOLDER + "' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ eos_token + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

TEXT_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    # mixture of experts: 4 experts of width 64, top-2
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    intermediate_size_mlp=128,
    shared_expert_intermediate_size=64,
    n_shared_experts=1,
    first_k_dense_replace=1,
    use_cache=False,
)
VISION_SHAPE = dict(
    hidden_size=32,
    embed_dim=32,
    intermediate_size=64,
    num_hidden_layers=2,
    depth=2,
    num_attention_heads=2,
    num_heads=2,
    head_dim=16,
)
# keys holding indices of vision or text layers, clamped into the tiny depth
LAYER_INDEX_KEYS = ("deepstack_visual_indexes", "fullatt_block_indexes", "intermediate_layers_indices")


def _depth_key(d: dict) -> Optional[str]:
    return next((k for k in ("num_hidden_layers", "depth") if isinstance(d.get(k), int)), None)


def _cut_layer_lists(d: dict, old: int, new: int) -> None:
    """Per-layer lists (one entry per layer of the old depth) cut to ``new`` entries, every kind of entry
    kept (Gemma 3's sliding and full attention layers both run); layer-index lists clamped below ``new``."""
    for key, value in list(d.items()):
        if isinstance(value, list) and len(value) == old and old != new and key not in LAYER_INDEX_KEYS:
            kinds = list(dict.fromkeys(map(repr, value)))
            picked = [value[[repr(v) for v in value].index(k)] for k in kinds][:new]
            d[key] = (picked + value[: new - len(picked)]) if len(picked) < new else picked
        if key in LAYER_INDEX_KEYS and isinstance(value, list) and value:
            d[key] = sorted({min(int(i), new - 1) for i in value})


def _scale_mrope(d: dict, old_head_dim: Optional[int], new_head_dim: int) -> None:
    """M-RoPE's (temporal, height, width) sections sum to the rotary half-width: scaled to the new head."""
    rope = d.get("rope_parameters") or d.get("rope_scaling")
    if not isinstance(rope, dict) or not rope.get("mrope_section") or not old_head_dim:
        return
    sec = [int(x) for x in rope["mrope_section"]]
    total = max(len(sec), sum(sec) * new_head_dim // old_head_dim)
    scaled = [max(1, x * total // sum(sec)) for x in sec]
    scaled[0] += total - sum(scaled)
    rope["mrope_section"] = scaled


def _shrink(d: dict, shape: dict) -> dict:
    """``d`` (a sub-config's dict) with the keys of ``shape`` it has set to their tiny values."""
    d = dict(d)
    key = _depth_key(d)
    old = d.get(key) if key else None
    old_head_dim = d.get("head_dim") or (
        d["hidden_size"] // d["num_attention_heads"] if d.get("num_attention_heads") and d.get("hidden_size") else None
    )
    for k, v in shape.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):  # rope_parameters: the family's keys merged in
            d[k] = {**d[k], **v}
            continue
        if k in d and (d[k] is None or isinstance(d[k], (int, float))) and not isinstance(d[k], bool):
            if d[k] is None and k not in ("head_dim",):
                continue
            d[k] = v
    if key and old:
        _cut_layer_lists(d, int(old), int(d[key]))
    if "rope_parameters" not in shape:  # the family's own sections stand as given
        _scale_mrope(d, old_head_dim, int(shape.get("head_dim", 16)))
    for k in ("layer_types", "mlp_layer_types", "moe_layers", "no_rope_layers"):  # derived again from the depth
        if k in d and d[k] is None:
            d.pop(k)
    return d


def tiny_vlm_config(model_type: str, vocab_size: int, token_ids: dict[str, int], extra: Optional[dict] = None):
    """The family's config at its defaults, text model and vision tower shrunk, its special token ids and
    vocabulary those of the tiny tokenizer (``token_ids``: config key → id)."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type).to_dict()
    fix = dict(FAMILY_CONFIG.get(model_type, {}))
    text = _shrink(base.get("text_config") or {}, {**TEXT_SHAPE, **fix.pop("text", {})})
    text["vocab_size"] = vocab_size
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if k in token_ids:
            text[k] = token_ids[k]
    vision = _shrink(base.get("vision_config") or {}, {**VISION_SHAPE, **fix.pop("vision", {})})
    if "out_hidden_size" in vision:  # the merger projects into the text model's width
        vision["out_hidden_size"] = text.get("hidden_size", 64)
    top = {k: v for k, v in token_ids.items() if k in base and k not in ("bos_token_id", "eos_token_id")}
    top.update(fix)
    top.update(extra or {})
    kw: dict[str, Any] = {"text_config": text, **top}
    if base.get("vision_config") is not None:
        kw["vision_config"] = vision
    if "vocab_size" in base:
        kw["vocab_size"] = vocab_size
    config = AutoConfig.for_model(model_type, **kw)
    config.use_cache = False
    config.get_text_config().use_cache = False
    return config


# Family settings the generic shrink cannot guess, each with why.
FAMILY_CONFIG: dict[str, dict] = {
    # Gemma 3: SigLIP at 64 px / patch 16 = 4×4 patches, pooled to 2×2 = 4 image tokens (mm_tokens_per_image
    # must be a square whose side divides the patch side)
    "gemma3": {"vision": {"image_size": 64, "patch_size": 16}, "mm_tokens_per_image": 4},
    # InternVL: 64 px / patch 16 = 4×4 patches, pixel-shuffled by 0.5 to 2×2 = 4 tokens a tile
    "internvl": {"vision": {"image_size": [64, 64], "patch_size": [16, 16]}, "image_seq_length": 4},
    # Llama 4: 64 px / patch 16 = 4×4 patches, pixel-shuffled by 0.5 to 4 tokens a tile; the projector's input
    # is the shuffled width (hidden 32 / 0.5² = 128 → vision_output_dim), its output the text width
    "llama4": {
        "vision": {
            "image_size": 64,
            "patch_size": 16,
            "vision_output_dim": 64,
            "projector_input_dim": 64,
            "projector_output_dim": 64,
        },
        "text": {"interleave_moe_layer_step": 1, "attention_chunk_size": 1024},
    },
    # Mistral 3 (Pixtral tower): patch 16, merged 2×2 into one token
    "mistral3": {"vision": {"image_size": 64, "patch_size": 16}, "spatial_merge_size": 2},
    # SmolVLM 2: 32 px tiles / patch 8, pixel-shuffled by 2 to 4 tokens a tile
    "smolvlm": {"vision": {"image_size": 32, "patch_size": 8}, "scale_factor": 2},
    "idefics3": {"vision": {"image_size": 32, "patch_size": 8}, "scale_factor": 2},
    # GLM-4.1V / GLM-4.5V: M-RoPE sections default in the model's code to a 128-wide head's; a 16-wide head's
    # rotary half (GLM-4.5V rotates half the head)
    "glm4v": {"text": {"rope_parameters": {"mrope_section": [2, 3, 3]}}},
    "glm4v_moe": {"text": {"rope_parameters": {"mrope_section": [1, 1, 2]}}},
    # LFM2-VL: SigLIP-2 patch 16, 2×2 patches into one token
    "lfm2_vl": {"vision": {"patch_size": 16, "num_patches": 64}, "projector_hidden_size": 64},
}


def _family_processor_kwargs(model_type: str, config) -> dict:
    """The processor's geometry from the tiny config, where the processor is told it rather than reading it
    from its image processor: image tokens per image or tile, patch and merge sizes."""
    vc = getattr(config, "vision_config", None)

    def side(x) -> int:
        return int(x[0] if isinstance(x, (list, tuple)) else x)

    if model_type == "gemma3":
        return {"image_seq_length": int(config.mm_tokens_per_image)}
    if model_type == "internvl":
        n = (side(vc.image_size) // side(vc.patch_size)) ** 2
        return {"image_seq_length": int(n * float(config.downsample_ratio) ** 2)}
    if model_type in ("smolvlm", "idefics3"):
        return {"image_seq_len": (int(vc.image_size) // int(vc.patch_size)) ** 2 // int(config.scale_factor) ** 2}
    if model_type == "mistral3":
        return {"patch_size": int(vc.patch_size), "spatial_merge_size": int(config.spatial_merge_size)}
    if model_type == "llama4":
        return {"patch_size": int(vc.patch_size), "pixel_shuffle_ratio": float(vc.pixel_shuffle_ratio)}
    return {}


def _image_processor_class(model_type: str):
    """The family's image processor class: its PIL variant where it has one (no torchvision needed)."""
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type)
    if not names:  # a variant (Qwen3-VL-MoE, GLM-4.5V) sharing its processor class with a family that maps one
        siblings = [t for t, p in PROCESSOR_MAPPING_NAMES.items() if p == PROCESSOR_MAPPING_NAMES.get(model_type)]
        names = next((IMAGE_PROCESSOR_MAPPING_NAMES[t] for t in siblings if IMAGE_PROCESSOR_MAPPING_NAMES.get(t)), None)
    if not names:
        raise TinyVlmError(f"{model_type}: transformers maps no image processor to it")
    if isinstance(names, dict):
        name = names.get("pil") or names.get("torchvision")
        if "pil" not in names:
            try:
                import torchvision  # noqa: F401
            except ImportError:
                raise TinyVlmError(f"{model_type}: its image processor ({name}) needs torchvision, not installed")
    else:
        name = names[-1] if isinstance(names, (list, tuple)) else names
    return getattr(transformers, name)


class TinyVlmError(RuntimeError):
    """A family whose tiny model or offline processor cannot be built here, and why."""


def _shrink_image_processor(ip, model_type: str, config) -> None:
    """Small images for the tiny tower: fixed-size processors at the tower's image size, size-following ones
    (Qwen-style pixel bounds, longest-edge tiles) at a few image tokens, the patch geometry the config's."""
    vc = getattr(config, "vision_config", None)
    patch = getattr(vc, "patch_size", None)
    patch = int(patch[0] if isinstance(patch, (list, tuple)) else patch) if patch else None
    image = getattr(vc, "image_size", None)
    image = int(image[0] if isinstance(image, (list, tuple)) else image) if image else None
    merge = getattr(vc, "spatial_merge_size", None) or getattr(config, "spatial_merge_size", None)
    for attr, value in (("patch_size", patch), ("merge_size", merge), ("encoder_patch_size", patch)):
        if value and isinstance(getattr(ip, attr, None), int):
            setattr(ip, attr, int(value))
    size = dict(getattr(ip, "size", None) or {})
    if "height" in size and image:
        size = {"height": image, "width": image}
    elif "shortest_edge" in size and "longest_edge" in size and getattr(ip, "merge_size", None):
        factor = int(ip.patch_size) * int(ip.merge_size)  # pixel counts: Qwen-style min/max pixels
        size = {"shortest_edge": factor * factor, "longest_edge": (2 * factor) ** 2}
        for attr, value in (("min_pixels", factor * factor), ("max_pixels", (2 * factor) ** 2)):
            if getattr(ip, attr, None) is not None:
                setattr(ip, attr, value)
    elif "longest_edge" in size:
        tile = int((getattr(ip, "max_image_size", None) or {}).get("longest_edge") or image or 4 * (patch or 16))
        if getattr(ip, "max_image_size", None):
            ip.max_image_size = {"longest_edge": image or tile}
            tile = image or tile
        size = {"longest_edge": 2 * tile}
    elif "shortest_edge" in size and image:
        size = {"shortest_edge": image}
    if size:
        ip.size = type(ip.size)(**size) if ip.size is not None else size
    if getattr(ip, "crop_size", None) and image:
        ip.crop_size = type(ip.crop_size)(height=image, width=image)
    for attr, value in FAMILY_IMAGE_PROCESSOR.get(model_type, {}).items():
        setattr(ip, attr, value(config) if callable(value) else value)


# Image processor settings the generic shrink cannot guess, each with why.
FAMILY_IMAGE_PROCESSOR: dict[str, dict[str, Any]] = {
    # Llama 4: tiles of the tower's image size, at most 2 of them (and the whole image) for a tiny photo
    "llama4": {"size": {"height": 64, "width": 64}, "max_patches": 2},
    # InternVL (GotOcr2): no crops into tiles for a tiny photo: one 64 px tile
    "internvl": {"crop_to_patches": False},
    # LFM2-VL: 64 px tiles, at most 16 image tokens an image
    "lfm2_vl": {"tile_size": 64, "max_image_tokens": 16, "min_image_tokens": 4, "do_image_splitting": False},
    # SmolVLM 2: images resized to 64 px on their longest side and cut into 32 px tiles
    "smolvlm": {"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}},
}


def _tokenizer(extra: dict[str, str]):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_FILE),
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=4096,
        padding_side="right",
        extra_special_tokens=dict(extra),
    )


def _image_only_class(cls):
    """``cls`` without a video processor (video processors need torchvision; bigtune trains on photos)."""
    from bigtune.core.processors import image_only_processor_class

    return image_only_processor_class(cls)


def tiny_vlm(model_type: str):
    """(processor, config) of a tiny ``model_type`` model, built offline: the processor first (its geometry
    from a first tiny config), then the config with the tokenizer's vocabulary and the ids of the tokens the
    processor writes (the image token: the one it repeats for an image). Raises TinyVlmError saying why a
    family cannot be built."""
    import transformers
    from PIL import Image
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(model_type)
    if not name:
        raise TinyVlmError(f"{model_type}: transformers maps no processor class to it (its processor is remote code)")
    cls = getattr(transformers, name, None)
    if cls is None:
        raise TinyVlmError(f"{model_type}: processor class {name} is not importable here")
    params = set(inspect.signature(cls.__init__).parameters) | set(cls.get_attributes())
    if any("audio" in p or "feature_extractor" in p for p in params):
        raise TinyVlmError(f"{model_type}: {name} takes audio (a feature extractor); bigtune's data is images")
    if "image_processor" not in params:
        raise TinyVlmError(f"{model_type}: {name} has no image processor")
    geometry = tiny_vlm_config(model_type, 1024, {})
    ip_cls = _image_processor_class(model_type)

    def small_images():
        ip = ip_cls()
        _shrink_image_processor(ip, model_type, geometry)
        return ip

    kwargs = _family_processor_kwargs(model_type, geometry)
    proc = _build_processor(model_type, _image_only_class(cls), small_images, kwargs, _tokenizer)
    text = f"a {proc.image_token} b"
    out = proc(text=[text], images=[Image.new("RGB", (48, 40), (200, 120, 40))], return_tensors="pt")
    ids = out["input_ids"][0].tolist()
    image_id = max(set(ids), key=ids.count)
    tok = proc.tokenizer
    token_ids = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    token_ids.update({"image_token_id": image_id, "image_token_index": image_id})
    vocab = tok.get_vocab()
    for key, attr in CONFIG_TOKEN_KEYS.items():
        token = getattr(tok, attr, None) or getattr(proc, attr, None)
        if isinstance(token, str) and token in vocab:
            token_ids[key] = vocab[token]
    return proc, tiny_vlm_config(model_type, len(tok), token_ids)


# config keys of special tokens other than the image token, and the tokenizer (or processor) attribute
# holding each token
CONFIG_TOKEN_KEYS = {
    "boi_token_index": "boi_token",
    "eoi_token_index": "eoi_token",
    "boi_token_id": "boi_token",
    "eoi_token_id": "eoi_token",
    "video_token_id": "video_token",
    "vision_start_token_id": "vision_start_token",
    "vision_end_token_id": "vision_end_token",
    "image_start_token_id": "image_start_token",
    "image_end_token_id": "image_end_token",
}


def _build_processor(model_type: str, cls, make_image_processor, kwargs: dict, make_tokenizer):
    """The processor over a tokenizer ``make_tokenizer(extra)`` builds, each special token it asks for added
    to ``extra`` (an AttributeError naming a ``*_token`` of the tokenizer, or a ``*_token`` attribute of the
    processor not in the vocabulary), built again until none is missing."""
    extra: dict[str, str] = {}
    for _ in range(12):
        tok = make_tokenizer(extra)
        try:
            proc = cls(image_processor=make_image_processor(), tokenizer=tok, **kwargs)
        except AttributeError as e:
            missing = _missing_token(str(e))
            if missing is None or missing in extra:
                raise TinyVlmError(f"{model_type}: {cls.__name__} could not be built: {e}") from e
            extra[missing] = f"<{missing}>"
            continue
        vocab = tok.get_vocab()
        unknown = {
            attr: value
            for attr, value in vars(proc).items()
            if attr.endswith("_token") and isinstance(value, str) and value and value not in vocab
        }
        if not unknown:
            proc.chat_template = GENERIC_CHAT_TEMPLATE.replace(IMAGE_PLACEHOLDER, str(proc.image_token))
            return proc
        extra.update(unknown)
    raise TinyVlmError(f"{model_type}: {cls.__name__} kept asking for more special tokens ({', '.join(extra)})")


# -- a published checkpoint's processor, offline, for the planner ---------------------------------------------


def _tokenizer_at_ids(ids: dict[str, int]):
    """A make_tokenizer for _build_processor: the bundled tokenizer with each special token the processor asks
    for at the id the model's config gives it (``ids``: tokenizer attribute → id, see token_ids_of), others
    after the bundled vocabulary."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    def make(extra: dict[str, str]):
        d = json.loads(TOKENIZER_FILE.read_text(encoding="utf-8"))
        for attr, token in extra.items():
            if attr in ids:  # in the model's vocabulary and in the added tokens, so it is never split
                d["model"]["vocab"][token] = ids[attr]
                d["added_tokens"].append(
                    {"id": ids[attr], "content": token, "single_word": False, "lstrip": False, "rstrip": False}
                    | {"normalized": False, "special": True}
                )
        return PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer.from_str(json.dumps(d)),
            bos_token="<s>",
            eos_token="</s>",
            pad_token="<pad>",
            model_max_length=1 << 20,
            padding_side="right",
            extra_special_tokens=dict(extra),
        )

    return make


def token_ids_of(config) -> dict[str, int]:
    """Tokenizer attribute → id for the special tokens ``config`` names (the image token and the ids in
    CONFIG_TOKEN_KEYS)."""
    out = {}
    for key in ("image_token_id", "image_token_index"):
        if isinstance(getattr(config, key, None), int):
            out["image_token"] = int(getattr(config, key))
    for key, attr in CONFIG_TOKEN_KEYS.items():
        if isinstance(getattr(config, key, None), int):
            out[attr] = int(getattr(config, key))
    return out


def standin_processor(config, settings: dict):
    """A published checkpoint's processor built offline for planning: the family's processor class
    (image-only) and image processor at the checkpoint's published settings (``settings``: the bundled
    ``image_processor`` and ``processor`` dicts, assets/processors), over the bundled tokenizer with the
    config's special-token ids, and a neutral chat template. It lays out images exactly as the real one
    (the image tokens, markers and per-image tensors); the text around them is the stand-in's."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    model_type = config.model_type
    name = settings.get("processor_class") or PROCESSOR_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, name or "", None)
    if cls is None:
        raise TinyVlmError(f"{model_type}: processor class {name!r} is not importable here")
    ip_cls = _image_processor_class(model_type)
    published = dict(settings.get("image_processor", {}))
    kwargs = {k: v for k, v in settings.get("processor", {}).items() if k != "processor_class"}
    return _build_processor(
        model_type,
        _image_only_class(cls),
        lambda: ip_cls.from_dict(published),
        kwargs,
        _tokenizer_at_ids(token_ids_of(config)),
    )


def _missing_token(message: str) -> Optional[str]:
    """The special-token attribute an AttributeError says the tokenizer lacks (``boi_token_id`` → boi_token)."""
    import re

    m = re.search(r"has no attribute '?(\w+)'?", message)
    if not m:
        return None
    attr = m.group(1).removesuffix("_id")
    return attr if attr.endswith("_token") else None
