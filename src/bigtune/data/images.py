"""Image + caption data for image-to-text models (BLIP-2; chat models such as Qwen2-VL: ``bigtune.data.vlm``).

Sources (``data.source``):

* ``demo``: the bundled food-photo caption set (``assets/gourmetgram_demo``, an image folder);
* a folder written by ``datasets.save_to_disk`` (Dataset or DatasetDict; ``data.split`` picks the
  split) with an image column (``data.image_field``) and a caption column (``data.text_field``);
* an image folder holding ``metadata.jsonl`` or ``metadata.csv`` with ``file_name`` and the caption;
* a ``.jsonl`` (or ``.json`` list) of ``{"image": path, "text": caption}``, paths relative to the file.

Every image is decoded once with PIL while the examples are built, so missing files, unreadable or
truncated images and empty captions are found up front, counted and reported by index and reason,
and skipped. Only the reference (a path or the encoded bytes) is kept: resizing and normalising
happen in the dataset's ``__getitem__``, so DataLoader workers share that work.

Token layout (transformers 5 BLIP-2 puts ``num_query_tokens`` image tokens first, where the Q-Former
outputs go):

* decoder-only language model (OPT): ``input_ids = <image>×q + BOS + caption + EOS``; the labels are
  the same ids with the image positions at -100 (the caption is both input and target, shifted by
  the loss as for any causal LM);
* encoder-decoder (Flan-T5): the encoder reads ``<image>×q + EOS``; the decoder's labels are
  ``caption + EOS`` and the collator builds ``decoder_input_ids`` by shifting them right behind the
  decoder start token, so the model gets no ``labels`` and the engine's summed-token loss applies.

``data.max_seq_length`` bounds the caption tokens (BOS/EOS included); the image tokens come on top.
"""

from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from bigtune.core.presets import ASSETS, IMAGE_TOKEN
from bigtune.core.stepmath import IGNORE_INDEX
from bigtune.data.text import DataError, DataReport, no_samples_error, split_and_select
from bigtune.recipe import DataConfig

DEMO_IMAGES = ASSETS / "gourmetgram_demo"

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")


@dataclass
class ImageExample:
    image: Any  # a file path (str) or encoded image bytes
    input_ids: list[int]
    labels: list[int]


def open_image(ref: Any):
    """A fully decoded RGB PIL image from a path, bytes, a datasets {bytes, path} dict or a PIL image.

    Raises OSError/ValueError (with PIL's reason) for missing, unreadable or truncated files.
    """
    from PIL import Image

    if isinstance(ref, dict):
        ref = ref.get("bytes") or ref.get("path")
    if isinstance(ref, Image.Image):
        img = ref
    elif isinstance(ref, (bytes, bytearray)):
        img = Image.open(io.BytesIO(ref))
    elif isinstance(ref, (str, Path)):
        if not Path(ref).is_file():
            raise FileNotFoundError(f"missing image file {ref}")
        img = Image.open(ref)
    else:
        raise ValueError(f"no image (got {type(ref).__name__})")
    img.load()  # decodes every byte: truncated files fail here, not in a DataLoader worker
    return img.convert("RGB")


def check_image(ref: Any) -> str:
    """'' when the image decodes, else the reason it does not."""
    try:
        open_image(ref)
    except FileNotFoundError as e:
        return str(e)
    except Exception as e:  # PIL raises OSError, SyntaxError, ValueError, DecompressionBombError...
        return f"unreadable image ({type(e).__name__}: {str(e)[:120]})"
    return ""


