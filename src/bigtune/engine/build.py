"""Setup and build of a training run: Fabric (with the allocator settings it must start with), then data,
model, optimizer, loaders and schedule (``build``), handed to the loop (loop.py) as one ``Built``."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from bigtune.core.presets import PRESETS
from bigtune.data.text import Collator, EpochSampler, ListDataset, build_examples, pack_examples
from bigtune.engine.optim import make_optimizer
from bigtune.engine.pipeline import PipelineRunner
from bigtune.engine.state import Built
from bigtune.models.build import (
    apply_peft,
    build_model,
    compile_blocks,
    count_parameters,
    enable_activation_checkpointing,
    load_tokenizer_or_processor,
)
from bigtune.recipe import Recipe, RecipeError, quant_backend, resolve_accelerator

ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # both carry the allocator settings (torch 2.9+)


def set_cuda_alloc_conf(recipe: Recipe) -> None:
    """Export train.cuda_alloc_conf as PYTORCH_CUDA_ALLOC_CONF. PyTorch reads it once, when the caching
    allocator first starts, so this runs before Fabric touches CUDA; the ranks Fabric spawns inherit it, and
    ranks started by torchrun or Slurm run this themselves. A different setting already in the environment,
    or a CUDA allocator that started before bigtune could set it, is a RecipeError: the run would not be
    the one the recipe says (and planned)."""
    conf = recipe.train.cuda_alloc_conf
    if not conf:
        return
    wanted = "".join(conf.split())
    for var in ALLOC_CONF_VARS:
        have = os.environ.get(var)
        if have is not None and "".join(have.split()) != wanted:
            raise RecipeError(
                [
                    f"train.cuda_alloc_conf: {conf!r}, but the environment sets {var}={have!r}; unset {var}, or "
                    f"make the two agree (or set train.cuda_alloc_conf='' to keep the environment's)"
                ]
            )
    if torch.cuda.is_initialized() and "".join(os.environ.get(ALLOC_CONF_VARS[0], "").split()) != wanted:
        raise RecipeError(
            [
                f"train.cuda_alloc_conf: {conf!r} comes too late: CUDA already started in this process with other "
                f"allocator settings; export PYTORCH_CUDA_ALLOC_CONF={conf!r} before starting Python"
            ]
        )
    os.environ[ALLOC_CONF_VARS[0]] = conf


def setup_fabric(recipe: Recipe):
    from lightning.fabric import Fabric

    from bigtune.engine.strategies import is_deepspeed, make_strategy

    accel = resolve_accelerator(recipe)
    fabric = Fabric(
        accelerator=accel,
        devices=recipe.devices,
        num_nodes=recipe.num_nodes,
        precision=recipe.precision,
        strategy=make_strategy(recipe, accel),
    )
    # Models are built in the dtype their precision stores weights in, and PEFT / bitsandbytes pick
    # their own dtypes on purpose (fp32 adapters and norms, uint8 4-bit weights): Fabric's blanket
    # module.to(dtype) would undo that (and bitsandbytes models refuse .to), so it is skipped.
    fabric._precision.convert_module = lambda module: module
    if recipe.world_size > 1 or is_deepspeed(recipe):  # Fabric wants DeepSpeed launched even on one GPU
        fabric.launch()  # spawns the other ranks (a no-op under torchrun / Slurm, which started them)
    return fabric


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def lr_factor(step: int, total_steps: int, warmup: int, schedule: str, floor: float) -> float:
    """Multiplier on the peak lr at optimizer step ``step`` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total_steps <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if schedule == "cosine":
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return floor + (1 - floor) * (1 - progress)


def _image_data(recipe: Recipe, processor):
    """image-to-text: examples, report, the dataset/collator factories (images processed lazily)."""
    from bigtune.data import vlm
    from bigtune.data.images import ImageCaptionDataset, ImageCollator, TokenLayout, build_image_examples
    from bigtune.models.configs import resolve_config_name

    config = resolve_config_name(recipe.model)
    vlm.bound_image_pixels(processor, config, recipe.data.image_max_pixels, recipe.model.name)
    if vlm.is_vlm(config):  # Qwen2-VL, LLaVA, PaliGemma: the caption answers data.prompt beside the image
        layout = vlm.ChatImageLayout.for_model(processor, config, recipe.data.prompt)
        dataset = lambda items: vlm.ChatImageDataset(items, processor.image_processor, layout)  # noqa: E731
        collator = vlm.ChatImageCollator(layout)
    else:
        layout = TokenLayout.for_model(processor, config)
        dataset = lambda items: ImageCaptionDataset(items, processor.image_processor)  # noqa: E731
        collator = ImageCollator(layout)
    examples, report = build_image_examples(recipe.data, processor, layout, recipe.seed)
    return (
        examples,
        report,
        dataset,
        collator,
        (lambda cfg: build_image_examples(cfg, processor, layout, recipe.seed)),
    )


