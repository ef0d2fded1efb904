"""Several sources in one run (``data.sources``): each read and checked on its own, then weighted and joined.

Each entry is built exactly as a single ``data.source`` would be (its own format, split and text field), so
a problem in it is reported with its index and file. The validation split (``data.val_fraction``) is held
out of every source before weighting: each source is represented, and no held-out sample is repeated.
A weight then scales that source's training samples: the whole part repeats every sample, the fractional
part adds a seeded subset (weight 2.5 on 10 samples: every sample twice plus 5 of them). The counts are
exact and the same on every run with the same seed; ``data.num_train_samples`` then picks from the mixture.

datasets' ``interleave_datasets`` draws sources by probability, so its counts per source only approach
the weights, and it works on raw records, which here may differ in format from source to source; the
mixture is therefore made from the tokenized examples, by index.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable

from bigtune.data.records import DataError, DataReport, split_and_select
from bigtune.recipe import DataConfig


def source_config(cfg: DataConfig, index: int) -> DataConfig:
    """The single-source config that data.sources[index] stands for (its keys over this section's)."""
    entry = cfg.sources[index]
    return dataclasses.replace(
        cfg,
        source=entry["source"],
        format=entry.get("format", cfg.format),
        split=entry.get("split", cfg.split),
        text_field=entry.get("text_field", cfg.text_field),
        sources=[],
        # A separate validation source replaces the held-out split, as it does for one source.
        val_fraction=0.0 if cfg.val_source else cfg.val_fraction,
        val_source=None,
        num_train_samples=None,
    )


def weighted(examples: list, weight: float, seed: int) -> list:
    """``examples`` repeated int(weight) times, plus a seeded round(frac(weight) × n) of them in file order."""
    whole, frac = divmod(float(weight), 1.0)
    out = list(examples) * int(whole)
    extra = round(frac * len(examples))
    if extra:
        order = list(range(len(examples)))
        random.Random(seed).shuffle(order)
        out += [examples[i] for i in sorted(order[:extra])]
    return out


def _where(index: int, source: str) -> str:
    return f"data.sources[{index}] ({source})"


def build_mixture(
    cfg: DataConfig, tok: Any, seed: int, build_one: Callable[[DataConfig, Any, int], tuple[list, DataReport]]
) -> tuple[list, DataReport]:
    """(training examples, report) of every data.sources entry, weighted and joined; validation in the report."""
    parts: list[tuple[list, DataReport, float]] = []
    for i, entry in enumerate(cfg.sources):
        one = source_config(cfg, i)
        try:
            examples, rep = build_one(one, tok, seed)
        except DataError as e:
            # The single-source messages name `data.source`; here the entry's index says which one.
            msg = str(e).removeprefix("data.source: ").removeprefix("data.source ")
            raise DataError(f"{_where(i, one.source)}: {msg}") from None
        weight = float(entry.get("weight", 1.0))
        kept = weighted(examples, weight, seed + i)
        if not kept:
            raise DataError(
                f"{_where(i, one.source)}: weight {weight:g} × {len(examples)} training samples keeps none; "
                f"raise data.sources[{i}].weight to at least {1 / len(examples):.3g}"
            )
        parts.append((kept, rep, weight))

    total = sum(len(kept) for kept, _, _ in parts)
    formats = sorted({rep.format for _, rep, _ in parts})
    report = DataReport(
        source="mixture of " + ", ".join(f"{rep.source} ×{w:g}" for _, rep, w in parts),
        format="/".join(formats),
    )
    mixed: list = []
    for i, (kept, rep, weight) in enumerate(parts):
        mixed += kept
        report.records += rep.records
        report.truncated += rep.truncated
        report.skipped += [(j, f"data.sources[{i}]: {reason}") for j, reason in rep.skipped]
        report.val_examples += rep.val_examples
        report.sources.append(
            {
                "index": i,
                "source": rep.source,
                "format": rep.format,
                "weight": weight,
                "records": rep.records,
                "train_samples": rep.used,
                "mixed_samples": len(kept),
                "validation": rep.validation,
            }
        )
        report.notes.append(
            f"data.sources[{i}] {rep.source} ({rep.format}), weight {weight:g}: {rep.used} samples → {len(kept)} "
            f"({100 * len(kept) / total:.0f}% of the mixture), {rep.validation} for validation"
        )
        report.notes += [f"  {n}" for n in rep.notes]
    # num_train_samples picks from the whole mixture, as it does from one source (the split is done).
    mixed = split_and_select(mixed, report, dataclasses.replace(cfg, val_fraction=0.0), seed)
    report.validation = len(report.val_examples)
    return mixed, report
