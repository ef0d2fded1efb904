"""Plan at the lengths of the recipe's own data instead of full max_seq_length rows.

A plain plan is the worst case: every micro-batch max_seq_length tokens long. The collators pad a
micro-batch to its longest sample, so over an epoch the peak comes from the batch holding the longest
sample (after truncation), and the time from the average padded batch. With short samples — the lab's
captions, most instruction sets — that is a much smaller run than the worst case, and it can decide
whether a recipe fits. ``bigtune plan --data-lengths`` reads and tokenizes the data exactly as ``train``
will (same builders, same truncation, same seeded order) and plans:

* the peak at the longest sample's length, with padded batches (an explicit attention mask);
* the step time at the mean padded micro-batch of one epoch (the engine's own seeded sampler, length
  grouping included) and tokens/s from the real (unpadded) tokens.

Packed data fills every row to max_seq_length, so it is planned as the worst case, which it is.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

from bigtune.recipe import Recipe, load_recipe


@dataclass
class DataLengths:
    """Sample lengths in ``data.max_seq_length``'s unit (text tokens; BLIP-2: caption tokens)."""

    source: str
    samples: int
    longest: int  # the peak's length: the batch holding this sample is padded to it
    mean_padded: float  # mean padded length of the epoch's micro-batches (what the GPU computes)
    mean_tokens: float  # mean real tokens per sample (what tokens/s counts)
    truncated: int  # samples cut at max_seq_length
    # Qwen2-VL / Qwen2.5-VL: the (t, h, w) tile grid of the data's largest image (the most image tokens)
    largest_image: Optional[tuple[int, int, int]] = None

    def to_dict(self) -> dict:
        return asdict(self)


def _examples(recipe: Recipe):
    """The training examples as ``train`` builds them, and the per-sample length in max_seq_length's unit."""
    from bigtune.models.build import load_tokenizer_or_processor
    from bigtune.plan.base.constants import PlanError

    try:
        tok = load_tokenizer_or_processor(recipe.model)
    except Exception as e:  # noqa: BLE001 - any loading failure gets the same advice
        raise PlanError(
            f"--data-lengths tokenizes the data as train does, so it needs model.name's tokenizer: {e} "
            "(or plan without --data-lengths: every row max_seq_length tokens)"
        ) from e
    family = recipe.model.family
    if family == "image-to-text":
        from bigtune.data.images import TokenLayout, build_image_examples
        from bigtune.data.vlm import ChatImageLayout, is_vlm
        from bigtune.models.configs import resolve_config_name

        config = resolve_config_name(recipe.model)
        if is_vlm(config):  # text tokens (the image placeholder among them); the images' tokens apart
            chat = ChatImageLayout.for_model(tok, config, recipe.data.prompt)
            examples, report = build_image_examples(recipe.data, tok, chat, recipe.seed)
            return examples, report, [len(e.input_ids) for e in examples]

        layout = TokenLayout.for_model(tok, resolve_config_name(recipe.model))
        examples, report = build_image_examples(recipe.data, tok, layout, recipe.seed)
        if layout.encoder_decoder:  # the caption is the decoder's; the encoder input is fixed
            return examples, report, [len(e.labels) for e in examples]
        return examples, report, [len(e.input_ids) - layout.num_query_tokens for e in examples]
    if family == "sequence-classification":
        from bigtune.data.labels import build_classification_examples

        examples, report = build_classification_examples(recipe.data, tok, recipe.seed)
    else:
        from bigtune.data.text import build_examples

        examples, report = build_examples(recipe.data, tok, recipe.seed)
    return examples, report, [len(e.input_ids) for e in examples]


def epoch_batch_lengths(lengths: list[int], recipe: Recipe, world: int = 1) -> list[int]:
    """Padded length of every micro-batch of rank 0's first epoch, in the engine's sampler order."""
    from bigtune.data.text import EpochSampler

    micro = recipe.train.micro_batch_size
    grouping = {}
    if recipe.data.group_by_length:
        grouping = {"lengths": lengths, "group_size": 50 * micro * world}
    order = EpochSampler(len(lengths), recipe.seed, world=world, **grouping).rank_order()
    return [max(lengths[i] for i in order[k : k + micro]) for k in range(0, len(order), micro)]