def total_steps(max_epochs: Optional[int], max_steps: Optional[int], steps_per_epoch: int) -> int:
    """Optimizer steps a run takes: max_steps alone sets the length (epochs repeat as needed), max_epochs
    alone or neither (one pass) counts passes, both stop at whichever comes first."""
    if max_epochs is None:
        return max_steps if max_steps is not None else steps_per_epoch
    by_epochs = steps_per_epoch * max_epochs
    return by_epochs if max_steps is None else min(by_epochs, max_steps)


def run_length(max_epochs: Optional[int], max_steps: Optional[int], steps_per_epoch: int) -> tuple[str, Optional[str]]:
    """(how the run's length reads, a notice or None). The notice says when train.max_epochs ends the run
    before train.max_steps is reached, which a user who set max_steps alone on a recipe with max_epochs
    would not expect; when max_steps comes first the description names it."""
    total = total_steps(max_epochs, max_steps, steps_per_epoch)
    per_epoch = f"{steps_per_epoch} step{'s' if steps_per_epoch != 1 else ''} an epoch"
    if max_epochs is None and max_steps is None:
        return f"{total} optimizer steps (one epoch: neither train.max_epochs nor train.max_steps is set)", None
    if max_epochs is None:
        return f"{total} optimizer steps (train.max_steps; {per_epoch})", None
    by_epochs = steps_per_epoch * max_epochs
    epochs = f"{max_epochs} epoch{'s' if max_epochs != 1 else ''} of {steps_per_epoch} steps"
    if max_steps is None or max_steps == by_epochs:
        return f"{total} optimizer steps ({epochs})", None
    if max_steps < by_epochs:
        return (
            f"{total} optimizer steps (train.max_steps={max_steps} ends the run after "
            f"{max_steps / steps_per_epoch:.3g} of train.max_epochs={max_epochs} epochs; {per_epoch})",
            None,
        )
    return f"{total} optimizer steps ({epochs})", (
        f"note: train.max_epochs={max_epochs} ends the run at step {by_epochs}, before train.max_steps={max_steps}; "
        f"raise train.max_epochs (or set it to null) to run {max_steps} steps"
    )


def _data(recipe: Recipe, tokenizer):
    """(examples, report, dataset class, collator, builder for another source) for the model's family."""
    if recipe.model.family == "image-to-text":
        return _image_data(recipe, tokenizer)
    if recipe.model.family == "sequence-classification":
        from bigtune.data.labels import classification_data

        return classification_data(recipe, tokenizer)
    examples, report = build_examples(recipe.data, tokenizer, recipe.seed)
    build_more = lambda cfg: build_examples(cfg, tokenizer, recipe.seed)  # noqa: E731
    # Sequence parallelism splits every batch's sequence evenly across the tensor-parallel ranks.
    multiple = recipe.tensor_parallel if recipe.sequence_parallel else 1
    return examples, report, ListDataset, Collator(tokenizer.pad_token_id, multiple), build_more


