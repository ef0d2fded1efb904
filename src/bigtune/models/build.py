"""Loading models and tokenizers: built-in presets, local Hugging Face folders, hub ids.

Weights load from safetensors only (a folder with just pickle ``.bin`` files is refused with the
conversion to run), and remote code runs only when the recipe says ``trust_remote_code: true``.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Optional

import torch

from bigtune.core.hub import hub_kwargs, hub_reachable
from bigtune.core.presets import PRESETS, preset_config, preset_processor, tiny_tokenizer
from bigtune.models.configs import ModelError
from bigtune.recipe import ModelConfig, PeftConfig

DTYPES = {
    "32-true": torch.float32,
    "bf16-true": torch.bfloat16,
    "bf16-mixed": torch.float32,
    "16-mixed": torch.float32,
    "16-true": torch.float16,
}


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
        tok = AutoTokenizer.from_pretrained(
            _local_or_id(src), revision=cfg.revision, trust_remote_code=cfg.trust_remote_code, **hub_kwargs(src)
        )
    except Exception as e:  # transformers raises OSError/ValueError/HF hub errors
        raise ModelError(load_hint("tokenizer", src, e)) from e
    if tok.pad_token is None:
        # Llama-family tokenizers ship without a pad token; padding positions are masked out of the
        # loss and attention anyway, so reusing EOS is safe.
        tok.pad_token = tok.eos_token or tok.unk_token
    tok.padding_side = "right"
    return tok


def load_processor(cfg: ModelConfig):
    """image-to-text: the model's processor (image processor + tokenizer with the image token; BLIP-2's
    Blip2Processor, Qwen2-VL's processor with its chat template)."""
    if cfg.name in PRESETS and cfg.tokenizer is None:
        return preset_processor(cfg.name)
    if cfg.init == "random" and cfg.tokenizer is None and not Path(cfg.name).expanduser().is_dir():
        # As load_tokenizer: random weights need no hub download; the images keep the model's real size.
        from bigtune.core.presets import random_init_processor
        from bigtune.models.configs import resolve_config_name

        config = resolve_config_name(cfg)
        if getattr(config, "model_type", "") != "blip-2":
            raise ModelError(
                f"model.init=random for {cfg.name} ({getattr(config, 'model_type', '?')}): bigtune builds a "
                "processor for a random-init BLIP-2 only; a chat vision-language model needs its own (its image "
                "tokens and chat template). Set model.tokenizer to a folder holding that model's processor "
                "(processor, tokenizer and chat template files; no weights needed)"
            )
        print(
            f"model: random init of {cfg.name}; bigtune's tiny tokenizer (ids < 512) and BLIP's image processor "
            "at the model's image size",
            flush=True,
        )
        return random_init_processor(config)

    from bigtune.core.processors import AutoImageTextProcessor  # Qwen2-VL loads without torchvision too

    src = cfg.tokenizer or cfg.name
    try:
        proc = AutoImageTextProcessor.from_pretrained(
            _local_or_id(src), revision=cfg.revision, trust_remote_code=cfg.trust_remote_code, **hub_kwargs(src)
        )
    except Exception as e:
        raise ModelError(load_hint("processor", src, e)) from e
    tok = getattr(proc, "tokenizer", None)
    if tok is None or not hasattr(proc, "image_processor"):
        raise ModelError(
            f"{src}: the processor has no tokenizer and image processor; an image-to-text model needs "
            "both (save them with Blip2Processor.save_pretrained)"
        )
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    tok.padding_side = "right"
    return proc


def load_tokenizer_or_processor(cfg: ModelConfig):
    return load_processor(cfg) if cfg.family == "image-to-text" else load_tokenizer(cfg)


def _local_or_id(name: str) -> str:
    p = Path(name).expanduser()
    return str(p) if p.exists() else name


def load_hint(what: str, name: str, e: Exception) -> str:
    local = Path(name).expanduser().exists()
    if local:
        return f"could not load the {what} from folder {name}: {e}"
    if not hub_reachable():
        return (
            f"could not load the {what} {name!r}: the Hugging Face hub does not answer from this machine "
            "(no connection within 3 s, or HF_HUB_OFFLINE is set) and it is not in the local cache. Download it "
            "where there is internet (`huggingface-cli download ...`), copy it here and set model.name to that "
            "local folder, or fill the cache (HF_HOME) there and copy that."
        )
    return (
        f"could not load the {what} {name!r} from the Hugging Face hub ({type(e).__name__}: {str(e)[:300]}). "
        "Without internet, download it elsewhere (`huggingface-cli download ...`) and set model.name to the "
        "local folder; for a gated model, log in with `huggingface-cli login`."
    )


