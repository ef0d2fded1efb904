"""One log window's bookkeeping: tokens, samples, model FLOPs, the loss and the wall time since the
window opened, closed into one metrics record. The arithmetic itself lives in ``bigtune.core.stepmath``."""

from __future__ import annotations

import math
import time
from typing import Optional

import torch

from bigtune.core.stepmath import IGNORE_INDEX, causal_pairs, flop_shape, mfu, throughput, training_flops


def batch_tokens(batch: dict) -> int:
    """Tokens a batch trains on, in data.max_seq_length's unit (what the planner's tokens/s counts): the
    real input tokens of a text batch; the caption tokens of an image-to-text batch (its labels), not the
    image tokens ahead of an OPT caption nor a T5 encoder's fixed input."""
    if "pixel_values" in batch:
        return int((batch["labels"] != IGNORE_INDEX).sum())
    return int(batch["attention_mask"].sum())


class WindowMeter:
    """Counts what the steps of one log window did; ``close_window`` turns it into a metrics record.

    The loss is summed on the device and read once per window, the only host sync of the loop; tokens
    and samples are counted on the host-side batch. Across ranks, the loss is averaged and the tokens
    summed when the window closes.
    """

    def __init__(self, fabric, model: torch.nn.Module, peak_flops: Optional[float]):
        self.fabric = fabric
        self.peak_flops = peak_flops
        self.shape = flop_shape(model) or None  # None: a model whose FLOPs are not counted
        self.loss = torch.zeros((), device=fabric.device)
        from bigtune.engine.strategies import data_parallel, tensor_parallel_size

        # Under tensor parallelism a group of ranks reads one batch and splits its model FLOPs.
        self.data_parallel_size, self.tensor_parallel = data_parallel(fabric)[1], tensor_parallel_size(fabric)
        self._reset()

    def _reset(self) -> None:
        self.tokens = self.samples = self.steps = 0
        self.flops = 0.0
        self.loss.zero_()
        self.t0 = time.perf_counter()

    def add(self, batches: list[dict], loss: torch.Tensor, state) -> None:
        """One optimizer step's micro-batches and its (device) loss; advances ``state.tokens/samples``."""
        tokens = sum(batch_tokens(x) for x in batches)  # this rank's; summed when the window closes
        # Equal shares per rank; a packed row holds several samples.
        samples = sum(x.get("samples", x["input_ids"].shape[0]) for x in batches) * self.data_parallel_size
        if self.shape:
            flops = sum(
                training_flops(
                    self.shape, int(x["attention_mask"].sum()), causal_pairs(x["attention_mask"], x.get("position_ids"))
                )
                for x in batches
            )
            self.flops += flops / self.tensor_parallel  # this rank's share
        state.tokens += tokens
        state.samples += samples
        self.tokens += tokens
        self.samples += samples
        self.loss += loss
        self.steps += 1

    def close_window(self, state, epoch: int, lr: float) -> dict:
        """The window's metrics record; also adds its loss to ``state``'s loss curve."""
        mean_loss = (self.loss / self.steps).item()
        if self.fabric.world_size > 1:
            from bigtune.engine.strategies import all_sum

            mean_loss = all_sum(self.fabric, mean_loss) / self.fabric.world_size
            global_tokens = int(all_sum(self.fabric, self.tokens, data_parallel_only=True))
            state.tokens += global_tokens - self.tokens
            self.tokens = global_tokens
        if not math.isfinite(mean_loss):
            raise FloatingPointError(
                f"loss became {mean_loss} by step {state.step}: lower optim.lr, set optim.grad_clip, or use "
                "bf16 instead of fp16 precision"
            )
        dt = time.perf_counter() - self.t0
        state.train_seconds += dt
        tp = throughput(self.tokens, self.samples, dt)
        rec = {
            "step": state.step,
            "epoch": epoch,
            "loss": mean_loss,
            "lr": lr,
            "step_time_s": dt / self.steps,
            **tp,
            "model_flops_per_s": self.flops / dt,
            "mfu": mfu(self.flops / dt, self.peak_flops),
            "tokens": state.tokens,
        }
        state.losses.append(mean_loss)  # (the epoch's average counts every step itself: engine/loop.py fit)
        self._reset()
        return rec
