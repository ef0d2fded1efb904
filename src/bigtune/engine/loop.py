"""The training engine's loop: ``fit`` (one screen), its step, evaluation and signals, and ``train``, which sets up
and builds a run (build.py), fits it and records the result.

``train(recipe)`` is the whole thing and returns the run's summary (also written to
summary.json). Problems found before training (recipe, data, model) raise and write nothing;
an out-of-memory during training is a *result*: summary.json says ``status: oom`` with the step
and phase where it happened, the last memory snapshot and what to change.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional, Protocol

import torch

from bigtune.core.rundir import RunDir, pick_run_dir
from bigtune.core.stepmath import (
    GIB,
    IGNORE_INDEX,
    causal_lm_loss_sum,
    chunked_lm_loss_sum,
    loss_normaliser,
    target_token_count,
)
from bigtune.engine.build import build, run_length, set_cuda_alloc_conf, setup_fabric
from bigtune.engine.checkpoints import (  # noqa: F401 - CHECKPOINT_KEYS, checkpoint_step: the loop's API too
    CHECKPOINT_KEYS,
    checkpoint_step,
    find_resume_checkpoint,
    load_checkpoint,
    resume_point,
    resume_recipe,
    save_at_end,
    save_checkpoint,
    save_hf_model,
)
from bigtune.engine.meter import WindowMeter
from bigtune.engine.progress import Progress, memory_in_use
from bigtune.engine.report import (
    NOTICES,
    VERBOSITIES,
    Output,
    device_capacity,
    device_info,
    eval_summary,
    gpu_peak_flops,
    library_bars_off,
    notice,
    record_error,
    run_results,
    summary_line,
    versions,
)
from bigtune.engine.state import Built, LoopState, epoch_loss_mean
from bigtune.engine.tracking import (
    RUNS_FILE,
    SERVE_JOB_ENV,
    SWEEP_ENV,
    RunInfo,
    Trackers,
    flatten,
    open_trackers,
    run_artifacts,
)
from bigtune.memory import monitor as mem
from bigtune.models.build import (
    PLAIN_HEAD_TYPES,
    forward_inputs,
    has_plain_head,
    hidden_states_out,
    plain_output_head,
    router_aux_coef,
    shifts_labels,
)
from bigtune.recipe import Recipe, load_recipe

EXIT_ERROR, EXIT_BAD_INPUT, EXIT_OOM = 1, 2, 3


class TrainingOOM(RuntimeError):
    """Raised by ``train(..., raise_on_oom=True)``; ``summary`` holds the recorded result."""

    def __init__(self, summary: dict):
        self.summary = summary
        oom = summary.get("oom", {})
        super().__init__(f"out of memory at step {oom.get('step')} during {oom.get('phase')}")


def train_step(
    b: Built,
    batches: list[dict],
    monitor: Optional[mem.MemoryMonitor],
    measure: bool,
    state: LoopState,
    token_count: Optional[int] = None,
) -> tuple[torch.Tensor, list[mem.Snapshot]]:
    """One optimizer step over ``batches`` (the micro-batches of one accumulation window).

    ``token_count`` is the window's target-token count when the caller knows it (counted across
    ranks, or outside the planner's fake tensors); otherwise it is counted here.

    Long because the order of forward, loss (with a mixture-of-experts model's router aux loss), backward,
    snapshots and optimizer step is what the planner simulates: one function keeps that order in one place.
    """
    from bigtune.engine.strategies import (
        backward_kwargs,
        clip_gradients,
        clips_itself,
        data_parallel,
        micro_batch_context,
    )

    if getattr(b, "pipeline", None) is not None:  # the schedule orders the stages' forwards and backwards
        return b.pipeline.step(b, batches, monitor, measure, state, token_count, clip_gradients)
    fabric, model, opt = b.fabric, b.model, b.optimizer
    shift = shifts_labels(model)
    if token_count is None and fabric.world_size > 1:
        from bigtune.engine.strategies import all_sum

        # Every rank divides by the token count of the whole global batch (DDP/FSDP then average over the
        # data-parallel ranks; a tensor-parallel group reads one batch, so it is counted once).
        count = sum(int(target_token_count(x["labels"], shift)) for x in batches)
        token_count = int(all_sum(fabric, count, data_parallel_only=True))
    scale = loss_normaliser(
        [x["labels"] for x in batches], world_size=data_parallel(fabric)[1], global_token_count=token_count, shift=shift
    )
    snaps: list[mem.Snapshot] = []
    track = monitor is not None and (measure or monitor.cap_bytes is not None and not monitor.is_cuda)
    loss_total = torch.zeros((), device=fabric.device)
    head = chunked_loss_head(b.recipe, model)
    aux_coef = router_aux_coef(model)  # 0 unless a mixture-of-experts model
    aux_sum = aux_share = torch.zeros((), device=fabric.device)
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
                # MoE: ask for the router's load-balancing loss; keep no reference to the output (it holds the logits)
                out = model(**forward_inputs(batch, padded), **({"output_router_logits": True} if aux_coef else {}))
                logits, aux = out.logits, getattr(out, "aux_loss", None)  # logits: the hidden states when chunking
                del out
            if head is not None:
                with fabric.autocast():  # the output layer computes as it would inside the forward
                    loss = (
                        chunked_lm_loss_sum(
                            logits, head.weight, batch["labels"], b.recipe.train.loss_chunk_tokens, shift
                        )
                        * scale
                    )
            else:
                loss = causal_lm_loss_sum(logits, batch["labels"], shift, getattr(b, "class_weights", None)) * scale
            # Backward needs the loss's saved tensors, not the logits: holding them through backward
            # would add tokens × vocab × bytes to the step's peak.
            del logits
            if track:
                monitor.mark_segment()  # the forward's high, apart from the backward's (planner: simulate)
            if measure and last:
                snaps.append(monitor.snapshot(state.step, "after_forward", model, opt))
            if late_zero and i == 0:
                opt.zero_grad(set_to_none=True)
            loss_total += loss.detach()  # the logged loss is the LM loss alone
            if aux is not None:
                # MoE router aux loss: HF adds coef × aux_loss (a per-micro-batch mean) to a mean LM loss. Each
                # micro-batch's aux is weighted by its share of the window's target tokens (its tokens × the
                # LM loss's scale), so the window adds coef × the token-weighted mean, as one big batch would.
                share = target_token_count(batch["labels"], shift) * scale
                loss = loss + aux_coef * aux * share
                aux_sum = aux_sum + aux.detach() * share
                aux_share = aux_share + share
                del aux
            state.phase = "backward"
            fabric.backward(loss, **backward_kwargs(fabric))
            if track:
                monitor.mark_segment()
        del loss
    if measure:
        snaps.append(monitor.snapshot(state.step, "after_backward", model, opt))
    state.phase = "optimizer"
    if b.recipe.optim.grad_clip is not None and not clips_itself(fabric):
        state.grad_norm = clip_gradients(fabric, model, opt, b.recipe.optim.grad_clip).detach()
    opt.step()
    b.scheduler.step()
    if measure:
        snaps.append(monitor.snapshot(state.step, "after_optimizer", model, opt))
    if not late_zero:
        opt.zero_grad(set_to_none=True)
    if track:
        monitor.end_step()
    # MoE: this window's token-weighted mean router aux loss (fit logs it as aux_loss); None for other models
    state.aux_loss = aux_sum / aux_share.clamp(min=1e-12) if aux_coef else None
    return loss_total, snaps


def _text_shape(batch: dict) -> list[int]:
    """[micro batch, text tokens] as the recipe counts them (data.max_seq_length): image-to-text
    batches of a decoder-only model put the image tokens (labelled -100) ahead of the caption. A chat
    vision-language batch (image tokens marked in mm_token_type_ids, the placeholder counted as text):
    the padded length less the most image tokens of a row, plus that row's placeholder, so that rows of
    that many text tokens with the batch's images (image_grids) pad to the same length."""
    if batch["labels"].dim() < 2:  # a classifier: one label per sample
        return [int(x) for x in batch["input_ids"].shape]
    b, n = batch["labels"].shape[:2]
    if "image_grid_thw" in batch and "mm_token_type_ids" in batch and "image_px" not in batch:
        return [int(b), int(n) - int(batch["mm_token_type_ids"].sum(1).max()) + 1]
    if "image_tokens" in batch:  # LLaVA / PaliGemma / SmolVLM / LLaVA-NeXT: a row's image at most that many tokens
        return [int(b), int(n) - int(batch["image_tokens"]) + 1]
    if "pixel_values" in batch and "decoder_input_ids" not in batch:
        n -= int((batch["labels"][0] == IGNORE_INDEX).sum()) - int((batch["attention_mask"][0] == 0).sum())
    return [int(b), int(n)]


def loss_chunk_skipped(r: Recipe, config) -> Optional[str]:
    """Why ``train.loss_chunk_tokens`` does not apply to this run (None when it does, or is off).
    ``config``: the model's config (None: the model is not known yet, its head is not checked)."""
    if not r.train.loss_chunk_tokens:
        return None
    if r.strategy == "fsdp" or r.strategy.startswith("deepspeed"):
        return f"strategy={r.strategy} shards the output layer, which the chunked loss reads whole"
    if r.model.family != "causal-lm":
        return f"model.family={r.model.family} computes its own loss"
    if config is not None and not has_plain_head(config):
        kind = getattr(config, "model_type", None)
        return (
            f"model type {kind!r} post-processes its logits (chunked for: {', '.join(PLAIN_HEAD_TYPES)}, "
            "and gemma3_text without final_logit_softcapping)"
        )
    return None


def chunked_loss_head(r: Recipe, model) -> Optional[torch.nn.Linear]:
    """The output layer to compute the loss from in chunks, or None for the plain loss (chunking off,
    or a model/strategy it does not apply to: see train.loss_chunk_tokens)."""
    if not r.train.loss_chunk_tokens or loss_chunk_skipped(r, None) is not None:
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


def fit(
    b: Built,
    run: RunDir,
    state: LoopState,
    monitor: Optional[mem.MemoryMonitor],
    peak_flops: Optional[float],
    tracker: Optional[Trackers] = None,
):
    """The loop: optimizer steps until ``b.total_steps``, with logging, evaluation, checkpoints and stops."""
    r = b.recipe
    tracker = tracker or Trackers([])
    meter = WindowMeter(b.fabric, b.model, peak_flops)
    aux_window: list = []

    def log_window(epoch: int) -> None:
        nonlocal aux_window
        rec = meter.close_window(state, epoch, lr=b.scheduler.get_last_lr()[0])
        if state.grad_norm is not None:  # the window's last step, before clipping (read here: one sync per log)
            norm = state.grad_norm
            rec["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # FSDP2: a DTensor
        if aux_window:
            rec["aux_loss"] = float(torch.stack(aux_window).mean())
            aux_window = []
        run.append_jsonl("metrics.jsonl", rec)
        run.append_csv("metrics.csv", rec)
        tracker.log_step(rec["step"], rec)
        progress.log(state.step, rec, memory_in_use(b.fabric.device, monitor))

    state.epoch_loss_sum = torch.as_tensor(float(state.epoch_loss_sum), dtype=torch.float32, device=b.fabric.device)
    start_epoch, first_window = divmod(state.step, b.steps_per_epoch)
    # the bar (on a terminal) stays up until the loop ends, however it ends: a stop, an OOM, an error
    with Progress(b.total_steps, start=state.step) as progress:
        for epoch in range(start_epoch, math.ceil(b.total_steps / b.steps_per_epoch)):
            for batches in windows(b, epoch, first_window if epoch == start_epoch else 0):
                measure = (
                    monitor is not None
                    and r.memory.enabled
                    and (state.step in (0, 1) or state.step % r.memory.every_steps == 0)
                )
                loss, snaps = train_step(b, batches, monitor, measure, state)
                if snaps:
                    _record_memory(b, run, snaps, batches, tracker)
                meter.add(batches, loss, state)
                state.epoch_loss_sum += loss  # on the device: no host sync per step
                state.epoch_loss_steps += 1
                if state.aux_loss is not None:  # MoE: the router aux loss, averaged over the logging window
                    aux_window.append(state.aux_loss.detach())
                state.step += 1
                if state.step % r.train.log_every_steps == 0 or state.step == b.total_steps:
                    log_window(epoch)
                else:
                    progress.step(state.step)
                if b.val_loader is not None and r.eval.every_steps and state.step % r.eval.every_steps == 0:
                    run_eval(b, run, state, monitor, epoch, tracker)
                if r.checkpoint.enabled and r.checkpoint.every_steps and state.step % r.checkpoint.every_steps == 0:
                    save_checkpoint(b, run, state)
                stop = _stop_requested(b.fabric)
                if stop:
                    if meter.steps:  # the steps since the last log: recorded, so the stop's loss and speed are known
                        log_window(epoch)
                    raise Preempted(state.step, stop)
                if state.step >= b.total_steps:
                    break
            if state.epoch_loss_steps:
                mean = epoch_loss_mean(b.fabric, state)
                state.epoch_losses.append({"epoch": epoch, "loss": mean, "steps": state.epoch_loss_steps})
                print(f"epoch {epoch}: average train loss {mean:.4f} over {state.epoch_loss_steps} steps", flush=True)
            state.epoch_loss_sum, state.epoch_loss_steps = torch.zeros_like(state.epoch_loss_sum), 0
            if state.step >= b.total_steps:
                break
    if r.optim.zero_grad == "before_backward":  # the last step's gradients are still held: not for what follows
        b.optimizer.zero_grad(set_to_none=True)


def _record_memory(b: Built, run: RunDir, snaps: list, batches: list[dict], tracker: Optional[Trackers] = None) -> None:
    """Every rank's snapshots of a measured step into memory.jsonl, the table printed, and this rank's (rank 0
    is the one that tracks) to the trackers."""
    shape = _text_shape(batches[0])
    # Packed rows attend through an explicit block mask, as padded batches do (for the planner).
    padded = any(x.get("padded", True) or x.get("packed", False) for x in batches)
    if b.pipeline is not None:  # the stages compute on micro-batches padded to one shape, without a padding mask
        shape, padded = list(b.pipeline.shape), False
    # chat vision-language models: each image's (t, h, w) tile grid, which the re-plan lays out again
    grids = {"image_grids": batches[0]["image_grid_thw"].tolist()} if "image_grid_thw" in batches[0] else {}
    if "image_tiles" in batches[0]:  # Idefics3 (SmolVLM): each image's (rows, cols) of tiles
        grids = {"image_grids": batches[0]["image_tiles"]}
    if "image_sizes" in batches[0]:  # LLaVA-NeXT: each image's (height, width) px, which decide its tiles and tokens
        grids = {"image_grids": batches[0]["image_sizes"].tolist()}
    if "image_px" in batches[0]:  # the generic path: each image's (height, width) px, which its processor lays out
        grids = {"image_grids": batches[0]["image_px"]}
    per_rank = mem.gather_snapshots(b.fabric, snaps)
    for rank, rank_snaps in enumerate(per_rank):
        for s in rank_snaps:
            run.append_jsonl(
                "memory.jsonl", {**s.to_dict(), "rank": rank, "batch_shape": shape, "padded": padded, **grids}
            )
    if tracker is not None:
        for s in snaps:
            tracker.log_memory(s.step, s.phase, s.to_dict())
    print(mem.format_table(snaps, device_capacity(b.fabric.device, b.recipe)), flush=True)
    if len(per_rank) > 1:
        print(mem.format_rank_spread(per_rank), flush=True)


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
    out = {
        "val_loss": loss,
        "val_perplexity": math.exp(min(loss, 50.0)),
        "val_tokens": tokens,
        "eval_peak_allocated": peak,
    }
    if classify and golds:
        from bigtune.core.metrics import classification_metrics

        m = classification_metrics(torch.cat(golds).tolist(), torch.cat(preds).tolist(), b.data_report.label_names)
        out.update({k: m[k] for k in ("accuracy", "macro_f1", "f1_per_class", "confusion_matrix")})
    return out


def is_better(metric: str, value: float, best: Optional[float]) -> bool:
    """eval.best_metric: val_loss improves downwards, accuracy / macro_f1 upwards."""
    if best is None:
        return True
    return value < best if metric == "val_loss" else value > best


def run_eval(b: Built, run: RunDir, state: LoopState, monitor, epoch: int, tracker: Optional[Trackers] = None) -> dict:
    res = evaluate(b, monitor)
    state.last_eval_step = state.step
    rec = {"step": state.step, "epoch": epoch, "split": "val", **res}
    run.append_jsonl("eval.jsonl", rec)
    if tracker is not None:
        tracker.log_step(
            state.step,
            {
                (k if k.startswith("val_") else f"val_{k}"): v
                for k, v in res.items()
                if k.startswith("val_") or k in ("accuracy", "macro_f1")
            },
        )
    metric = b.recipe.eval.best_metric
    best = is_better(metric, res[metric], state.best_score)
    if state.best_val_loss is None or res["val_loss"] < state.best_val_loss:
        state.best_val_loss = res["val_loss"]
    task = f" accuracy {res['accuracy']:.4f} macro-F1 {res['macro_f1']:.4f}" if "accuracy" in res else ""
    print(
        f"eval at step {state.step}: val_loss {res['val_loss']:.4f} perplexity {res['val_perplexity']:.2f}{task}"
        + (f" (best {metric})" if best else ""),
        flush=True,
    )
    if best:
        state.best_score = res[metric]
        if b.recipe.eval.keep_best and b.recipe.checkpoint.save_model:
            save_hf_model(b, run, dest_name="best", keep_base=False)
            run.write_json("best.json", {"step": state.step, **res})
    return res


class Preempted(Exception):
    """SIGTERM (Slurm preemption or time limit) or SIGINT (Ctrl-C) arrived: the loop stops at a step
    boundary, a checkpoint is written and the run can be resumed."""

    def __init__(self, step: int, signal_name: str = "SIGTERM"):
        self.step = step
        self.signal = signal_name
        super().__init__(f"stopped by {signal_name} after step {step}")


_STOP: dict[str, Optional[str]] = {"requested": None}


def _on_stop_signal(signum, frame) -> None:
    # Acted on between steps, where a checkpoint is consistent. A second Ctrl-C stops at once.
    if _STOP["requested"] == "SIGINT" and signum == signal.SIGINT:
        raise KeyboardInterrupt
    _STOP["requested"] = signal.Signals(signum).name


@contextlib.contextmanager
def _stop_signals():
    """SIGTERM (a scheduler's pre-emption) and SIGINT (Ctrl-C) end the loop at the next step boundary
    with a checkpoint; outside the main thread signals cannot be caught, so nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STOP["requested"] = None
    previous = {sig: signal.signal(sig, _on_stop_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_requested(fabric) -> Optional[str]:
    """The stop signal's name when one arrived (on any rank), else None."""
    flag = _STOP["requested"]
    if fabric.world_size > 1:
        from bigtune.engine.strategies import all_sum

        if all_sum(fabric, float(flag is not None)) > 0:  # every rank stops at the same step
            return flag or "SIGTERM"
        return None
    return flag


class RunHooks(Protocol):
    """What the layer that orchestrates a run (``bigtune.run``) adds around the engine: the plan printed
    before step 0, the advice and fitting variants after an out-of-memory, and plan vs measured at the end.
    The engine knows nothing of the planner; the planner runs the engine's step. Only rank 0 calls these."""

    def before_run(self, recipe: Recipe, device: torch.device, world: int) -> Optional[dict]:
        """Before step 0; returns the plan (``Plan.to_dict()``) for the trackers, or None."""

    def on_oom(self, recipe: Recipe, device: torch.device, cap_bytes: Optional[int], oom: dict) -> None: ...

    def after_run(self, recipe: Recipe, device: torch.device, world: int, snaps: list[dict], summary: dict) -> None: ...


def train(
    recipe: Recipe | dict | str | Path | None = None,
    overrides: list[str] | dict | None = None,
    resume: str | Path | None = None,
    raise_on_oom: bool = False,
    quiet_recipe: bool = False,
    reuse_dir: bool = False,
    hooks: Optional[RunHooks] = None,
    verbosity: str = "normal",
) -> dict:
    """Train one recipe; return the summary dict (also in <run>/summary.json).

    ``recipe`` is a Recipe, a dict, a YAML path or None (the built-in demo). ``resume`` is a run
    directory or checkpoint; with no recipe given, the run's own recipe.yaml is used, and a recipe that
    does not match the checkpoint is a RecipeError; a run that stopped before its first step starts
    afresh in its folder. Bad input raises (RecipeError, DataError, ModelError) before anything is
    written; an out-of-memory returns a summary with status "oom" (or raises TrainingOOM). Use
    ``bigtune.train`` for the same with the plan beside the measurement.

    ``verbosity``: "normal" prints a few lines about the run, its progress and results; "verbose" also the
    whole resolved recipe (``quiet_recipe`` leaves it out) and the plan's table; "quiet" only notices (on
    stderr) and the final summary line.
    """
    if verbosity not in VERBOSITIES:
        raise ValueError(f"verbosity={verbosity!r}; one of {', '.join(VERBOSITIES)}")
    t_start = time.perf_counter()
    resume_ckpt = None
    afresh = False  # --resume of a run that stopped before its first step
    if resume is not None:
        run_path, resume_ckpt = find_resume_checkpoint(resume)
        r = resume_recipe(run_path, resume_ckpt, recipe, overrides)
        afresh = resume_ckpt is None
    else:
        r = load_recipe(recipe, overrides)
        if reuse_dir and r.output_dir:
            run_path = Path(r.output_dir)  # a requeued job starts over in its own folder
        else:
            run_path = pick_run_dir(r.output_dir, r.name)
    set_cuda_alloc_conf(r)
    fabric = setup_fabric(r)
    if fabric.world_size > 1:
        run_path = Path(fabric.broadcast(str(run_path), src=0))  # every rank uses rank 0's choice
    # Only rank 0 talks (the other ranks' prints would repeat it); under --quiet it says only its notices
    # (on stderr) and the final line.
    talker = fabric.global_rank == 0
    console = sys.stdout if talker else None  # where the final summary line goes
    silent = not talker or verbosity == "quiet"
    out = Output(
        console=console,
        verbose=verbosity == "verbose",
        show_recipe=verbosity == "verbose" and not quiet_recipe,
        afresh=afresh,
    )
    NOTICES["stream"] = sys.stderr if talker and verbosity == "quiet" else None
    try:
        with contextlib.redirect_stdout(io.StringIO()) if silent else contextlib.nullcontext(), library_bars_off():
            hooks = hooks if talker else None
            return _train(r, fabric, run_path, resume_ckpt, t_start, raise_on_oom, out, hooks)
    finally:
        NOTICES["stream"] = None


def _announce(r: Recipe, b: Built, fabric) -> None:
    """What the run is about to do, before anything is written: data, model, precision, strategy, batch,
    length (the whole recipe is in the run folder's recipe.yaml)."""
    for line in b.data_report.lines():
        print(line, flush=True)
    if r.data.packing:
        print(
            f"data.packing: {b.data_report.used} samples in {b.sampler.n} rows of up to {r.data.max_seq_length} "
            "tokens (train.micro_batch_size counts rows)",
            flush=True,
        )
    peft = "" if r.peft.method == "none" else f", {r.peft.method} r={r.peft.r}"
    quant = "" if r.model.quantize == "none" else f", {r.model.quantize} base"
    print(
        f"model: {r.model.name}: {b.params['total']:,} parameters ({b.params['trainable']:,} trainable{peft}{quant}), "
        f"precision {r.precision}",
        flush=True,
    )
    world, dp = fabric.world_size, r.data_parallel_size
    devices = f"{world} {fabric.device.type} device{'s' if world > 1 else ''}"
    strategy = "" if world == 1 and r.strategy == "auto" else f", strategy {r.strategy}"
    ranks = f"{dp} device{'s' if dp > 1 else ''}" if dp == world else f"{dp} data-parallel ranks"
    print(
        f"run: {devices}{strategy}; batch {r.global_batch_size} samples = micro-batch {r.train.micro_batch_size} "
        f"× accumulation {r.accumulate} × {ranks}",
        flush=True,
    )
    length, run_length_notice = run_length(r.train.max_epochs, r.train.max_steps, b.steps_per_epoch)
    print(f"steps: {length}", flush=True)
    if run_length_notice:
        notice(run_length_notice)
    if r.optim.lr_scaling != "none":
        print(
            f"lr: {r.lr:.3g} = optim.lr {r.optim.lr:.3g} scaled {r.optim.lr_scaling} with {r.data_parallel_size} "
            f"data-parallel ranks (optim.lr_scaling)",
            flush=True,
        )
    if r.train.loss_chunk_tokens and chunked_loss_head(r, b.model) is None:
        why = loss_chunk_skipped(r, getattr(b.model, "config", None)) or (
            "the output layer carries adapters or is quantized"
        )
        notice(f"note: train.loss_chunk_tokens={r.train.loss_chunk_tokens} is not used: {why}")
    from bigtune.engine.strategies import MEMORY_NOTE_DEEPSPEED, is_deepspeed

    if is_deepspeed(r) and r.memory.enabled:
        print(MEMORY_NOTE_DEEPSPEED, flush=True)
    if r.train.compile and r.memory.enabled and fabric.device.type == "cpu":
        print(
            "memory: measured steps (0, 1, every memory.every_steps) run the compiled blocks eager, since the CPU "
            "tracker cannot see inside compiled code: their table is the eager step's memory, exact, and their "
            "step time is eager too",
            flush=True,
        )


# What a run writes as it goes: a fresh run in a folder that has them (--auto-resume without a checkpoint,
# --resume of a run stopped before its first step) starts them anew rather than appending to the old ones, and
# new tracked runs rather than continuing those tracking.json names.
RUN_RECORDS = ("metrics.jsonl", "metrics.csv", "memory.jsonl", "eval.jsonl", "summary.json", "best.json", RUNS_FILE)


def _open_run(
    r: Recipe, b: Built, run_path: Path, resume_ckpt: Optional[Path], writer: bool
) -> tuple[RunDir, LoopState]:
    run = RunDir(run_path, writer=writer)
    run.create()
    state = LoopState()
    if resume_ckpt is None and writer:
        for name in RUN_RECORDS:
            (run.path / name).unlink(missing_ok=True)
    if resume_ckpt is not None:
        load_checkpoint(b, resume_ckpt, state)
        # Records past the checkpoint belong to the interrupted attempt; this run writes them again.
        run.truncate_jsonl("metrics.jsonl", lambda rec: rec["step"] <= state.step)
        run.truncate_jsonl("memory.jsonl", lambda rec: rec["step"] < state.step)
        run.truncate_jsonl("eval.jsonl", lambda rec: rec["step"] <= state.step)
        print(f"resumed from {resume_ckpt} at step {state.step}", flush=True)
    run.write_text("recipe.yaml", r.to_yaml())  # after a resume's checks passed: never over a good one
    print(f"run dir: {run.path} (recipe.yaml there holds the whole resolved recipe)", flush=True)
    return run, state


def _record_oom(e: BaseException, r: Recipe, fabric, state, monitor, cap: Optional[int], hooks) -> dict:
    """An out-of-memory error as a result: where it struck, the last snapshot, said once on the console."""
    oom = {
        "step": state.step,
        "phase": state.phase,
        "message": str(e).splitlines()[0][:500],
        "last_snapshot": monitor.last.to_dict() if monitor and monitor.last else None,
        "cached_unallocated_bytes": mem.unallocated_at_oom(e),
    }
    notice(f"OUT OF MEMORY at step {state.step} during {state.phase}: {oom['message']}")
    if hooks is not None:
        hooks.on_oom(r, fabric.device, cap, oom)
    if fabric.device.type == "cuda":
        torch.cuda.empty_cache()
    return oom


def _set_up(
    r: Recipe, fabric, run_path: Path, resume_ckpt: Optional[Path], out: Output, hooks: Optional[RunHooks]
) -> "tuple[Built, Optional[dict]] | dict":
    """The run built and announced with its plan (None when not planned), or the summary that ends it here: a
    finished run resumed, or Ctrl-C while setting up (Python's own KeyboardInterrupt: the stop handlers come with
    the loop)."""
    if out.afresh:
        notice(f"{run_path} stopped before its first optimizer step and has no checkpoint: starting it afresh there")
    try:
        if out.show_recipe:
            print("# resolved recipe\n" + r.to_yaml().rstrip(), flush=True)
        b = build(r, fabric)  # raises on bad data/model before the run dir exists
        if resume_ckpt is not None and (finished := resume_point(r, b, run_path, resume_ckpt)) is not None:
            return finished
        _announce(r, b, fabric)
        plan = hooks.before_run(r, fabric.device, fabric.world_size) if hooks is not None else None
    except KeyboardInterrupt:
        if resume_ckpt is not None:
            notice(f"SIGINT while setting up the resumed run: {run_path} is as it was; run the same command again")
        else:
            notice(
                "SIGINT before the first optimizer step, while setting up: nothing was written; run the same command again"
            )
        return {"status": "interrupted", "stopped_by": "SIGINT", "steps": 0, "run_dir": None}
    return b, plan


def _open_tracking(
    r: Recipe, b: Built, fabric, run: RunDir, plan: Optional[dict], resumed_at: Optional[int]
) -> Trackers:
    """The trackers tracking.backends asks for, started: rank 0's only (the other ranks' calls do nothing), so a
    run of N processes is one tracked run. ``resumed_at``: the checkpoint's step of a resumed run, whose trackers
    continue the runs they logged before (None: a fresh run)."""
    if fabric.global_rank != 0 or not r.tracking.backends:
        return Trackers([])
    dev = device_info(fabric.device)
    strategy = r.strategy if r.strategy != "auto" else ("single" if fabric.world_size == 1 else "ddp")
    tags = {
        "bigtune.device": str(dev["name"]),
        "bigtune.device_type": dev["type"],
        "bigtune.strategy": strategy,
        "bigtune.world_size": str(fabric.world_size),
        "bigtune.run_dir": str(run.path),
    }
    serve_job = os.environ.get(SERVE_JOB_ENV)
    if serve_job:  # a job of the training service: its run named by the job
        tags["bigtune.serve_job"] = serve_job
    info = RunInfo(serve_job or run.path.name, run.path, tags, os.environ.get(SWEEP_ENV), resumed_at)
    tracker = open_trackers(r.tracking, info)
    params = {
        **flatten(r.to_dict()),
        "run.world_size": fabric.world_size,
        "run.global_batch_size": r.global_batch_size,
        "run.accumulate": r.accumulate,
        "run.lr": r.lr,
        "run.total_steps": b.total_steps,
        "run.parameters_total": b.params.get("total"),
        "run.parameters_trainable": b.params.get("trainable"),
    }
    tracker.start(params, plan)
    return tracker


def _train(
    r: Recipe,
    fabric,
    run_path: Path,
    resume_ckpt: Optional[Path],
    t_start: float,
    raise_on_oom: bool,
    out: Output,
    hooks: Optional[RunHooks],
) -> dict:
    setup = _set_up(r, fabric, run_path, resume_ckpt, out, hooks)
    if isinstance(setup, dict):  # a finished run resumed, or Ctrl-C while setting up
        return setup
    b, plan = setup
    run, state = _open_run(r, b, run_path, resume_ckpt, writer=fabric.global_rank == 0)
    tracker = _open_tracking(r, b, fabric, run, plan, state.step if resume_ckpt is not None else None)
    cap = int(r.memory.cap_gib * GIB) if r.memory.cap_gib is not None else None
    monitor = mem.MemoryMonitor(fabric.device, cap) if (r.memory.enabled or cap is not None) else None
    summary: dict[str, Any] = {
        **{"name": r.name, "run_dir": str(run.path), "recipe": r.to_dict(), "device": device_info(fabric.device)},
        **{"versions": versions(), "parameters": b.params, "data": b.data_report.summary()},
        "total_steps": b.total_steps,
    }
    status, error = "ok", None
    try:
        with _stop_signals():
            fit(b, run, state, monitor, gpu_peak_flops(fabric.device, r.precision), tracker)
        if b.val_loader is not None and state.last_eval_step != state.step:
            run_eval(b, run, state, monitor, -1, tracker)
        save_at_end(b, run, state)
    except Preempted as e:
        status = "preempted" if e.signal == "SIGTERM" else "interrupted"
        save_checkpoint(b, run, state)
        summary["preempted_at_step"] = e.step
        summary["stopped_by"] = e.signal
        notice(f"{e.signal}: checkpoint written at step {e.step}; continue with --resume {run.path}")
    except KeyboardInterrupt:
        # Before the loop's stop handlers were in place, or a second Ctrl-C during the first step. Later
        # steps stop at once, as a second Ctrl-C asks, from the last checkpoint written.
        if state.step:
            tracker.close()
            raise
        if monitor is not None:
            monitor.end_step()
        status = "interrupted"
        summary["stopped_by"] = "SIGINT"
        notice(
            f"SIGINT before the first optimizer step: no checkpoint to write; `--resume {run.path}` starts this "
            "run afresh there"
        )
    except Exception as e:  # noqa: BLE001 - every failure becomes a recorded result
        if monitor is not None:
            monitor.end_step()
        if not mem.is_oom(e):
            status, error = "error", e
            record_error(e, r, fabric.world_size, summary)
        else:
            status = "oom"
            summary["oom"] = _record_oom(e, r, fabric, state, monitor, cap, hooks)
    summary.update(run_results(run, state, status, time.perf_counter() - t_start))
    summary.update(eval_summary(r, run, state))
    if hooks is not None:
        hooks.after_run(r, fabric.device, fabric.world_size, run.read_jsonl("memory.jsonl"), summary)
    run.write_json("summary.json", summary)
    model_dir = run.path / ("adapter" if r.peft.method != "none" else "model")
    tracker.finish(status, summary, run_artifacts(run.path, model_dir if r.tracking.log_model else None))
    if out.console is not None:
        print(summary_line(summary, run.path / "summary.json"), file=out.console, flush=True)
    if error is not None:
        raise error
    if status == "oom" and raise_on_oom:
        raise TrainingOOM(summary)
    return summary