def compute_dtype(cfg: ModelConfig, precision: str) -> torch.dtype:
    if cfg.compute_dtype != "auto":
        return getattr(torch, cfg.compute_dtype)
    if precision.startswith("bf16"):
        return torch.bfloat16
    return torch.float16 if precision.startswith("16") else torch.float32


# Classification heads by attribute name (BERT/RoBERTa: classifier; DistilBERT: pre_classifier + classifier;
# Llama and other decoders: score).
CLASSIFIER_HEADS = ("classifier", "pre_classifier", "score")


def quantization_config(cfg: ModelConfig, precision: str, sharded: bool = False):
    """The bitsandbytes loading config for model.quantize (None when not quantized). ``sharded`` (DeepSpeed
    ZeRO-3): the packed 4-bit bytes are stored as compute-dtype elements, so that ZeRO, which partitions and
    gathers floating-point parameters of one dtype, handles them like the rest of the model."""
    if cfg.quantize == "none":
        return None
    from transformers import BitsAndBytesConfig

    # A classifier's new head trains in full (peft SEQ_CLS modules_to_save): it must stay unquantized.
    skip = {"llm_int8_skip_modules": list(CLASSIFIER_HEADS)} if cfg.family == "sequence-classification" else {}
    if cfg.quantize == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.quantize,
        bnb_4bit_use_double_quant=cfg.double_quant,
        bnb_4bit_compute_dtype=compute_dtype(cfg, precision),
        **({"bnb_4bit_quant_storage": compute_dtype(cfg, precision)} if sharded else {}),
        **skip,
    )


def auto_class(family: str):
    if family == "sequence-classification":
        from transformers import AutoModelForSequenceClassification

        return AutoModelForSequenceClassification
    if family == "image-to-text":
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def attention_for(model_cfg: ModelConfig, config) -> tuple[str, Optional[str]]:
    """The attention implementation a model of ``config`` runs with, and a note when it is not the recipe's.

    transformers refuses ``sdpa`` for architectures whose attention has no SDPA path (Gemma-2 with its
    logit soft-capping, BLOOM with ALiBi, ...): rather than fail, such a model runs eager attention, the
    only kernel it has, and the run and the plan say so.
    """
    wanted = model_cfg.attn_implementation
    if wanted != "sdpa":
        return wanted, None
    try:
        cls = auto_class(model_cfg.family)._model_mapping[type(config)]
    except (KeyError, AttributeError):  # a remote-code model: transformers decides when it loads it
        return wanted, None
    if getattr(cls, "_supports_sdpa", True):
        # A vision-language model builds its language model from the text config, which transformers checks
        # on its own (PaliGemma 2's Gemma-2 has no SDPA path though PaliGemma has one)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        from transformers import AutoModelForCausalLM

        cls = AutoModelForCausalLM._model_mapping.get(type(text), None) if text is not config else None
        if cls is None or getattr(cls, "_supports_sdpa", True):
            return wanted, None
    return "eager", (
        f"model.attn_implementation: {cls.__name__} has no SDPA attention in transformers, so eager attention "
        "is used (it keeps the S×S attention weights for backward); set model.attn_implementation=eager to "
        "silence this"
    )


def _pretrained_attention(cfg: ModelConfig) -> str:
    if cfg.attn_implementation != "sdpa":
        return cfg.attn_implementation
    from bigtune.models.configs import resolve_config_name

    try:
        attn, note = attention_for(cfg, resolve_config_name(cfg))
    except ModelError:  # no config to read here: from_pretrained then says what is missing
        return cfg.attn_implementation
    if note:
        print(f"note: {note}", flush=True)
    return attn


def label_config(label_names: Optional[list]) -> dict:
    """Config keys that give a classification head its classes (empty for other families)."""
    if not label_names:
        return {}
    names = [str(n) for n in label_names]
    return {
        "num_labels": len(names),
        "id2label": dict(enumerate(names)),
        "label2id": {n: i for i, n in enumerate(names)},
    }


