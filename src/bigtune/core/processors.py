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


def _image_only(cls):
    """``cls`` without its video processor; same ``__name__`` so what it saves names ``cls``."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        cls.__init__(self, image_processor, tokenizer, chat_template=chat_template, **kwargs)

    # transformers reads a processor's parts from its __init__ signature: this one has no video_processor
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
    from transformers import AutoImageProcessor, AutoTokenizer

    folder = Path(folder)
    cls = saved_processor_class(folder)
    if cls not in CHAT_VLM_PROCESSORS:
        return None
    template = None
    if (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif (folder / "chat_template.json").is_file():
        template = json.loads((folder / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    images = AutoImageProcessor.from_pretrained(str(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    return chat_vlm_processor(cls, images, tok, template or getattr(tok, "chat_template", None))


class AutoImageTextProcessor:
    """``AutoProcessor.from_pretrained``, except that a chat vision-language processor saved in a local
    folder loads as its image parts (see the module docstring)."""

    @staticmethod
    def from_pretrained(source: str, **kwargs):
        from transformers import AutoProcessor

        local = Path(source).expanduser()
        proc = load_chat_vlm_processor(local) if local.is_dir() else None
        return proc if proc is not None else AutoProcessor.from_pretrained(source, **kwargs)
