"""Image + caption data as a conversation, for vision-language models (Qwen2-VL, Qwen2.5-VL, LLaVA-1.5,
LLaVA-NeXT, PaliGemma, PaliGemma 2, SmolVLM).

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

LLaVA-NeXT fits each image into one of several tile grids and adds the whole image at the tower's size
(``AnyresTiles``): its token count follows the image's size and aspect, and each row's images are
``(1, tiles, channels, size, size)`` pixels, padded with all-zero tiles to the batch's most tiles (as its
processor pads them), beside their original sizes (``image_sizes``), from which the model finds its tiles.

Every other image-text-to-text family transformers ships (Qwen3-VL, Gemma 3, InternVL, Mistral 3, SmolVLM 2,
GLM-4.1V, ...) takes the generic path (``generic``, issue #46), which knows no family: the user turn is
rendered by the model's chat template with an image content part, and the model's own processor expands that
rendered prompt with the image (its placeholder into the image's tokens, whatever tiles, rows or markers the
family writes; its pixels and any per-image or per-token tensors). The answer's tokens are found as for the
other families, by rendering with and without the answer; they follow the expanded prompt. Rows are padded
to the batch's longest; the processor's per-image tensors are concatenated along their first axis, zero-padded
where the images differ in size, as the processors pad them.

Records are read, checked and reported exactly as for BLIP-2 (``bigtune.data.images``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from bigtune.core.processors import is_generic_vlm
from bigtune.core.stepmath import IGNORE_INDEX
from bigtune.data.chat import encode, render
from bigtune.data.images import ImageExample, open_image
from bigtune.data.text import DataError

# model_type of the chat vision-language models whose image tokens follow each image's size (Qwen2-VL);
# the planner lays out their batches (bigtune.plan.step.chatvlm) and keys on is_chat_vlm
CHAT_VLM_TYPES = ("qwen2_vl", "qwen2_5_vl")

# ... and of those that see every image at one fixed size, so as a fixed number of tokens
FIXED_IMAGE_VLM_TYPES = ("llava", "paligemma")

# prefix LMs: the image and prompt attend both ways (token_type_ids 0), the answer causally
PREFIX_LM_TYPES = ("paligemma",)

# ... and of those that split a large image into tiles plus the whole image scaled down (Idefics3, which
# SmolVLM is): a fixed number of tokens per tile, the tiles' count following the image's size
SPLIT_IMAGE_VLM_TYPES = ("idefics3",)

# ... and of those that fit an image into the best of several tile grids ("anyres": LLaVA-NeXT), whose
# token count follows the image's size and aspect (see AnyresTiles)
ANYRES_VLM_TYPES = ("llava_next",)

# every other image-text-to-text family takes the generic path (core.processors.is_generic_vlm: OWN_PATH_VLM_TYPES
# lists BLIP-2 and the types above)


def is_chat_vlm(model_config) -> bool:
    """Qwen2-VL / Qwen2.5-VL: image tokens per image size (see CHAT_VLM_TYPES)."""
    return getattr(model_config, "model_type", "") in CHAT_VLM_TYPES


def is_vlm(model_config) -> bool:
    """Any model this module lays out: the caption is the answer to data.prompt beside the image."""
    kinds = CHAT_VLM_TYPES + FIXED_IMAGE_VLM_TYPES + SPLIT_IMAGE_VLM_TYPES + ANYRES_VLM_TYPES
    return getattr(model_config, "model_type", "") in kinds or is_generic_vlm(model_config)


def unsupported_reason(model_config, processor=None) -> Optional[str]:
    """Why the generic path cannot train ``model_config``'s family on images and captions (None: it can):
    no processor class in transformers (remote code), or a processor that takes video only or audio too.
    ``processor``: the loaded one (None: the family's class in transformers is checked)."""
    import transformers
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    name = PROCESSOR_MAPPING_NAMES.get(getattr(model_config, "model_type", ""))
    cls = type(processor) if processor is not None else getattr(transformers, name or "", None)
    if cls is None:
        return "transformers has no processor class for it (its processor is remote code, trust_remote_code)"
    parts = set(cls.get_attributes()) if hasattr(cls, "get_attributes") else set()
    if processor is not None:
        parts |= {p for p in ("image_processor", "feature_extractor", "video_processor") if hasattr(processor, p)}
    if "feature_extractor" in parts or "audio_tokenizer" in parts:
        return f"its processor ({cls.__name__}) takes audio as well; bigtune trains on images and captions"
    if "image_processor" not in parts:
        what = "video only" if "video_processor" in parts else "no images"
        return f"its processor ({cls.__name__}) takes {what}"
    return None


def check_supported(model_config, processor) -> None:
    """One clear error (DataError) for a family the generic path cannot train: video-only, audio, remote code."""
    if not is_generic_vlm(model_config):
        return
    if reason := unsupported_reason(model_config, processor):
        kind = getattr(model_config, "model_type", "?")
        raise DataError(
            f"model type {kind!r}: {reason}. bigtune fine-tunes image-text-to-text models on images with "
            "captions; choose an image-text model (Qwen3-VL, Gemma 3, InternVL, SmolVLM, ...)"
        )


def fixed_image_tokens(model_config) -> int:
    """Language-model tokens of one image for LLaVA / PaliGemma: one per vision patch; LLaVA's "full"
    feature selection keeps CLIP's class token too ("default", LLaVA-1.5's, drops it)."""
    vc = model_config.vision_config
    n = (int(vc.image_size) // int(vc.patch_size)) ** 2
    return n + 1 if getattr(model_config, "vision_feature_select_strategy", "default") == "full" else n


@dataclass(frozen=True)
class SplitImageText:
    """Idefics3's (SmolVLM's) image text, as Idefics3Processor writes it in place of ``<image>``: for each
    tile ``<fake_token_around_image><row_r_col_c>`` and its ``<image>`` tokens, a newline after each row of
    tiles, then a newline and ``<fake_token_around_image><global-img>`` with the whole image's tokens, closed
    by ``<fake_token_around_image>``; an image not split (rows = cols = 0) is the global part alone. Each piece
    sits between special tokens, so its ids are the same in any text: tokenized once here."""

    image_token_id: int
    tile_tokens: int  # <image> tokens per tile: (image_size / patch)² / scale_factor²
    fake: tuple[int, ...]
    global_tag: tuple[int, ...]
    newline: tuple[int, ...]
    blank_line: tuple[int, ...]
    tile_tags: tuple[tuple[int, ...], ...]  # row-major, 6 × 6 as the processor's <row_r_col_c> tokens

    @classmethod
    def for_tokenizer(cls, tok, image_token_id: int, tile_tokens: int) -> "SplitImageText":
        tags = tuple(tuple(encode(tok, f"<row_{r}_col_{c}>")) for r in range(1, 7) for c in range(1, 7))
        ids = (encode(tok, t) for t in ("<fake_token_around_image>", "<global-img>", "\n", "\n\n"))
        fake, global_tag, newline, blank_line = (tuple(x) for x in ids)
        return cls(image_token_id, tile_tokens, fake, global_tag, newline, blank_line, tags)

    def ids(self, rows: int, cols: int) -> list[int]:
        """The ids in place of one image split into ``rows`` × ``cols`` tiles."""
        if rows > 6 or cols > 6:
            raise DataError(f"an image split into {rows}×{cols} tiles: Idefics3's tile tokens go up to 6×6")
        tokens = [self.image_token_id] * self.tile_tokens
        out: list[int] = []
        for r in range(rows):
            for c in range(cols):
                out += [*self.fake, *self.tile_tags[r * 6 + c], *tokens]
            out += self.newline if r < rows - 1 else self.blank_line
        return out + [*self.fake, *self.global_tag, *tokens, *self.fake]


@dataclass(frozen=True)
class AnyresTiles:
    """LLaVA-NeXT's image tokens ("anyres"), from the model config, whose settings decide how many features
    the model makes of an image: the image is fitted into the best of ``pinpoints`` (transformers'
    select_best_resolution: the most of the image's pixels kept, then the least padding), that resolution
    cut into ``tile``-px tiles, each (tile / patch)² features; the model drops the rows (or columns) of
    features that only hold the fit's padding, ends every remaining row with a newline embedding, and
    puts the whole image at ``tile`` px (the base image) first."""

    pinpoints: tuple[tuple[int, int], ...]  # (height, width) px, multiples of tile
    tile: int  # px: the vision tower's image size
    patch: int
    class_token: bool  # "full" feature selection keeps CLIP's class token on the base image

    @classmethod
    def from_config(cls, model_config) -> "AnyresTiles":
        vc = model_config.vision_config
        pins = tuple((int(h), int(w)) for h, w in model_config.image_grid_pinpoints)
        full = getattr(model_config, "vision_feature_select_strategy", "default") == "full"
        return cls(pins, int(vc.image_size), int(vc.patch_size), full)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of tiles for an image of ``height`` × ``width`` pixels."""
        from transformers.image_processing_utils import select_best_resolution

        h, w = select_best_resolution((height, width), [list(p) for p in self.pinpoints])
        return h // self.tile, w // self.tile

    def tiles(self, height: int, width: int) -> int:
        """Images the vision tower runs for one image: its tiles and the base image."""
        rows, cols = self.grid(height, width)
        return rows * cols + 1

    def tokens(self, height: int, width: int) -> int:
        """Language-model tokens of one image of ``height`` × ``width`` pixels."""
        rows, cols = self.grid(height, width)
        side = self.tile // self.patch
        h, w = rows * side, cols * side
        # the fit scaled the image to touch two opposite sides and padded the other two evenly: the feature
        # rows (or columns) of that padding are dropped, an even number, as transformers' unpad_image does
        if width / height > w / h:
            h -= (h - int(round(height * (w / width), 7))) // 2 * 2
        else:
            w -= (w - int(round(width * (h / height), 7))) // 2 * 2
        return h * w + h + side * side + int(self.class_token)

    def worst_size(self) -> tuple[int, int]:
        """The image size with the most tokens (then tiles): an image exactly one pinpoint's size, which is
        not padded, so none of its features are dropped."""
        return max(self.pinpoints, key=lambda p: (self.tokens(*p), self.tiles(*p)))


def generic_budget_size(image_processor, max_pixels: int) -> Optional[dict]:
    """The generic path's image processor ``size`` under ``max_pixels`` pixels per image, by the processor's own
    convention: pixel-count bounds (Qwen-style ``shortest_edge``/``longest_edge`` beside a ``merge_size``) take
    the budget as the most pixels; a ``longest_edge`` resize takes its square root as the longest edge. None: the
    processor resizes every image to one size (``height``/``width``), which a budget would not change."""
    import math

    size = dict(getattr(image_processor, "size", None) or {})
    if "longest_edge" in size and "shortest_edge" in size and getattr(image_processor, "merge_size", None):
        return {"shortest_edge": min(int(size["shortest_edge"] or max_pixels), max_pixels), "longest_edge": max_pixels}
    if "longest_edge" in size:
        return {**size, "longest_edge": math.isqrt(max_pixels)}
    return None


def image_max_pixels_problem(model_config, name: str, processor=None) -> Optional[str]:
    """Why data.image_max_pixels cannot apply to ``model_config`` (None: it can): every model but Qwen2-VL,
    Idefics3 and the generic path's size-following processors resizes each image to its vision tower's one
    size, so the budget would change nothing."""
    model_type = getattr(model_config, "model_type", "")
    if model_type in CHAT_VLM_TYPES + SPLIT_IMAGE_VLM_TYPES:
        return None
    if is_generic_vlm(model_config) and processor is not None:
        ip = processor.image_processor
        if generic_budget_size(ip, 1 << 20) is not None:
            return None
        return (
            f"data.image_max_pixels: {name} ({model_type}) resizes every image to {dict(ip.size)} px; remove "
            "data.image_max_pixels"
        )
    size = getattr(getattr(model_config, "vision_config", None), "image_size", None)
    what = f"resizes every image to {size}×{size} px" if size else "does not take a pixel budget"
    if model_type in ANYRES_VLM_TYPES:  # its largest image is its largest pinpoint
        what = "fits every image into one of its image_grid_pinpoints (tile grids), which bound it"
    return f"data.image_max_pixels: {name} ({model_type}) {what}; remove data.image_max_pixels"


def image_size_for_budget(image_processor, model_config, max_pixels: int, name: str) -> dict:
    """The image processor's ``size`` under a budget of ``max_pixels`` pixels per image (data.image_max_pixels).
    Qwen2-VL: the budget is max_pixels (``longest_edge``; min_pixels lowered to it if above). Idefics3: the
    longest edge images are resized to, floor(sqrt(budget)) rounded down to the tile size, so a square image
    at that edge fits the budget and no image has more tiles than it. Raises DataError for other models and
    for a budget below one image token (Qwen: (patch × merge)² px) or one tile (Idefics3)."""
    import math

    if problem := image_max_pixels_problem(model_config, name):
        raise DataError(problem)
    size = getattr(image_processor, "size", None) or {}
    if is_chat_vlm(model_config):
        vc = model_config.vision_config
        patch = int(getattr(image_processor, "patch_size", None) or vc.patch_size)
        merge = int(getattr(image_processor, "merge_size", None) or vc.spatial_merge_size)
        if max_pixels < (patch * merge) ** 2:
            raise DataError(
                f"data.image_max_pixels={max_pixels}: below one image token of {name} ({patch * merge}×"
                f"{patch * merge} px); set it to at least {(patch * merge) ** 2}"
            )
        shortest = size.get("shortest_edge") or max_pixels
        return {"shortest_edge": min(int(shortest), max_pixels), "longest_edge": max_pixels}
    tile = int((getattr(image_processor, "max_image_size", None) or {}).get("longest_edge") or 0)
    tile = tile or int(model_config.vision_config.image_size)
    edge = math.isqrt(max_pixels) // tile * tile
    if edge < tile:
        raise DataError(
            f"data.image_max_pixels={max_pixels}: below one {tile}×{tile} px tile of {name}; set it to at least "
            f"{tile * tile}"
        )
    return {"longest_edge": edge}


def bound_image_pixels(processor, model_config, max_pixels: Optional[int], name: str) -> None:
    """Set data.image_max_pixels on ``processor``'s image processor (see image_size_for_budget), so the
    training data, and the run's saved processor that `bigtune caption` loads, keep within it."""
    if max_pixels is None:
        return
    ip = processor.image_processor
    if is_generic_vlm(model_config):
        if problem := image_max_pixels_problem(model_config, name, processor):
            raise DataError(problem)
        size = generic_budget_size(ip, int(max_pixels))
        for attr, key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):  # Qwen-style copies
            if getattr(ip, attr, None) is not None and "merge_size" in vars(ip):
                setattr(ip, attr, size[key])
        ip.size = type(ip.size)(**size)
        return
    ip.size = type(ip.size)(**image_size_for_budget(ip, model_config, int(max_pixels), name))


def split_tile_tokens(processor, model_config) -> int:
    """``<image>`` tokens per Idefics3 tile: the processor's image_seq_len, else from the config (patches per
    tile over scale_factor², the connector's pixel shuffle)."""
    n = getattr(processor, "image_seq_len", None)
    if n:
        return int(n)
    vc = model_config.vision_config
    return (int(vc.image_size) // int(vc.patch_size)) ** 2 // int(model_config.scale_factor) ** 2


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
    split: Optional[SplitImageText] = None  # Idefics3 / SmolVLM: the image's tiles written out as text
    anyres: Optional[AnyresTiles] = None  # LLaVA-NeXT: tokens from each image's size
    processor: Any = None  # the generic path: the model's processor expands the rendered prompt with its image
    prompt_text: str = ""  # ... the rendered user turn through the generation prompt, one image content part

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
        prompt_text = render(tok, template, conversation(prompt), True)
        prompt_ids = _text_ids(tok, prompt_text)
        if is_generic_vlm(model_config):
            check_supported(model_config, processor)
            image_id = generic_image_token_id(model_config, processor)
            return cls(
                template, prompt, prompt_ids, image_id, int(pad), 1, processor=processor, prompt_text=prompt_text
            )
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
        if getattr(model_config, "model_type", "") in SPLIT_IMAGE_VLM_TYPES:
            split = SplitImageText.for_tokenizer(tok, image_id, split_tile_tokens(processor, model_config))
            return cls(template, prompt, prompt_ids, image_id, int(pad), 1, split=split)
        if getattr(model_config, "model_type", "") in ANYRES_VLM_TYPES:
            return cls(
                template, prompt, prompt_ids, image_id, int(pad), 1, anyres=AnyresTiles.from_config(model_config)
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

    def image_ids(self, pixels) -> list[int]:
        """The ids in place of one image's placeholder, from the image processor's output: the image token
        repeated (a fixed count for LLaVA / PaliGemma, Qwen's patches over merge_size², LLaVA-NeXT's from the
        image's size), or Idefics3's tiles written out (its rows and columns)."""
        if self.split is not None:
            return self.split.ids(int(pixels["rows"][0][0]), int(pixels["cols"][0][0]))
        if self.anyres is not None:
            height, width = (int(x) for x in pixels["image_sizes"][0])
            return [self.image_token_id] * self.anyres.tokens(height, width)
        count = self.image_tokens or int(pixels["image_grid_thw"][0].prod()) // self.merge_size**2
        return [self.image_token_id] * count

    def prefix_length(self, count: int) -> int:
        """Tokens before the answer once the placeholder is ``count`` tokens (the prompt comes first)."""
        return len(self.prompt_ids) - 1 + count

    def expand(self, ids: list[int], labels: list[int], image: list[int]) -> tuple[list[int], list[int]]:
        """``ids``/``labels`` with the image placeholder replaced by ``image`` (labels -100)."""
        at = ids.index(self.image_token_id)
        return ids[:at] + image + ids[at + 1 :], labels[:at] + [IGNORE_INDEX] * len(image) + labels[at + 1 :]


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
    if layout.processor is not None:
        return generic_item(layout, image, ids, labels)
    extra = {"return_row_col_info": True} if layout.split is not None else {}
    pixels = image_processor(image, return_tensors="pt", **extra)
    grid = pixels.get("image_grid_thw")
    image_ids = layout.image_ids(pixels)
    count = len(image_ids)
    ids, expanded = layout.expand(ids, ids if labels is None else labels, image_ids)
    item: dict = {"pixel_values": pixels["pixel_values"], "input_ids": ids, "image_length": count}
    if grid is not None:
        item["image_grid_thw"] = grid
    if "image_sizes" in pixels:  # LLaVA-NeXT: the image's (height, width), from which the model finds its tiles
        item["image_sizes"] = pixels["image_sizes"]
    if "pixel_attention_mask" in pixels:  # Idefics3: (1, tiles + 1, height, width), the real pixels of each
        item["pixel_attention_mask"] = pixels["pixel_attention_mask"]
        item["image_tiles"] = [int(pixels["rows"][0][0]), int(pixels["cols"][0][0])]
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


def _cat_images(pixels: list[torch.Tensor], per_row: bool) -> torch.Tensor:
    """The rows' pixels as one tensor; with ``per_row`` (Idefics3's and LLaVA-NeXT's (1, images, ...) rows)
    padded with all-zero images to the most images of a row, as their processors pad them (Idefics3 skips
    all-zero images; LLaVA-NeXT takes each row's own count of tiles from its image size)."""
    if not per_row:
        return torch.cat(pixels)
    n = max(p.shape[1] for p in pixels)
    return torch.cat([torch.nn.functional.pad(p, (0, 0) * (p.dim() - 2) + (0, n - p.shape[1])) for p in pixels])


def collate_chat_images(items: list[dict], layout: ChatImageLayout, left: bool = False) -> dict[str, Any]:
    """One batch: rows padded to the longest (right for training, ``left`` for generation), the images'
    pixels concatenated (Qwen's patches along one axis, fixed-size images stacked), Qwen's
    ``mm_token_type_ids`` (1 on image tokens), from which the model places its 3-D rotary positions
    (M-RoPE), and a prefix LM's ``token_type_ids`` (0 on the prefix, 1 on the answer; padding 0, as the
    processor pads them)."""
    if layout.processor is not None:
        return _collate_generic(items, layout, left)
    ids = _pad([x["input_ids"] for x in items], layout.pad_id, left)
    mask = _pad([[1] * len(x["input_ids"]) for x in items], 0, left)
    per_row = items[0]["pixel_values"].dim() == 5
    out: dict[str, Any] = {
        "pixel_values": _cat_images([x["pixel_values"] for x in items], per_row),
        "input_ids": ids,
        "attention_mask": mask,
        "padded": any(len(x["input_ids"]) < ids.shape[1] for x in items),
    }
    if "image_sizes" in items[0]:  # LLaVA-NeXT; the engine records them for the planner's re-plan too
        out["image_sizes"] = torch.cat([x["image_sizes"] for x in items])
    if "pixel_attention_mask" in items[0]:
        out["pixel_attention_mask"] = _cat_images([x["pixel_attention_mask"] for x in items], per_row)
        # each row's (rows, cols) of tiles, which the engine records for the planner's re-plan (not a model input)
        out["image_tiles"] = [x["image_tiles"] for x in items]
    if "image_grid_thw" in items[0]:
        out["image_grid_thw"] = torch.cat([x["image_grid_thw"] for x in items])
        out["mm_token_type_ids"] = (ids == layout.image_token_id).long() * mask
    else:  # the most tokens a row's image takes: how the engine counts the batch's text tokens (its shape)
        out["image_tokens"] = max(x["image_length"] for x in items)
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


# -- the generic path -------------------------------------------------------------------------------------------

# per-token tensors a processor may return beside input_ids, (1, tokens, ...) for one row: extended over the
# answer with their last prompt position's value (0 for token types: the answer is text; Mllama's cross-attention
# mask: the answer sees the image as the prompt's end does), padded with 0
PER_TOKEN_KEYS = ("attention_mask", "token_type_ids", "mm_token_type_ids", "cross_attention_mask")


def generic_image_token_id(model_config, processor) -> int:
    """The id the model replaces with image features: the config's image token (``image_token_id`` or
    ``image_token_index``), else the processor's."""
    for key in ("image_token_id", "image_token_index"):
        value = getattr(model_config, key, None)
        if isinstance(value, int):
            return value
    value = getattr(processor, "image_token_id", None)
    if isinstance(value, int):
        return value
    raise DataError(
        f"model type {getattr(model_config, 'model_type', '?')!r}: neither its config nor its processor names an "
        "image token id; use the model's own config and processor"
    )


def generic_item(layout: ChatImageLayout, image, ids: list[int], labels: Optional[list[int]]) -> dict:
    """One row of the generic path: the processor's expansion of the rendered prompt with ``image``, then
    the answer's ids (``ids`` after the unexpanded prompt), labelled -100 on the expanded prompt."""
    proc, tok = layout.processor, layout.processor.tokenizer
    out = proc(text=[layout.prompt_text], images=[image], return_tensors="pt", add_special_tokens=False)
    expanded = [int(x) for x in out["input_ids"][0]]
    lead = 0  # BOS, when the tokenizer adds one itself and the template does not write it (as _text_ids)
    if layout.prompt_ids[:1] == [tok.bos_token_id] and expanded[:1] != [tok.bos_token_id]:
        expanded, lead = [int(tok.bos_token_id)] + expanded, 1
    if layout.image_token_id not in expanded:
        raise DataError(
            f"{type(proc).__name__} wrote no image token (id {layout.image_token_id}) for the image in the rendered "
            "prompt: the chat template's image part is not the processor's placeholder; use the model's own chat "
            "template"
        )
    n = len(layout.prompt_ids)
    answer = len(ids) - n
    per_token, images = {}, {}
    for key, value in out.items():
        if key == "input_ids" or not isinstance(value, torch.Tensor):
            continue
        if key in PER_TOKEN_KEYS:
            value = value[0]
            if lead:
                value = torch.cat([value[:1], value])
            if answer:
                value = torch.cat([value, value[-1:].expand(answer, *value.shape[1:])])
            per_token[key] = value
        else:
            images[key] = value
    item: dict = {
        "image_px": [int(image.height), int(image.width)],
        "input_ids": expanded + ids[n:],
        "image_length": len(expanded) - n + 1,  # the image's tokens less the placeholder's one
        "per_token": per_token,
        "images": images,
    }
    if labels is not None:
        item["labels"] = [IGNORE_INDEX] * len(expanded) + labels[n:]
    return item


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenated along the first axis, each zero-padded at the end of every other axis to the largest."""
    shape = [max(t.shape[d] for t in tensors) for d in range(tensors[0].dim())]
    out = []
    for t in tensors:
        pad: list[int] = []
        for d in reversed(range(1, t.dim())):
            pad += [0, shape[d] - t.shape[d]]
        out.append(torch.nn.functional.pad(t, pad) if any(pad) else t)
    return torch.cat(out)


def _collate_generic(items: list[dict], layout: ChatImageLayout, left: bool) -> dict[str, Any]:
    """The generic path's batch: ids, labels and per-token tensors padded to the longest row (right for
    training, ``left`` for generation), the processor's per-image tensors concatenated (see _cat_padded)."""
    ids = _pad([x["input_ids"] for x in items], layout.pad_id, left)
    mask = _pad([[1] * len(x["input_ids"]) for x in items], 0, left)
    out: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
    for key in items[0]["per_token"]:
        if key == "attention_mask":
            continue
        rows = [x["per_token"][key] for x in items]
        width = ids.shape[1]
        padded = torch.zeros((len(rows), width, *rows[0].shape[1:]), dtype=rows[0].dtype)
        for i, r in enumerate(rows):
            if left:
                padded[i, width - len(r) :] = r
            else:
                padded[i, : len(r)] = r
        out[key] = padded
    for key in items[0]["images"]:
        out[key] = _cat_padded([x["images"][key] for x in items])
    out["padded"] = any(len(x["input_ids"]) < ids.shape[1] for x in items)
    out["image_tokens"] = max(x["image_length"] for x in items)
    # each row's image (height, width) px, which the engine records for the planner's re-plan (not a model input)
    out["image_px"] = [x["image_px"] for x in items]
    if "labels" in items[0]:
        out["labels"] = _pad([x["labels"] for x in items], IGNORE_INDEX, left)
    return out


def generation_batch(layout: ChatImageLayout, image_processor, images: list) -> dict[str, Any]:
    """Model inputs asking ``layout.prompt`` about each image (PIL images), left-padded for ``generate``."""
    items = [image_item(layout, image_processor, img, layout.prompt_ids, None) for img in images]
    batch = collate_chat_images(items, layout, left=True)
    del batch["padded"]
    batch.pop("image_tokens", None)
    batch.pop("image_tiles", None)
    batch.pop("image_px", None)
    return batch