def _from_pretrained(
    name: str, cfg: ModelConfig, dtype: torch.dtype, quant, label_names: Optional[list] = None, attn: str = "sdpa"
) -> torch.nn.Module:
    AutoModelForCausalLM = auto_class(cfg.family)

    kwargs: dict = label_config(label_names) | text_model_kwargs(name, cfg.family, cfg.revision, cfg.trust_remote_code)
    if quant is not None and torch.cuda.is_available():
        kwargs["device_map"] = {"": torch.cuda.current_device()}  # bitsandbytes quantizes while placing
    try:
        model = AutoModelForCausalLM.from_pretrained(
            name,
            dtype=dtype,
            revision=cfg.revision,
            trust_remote_code=cfg.trust_remote_code,
            use_safetensors=True,
            attn_implementation=attn,
            quantization_config=quant,
            **hub_kwargs(name),
            **kwargs,
        )
    except Exception as e:
        raise ModelError(load_hint("model", cfg.name, e)) from e
    return save_as_loaded(model) if "key_mapping" in kwargs else model


def save_as_loaded(model: torch.nn.Module) -> torch.nn.Module:
    """Forget the key renaming a text model of a composite checkpoint was loaded with (text_model_kwargs):
    transformers 5 reverts it on save_pretrained, which would write "language_model.model.*" keys beside a
    text-only config that no loader maps back. Only those renamings go; the model's own conversions stay.
    (``_weight_conversions`` is where transformers 5.x keeps them; there is no public setter.)"""
    from bigtune.models.configs import TEXT_MODEL_OF

    ours = {pattern for mapping in TEXT_MODEL_OF.values() for pattern in mapping}
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [c for c in conversions if not set(getattr(c, "source_patterns", ())) <= ours]
    return model


def text_model_kwargs(
    name: str, family: str = "causal-lm", revision: Optional[str] = None, trust_remote_code: bool = False
) -> dict:
    """from_pretrained's config and key_mapping for the text model of a composite checkpoint
    (models.configs.TEXT_MODEL_OF), else nothing. Training, export and generation all load it so."""
    if family != "causal-lm":
        return {}
    from transformers import AutoConfig

    from bigtune.models.configs import text_model_of

    try:
        whole = AutoConfig.from_pretrained(
            name, revision=revision, trust_remote_code=trust_remote_code, **hub_kwargs(name)
        )
    except Exception:  # no config to read: from_pretrained then says what is missing
        return {}
    text, mapping = text_model_of(whole, family)
    if mapping is None:
        return {}
    print(
        f"note: {name} is a {type(whole).__name__.removesuffix('Config')} checkpoint: its text model "
        f"({text.model_type}) is fine-tuned alone; the vision tower is not loaded",
        flush=True,
    )
    return {"config": text, "key_mapping": mapping}


def random_model(
    auto_class_, config, dtype: torch.dtype, seed: int, device: Optional[torch.device] = None
) -> torch.nn.Module:
    """A model of ``config`` with fresh weights from ``seed``, drawn on ``device`` when given: one CPU core
    draws about 0.1 G normal samples a second (a minute for an 8B model before a quantized run writes and
    reloads it), a GPU the whole model in about a second. Where the device has no room for the 16-bit
    weights, the CPU."""
    torch.manual_seed(seed)  # seeds the CPU and every GPU generator
    if device is not None:
        try:
            with torch.device(device):
                return auto_class_.from_config(config, dtype=dtype)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
    return auto_class_.from_config(config, dtype=dtype)


