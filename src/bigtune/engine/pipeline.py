"""Pipeline parallelism (pipeline_parallel > 1) with torch.distributed.pipelining: one stage per rank.

The decoder stack is split evenly: stage 0 holds the embeddings and its layers, the last stage its layers, the
final norm, the output layer and the loss. Each stage keeps Hugging Face's parameter names (the layers sit in a
ModuleDict keyed by their index in the whole model), so the stages' state dicts are disjoint pieces of the whole
model's: export gathers them into one Hugging Face folder, a checkpoint is one file per stage.

Every rank reads the same micro-batches (there is no data parallelism beside the pipeline). A micro-batch of
train.micro_batch_size rows is padded to (micro_batch_size, data.max_seq_length) and split into
train.pipeline_microbatches pipeline micro-batches: the stages exchange activations of one fixed shape (the
schedule sizes its receive buffers once). Padding is appended on the right with label -100, so it changes
no loss: under the causal mask no real token attends to a later one. The stage handed to torch is Fabric's
wrapped module (its precision's autocast and casts apply), which returns float32: the hidden states travel in
float32 under every precision.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

import torch

from bigtune.core.stepmath import IGNORE_INDEX, causal_lm_loss_sum, loss_normaliser, target_token_count
from bigtune.recipe import Recipe, RecipeError

# Model types whose decoder forward StageModule repeats (embed, rotary, causal mask, layers, norm, head).
PIPELINE_MODEL_TYPES = ("llama",)


def make_pipeline_strategy(timeout, backend: Optional[str]):
    """A DDPStrategy that launches the ranks and their process group but leaves each rank's stage unwrapped (no
    gradient all-reduce: the stages hold different weights) and writes one checkpoint file per stage."""
    from lightning.fabric.strategies import DDPStrategy

    class PipelineStrategy(DDPStrategy):
        def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
            return module

        def save_checkpoint(self, path, state, storage_options=None, filter=None) -> None:
            state = self._convert_stateful_objects_in_state(state, filter=(filter or {}))
            self.checkpoint_io.save_checkpoint(checkpoint=state, path=_stage_file(path, self.global_rank))

        def load_checkpoint(self, path, state=None, strict=True, weights_only=None):
            return super().load_checkpoint(_stage_file(path, self.global_rank), state, strict, weights_only)

    return PipelineStrategy(timeout=timeout, process_group_backend=backend)


def _stage_file(path, rank: int) -> Path:
    return Path(path) / f"stage-{rank}.pt"


def is_pipeline(fabric) -> bool:
    return type(getattr(fabric, "strategy", None)).__name__ == "PipelineStrategy"


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """The decoder layers (indices in the whole model) stage ``stage`` of ``stages`` holds."""
    per = num_layers // stages
    return range(stage * per, (stage + 1) * per)


def check_model(model: torch.nn.Module, stages: int) -> None:
    """Raise RecipeError naming pipeline_parallel when ``model`` cannot be split into ``stages`` even stages."""
    config = model.config
    problems = []
    if config.model_type not in PIPELINE_MODEL_TYPES:
        problems.append(
            f"pipeline_parallel={stages}: model type {config.model_type!r} is not split into stages (supported: "
            f"{', '.join(PIPELINE_MODEL_TYPES)}); use pipeline_parallel=1 or strategy=fsdp"
        )
    if config.num_hidden_layers % stages:
        problems.append(
            f"pipeline_parallel={stages} does not divide the model's num_hidden_layers={config.num_hidden_layers}: "
            "stages hold equal numbers of layers; pick a pipeline_parallel that divides it"
        )
    if getattr(config, "tie_word_embeddings", False):
        problems.append(
            f"pipeline_parallel={stages}: the model ties its output layer to its embeddings, which would live on "
            "the first and last stages; use pipeline_parallel=1 or strategy=fsdp"
        )
    if problems:
        raise RecipeError(problems)


class StageModule(torch.nn.Module):
    """One pipeline stage of a Llama-style causal LM, with the whole model's parameter names."""

    def __init__(self, causal_lm: torch.nn.Module, stage: int, stages: int, layers: Optional[range] = None):
        super().__init__()
        inner = causal_lm.model
        # ``layers``: which of causal_lm's layers this stage holds (the planner's shallow copies: all of them)
        ids = layers if layers is not None else stage_layers(causal_lm.config.num_hidden_layers, stages, stage)
        inner.layers = torch.nn.ModuleDict({str(i): inner.layers[i] for i in ids})
        self.is_first, self.is_last = stage == 0, stage == stages - 1
        if not self.is_first:
            inner.embed_tokens = None
        if not self.is_last:
            inner.norm = None
            causal_lm.lm_head = None
        self.model = inner
        self.lm_head = causal_lm.lm_head
        # This stage's layers: what the FLOP count (stepmath.flop_shape) counts on this rank.
        self.config = copy.copy(causal_lm.config)
        self.config.num_hidden_layers = len(ids)
        self._whole = [causal_lm]  # a list: not a submodule; export writes through its save_pretrained

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        m = self.model
        h = m.embed_tokens(x) if self.is_first else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        # No padding mask: padding is on the right, where the causal mask already keeps real tokens from it.
        mask = create_causal_mask(config=m.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos)
        rope = m.rotary_emb(h, position_ids=pos)
        for layer in m.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos)
        return self.lm_head(m.norm(h)) if self.is_last else h

    def save_pretrained(self, path, state_dict: dict, **kwargs) -> None:
        self._whole[0].save_pretrained(path, state_dict=state_dict, **kwargs)


def split_model(recipe: Recipe, fabric, model: torch.nn.Module) -> StageModule:
    """This rank's stage of ``model`` (built whole with the run's seed, so every stage starts from the single
    process's weights); the other stages' modules are dropped."""
    check_model(model, recipe.pipeline_parallel)
    return StageModule(model, fabric.global_rank, recipe.pipeline_parallel)


