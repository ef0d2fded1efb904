"""PYTORCH_CUDA_ALLOC_CONF, parsed: the caching-allocator settings a training process runs with
(``train.cuda_alloc_conf``) and the planner replays (plan/device/allocator.py).

The grammar and the limits are PyTorch's (c10/core/AllocatorConfig.cpp and c10/cuda/CUDAAllocatorConfig.cpp,
torch 2.9-2.11): comma-separated ``key:value`` pairs, whitespace ignored, a trailing comma allowed, the last
of a repeated key wins; ``True``/``False`` spelled so; ``max_split_size_mb`` and ``max_non_split_rounding_mb``
whole MiB of at least 20 (the 20 MiB large-pool segment); ``garbage_collection_threshold`` strictly
between 0 and 1. Only the keys the planner models are accepted: a key PyTorch knows but the replay does not
model would make the plan silently wrong, so it is refused with the reason, as is a key PyTorch does not know.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Optional

MIB = 1 << 20
MIN_SPLIT_MB = 20  # kLargeBuffer / 1 MiB: max_split_size_mb and max_non_split_rounding_mb may not go below it

MODELLED = ("expandable_segments", "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold")

# PyTorch's other keys, each with why the replay does not follow it.
NOT_MODELLED = {
    "roundup_power2_divisions": "it changes how requests are rounded, which the replay does not model",
    "backend": "cudaMallocAsync is a different allocator; the replay models the native caching allocator",
    "per_process_memory_fraction": "the planner judges FITS against the whole device",
    "large_segment_size_mb": "the replay keeps PyTorch's 20 MiB large-pool segment",
    "release_lock_on_cudamalloc": "it changes locking only, and the planner does not model it",
    "pinned_use_cuda_host_register": "it concerns pinned host memory, which the planner does not model",
    "pinned_num_register_threads": "it concerns pinned host memory, which the planner does not model",
    "pinned_use_background_threads": "it concerns pinned host memory, which the planner does not model",
    "pinned_reserve_segment_size_mb": "it concerns pinned host memory, which the planner does not model",
    "graph_capture_record_stream_reuse": "the engine captures no CUDA graphs",
}


class AllocatorConfigError(ValueError):
    """A PYTORCH_CUDA_ALLOC_CONF string bigtune cannot run or plan with; the message says why and how to fix it."""


@dataclass(frozen=True)
class AllocatorConfig:
    """The modelled settings; the defaults are PyTorch's (what an empty PYTORCH_CUDA_ALLOC_CONF gives).

    ``max_split_size``: bytes; None is PyTorch's SIZE_MAX (every block may be split). ``max_non_split_rounding``:
    how much larger than the request a cached oversize block may be and still serve it whole.
    ``garbage_collection_threshold``: 0 is off (see plan/device/allocator.py for why the replay never runs it)."""

    expandable_segments: bool = False
    max_split_size: Optional[int] = None
    max_non_split_rounding: int = MIN_SPLIT_MB * MIB
    garbage_collection_threshold: float = 0.0

    @property
    def is_default(self) -> bool:
        return self == AllocatorConfig()

    def __str__(self) -> str:
        """The canonical PYTORCH_CUDA_ALLOC_CONF text of the settings that differ from the defaults."""
        parts = []
        if self.expandable_segments:
            parts.append("expandable_segments:True")
        if self.max_split_size is not None:
            parts.append(f"max_split_size_mb:{self.max_split_size // MIB}")
        if self.max_non_split_rounding != MIN_SPLIT_MB * MIB:
            parts.append(f"max_non_split_rounding_mb:{self.max_non_split_rounding // MIB}")
        if self.garbage_collection_threshold:
            parts.append(f"garbage_collection_threshold:{self.garbage_collection_threshold:g}")
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str) -> "AllocatorConfig":
        """``AllocatorConfig.parse("expandable_segments:True,max_split_size_mb:128")``; "" is the default.
        Raises AllocatorConfigError naming the first bad key or value."""
        # ConfigTokenizer: whitespace dropped, ',' ':' '[' ']' are tokens of their own.
        tokens = re.findall(r"[,:\[\]]|[^,:\[\]]+", "".join(text.split()))
        values: dict = {}
        i = 0
        while i < len(tokens):
            key = tokens[i]
            if key in ",:[]":
                raise AllocatorConfigError(
                    f"{text!r}: expected a key at {key!r}; write key:value pairs separated by commas"
                )
            if i + 2 >= len(tokens) or tokens[i + 1] != ":" or tokens[i + 2] in ",:]":
                raise AllocatorConfigError(f"{text!r}: {key!r} has no value; write {key}:VALUE")
            _check_key(text, key)
            values[key] = tokens[i + 2]
            i += 3
            if i < len(tokens):
                if tokens[i] != ",":
                    raise AllocatorConfigError(f"{text!r}: expected ',' after {key}:{values[key]}, got {tokens[i]!r}")
                i += 1
        return dataclasses.replace(cls(), **{_FIELD[k]: _value(text, k, v) for k, v in values.items()})


_FIELD = {
    "expandable_segments": "expandable_segments",
    "max_split_size_mb": "max_split_size",
    "max_non_split_rounding_mb": "max_non_split_rounding",
    "garbage_collection_threshold": "garbage_collection_threshold",
}


def _check_key(text: str, key: str) -> None:
    if key in MODELLED:
        return
    if key in NOT_MODELLED:
        raise AllocatorConfigError(
            f"{text!r}: {key} is a PyTorch setting the planner does not model ({NOT_MODELLED[key]}); remove it. "
            f"Modelled: {', '.join(MODELLED)}"
        )
    close = difflib.get_close_matches(key, MODELLED + tuple(NOT_MODELLED), n=1)
    hint = f"; did you mean {close[0]}?" if close else f"; modelled keys: {', '.join(MODELLED)}"
    raise AllocatorConfigError(f"{text!r}: unknown key {key!r}{hint}")


def _value(text: str, key: str, raw: str):
    """One value checked as PyTorch checks it, converted to the field's unit (bytes for the *_mb keys)."""
    if key == "expandable_segments":
        if raw not in ("True", "False"):
            raise AllocatorConfigError(f"{text!r}: expandable_segments takes True or False (spelled so), not {raw!r}")
        return raw == "True"
    if key == "garbage_collection_threshold":
        try:
            threshold = float(raw)
        except ValueError:
            threshold = -1.0
        if not 0.0 < threshold < 1.0:
            raise AllocatorConfigError(f"{text!r}: garbage_collection_threshold must be in (0.0, 1.0), not {raw!r}")
        return threshold
    if not raw.isdigit() or int(raw) < MIN_SPLIT_MB:
        raise AllocatorConfigError(f"{text!r}: {key} must be a whole number of MiB >= {MIN_SPLIT_MB}, not {raw!r}")
    return int(raw) * MIB
