"""The training engine: setup (Fabric), build (model, data, optimizer), fit (the loop).

``train(recipe)`` is the whole thing and returns the run's summary (also written to
summary.json). Problems found before training (recipe, data, model) raise and write nothing;
an out-of-memory during training is a *result*: summary.json says ``status: oom`` with the step
and phase where it happened, the last memory snapshot and what to change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from bigtune import memory as mem
from bigtune.data import Collator, DataReport, EpochSampler, ListDataset, build_examples, pack_examples
from bigtune.models import apply_peft, build_model, compile_blocks, count_parameters, \
    enable_activation_checkpointing, forward_inputs, hidden_states_out, load_tokenizer_or_processor, \
    plain_output_head, shifts_labels
from bigtune.optim import make_optimizer
from bigtune.presets import PRESETS
from bigtune.recipe import Recipe, load_recipe, resolve_accelerator
from bigtune.rundir import RunDir, pick_run_dir
from bigtune.stepmath import GIB, IGNORE_INDEX, causal_lm_loss_sum, causal_pairs, chunked_lm_loss_sum, flop_shape, \
    human_bytes, loss_normaliser, mfu, target_token_count, throughput, training_flops

EXIT_ERROR, EXIT_BAD_INPUT, EXIT_OOM = 1, 2, 3


class TrainingOOM(RuntimeError):
    """Raised by ``train(..., raise_on_oom=True)``; ``summary`` holds the recorded result."""

    def __init__(self, summary: dict):
        self.summary = summary
        oom = summary.get("oom", {})
        super().__init__(f"out of memory at step {oom.get('step')} during {oom.get('phase')}")


# -- setup ------------------------------------------------------------------------------------------

def setup_fabric(recipe: Recipe):
    from lightning.fabric import Fabric

    from bigtune.dist import is_deepspeed, make_strategy

    accel = resolve_accelerator(recipe)
    fabric = Fabric(accelerator=accel, devices=recipe.devices, num_nodes=recipe.num_nodes,
                    precision=recipe.precision, strategy=make_strategy(recipe, accel))
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


# -- build ------------------------------------------------------------------------------------------

@dataclass
class Built:
    recipe: Recipe
    fabric: Any
    tokenizer: Any
    model: Any
    optimizer: Any
    scheduler: Any
    loader: Any
    sampler: EpochSampler
    data_report: DataReport
    steps_per_epoch: int
    total_steps: int
    micro_batches_per_epoch: int
    params: dict = field(default_factory=dict)
    base_dir: Optional[Path] = None      # initial weights of a preset/random model under adapters
    val_loader: Any = None               # the held-out split, when there is one
    class_weights: Optional[torch.Tensor] = None  # sequence-classification: per-class loss weights


def _image_data(recipe: Recipe, processor):
    """image-to-text: examples, report, the dataset/collator factories (images processed lazily)."""
    from bigtune.imagedata import ImageCaptionDataset, ImageCollator, TokenLayout, build_image_examples
    from bigtune.planner import resolve_config_name

    layout = TokenLayout.for_model(processor, resolve_config_name(recipe.model))
    examples, report = build_image_examples(recipe.data, processor, layout, recipe.seed)
    return examples, report, (lambda items: ImageCaptionDataset(items, processor.image_processor)), \
        ImageCollator(layout), \
        (lambda cfg: build_image_examples(cfg, processor, layout, recipe.seed))


def build(recipe: Recipe, fabric) -> Built:
    image = recipe.model.family == "image-to-text"
    tokenizer = load_tokenizer_or_processor(recipe.model)
    if image:
        examples, report, make_dataset, collator, build_more = _image_data(recipe, tokenizer)
    elif recipe.model.family == "sequence-classification":
        from bigtune.classify import classification_data

        examples, report, make_dataset, collator, build_more = classification_data(recipe, tokenizer)
    else:
        examples, report = build_examples(recipe.data, tokenizer, recipe.seed)
        make_dataset, collator = ListDataset, Collator(tokenizer.pad_token_id)
        build_more = lambda cfg: build_examples(cfg, tokenizer, recipe.seed)  # noqa: E731
    seed_everything(recipe.seed)
    peft = recipe.peft.method != "none"
    quantized = recipe.model.quantize != "none"
    no_folder = recipe.model.name in PRESETS or recipe.model.init == "random"
    # An adapter run on a model without a folder keeps its initial weights, so export can merge into them.
    base_dir = Path(tempfile.mkdtemp(prefix="bigtune-base-")) if peft and no_folder and \
        recipe.checkpoint.save_model else None
    from bigtune.dist import is_deepspeed, make_deepspeed_optimizer

    deepspeed = is_deepspeed(recipe)
    # ZeRO-3's init context partitions parameters as they are created, which the model builder's
    # own weight handling does not expect: DeepSpeed models are built on the CPU and partitioned later.
    if no_folder and not quantized and not deepspeed:
        # Random init straight on the device: a 7B model initialised on the CPU takes minutes.
        with fabric.init_module():
            model = build_model(recipe.model, tokenizer, recipe.precision, recipe.seed, base_dir,
                                report.label_names)
    else:
        model = build_model(recipe.model, tokenizer, recipe.precision, recipe.seed, base_dir, report.label_names)
    if recipe.train.activation_checkpointing and not quantized:
        enable_activation_checkpointing(model)
    if peft:
        model = apply_peft(model, recipe.peft, quantized, recipe.train.activation_checkpointing, recipe.model.family,
                           upcast=recipe.model.upcast_unquantized)
    if recipe.train.compile:
        # After checkpointing and adapters (the compiled graph includes both), before Fabric's setup: FSDP2
        # then shards the compiled blocks, the order torchtitan uses.
        blocks = compile_blocks(model)
        kinds = ", ".join(sorted({type(x).__name__ for x in blocks}))
        print(f"train.compile: {len(blocks)} blocks ({kinds}) compile on first use; the first steps are slow",
              flush=True)
    params = count_parameters(model)
    if deepspeed:  # DeepSpeed wraps model and optimizer together, in one engine
        from bigtune.dist import deepspeed_config

        fabric.strategy.config.update(deepspeed_config(recipe, numel=params["total"]))  # buckets sized to the model
        raw_optimizer = make_deepspeed_optimizer(recipe, model)
        model, optimizer = fabric.setup(model, raw_optimizer)
    else:
        model = fabric.setup_module(model)
        optimizer = raw_optimizer = fabric.setup_optimizers(make_optimizer(recipe.optim, model, lr=recipe.lr))

    if recipe.data.packing:
        examples = pack_examples(examples, recipe.data.max_seq_length, recipe.seed)
    grouping = {}
    if recipe.data.group_by_length:
        grouping = {"lengths": [len(e.input_ids) for e in examples],
                    "group_size": 50 * recipe.train.micro_batch_size * fabric.world_size}
    sampler = EpochSampler(len(examples), recipe.seed, rank=fabric.global_rank, world=fabric.world_size, **grouping)
    loader = torch.utils.data.DataLoader(
        make_dataset(examples), batch_size=recipe.train.micro_batch_size, sampler=sampler,
        collate_fn=collator, num_workers=recipe.data.num_workers,
        pin_memory=fabric.device.type == "cuda", persistent_workers=False,
        # Its own generator: each new iterator draws a worker seed, which must not advance the global
        # RNG that dropout uses (a resumed run creates its iterator at a different point).
        generator=torch.Generator().manual_seed(recipe.seed))
    micro = math.ceil(sampler.per_rank / recipe.train.micro_batch_size)
    if recipe.train.limit_train_batches is not None:
        micro = min(micro, recipe.train.limit_train_batches)
    steps_per_epoch = math.ceil(micro / recipe.accumulate)
    total = steps_per_epoch * recipe.train.max_epochs if recipe.train.max_epochs else recipe.train.max_steps
    if recipe.train.max_steps is not None:
        total = min(total, recipe.train.max_steps)
    val_loader = None
    val_examples = report.val_examples
    if recipe.data.val_source:
        vcfg = dataclasses.replace(recipe.data, source=recipe.data.val_source, val_fraction=0.0, val_source=None,
                                   num_train_samples=None)
        val_examples, vrep = build_more(vcfg)
        report.validation = len(val_examples)
    if val_examples:
        val_loader = torch.utils.data.DataLoader(
            make_dataset(val_examples), batch_size=recipe.eval.batch_size or recipe.train.micro_batch_size,
            shuffle=False, collate_fn=collator, num_workers=recipe.data.num_workers)
    o = recipe.optim
    # On the torch optimizer itself: DeepSpeed's wrapper is no torch Optimizer but shares its param_groups.
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        raw_optimizer, lambda s: lr_factor(s, total, o.warmup_steps, o.schedule, o.min_lr_ratio))
    weights = torch.tensor(recipe.data.class_weights, dtype=torch.float32, device=fabric.device) \
        if recipe.data.class_weights else None
    return Built(recipe, fabric, tokenizer, model, optimizer, scheduler, loader, sampler, report,
                 steps_per_epoch, total, micro, params, base_dir, val_loader, weights)


# -- the loop ---------------------------------------------------------------------------------------

class Progress:
    """An ETA line on a terminal, plain lines otherwise (logs, notebooks, CI)."""

    def __init__(self, total: int):
        self.total = total
        self.tty = sys.stdout.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, text: str, newline: bool) -> None:
        done = step / max(1, self.total)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (1 - done) if done > 0 else float("nan")
        line = f"step {step}/{self.total} [{done:5.1%}] {text} eta {eta:5.0f}s"
        if self.tty:
            print("\r" + line.ljust(110), end="\n" if newline else "", flush=True)
        elif newline:
            print(line, flush=True)


@dataclass
class LoopState:
    step: int = 0                        # optimizer steps done
    tokens: int = 0                      # non-padding tokens trained on
    samples: int = 0
    train_seconds: float = 0.0
    phase: str = "setup"
    losses: list = field(default_factory=list)
    epoch_loss_sum: float = 0.0
    epoch_loss_steps: int = 0
    best_val_loss: Optional[float] = None
    best_score: Optional[float] = None   # eval.best_metric's best value so far (what keep_best goes by)
    last_eval_step: Optional[int] = None


def train_step(b: Built, batches: list[dict], monitor: Optional[mem.MemoryMonitor], measure: bool,
               state: LoopState, token_count: Optional[int] = None) -> tuple[torch.Tensor, list[mem.Snapshot]]:
    """One optimizer step over ``batches`` (the micro-batches of one accumulation window).

    ``token_count`` is the window's target-token count when the caller knows it (counted across
    ranks, or outside the planner's fake tensors); otherwise it is counted here.
    """
    from bigtune.dist import backward_kwargs, clips_itself, micro_batch_context

    fabric, model, opt = b.fabric, b.model, b.optimizer
    shift = shifts_labels(model)
    if token_count is None and fabric.world_size > 1:
        from bigtune.dist import all_sum

        # Every rank divides by the token count of the whole global batch (DDP/FSDP then average).
        token_count = int(all_sum(fabric, sum(int(target_token_count(x["labels"], shift)) for x in batches)))
    scale = loss_normaliser([x["labels"] for x in batches], world_size=fabric.world_size,
                            global_token_count=token_count, shift=shift)
    snaps: list[mem.Snapshot] = []
    track = monitor is not None and (measure or monitor.cap_bytes is not None and not monitor.is_cuda)
    loss_total = torch.zeros((), device=fabric.device)
    head = chunked_loss_head(b.recipe, model)
    # Lightning Trainer's order (optim.zero_grad=before_backward): the last step's gradients live through
    # this window's first forward and are freed just before its backward.
    late_zero = b.recipe.optim.zero_grad == "before_backward"
    for i, batch in enumerate(batches):
        last = i == len(batches) - 1
        padded = batch.get("padded", True)
        batch = {k: v.to(fabric.device, non_blocking=True) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        if track and i == 0:
            monitor.begin_step(model, opt, extra=batch.values())
        if measure and i == 0:
            snaps.append(monitor.snapshot(state.step, "before_forward", model, opt))
        with micro_batch_context(fabric, model, last, b.recipe.fsdp_grad_sync):
            state.phase = "forward"
            with hidden_states_out(head):
                logits = model(**forward_inputs(batch, padded)).logits  # the hidden states when chunking
            if head is not None:
                with fabric.autocast():  # the output layer computes as it would inside the forward
                    loss = chunked_lm_loss_sum(logits, head.weight, batch["labels"],
                                               b.recipe.train.loss_chunk_tokens, shift) * scale
            else:
                loss = causal_lm_loss_sum(logits, batch["labels"], shift, getattr(b, "class_weights", None)) * scale
            # Backward needs the loss's saved tensors, not the logits: holding them through backward
            # would add tokens × vocab × bytes to the step's peak.
            del logits
            if measure and last:
                snaps.append(monitor.snapshot(state.step, "after_forward", model, opt))
            if late_zero and i == 0:
                opt.zero_grad(set_to_none=True)
            state.phase = "backward"
            fabric.backward(loss, **backward_kwargs(fabric))
        loss_total += loss.detach()
        del loss
    if measure:
        snaps.append(monitor.snapshot(state.step, "after_backward", model, opt))
    state.phase = "optimizer"
    if b.recipe.optim.grad_clip is not None and not clips_itself(fabric):
        # error_if_nonfinite would sync with the host every step; a non-finite loss is caught at logging.
        fabric.clip_gradients(model, opt, max_norm=b.recipe.optim.grad_clip, error_if_nonfinite=False)
    opt.step()
    b.scheduler.step()
    if measure:
        snaps.append(monitor.snapshot(state.step, "after_optimizer", model, opt))
    if not late_zero:
        opt.zero_grad(set_to_none=True)
    if track:
        monitor.end_step()
    return loss_total, snaps


def batch_tokens(batch: dict) -> int:
    """Tokens a batch trains on, in data.max_seq_length's unit (what the planner's tokens/s counts): the
    real input tokens of a text batch; the caption tokens of an image-to-text batch (its labels), not the
    image tokens ahead of an OPT caption nor a T5 encoder's fixed input."""
    if "pixel_values" in batch:
        return int((batch["labels"] != IGNORE_INDEX).sum())
    return int(batch["attention_mask"].sum())


