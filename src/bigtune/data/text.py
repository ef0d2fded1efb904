"""Data: read a source, turn records into token ids and labels, batch them.

Sources: the bundled demo, JSON/JSONL/CSV/Parquet files, plain text, and folders written by
``datasets.save_to_disk``. Formats: alpaca-style instruction records (instruction / input /
output, prompt masked out of the loss by default), raw text (a ``text`` column, or a .txt file
cut into max_seq_length blocks) and chat conversations (``bigtune.data.chat``).

A record that cannot be used (missing or empty fields, nothing left to learn after truncation) is
skipped, counted and reported with its index and reason; a file that cannot be parsed is an error
naming the file and line.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from bigtune.core.presets import DEMO_CHAT_DATA, DEMO_DATA
from bigtune.core.stepmath import IGNORE_INDEX
from bigtune.data.chat import ChatFormatter
from bigtune.data.records import DataError, DataReport, Example, split_and_select
from bigtune.recipe import DataConfig

TRAIN_ON = {
    "assistant": "every assistant turn",
    "last_assistant": "the last assistant turn",
    "all": "every token",
}

PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"

PROMPT_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"


def format_prompt(instruction: str, input_text: str = "") -> str:
    """The instruction prompt used for training and for `generate` on instruction-tuned runs."""
    if input_text:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input_text)
    return PROMPT_NO_INPUT.format(instruction=instruction)


def read_jsonl(path: Path) -> list[Any]:
    out = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path} line {lineno} column {e.colno}: not valid JSON ({e.msg}); fix or delete "
                    "that line (each line must be one JSON object)"
                ) from None
    return out


def json_file_error(path: Path, e: json.JSONDecodeError) -> str:
    """The message for a .json file the parser refused: its line and column, and the fix."""
    where = f"{path} line {e.lineno} column {e.colno}: not valid JSON ({e.msg})"
    if e.msg == "Extra data":  # one whole value, then more: records one per line, as JSONL writes them
        return f"{where}; the file holds more than one JSON value: one record per line is JSONL, name it .jsonl"
    return f"{where}; fix the file, or use JSONL (one object per line)"


def _read_json(path: Path, split: str) -> list[Any]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(json_file_error(path, e)) from None
    if isinstance(obj, dict):
        if split in obj and isinstance(obj[split], list):
            return obj[split]
        raise DataError(
            f"{path}: top level is an object without a list under {split!r}; expected a list of "
            'records or {"' + split + '": [...]}'
        )
    if not isinstance(obj, list):
        raise DataError(f"{path}: expected a list of records, got {type(obj).__name__}")
    return obj


def _read_hf(path: Path, split: str) -> list[Any]:
    import datasets

    if path.is_dir():
        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as e:
            raise DataError(f"{path}: not a folder written by datasets' save_to_disk ({e})") from e
    else:
        builder = {".csv": "csv", ".parquet": "parquet", ".tsv": "csv"}[path.suffix]
        kw = {"delimiter": "\t"} if path.suffix == ".tsv" else {}
        try:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", **kw)
        except Exception as e:
            raise DataError(f"{path}: could not read as {builder} ({e})") from e
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{path}: has splits {sorted(ds)}, not {split!r}; set data.split to one of them")
        ds = ds[split]
    return [row for row in ds]


def _read_hub(dataset_id: str, split: str) -> list[Any]:
    import datasets
    import datasets.config

    from bigtune.core.hub import hub_reachable

    # With no hub to ask, datasets' own offline switch makes it read its cache at once instead of
    # retrying the hub for tens of seconds before the same error.
    offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = offline or not hub_reachable()
    try:
        ds = datasets.load_dataset(dataset_id, split=split)
    except Exception as e:
        raise DataError(
            f"data.source hf:{dataset_id}: could not load split {split!r} from the hub ({e}). Offline, "
            "save it elsewhere with `datasets.load_dataset(...).save_to_disk(DIR)` and point "
            "data.source at DIR"
        ) from e
    finally:
        datasets.config.HF_HUB_OFFLINE = offline
    return [row for row in ds]


def read_source(cfg: DataConfig) -> tuple[str, list[Any]]:
    """(source label, raw records). Plain .txt files come back as one string."""
    if cfg.source == "demo":
        demo = DEMO_CHAT_DATA if cfg.format == "chat" else DEMO_DATA
        return str(demo), read_jsonl(demo)
    if cfg.source.startswith("hf:"):
        return cfg.source, _read_hub(cfg.source[3:], cfg.split)
    path = Path(cfg.source).expanduser()
    if not path.exists():
        raise DataError(f"data.source: {path} does not exist")
    if path.is_dir():
        return str(path), _read_hf(path, cfg.split)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return str(path), read_jsonl(path)
    if suffix == ".json":
        return str(path), _read_json(path, cfg.split)
    if suffix in (".csv", ".tsv", ".parquet"):
        return str(path), _read_hf(path, cfg.split)
    if suffix in (".txt", ".md", ".text"):
        return str(path), [path.read_text(encoding="utf-8", errors="replace")]
    raise DataError(
        f"data.source: {path} has an unknown extension {suffix!r}; use .jsonl, .json, .csv, .parquet, "
        ".txt or a save_to_disk folder"
    )


def detect_format(cfg: DataConfig, source: str, records: list[Any]) -> str:
    if cfg.format != "auto":
        return cfg.format
    if source.endswith((".txt", ".md", ".text")):
        return "text"
    # Look past malformed leading records: one bad record must be skipped, not break detection.
    dicts = [r for r in records[:1000] if isinstance(r, dict)]
    if any(isinstance(r.get("messages"), list) or isinstance(r.get("conversations"), list) for r in dicts):
        return "chat"
    if any("instruction" in r and "output" in r for r in dicts):
        return "alpaca"
    if any(cfg.text_field in r for r in dicts):
        return "jsonl-text"
    first = dicts[0] if dicts else None
    keys = sorted(first) if first is not None else []
    raise DataError(
        f"data.source {source}: cannot tell the format from keys {keys}; records need a messages or "
        f"conversations list (chat), instruction/output (alpaca) or a {cfg.text_field!r} field (set "
        "data.text_field), or set data.format"
    )


def _alpaca_example(rec: Any, tok, cfg: DataConfig) -> tuple[Optional[Example], str, bool]:
    if not isinstance(rec, dict):
        return None, f"not an object ({type(rec).__name__})", False
    for key in ("instruction", "output"):
        if key not in rec or rec[key] is None:
            return None, f"missing {key!r}", False
        if not isinstance(rec[key], str):
            return None, f"{key!r} is {type(rec[key]).__name__}, not text", False
    inp = rec.get("input") or ""
    if not isinstance(inp, str):
        return None, f"'input' is {type(inp).__name__}, not text", False
    if not rec["output"].strip():
        return None, "empty 'output'", False
    prompt_ids = tok(format_prompt(rec["instruction"], inp), add_special_tokens=False)["input_ids"]
    answer_ids = tok(rec["output"], add_special_tokens=False)["input_ids"]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    prompt = bos + prompt_ids
    ids = prompt + answer_ids + eos
    labels = ([IGNORE_INDEX] * len(prompt) if cfg.mask_prompt else list(prompt)) + answer_ids + eos
    truncated = len(ids) > cfg.max_seq_length
    ids, labels = ids[: cfg.max_seq_length], labels[: cfg.max_seq_length]
    if len(prompt) >= cfg.max_seq_length:
        return (
            None,
            f"prompt is longer than data.max_seq_length={cfg.max_seq_length}: no response tokens left",
            truncated,
        )
    return Example(ids, labels), "", truncated


def _text_example(rec: Any, tok, cfg: DataConfig) -> tuple[Optional[Example], str, bool]:
    text = rec.get(cfg.text_field) if isinstance(rec, dict) else None
    if not isinstance(text, str):
        return None, f"missing text field {cfg.text_field!r}", False
    if not text.strip():
        return None, "empty text", False
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    ids = bos + tok(text, add_special_tokens=False)["input_ids"]
    if tok.eos_token_id is not None:
        ids.append(tok.eos_token_id)
    truncated = len(ids) > cfg.max_seq_length
    ids = ids[: cfg.max_seq_length]
    if len(ids) < 2:
        return None, "fewer than 2 tokens", truncated
    return Example(ids, list(ids)), "", truncated


def _text_blocks(text: str, tok, cfg: DataConfig) -> list[Example]:
    """A plain-text file becomes consecutive max_seq_length blocks (the usual LM setup)."""
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = cfg.max_seq_length
    blocks = [ids[i : i + n] for i in range(0, len(ids), n)]
    return [Example(b, list(b)) for b in blocks if len(b) >= 2]


def no_samples_error(source: str, report: DataReport) -> DataError:
    """The one error for a source that yields nothing to train on, naming the first problem."""
    first = f"; first problem: record {report.skipped[0][0]}: {report.skipped[0][1]}" if report.skipped else ""
    return DataError(f"{source}: no usable samples ({report.records} records, {len(report.skipped)} skipped{first})")


def build_examples(cfg: DataConfig, tok, seed: int) -> tuple[list[Example], DataReport]:
    """Read, validate, tokenize, select num_train_samples (seeded shuffle). Raises DataError if empty.

    With data.sources, every entry is built this way and the results are weighted and joined (data/mix.py).
    """
    if cfg.sources:
        from bigtune.data.mix import build_mixture

        return build_mixture(cfg, tok, seed, build_examples)
    source, records = read_source(cfg)
    if not records:
        raise DataError(f"{source}: no usable samples (the source holds no records)")
    fmt = detect_format(cfg, source, records)
    report = DataReport(source=source, format=fmt, records=len(records))
    examples: list[Example] = []
    if fmt == "text" and len(records) == 1 and isinstance(records[0], str):
        examples = _text_blocks(records[0], tok, cfg)
        report.records = len(examples)
    else:
        make = _alpaca_example if fmt == "alpaca" else _text_example
        if fmt == "chat":
            try:
                make = ChatFormatter(cfg, tok)
            except DataError as e:
                raise DataError(f"{source}: {e}") from None
            report.notes.append(f"rendered with {make.label}; loss on {TRAIN_ON[cfg.train_on]}")
        for i, rec in enumerate(records):
            try:
                ex, reason, truncated = make(rec, tok, cfg)
            except DataError as e:  # a problem of the template or tokenizer, not of this one record
                raise DataError(f"{source} record {i}: {e}") from None
            if ex is None:
                if not cfg.skip_bad_records:
                    raise DataError(f"{source} record {i}: {reason}; fix the record or set data.skip_bad_records=true")
                report.skipped.append((i, reason))
                continue
            report.truncated += int(truncated)
            examples.append(ex)
    if not examples:
        raise no_samples_error(source, report)
    examples = split_and_select(examples, report, cfg, seed)
    return examples, report


@dataclass
class PackedRow:
    """Several examples concatenated into one row (data.packing). ``position_ids`` restart at 0 for
    each example, which is how the model keeps attention inside each one; the first label of each
    example is IGNORE_INDEX so no example's first token is predicted from the previous one."""

    input_ids: list[int]
    labels: list[int]
    position_ids: list[int]
    samples: int


