"""What a run tells: notices, the final summary's figures and line, the versions and device."""

from __future__ import annotations

import contextlib
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from bigtune.core.rundir import RunDir
from bigtune.core.stepmath import GIB, human_bytes, throughput
from bigtune.engine.state import LoopState
from bigtune.recipe import Recipe

VERBOSITIES = ("quiet", "normal", "verbose")


# Notices are lines a user must see even with --quiet (a run length they did not ask for, a stop, an
# out-of-memory): on stdout with the rest normally, on stderr beside errors and warnings under --quiet.
NOTICES: dict[str, Any] = {"stream": None}  # None: the current sys.stdout


def notice(msg: str) -> None:
    """Print a line that --quiet still shows (on stderr there)."""
    print(msg, file=NOTICES["stream"], flush=True)


@dataclass
class Output:
    """What a run prints beyond its progress: see ``train``'s ``verbosity``."""

    console: Any  # the final summary line's stream (None: not this rank)
    verbose: bool = False
    show_recipe: bool = False
    afresh: bool = False  # say that a --resume starts the run afresh


@contextlib.contextmanager
def library_bars_off():
    """transformers' own tqdm bars ("Loading weights", "Writing model shards") off for the run: ours say
    what happens, and theirs interleave with it on stderr. Restored afterwards for the caller's own use."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # the engine runs without transformers only in the planner's unit tests
        yield
        return
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


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
    return {
        "type": "cpu",
        "name": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "count": 1,
    }


def gpu_peak_flops(device: torch.device, precision: str) -> Optional[float]:
    if device.type != "cuda":
        return None
    try:
        from bigtune.core.gpus import detect_gpu, peak_flops
    except ImportError:
        return None
    props = torch.cuda.get_device_properties(device)
    gpu = detect_gpu(props.name, props.total_memory)
    if gpu is None:
        return None
    return peak_flops(gpu, precision, allow_tf32=torch.backends.cuda.matmul.allow_tf32)


def device_capacity(device: torch.device, r: Recipe) -> Optional[int]:
    if r.memory.cap_gib is not None:
        return int(r.memory.cap_gib * GIB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def summary_line(summary: dict, path: Path) -> str:
    """The run's last line: how it ended, its loss, memory and speed, where the rest is."""
    parts = [f"status {summary['status']}"]
    if not summary.get("steps"):
        parts.append("stopped before the first optimizer step; no loss yet")
    else:
        parts.append(f"{summary['steps']} steps")
        if summary.get("final_loss") is not None:
            parts.append(f"final loss {summary['final_loss']:.4f}")
        if summary.get("peak_allocated_bytes") is not None:
            parts.append(f"peak allocated {human_bytes(summary['peak_allocated_bytes'])}")
        if summary.get("tokens_per_s"):
            parts.append(f"{summary['tokens_per_s']:,.0f} tok/s")
    return "; ".join(parts + [f"summary: {path}"])


def run_results(run: RunDir, state: LoopState, status: str, wall: float) -> dict:
    snaps = run.read_jsonl("memory.jsonl")
    peaks = [s["peak_allocated"] for s in snaps]
    reserved = [s["peak_reserved"] for s in snaps if s.get("peak_reserved") is not None]
    used = [s["device_used"] for s in snaps if s.get("device_used") is not None]
    metrics = run.read_jsonl("metrics.jsonl")
    tp = (
        throughput(state.tokens, state.samples, state.train_seconds)
        if state.train_seconds
        else {"tokens_per_s": None, "samples_per_s": None}
    )
    return {
        "status": status,
        "steps": state.step,
        "tokens": state.tokens,
        "samples": state.samples,
        "final_loss": metrics[-1]["loss"] if metrics else None,
        "first_loss": metrics[0]["loss"] if metrics else None,
        "epoch_losses": state.epoch_losses,
        "peak_allocated_bytes": max(peaks) if peaks else None,
        "peak_reserved_bytes": max(reserved) if reserved else None,
        # the most in use on the whole device at a snapshot (CUDA; what nvidia-smi shows)
        "peak_device_used_bytes": max(used) if used else None,
        "wall_seconds": wall,
        "train_seconds": state.train_seconds,
        "step_time_s": state.train_seconds / state.step if state.step else None,
        **tp,
        "mfu": metrics[-1].get("mfu") if metrics else None,
    }


def eval_summary(r: Recipe, run: RunDir, state: LoopState) -> dict:
    evals = run.read_jsonl("eval.jsonl")
    if not evals:
        return {}
    metric = r.eval.best_metric
    best_rec = min(evals, key=lambda e: e[metric] if metric == "val_loss" else -e[metric])
    return {
        "eval": {
            "final": evals[-1],
            "best_val_loss": state.best_val_loss,
            "best_metric": metric,
            "best_value": best_rec[metric],
            "best_step": best_rec["step"],
            "eval_peak_allocated_bytes": max((e["eval_peak_allocated"] or 0) for e in evals) or None,
        }
    }


def record_error(e: BaseException, r: Recipe, world: int, summary: dict) -> None:
    from bigtune.engine.strategies import collective_failure_hint

    summary["error"] = f"{type(e).__name__}: {e}"
    hint = collective_failure_hint(e, r, world)
    if hint:
        summary["error_hint"] = hint
        print(hint, file=sys.stderr, flush=True)  # every rank: the others' stdout is silenced