def _text_shape(batch: dict) -> list[int]:
    """[micro batch, text tokens] as the recipe counts them (data.max_seq_length): image-to-text
    batches of a decoder-only model put the image tokens (labelled -100) ahead of the caption."""
    if batch["labels"].dim() < 2:  # a classifier: one label per sample
        return [int(x) for x in batch["input_ids"].shape]
    b, n = batch["labels"].shape[:2]
    if "pixel_values" in batch and "decoder_input_ids" not in batch:
        n -= int((batch["labels"][0] == IGNORE_INDEX).sum()) - int((batch["attention_mask"][0] == 0).sum())
    return [int(b), int(n)]


def chunked_loss_head(r: Recipe, model) -> Optional[torch.nn.Linear]:
    """The output layer to compute the loss from in chunks, or None for the plain loss (chunking off,
    or a model/strategy it does not apply to: see train.loss_chunk_tokens)."""
    if not r.train.loss_chunk_tokens or r.strategy == "fsdp" or r.strategy.startswith("deepspeed") \
            or r.model.family != "causal-lm":
        return None
    return plain_output_head(model)


def windows(b: Built, epoch: int, first_window: int):
    """Yield lists of micro-batches (one list per optimizer step) for ``epoch``, from ``first_window``."""
    k = b.recipe.accumulate
    b.sampler.set_epoch(epoch, first_window * k * b.recipe.train.micro_batch_size)
    it = iter(b.loader)
    for w in range(first_window, b.steps_per_epoch):
        n = min(k, b.micro_batches_per_epoch - w * k)
        batches = [batch for _, batch in zip(range(n), it)]
        if not batches:
            return
        yield batches


