"""Labelled text for ``model.family: sequence-classification``: label names, encoding and the collator.

A label is a class name from ``data.label_names`` or an integer index into them; with no label_names the
classes are the sorted distinct labels of the training data. A record with no text or no label is skipped
and counted; a label outside the classes is an error naming the file, record and line.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional

from bigtune.core.presets import DEMO_CLASSIFICATION_DATA
from bigtune.recipe import DataConfig


def _label_key(value: Any) -> tuple[Any, str]:
    """(int or str label, '') or (None, reason). Integral floats (CSV/pandas) count as integers."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None, "missing"
    if isinstance(value, bool):
        return None, f"label {value!r} is a boolean; use class names or integer indices"
    if isinstance(value, int):
        return value, ""
    if isinstance(value, float) and value.is_integer():
        return int(value), ""
    if isinstance(value, str):
        return value.strip(), ""
    return None, f"label {value!r} ({type(value).__name__}) is neither a class name nor an integer index"


def _where(source: str, index: int) -> str:
    """'FILE record I (line L)' where the line is known (JSONL, CSV without multi-line cells)."""
    path = Path(source)
    line = None
    if path.suffix.lower() == ".jsonl" and path.is_file():
        seen = -1
        with path.open(encoding="utf-8") as fh:
            for lineno, text in enumerate(fh, 1):
                if text.strip():
                    seen += 1
                    if seen == index:
                        line = lineno
                        break
    elif path.suffix.lower() == ".csv":
        line = index + 2  # after the header
    return f"{source} record {index}" + (f" (line {line})" if line else "")


def infer_label_names(keys: list[Any], source: str) -> list[str]:
    """Sorted distinct labels: integers as numbers, text alphabetically; a mix is an error."""
    from bigtune.data.text import DataError

    ints = {k for k in keys if isinstance(k, int)}
    strs = {k for k in keys if isinstance(k, str)}
    if ints and strs:
        raise DataError(
            f"{source}: labels mix integers ({sorted(ints)[:5]}) and names ({sorted(strs)[:5]}); use one "
            "kind, or set data.label_names so integers are read as indices into them"
        )
    names = [str(k) for k in sorted(ints)] if ints else sorted(strs)
    if len(names) < 2:
        raise DataError(
            f"{source}: every usable record has the label {names[0]!r}; a classifier needs at least 2 "
            "classes (check data.label_field)"
        )
    return names


class LabelMap:
    """Label value → class index for a fixed list of class names."""

    def __init__(self, names: list):
        self.names = [str(n) for n in names]
        self.by_name = {n: i for i, n in enumerate(self.names)}
        # Names like 1..5 (star ratings): an integer label is matched by name, not used as an index.
        self.numeric_names = all(n.lstrip("-").isdigit() for n in self.names)

    def index(self, key: Any) -> Optional[int]:
        if isinstance(key, int):
            if self.numeric_names:
                return self.by_name.get(str(key))
            return key if 0 <= key < len(self.names) else None
        return self.by_name.get(key)


def encode_text(tok, text: str, max_len: int) -> tuple[list[int], bool]:
    """(BOS + text + EOS truncated to max_len, truncated?) — the same for training, eval and predict."""
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    ids = bos + tok(text, add_special_tokens=False)["input_ids"] + eos
    return ids[:max_len], len(ids) > max_len


def build_classification_examples(cfg: DataConfig, tok, seed: int):
    """(examples, DataReport): read, check and tokenize text + label records, split off validation,
    select num_train_samples. ``Example.labels`` is ``[class index]``; the report's label_names are
    cfg.label_names, or inferred.
    """
    from bigtune.data.text import DataError, DataReport, Example, no_samples_error, read_source, split_and_select

    if cfg.source == "demo":
        cfg = dataclasses.replace(cfg, source=str(DEMO_CLASSIFICATION_DATA))
    source, records = read_source(cfg)
    if records and isinstance(records[0], str):
        raise DataError(
            f"{source}: a plain text file has no labels; classification needs records with "
            f"{cfg.text_field!r} and {cfg.label_field!r} (.jsonl, .csv, .parquet, save_to_disk)"
        )
    if not records:
        raise DataError(f"{source}: no usable samples (the source holds no records)")
    report = DataReport(source=source, format="classification", records=len(records))
    rows: list[tuple[int, str, Any]] = []
    for i, rec in enumerate(records):
        reason = ""
        if not isinstance(rec, dict):
            reason = f"not an object ({type(rec).__name__})"
        else:
            text = rec.get(cfg.text_field)
            key, why = _label_key(rec.get(cfg.label_field))
            if not isinstance(text, str):
                reason = f"missing text field {cfg.text_field!r}"
            elif not text.strip():
                reason = "empty text"
            elif why == "missing":
                reason = f"missing label field {cfg.label_field!r}"
            elif why:
                raise DataError(f"{_where(source, i)}: {why}; fix the record")
        if reason:
            if not cfg.skip_bad_records:
                raise DataError(f"{_where(source, i)}: {reason}; fix the record or set data.skip_bad_records=true")
            report.skipped.append((i, reason))
            continue
        rows.append((i, text, key))
    if not rows:
        raise no_samples_error(source, report)
    names = [str(n) for n in cfg.label_names] if cfg.label_names else infer_label_names([k for _, _, k in rows], source)
    labels = LabelMap(names)
    examples: list[Example] = []
    counts = {n: 0 for n in names}
    for i, text, key in rows:
        y = labels.index(key)
        if y is None:
            raise DataError(
                f"{_where(source, i)}: label {key!r} is not one of data.label_names {names}; fix the "
                "record, or correct data.label_names (integers are indices into it)"
            )
        ids, truncated = encode_text(tok, text, cfg.max_seq_length)
        report.truncated += int(truncated)
        examples.append(Example(ids, [y]))
        counts[names[y]] += 1
    report.label_names, report.label_counts = names, counts
    return split_and_select(examples, report, cfg, seed), report


class ClassificationCollator:
    """Right-pads input_ids (mask 0); labels are one class index per sample, shape (batch,)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, batch: list) -> dict[str, Any]:
        import torch

        n = max(len(e.input_ids) for e in batch)
        ids = torch.full((len(batch), n), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), n), dtype=torch.long)
        for i, e in enumerate(batch):
            ids[i, : len(e.input_ids)] = torch.tensor(e.input_ids, dtype=torch.long)
            mask[i, : len(e.input_ids)] = 1
        labels = torch.tensor([e.labels[0] for e in batch], dtype=torch.long)
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": labels,
            "padded": any(len(e.input_ids) < n for e in batch),
        }


def classification_data(recipe, tokenizer):
    """The engine's data hooks for the family: (examples, report, dataset factory, collator, builder
    for a validation source). Inferred label names are stored in ``recipe.data.label_names``, so the
    run's recipe.yaml, its validation source and its saved config all use the same classes."""
    from bigtune.data.text import ListDataset

    examples, report = build_classification_examples(recipe.data, tokenizer, recipe.seed)
    if not recipe.data.label_names:
        recipe.data.label_names = list(report.label_names)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return (
        examples,
        report,
        ListDataset,
        ClassificationCollator(pad),
        (lambda cfg: build_classification_examples(cfg, tokenizer, recipe.seed)),
    )
