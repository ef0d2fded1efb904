"""What every data module shares: the error a bad source raises, the report of what was read, one tokenized
training example, and the held-out split."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from bigtune.recipe import DataConfig


class DataError(ValueError):
    """The data cannot be used as given; the message names the file/record and the fix."""


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


@dataclass
class DataReport:
    source: str
    format: str
    records: int = 0
    used: int = 0
    skipped: list[tuple[int, str]] = field(default_factory=list)
    truncated: int = 0
    validation: int = 0
    val_examples: list = field(default_factory=list, repr=False)
    label_names: list = field(default_factory=list)  # classification: class names in index order
    label_counts: dict = field(default_factory=dict)  # classification: usable records per class
    notes: list = field(default_factory=list)  # how the format was applied (chat: template, loss tokens)
    sources: list = field(default_factory=list)  # data.sources: one dict of counts per entry (data/mix.py)

    def summary(self) -> dict:
        out = {
            "source": self.source,
            "format": self.format,
            "records": self.records,
            "used": self.used,
            "validation": self.validation,
            "skipped": len(self.skipped),
            "truncated": self.truncated,
            "skipped_examples": [{"index": i, "reason": r} for i, r in self.skipped[:20]],
        }
        if self.notes:
            out["notes"] = list(self.notes)
        if self.label_names:
            out.update(label_names=list(self.label_names), label_counts=dict(self.label_counts))
        if self.sources:
            out["sources"] = [dict(s) for s in self.sources]
        return out

    def lines(self) -> list[str]:
        out = [
            f"data: {self.source} ({self.format}): {self.records} records, {self.used} used for training, "
            f"{self.validation} for validation, {len(self.skipped)} skipped, {self.truncated} truncated"
        ]
        out += [f"  {n}" for n in self.notes]
        if self.label_names:
            out.append("  labels: " + ", ".join(f"{n} ({self.label_counts.get(n, 0)})" for n in self.label_names))
        for i, r in self.skipped[:10]:
            out.append(f"  skipped record {i}: {r}")
        if len(self.skipped) > 10:
            out.append(f"  ... and {len(self.skipped) - 10} more (all listed in summary.json up to 20)")
        return out


def split_and_select(examples: list, report: DataReport, cfg: DataConfig, seed: int) -> list:
    """Hold out val_fraction (seeded; into report.val_examples), then keep num_train_samples (seeded)."""
    report.validation = 0
    if cfg.val_fraction and not cfg.val_source:
        # Held out before anything else, by a seeded shuffle: the split is the same on every resume.
        order = list(range(len(examples)))
        random.Random(seed + 7).shuffle(order)
        n_val = max(1, int(round(cfg.val_fraction * len(examples))))
        if n_val >= len(examples):
            raise DataError(f"data.val_fraction={cfg.val_fraction} leaves no training samples out of {len(examples)}")
        val_idx = set(order[:n_val])
        report.val_examples = [e for i, e in enumerate(examples) if i in val_idx]
        examples = [e for i, e in enumerate(examples) if i not in val_idx]
        report.validation = n_val
    if cfg.num_train_samples is not None and cfg.num_train_samples < len(examples):
        order = list(range(len(examples)))
        random.Random(seed).shuffle(order)
        examples = [examples[i] for i in sorted(order[: cfg.num_train_samples])]
    report.used = len(examples)
    return examples