def fit(b: Built, run: RunDir, state: LoopState, monitor: Optional[mem.MemoryMonitor], peak_flops: Optional[float]):
    r = b.recipe
    progress = Progress(b.total_steps)
    shape_for_flops = None
    window_flops = 0.0
    loss_acc = torch.zeros((), device=b.fabric.device)
    window_tokens = window_samples = 0
    window_t0 = time.perf_counter()
    window_steps = 0
    start_epoch, first_window = divmod(state.step, b.steps_per_epoch)
    for epoch in range(start_epoch, math.ceil(b.total_steps / b.steps_per_epoch)):
        for batches in windows(b, epoch, first_window if epoch == start_epoch else 0):
            measure = monitor is not None and r.memory.enabled and (
                state.step in (0, 1) or state.step % r.memory.every_steps == 0)
            loss, snaps = train_step(b, batches, monitor, measure, state)
            shape = _text_shape(batches[0])
            # Packed rows attend through an explicit block mask, as padded batches do (for the planner).
            padded = any(x.get("padded", True) or x.get("packed", False) for x in batches)
            if snaps:
                per_rank = mem.gather_snapshots(b.fabric, snaps)
                for rank, rank_snaps in enumerate(per_rank):
                    for s in rank_snaps:
                        run.append_jsonl("memory.jsonl", {**s.to_dict(), "rank": rank, "batch_shape": shape,
                                                          "padded": padded})
                print(mem.format_table(snaps, _capacity(b.fabric.device, r)), flush=True)
                if len(per_rank) > 1:
                    print(mem.format_rank_spread(per_rank), flush=True)
            # Counted on the host-side batch (still on the CPU): no device sync.
            tokens = sum(batch_tokens(x) for x in batches)  # this rank's; summed at logging
            # Equal shares per rank; a packed row holds several samples.
            samples = sum(x.get("samples", x["input_ids"].shape[0]) for x in batches) * b.fabric.world_size
            if shape_for_flops is None:
                shape_for_flops = flop_shape(b.model) or False
            if shape_for_flops:
                window_flops += sum(training_flops(shape_for_flops, int(x["attention_mask"].sum()),
                                                   causal_pairs(x["attention_mask"], x.get("position_ids")))
                                    for x in batches)
            state.tokens += tokens
            state.samples += samples
            window_tokens += tokens
            window_samples += samples
            loss_acc += loss
            state.step += 1
            window_steps += 1
            if state.step % r.train.log_every_steps == 0 or state.step == b.total_steps:
                mean_loss = (loss_acc / window_steps).item()  # the only host sync, once per log window
                if b.fabric.world_size > 1:
                    from bigtune.dist import all_sum

                    mean_loss = all_sum(b.fabric, mean_loss) / b.fabric.world_size
                    global_tokens = int(all_sum(b.fabric, window_tokens))
                    state.tokens += global_tokens - window_tokens
                    window_tokens = global_tokens
                if not math.isfinite(mean_loss):
                    raise FloatingPointError(
                        f"loss became {mean_loss} by step {state.step}: lower optim.lr, set optim.grad_clip, or use "
                        "bf16 instead of fp16 precision")
                dt = time.perf_counter() - window_t0
                state.train_seconds += dt
                tp = throughput(window_tokens, window_samples, dt)
                rec = {"step": state.step, "epoch": epoch, "loss": mean_loss, "lr": b.scheduler.get_last_lr()[0],
                       "step_time_s": dt / window_steps, **tp,
                       "model_flops_per_s": window_flops / dt, "mfu": mfu(window_flops / dt, peak_flops),
                       "tokens": state.tokens}
                run.append_jsonl("metrics.jsonl", rec)
                run.append_csv("metrics.csv", rec)
                _tensorboard(run, rec)
                state.losses.append(mean_loss)
                state.epoch_loss_sum += mean_loss * window_steps
                state.epoch_loss_steps += window_steps
                progress.update(state.step, f"loss {mean_loss:.4f} lr {rec['lr']:.2e} "
                                f"{tp['tokens_per_s']:,.0f} tok/s", newline=True)
                loss_acc.zero_()
                window_tokens = window_samples = window_steps = 0
                window_flops = 0.0
                window_t0 = time.perf_counter()
            elif progress.tty:
                progress.update(state.step, "", newline=False)
            if b.val_loader is not None and r.eval.every_steps and state.step % r.eval.every_steps == 0:
                run_eval(b, run, state, monitor, epoch)
            if r.checkpoint.enabled and r.checkpoint.every_steps and state.step % r.checkpoint.every_steps == 0:
                save_checkpoint(b, run, state)
            if _stop_requested(b.fabric):
                raise Preempted(state.step)
            if state.step >= b.total_steps:
                break
        if state.epoch_loss_steps:
            print(f"epoch {epoch}: average train loss {state.epoch_loss_sum / state.epoch_loss_steps:.4f}", flush=True)
        state.epoch_loss_sum, state.epoch_loss_steps = 0.0, 0
        if state.step >= b.total_steps:
            break
    if r.optim.zero_grad == "before_backward":  # the last step's gradients are still held: not for what follows
        b.optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def evaluate(b: Built, monitor: Optional[mem.MemoryMonitor]) -> dict:
    """Token-weighted mean loss over the validation split, under the training precision.

    Its memory peak is measured on its own (not mixed into the training step's figures).
    """
    model, fabric = b.model, b.fabric
    was_training = model.training
    model.eval()
    if monitor is not None:
        monitor.begin_step(model, b.optimizer)
    loss_sum = torch.zeros((), device=fabric.device, dtype=torch.float64)
    tokens = 0
    classify = b.recipe.model.family == "sequence-classification"
    preds, golds = [], []
    try:
        for i, batch in enumerate(b.val_loader):
            if b.recipe.eval.max_batches is not None and i >= b.recipe.eval.max_batches:
                break
            padded = batch.get("padded", True)
            batch = {k: v.to(fabric.device) for k, v in batch.items() if isinstance(v, torch.Tensor)}
            shift = shifts_labels(model)
            logits = model(**forward_inputs(batch, padded)).logits
            loss_sum += causal_lm_loss_sum(logits, batch["labels"], shift).double()
            tokens += int(target_token_count(batch["labels"], shift))
            if classify:
                preds.append(logits.argmax(-1).cpu())
                golds.append(batch["labels"].cpu())
            del logits
        peak = None
        if monitor is not None:
            peak = monitor.snapshot(-1, "eval", model, b.optimizer).peak_allocated
    finally:
        if monitor is not None:
            monitor.end_step()
        model.train(was_training)
    loss = float(loss_sum) / max(tokens, 1)
    out = {"val_loss": loss, "val_perplexity": math.exp(min(loss, 50.0)), "val_tokens": tokens,
           "eval_peak_allocated": peak}
    if classify and golds:
        from bigtune.metrics import classification_metrics

        m = classification_metrics(torch.cat(golds).tolist(), torch.cat(preds).tolist(),
                                   b.data_report.label_names)
        out.update({k: m[k] for k in ("accuracy", "macro_f1", "f1_per_class", "confusion_matrix")})
    return out