class PipelineRunner:
    """The stage and schedule of this rank, and one optimizer step over a window's micro-batches.

    ``make_schedule(runner)``: something with torch's schedule ``step`` and a ``buffers()`` list instead of
    torch's (the planner's emulation on fake tensors, plan/layout/pipeline.py), for stage ``stage`` (default: this
    rank's)."""

    def __init__(self, recipe: Recipe, fabric, model, make_schedule=None, stage: Optional[int] = None):
        self.recipe, self.fabric = recipe, fabric
        self.stages = recipe.pipeline_parallel
        index = fabric.global_rank if stage is None else stage
        self.is_first, self.is_last = index == 0, index == self.stages - 1
        self.scale = 1.0
        self.emulated = make_schedule is not None
        if self.emulated:
            schedule = make_schedule(self)
        else:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            self.stage = PipelineStage(model, index, self.stages, fabric.device)
            kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[recipe.pipeline_schedule]
            # scale_grads=False: the loss is already normalised over the whole step (stepmath.loss_normaliser).
            schedule = kind(self.stage, recipe.pipeline_microbatches, loss_fn=self.loss, scale_grads=False)
        self.schedule = schedule
        self.shape = (recipe.train.micro_batch_size, recipe.data.max_seq_length)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss_sum(logits, labels, True) * self.scale

    def buffers(self) -> list[torch.Tensor]:
        """The schedule's receive buffers (activations from the previous stage, gradients from the next), one per
        pipeline micro-batch, allocated at the first step and kept: registered with the memory monitor."""
        if self.emulated:
            return self.schedule.buffers()
        infos = [*self.stage.args_recv_info.values(), *self.stage.grad_recv_info.values()]
        return [x.buffer for info in infos for x in info if getattr(x, "buffer", None) is not None]

    def _padded(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        rows, length = self.shape
        ids = torch.zeros(self.shape, dtype=torch.long)
        labels = torch.full(self.shape, IGNORE_INDEX, dtype=torch.long)
        b, n = batch["input_ids"].shape
        n = min(n, length)  # rows are built no longer than data.max_seq_length
        ids[:b, :n], labels[:b, :n] = batch["input_ids"][:, :n], batch["labels"][:, :n]
        return ids.to(self.fabric.device), labels.to(self.fabric.device)

    def step(
        self,
        b,
        batches: list[dict],
        monitor,
        measure: bool,
        state,
        token_count: Optional[int],
        clip_gradients,
    ) -> tuple[torch.Tensor, list]:
        """What engine.loop.train_step does, through the schedule: returns (the window's loss on every rank, this
        rank's memory snapshots). Every rank reads the whole window, so the token count needs no all-reduce
        (``token_count``: given by the planner, whose fake labels cannot be counted). ``clip_gradients`` is the
        loop's own clip (engine.strategies), handed in so that this module stays below the strategies."""
        fabric, model, opt = self.fabric, b.model, b.optimizer
        self.state = state  # the emulated schedule names its phases in it
        labels = [x["labels"] for x in batches]
        if token_count is None:
            token_count = sum(int(target_token_count(x, True)) for x in labels)
        self.scale = loss_normaliser(labels, 1, token_count, True)
        snaps: list = []
        track = monitor is not None and (measure or monitor.cap_bytes is not None and not monitor.is_cuda)
        loss_total = torch.zeros((), device=fabric.device)
        for i, batch in enumerate(batches):
            ids, target = self._padded(batch)
            if track and i == 0:
                monitor.begin_step(model, opt, extra=(ids, target, *self.buffers()))
            if measure and i == 0:
                snaps.append(monitor.snapshot(state.step, "before_forward", model, opt))
            state.phase = "forward"  # the schedule interleaves forwards and backwards
            losses: list = []
            self.schedule.step(
                *((ids,) if self.is_first else ()),
                **({"target": target, "losses": losses} if self.is_last else {}),
                return_outputs=False,
            )
            if losses:
                loss_total += torch.stack([x.detach() for x in losses]).sum()
        if measure:
            snaps.append(monitor.snapshot(state.step, "after_backward", model, opt))
        state.phase = "optimizer"
        if self.recipe.optim.grad_clip is not None:
            state.grad_norm = clip_gradients(fabric, model, opt, self.recipe.optim.grad_clip).detach()
        opt.step()
        b.scheduler.step()
        if measure:
            snaps.append(monitor.snapshot(state.step, "after_optimizer", model, opt))
        opt.zero_grad(set_to_none=True)
        if track:
            monitor.end_step()
        if not self.emulated:
            torch.distributed.broadcast(loss_total, src=self.stages - 1)  # the loss lives on the last stage
        state.aux_loss = None
        return loss_total, snaps


def gather_state_dict(fabric, module: torch.nn.Module) -> dict[str, Any]:
    """The whole model's state dict on rank 0 (every rank's call; {} elsewhere): the stages' disjoint pieces."""
    local = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    pieces = [None] * fabric.world_size if fabric.global_rank == 0 else None
    torch.distributed.gather_object(local, pieces, dst=0)
    if fabric.global_rank != 0:
        return {}
    return {k: v for piece in pieces for k, v in piece.items()}


def global_grad_norm_clip(module: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to the norm of every stage's gradients together (each rank holds a disjoint part of the model);
    returns that norm."""
    params = [p for p in module.parameters() if p.grad is not None]
    device = next(module.parameters()).device
    local = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros((), device=device)
    squared = local.double() ** 2
    torch.distributed.all_reduce(squared)
    total = squared.sqrt().to(local.dtype)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