def data_lengths(recipe: Recipe, world: int = 1) -> DataLengths:
    """Read and tokenize the recipe's training data (as ``train`` does) and measure its lengths."""
    examples, report, lengths = _examples(recipe)
    batches = epoch_batch_lengths(lengths, recipe, world)
    largest = _largest_image(recipe, examples) if recipe.model.family == "image-to-text" else None
    return DataLengths(
        source=report.source,
        samples=len(lengths),
        longest=max(lengths),
        mean_padded=sum(batches) / len(batches),
        mean_tokens=sum(lengths) / len(lengths),
        truncated=report.truncated,
        largest_image=largest,
    )


def _largest_image(recipe: Recipe, examples: list) -> Optional[tuple[int, int, int]]:
    """A chat vision-language model's grid of the data's image with the most tokens (None for BLIP-2, whose
    images are all one size). Only the images' headers are read."""
    from bigtune.models.configs import resolve_config_name
    from bigtune.plan.step.chatvlm import image_geometry, image_pixels, is_chat_vlm_config

    config = resolve_config_name(recipe.model)
    if not is_chat_vlm_config(config):
        return None
    geometry = image_geometry(recipe, config)
    grids = {geometry.grid(*image_pixels(e.image)) for e in examples}
    return max(grids, key=lambda g: (geometry.tokens(g), g))


def plan_at_data_lengths(recipe: Recipe, target, config=None, workers: int = 1, lengths: Optional[DataLengths] = None):
    """``planner.plan`` with the peak at the data's longest sample and the time at its mean padded batch."""
    from bigtune.models.configs import resolve_config
    from bigtune.plan.base.target import target_arch
    from bigtune.plan.layout.tensor_parallel import rank_config, with_tensor_parallel
    from bigtune.plan.layout.time import step_time
    from bigtune.plan.planner import plan
    from bigtune.plan.step.simulate import simulate_full_depth, simulation_recipe

    if recipe.data.packing:
        p = plan(recipe, target, config=config, workers=workers)
        p.notes.append("data.packing: every row is max_seq_length tokens, so the data's lengths change nothing")
        return p
    dp = with_tensor_parallel(recipe, target).data_parallel  # the ranks that read different batches
    d = lengths or data_lengths(recipe, dp)
    at_peak = load_recipe(recipe.to_dict(), {"data.max_seq_length": d.longest}, check=False)
    # Padded batches hand the model an explicit attention mask (a different SDPA kernel on some GPUs);
    # a dataset whose every sample has the same length never pads.
    padded = d.mean_tokens < d.longest
    # Chat vision-language models: every row with the largest image, so no batch of the data pads longer
    images = (tuple(d.largest_image),) if d.largest_image else None
    p = plan(at_peak, target, config=config, workers=workers, padded=padded, images=images)
    p.recipe_name = recipe.name
    # Time: the GPU computes the padded batch; tokens/s counts the real tokens.
    mean_len = max(1, math.ceil(d.mean_padded))
    at_mean = load_recipe(recipe.to_dict(), {"data.max_seq_length": mean_len}, check=False)
    step, tnotes = None, []
    if target.gpu is not None:
        # The kernels of a shorter batch are other kernels (thinner matmuls, fewer scores): simulate it
        # (under tensor parallelism, one rank's model).
        tp_target = with_tensor_parallel(at_mean, target)
        rank = rank_config(config if config is not None else resolve_config(recipe), tp_target.tensor_parallel)
        sim = simulate_full_depth(
            simulation_recipe(at_mean, target.strategy),
            rank,
            target.device == "cuda",
            padded=padded,
            arch=target_arch(target),
            images=images,
        )
        step, _, tnotes = step_time(at_mean, sim, tp_target, rank)
    p.notes = [n for n in p.notes if not n.startswith("time:")] + tnotes
    real = recipe.train.micro_batch_size * recipe.accumulate * dp * d.mean_tokens
    p.tokens_per_step = int(round(real))
    p.step_time_s = step
    p.tokens_per_s = real / step if step else None
    p.data_lengths = d.to_dict()
    p.notes.insert(
        0,
        f"planned at the data's lengths ({d.samples} samples of {d.source}): peak at the longest "
        f"sample, {d.longest} tokens (max_seq_length {recipe.data.max_seq_length}, {d.truncated} "
        f"truncated); time at the mean padded micro-batch, {d.mean_padded:.1f} tokens; "
        f"{d.mean_tokens:.1f} real tokens per sample",
    )
    return p