def write_base(model: torch.nn.Module, tokenizer, folder: Path) -> None:
    """A random-init (or preset) base as a model folder, written by every rank into its own ``folder``
    (transformers' save_pretrained writes on rank 0 only once torch.distributed is up). Keys are the
    state dict's; a tied weight is stored under each of its names."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(str(folder / "config.json"))
    seen: set[int] = set()
    tensors = {}
    for key, value in model.state_dict().items():
        ptr = value.untyped_storage().data_ptr()
        value = value.detach().to("cpu")  # a model drawn on the GPU (random_model) is written from host memory
        tensors[key] = value.clone().contiguous() if ptr in seen else value.contiguous()
        seen.add(ptr)
    tmp = folder / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.rename(folder / "model.safetensors")
    tokenizer.save_pretrained(str(folder))


def build_model(
    cfg: ModelConfig,
    tokenizer,
    precision: str,
    seed: int,
    base_dir: Optional[Path] = None,
    label_names: Optional[list] = None,
    zero3: bool = False,
    init_device: Optional[torch.device] = None,
) -> torch.nn.Module:
    """The model in the dtype its precision stores weights in (quantized if asked), in train mode;
    ``init_device``: where a random-init or preset model draws its weights (``random_model``).

    sequence-classification: ``label_names`` size the head and name its classes (config id2label).

    Presets and random-init models have no folder to come back to: with ``base_dir`` their initial
    weights are written there (a LoRA run's export merges into them), and a quantized one is loaded
    back from there so bitsandbytes quantizes it exactly as it would a downloaded model.
    """
    AutoModelForCausalLM = auto_class(cfg.family)

    dtype = weights_dtype(precision)
    quant = quantization_config(cfg, precision, sharded=zero3)
    if cfg.name in PRESETS or cfg.init == "random":
        if cfg.name in PRESETS:
            config = preset_config(cfg.name, tokenizer)
        else:
            from bigtune.models.configs import resolve_config_name

            config = resolve_config_name(cfg)
        attn, note = attention_for(cfg, config)
        if note:
            print(f"note: {note}", flush=True)
        config._attn_implementation = attn
        for key, value in label_config(label_names).items():
            setattr(config, key, value)
        model = random_model(AutoModelForCausalLM, config, dtype, seed, init_device)
        scratch = quant is not None and base_dir is None  # written only to be quantized on loading
        if scratch:
            base_dir = Path(tempfile.mkdtemp(prefix="bigtune-base-"))
        if base_dir is not None:
            model.save_pretrained(base_dir, safe_serialization=True)
            tokenizer.save_pretrained(base_dir)
            if not (Path(base_dir) / "config.json").exists():  # not rank 0: save_pretrained wrote nothing
                write_base(model, tokenizer, Path(base_dir))
        if quant is not None:
            del model
            torch.cuda.empty_cache()  # the 16-bit weights drawn on a GPU (none elsewhere): reserved is measured
            model = _from_pretrained(str(base_dir), cfg, dtype, quant, label_names, attn)
        if scratch:  # loaded: a 7B base is 14 GB of temporary files otherwise left behind
            shutil.rmtree(base_dir, ignore_errors=True)
    else:
        name = _local_or_id(cfg.name)
        local = Path(name).is_dir()
        if local:
            files = {p.suffix for p in Path(name).iterdir()}
            if ".safetensors" not in files and (".bin" in files or ".pt" in files):
                raise ModelError(
                    f"model folder {name} has only pickle weights (.bin/.pt); bigtune loads safetensors only, because "
                    'unpickling can run code. Convert once: `python -c "from transformers import '
                    + auto_class(cfg.family).__name__
                    + " as M; M.from_pretrained('"
                    + name
                    + "').save_pretrained('"
                    + name
                    + "-st')\"` and point model.name at the new folder."
                )
        model = _from_pretrained(name, cfg, dtype, quant, label_names, _pretrained_attention(cfg))
    model.config.use_cache = False
    if cfg.family == "sequence-classification" and model.config.pad_token_id is None:
        # Llama-style heads pool the last non-pad token, found by comparing ids with pad_token_id.
        tok = getattr(tokenizer, "tokenizer", tokenizer)
        model.config.pad_token_id = tok.pad_token_id  # the KV cache is useless in training and costs memory
    if cfg.family == "image-to-text":
        text_cfg = getattr(model.config, "text_config", None)
        if text_cfg is not None:
            text_cfg.use_cache = False
        freeze_parts(model, cfg)
    model.train()
    return model


# BLIP-2 parts by attribute name; query_tokens are the Q-Former's learned queries.
IMAGE_TO_TEXT_PARTS = {
    "vision": ("vision_model",),
    "qformer": ("qformer", "query_tokens"),
    "language_model": ("language_model",),
}

# Chat vision-language models by parameter-name prefix, the longest match deciding: the vision encoder
# without its patch merger; the merger, which projects vision features into the language model (the
# part BLIP-2's Q-Former plays, so model.freeze_qformer freezes it); the language model with its head.
CHAT_VLM_PARTS = {
    "vision": ("model.visual.",),
    "qformer": ("model.visual.merger.",),
    "language_model": ("model.language_model.", "lm_head."),
}

# LLaVA and PaliGemma: the vision tower, the multi-modal projector (model.freeze_qformer) and the language
# model with its head (PaliGemma ties the head to the embeddings)
PROJECTOR_VLM_PARTS = {
    "vision": ("model.vision_tower.",),
    "qformer": ("model.multi_modal_projector.",),
    "language_model": ("model.language_model.", "lm_head."),
}

VLM_PARTS = {
    "qwen2_vl": CHAT_VLM_PARTS,
    "qwen2_5_vl": CHAT_VLM_PARTS,
    "llava": PROJECTOR_VLM_PARTS,
    # LLaVA-NeXT: as LLaVA; image_newline, the learned embedding that ends each row of tile features, goes with
    # the projector (model.freeze_qformer): both connect the vision tower to the language model
    "llava_next": {**PROJECTOR_VLM_PARTS, "qformer": ("model.multi_modal_projector.", "model.image_newline")},
    "paligemma": PROJECTOR_VLM_PARTS,
    # Idefics3 (SmolVLM): SigLIP, the pixel-shuffle connector (model.freeze_qformer), the language model and head
    "idefics3": {
        "vision": ("model.vision_model.",),
        "qformer": ("model.connector.",),
        "language_model": ("model.text_model.", "lm_head."),
    },
}

CHAT_VLM_TYPES = tuple(VLM_PARTS)


# The generic path's families (bigtune.data.vlm.is_generic_vlm) name their parts in a few ways: these names,
# found under the model's ``model.``, decide which part a parameter belongs to (the longest prefix wins, so a
# merger inside the vision tower goes with the projector)
GENERIC_VLM_PART_NAMES = {
    "vision": ("visual", "vision_tower", "vision_model", "vision_encoder"),
    "qformer": (
        "multi_modal_projector",
        "connector",
        "projector",
        "mlp1",
        "image_newline",
        "visual.merger",
        "visual.deepstack_merger_list",
        "vision_tower.multi_modal_projector",
    ),
    "language_model": ("language_model", "text_model"),
}


def generic_vlm_parts(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Parameter-name prefixes of the vision tower, the projector and the language model (with its head) of a
    generic-path model, from the names its modules have (GENERIC_VLM_PART_NAMES)."""
    names = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters()}
    parts = {
        part: tuple(f"model.{a}." if f"model.{a}" in names else "" for a in attrs if f"model.{a}" in names)
        for part, attrs in GENERIC_VLM_PART_NAMES.items()
    }
    parts["language_model"] += ("lm_head.",)
    return parts