def _model_and_optimizer(recipe: Recipe, fabric, tokenizer, label_names):
    """(model, optimizer, the torch optimizer under it, parameter counts, base weights folder), set up by Fabric."""
    peft = recipe.peft.method != "none"
    quantized = recipe.model.quantize != "none"
    no_folder = recipe.model.name in PRESETS or recipe.model.init == "random"
    # An adapter run on a model without a folder keeps its initial weights, so export can merge into them.
    base_dir = (
        Path(tempfile.mkdtemp(prefix="bigtune-base-")) if peft and no_folder and recipe.checkpoint.save_model else None
    )
    from bigtune.engine.strategies import is_deepspeed, make_deepspeed_optimizer, zero_layout

    deepspeed = is_deepspeed(recipe)
    nf4 = quantized and quant_backend(recipe) == "torchao"
    zero3 = deepspeed and zero_layout(recipe.strategy)[0] == 3  # a 4-bit base then stores 16-bit elements
    # ZeRO-3's init context partitions parameters as they are created, which the model builder's
    # own weight handling does not expect: DeepSpeed models are built on the CPU and partitioned later.
    load_report = None
    if nf4:  # built with its adapters, sharded block by block as it loads
        model, base_dir, load_report = _nf4_model(recipe, fabric, tokenizer, base_dir, label_names)
    elif no_folder and not quantized and not deepspeed:
        # Random init straight on the device: a 7B model initialised on the CPU takes minutes.
        with fabric.init_module():
            model = build_model(recipe.model, tokenizer, recipe.precision, recipe.seed, base_dir, label_names, zero3)
    else:
        # A quantized random base is drawn on the GPU, written, and loaded back quantized (build_model).
        init = fabric.device if quantized and no_folder and fabric.device.type == "cuda" else None
        model = build_model(
            recipe.model, tokenizer, recipe.precision, recipe.seed, base_dir, label_names, zero3, init_device=init
        )
    if recipe.train.activation_checkpointing and not quantized:
        enable_activation_checkpointing(model)
    if peft and not nf4:
        model = apply_peft(
            model,
            recipe.peft,
            quantized,
            recipe.train.activation_checkpointing,
            recipe.model.family,
            upcast=recipe.model.upcast_unquantized,
        )
    if recipe.train.compile:
        # After checkpointing and adapters (the compiled graph includes both), before Fabric's setup: FSDP2
        # then shards the compiled blocks, the order torchtitan uses.
        blocks = compile_blocks(model)
        kinds = ", ".join(sorted({type(x).__name__ for x in blocks}))
        print(
            f"train.compile: {len(blocks)} blocks ({kinds}) compile on first use; the first steps are slow", flush=True
        )
    if recipe.pipeline_parallel > 1:  # built whole (the single process's weights), this rank's stage kept
        from bigtune.engine.pipeline import split_model

        model = split_model(recipe, fabric, model)
    params = count_parameters(model)
    if load_report is not None:
        params["nf4_load"] = load_report  # this rank's (the summary is rank 0's)
    if deepspeed:  # DeepSpeed wraps model and optimizer together, in one engine
        from bigtune.engine.strategies import deepspeed_config

        fabric.strategy.config.update(deepspeed_config(recipe, numel=params["total"]))  # buckets sized to the model
        raw_optimizer = make_deepspeed_optimizer(recipe, model)
        model, optimizer = fabric.setup(model, raw_optimizer)
    else:
        model = fabric.setup_module(model)
        optimizer = raw_optimizer = fabric.setup_optimizers(make_optimizer(recipe.optim, model, lr=recipe.lr))
    return model, optimizer, raw_optimizer, params, base_dir


def _nf4_model(recipe: Recipe, fabric, tokenizer, base_dir: Optional[Path], label_names):
    """(model, base_dir, load report): QLoRA on torchao NF4 weights, streamed from safetensors (models/nf4.py). A preset or
    random-init model is written to ``base_dir`` first (each rank the same seeded weights) and streamed back."""
    from bigtune.engine.strategies import shard_while_loading
    from bigtune.models.build import write_base
    from bigtune.models.nf4 import build_nf4_peft_model, weights_folder

    scratch = False  # a base written only to be streamed back, removed once loaded
    if recipe.model.name in PRESETS or recipe.model.init == "random":
        scratch = base_dir is None
        base_dir = base_dir or Path(tempfile.mkdtemp(prefix="bigtune-base-"))
        plain = dataclasses.replace(recipe.model, quantize="none")
        cuda = fabric.device.type == "cuda"
        whole = build_model(
            plain,
            tokenizer,
            recipe.precision,
            recipe.seed,
            None,
            label_names,
            init_device=fabric.device if cuda else None,
        )
        write_base(whole, tokenizer, base_dir)
        del whole
        if cuda:
            torch.cuda.empty_cache()  # the 16-bit weights' cache: the run's reserved is measured
        folder = base_dir
    else:
        folder = weights_folder(recipe.model)
    model, report = build_nf4_peft_model(
        recipe.model,
        recipe.peft,
        folder,
        recipe.precision,
        recipe.seed,
        recipe.train.activation_checkpointing,
        shard=shard_while_loading(recipe, fabric),
        quantize_on=fabric.device if fabric.device.type == "cuda" else None,
    )
    if scratch:
        shutil.rmtree(base_dir, ignore_errors=True)
        base_dir = None
    fabric.print(
        f"model: NF4 base (torchao) loaded tensor by tensor: {report['nf4_base_bytes_this_rank'] / 2**20:.2f} MiB "
        f"of 4-bit weights on this rank, peak host RSS {report['load_peak_rss_bytes'] / 2**30:.2f} GiB while loading"
    )
    return model, base_dir, report