def is_better(metric: str, value: float, best: Optional[float]) -> bool:
    """eval.best_metric: val_loss improves downwards, accuracy / macro_f1 upwards."""
    if best is None:
        return True
    return value < best if metric == "val_loss" else value > best


def run_eval(b: Built, run: RunDir, state: LoopState, monitor, epoch: int) -> dict:
    res = evaluate(b, monitor)
    state.last_eval_step = state.step
    rec = {"step": state.step, "epoch": epoch, "split": "val", **res}
    run.append_jsonl("eval.jsonl", rec)
    _tensorboard(run, {"step": state.step, **{(k if k.startswith("val_") else f"val_{k}"): v
                                              for k, v in res.items() if k.startswith("val_") or
                                              k in ("accuracy", "macro_f1")}})
    metric = b.recipe.eval.best_metric
    best = is_better(metric, res[metric], state.best_score)
    if state.best_val_loss is None or res["val_loss"] < state.best_val_loss:
        state.best_val_loss = res["val_loss"]
    task = f" accuracy {res['accuracy']:.4f} macro-F1 {res['macro_f1']:.4f}" if "accuracy" in res else ""
    print(f"eval at step {state.step}: val_loss {res['val_loss']:.4f} perplexity {res['val_perplexity']:.2f}{task}"
          + (f" (best {metric})" if best else ""), flush=True)
    if best:
        state.best_score = res[metric]
        if b.recipe.eval.keep_best and b.recipe.checkpoint.save_model:
            save_hf_model(b, run, dest_name="best", keep_base=False)
            run.write_json("best.json", {"step": state.step, **res})
    return res


class Preempted(Exception):
    """SIGTERM arrived (Slurm preemption or time limit): checkpoint written, run can be resumed."""

    def __init__(self, step: int):
        self.step = step
        super().__init__(f"stopped by SIGTERM after step {step}")


_STOP = {"requested": False}


def _on_sigterm(signum, frame) -> None:
    _STOP["requested"] = True  # acted on between steps, where a checkpoint is consistent


def _stop_requested(fabric) -> bool:
    flag = _STOP["requested"]
    if fabric.world_size > 1:
        from bigtune.dist import all_sum

        flag = all_sum(fabric, float(flag)) > 0  # every rank stops at the same step
    return flag


