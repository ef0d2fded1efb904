"""Image + caption data as a conversation, for chat vision-language models (Qwen2-VL, Qwen2.5-VL).

Each record becomes one exchange: the user turn holds the image and ``data.prompt``, the assistant's
answer is the caption. The text comes from the processor's chat template. Which tokens are the answer
is found by rendering, never by looking for marker strings: the exchange rendered up to the generation
prompt (what the model sees when it is asked) must be the start of the whole exchange's tokens, and the
tokens after it carry the loss (the caption and the template's end of turn).

These models see an image at about its own size: it is cut into patches, and every merge_size² of them
become one language-model token. So the image stays a single ``<|image_pad|>`` placeholder until the
dataset has processed the image; the placeholder is then repeated once per image token (labelled
-100), and each batch is padded to its longest row. The images' patches are concatenated along one
axis (``pixel_values``), with one (t, h, w) patch grid per image (``image_grid_thw``).

Records are read, checked and reported exactly as for BLIP-2 (``bigtune.data.images``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from bigtune.core.stepmath import IGNORE_INDEX
from bigtune.data.chat import encode, render
from bigtune.data.images import ImageExample, open_image
from bigtune.data.text import DataError

# model_type of the chat vision-language models this module lays out
CHAT_VLM_TYPES = ("qwen2_vl", "qwen2_5_vl")


def is_chat_vlm(model_config) -> bool:
    return getattr(model_config, "model_type", "") in CHAT_VLM_TYPES


def conversation(prompt: str, caption: str | None = None) -> list[dict]:
    """The exchange in the chat template's structured form: image then prompt, then the caption."""
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}
    if caption is None:
        return [user]
    return [user, {"role": "assistant", "content": [{"type": "text", "text": caption}]}]


@dataclass
class ChatImageLayout:
    """The exchange's fixed part and the ids the collator needs (see the module docstring)."""

    template: str
    prompt: str
    prompt_ids: list[int]  # the user turn through the generation prompt, one image placeholder
    image_token_id: int
    pad_id: int
    merge_size: int

    @classmethod
    def for_model(cls, processor, model_config, prompt: str) -> "ChatImageLayout":
        tok = processor.tokenizer
        template = getattr(processor, "chat_template", None) or getattr(tok, "chat_template", None)
        if not template:
            raise DataError(
                "the processor has no chat template, so the prompt and caption cannot be laid out as a "
                "conversation; save the model's chat_template.jinja next to its processor"
            )
        if not prompt.strip():
            raise DataError("data.prompt is empty; a chat vision-language model needs a request beside the image")
        prompt_ids = encode(tok, render(tok, template, conversation(prompt), True))
        image_id = int(model_config.image_token_id)
        if prompt_ids.count(image_id) != 1:
            raise DataError(
                f"the chat template renders the image as {prompt_ids.count(image_id)} image tokens (id {image_id}), "
                "not one placeholder; use the model's own chat template"
            )
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return cls(template, prompt, prompt_ids, image_id, int(pad), int(model_config.vision_config.spatial_merge_size))

    def encode(self, tok, caption: str, max_len: int) -> tuple[list[int], list[int], bool]:
        """(input_ids, labels, truncated) for one caption: the prompt's tokens labelled -100, the answer's
        tokens (cut so the text is at most ``max_len`` tokens) labelled with themselves."""
        full = encode(tok, render(tok, self.template, conversation(self.prompt, caption), False))
        n = len(self.prompt_ids)
        if full[:n] != self.prompt_ids:
            raise DataError(
                "the chat template writes the user turn differently once the answer follows, so the answer's "
                f"tokens cannot be found exactly (caption {caption[:60]!r}); use the model's own chat template"
            )
        if n >= max_len:
            raise DataError(
                f"data.max_seq_length={max_len}: the prompt alone is {n} tokens (chat template and data.prompt), "
                f"so no caption token fits; set data.max_seq_length above {n}"
            )
        truncated = len(full) > max_len
        full = full[:max_len]
        return full, [IGNORE_INDEX] * n + full[n:], truncated

    def image_token_count(self, grid_thw: torch.Tensor) -> int:
        """Language-model tokens of one image: its patches over merge_size²."""
        return int(grid_thw.prod()) // self.merge_size**2

    def expand(self, ids: list[int], labels: list[int], count: int) -> tuple[list[int], list[int]]:
        """``ids``/``labels`` with the image placeholder repeated ``count`` times (labels -100)."""
        at = ids.index(self.image_token_id)
        return (
            ids[:at] + [self.image_token_id] * count + ids[at + 1 :],
            labels[:at] + [IGNORE_INDEX] * count + labels[at + 1 :],
        )


class ChatImageDataset(torch.utils.data.Dataset):
    """Processes an example's image on access (in DataLoader workers when there are some) and expands
    its placeholder to the image's token count."""

    def __init__(self, items: list[ImageExample], image_processor, layout: ChatImageLayout):
        self.items, self.image_processor, self.layout = items, image_processor, layout

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict:
        ex = self.items[i]
        pixels = self.image_processor(open_image(ex.image), return_tensors="pt")
        grid = pixels["image_grid_thw"]
        ids, labels = self.layout.expand(ex.input_ids, ex.labels, self.layout.image_token_count(grid[0]))
        return {"pixel_values": pixels["pixel_values"], "image_grid_thw": grid, "input_ids": ids, "labels": labels}


def _pad(rows: list[list[int]], value: int, left: bool = False) -> torch.Tensor:
    n = max(len(r) for r in rows)
    out = torch.full((len(rows), n), value, dtype=torch.long)
    for i, r in enumerate(rows):
        if left:
            out[i, n - len(r) :] = torch.tensor(r, dtype=torch.long)
        else:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def collate_chat_images(items: list[dict], layout: ChatImageLayout, left: bool = False) -> dict[str, Any]:
    """One batch: rows padded to the longest (right for training, ``left`` for generation), the images'
    patches concatenated, and ``mm_token_type_ids`` (1 on image tokens), from which the model places
    its 3-D rotary positions (M-RoPE)."""
    ids = _pad([x["input_ids"] for x in items], layout.pad_id, left)
    mask = _pad([[1] * len(x["input_ids"]) for x in items], 0, left)
    out: dict[str, Any] = {
        "pixel_values": torch.cat([x["pixel_values"] for x in items]),
        "image_grid_thw": torch.cat([x["image_grid_thw"] for x in items]),
        "input_ids": ids,
        "attention_mask": mask,
        "mm_token_type_ids": (ids == layout.image_token_id).long() * mask,
        "padded": any(len(x["input_ids"]) < ids.shape[1] for x in items),
    }
    if "labels" in items[0]:
        out["labels"] = _pad([x["labels"] for x in items], IGNORE_INDEX, left)
    return out


class ChatImageCollator:
    def __init__(self, layout: ChatImageLayout):
        self.layout = layout

    def __call__(self, batch: list[dict]) -> dict[str, Any]:
        return collate_chat_images(batch, self.layout)


def generation_batch(layout: ChatImageLayout, image_processor, images: list) -> dict[str, Any]:
    """Model inputs asking ``layout.prompt`` about each image (PIL images), left-padded for ``generate``."""
    items = []
    for img in images:
        pixels = image_processor(img, return_tensors="pt")
        grid = pixels["image_grid_thw"]
        ids, _ = layout.expand(layout.prompt_ids, layout.prompt_ids, layout.image_token_count(grid[0]))
        items.append({"pixel_values": pixels["pixel_values"], "image_grid_thw": grid, "input_ids": ids})
    batch = collate_chat_images(items, layout, left=True)
    del batch["padded"]
    return batch