def _from_disk(path: Path, cfg: DataConfig) -> list[tuple[Any, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except Exception as e:
        raise DataError(f"{path}: not a folder written by datasets' save_to_disk ({e})") from e
    if isinstance(ds, datasets.DatasetDict):
        if cfg.split not in ds:
            raise DataError(f"{path}: has splits {sorted(ds)}, not {cfg.split!r}; set data.split to one of them")
        ds = ds[cfg.split]
    for col in (cfg.image_field, cfg.text_field):
        if col not in ds.column_names:
            raise DataError(
                f"{path}: no column {col!r} (columns: {ds.column_names}); set data.image_field / data.text_field"
            )
    if isinstance(ds.features[cfg.image_field], datasets.Image):
        # Keep the encoded bytes: decoding is ours, so one bad image is a skipped record, not a crash.
        ds = ds.cast_column(cfg.image_field, datasets.Image(decode=False))
    return [(row[cfg.image_field], row[cfg.text_field]) for row in ds]


def _resolve(ref: Any, root: Path) -> Any:
    if isinstance(ref, str) and ref and not Path(ref).is_absolute():
        return str(root / ref)
    return ref


def _from_image_folder(path: Path, cfg: DataConfig) -> list[tuple[Any, Any]]:
    jsonl, csv_file = path / "metadata.jsonl", path / "metadata.csv"
    if jsonl.is_file():
        rows = _read_jsonl_records(jsonl)
    elif csv_file.is_file():
        with csv_file.open(encoding="utf-8", newline="") as fh:
            rows = list(csv.DictReader(fh))
    else:
        raise DataError(
            f"{path}: a folder needs metadata.jsonl or metadata.csv (file_name, {cfg.text_field}) or "
            "to be a datasets save_to_disk folder"
        )
    out = []
    for row in rows:
        if not isinstance(row, dict):
            out.append((None, None))
            continue
        ref = row.get("file_name", row.get(cfg.image_field))
        out.append((_resolve(ref, path), row.get(cfg.text_field)))
    return out


def _read_jsonl_records(path: Path) -> list[Any]:
    from bigtune.data.text import read_jsonl  # one JSONL reader: bad lines are errors with file and line

    return read_jsonl(path)


def _from_json(path: Path, cfg: DataConfig) -> list[tuple[Any, Any]]:
    if path.suffix.lower() == ".jsonl":
        rows = _read_jsonl_records(path)
    else:
        try:
            rows = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            from bigtune.data.text import json_file_error

            raise DataError(json_file_error(path, e)) from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: expected a list of {{{cfg.image_field!r}: path, {cfg.text_field!r}: caption}}")
    return [
        (_resolve(r.get(cfg.image_field), path.parent), r.get(cfg.text_field)) if isinstance(r, dict) else (None, None)
        for r in rows
    ]


def read_image_source(cfg: DataConfig, source: Optional[str] = None) -> tuple[str, list[tuple[Any, Any]]]:
    """(source label, [(image reference, caption)]) in the source's order."""
    src = source or cfg.source
    path = DEMO_IMAGES if src == "demo" else Path(src).expanduser()
    if not path.exists():
        raise DataError(f"data.source: {path} does not exist")
    if path.is_dir():
        if (
            (path / "dataset_dict.json").is_file()
            or (path / "dataset_info.json").is_file()
            or (path / "state.json").is_file()
        ):
            return str(path), _from_disk(path, cfg)
        return str(path), _from_image_folder(path, cfg)
    if path.suffix.lower() in (".jsonl", ".json"):
        return str(path), _from_json(path, cfg)
    raise DataError(
        f"data.source: {path}: image-to-text reads a save_to_disk folder, an image folder with "
        "metadata.jsonl/metadata.csv, or a .jsonl of {image, text}"
    )


@dataclass
class TokenLayout:
    """What the model expects around the caption (see the module docstring)."""

    image_token_id: int
    num_query_tokens: int
    bos_id: Optional[int]
    eos_id: Optional[int]
    pad_id: int
    encoder_decoder: bool
    decoder_start_id: Optional[int] = None

    @classmethod
    def for_model(cls, processor, model_config) -> "TokenLayout":
        tok = processor.tokenizer
        image_id = getattr(model_config, "image_token_index", None)
        if image_id is None:
            image_id = tok.convert_tokens_to_ids(IMAGE_TOKEN)
        text = model_config.text_config
        enc_dec = not getattr(model_config, "use_decoder_only_language_model", True)
        start = getattr(text, "decoder_start_token_id", None)
        return cls(
            image_id,
            int(model_config.num_query_tokens),
            tok.bos_token_id,
            tok.eos_token_id,
            tok.pad_token_id if tok.pad_token_id is not None else 0,
            enc_dec,
            start if start is not None else tok.pad_token_id,
        )

    def prompt_ids(self, prompt_tokens: list[int]) -> list[int]:
        """The model input before the caption: image tokens, then BOS + prompt (OPT) or prompt + EOS (T5)."""
        image = [self.image_token_id] * self.num_query_tokens
        if self.encoder_decoder:
            return image + prompt_tokens + ([self.eos_id] if self.eos_id is not None else [])
        return image + ([self.bos_id] if self.bos_id is not None else []) + prompt_tokens

    def encode(self, tok, caption: str, max_len: int) -> tuple[list[int], list[int], bool]:
        """(input_ids, labels, truncated) for one caption's text (``bigtune.data.vlm`` lays out chat models)."""
        return self.example(tok(caption, add_special_tokens=False)["input_ids"], max_len)

    def example(self, caption_ids: list[int], max_len: int) -> tuple[list[int], list[int], bool]:
        """(input_ids, labels, truncated) for one caption."""
        eos = [self.eos_id] if self.eos_id is not None else []
        if self.encoder_decoder:
            target = caption_ids + eos
            truncated = len(target) > max_len
            return self.prompt_ids([]), target[:max_len], truncated
        bos = [self.bos_id] if self.bos_id is not None else []
        text = bos + caption_ids + eos
        truncated = len(text) > max_len
        text = text[:max_len]
        image = [self.image_token_id] * self.num_query_tokens
        return image + text, [IGNORE_INDEX] * len(image) + text, truncated


def build_image_examples(
    cfg: DataConfig, processor, layout, seed: int, source: Optional[str] = None
) -> tuple[list[ImageExample], DataReport]:
    """Read, check every image and caption, tokenize, split off validation, select num_train_samples.
    ``layout``: a TokenLayout (BLIP-2) or a ``bigtune.data.vlm.ChatImageLayout``: its ``encode`` tokenizes."""
    label, rows = read_image_source(cfg, source)
    if not rows:
        raise DataError(f"{label}: no usable samples (the source holds no records)")
    report = DataReport(source=label, format="image-caption", records=len(rows))
    tok = processor.tokenizer
    examples: list[ImageExample] = []
    for i, (ref, caption) in enumerate(rows):
        reason = ""
        if ref is None or ref == "":
            reason = f"missing image field {cfg.image_field!r}"
        elif not isinstance(caption, str):
            reason = f"missing caption field {cfg.text_field!r}"
        elif not caption.strip():
            reason = "empty caption"
        else:
            reason = check_image(ref)
        if reason:
            if not cfg.skip_bad_records:
                raise DataError(f"{label} record {i}: {reason}; fix the record or set data.skip_bad_records=true")
            report.skipped.append((i, reason))
            continue
        input_ids, labels, truncated = layout.encode(tok, caption.strip(), cfg.max_seq_length)
        report.truncated += int(truncated)
        if isinstance(ref, dict):
            ref = ref.get("bytes") or ref.get("path")
        examples.append(ImageExample(ref, input_ids, labels))
    if not examples:
        raise no_samples_error(label, report)
    examples = split_and_select(examples, report, cfg, seed)
    return examples, report


class ImageCaptionDataset(torch.utils.data.Dataset):
    """Decodes and processes an example's image on access (in DataLoader workers when there are some)."""

    def __init__(self, items: list[ImageExample], image_processor):
        self.items = items
        self.image_processor = image_processor

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ImageExample]:
        ex = self.items[i]
        pixels = self.image_processor(open_image(ex.image), return_tensors="pt")["pixel_values"][0]
        return pixels, ex


class ImageCollator:
    """Stacks pixel_values; right-pads input_ids (mask 0) and labels (-100). Encoder-decoder layouts
    also get decoder_input_ids: the labels shifted right behind the decoder start token."""

    def __init__(self, layout: TokenLayout):
        self.layout = layout

    @staticmethod
    def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
        n = max(len(r) for r in rows)
        out = torch.full((len(rows), n), value, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        return out

    def __call__(self, batch: list[tuple[torch.Tensor, ImageExample]]) -> dict[str, Any]:
        lay = self.layout
        exs = [e for _, e in batch]
        ids = self._pad([e.input_ids for e in exs], lay.pad_id)
        mask = self._pad([[1] * len(e.input_ids) for e in exs], 0)
        labels = self._pad([e.labels for e in exs], IGNORE_INDEX)
        out: dict[str, Any] = {
            "pixel_values": torch.stack([p for p, _ in batch]),
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "padded": any(len(e.input_ids) < ids.shape[1] for e in exs),
        }
        if lay.encoder_decoder:
            dec = torch.full_like(labels, lay.pad_id)
            dec[:, 0] = lay.decoder_start_id
            dec[:, 1:] = labels[:, :-1]
            dec[dec == IGNORE_INDEX] = lay.pad_id
            out["decoder_input_ids"] = dec
        return out