_TB: dict[str, Any] = {}


def _tensorboard(run: RunDir, rec: dict) -> None:
    """Metrics to TensorBoard when it is installed (JSONL/CSV are always written)."""
    key = str(run.path)
    if key not in _TB:
        try:
            from torch.utils.tensorboard import SummaryWriter

            _TB[key] = SummaryWriter(str(run.path / "tensorboard"))
        except Exception:  # tensorboard not installed: skip silently, JSONL/CSV have everything
            _TB[key] = None
    w = _TB[key]
    if w is not None:
        for k, v in rec.items():
            if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                w.add_scalar(f"train/{k}", v, rec["step"])
        w.flush()


def _capacity(device: torch.device, r: Recipe) -> Optional[int]:
    if r.memory.cap_gib is not None:
        return int(r.memory.cap_gib * GIB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


# -- checkpoints ------------------------------------------------------------------------------------

def save_checkpoint(b: Built, run: RunDir, state: LoopState) -> Path:
    from bigtune.dist import is_deepspeed

    path = run.checkpoint_path(state.step)
    tmp = path.with_name(path.name + ".tmp")
    payload = {"model": b.model, "optimizer": b.optimizer, "scheduler": b.scheduler,
               "loop": {"step": state.step, "tokens": state.tokens, "samples": state.samples,
                        "train_seconds": state.train_seconds, "losses": list(state.losses),
                        "best_val_loss": state.best_val_loss, "best_score": state.best_score},
               "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                       "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}}
    trainable = {n for n, p in b.model.module.named_parameters() if p.requires_grad}
    # Adapter runs checkpoint only what trains: the frozen base is reloaded from its source on resume.
    only_trainable = {"model": lambda name, _: name in trainable} if b.recipe.peft.method != "none" else None
    if is_deepspeed(b.recipe):
        only_trainable = None  # DeepSpeed filters itself (exclude_frozen_parameters) and refuses a filter
    b.fabric.save(tmp, payload, filter=only_trainable)  # every rank takes part (FSDP writes shards)
    if b.fabric.global_rank == 0:
        os.replace(tmp, path)
    b.fabric.barrier()
    run.prune_checkpoints(b.recipe.checkpoint.keep_last)
    return path


def load_checkpoint(b: Built, path: Path, state: LoopState) -> None:
    payload = {"model": b.model, "optimizer": b.optimizer, "scheduler": b.scheduler}
    rest = b.fabric.load(path, payload, strict=b.recipe.peft.method == "none", weights_only=True)
    # Fabric's sharded (FSDP2) load restores only the model and optimizer itself: anything else in
    # `payload` is replaced by its saved state dict and left for the caller. The scheduler (warmup
    # position) must then be restored here, or the lr restarts from step 0 one step after resume.
    if isinstance(payload["scheduler"], dict):
        b.scheduler.load_state_dict(payload["scheduler"])
    loop = rest["loop"]
    state.step, state.tokens, state.samples = loop["step"], loop["tokens"], loop["samples"]
    state.train_seconds, state.losses = loop["train_seconds"], list(loop["losses"])
    state.best_val_loss = loop.get("best_val_loss")
    state.best_score = loop.get("best_score", state.best_val_loss)
    torch.set_rng_state(rest["rng"]["torch"])
    random.setstate(_as_tuple(rest["rng"]["python"]))
    if rest["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rest["rng"]["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def find_resume_checkpoint(resume: str | Path) -> tuple[Path, Path]:
    """(run dir, checkpoint) from a run dir (its newest checkpoint) or a checkpoint path."""
    p = Path(resume)
    if p.is_file() or p.suffix == ".ckpt":
        if not p.exists():
            raise FileNotFoundError(f"--resume: checkpoint {p} does not exist")
        return p.parent.parent, p
    if not p.is_dir():
        raise FileNotFoundError(f"--resume: {p} is neither a run directory nor a checkpoint")
    ckpts = RunDir(p).list_checkpoints()
    if not ckpts:
        raise FileNotFoundError(f"--resume: {p} has no checkpoints (train with checkpoint.enabled=true and "
                                "checkpoint.every_steps=N to make some)")
    return p, ckpts[-1]


# -- the whole run ----------------------------------------------------------------------------------

def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__}
    for mod in ("transformers", "lightning", "peft", "datasets"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:
            out[mod] = "not installed"
    return out


def device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": props.name, "memory_bytes": props.total_memory, "count": 1}
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "count": 1}


def gpu_peak_flops(device: torch.device, precision: str) -> Optional[float]:
    if device.type != "cuda":
        return None
    try:
        from bigtune.gpus import detect_gpu, peak_flops
    except ImportError:
        return None
    props = torch.cuda.get_device_properties(device)
    gpu = detect_gpu(props.name, props.total_memory)
    if gpu is None:
        return None
    return peak_flops(gpu, precision, allow_tf32=torch.backends.cuda.matmul.allow_tf32)


