"""The parallel layouts that run inside a simulated step, on one process: torch's pipeline schedules for one
stage (the engine's PipelineRunner on an emulated schedule) and the sequence-parallel cuts and gathers of one
tensor-parallel rank (see layout/pipeline.py and layout/tensor_parallel.py for what the plan makes of them)."""

from __future__ import annotations

from typing import Optional

import torch

from bigtune.plan.base.constants import PlanError
from bigtune.recipe import Recipe


def boundary_dtype() -> torch.dtype:
    """The dtype of the hidden states the stages exchange: Fabric's module wrapper returns every output in the
    default dtype (float32) under every precision, so torch's schedule sizes its buffers in it."""
    return torch.get_default_dtype()


class EmulatedSchedule:
    """torch's ScheduleGPipe / Schedule1F1B for stage ``index`` of ``stages`` in one process: the same order of
    forwards and backwards, the same caches and receive buffers, no communication (the received activations and
    gradients are the buffers' contents, which fake tensors do not have anyway)."""

    def __init__(self, model, index: int, stages: int, n: int, kind: str, runner, act_shape, dtype):
        self.model, self.index, self.stages, self.n, self.kind = model, index, stages, n, kind
        self.runner = runner  # its loss, and its loop state, whose phase the time model files each operator under
        self.first, self.last = index == 0, index == stages - 1
        self.acts = [] if self.first else [torch.empty(act_shape, dtype=dtype, requires_grad=True) for _ in range(n)]
        self.grads = [] if self.last else [torch.empty(act_shape, dtype=dtype) for _ in range(n)]

    def buffers(self) -> list[torch.Tensor]:
        return [*self.acts, *self.grads]

    def order(self) -> list[tuple[str, int]]:
        """("F" | "B", micro-batch) in the order this stage runs them."""
        n = self.n
        if self.kind == "gpipe":
            return [("F", j) for j in range(n)] + [("B", j) for j in range(n)]
        warmup = min(n, self.stages - self.index)  # torch's Schedule1F1B
        ops = [("F", j) for j in range(warmup)]
        for j in range(n):
            ops.append(("B", j))
            if warmup + j < n:
                ops.append(("F", warmup + j))
        return ops

    def step(self, *args, target=None, losses: Optional[list] = None, return_outputs: bool = False) -> None:
        for a in self.acts:  # as torch's clear_runtime_states: last step's input gradients go now
            a.grad = None
        inputs = args[0].tensor_split(self.n) if self.first else self.acts
        targets = target.tensor_split(self.n) if self.last else None
        cache: dict[int, torch.Tensor] = {}
        computed: list[torch.Tensor] = []
        sending: list[torch.Tensor] = []  # input gradients on their way to the previous stage
        order = self.order()
        output = None  # torch's schedule keeps the latest forward's output in a local until the next forward returns
        # 1F1B sends the first warm-up forward's output alone and keeps that send until its steady loop ends
        warm_send = None
        for k, (op, j) in enumerate(order):
            self.runner.state.phase = "forward" if op == "F" else "backward"
            if op == "F":
                output = cache[j] = self.model(inputs[j])
                if j == 0 and self.kind != "gpipe" and not self.last and min(self.n, self.stages - self.index) > 1:
                    warm_send = output
                if self.last:
                    computed.append(self.runner.loss(cache[j], targets[j]))
                continue
            out = cache.pop(j)
            if self.last:
                computed[j].backward()
            else:
                torch.autograd.backward(out, grad_tensors=self.grads[j])
            del out
            if not self.first:
                # torch takes the gradient out of the buffer into its send. GPipe waits for every backward send
                # at the end of the step; 1F1B's list of send ops keeps the latest until the next backward's.
                if self.kind != "gpipe":
                    sending.clear()
                sending.append(inputs[j].grad)
                inputs[j].grad = None
            if all(o == "B" for o, _ in order[k + 1 :]):  # the backward that ends 1F1B's steady loop
                warm_send = None
        sending.clear()
        del output, warm_send
        if losses is not None:
            losses.extend(computed)


def emulated_runner(recipe: Recipe, fabric, wrapped, stage: int, config):
    """The engine's PipelineRunner for stage ``stage``, on the emulated schedule (call under FakeTensorMode)."""
    from bigtune.engine.pipeline import PipelineRunner

    rows = recipe.train.micro_batch_size // recipe.pipeline_microbatches
    shape = (rows, recipe.data.max_seq_length, config.hidden_size)
    dtype = boundary_dtype()
    p, m, kind = recipe.pipeline_parallel, recipe.pipeline_microbatches, recipe.pipeline_schedule
    make = lambda runner: EmulatedSchedule(wrapped, stage, p, m, kind, runner, shape, dtype)  # noqa: E731
    return PipelineRunner(recipe, fabric, wrapped, make_schedule=make, stage=stage)


_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def emulate_sequence_parallel(model, tp: int) -> None:
    """Hooks that lay out the simulated rank model as the engine's sequence_parallel_block_plan and
    sequence_parallel_stack_plan do, one rank of ``tp``: the first block's input cut to s / tp rows (a new
    tensor, as DTensor's Replicate → Shard(1) clones its chunk), each self_attn / mlp input gathered to s rows,
    each row-wise output cut back to s / tp rows, the final norm's input gathered. The collectives become local
    copies of the sizes the real ones allocate (their backward too: a cut's gradient is s rows, a gather's
    s / tp). The causal mask and positions still cover s rows: the stack computes them before the first block.
    With activation checkpointing the cut happens inside the first block's checkpoint here (the engine cuts
    before the block), which can count at most (1 - 1/tp) × b × s × h more, once (the tiny Llama's peak: equal)."""
    import torch

    from bigtune.models.build import decoder_blocks

    def cut(x):
        return x.narrow(1, 0, x.shape[1] // tp).clone()

    def gather(x):
        return torch.cat([x] * tp, dim=1)

    def on_hidden(fn):  # the hidden states, passed positionally (mlp, decoder layers) or by keyword (self_attn)
        def hook(module, args, kwargs):
            if args:
                return (fn(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}

        return hook

    blocks = decoder_blocks(model)
    try:
        parts = [
            (b.get_submodule("self_attn"), b.get_submodule("mlp"), [b.get_submodule(k) for k in _ROWWISE])
            for b in blocks
        ]
        norm = model.get_decoder().get_submodule("norm")
    except AttributeError as e:
        raise PlanError(f"sequence_parallel: the model is not laid out like Llama's decoder ({e})") from None
    blocks[0].register_forward_pre_hook(on_hidden(cut), with_kwargs=True)
    for attn, mlp, rowwise in parts:
        attn.register_forward_pre_hook(on_hidden(gather), with_kwargs=True)
        mlp.register_forward_pre_hook(on_hidden(gather), with_kwargs=True)
        for linear in rowwise:
            linear.register_forward_hook(lambda module, args, out: cut(out))
    norm.register_forward_pre_hook(on_hidden(gather), with_kwargs=True)
