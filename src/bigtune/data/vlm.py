"""Image + caption data as a conversation, for vision-language models (Qwen2-VL, Qwen2.5-VL, LLaVA-1.5,
PaliGemma, PaliGemma 2).

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

LLaVA-1.5 and PaliGemma resize every image to their vision tower's size, so each image is a fixed
number of tokens: (image_size / patch)² (``image_tokens``), and the images stack into one
(batch, channels, height, width) ``pixel_values``. PaliGemma has no chat template: it is a prefix LM
(``prefix_lm``) that reads ``<image>×n BOS prompt \n`` and answers ``caption EOS``, as its processor lays
out a prompt and its ``suffix``; the prefix attends both ways and the answer causally, which the model
reads from ``token_type_ids`` (0 on the prefix, 1 on the answer).

Records are read, checked and reported exactly as for BLIP-2 (``bigtune.data.images``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from bigtune.core.stepmath import IGNORE_INDEX
from bigtune.data.chat import encode, render
from bigtune.data.images import ImageExample, open_image
from bigtune.data.text import DataError

# model_type of the chat vision-language models whose image tokens follow each image's size (Qwen2-VL);
# the planner lays out their batches (bigtune.plan.chatvlm) and keys on is_chat_vlm
CHAT_VLM_TYPES = ("qwen2_vl", "qwen2_5_vl")

# ... and of those that see every image at one fixed size, so as a fixed number of tokens
FIXED_IMAGE_VLM_TYPES = ("llava", "paligemma")

# prefix LMs: the image and prompt attend both ways (token_type_ids 0), the answer causally
PREFIX_LM_TYPES = ("paligemma",)


def is_chat_vlm(model_config) -> bool:
    """Qwen2-VL / Qwen2.5-VL: image tokens per image size (see CHAT_VLM_TYPES)."""
    return getattr(model_config, "model_type", "") in CHAT_VLM_TYPES


def is_vlm(model_config) -> bool:
    """Any model this module lays out: the caption is the answer to data.prompt beside the image."""
    return getattr(model_config, "model_type", "") in CHAT_VLM_TYPES + FIXED_IMAGE_VLM_TYPES


def fixed_image_tokens(model_config) -> int:
    """Language-model tokens of one image for LLaVA / PaliGemma: one per vision patch; LLaVA's "full"
    feature selection keeps CLIP's class token too ("default", LLaVA-1.5's, drops it)."""
    vc = model_config.vision_config
    n = (int(vc.image_size) // int(vc.patch_size)) ** 2
    return n + 1 if getattr(model_config, "vision_feature_select_strategy", "default") == "full" else n


def _text_ids(tok, text: str) -> list[int]:
    """Rendered text to ids as a processor tokenizes it: BOS added when the tokenizer adds one itself and
    the text does not start with it (llava-hf's template writes none; Llama's tokenizer adds it)."""
    ids = encode(tok, text)
    bos = tok.bos_token_id
    adds_bos = bos is not None and list(tok("a")["input_ids"][:1]) == [bos]
    return [bos] + ids if adds_bos and ids[:1] != [bos] else ids


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
    image_tokens: int = 0  # LLaVA / PaliGemma: tokens of every image; 0: from each image's grid (Qwen2-VL)
    prefix_lm: bool = False  # PaliGemma: no chat template; token_type_ids mark the prefix

    @classmethod
    def for_model(cls, processor, model_config, prompt: str) -> "ChatImageLayout":
        tok = processor.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        if getattr(model_config, "model_type", "") in PREFIX_LM_TYPES:
            return cls._prefix_lm(tok, model_config, prompt, int(pad))
        template = getattr(processor, "chat_template", None) or getattr(tok, "chat_template", None)
        if not template:
            raise DataError(
                "the processor has no chat template, so the prompt and caption cannot be laid out as a "
                "conversation; save the model's chat_template.jinja next to its processor"
            )
        if not prompt.strip():
            raise DataError("data.prompt is empty; a chat vision-language model needs a request beside the image")
        prompt_ids = _text_ids(tok, render(tok, template, conversation(prompt), True))
        image_id = int(model_config.image_token_id)
        if prompt_ids.count(image_id) != 1:
            raise DataError(
                f"the chat template renders the image as {prompt_ids.count(image_id)} image tokens (id {image_id}), "
                "not one placeholder; use the model's own chat template"
            )
        if is_chat_vlm(model_config):
            return cls(
                template, prompt, prompt_ids, image_id, int(pad), int(model_config.vision_config.spatial_merge_size)
            )
        return cls(template, prompt, prompt_ids, image_id, int(pad), 1, fixed_image_tokens(model_config))

    @classmethod
    def _prefix_lm(cls, tok, model_config, prompt: str, pad: int) -> "ChatImageLayout":
        """PaliGemma's prefix, as PaliGemmaProcessor builds it: the image, BOS, the prompt and a newline
        (the prompt may be empty: then the model captions the image unprompted)."""
        if tok.bos_token_id is None or tok.eos_token_id is None:
            raise DataError("the PaliGemma tokenizer has no BOS or EOS token; use the model's own tokenizer")
        image_id = int(model_config.image_token_id)
        prompt_ids = [image_id, int(tok.bos_token_id)] + encode(tok, prompt + "\n")
        return cls("", prompt, prompt_ids, image_id, pad, 1, fixed_image_tokens(model_config), prefix_lm=True)

    def _full_ids(self, tok, caption: str) -> list[int]:
        """The whole exchange's ids; the answer ends with EOS (llava-hf's template writes none, but LLaVA-1.5
        was trained with it, and without it the model never learns to stop)."""
        if self.prefix_lm:  # the processor's suffix: the caption and EOS
            return self.prompt_ids + encode(tok, caption) + [int(tok.eos_token_id)]
        full = _text_ids(tok, render(tok, self.template, conversation(self.prompt, caption), False))
        n = len(self.prompt_ids)
        if full[:n] != self.prompt_ids:
            raise DataError(
                "the chat template writes the user turn differently once the answer follows, so the answer's "
                f"tokens cannot be found exactly (caption {caption[:60]!r}); use the model's own chat template"
            )
        eos = tok.eos_token_id
        return full + [int(eos)] if eos is not None and eos not in full[n:] else full

    def encode(self, tok, caption: str, max_len: int) -> tuple[list[int], list[int], bool]:
        """(input_ids, labels, truncated) for one caption: the prompt's tokens labelled -100, the answer's
        tokens (cut so the text is at most ``max_len`` tokens) labelled with themselves."""
        full = self._full_ids(tok, caption)
        n = len(self.prompt_ids)
        if n >= max_len:
            raise DataError(
                f"data.max_seq_length={max_len}: the prompt alone is {n} tokens (chat template and data.prompt), "
                f"so no caption token fits; set data.max_seq_length above {n}"
            )
        truncated = len(full) > max_len
        full = full[:max_len]
        return full, [IGNORE_INDEX] * n + full[n:], truncated

    def image_token_count(self, grid_thw: Optional[torch.Tensor]) -> int:
        """Language-model tokens of one image: fixed (LLaVA, PaliGemma), or its patches over merge_size²."""
        if self.image_tokens:
            return self.image_tokens
        return int(grid_thw.prod()) // self.merge_size**2

    def prefix_length(self, count: int) -> int:
        """Tokens before the answer once the placeholder is ``count`` image tokens (the prompt comes first)."""
        return len(self.prompt_ids) - 1 + count

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
        item = image_item(self.layout, self.image_processor, open_image(ex.image), ex.input_ids, ex.labels)
        return item


def image_item(layout: ChatImageLayout, image_processor, image, ids: list[int], labels: Optional[list[int]]) -> dict:
    """One row: the image's pixels (and Qwen's tile grid), its placeholder expanded, and for a prefix LM the
    prefix length (the collator's token_type_ids)."""
    pixels = image_processor(image, return_tensors="pt")
    grid = pixels.get("image_grid_thw")
    count = layout.image_token_count(None if grid is None else grid[0])
    ids, expanded = layout.expand(ids, ids if labels is None else labels, count)
    item: dict = {"pixel_values": pixels["pixel_values"], "input_ids": ids}
    if grid is not None:
        item["image_grid_thw"] = grid
    if labels is not None:
        item["labels"] = expanded
    if layout.prefix_lm:
        item["prefix_length"] = layout.prefix_length(count)
    return item


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
    pixels concatenated (Qwen's patches along one axis, fixed-size images stacked), Qwen's
    ``mm_token_type_ids`` (1 on image tokens), from which the model places its 3-D rotary positions
    (M-RoPE), and a prefix LM's ``token_type_ids`` (0 on the prefix, 1 on the answer; padding 0, as the
    processor pads them)."""
    ids = _pad([x["input_ids"] for x in items], layout.pad_id, left)
    mask = _pad([[1] * len(x["input_ids"]) for x in items], 0, left)
    out: dict[str, Any] = {
        "pixel_values": torch.cat([x["pixel_values"] for x in items]),
        "input_ids": ids,
        "attention_mask": mask,
        "padded": any(len(x["input_ids"]) < ids.shape[1] for x in items),
    }
    if "image_grid_thw" in items[0]:
        out["image_grid_thw"] = torch.cat([x["image_grid_thw"] for x in items])
        out["mm_token_type_ids"] = (ids == layout.image_token_id).long() * mask
    if layout.prefix_lm:
        types = [[0] * x["prefix_length"] + [1] * (len(x["input_ids"]) - x["prefix_length"]) for x in items]
        out["token_type_ids"] = _pad(types, 0, left)
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
    items = [image_item(layout, image_processor, img, layout.prompt_ids, None) for img in images]
    batch = collate_chat_images(items, layout, left=True)
    del batch["padded"]
    return batch