def oom_advice(r: Recipe) -> list[str]:
    """What usually frees the most memory for this recipe, most effective first."""
    out = []
    if r.strategy == "fsdp" and r.fsdp_wrap == "none" and r.world_size > 1:
        out.append("fsdp_wrap=block (one FSDP unit per decoder block: the whole model is no longer gathered at "
                   "once, nor every gradient held unsharded until the backward ends)")
    if r.strategy == "fsdp" and r.fsdp_grad_sync == "step" and r.accumulate > 1:
        out.append("fsdp_grad_sync=micro_batch (gradients reduce-scattered after every micro-batch: each rank keeps "
                   "only its shard, not every unsharded gradient through the window)")
    if r.train.micro_batch_size > 1:
        half = max(1, r.train.micro_batch_size // 2)
        if r.optim.in_backward:  # it cannot accumulate: the global batch shrinks with it
            out.append(f"train.micro_batch_size={half} (roughly half the activations; optim.in_backward cannot "
                       "accumulate, so the batch halves too)")
        else:
            out.append(f"train.micro_batch_size={half} with train.accumulate_grad_batches={r.accumulate * 2} "
                       "(same global batch, roughly half the activations)")
    if not r.train.activation_checkpointing:
        out.append("train.activation_checkpointing=true (activations drop to about one layer input per layer)")
    if r.precision in ("32-true", "bf16-mixed", "16-mixed"):
        out.append("precision=bf16-true (halves parameters, gradients and optimizer state)")
    if r.optim.name == "adamw":
        out.append("optim.name=sgd (no optimizer state; expect slower convergence)")
    if not r.optim.in_backward and r.world_size == 1 and r.optim.name in ("adamw", "sgd", "adamw8bit", "adam8bit"):
        out.append("optim.in_backward=true (each weight steps inside the backward: no full set of gradients; needs "
                   "train.accumulate_grad_batches=1 and optim.grad_clip=null)")
    return out


def train(recipe: Recipe | dict | str | Path | None = None, overrides: list[str] | dict | None = None,
          resume: str | Path | None = None, raise_on_oom: bool = False, quiet_recipe: bool = False,
          reuse_dir: bool = False) -> dict:
    """Train one recipe; return the summary dict (also in <run>/summary.json).

    ``recipe`` is a Recipe, a dict, a YAML path or None (the built-in demo). ``resume`` is a run
    directory or checkpoint. Bad input raises (RecipeError, DataError, ModelError) before anything is
    written; an out-of-memory returns a summary with status "oom" (or raises TrainingOOM).
    """
    t_start = time.perf_counter()
    r = load_recipe(recipe, overrides)
    resume_ckpt = None
    if resume is not None:
        run_path, resume_ckpt = find_resume_checkpoint(resume)
    elif reuse_dir and r.output_dir:
        run_path = Path(r.output_dir)  # a requeued job starts over in its own folder
    else:
        run_path = pick_run_dir(r.output_dir, r.name)
    fabric = setup_fabric(r)
    if fabric.world_size > 1:
        run_path = Path(fabric.broadcast(str(run_path), src=0))  # every rank uses rank 0's choice
    # Only rank 0 talks; the other ranks' prints would repeat it.
    quiet = contextlib.redirect_stdout(io.StringIO()) if fabric.global_rank != 0 else contextlib.nullcontext()
    with quiet:
        return _train(r, fabric, run_path, resume_ckpt, t_start, raise_on_oom, quiet_recipe)


def _train(r: Recipe, fabric, run_path: Path, resume_ckpt: Optional[Path], t_start: float, raise_on_oom: bool,
           quiet_recipe: bool) -> dict:
    if not quiet_recipe:
        print("# resolved recipe\n" + r.to_yaml().rstrip(), flush=True)
    b = build(r, fabric)  # raises on bad data/model before the run dir exists
    for line in b.data_report.lines():
        print(line, flush=True)
    if r.data.packing:
        print(f"data.packing: {b.data_report.used} samples in {b.sampler.n} rows of up to {r.data.max_seq_length} "
              "tokens (train.micro_batch_size counts rows)", flush=True)
    print(f"model: {r.model.name}: {b.params['total']:,} parameters ({b.params['trainable']:,} trainable), "
          f"precision {r.precision}, device {fabric.device}; {b.total_steps} optimizer steps of "
          f"{r.global_batch_size} samples ({r.train.micro_batch_size} × {r.accumulate} accumulation)", flush=True)
    if r.optim.lr_scaling != "none":
        print(f"lr: {r.lr:.3g} = optim.lr {r.optim.lr:.3g} scaled {r.optim.lr_scaling} with {r.world_size} "
              f"data-parallel ranks (optim.lr_scaling)", flush=True)
    from bigtune.dist import MEMORY_NOTE_DEEPSPEED, is_deepspeed

    if is_deepspeed(r) and r.memory.enabled:
        print(MEMORY_NOTE_DEEPSPEED, flush=True)
    if r.train.compile and r.memory.enabled and fabric.device.type == "cpu":
        print("memory: measured steps (0, 1, every memory.every_steps) run the compiled blocks eager, since the CPU "
              "tracker cannot see inside compiled code: their table is the eager step's memory, exact, and their "
              "step time is eager too", flush=True)

    rank0 = fabric.global_rank == 0
    prediction = predict_for_device(r, fabric.device, fabric.world_size) if r.memory.plan and rank0 else None

    run = RunDir(run_path, writer=rank0)
    run.create()
    run.write_text("recipe.yaml", r.to_yaml())
    state = LoopState()
    if resume_ckpt is not None:
        load_checkpoint(b, resume_ckpt, state)
        # Records past the checkpoint belong to the interrupted attempt; this run writes them again.
        run.truncate_jsonl("metrics.jsonl", lambda rec: rec["step"] <= state.step)
        run.truncate_jsonl("memory.jsonl", lambda rec: rec["step"] < state.step)
        run.truncate_jsonl("eval.jsonl", lambda rec: rec["step"] <= state.step)
        print(f"resumed from {resume_ckpt} at step {state.step}", flush=True)
    print(f"run dir: {run.path}", flush=True)

    cap = int(r.memory.cap_gib * GIB) if r.memory.cap_gib is not None else None
    monitor = mem.MemoryMonitor(fabric.device, cap) if (r.memory.enabled or cap is not None) else None
    summary: dict[str, Any] = {"name": r.name, "run_dir": str(run.path), "recipe": r.to_dict(),
                               "device": device_info(fabric.device), "versions": versions(),
                               "parameters": b.params, "data": b.data_report.summary(),
                               "total_steps": b.total_steps}
    status, error = "ok", None
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        _STOP["requested"] = False
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    else:
        previous = None
    try:
        fit(b, run, state, monitor, gpu_peak_flops(fabric.device, r.precision))
        if b.val_loader is not None and state.last_eval_step != state.step:
            run_eval(b, run, state, monitor, -1)
        if r.checkpoint.enabled and (not run.list_checkpoints() or
                                     run.list_checkpoints()[-1] != run.checkpoint_path(state.step)):
            save_checkpoint(b, run, state)
        if r.checkpoint.save_model:
            save_hf_model(b, run)
    except Preempted as e:
        status = "preempted"
        save_checkpoint(b, run, state)
        summary["preempted_at_step"] = e.step
        print(f"SIGTERM: checkpoint written at step {e.step}; continue with --resume {run.path}", flush=True)
    except Exception as e:  # noqa: BLE001 - every failure becomes a recorded result
        if monitor is not None:
            monitor.end_step()
        if mem.is_oom(e):
            status = "oom"
            summary["oom"] = {"step": state.step, "phase": state.phase, "message": str(e).splitlines()[0][:500],
                              "last_snapshot": monitor.last.to_dict() if monitor and monitor.last else None,
                              "advice": oom_advice(r)}
            print(f"OUT OF MEMORY at step {state.step} during {state.phase}: {summary['oom']['message']}", flush=True)
            for a in summary["oom"]["advice"]:
                print(f"  try: {a}", flush=True)
            fitting = alternatives_for_device(r, fabric.device, cap) if rank0 and r.memory.oom_alternatives else []
            if fitting:
                summary["oom"]["alternatives"] = fitting
                print("  variants the planner predicts to fit, fastest first:", flush=True)
                for line in fitting[:5]:
                    print(f"    {line}", flush=True)
            if fabric.device.type == "cuda":
                torch.cuda.empty_cache()
        else:
            from bigtune.dist import collective_failure_hint

            status, error = "error", e
            summary["error"] = f"{type(e).__name__}: {e}"
            hint = collective_failure_hint(e, r, fabric.world_size)
            if hint:
                summary["error_hint"] = hint
                print(hint, file=sys.stderr, flush=True)  # every rank: the others' stdout is silenced
    finally:
        _close_tensorboard(run)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    summary.update(_results(run, state, status, time.perf_counter() - t_start))
    evals = run.read_jsonl("eval.jsonl")
    if evals:
        metric = r.eval.best_metric
        best_rec = min(evals, key=lambda e: e[metric] if metric == "val_loss" else -e[metric])
        summary["eval"] = {"final": evals[-1], "best_val_loss": state.best_val_loss,
                           "best_metric": metric, "best_value": best_rec[metric], "best_step": best_rec["step"],
                           "eval_peak_allocated_bytes": max((e["eval_peak_allocated"] or 0) for e in evals) or None}
    if prediction is not None:
        summary["plan"] = compare_with_plan(prediction, r, fabric.device, run.read_jsonl("memory.jsonl"),
                                            fabric.world_size)
        print(format_comparison(summary["plan"]), flush=True)
    run.write_json("summary.json", summary)
    print(f"status {status}; final loss {summary['final_loss']}; peak allocated "
          f"{human_bytes(summary['peak_allocated_bytes'])}; {summary['tokens_per_s'] or 0:,.0f} tok/s; "
          f"summary: {run.path / 'summary.json'}", flush=True)
    if error is not None:
        raise error
    if status == "oom" and raise_on_oom:
        raise TrainingOOM(summary)
    return summary


def _target_for(device: torch.device, cap_bytes: Optional[int] = None):
    from bigtune.gpus import custom_gpu, detect_gpu
    from bigtune.planner import Target

    if device.type != "cuda":
        if cap_bytes is not None:
            return Target("cpu", custom_gpu(cap_bytes / GIB))
        return Target("cpu")
    props = torch.cuda.get_device_properties(device)
    gpu = detect_gpu(props.name, props.total_memory) or custom_gpu(props.total_memory / GIB)
    if cap_bytes is not None:
        gpu = custom_gpu(cap_bytes / GIB, gpu)
    return Target("cuda", gpu)


def _plan_target(r: Recipe, device: torch.device, world: int):
    from bigtune.planner import run_strategy

    return dataclasses.replace(_target_for(device), gpus=world, strategy=run_strategy(r.strategy, world))


def predict_for_device(r: Recipe, device: torch.device, world: int = 1):
    """The planner's prediction for this run's device, printed before step 0 (None if it cannot plan)."""
    from bigtune.planner import format_plan, plan

    try:
        p = plan(r, _plan_target(r, device, world))
    except Exception as e:  # noqa: BLE001 - a planning problem must never stop training
        print(f"plan: unavailable ({type(e).__name__}: {str(e)[:200]})", flush=True)
        return None
    print(format_plan(p), flush=True)
    return p


def alternatives_for_device(r: Recipe, device: torch.device, cap_bytes: Optional[int]) -> list[str]:
    """One line per variant predicted to fit this device (single device only), fastest first."""
    from bigtune.planner import alternatives

    try:
        # In-process (workers=1): forking worker processes from a process that has trained (OpenMP
        # and allocator threads mid-state) can deadlock the children; a fresh `bigtune plan` forks safely.
        # Adapters included: after an OOM, training fewer weights is a fair thing to suggest.
        alts = alternatives(r, _target_for(device, cap_bytes), max_gpus=1, workers=1, adapters=True)
    except Exception as e:  # noqa: BLE001
        print(f"  (planner could not suggest variants: {type(e).__name__}: {str(e)[:200]})", flush=True)
        return []
    return [f"{a.variant}: predicted peak {human_bytes(a.peak_total)}" for a in alts]


def compare_with_plan(p, r: Recipe, device: torch.device, snaps: list[dict], world: int = 1) -> dict:
    """Measured vs predicted per category and phase, at the last measured step (steady state).

    The plan before training assumes full max_seq_length micro-batches (the worst case). When the
    measured step's batch was shorter, the step is planned again at that shape so the two can be
    compared like for like; both predictions are kept.
    """
    out: dict[str, Any] = {"target": p.target, "predicted_peak_allocated": p.peak_allocated,
                           "predicted_peak_total": p.peak_total, "predicted_fits": p.fits,
                           "predicted_tight": getattr(p, "tight", False), "notes": p.notes,
                           "phases": {}}
    snaps = [s for s in snaps if s.get("rank", 0) == 0]  # the plan is per device; compare rank 0's
    if not snaps:
        return out
    last = max(s["step"] for s in snaps)
    steady = {s["phase"]: s for s in snaps if s["step"] == last}
    first = steady.get("before_forward", {})
    shape, padded = first.get("batch_shape"), first.get("padded", False)
    like = p
    if shape and (shape[0] != r.train.micro_batch_size or shape[1] != r.data.max_seq_length or padded):
        from bigtune.planner import plan

        try:
            like = plan(load_recipe(r.to_dict(), {"train.micro_batch_size": shape[0],
                                                  "data.max_seq_length": shape[1]}), _plan_target(r, device, world),
                        padded=padded)
            out["replanned_at_batch_shape"] = shape
        except Exception as e:  # noqa: BLE001
            out["replan_error"] = f"{type(e).__name__}: {e}"
    for ph, s in steady.items():
        if ph in like.phases:
            out["phases"][ph] = {c: {"measured": s[c], "predicted": like.phases[ph][c]}
                                 for c in ("parameters", "gradients", "optimizer_device", "optimizer_cpu",
                                           "activations", "allocated", "peak_allocated")}
    measured = max(s["peak_allocated"] for s in steady.values())
    out["measured_peak_allocated"] = measured
    out["measured_peak_allocated_all_steps"] = max(s["peak_allocated"] for s in snaps)
    out["predicted_peak_allocated_like_for_like"] = like.peak_allocated
    out["peak_error_pct"] = _error_pct(like.peak_allocated, measured)
    # CUDA: what the allocator reserved and what the whole device had in use (nvidia-smi's figure) in
    # that step, beside the plan's analytic reserved (fragmentation) and total (+ CUDA context).
    reserved = [s["peak_reserved"] for s in steady.values() if s.get("peak_reserved") is not None]
    used = [s["device_used"] for s in steady.values() if s.get("device_used") is not None]
    out["measured_peak_reserved"] = max(reserved) if reserved else None
    out["measured_device_used"] = max(used) if used else None
    out["predicted_peak_reserved_like_for_like"] = like.peak_reserved
    out["predicted_peak_total_like_for_like"] = like.peak_total
    out["reserved_error_pct"] = _error_pct(like.peak_reserved, out["measured_peak_reserved"])
    out["total_error_pct"] = _error_pct(like.peak_total, out["measured_device_used"])
    # The roofline time for the same batch shape (None on a CPU): bench/plan_accuracy.py sets it
    # beside the measured step time.
    out["predicted_step_time_s"] = like.step_time_s
    out["predicted_tokens_per_s"] = like.tokens_per_s
    out["predicted_needed_like_for_like"] = getattr(like, "needed_total", None)  # what must fit (FITS/OOM)
    return out


def _error_pct(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    """Signed error of a prediction in percent of the measurement (None when either is missing)."""
    if predicted is None or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


def format_comparison(c: dict) -> str:
    if "measured_peak_allocated" not in c:
        return "plan vs measured: nothing measured"
    shape = c.get("replanned_at_batch_shape")
    where = f"re-planned at the measured batch {shape[0]}×{shape[1]}" if shape else "as planned"
    lines = [f"measured / predicted, last measured step ({where}):",
             f"{'phase':<16}" + "".join(f"{h:>24}" for h in ("params", "grads", "optim", "acts", "alloc"))]
    for ph, cats in c["phases"].items():
        cells = [f"{human_bytes(cats[k]['measured'])} / {human_bytes(cats[k]['predicted'])}"
                 for k in ("parameters", "gradients", "optimizer_device", "activations", "allocated")]
        lines.append(f"{ph:<16}" + "".join(f"{x:>24}" for x in cells))
    lines.append(f"peak allocated of that step: measured {human_bytes(c['measured_peak_allocated'])}, predicted "
                 f"{human_bytes(c['predicted_peak_allocated_like_for_like'])} ({c['peak_error_pct']:+.2f}%)"
                 + (f"; worst case (full max_seq_length) {human_bytes(c['predicted_peak_allocated'])}"
                    if shape else ""))
    if c.get("measured_peak_reserved") is not None and c.get("predicted_peak_reserved_like_for_like") is not None:
        lines.append(f"peak reserved: measured {human_bytes(c['measured_peak_reserved'])}, predicted "
                     f"{human_bytes(c['predicted_peak_reserved_like_for_like'])} ({c['reserved_error_pct']:+.2f}%)")
    if c.get("measured_device_used") is not None and c.get("predicted_peak_total_like_for_like") is not None:
        lines.append(f"in use on the device (as nvidia-smi shows it): measured {human_bytes(c['measured_device_used'])}"
                     f", predicted {human_bytes(c['predicted_peak_total_like_for_like'])} "
                     f"({c['total_error_pct']:+.2f}%)")
    return "\n".join(lines)


def _results(run: RunDir, state: LoopState, status: str, wall: float) -> dict:
    snaps = run.read_jsonl("memory.jsonl")
    peaks = [s["peak_allocated"] for s in snaps]
    reserved = [s["peak_reserved"] for s in snaps if s.get("peak_reserved") is not None]
    used = [s["device_used"] for s in snaps if s.get("device_used") is not None]
    metrics = run.read_jsonl("metrics.jsonl")
    tp = throughput(state.tokens, state.samples, state.train_seconds) if state.train_seconds else \
        {"tokens_per_s": None, "samples_per_s": None}
    return {
        "status": status, "steps": state.step, "tokens": state.tokens, "samples": state.samples,
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "first_loss": metrics[0]["loss"] if metrics else None,
        "peak_allocated_bytes": max(peaks) if peaks else None,
        "peak_reserved_bytes": max(reserved) if reserved else None,
        # the most in use on the whole device at a snapshot (CUDA; what nvidia-smi shows)
        "peak_device_used_bytes": max(used) if used else None,
        "wall_seconds": wall, "train_seconds": state.train_seconds,
        "step_time_s": state.train_seconds / state.step if state.step else None,
        **tp, "mfu": metrics[-1].get("mfu") if metrics else None,
    }


def _close_tensorboard(run: RunDir) -> None:
    w = _TB.pop(str(run.path), None)
    if w is not None:
        w.close()


def save_hf_model(b: Built, run: RunDir, dest_name: Optional[str] = None, keep_base: bool = True) -> Path:
    """The trained model in Hugging Face format (safetensors), written atomically.

    Full fine-tuning: <run>/model. Adapters: <run>/adapter (peft format), plus <run>/base with the
    initial weights when the base has no folder of its own (presets, random init);
    `bigtune export --merge` folds them into one model.
    """
    from bigtune.dist import full_state_dict

    model = b.model.module if hasattr(b.model, "module") else b.model
    dest = run.path / (dest_name or ("adapter" if b.recipe.peft.method != "none" else "model"))
    state = full_state_dict(b.fabric, model)  # FSDP: every rank joins the gather; rank 0 gets it
    if b.fabric.global_rank != 0:
        return dest
    tmp = run.path / f".{dest.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    if state is not None:
        model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
    else:
        model.save_pretrained(tmp, safe_serialization=True)
    b.tokenizer.save_pretrained(tmp)
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    if keep_base and b.base_dir is not None and b.base_dir.exists():
        if (run.path / "base").exists():
            shutil.rmtree(run.path / "base")
        shutil.move(str(b.base_dir), run.path / "base")
    return dest