def _freeze_by_prefix(model: torch.nn.Module, flags: dict[str, bool]) -> dict[str, int]:
    parts = VLM_PARTS.get(model.config.model_type) or generic_vlm_parts(model)
    out = dict.fromkeys(flags, 0)
    for name, p in model.named_parameters():
        match = max(
            ((len(pre), part) for part, pres in parts.items() for pre in pres if name.startswith(pre)),
            default=None,
        )
        if match is not None and flags[match[1]]:
            p.requires_grad_(False)
            out[match[1]] += p.numel()
    return out


def freeze_parts(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, int]:
    """requires_grad=False on the parts the recipe freezes: no gradients and (make_optimizer takes
    trainable parameters only) no optimizer state for them. Returns frozen element counts per part."""
    flags = {"vision": cfg.freeze_vision, "qformer": cfg.freeze_qformer, "language_model": cfg.freeze_language_model}
    from bigtune.core.processors import is_generic_vlm

    if getattr(model.config, "model_type", "") in CHAT_VLM_TYPES or is_generic_vlm(model.config):
        return _freeze_by_prefix(model, flags)
    out = {}
    for part, flag in (
        ("vision", cfg.freeze_vision),
        ("qformer", cfg.freeze_qformer),
        ("language_model", cfg.freeze_language_model),
    ):
        n = 0
        for attr in IMAGE_TO_TEXT_PARTS[part]:
            obj = getattr(model, attr, None)
            if obj is None:
                continue
            params = [obj] if isinstance(obj, torch.nn.Parameter) else list(obj.parameters())
            for p in params:
                if flag:
                    p.requires_grad_(False)
                    n += p.numel()
        out[part] = n
    return out


