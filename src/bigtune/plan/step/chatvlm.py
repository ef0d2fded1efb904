"""The planner's side of chat vision-language models (Qwen2-VL, Qwen2.5-VL; LLaVA, PaliGemma, Idefics3 /
SmolVLM and LLaVA-NeXT further down).

Such a model sees each image at about its own size: the processor resizes it to multiples of
patch × merge pixels within its min/max pixels, cuts it into patch × patch tiles (each repeated over
``temporal_patch_size`` frames), and every merge² tiles become one language-model token. So a
synthetic batch needs the processor's bounds, not just the model config. A plain plan is the worst
case: every image at the processor's max_pixels (data.image_max_pixels when set, as training sets it on the
processor). ``bigtune plan --image-size HxW`` (that image as the processor resizes it) and the engine's
re-plan of a measured batch give their own image grids instead.

The batch is laid out as ``bigtune.data.vlm`` lays out a real one: the user turn (chat template, the
image placeholder repeated once per image token, data.prompt) labelled -100, the answer after it up to
data.max_seq_length text tokens, each row padded to the longest; the images' tiles concatenated in
``pixel_values`` with one (t, h, w) grid per image in ``image_grid_thw``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Optional
from unittest import mock

import torch

from bigtune.recipe import Recipe

Grid = tuple[int, int, int]  # one image's (t, h, w) tile grid, as image_grid_thw holds it
ImageSizeHW = tuple[int, int]  # one image's (height, width) px

# transformers' Qwen2VLImageProcessor defaults, for a model whose processor cannot be loaded here
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


@dataclass(frozen=True)
class ImageGeometry:
    """How the model's processor turns an image into tiles and tokens, and the user turn's token ids."""

    patch: int
    merge: int
    temporal: int
    channels: int
    min_pixels: int
    max_pixels: int
    prompt_ids: tuple[int, ...]  # the user turn through the generation prompt, one image placeholder
    image_token_id: int
    from_processor: bool  # False: the prompt is a bare placeholder (and without a processor, default bounds)
    bounds_from_processor: bool = True  # False: min/max pixels are transformers' defaults
    max_pixels_from_recipe: bool = False  # True: max_pixels is data.image_max_pixels

    @property
    def factor(self) -> int:
        return self.patch * self.merge

    def grid(self, height: int, width: int) -> Grid:
        """The tile grid of an image of ``height`` × ``width`` pixels after the processor's resize."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return (1, h // self.patch, w // self.patch)

    def worst_grid(self) -> Grid:
        """The grid with the most tokens any image can get: the largest a × b merged units whose pixels
        (a·b·factor²) fit in max_pixels, the squarest of equals (an image of exactly that size is not resized)."""
        units = max(1, self.max_pixels // self.factor**2)
        a = max(range(1, math.isqrt(units) + 1), key=lambda x: (x * (units // x), x))
        return (1, a * self.merge, (units // a) * self.merge)

    def tokens(self, grid: Grid) -> int:
        return grid[0] * grid[1] * grid[2] // self.merge**2

    def tile_width(self) -> int:
        """Elements per tile in ``pixel_values``: channels × frames × patch²."""
        return self.channels * self.temporal * self.patch**2


def is_chat_vlm_config(config) -> bool:
    from bigtune.data.vlm import is_chat_vlm

    return is_chat_vlm(config)


def is_fixed_image_vlm_config(config) -> bool:
    """LLaVA-1.5, PaliGemma: every image resized to the vision tower's size, so a fixed number of tokens."""
    from bigtune.data.vlm import FIXED_IMAGE_VLM_TYPES

    return getattr(config, "model_type", "") in FIXED_IMAGE_VLM_TYPES


def check_image_budget(recipe: Recipe, config) -> None:
    """Refuse data.image_max_pixels for a model that resizes every image to one size (DataError, as training)."""
    from bigtune.data.text import DataError
    from bigtune.data.vlm import image_max_pixels_problem

    if recipe.data.image_max_pixels is None:
        return
    proc = _processor(recipe.model) if is_generic_vlm_config(config) else None
    if problem := image_max_pixels_problem(config, recipe.model.name, proc):
        raise DataError(problem)


# -- the generic path (bigtune.data.vlm's generic layout: the model's processor lays out every row) ------------

# the side of the square image a plan assumes for a generic-path model when neither --image-size nor
# data.image_max_pixels says more: the processor's own geometry then caps it (its largest resize, its most
# tiles), as it would a large photo
PLANNED_IMAGE_SIDE = 2048


def is_generic_vlm_config(config) -> bool:
    from bigtune.core.processors import is_generic_vlm

    return is_generic_vlm(config)


def generic_image_sizes(recipe: Recipe, images: Optional[tuple], rows: int) -> list[ImageSizeHW]:
    """One (height, width) per row: ``images`` in turn (--image-size, or a measured batch's sizes), else a
    square at data.image_max_pixels, else PLANNED_IMAGE_SIDE px."""
    if images:
        return [tuple(int(x) for x in images[i % len(images)]) for i in range(rows)]
    budget = recipe.data.image_max_pixels
    side = math.isqrt(int(budget)) if budget else PLANNED_IMAGE_SIDE
    return [(side, side)] * rows


def generic_layout(recipe: Recipe, config):
    """The model's processor (data.image_max_pixels set on it, as training sets it) and its generic layout."""
    from bigtune.data.vlm import ChatImageLayout, bound_image_pixels

    proc = _processor(recipe.model)
    bound_image_pixels(proc, config, recipe.data.image_max_pixels, recipe.model.name)
    return ChatImageLayout.for_model(proc, config, recipe.data.prompt)


@contextlib.contextmanager
def one_thread():
    """torch on one intra-op thread inside, as before outside."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def generic_batch(recipe: Recipe, cfg, b_size: int, padded: bool, images: Optional[tuple]) -> dict:
    """A micro-batch laid out exactly as training lays one out (bigtune.data.vlm's generic path), by the model's
    own processor from blank images of the planned sizes: every row the expanded prompt and an answer up to
    data.max_seq_length text tokens (random ids below the image token), padded to the longest row."""
    from PIL import Image

    from bigtune.core.stepmath import IGNORE_INDEX
    from bigtune.data.vlm import collate_chat_images, generic_item

    layout = generic_layout(recipe, cfg)
    g = torch.Generator().manual_seed(0)
    top = min(int(cfg.get_text_config().vocab_size), layout.image_token_id)
    answer_len = max(1, recipe.data.max_seq_length - len(layout.prompt_ids))
    items = []
    # On one thread: the processor's and the collation's ops on full-size pixels would otherwise start
    # OpenMP's pool in this process, and the worker processes a plan forks later would hang in their first
    # parallel op (a plan of Gemma 3's 896-px photos hung so on 2 cores).
    with one_thread():
        for h, w in generic_image_sizes(recipe, images, b_size):
            ids = list(layout.prompt_ids) + torch.randint(3, top, (answer_len,), generator=g).tolist()
            image = Image.new("RGB", (w, h), (128, 128, 128))
            items.append(generic_item(layout, image, ids, ids))
        batch = collate_chat_images(items, layout)
    if padded and not batch["padded"]:  # one padded position: the explicit-mask attention path
        batch["attention_mask"][-1, -1], batch["labels"][-1, -1] = 0, IGNORE_INDEX
        batch["padded"] = True
    return batch


def generic_images_note(recipe: Recipe, config, images: Optional[tuple]) -> str:
    """What the plan assumed about a generic-path model's images."""
    from bigtune.data.vlm import generic_budget_size

    sizes = generic_image_sizes(recipe, images, recipe.train.micro_batch_size)
    batch = generic_batch(recipe, config, 1, False, tuple(sizes[:1]))
    layout = generic_layout(recipe, config)
    h, w = sizes[0]
    ip = layout.processor.image_processor
    if generic_budget_size(ip, 1 << 20) is None and getattr(ip.size, "height", None):  # one size for every photo
        what = f"every photo resized to {ip.size.height}×{ip.size.width} px"
    else:
        why = "" if images or recipe.data.image_max_pixels else " (no data.image_max_pixels: a large photo)"
        what = f"{h}×{w} px{why}"
    tokens = int((batch["input_ids"][0] == layout.image_token_id).sum())
    note = f"images: {what}, as {type(layout.processor).__name__} lays it out: {tokens} image tokens"
    standin = standin_note(recipe.model)
    return note if standin is None else f"{note}; {standin}"


def is_vlm_config(config) -> bool:
    """Any vision-language model whose batch bigtune.data.vlm lays out (and this module plans)."""
    from bigtune.data.vlm import is_vlm

    return is_vlm(config)


_PROCESSORS: dict[tuple, object] = {}  # one load per model for the several simulations of a plan
_STANDINS: dict[tuple, str] = {}  # the models whose processor is the bundled stand-in: why the real one did not load


def _processor(model):
    """The model's processor; offline, a bundled checkpoint's processor class at its published settings
    (models.configs.bundled_processor), which lays its images out as the real one."""
    from bigtune.models.build import load_processor
    from bigtune.models.configs import ModelError, bundled_processor

    key = (model.name, model.tokenizer, model.init, model.revision)
    if key not in _PROCESSORS:
        try:
            _PROCESSORS[key] = load_processor(model)
        except ModelError as e:
            standin = bundled_processor(model)
            if standin is None:
                raise
            _PROCESSORS[key] = standin
            _STANDINS[key] = str(e).splitlines()[0]
    return _PROCESSORS[key]


def standin_note(model) -> Optional[str]:
    """Where the plan laid images out with the bundled processor settings instead of the model's own
    processor (offline, a gated checkpoint...): that, and why the real one did not load; else None."""
    why = _STANDINS.get((model.name, model.tokenizer, model.init, model.revision))
    if why is None:
        return None
    return (
        f"processor: {model.name}'s own did not load ({why}); its published settings bundled with bigtune laid "
        "the images out instead (the same image tokens; the text around them from a stand-in tokenizer)"
    )


def _processor_and_layout(recipe: Recipe, config):
    """The model's processor and chat image layout where they load here (a preset's are built locally); None
    for what does not (the hub unreachable, no chat template): the callers fall back to published defaults."""
    from bigtune.data.vlm import ChatImageLayout

    proc = layout = None
    try:
        proc = _processor(recipe.model)
        layout = ChatImageLayout.for_model(proc, config, recipe.data.prompt)
    except Exception:  # noqa: BLE001 - no processor (hub unreachable, ...) or no chat template: defaults
        pass
    return proc, layout


def image_geometry(recipe: Recipe, config) -> ImageGeometry:
    """The processor's geometry for ``recipe``'s model (bounds and prompt from its processor where it loads
    here: a preset's is built locally; else transformers' default bounds and a bare image placeholder)."""
    from bigtune.data.vlm import image_size_for_budget

    vc = config.vision_config
    proc, layout = _processor_and_layout(recipe, config)
    ip = getattr(proc, "image_processor", None)
    size = getattr(ip, "size", None)
    bounds = {k: getattr(size, k, None) for k in ("shortest_edge", "longest_edge")}
    budget = recipe.data.image_max_pixels
    if budget is not None:  # the bounds training sets on the processor (bigtune.data.vlm.bound_image_pixels)
        bounds = image_size_for_budget(ip, config, int(budget), recipe.model.name)
    return ImageGeometry(
        patch=int(getattr(ip, "patch_size", None) or vc.patch_size),
        merge=int(getattr(ip, "merge_size", None) or vc.spatial_merge_size),
        temporal=int(getattr(ip, "temporal_patch_size", None) or vc.temporal_patch_size),
        channels=int(getattr(vc, "in_channels", None) or getattr(vc, "in_chans", 3)),
        min_pixels=int(bounds["shortest_edge"] or DEFAULT_MIN_PIXELS),
        max_pixels=int(bounds["longest_edge"] or DEFAULT_MAX_PIXELS),
        prompt_ids=tuple(layout.prompt_ids) if layout else (int(config.image_token_id),),
        image_token_id=int(config.image_token_id),
        from_processor=layout is not None,
        bounds_from_processor=size is not None or budget is not None,
        max_pixels_from_recipe=budget is not None,
    )


def parse_image_size(text: str) -> tuple[int, int]:
    """``HxW`` pixels (e.g. 448x448) as (height, width)."""
    try:
        h, w = (int(x) for x in text.lower().replace("×", "x").split("x"))
    except ValueError:
        raise ValueError(f"--image-size {text!r}: expected HEIGHTxWIDTH in pixels, e.g. 448x448") from None
    if h < 1 or w < 1:
        raise ValueError(f"--image-size {text!r}: both sides must be at least 1 pixel")
    return h, w


def image_pixels(ref) -> tuple[int, int]:
    """(height, width) of an image (a path, bytes, a datasets {bytes, path} dict or a PIL image), from its header."""
    import io

    from PIL import Image

    if isinstance(ref, dict):
        ref = ref.get("bytes") or ref.get("path")
    if isinstance(ref, (bytes, bytearray)):
        ref = io.BytesIO(ref)
    if isinstance(ref, Image.Image):
        return ref.height, ref.width
    with Image.open(ref) as img:
        return img.height, img.width


def grids_for(geometry: ImageGeometry, images: Optional[tuple[Grid, ...]], rows: int) -> list[Grid]:
    """One grid per row: ``images`` in turn, or the worst case (max_pixels) for every row."""
    if not images:
        return [geometry.worst_grid()] * rows
    return [tuple(int(x) for x in images[i % len(images)]) for i in range(rows)]


def _answered_rows(rows: list[list[int]], answer_len: int, top: int, padded: bool) -> tuple:
    """(input_ids, labels, attention_mask) of a batch as ChatImageCollator pads it: each row's ids (image
    tokens in place) then a random answer of ``answer_len`` ids below ``top`` (seeded, one draw per row),
    the loss on the answer only, right-padded to the longest row; ``padded`` with every row full: one
    padded position, so the explicit-mask attention path a real padded batch takes is the one simulated."""
    from bigtune.core.stepmath import IGNORE_INDEX

    g = torch.Generator().manual_seed(0)
    length = max(len(row) for row in rows) + answer_len
    ids = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        answer = torch.randint(3, top, (answer_len,), generator=g).tolist()
        n = len(row) + answer_len
        ids[i, :n], labels[i, len(row) : n], mask[i, :n] = torch.tensor(row + answer), torch.tensor(answer), 1
    if padded and bool(mask.all()):
        mask[-1, -1], labels[-1, -1] = 0, IGNORE_INDEX
    return ids, labels, mask


def synthetic_batch(
    recipe: Recipe, cfg, geometry: ImageGeometry, b_size: int, padded: bool, images: Optional[tuple[Grid, ...]]
) -> dict:
    """A micro-batch shaped as ChatImageCollator builds it: every row data.max_seq_length text tokens (the
    image placeholder among them) plus its image's tokens, padded to the longest row."""

    grids = grids_for(geometry, images, b_size)
    counts = [geometry.tokens(grid) for grid in grids]
    prompt = list(geometry.prompt_ids)
    at = prompt.index(geometry.image_token_id)
    answer_len = max(1, recipe.data.max_seq_length - len(prompt))
    # answer ids below every special (image, vision start/end) id: the image tokens are only where placed
    special = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    top = min([int(cfg.text_config.vocab_size)] + [int(getattr(cfg, k)) for k in special if getattr(cfg, k, None)])
    rows = [prompt[:at] + [geometry.image_token_id] * c + prompt[at + 1 :] for c in counts]
    ids, labels, mask = _answered_rows(rows, answer_len, top, padded)
    # A shape only: simulate() swaps in a fake tensor (see _fake_pixels).
    pixels = torch.empty(sum(t * h * w for t, h, w in grids), geometry.tile_width())
    return {
        "pixel_values": pixels,
        "image_grid_thw": torch.tensor(grids, dtype=torch.long),
        "input_ids": ids,
        "attention_mask": mask,
        "mm_token_type_ids": (ids == geometry.image_token_id).long() * mask,
        "labels": labels,
        "padded": padded or not bool(mask.all()),
    }


@dataclass(frozen=True)
class FixedImageLayout:
    """A fixed-image model's exchange (LLaVA-1.5, PaliGemma): its user turn or prefix, one image placeholder
    among the ids, and every image's token count and pixel size from the config."""

    prompt_ids: tuple[int, ...]
    image_token_id: int
    image_tokens: int
    prefix_lm: bool  # PaliGemma: token_type_ids 0 on the prefix, 1 on the answer
    from_processor: bool  # False: a bare image placeholder (the processor did not load here)


def fixed_image_layout(recipe: Recipe, config) -> FixedImageLayout:
    """The layout bigtune.data.vlm gives ``recipe``'s data (from the model's processor where it loads here)."""
    from bigtune.data.vlm import PREFIX_LM_TYPES, ChatImageLayout, fixed_image_tokens

    image_id = int(config.image_token_id)
    try:
        chat = ChatImageLayout.for_model(_processor(recipe.model), config, recipe.data.prompt)
        prompt, known = tuple(chat.prompt_ids), True
    except Exception:  # noqa: BLE001 - no processor (hub unreachable, ...) or no chat template: a bare placeholder
        prompt, known = (image_id,), False
    prefix_lm = getattr(config, "model_type", "") in PREFIX_LM_TYPES
    return FixedImageLayout(prompt, image_id, fixed_image_tokens(config), prefix_lm, known)


def fixed_image_batch(recipe: Recipe, cfg, layout: FixedImageLayout, b_size: int, padded: bool) -> dict:
    """A micro-batch shaped as ChatImageCollator builds it for LLaVA / PaliGemma: every row the prompt (its
    placeholder as the image's tokens) and an answer up to data.max_seq_length text tokens; the images
    stacked as (batch, channels, size, size) pixels; a prefix LM's token_type_ids."""
    from bigtune.core.stepmath import IGNORE_INDEX

    g = torch.Generator().manual_seed(0)
    prompt = list(layout.prompt_ids)
    at = prompt.index(layout.image_token_id)
    row = prompt[:at] + [layout.image_token_id] * layout.image_tokens + prompt[at + 1 :]
    answer_len = max(1, recipe.data.max_seq_length - len(prompt))
    top = min(int(cfg.text_config.vocab_size), layout.image_token_id)  # answer ids below the image token
    answers = torch.randint(3, top, (b_size, answer_len), generator=g)
    ids = torch.cat([torch.tensor([row] * b_size, dtype=torch.long), answers], 1)
    labels = torch.cat([torch.full((b_size, len(row)), IGNORE_INDEX, dtype=torch.long), answers], 1)
    mask = torch.ones_like(ids)
    types = torch.cat([torch.zeros(b_size, len(row), dtype=torch.long), torch.ones_like(answers)], 1)
    if padded:  # one padded row: the explicit-mask attention path a real padded batch takes
        mask[-1, -1], labels[-1, -1], types[-1, -1] = 0, IGNORE_INDEX, 0
    vc = cfg.vision_config
    # A shape only: simulate() swaps in a fake tensor (see _fake_pixels).
    pixels = torch.empty(b_size, int(getattr(vc, "num_channels", 3)), int(vc.image_size), int(vc.image_size))
    batch = {"pixel_values": pixels, "input_ids": ids, "attention_mask": mask, "labels": labels, "padded": padded}
    if layout.prefix_lm:
        batch["token_type_ids"] = types
    batch["image_tokens"] = layout.image_tokens  # the engine's batch-shape rule reads it (loop._text_shape)
    return batch


def fixed_images_note(config, layout: FixedImageLayout) -> str:
    """What the plan assumed about a fixed-image model's images."""
    size = int(config.vision_config.image_size)
    src = "" if layout.from_processor else "; the processor did not load here, so a bare image placeholder"
    return f"images: every image resized to {size}×{size} px ({layout.image_tokens} image tokens){src}"


@dataclass(frozen=True)
class CaptionImages:
    """What ``bigtune caption`` gives a chat vision-language model per image (bigtune.data.vlm.generation_batch):
    the processor's prompt with one image placeholder, the image's tokens and one image's pixel_values."""

    prompt_ids: tuple[int, ...]
    image_token_id: int
    image_tokens: int  # language-model tokens of one image
    vision_patches: int  # patches the vision tower runs per image (time estimates)
    grid: Optional[Grid]  # Qwen2-VL: the image's (t, h, w) tile grid; None: a fixed-size image
    # Qwen2-VL: (tiles, tile width), one image's rows; SmolVLM, LLaVA-NeXT: (images, channels, tile, tile);
    # else (channels, size, size)
    pixel_shape: tuple[int, ...]
    prefix_lm: bool  # PaliGemma: token_type_ids (0 on the whole prefix)
    note: str
    image_ids: tuple[int, ...] = ()  # SmolVLM: the ids in place of the placeholder (tile text); (): image tokens
    image_size: Optional[ImageSizeHW] = None  # LLaVA-NeXT: the image's (height, width), its image_sizes
    pixel_mask: bool = False  # SmolVLM: pixel_attention_mask, 1 on every pixel of its (whole) tiles


def caption_images(recipe: Recipe, config, image_size: Optional[tuple[int, int]] = None) -> CaptionImages:
    """The images a caption plan gives ``recipe``'s model: Qwen2-VL's worst case (max_pixels, or
    data.image_max_pixels) or ``image_size`` as its processor resizes it, SmolVLM's and LLaVA-NeXT's worst
    case (the most tiles and tokens) or ``image_size`` as they tile it; LLaVA / PaliGemma's one size."""
    from bigtune.data.text import DataError
    from bigtune.data.vlm import image_max_pixels_problem

    check_image_budget(recipe, config)
    if is_chat_vlm_config(config):
        geo = image_geometry(recipe, config)
        grid = geo.grid(*image_size) if image_size else geo.worst_grid()
        patches = grid[0] * grid[1] * grid[2]
        note = images_note(geo, (grid,) if image_size else None, 1)
        return CaptionImages(
            geo.prompt_ids,
            geo.image_token_id,
            geo.tokens(grid),
            patches,
            grid,
            (patches, geo.tile_width()),
            False,
            note,
        )
    if is_split_image_vlm_config(config):
        return split_caption_images(recipe, config, image_size)
    if is_anyres_vlm_config(config):
        return anyres_caption_images(recipe, config, image_size)
    if image_size:  # the same refusal as a training plan's --image-size
        raise DataError(
            f"--image-size is for Qwen2-VL / Qwen2.5-VL, SmolVLM and LLaVA-NeXT models; {recipe.model.name} sees "
            "images at a fixed size"
        )
    if not is_fixed_image_vlm_config(config):
        raise DataError(image_max_pixels_problem(config, recipe.model.name) or f"{recipe.model.name}: not a chat VLM")
    layout = fixed_image_layout(recipe, config)
    vc = config.vision_config
    size, patch = int(vc.image_size), int(vc.patch_size)
    clip_class_token = getattr(vc, "model_type", "") == "clip_vision_model"  # CLIP's tower adds one, SigLIP's none
    return CaptionImages(
        layout.prompt_ids,
        layout.image_token_id,
        layout.image_tokens,
        (size // patch) ** 2 + int(clip_class_token),
        None,
        (int(getattr(vc, "num_channels", 3)), size, size),
        layout.prefix_lm,
        fixed_images_note(config, layout),
    )


def caption_inputs(images: CaptionImages, batch_size: int, dtype: torch.dtype) -> dict:
    """A generation batch as generation_batch builds it for ``batch_size`` such images (every row the same
    length, so no padding). Integer tensors from Python lists: under fake tensors they keep their values
    (real_index_math); the pixels are random (fake under fake tensors)."""
    at = images.prompt_ids.index(images.image_token_id)
    image = list(images.image_ids) or [images.image_token_id] * images.image_tokens
    row = [*images.prompt_ids[:at], *image, *images.prompt_ids[at + 1 :]]
    ids = torch.tensor([row] * batch_size, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    rows = (
        (batch_size * images.pixel_shape[0], *images.pixel_shape[1:])
        if images.grid
        else (batch_size, *images.pixel_shape)
    )
    out = {
        "pixel_values": torch.randn(rows, generator=g).to(dtype),
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
    }
    if images.grid:
        out["image_grid_thw"] = torch.tensor([list(images.grid)] * batch_size, dtype=torch.long)
        out["mm_token_type_ids"] = (ids == images.image_token_id).long()
    if images.prefix_lm:
        out["token_type_ids"] = torch.zeros_like(ids)
    if images.image_size:
        out["image_sizes"] = torch.tensor([list(images.image_size)] * batch_size, dtype=torch.long)
    if images.pixel_mask:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        # A real tensor even under fake tensors: Idefics3's plan reads which images are real from its values
        # (split_image_features), and at real sizes it is too large to be kept as a known fake tensor.
        with unset_fake_temporarily():
            shape = (batch_size, images.pixel_shape[0], *images.pixel_shape[2:])
            out["pixel_attention_mask"] = torch.ones(shape, dtype=torch.long)
    return out


def has_vision_block_kinds(config) -> bool:
    """Qwen2.5-VL: its vision blocks attend within windows, except the full-attention ones
    (fullatt_block_indexes, every 8th in the published models)."""
    return bool(getattr(config.vision_config, "fullatt_block_indexes", None))


def vision_blocks(config, kind: str) -> int:
    """Qwen2.5-VL's vision blocks of one ``kind``: "full" (full attention) or "window"."""
    vc = config.vision_config
    full = len(set(int(i) for i in vc.fullatt_block_indexes or []))
    return full if kind == "full" else int(vc.depth) - full


def set_vision_blocks(config, kind: str, n: int) -> None:
    """Make ``n`` of Qwen2.5-VL's vision blocks of ``kind`` (the other kind's count kept), the full-attention
    blocks spread as evenly as the published placement (each one closing its share of the tower: 32 blocks,
    4 full: 7, 15, 23, 31). Unchanged counts keep the placement as it is."""
    if vision_blocks(config, kind) == n:
        return
    other = "window" if kind == "full" else "full"
    full = n if kind == "full" else vision_blocks(config, other)
    depth = n + vision_blocks(config, other)
    vc = config.vision_config
    vc.depth = depth
    vc.fullatt_block_indexes = [(i + 1) * depth // full - 1 for i in range(full)]


def images_note(geometry: ImageGeometry, images: Optional[tuple[Grid, ...]], micro: int) -> str:
    """What the plan assumed about the images."""
    grids = grids_for(geometry, images, micro)
    sizes = sorted({(h * geometry.patch, w * geometry.patch, geometry.tokens((t, h, w))) for t, h, w in grids})
    what = ", ".join(f"{h}×{w} px ({n} image tokens)" for h, w, n in sizes)
    why = ""
    if not images:
        whose = "data.image_max_pixels" if geometry.max_pixels_from_recipe else "the processor's max_pixels"
        why = f": the worst case, {whose}={geometry.max_pixels} (--image-size HxW to plan yours)"
    src = ""
    if not geometry.from_processor:
        src = "; the processor or its chat template did not load here, so a bare image placeholder" + (
            "" if geometry.bounds_from_processor else " and transformers' default pixel bounds"
        )
    return f"images: one per row at {what}{why}{src}"


# Integer tensors up to this many elements stay known under fake tensors (see real_index_math).
KNOWN_NUMEL = 1 << 20


def _on_known_values(fn):
    """``fn`` run on the known values of its (integer) tensor arguments, outside fake mode; its tensors
    come back as known fake copies, made through the dispatch modes so the memory tracker counts them."""

    def run(*args, **kwargs):
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
        from torch.utils._pytree import tree_map, tree_map_only

        def real(t):
            return t.constant if isinstance(t, FakeTensor) and t.constant is not None else t

        args, kwargs = tree_map(real, (args, kwargs))
        with unset_fake_temporarily():
            out = fn(*args, **kwargs)
        return tree_map_only(torch.Tensor, lambda t: t.clone(), out)

    return run


# methods that work out positions or indices from their integer inputs' values (``.tolist()``, loops per
# image), run on known values for any generic-path family that defines them (Qwen3-VL, GLM-4.1V, ...)
INDEX_MATH_METHODS = ("get_rope_index", "get_vision_position_ids", "get_vision_window_index")


def _generic_index_math(stack: contextlib.ExitStack, config) -> None:
    """Run the generic-path family's index math (INDEX_MATH_METHODS of its modeling module's classes) on known
    values, as real_index_math does for Qwen2-VL's."""
    import importlib

    kind = getattr(config, "model_type", "").replace("-", "_")
    try:
        module = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    except ImportError:
        return
    for cls in vars(module).values():
        if not isinstance(cls, type):
            continue
        for name in INDEX_MATH_METHODS:
            if name in vars(cls):
                stack.enter_context(mock.patch.object(cls, name, _on_known_values(getattr(cls, name))))


@contextlib.contextmanager
def real_index_math(config=None):
    """Qwen2-VL's forward works out positions and attention segments from the values of its integer inputs
    (image grids, token types, mask): ``.tolist()``, ``.item()``, boolean indexing, loops per image. Fake
    tensors have no values, so here integer tensors entering fake mode keep theirs (a fake tensor's
    ``constant``): FakeTensorMode then computes ops on them for real, and outputs of up to KNOWN_NUMEL
    elements stay known. Their bytes are counted as any fake tensor's. The helpers that build their
    indices from ``torch.arange`` (the 3-D rotary positions, Qwen2.5-VL's attention windows) run on the
    real values outright. Idefics3 (SmolVLM) reads which images are padding from pixel_attention_mask
    (split_image_features). The model's float compute stays fake. That real work runs on one thread: an
    OpenMP pool started here would hang the worker processes plans fork later (as in _fake_pixels)."""
    from torch._subclasses import fake_tensor
    from transformers import masking_utils
    from transformers.models.idefics3 import modeling_idefics3
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    convert = fake_tensor.FakeTensorConverter.from_real_tensor

    def from_real_tensor(self, fake_mode, t, make_constant=False, *args, **kwargs):
        known = make_constant or (not t.is_floating_point() and t.numel() <= KNOWN_NUMEL)
        return convert(self, fake_mode, t, known, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(one_thread())
        stack.enter_context(mock.patch.object(fake_tensor, "CONSTANT_NUMEL_LIMIT", KNOWN_NUMEL))
        stack.enter_context(mock.patch.object(fake_tensor.FakeTensorConverter, "from_real_tensor", from_real_tensor))
        for cls in (modeling_qwen2_vl.Qwen2VLModel, modeling_qwen2_5_vl.Qwen2_5_VLModel):
            stack.enter_context(mock.patch.object(cls, "get_rope_index", _on_known_values(cls.get_rope_index)))
        window = _on_known_values(modeling_qwen2_5_vl.get_vision_window_index)
        stack.enter_context(mock.patch.object(modeling_qwen2_5_vl, "get_vision_window_index", window))
        # (can_return_tuple: upstream's decorator, which takes return_dict)
        features = modeling_idefics3.can_return_tuple(split_image_features)
        stack.enter_context(mock.patch.object(modeling_idefics3.Idefics3Model, "get_image_features", features))
        for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
            skip = _skip_on_known_values(getattr(masking_utils, name))
            stack.enter_context(mock.patch.object(masking_utils, name, skip))
        if config is not None and is_generic_vlm_config(config):
            _generic_index_math(stack, config)
        yield


def _skip_on_known_values(fn):
    """transformers' test whether SDPA can do without a padding mask (``_ignore_causal_mask_sdpa``,
    ``_ignore_bidirectional_mask_sdpa``: none of it masked), run on the mask's values where they are known.
    transformers never reads a fake tensor's values ("tracing") and keeps the mask, which sends SDPA down
    another kernel, with an S×S mask, than the real run's: a caption batch of equal rows (all ones) or
    Idefics3's vision tower (its patch mask is all ones for whole tiles) attend without a mask there."""

    def skip(padding_mask, *args, **kwargs):
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        if isinstance(padding_mask, FakeTensor) and padding_mask.constant is not None:
            with unset_fake_temporarily():
                return fn(padding_mask.constant, *args, **kwargs)
        return fn(padding_mask, *args, **kwargs)

    return skip


# --- Idefics3 (SmolVLM): an image split into tiles plus the whole image ---------------------------------
TileGrid = tuple[int, int]  # one image's (rows, cols) of tiles; (0, 0): not split, the whole image alone

# SmolVLM-Instruct's published preprocessor_config.json, for a model whose processor cannot be loaded here:
# images upscaled to 4 tiles on their longest side (its config.json's vision_config.size is not read by the
# processor), tiles of the vision tower's image_size
SPLIT_EDGE_TILES = 4


def is_split_image_vlm_config(config) -> bool:
    """Idefics3 / SmolVLM: a large image split into tiles, the tiles' count following its size."""
    from bigtune.data.vlm import SPLIT_IMAGE_VLM_TYPES

    return getattr(config, "model_type", "") in SPLIT_IMAGE_VLM_TYPES


@dataclass(frozen=True)
class SplitGeometry:
    """How Idefics3's processor tiles an image, and the user turn's token ids."""

    longest_edge: int  # px: every image is resized to this longest side (then to whole tiles)
    tile: int  # px: the tiles' (and the global image's) side, the vision tower's image size
    channels: int
    tile_tokens: int  # <image> tokens per tile (and for the global image)
    prompt_ids: tuple[int, ...]  # the user turn through the generation prompt, one image placeholder
    image_token_id: int
    text: object  # bigtune.data.vlm.SplitImageText from the tokenizer; None: one token per tile marker
    from_processor: bool
    edge_from_recipe: bool = False  # True: longest_edge is from data.image_max_pixels

    def grid(self, height: int, width: int) -> TileGrid:
        """The tiles of an image of ``height`` × ``width`` pixels, as the processor counts them."""
        from transformers import Idefics3ImageProcessorPil

        ip = Idefics3ImageProcessorPil(
            size={"longest_edge": self.longest_edge}, max_image_size={"longest_edge": self.tile}
        )
        _, rows, cols = ip.get_number_of_image_patches(height, width)
        return int(rows), int(cols)

    def worst_grid(self) -> TileGrid:
        """The most tiles: a square image, at longest_edge on both sides."""
        return self.grid(self.longest_edge, self.longest_edge)

    def images(self, grid: TileGrid) -> int:
        """Images the vision tower runs for one such image: its tiles and the global image."""
        return grid[0] * grid[1] + 1 if grid[0] * grid[1] else 1

    def image_ids(self, grid: TileGrid) -> list[int]:
        """The ids in place of the image's placeholder. Without the tokenizer each tile marker
        (<fake_token_around_image>, <row_r_col_c>, <global-img>, the newlines) is one token, as SmolVLM's
        special tokens are; their ids only need not be the image token's."""
        if self.text is not None:
            return self.text.ids(*grid)
        rows, cols = grid
        tile = [0, 0] + [self.image_token_id] * self.tile_tokens
        out = (tile * cols + [0]) * rows
        return out + [0, 0] + [self.image_token_id] * self.tile_tokens + [0]


def split_geometry(recipe: Recipe, config) -> SplitGeometry:
    """The processor's tiling for ``recipe``'s model (its processor where it loads here, else SmolVLM-Instruct's
    published one: SPLIT_EDGE_TILES tiles of vision_config.image_size), data.image_max_pixels applied."""
    from bigtune.data.vlm import image_size_for_budget, split_tile_tokens

    vc = config.vision_config
    proc, layout = _processor_and_layout(recipe, config)
    ip = getattr(proc, "image_processor", None)
    tile = int((getattr(ip, "max_image_size", None) or {}).get("longest_edge") or vc.image_size)
    edge = getattr(getattr(ip, "size", None), "longest_edge", None) or SPLIT_EDGE_TILES * tile
    budget = recipe.data.image_max_pixels
    if budget is not None:  # the bound training sets on the processor (bigtune.data.vlm.bound_image_pixels)
        edge = image_size_for_budget(ip, config, int(budget), recipe.model.name)["longest_edge"]
    return SplitGeometry(
        longest_edge=int(edge),
        tile=tile,
        channels=int(getattr(vc, "num_channels", 3)),
        tile_tokens=layout.split.tile_tokens if layout else split_tile_tokens(proc, config),
        prompt_ids=tuple(layout.prompt_ids) if layout else (int(config.image_token_id),),
        image_token_id=int(config.image_token_id),
        text=layout.split if layout else None,
        from_processor=layout is not None,
        edge_from_recipe=budget is not None,
    )


def split_image_batch(
    recipe: Recipe, cfg, geometry: SplitGeometry, b_size: int, padded: bool, images: Optional[tuple] = None
) -> dict:
    """A micro-batch shaped as ChatImageCollator builds it for Idefics3: every row data.max_seq_length text
    tokens (the placeholder among them) plus its image's tile text, padded to the longest row; each row's
    images (tiles, then the global image) in ``pixel_values`` (batch, images, channels, tile, tile), padded
    with all-zero images to the most images of a row, and ``pixel_attention_mask`` 1 on every real image
    (all of its pixels: tiles are whole) and 0 on the padding images, as the processor and collator pad."""

    grids = [tuple(int(x) for x in images[i % len(images)]) for i in range(b_size)] if images else None
    grids = grids or [geometry.worst_grid()] * b_size
    prompt = list(geometry.prompt_ids)
    at = prompt.index(geometry.image_token_id)
    answer_len = max(1, recipe.data.max_seq_length - len(prompt))
    top = min(int(cfg.text_config.vocab_size), geometry.image_token_id)  # answer ids below the image token
    rows = [prompt[:at] + geometry.image_ids(grid) + prompt[at + 1 :] for grid in grids]
    ids, labels, mask = _answered_rows(rows, answer_len, top, padded)
    counts = [geometry.images(grid) for grid in grids]
    side = geometry.tile
    # Filled on one thread: a parallel fill of this large tensor would start OpenMP's pool, after which the
    # worker processes plans fork hang (as in _fake_pixels).
    with one_thread():
        pixel_mask = torch.zeros((b_size, max(counts), side, side), dtype=torch.long)
        for i, n in enumerate(counts):
            pixel_mask[i, :n] = 1
    return {
        # A shape only: simulate() swaps in a fake tensor (see _fake_pixels).
        "pixel_values": torch.empty(b_size, max(counts), geometry.channels, side, side),
        "pixel_attention_mask": pixel_mask,
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "padded": padded or not bool(mask.all()),
        "image_tokens": max(len(r) for r in rows) - len(prompt) + 1,  # the engine's batch-shape rule reads it
        "image_tiles": [list(grid) for grid in grids],
    }


def split_images_note(geometry: SplitGeometry, images: Optional[tuple], micro: int) -> str:
    """What the plan assumed about an Idefics3 model's images."""
    grids = sorted({tuple(int(x) for x in g) for g in (images or [geometry.worst_grid()])})

    def what(grid: TileGrid) -> str:
        n = geometry.images(grid)
        tiles = f"{grid[0]}×{grid[1]} tiles of {geometry.tile} px + the whole image" if n > 1 else "one image"
        return f"{tiles} ({len(geometry.image_ids(grid))} image tokens)"

    why = ""
    if not images:
        whose = "data.image_max_pixels" if geometry.edge_from_recipe else "the processor's longest_edge"
        why = f": the worst case, a square image at {whose}={geometry.longest_edge} px (--image-size HxW to plan yours)"
    src = ""
    if not geometry.from_processor:
        src = (
            "; the processor did not load here, so SmolVLM-Instruct's tiling (longest edge "
            f"{SPLIT_EDGE_TILES} tiles) and one token per tile marker"
        )
    return f"images: one per row, {', '.join(what(g) for g in grids)}{why}{src}"


def split_caption_images(recipe: Recipe, config, image_size: Optional[tuple[int, int]] = None) -> CaptionImages:
    """What ``bigtune caption`` gives Idefics3 (SmolVLM) per image: the worst case (the most tiles) or
    ``image_size`` as its processor tiles it; the tiles and the whole image, each one vision-tower image."""
    geo = split_geometry(recipe, config)
    grid = geo.grid(*image_size) if image_size else geo.worst_grid()
    n, patch = geo.images(grid), int(config.vision_config.patch_size)
    ids = tuple(geo.image_ids(grid))
    return CaptionImages(
        geo.prompt_ids,
        geo.image_token_id,
        len(ids),
        n * (geo.tile // patch) ** 2,
        None,
        (n, geo.channels, geo.tile, geo.tile),
        False,
        split_images_note(geo, (grid,) if image_size else None, 1),
        image_ids=ids,
        pixel_mask=True,
    )


def _known_real_images(pixel_attention_mask, count: int):
    """(indices of the real images among the batch's ``count`` images, their patch masks' real values) from
    ``pixel_attention_mask`` (zero exactly on the collator's all-zero padding images), or None where its
    values are unknown. See split_image_features."""
    from torch._subclasses.fake_tensor import FakeTensor

    mask = pixel_attention_mask
    if isinstance(mask, FakeTensor):
        mask = mask.constant
    if mask is None:
        return None
    mask = mask.reshape(count, *mask.shape[-2:])
    return mask.flatten(1).any(1).nonzero().squeeze(1), mask


def split_image_features(self, pixel_values, pixel_attention_mask=None, **kwargs):
    """transformers' Idefics3Model.get_image_features (5.x) on fake tensors: the same operations, except that
    which images are padding is read from ``pixel_attention_mask`` (real values kept by real_index_math)
    instead of testing the fake pixels for all zeros. The zero test still runs on the fake pixels, so its
    temporary bytes are counted; the real images are then gathered by index (the same bytes as by mask), and
    the patch mask the vision tower reads gets its real values (its attention takes the path a real batch's
    takes)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    batch_size, num_images = pixel_values.shape[:2]
    pixel_values = pixel_values.to(dtype=self.dtype)
    pixel_values = pixel_values.view(batch_size * num_images, *pixel_values.shape[2:])
    zeros = (pixel_values == 0.0).sum(dim=(-1, -2, -3))  # upstream's padding test: its bytes, fake values
    del zeros
    with unset_fake_temporarily():
        known = _known_real_images(pixel_attention_mask, batch_size * num_images)
        if known is None:
            raise RuntimeError("Idefics3 plan: pixel_attention_mask has no known values (see real_index_math)")
        index, real_mask = known
        patch = self.config.vision_config.patch_size
        # per patch of every image (views, then one small sum), then the real images: no copy of the whole
        # mask, which the tracker would count on top of the fake copy below that stands for the real run's
        cells = real_mask.unfold(1, patch, patch).unfold(2, patch, patch)
        patch_mask = cells.sum(dim=(-1, -2))[index] > 0
        del cells
        per_row = torch.zeros(batch_size * num_images, dtype=torch.long)
        per_row[index] = 1
        per_row = per_row.view(batch_size, num_images).sum(1).tolist()
    pixel_values = pixel_values[index.clone()].contiguous()
    # The real run's copy of the real images' masks, alive (as there) through the vision tower, and its patch
    # sums: the same bytes, values unknown. A new fake tensor of that shape: converting the (real) input mask
    # to a fake one would count its bytes a second time, which the real run does not hold.
    masks = torch.empty((len(index), *pixel_attention_mask.shape[2:]), dtype=pixel_attention_mask.dtype)
    subgrid = masks.unfold(dimension=1, size=patch, step=patch).unfold(dimension=2, size=patch, step=patch)
    fake_patch_mask = (subgrid.sum(dim=(-1, -2)) > 0).bool()
    del subgrid, fake_patch_mask
    patch_attention_mask = patch_mask.clone()  # known values (see real_index_math)
    image_outputs = self.vision_model(
        pixel_values=pixel_values, patch_attention_mask=patch_attention_mask, return_dict=True, **kwargs
    )
    image_features = self.connector(image_outputs.last_hidden_state)
    image_outputs.pooler_output = [f.reshape(-1, f.shape[-1]) for f in image_features.split(per_row)]
    return image_outputs


# --- LLaVA-NeXT: an image fitted into one of several tile grids ("anyres") ------------------------------
def is_anyres_vlm_config(config) -> bool:
    """LLaVA-NeXT: each image fitted into one of image_grid_pinpoints, its tokens following its size."""
    from bigtune.data.vlm import ANYRES_VLM_TYPES

    return getattr(config, "model_type", "") in ANYRES_VLM_TYPES


@dataclass(frozen=True)
class AnyresGeometry:
    """How LLaVA-NeXT tiles an image (bigtune.data.vlm.AnyresTiles, from the config), and the user turn's ids."""

    tiles: object  # bigtune.data.vlm.AnyresTiles
    channels: int
    prompt_ids: tuple[int, ...]  # the user turn through the generation prompt, one image placeholder
    image_token_id: int
    from_processor: bool  # False: a bare image placeholder (the processor did not load here)

    def sizes(self, images: Optional[tuple], rows: int) -> list[ImageSizeHW]:
        """One image size per row: ``images`` in turn, or the worst case (the largest pinpoint) for every row."""
        if not images:
            return [self.tiles.worst_size()] * rows
        return [(int(images[i % len(images)][0]), int(images[i % len(images)][1])) for i in range(rows)]


def anyres_geometry(recipe: Recipe, config) -> AnyresGeometry:
    """The tiling and user turn bigtune.data.vlm gives ``recipe``'s data (the prompt from the model's processor
    where it loads here; the tiles from the config, as the model counts them)."""
    from bigtune.data.vlm import AnyresTiles

    _, layout = _processor_and_layout(recipe, config)
    image_id = int(config.image_token_id)
    return AnyresGeometry(
        tiles=AnyresTiles.from_config(config),
        channels=int(getattr(config.vision_config, "num_channels", 3)),
        prompt_ids=tuple(layout.prompt_ids) if layout else (image_id,),
        image_token_id=image_id,
        from_processor=layout is not None,
    )


def anyres_batch(
    recipe: Recipe, cfg, geometry: AnyresGeometry, b_size: int, padded: bool, images: Optional[tuple] = None
) -> dict:
    """A micro-batch shaped as ChatImageCollator builds it for LLaVA-NeXT: every row data.max_seq_length text
    tokens (the placeholder among them) plus its image's tokens, padded to the longest row; each row's tiles
    and base image in ``pixel_values`` (batch, most tiles, channels, tile, tile), padded with all-zero tiles,
    and each image's (height, width) in ``image_sizes`` (``images``: those sizes; None: the worst case)."""

    sizes = geometry.sizes(images, b_size)
    prompt = list(geometry.prompt_ids)
    at = prompt.index(geometry.image_token_id)
    answer_len = max(1, recipe.data.max_seq_length - len(prompt))
    top = min(int(cfg.text_config.vocab_size), geometry.image_token_id)  # answer ids below the image token
    counts = [geometry.tiles.tokens(*size) for size in sizes]
    rows = [prompt[:at] + [geometry.image_token_id] * c + prompt[at + 1 :] for c in counts]
    ids, labels, mask = _answered_rows(rows, answer_len, top, padded)
    tiles, side = max(geometry.tiles.tiles(*size) for size in sizes), geometry.tiles.tile
    return {
        # A shape only: simulate() swaps in a fake tensor (see _fake_pixels).
        "pixel_values": torch.empty(b_size, tiles, geometry.channels, side, side),
        "image_sizes": torch.tensor([list(size) for size in sizes], dtype=torch.long),
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "padded": padded or not bool(mask.all()),
        "image_tokens": max(counts),  # the engine's batch-shape rule reads it
    }


def anyres_images_note(geometry: AnyresGeometry, images: Optional[tuple]) -> str:
    """What the plan assumed about a LLaVA-NeXT model's images."""
    t = geometry.tiles

    def what(size: ImageSizeHW) -> str:
        rows, cols = t.grid(*size)
        return f"{size[0]}×{size[1]} px: {rows}×{cols} tiles of {t.tile} px + the whole image ({t.tokens(*size)} image tokens)"

    sizes = sorted(set(geometry.sizes(images, len(images) if images else 1)))
    why = "" if images else ": the worst case, an image of the largest pinpoint (--image-size HxW to plan yours)"
    src = "" if geometry.from_processor else "; the processor did not load here, so a bare image placeholder"
    return f"images: one per row, {', '.join(what(s) for s in sizes)}{why}{src}"


def anyres_caption_images(recipe: Recipe, config, image_size: Optional[tuple[int, int]] = None) -> CaptionImages:
    """What ``bigtune caption`` gives LLaVA-NeXT per image: the worst case (the largest pinpoint's size) or an
    image of ``image_size``; its tiles and base image, each one vision-tower image."""
    geo = anyres_geometry(recipe, config)
    t = geo.tiles
    size = (int(image_size[0]), int(image_size[1])) if image_size else t.worst_size()
    n = t.tiles(*size)
    clip_class_token = getattr(config.vision_config, "model_type", "") == "clip_vision_model"
    return CaptionImages(
        geo.prompt_ids,
        geo.image_token_id,
        t.tokens(*size),
        n * ((t.tile // t.patch) ** 2 + int(clip_class_token)),
        None,
        (n, geo.channels, t.tile, t.tile),
        False,
        anyres_images_note(geo, (size,) if image_size else None),
        image_size=size,
    )
