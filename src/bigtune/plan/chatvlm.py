"""The planner's side of chat vision-language models (Qwen2-VL, Qwen2.5-VL).

Such a model sees each image at about its own size: the processor resizes it to multiples of
patch × merge pixels within its min/max pixels, cuts it into patch × patch tiles (each repeated over
``temporal_patch_size`` frames), and every merge² tiles become one language-model token. So a
synthetic batch needs the processor's bounds, not just the model config. A plain plan is the worst
case: every image at the processor's max_pixels. ``bigtune plan --image-size HxW`` and the engine's
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


_PROCESSORS: dict[tuple, object] = {}  # one load per model for the several simulations of a plan


def _processor(model):
    from bigtune.models.build import load_processor

    key = (model.name, model.tokenizer, model.init, model.revision)
    if key not in _PROCESSORS:
        _PROCESSORS[key] = load_processor(model)
    return _PROCESSORS[key]


def image_geometry(recipe: Recipe, config) -> ImageGeometry:
    """The processor's geometry for ``recipe``'s model (bounds and prompt from its processor where it loads
    here: a preset's is built locally; else transformers' default bounds and a bare image placeholder)."""
    from bigtune.data.vlm import ChatImageLayout

    vc = config.vision_config
    proc = layout = None
    try:
        proc = _processor(recipe.model)
        layout = ChatImageLayout.for_model(proc, config, recipe.data.prompt)
    except Exception:  # noqa: BLE001 - no processor (hub unreachable, ...) or no chat template: defaults
        pass
    ip = getattr(proc, "image_processor", None)
    size = getattr(ip, "size", None)
    return ImageGeometry(
        patch=int(getattr(ip, "patch_size", None) or vc.patch_size),
        merge=int(getattr(ip, "merge_size", None) or vc.spatial_merge_size),
        temporal=int(getattr(ip, "temporal_patch_size", None) or vc.temporal_patch_size),
        channels=int(getattr(vc, "in_channels", None) or getattr(vc, "in_chans", 3)),
        min_pixels=int(getattr(size, "shortest_edge", None) or DEFAULT_MIN_PIXELS),
        max_pixels=int(getattr(size, "longest_edge", None) or DEFAULT_MAX_PIXELS),
        prompt_ids=tuple(layout.prompt_ids) if layout else (int(config.image_token_id),),
        image_token_id=int(config.image_token_id),
        from_processor=layout is not None,
        bounds_from_processor=size is not None,
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


def synthetic_batch(
    recipe: Recipe, cfg, geometry: ImageGeometry, b_size: int, padded: bool, images: Optional[tuple[Grid, ...]]
) -> dict:
    """A micro-batch shaped as ChatImageCollator builds it: every row data.max_seq_length text tokens (the
    image placeholder among them) plus its image's tokens, padded to the longest row."""
    from bigtune.core.stepmath import IGNORE_INDEX

    g = torch.Generator().manual_seed(0)
    grids = grids_for(geometry, images, b_size)
    counts = [geometry.tokens(grid) for grid in grids]
    prompt = list(geometry.prompt_ids)
    at = prompt.index(geometry.image_token_id)
    answer_len = max(1, recipe.data.max_seq_length - len(prompt))
    # answer ids below every special (image, vision start/end) id: the image tokens are only where placed
    special = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    top = min([int(cfg.text_config.vocab_size)] + [int(getattr(cfg, k)) for k in special if getattr(cfg, k, None)])
    length = max(len(prompt) - 1 + c + answer_len for c in counts)
    ids = torch.full((b_size, length), 0, dtype=torch.long)
    labels = torch.full((b_size, length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((b_size, length), dtype=torch.long)
    for i, c in enumerate(counts):
        row = prompt[:at] + [geometry.image_token_id] * c + prompt[at + 1 :]
        answer = torch.randint(3, top, (answer_len,), generator=g).tolist()
        n = len(row) + answer_len
        ids[i, :n] = torch.tensor(row + answer)
        labels[i, len(row) : n] = torch.tensor(answer)
        mask[i, :n] = 1
    if padded and bool(mask.all()):  # one padded row: the explicit-mask attention path a real padded batch takes
        mask[-1, -1], labels[-1, -1] = 0, IGNORE_INDEX
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


def vision_period(config) -> int:
    """Vision blocks that repeat as one unit: Qwen2.5-VL attends within windows except in its
    full-attention blocks (every 8th in the published models), so its unit runs from one full-attention
    block to the next; irregular placements make the whole tower one unit (simulated at full depth)."""
    vc = config.vision_config
    full = sorted(int(i) for i in (getattr(vc, "fullatt_block_indexes", None) or []))
    depth = int(vc.depth)
    if not full:
        return 1
    period = full[0] + 1
    if depth % period == 0 and full == list(range(period - 1, depth, period)):
        return period
    return depth


def shrink_vision(cfg, period: int) -> None:
    """After the vision tower's depth was cut: the full-attention blocks at the same place in each unit."""
    vc = cfg.vision_config
    if getattr(vc, "fullatt_block_indexes", None):
        vc.fullatt_block_indexes = list(range(period - 1, int(vc.depth), period))


def images_note(geometry: ImageGeometry, images: Optional[tuple[Grid, ...]], micro: int) -> str:
    """What the plan assumed about the images."""
    grids = grids_for(geometry, images, micro)
    sizes = sorted({(h * geometry.patch, w * geometry.patch, geometry.tokens((t, h, w))) for t, h, w in grids})
    what = ", ".join(f"{h}×{w} px ({n} image tokens)" for h, w, n in sizes)
    why = ""
    if not images:
        why = f": the worst case, the processor's max_pixels={geometry.max_pixels} (--image-size HxW to plan yours)"
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


@contextlib.contextmanager
def real_index_math():
    """Qwen2-VL's forward works out positions and attention segments from the values of its integer inputs
    (image grids, token types, mask): ``.tolist()``, ``.item()``, boolean indexing, loops per image. Fake
    tensors have no values, so here integer tensors entering fake mode keep theirs (a fake tensor's
    ``constant``): FakeTensorMode then computes ops on them for real, and outputs of up to KNOWN_NUMEL
    elements stay known. Their bytes are counted as any fake tensor's. The helpers that build their
    indices from ``torch.arange`` (the 3-D rotary positions, Qwen2.5-VL's attention windows) run on the
    real values outright. The model's float compute stays fake. That real work runs on one thread: an
    OpenMP pool started here would hang the worker processes plans fork later (as in _fake_pixels)."""
    from torch._subclasses import fake_tensor
    from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl
    from transformers.models.qwen2_vl import modeling_qwen2_vl

    convert = fake_tensor.FakeTensorConverter.from_real_tensor

    def from_real_tensor(self, fake_mode, t, make_constant=False, *args, **kwargs):
        known = make_constant or (not t.is_floating_point() and t.numel() <= KNOWN_NUMEL)
        return convert(self, fake_mode, t, known, *args, **kwargs)

    threads = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        torch.set_num_threads(1)
        stack.callback(torch.set_num_threads, threads)
        stack.enter_context(mock.patch.object(fake_tensor, "CONSTANT_NUMEL_LIMIT", KNOWN_NUMEL))
        stack.enter_context(mock.patch.object(fake_tensor.FakeTensorConverter, "from_real_tensor", from_real_tensor))
        for cls in (modeling_qwen2_vl.Qwen2VLModel, modeling_qwen2_5_vl.Qwen2_5_VLModel):
            stack.enter_context(mock.patch.object(cls, "get_rope_index", _on_known_values(cls.get_rope_index)))
        window = _on_known_values(modeling_qwen2_5_vl.get_vision_window_index)
        stack.enter_context(mock.patch.object(modeling_qwen2_5_vl, "get_vision_window_index", window))
        yield