DEFAULT_TARGETS = {
    "llama": ["q_proj", "v_proj"],
    "mistral": ["q_proj", "v_proj"],
    "opt": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"],
    "gemma": ["q_proj", "v_proj"],
    "phi": ["q_proj", "v_proj"],
    "t5": ["q", "v"],
    "bert": ["query", "value"],
    "roberta": ["query", "value"],
    "distilbert": ["q_lin", "v_lin"],
    "gpt2": ["c_attn"],
    "gpt_neox": ["query_key_value"],
    # model families (issue #26): PEFT's own defaults (its TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING);
    # fused projections take the adapter on the whole fused layer
    "qwen3": ["q_proj", "v_proj"],
    "qwen3_moe": ["q_proj", "v_proj"],
    "gemma2": ["q_proj", "v_proj"],
    "gemma3_text": ["q_proj", "v_proj"],
    "mixtral": ["q_proj", "v_proj"],
    "stablelm": ["q_proj", "v_proj"],
    "phi3": ["qkv_proj"],
    "falcon": ["query_key_value"],
    "bloom": ["query_key_value"],
    # BLIP-2: adapters on the language model's attention queries/values only (the usual BLIP-2
    # LoRA); a regex, so the Q-Former's query/value and the ViT's qkv are left alone.
    "blip-2": r".*language_model\..*\.(q_proj|v_proj|q|v)$",
    # Qwen2-VL / Qwen2.5-VL: the language model's queries and values (the vision blocks' attention is a fused qkv)
    "qwen2_vl": r".*language_model\..*\.(q_proj|v_proj)$",
    "qwen2_5_vl": r".*language_model\..*\.(q_proj|v_proj)$",
    # LLaVA / PaliGemma: likewise (CLIP's and SigLIP's attention have q_proj/v_proj too: the regex skips them)
    "llava": r".*language_model\..*\.(q_proj|v_proj)$",
    "llava_next": r".*language_model\..*\.(q_proj|v_proj)$",
    "paligemma": r".*language_model\..*\.(q_proj|v_proj)$",
    "idefics3": r".*text_model\..*\.(q_proj|v_proj)$",  # SmolVLM: its language model is model.text_model
}


# the generic path's families: the language model's attention queries and values, whatever its attribute name
GENERIC_VLM_TARGETS = r".*(language_model|text_model)\..*\.(q_proj|v_proj)$"


def lora_targets(model: torch.nn.Module, wanted: list) -> list[str] | str:
    if wanted == ["all-linear"]:
        return "all-linear"
    if wanted != ["auto"]:
        return list(wanted)
    kind = getattr(model.config, "model_type", "")
    from bigtune.core.processors import is_generic_vlm

    if kind not in DEFAULT_TARGETS and is_generic_vlm(model.config):  # the language model's queries and values
        return GENERIC_VLM_TARGETS
    if kind not in DEFAULT_TARGETS:
        raise ModelError(
            f"peft.target_modules: no default for model type {kind!r}; name the modules, e.g. "
            "peft.target_modules=[q_proj,v_proj], or use [all-linear]"
        )
    return DEFAULT_TARGETS[kind]


@contextlib.contextmanager
def peft_renames_quiet():
    """Silence transformers' FutureWarnings about the *gradient_checkpointing* names it renamed in 5.23, which
    peft still calls: they are peft's to fix, not the user's."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated", category=FutureWarning)
        yield


def apply_peft(
    model: torch.nn.Module,
    peft_cfg: PeftConfig,
    quantized: bool,
    checkpointing: bool,
    family: str = "causal-lm",
    upcast: bool = True,
):
    """Freeze the base, add LoRA/DoRA adapters (QLoRA: after peft's k-bit preparation when ``upcast``,
    model.upcast_unquantized; without it the unquantized weights keep their dtype)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if quantized and upcast:
        # Casts the remaining (non-quantized) weights to fp32 for stability, as QLoRA does, and turns
        # on checkpointing itself when asked.
        with peft_renames_quiet():
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False}
            )
    elif quantized and checkpointing:  # (get_peft_model freezes the base either way)
        enable_activation_checkpointing(model)
    config = LoraConfig(
        r=peft_cfg.r,
        lora_alpha=peft_cfg.alpha,
        lora_dropout=peft_cfg.dropout,
        target_modules=lora_targets(model, peft_cfg.target_modules),
        use_dora=peft_cfg.method == "dora",
        # image-to-text: the plain PeftModel passes pixel_values / decoder_input_ids through as is;
        # SEQ_CLS also trains (and saves) the new classification head in full.
        task_type={"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS"}.get(family),
    )
    with peft_renames_quiet():
        model = get_peft_model(model, config)
    if peft_cfg.adapter_dtype == "bfloat16":
        recast_parameters(model, torch.bfloat16, lambda name, p: p.requires_grad and "lora_" in name)
    return model


