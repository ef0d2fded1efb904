"""A tracker of live tensor storages (a TorchDispatchMode): on a CPU it measures what CUDA's allocator
would report, and under fake tensors it records the planner's allocation trace.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bigtune.core.stepmath import GIB, plain_tensors


class SimulatedOOM(torch.OutOfMemoryError):
    """Raised by the CPU tracker when live bytes exceed ``memory.cap_gib``."""


# Trackers inside their `with`: told of every storage resize_, which no dispatch mode sees. FSDP2
# gathers each unit's weights into storages it grows with resize_(n) and frees with resize_(0); a
# tracker blind to that counted every weight ever gathered as alive until the step ended.
_RESIZE_WATCHERS: list["LiveTensorTracker"] = []

_ORIGINAL_RESIZE = torch.UntypedStorage.resize_


def _watched_resize(storage, size):
    out = _ORIGINAL_RESIZE(storage, size)
    for tracker in list(_RESIZE_WATCHERS):
        tracker.resized(storage)
    return out


class LiveTensorTracker(TorchDispatchMode):
    """Counts the bytes of live tensor storages; exact on CPU and on fake tensors.

    ``live_bytes`` is what is alive now, ``peak_bytes`` the most since ``reset_peak()``.
    """

    def __init__(self, cap_bytes: Optional[int] = None, round_to: int = 1, events: Optional[list] = None):
        super().__init__()
        # With a list, every registration and death is appended in order, as ("alloc", serial,
        # nbytes) / ("free", serial): the planner replays it through allocator.CachingAllocator.
        self.events = events
        # > 0 inside untraced(): storages born there are counted but left out of ``events``
        self._untraced = 0
        self._serial: dict[int, int] = {}
        self.cap_bytes = cap_bytes
        # The planner sets 512 to emulate the CUDA caching allocator, which rounds every block up.
        self.round_to = round_to
        self._sizes: dict[int, int] = {}
        self._refs: dict[int, Any] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.window_peak = 0  # the most since reset_window(): one phase of a step
        # Storages marked by hold() (model states: weights, gradients, optimizer state) and the window's
        # high of everything else (activations, gathered copies, temporaries): the planner rebuilds a
        # sharded step's peak from it, since the states it sees are not the ones a rank holds.
        self._held: set[int] = set()
        self.held_bytes = 0
        self.window_unheld_peak = 0
        # the same high from late_start() on (None before; MemoryMonitor.follow_gradients starts it at the
        # backward's first repeated block or first stored gradient): past the loss and logits
        self.window_unheld_late: Optional[int] = None
        # held bytes when the window began, and the late high of everything but those (so with the
        # window's new gradients): see MemoryMonitor.snapshot's phase_gradients_pending_late
        self.window_held_start = 0
        self.window_live_late = 0
        # Highs of the window's segments (mark_segment: the engine marks each micro-batch's forward and
        # backward), closed ones in order, as (peak, unheld peak): the planner extrapolates each on its own,
        # since the point of a window that holds its high can move with the model's depth.
        self.segment_peaks: list[tuple[int, int]] = []
        self._segment_peak = self._segment_unheld_peak = 0
        self._generation = 0
        # Called as observer(func, args, kwargs, out) after each operator: the planner's time model
        # (roofline.OpCounter.observe) rides on this mode instead of stacking a second one.
        self.observer: Optional[Any] = None

    # Storages are keyed by id(); the weak-reference callback removes the key when the storage
    # dies, before Python can hand the same id to a new object.
    def _on_free(self, key: int, generation: int) -> None:
        if generation != self._generation:
            return
        size = self._sizes.pop(key, None)
        self._refs.pop(key, None)
        if size is not None:
            self.live_bytes -= size
            if key in self._held:
                self._held.discard(key)
                self.held_bytes -= size
            serial = self._serial.pop(key, None)
            if self.events is not None and serial is not None:
                self.events.append(("free", serial))

    def __enter__(self):
        _RESIZE_WATCHERS.append(self)
        if len(_RESIZE_WATCHERS) == 1:
            torch.UntypedStorage.resize_ = _watched_resize
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self in _RESIZE_WATCHERS:
                _RESIZE_WATCHERS.remove(self)
            if not _RESIZE_WATCHERS:
                torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE

    def resized(self, st) -> None:
        """A storage changed size in place: count its new size (registering it if it is new)."""
        key = id(st)
        if key not in self._sizes:
            self._register(st)
            self._after_growth()
            return
        size = -(-st.nbytes() // self.round_to) * self.round_to
        self.live_bytes += size - self._sizes[key]
        if key in self._held:
            self.held_bytes += size - self._sizes[key]
        self._sizes[key] = size
        if self.events is not None:
            serial = self._serial.pop(key, None)
            if serial is not None:
                self.events.append(("free", serial))
            if st.nbytes() and not self._untraced:
                self._serial[key] = len(self.events)
                self.events.append(("alloc", len(self.events), st.nbytes()))
        self._after_growth()

    def _register(self, st) -> None:
        key = id(st)
        size = -(-st.nbytes() // self.round_to) * self.round_to
        gen = self._generation
        try:
            self._refs[key] = weakref.ref(st, lambda _r, k=key, g=gen: self._on_free(k, g))
        except TypeError:
            return
        self._sizes[key] = size
        self.live_bytes += size
        if self.events is not None and st.nbytes() and not self._untraced:
            self._serial[key] = len(self.events)
            self.events.append(("alloc", len(self.events), st.nbytes()))

    def track(self, tensors: Iterable[Any]) -> None:
        # DTensor (FSDP2): the memory is its local shard; NF4Tensor: its packed data and constants
        for t in (leaf for x in tensors if isinstance(x, torch.Tensor) for leaf in plain_tensors(x)):
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            if id(st) not in self._sizes:
                self._register(st)
        self._after_growth()

    @contextlib.contextmanager
    def untraced(self):
        """Storages born inside stay out of ``events`` (still counted live): on a GPU they would be host
        memory, such as a CPU-offloaded optimizer's state and the temporaries of its host-side update."""
        self._untraced += 1
        try:
            yield
        finally:
            self._untraced -= 1

    def hold(self, tensors: Iterable[Any]) -> None:
        """Count these tensors' storages as model states from now on (registering them if new)."""
        tensors = [leaf for t in tensors if isinstance(t, torch.Tensor) for leaf in plain_tensors(t)]
        self.track(tensors)
        for t in tensors:
            try:
                key = id(t.untyped_storage())
            except (RuntimeError, NotImplementedError, TypeError):
                continue
            if key in self._sizes and key not in self._held:
                self._held.add(key)
                self.held_bytes += self._sizes[key]

    def gradient_stored(self, grad: torch.Tensor, starts_late: bool = True) -> None:
        """Autograd stored a gradient: hold it as a model state (and start the window's late high)."""
        self.hold([grad])
        if starts_late:
            self.late_start()

    def late_start(self) -> None:
        """From now on this window also tracks its late high (see window_unheld_late)."""
        if self.window_unheld_late is None:
            self.window_unheld_late = self.live_bytes - self.held_bytes
            self.window_live_late = self.live_bytes - self.window_held_start

    def mark_segment(self) -> None:
        """Close the window's current segment (its highs go to segment_peaks) and start the next."""
        self.segment_peaks.append((self._segment_peak, self._segment_unheld_peak))
        self._segment_peak, self._segment_unheld_peak = self.live_bytes, self.live_bytes - self.held_bytes

    def _after_growth(self) -> None:
        unheld = self.live_bytes - self.held_bytes
        if unheld > self._segment_unheld_peak:
            self._segment_unheld_peak = unheld
        if self.live_bytes > self._segment_peak:
            self._segment_peak = self.live_bytes
        if unheld > self.window_unheld_peak:
            self.window_unheld_peak = unheld
        if self.window_unheld_late is not None:
            self.window_unheld_late = max(self.window_unheld_late, unheld)
            self.window_live_late = max(self.window_live_late, self.live_bytes - self.window_held_start)
        if self.live_bytes > self.window_peak:
            self.window_peak = self.live_bytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            if self.cap_bytes is not None and self.live_bytes > self.cap_bytes:
                raise SimulatedOOM(
                    f"out of memory: {self.live_bytes / GIB:.3f} GiB live exceeds memory.cap_gib "
                    f"({self.cap_bytes / GIB:.3f} GiB)"
                )

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self.reset_window()

    def reset_window(self) -> None:
        self.window_peak = self.live_bytes
        self.window_unheld_peak = self.live_bytes - self.held_bytes
        self.window_unheld_late = None
        self.window_held_start, self.window_live_late = self.held_bytes, 0
        self.segment_peaks = []
        self._segment_peak, self._segment_unheld_peak = self.window_peak, self.window_unheld_peak

    def clear(self) -> None:
        self._generation += 1
        self._sizes.clear()
        self._refs.clear()
        self._serial.clear()
        self.live_bytes = 0
        self.peak_bytes = self.held_bytes = 0
        self._held.clear()
        self.reset_window()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.track(tree_flatten(out)[0])
        if self.observer is not None:
            self.observer(func, args, kwargs or {}, out)
        return out