def _train_loader(recipe: Recipe, fabric, examples, make_dataset, collator):
    """(sampler, loader, steps per epoch) for the training examples (packed or grouped as the recipe asks)."""
    if recipe.data.packing:
        examples = pack_examples(examples, recipe.data.max_seq_length, recipe.seed)
    from bigtune.engine.strategies import data_parallel

    dp_rank, dp_size = data_parallel(fabric)
    grouping = {}
    if recipe.data.group_by_length:
        grouping = {
            "lengths": [len(e.input_ids) for e in examples],
            "group_size": 50 * recipe.train.micro_batch_size * dp_size,
        }
    # The data-parallel rank: the ranks of one tensor-parallel group compute one model, so they read the same batches.
    sampler = EpochSampler(len(examples), recipe.seed, rank=dp_rank, world=dp_size, **grouping)
    loader = torch.utils.data.DataLoader(
        make_dataset(examples),
        batch_size=recipe.train.micro_batch_size,
        sampler=sampler,
        collate_fn=collator,
        num_workers=recipe.data.num_workers,
        pin_memory=fabric.device.type == "cuda",
        persistent_workers=False,
        # Its own generator: each new iterator draws a worker seed, which must not advance the global
        # RNG that dropout uses (a resumed run creates its iterator at a different point).
        generator=torch.Generator().manual_seed(recipe.seed),
    )
    micro = math.ceil(sampler.per_rank / recipe.train.micro_batch_size)
    if recipe.train.limit_train_batches is not None:
        micro = min(micro, recipe.train.limit_train_batches)
    return sampler, loader, micro, math.ceil(micro / recipe.accumulate)


def build(recipe: Recipe, fabric) -> Built:
    """Data, model, optimizer, loaders and schedule for one run, set up on ``fabric``."""
    tokenizer = load_tokenizer_or_processor(recipe.model)
    examples, report, make_dataset, collator, build_more = _data(recipe, tokenizer)
    seed_everything(recipe.seed)
    model, optimizer, raw_optimizer, params, base_dir = _model_and_optimizer(
        recipe, fabric, tokenizer, report.label_names
    )
    sampler, loader, micro, steps_per_epoch = _train_loader(recipe, fabric, examples, make_dataset, collator)
    total = total_steps(recipe.train.max_epochs, recipe.train.max_steps, steps_per_epoch)
    val_loader = None
    val_examples = report.val_examples
    if recipe.data.val_source:
        vcfg = dataclasses.replace(
            recipe.data,
            source=recipe.data.val_source,
            sources=[],  # a mixture's validation source is one source
            val_fraction=0.0,
            val_source=None,
            num_train_samples=None,
        )
        val_examples, vrep = build_more(vcfg)
        report.validation = len(val_examples)
    if val_examples:
        val_loader = torch.utils.data.DataLoader(
            make_dataset(val_examples),
            batch_size=recipe.eval.batch_size or recipe.train.micro_batch_size,
            shuffle=False,
            collate_fn=collator,
            num_workers=recipe.data.num_workers,
        )
    o = recipe.optim
    # On the torch optimizer itself: DeepSpeed's wrapper is no torch Optimizer but shares its param_groups.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        raw_optimizer, lambda s: lr_factor(s, total, o.warmup_steps, o.schedule, o.min_lr_ratio)
    )
    weights = (
        torch.tensor(recipe.data.class_weights, dtype=torch.float32, device=fabric.device)
        if recipe.data.class_weights
        else None
    )
    return Built(
        recipe,
        fabric,
        tokenizer,
        model,
        optimizer,
        scheduler,
        loader,
        sampler,
        report,
        steps_per_epoch,
        total,
        micro,
        params,
        base_dir,
        val_loader,
        weights,
        pipeline=PipelineRunner(recipe, fabric, model) if recipe.pipeline_parallel > 1 else None,
    )