def recast_parameters(model: torch.nn.Module, dtype: torch.dtype, which=lambda name, p: True) -> None:
    """Give the floating-point parameters ``which(name, p)`` selects the dtype ``dtype``, each as a new
    Parameter (tied parameters stay tied). Done before the optimizer exists. ``Module.to`` would do it for
    real tensors, but cannot swap the planner's fake ones, and the two must take the same path."""
    new: dict[int, torch.nn.Parameter] = {}
    for mod_name, mod in model.named_modules():
        for name, p in list(mod._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in new:
                if not which(f"{mod_name}.{name}" if mod_name else name, p):
                    continue
                new[id(p)] = torch.nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            mod._parameters[name] = new[id(p)]


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """HF per-layer checkpointing, non-reentrant (works with frozen inputs and keeps autograd hooks)."""
    kwargs = {"use_reentrant": False}
    # transformers >= 5.23 renamed the method (and its argument); 5.17 has only the old name.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compile_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """torch.compile every repeated transformer block in place (``Module.compile``), as torchtitan and
    torchtune do: one small graph reused by all blocks of a kind, the outer code (embeddings, masks,
    loss) left eager so its graph breaks cost nothing. In place keeps parameter names and the state
    dict unchanged (checkpoints, export), and keeps the block a block for FSDP to shard afterwards.
    Returns the compiled blocks."""
    from bigtune.models.build import decoder_blocks

    try:
        blocks = decoder_blocks(model)
    except ValueError:
        raise ModelError(
            f"train.compile: found no repeated transformer blocks in {type(model).__name__} to compile; "
            "set train.compile=false"
        ) from None
    # Every compiled block enters dynamo through the same code (Module._call_impl, or HF's checkpointing
    # wrapper around forward), so all block kinds share one recompile limit (8 graphs by default); each kind
    # needs a static and a shape-generic graph, plus variants (T5's first block, train vs eval). Without
    # headroom a BLIP-2 model would silently fall back to eager for its last kinds.
    kinds = len({type(b) for b in blocks})
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * kinds)
    for block in blocks:
        block.compile()
    return blocks


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    seen: set[int] = set()
    total = trainable = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        # a bitsandbytes 4-bit weight stores its packed bytes (n/2, or n/4 16-bit elements): count its weights
        state = getattr(p, "quant_state", None)
        n = math.prod(state.shape) if getattr(state, "shape", None) is not None else p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return {"total": total, "trainable": trainable}


def is_classifier(model: torch.nn.Module) -> bool:
    """True for a sequence-classification model, whatever wraps it (Fabric, DDP/FSDP, peft)."""
    m = model
    while True:
        if type(m).__name__.endswith("ForSequenceClassification"):
            return True
        inner = getattr(m, "module", None) or getattr(m, "_forward_module", None)
        if inner is None and hasattr(m, "get_base_model"):
            inner = m.get_base_model()
        if inner is None or inner is m:
            return False
        m = inner


def shifts_labels(model: torch.nn.Module) -> bool:
    """True when the loss compares position t's logits with label t+1 (decoder-only models).

    Encoder-decoder models (T5, BLIP-2 with a Flan-T5 language model) produce decoder logits already
    aligned with their labels.
    """
    if is_classifier(model):
        return False  # one label per sample, nothing to shift
    m = model
    while hasattr(m, "module") and not hasattr(m, "config"):
        m = m.module
    cfg = getattr(m, "config", None)
    if cfg is None:
        return True
    if getattr(cfg, "is_encoder_decoder", False):
        return False
    if hasattr(cfg, "use_decoder_only_language_model"):
        return bool(cfg.use_decoder_only_language_model)
    return True


def router_aux_coef(model: torch.nn.Module) -> float:
    """The weight of a mixture-of-experts model's router load-balancing loss in training (Mixtral,
    Qwen3-MoE: ``router_aux_loss_coef`` of configs that have ``output_router_logits``); 0 for other models."""
    m = model
    while hasattr(m, "module") and not hasattr(m, "config"):
        m = m.module
    cfg = getattr(m, "config", None)
    if cfg is None or not hasattr(cfg, "output_router_logits"):
        return 0.0
    return float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)


def forward_inputs(batch: dict, padded: bool) -> dict:
    """The model's keyword arguments from a collated batch: everything but the labels; the attention
    mask only when some row is padded (then HF can call SDPA with is_causal and no mask tensor)."""
    return {
        k: v
        for k, v in batch.items()
        if k != "labels" and (k != "attention_mask" or padded) and isinstance(v, torch.Tensor)
    }


# Model types whose forward returns exactly lm_head(final hidden states) as logits (no soft-capping or
# scaling after it): for them the loss can be computed from the hidden states in chunks.
PLAIN_HEAD_TYPES = ("llama", "mistral", "qwen2", "qwen3", "opt")
# Model types that soft-cap their logits only when the config sets final_logit_softcapping: Gemma 3 leaves
# it unset (Gemma 2 sets 30.0), so its head is plain.
SOFTCAP_WHEN_SET_TYPES = ("gemma3_text",)


def has_plain_head(config) -> bool:
    """Whether ``config``'s model returns exactly lm_head(final hidden states) as its logits."""
    kind = getattr(config, "model_type", None)
    if kind in SOFTCAP_WHEN_SET_TYPES:
        return getattr(config, "final_logit_softcapping", None) is None
    return kind in PLAIN_HEAD_TYPES


