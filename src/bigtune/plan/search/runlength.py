"""How long a whole run is: optimizer steps from the data's size, evaluations, and their seconds.

The rules are the engine's (engine/build.py): every rank takes ceil(samples / world) samples of an epoch
(the sampler pads by wrapping), cut into micro-batches, ``accumulate`` of them per optimizer step;
``total_steps`` turns epochs and max_steps into the run's length. Evaluation runs at every
``eval.every_steps`` and once more at the end, over the whole validation split on every rank (its loader
is not sharded), at most ``eval.max_batches`` batches.

The data's size is read as ``train`` reads it (same builders, validation split, num_train_samples and
packing), which needs the model's tokenizer and the data; ``--samples N`` gives the source's size instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from bigtune.plan.base.constants import PlanError
from bigtune.recipe import Recipe

# An evaluation batch runs the forward only: about 2 of the 6 FLOPs per parameter and token of a training
# sample (forward 2, backward 4). Its time is priced as this share of a training sample's (a rough rule,
# uncalibrated; the step's optimizer and communication make it err high).
EVAL_SHARE_OF_TRAIN_SAMPLE = 1 / 3


@dataclass(frozen=True)
class DataSize:
    """Training samples (packed rows with data.packing) and validation samples per evaluation."""

    train: int
    validation: Optional[int]  # None: a val_source whose size --samples does not give
    source: str  # where the counts come from, in words

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _built_examples(recipe: Recipe, source: Optional[str] = None):
    """(examples, report) as ``train`` builds them, for the model's family (``source``: another data source)."""
    from bigtune.models.build import load_tokenizer_or_processor

    tok = load_tokenizer_or_processor(recipe.model)
    cfg = recipe.data
    if source is not None:  # the engine's validation source: no split, no selection of its own
        cfg = dataclasses.replace(
            cfg, source=source, sources=[], val_fraction=0.0, val_source=None, num_train_samples=None
        )
    if recipe.model.family == "image-to-text":
        from bigtune.data.images import TokenLayout, build_image_examples
        from bigtune.models.configs import resolve_config_name

        layout = TokenLayout.for_model(tok, resolve_config_name(recipe.model))
        return build_image_examples(cfg, tok, layout, recipe.seed)
    if recipe.model.family == "sequence-classification":
        from bigtune.data.labels import build_classification_examples

        return build_classification_examples(cfg, tok, recipe.seed)
    from bigtune.data.text import build_examples

    return build_examples(cfg, tok, recipe.seed)


def data_size(recipe: Recipe, samples: Optional[int] = None) -> DataSize:
    """The run's training and validation sizes: read as ``train`` reads them, or from ``samples`` (the
    source's size) split and selected by the recipe's own rules."""
    from bigtune.data.text import DataReport, split_and_select

    if samples is not None:
        if samples < 1:
            raise PlanError(f"--samples must be at least 1, got {samples}")
        report = DataReport(source="--samples", format="")
        train = len(split_and_select(list(range(samples)), report, recipe.data, recipe.seed))
        val: Optional[int] = None if recipe.data.val_source else report.validation
        note = f"--samples {samples:,}"
        if recipe.data.packing:
            note += "; data.packing not applied (rows unknown without the data: an upper bound on steps)"
        return DataSize(train, val, note)
    try:
        examples, report = _built_examples(recipe)
        val = report.validation
        if recipe.data.val_source:
            val = len(_built_examples(recipe, recipe.data.val_source)[0])
    except Exception as e:  # noqa: BLE001 - any failure to read gets the same advice
        raise PlanError(
            f"counting the run's steps reads data.source as train does (with model.name's tokenizer): {e}. "
            "Give the data's size instead with --samples N"
        ) from e
    rows = len(examples)
    if recipe.data.packing:
        from bigtune.data.text import pack_examples

        rows = len(pack_examples(examples, recipe.data.max_seq_length, recipe.seed))
    note = f"{report.source}, read as train does" + (
        f" ({len(examples):,} samples packed)" if rows != len(examples) else ""
    )
    return DataSize(rows, val, note)


@dataclass(frozen=True)
class RunLength:
    steps: int  # optimizer steps of the whole run
    steps_per_epoch: int
    evaluations: int
    eval_batches: int  # per evaluation, on every rank

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def run_length(recipe: Recipe, size: DataSize, world: int, micro: int, accumulate: int) -> RunLength:
    """Steps and evaluations of ``recipe`` on ``world`` GPUs at ``micro`` × ``accumulate`` per step."""
    from bigtune.engine.build import total_steps

    per_rank = -(-size.train // world)
    micro_batches = -(-per_rank // micro)
    if recipe.train.limit_train_batches is not None:
        micro_batches = min(micro_batches, recipe.train.limit_train_batches)
    per_epoch = max(1, -(-micro_batches // accumulate))
    steps = total_steps(recipe.train.max_epochs, recipe.train.max_steps, per_epoch)
    evals, batches = 0, 0
    if size.validation:
        every = recipe.eval.every_steps
        evals = (steps // every + (1 if steps % every else 0)) if every else 1
        batches = -(-size.validation // (recipe.eval.batch_size or recipe.train.micro_batch_size))
        if recipe.eval.max_batches is not None:
            batches = min(batches, recipe.eval.max_batches)
    return RunLength(steps, per_epoch, evals, batches)


def run_seconds(recipe: Recipe, length: RunLength, step_s: float, micro: int, accumulate: int) -> tuple[float, float]:
    """(training seconds, evaluation seconds): steps × step time, and each evaluation's batches priced at
    EVAL_SHARE_OF_TRAIN_SAMPLE of a training sample's time per sample."""
    per_sample = step_s / (micro * accumulate)
    eval_batch = recipe.eval.batch_size or recipe.train.micro_batch_size
    eval_s = length.evaluations * length.eval_batches * eval_batch * per_sample * EVAL_SHARE_OF_TRAIN_SAMPLE
    return length.steps * step_s, eval_s


def hours(seconds: float) -> str:
    """Short duration text: 42 s, 17 min, 3.4 h, 2.1 d."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"
