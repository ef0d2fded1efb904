"""Processors of chat vision-language models (Qwen2-VL, Qwen2.5-VL), image-only.

transformers checks every part a processor declares, the video processor included, and rejects a
missing one; its video processors need torchvision, whose PyPI wheel does not import beside a CPU-only
torch. bigtune trains and captions photos, so such a processor is always built from its image processor
(the PIL variant) and tokenizer alone: an image-only subclass under the same class name, so that a
folder it saves says ``Qwen2VLProcessor`` and loads as the full processor elsewhere. The same build is
used with or without torchvision, so a run behaves the same on both.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

# processor_class (processor_config.json) of the chat vision-language models bigtune trains
CHAT_VLM_PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor")


# image-text-to-text model types with a path of their own: BLIP-2's Q-Former (bigtune.data.images) and the six
# families bigtune.data.vlm lays out itself (their ids and losses stay as they were); every other family
# transformers maps as image-text-to-text takes the generic path
OWN_PATH_VLM_TYPES = ("blip-2", "qwen2_vl", "qwen2_5_vl", "llava", "paligemma", "idefics3", "llava_next")


def is_generic_vlm(model_config) -> bool:
    """An image-text-to-text model of a family without a path of its own: bigtune.data.vlm's generic path."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    kind = getattr(model_config, "model_type", "")
    return kind in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and kind not in OWN_PATH_VLM_TYPES


def _image_only(cls):
    """``cls`` without its video processor; same ``__name__`` so what it saves names ``cls``."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        cls.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    # transformers reads a processor's parts from its __init__ signature: this one has no video_processor
    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})


def takes_video(cls) -> bool:
    """Whether processor class ``cls`` declares a video processor (which needs torchvision to load)."""
    import inspect

    return "video_processor" in inspect.signature(cls.__init__).parameters


def image_only_processor_class(cls):
    """Any processor class without its video processor (see the module docstring), ``cls`` itself when it
    has none. The family's own __init__ runs with ``video_processor=None``; ProcessorMixin then keeps the parts
    this class's signature declares, image processor and tokenizer."""
    if not takes_video(cls):
        return cls

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        cls.__init__(
            self,
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})


def chat_vlm_processor(class_name: str, image_processor, tokenizer, chat_template: Optional[str]):
    """A ``class_name`` processor (Qwen2VLProcessor, Qwen2_5_VLProcessor) from its parts, image-only: bigtune
    trains and captions photos, not videos. Also where torchvision is installed: the full class would
    then want a video processor, and transformers rejects None for it (check_argument_for_proper_class)."""
    import transformers

    if class_name not in CHAT_VLM_PROCESSORS:
        raise ValueError(f"{class_name}: not a chat vision-language processor ({', '.join(CHAT_VLM_PROCESSORS)})")
    cls = getattr(transformers, class_name)
    return _image_only(cls)(image_processor=image_processor, tokenizer=tokenizer, chat_template=chat_template)


def saved_processor_class(folder: Path) -> Optional[str]:
    """The processor_class a local folder's processor_config.json (or preprocessor_config.json) names."""
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        f = Path(folder) / name
        if f.is_file():
            try:
                cls = json.loads(f.read_text(encoding="utf-8")).get("processor_class")
            except (OSError, json.JSONDecodeError):
                continue
            if cls:
                return cls
    return None


def load_chat_vlm_processor(folder: Path):
    """The processor saved in ``folder`` without its video processor (see chat_vlm_processor), or None when
    the folder does not hold a chat vision-language processor."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    folder = Path(folder)
    cls = saved_processor_class(folder)
    generic = cls not in CHAT_VLM_PROCESSORS and cls is not None and hasattr(transformers, cls)
    if generic and not takes_video(getattr(transformers, cls)):
        return None
    if cls not in CHAT_VLM_PROCESSORS and not generic:
        return None
    template = None
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        template = json.loads((folder / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    images = AutoImageProcessor.from_pretrained(str(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    template = template or getattr(tok, "chat_template", None)
    if generic:  # any other family's processor with a video part: its own settings read back, image-only
        settings = json.loads((folder / "processor_config.json").read_text(encoding="utf-8"))
        kwargs = {k: v for k, v in settings.items() if k not in ("processor_class", "image_processor", "tokenizer")}
        kwargs = {k: v for k, v in kwargs.items() if not isinstance(v, dict)}
        klass = image_only_processor_class(getattr(transformers, cls))
        return klass(image_processor=images, tokenizer=tok, chat_template=template, **kwargs)
    return chat_vlm_processor(cls, images, tok, template)


class AutoImageTextProcessor:
    """``AutoProcessor.from_pretrained``, except that a chat vision-language processor saved in a local
    folder loads as its image parts (see the module docstring)."""

    @staticmethod
    def from_pretrained(source: str, **kwargs):
        from transformers import AutoProcessor

        local = Path(source).expanduser()
        proc = load_chat_vlm_processor(local) if local.is_dir() else None
        return proc if proc is not None else AutoProcessor.from_pretrained(source, **kwargs)