def plain_output_head(model: torch.nn.Module) -> Optional[torch.nn.Linear]:
    """The output layer when it is a plain bias-free Linear at the end of a plain-head model (else None:
    adapters or quantized layers on the head, or a model type that post-processes its logits)."""
    m = model
    while hasattr(m, "module") and not hasattr(m, "config"):
        m = m.module  # Fabric / DDP wrappers
    if not has_plain_head(getattr(m, "config", None)):
        return None
    get = getattr(m, "get_output_embeddings", None)
    head = get() if get is not None else None
    if type(head) is not torch.nn.Linear or head.bias is not None:  # noqa: E721 - subclasses (bnb) differ
        return None
    return head


def _pass_hidden(hidden: torch.Tensor) -> torch.Tensor:
    return hidden


class hidden_states_out:
    """Within this context the output layer passes its input through, so the model's ``logits`` are the
    final hidden states (for a chunked loss). The weights and state dict are untouched."""

    def __init__(self, head: Optional[torch.nn.Module]):
        self.head = head

    def __enter__(self):
        if self.head is not None:
            self.head.forward = _pass_hidden  # an instance attribute shadows the class's forward
        return self

    def __exit__(self, *exc):
        if self.head is not None:
            del self.head.forward


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks FSDP wraps one by one: the items of the model's block lists
    (``nn.ModuleList`` of one class: LlamaDecoderLayer, OPTDecoderLayer, T5Block, BLIP-2's vision
    encoder and Q-Former layers), outermost only, since a block sharded inside another sharded block
    is an overlapping mesh. HF's ``_no_split_modules`` is the fallback for models without such lists."""
    blocks = [
        m
        for lst in model.modules()
        if isinstance(lst, torch.nn.ModuleList) and len(lst) > 0 and len({type(x) for x in lst}) == 1
        for m in lst
    ]
    if not blocks:
        names: set[str] = set()
        for m in model.modules():
            names.update(getattr(m, "_no_split_modules", None) or [])
        blocks = [m for m in model.modules() if type(m).__name__ in names]
    inner = {id(c) for b in blocks for c in b.modules() if c is not b}
    blocks = [b for b in blocks if id(b) not in inner]
    if not blocks:
        raise ValueError(
            f"FSDP: found no transformer blocks to shard in {type(model).__name__} "
            "(no block lists, no _no_split_modules); use strategy=ddp for this model"
        )
    return blocks
