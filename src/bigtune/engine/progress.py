"""Training progress for a person: a live bar on a terminal, plain lines everywhere else.

On a terminal (rank 0's stdout is a TTY) a rich progress bar shows step / total, the last logged loss,
tokens/s, memory (GiB; MiB below one) and the time left, redrawn in place; lines the run prints meanwhile (memory tables,
epoch averages, evaluations) scroll above it. Anywhere else (a log file, CI, a notebook, a pipe) each logged
step is one plain line, ``step 4/24 [ 16.7%] loss 2.9012 lr 1.00e-03 1,234 tok/s eta    12s``, which tools
and tests parse. Under --quiet (and on the other ranks) stdout is not a terminal, so neither is shown.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional

import torch

from bigtune.core.stepmath import human_bytes


def memory_in_use(device: torch.device, monitor: Any = None) -> Optional[int]:
    """Bytes to show beside the progress: CUDA's reserved memory (close to what nvidia-smi shows), else the
    peak allocation of the memory monitor's last snapshot (``monitor``: a MemoryMonitor or None); None when
    neither is known."""
    if device.type == "cuda":
        return torch.cuda.memory_reserved(device)
    last = getattr(monitor, "last", None)
    return last.peak_allocated if last is not None else None


class Progress:
    """The loop's progress: ``with Progress(total, start) as p:``, then ``p.step(n)`` after every optimizer
    step and ``p.log(n, rec)`` after every logged one (``rec``: the metrics record).

    ``console``: a ``rich.console.Console`` to draw the bar on (None: a bar on stdout when stdout is a
    terminal, plain lines otherwise)."""

    def __init__(self, total: int, start: int = 0, console: Any = None):
        self.total, self.start = total, start
        self.console = console
        if console is None and sys.stdout.isatty():
            from rich.console import Console

            self.console = Console(file=sys.stdout)
        self.t0 = time.perf_counter()
        self._bar: Any = None
        self._task: Any = None

    @property
    def live(self) -> bool:
        """Whether progress is a live bar (else plain lines)."""
        return self.console is not None

    def __enter__(self) -> Progress:
        if self.live:
            # rich is imported only here: `import bigtune` and runs that log to files do without it
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn("step"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[speed]} tok/s"),
                TextColumn("mem {task.fields[memory]}"),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._bar.add_task(
                "train", total=self.total, completed=self.start, loss="-", speed="-", memory="-"
            )
            self._bar.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.stop()  # the bar's last state stays on the screen
            self._bar = None

    def step(self, step: int) -> None:
        """Optimizer step ``step`` is done (1-based: the steps taken so far)."""
        if self._bar is not None:
            self._bar.update(self._task, completed=step)

    def log(self, step: int, rec: dict, memory_bytes: Optional[int] = None) -> None:
        """A logged step: its record's loss, lr and tokens/s; ``memory_bytes`` as ``memory_in_use`` gives it."""
        if self._bar is not None:
            speed, memory = f"{rec['tokens_per_s']:,.0f}", human_bytes(memory_bytes)  # GiB, or MiB below 1 GiB
            self._bar.update(self._task, completed=step, loss=f"{rec['loss']:.4f}", speed=speed, memory=memory)
            return
        done = step / max(1, self.total)
        # the rate of this process's own steps: a resumed run's earlier steps took none of its time
        ran = (step - self.start) / max(1, self.total)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / ran * (1 - done) if ran > 0 else float("nan")
        text = f"loss {rec['loss']:.4f} lr {rec['lr']:.2e} {rec['tokens_per_s']:,.0f} tok/s"
        print(f"step {step}/{self.total} [{done:5.1%}] {text} eta {eta:5.0f}s", flush=True)