def pack_examples(examples: list[Example], max_len: int, seed: int) -> list[PackedRow]:
    """Seeded shuffle, then fill rows of at most ``max_len`` tokens in order (next-fit).

    Each example keeps its own loss targets: labels[0] of an example is never a target unpacked
    (nothing precedes it), and masking it here keeps it that way packed.
    """
    order = list(range(len(examples)))
    random.Random(seed + 11).shuffle(order)
    rows: list[PackedRow] = []
    cur = PackedRow([], [], [], 0)
    for i in order:
        e = examples[i]
        if cur.samples and len(cur.input_ids) + len(e.input_ids) > max_len:
            rows.append(cur)
            cur = PackedRow([], [], [], 0)
        cur.input_ids += e.input_ids
        cur.labels += [IGNORE_INDEX] + e.labels[1:]
        cur.position_ids += list(range(len(e.input_ids)))
        cur.samples += 1
    if cur.samples:
        rows.append(cur)
    return rows


class Collator:
    """Right-pads a list of examples to the longest one; padding gets label -100 and mask 0.

    Packed rows (PackedRow) also get ``position_ids``; their padding is one more document (positions
    from 0) so the model, given position ids and no attention mask, isolates it like the others.
    """

    def __init__(self, pad_id: int, pad_to_multiple_of: int = 1):
        self.pad_id = pad_id
        self.multiple = pad_to_multiple_of

    def __call__(self, batch: list[Example]) -> dict[str, torch.Tensor]:
        n = max(len(e.input_ids) for e in batch)
        n = -(-n // self.multiple) * self.multiple
        ids = torch.full((len(batch), n), self.pad_id, dtype=torch.long)
        labels = torch.full((len(batch), n), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, e in enumerate(batch):
            k = len(e.input_ids)
            ids[i, :k] = torch.tensor(e.input_ids)
            labels[i, :k] = torch.tensor(e.labels)
            mask[i, :k] = 1
        if isinstance(batch[0], PackedRow):
            pos = torch.arange(n).repeat(len(batch), 1)
            for i, e in enumerate(batch):
                k = len(e.input_ids)
                pos[i, :k] = torch.tensor(e.position_ids)
                pos[i, k:] -= k
            # The attention mask stays out of the forward (padded False): with it, the model would
            # ignore the document boundaries in position_ids. It still counts the real tokens.
            return {
                "input_ids": ids,
                "attention_mask": mask,
                "labels": labels,
                "position_ids": pos,
                "padded": False,
                "packed": True,
                "samples": sum(e.samples for e in batch),
            }
        # `padded` lets the model skip the attention mask when every row is full: HF then calls SDPA
        # with is_causal (flash kernels, no S×S mask), saving memory and time.
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "padded": any(len(e.input_ids) < n for e in batch),
        }


class EpochSampler(torch.utils.data.Sampler[int]):
    """Seeded permutation per epoch that can start mid-epoch, so a resumed run sees the same data."""

    def __init__(
        self,
        n: int,
        seed: int,
        shuffle: bool = True,
        rank: int = 0,
        world: int = 1,
        lengths: Optional[list[int]] = None,
        group_size: int = 0,
    ):
        self.n, self.seed, self.shuffle = n, seed, shuffle
        # Length grouping (data.group_by_length): within each run of group_size samples of the
        # permutation, longest first, so a micro-batch holds similar lengths and little padding.
        self.lengths, self.group_size = lengths, group_size
        self.rank, self.world = rank, world
        self.epoch = 0
        self.start = 0  # first position (in this rank's share) to yield, set on resume

    @property
    def per_rank(self) -> int:
        return -(-self.n // self.world)

    def set_epoch(self, epoch: int, start_sample: int = 0) -> None:
        self.epoch, self.start = epoch, start_sample

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        # A large odd stride keeps (seed, epoch) pairs from sharing a permutation.
        g = torch.Generator().manual_seed(self.seed + 1_000_003 * self.epoch)
        perm = torch.randperm(self.n, generator=g).tolist()
        if self.lengths is None or self.group_size <= 1:
            return perm
        out = []
        for i in range(0, self.n, self.group_size):
            out += sorted(perm[i : i + self.group_size], key=lambda j: -self.lengths[j])
        return out

    def rank_order(self) -> list[int]:
        """This rank's share: every world-th sample of the epoch's permutation, starting at its rank.
        The permutation is padded by wrapping so every rank gets the same count (no rank waits for
        a step the others never take); one optimizer step then covers consecutive samples."""
        order = self.order()
        order += order[: self.per_rank * self.world - len(order)]
        return order[self.rank :: self.world]

    def __iter__(self) -> Iterator[int]:
        return iter(self.rank_order()[self.start :])

    def __len__(self) -> int:
        return self.per_rank - self.start


class ListDataset(torch.utils.data.Dataset):
    def __init__(self, items: list[Example]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Example:
        return self.items[i]
