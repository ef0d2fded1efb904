"""A model of PyTorch's CUDA caching allocator, to predict *reserved* memory from an allocation trace.

``torch.cuda.memory_reserved`` is what the process holds from the driver (and what ``nvidia-smi``
shows, plus the CUDA context); it exceeds the allocated bytes because the caching allocator keeps
freed blocks for reuse and carves requests out of larger segments. The planner's simulation sees
every tensor storage created and freed during a training step, in order (memory.LiveTensorTracker
with ``events``); replaying that sequence through this model gives the reserved bytes a GPU would
show, instead of a fixed ratio.

What is modelled (c10/cuda/CUDACachingAllocator.cpp, default settings: no expandable segments, no
``max_split_size_mb``, no garbage-collection threshold, one stream):

* Requests are rounded up to 512 bytes. Requests of at most 1 MiB come from the *small* pool, the
  rest from the *large* pool.
* A request is served by the smallest cached free block of its pool that is large enough (ties:
  lowest address). If none is, a new segment is reserved: 2 MiB for small requests, 20 MiB for
  requests under 10 MiB, otherwise the request rounded up to 2 MiB.
* The block is split when the remainder is worth keeping (small pool: at least 512 bytes; large
  pool: more than 1 MiB); otherwise the whole block is handed out and counts as allocated.
* A freed block merges with free neighbours in its segment and goes back to the cache; segments are
  never returned (short of an out-of-memory retry or ``empty_cache``).

What happens near the capacity is modelled too (``capacity``): when a new segment would not fit, PyTorch
frees every cached block that is a whole segment and asks again (``release_cached_blocks`` from
``malloc``; torch.cuda.memory_stats' ``num_alloc_retries``); only if that is still short is it an
out-of-memory error. Blocks still cut from a segment that holds a live one are never given back. So a
trace that reserves more than a device has on a GPU with room to spare can still run on it: cached
segments are freed at the worst moments and later requests get segments of their own size instead of
pieces of big cached ones. ``least_capacity`` finds the smallest device on which a trace survives:
that is what FITS/OOM is judged by, not the reserved peak of an unbounded replay.

Not modelled: kernels' internal workspaces and several streams (NCCL, FSDP prefetch).

Each rule above is checked against the C++ functions it models (round_size, get_allocation_size,
get_free_block, should_split, free_block's merge) on synthetic traces reasoned by hand (tests/test_allocator.py).
A high reserved/allocated ratio on large-vocabulary models (1.2-1.25 for Qwen's 152k tokens at 4 x 512) is the
trace, not the replay: the engine's loss (core.stepmath.causal_lm_loss_sum) copies the shifted logits,
(T-1) rows whose 2 MiB-rounded segments cannot serve the T-row fp32 logits' gradient, so the backward
reserves one more logits-sized segment. A loss that shifts the labels instead (transformers' ForCausalLMLoss,
and this engine's chunked loss) keeps those blocks one size: 1.08-1.10 on the same plans.

Also not modelled: a run's micro-batches of different lengths. The planner replays steps of one shape
(full rows). Padded to their longest sample, real batches change shape every step, and cached blocks cut
for one shape often cannot serve the next, so reserved creeps up over a run. With this model, six steps of
random lengths (200-512 tokens) before the full-length one lift an 8-layer TinyLlama's reserved from 1.07
to 1.30-1.58 times its peak allocated (three seeds, bench/varlen_reserved.py), while the segments in use at
the peak, what decides FITS, move by 3 % at most. The lab's printouts, taken early in their runs, sit
0-19 % above the fixed-shape replay. Packed or fixed-length data does not creep.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Optional

MIN_BLOCK = 512

SMALL_SIZE = 1 << 20  # requests up to 1 MiB use the small pool

SMALL_BUFFER = 2 << 20  # small-pool segments are 2 MiB

LARGE_BUFFER = 20 << 20  # requests under 10 MiB get a 20 MiB segment

MIN_LARGE_ALLOC = 10 << 20

ROUND_LARGE = 2 << 20  # larger requests: their own segment, rounded up to 2 MiB


def round_size(nbytes: int) -> int:
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Segment:
    __slots__ = ("size", "live")

    def __init__(self, size: int):
        self.size, self.live = size, 0  # live: allocated blocks in it


class _Block:
    __slots__ = ("addr", "size", "small", "free", "prev", "next", "segment")

    def __init__(self, addr: int, size: int, small: bool, segment: _Segment):
        self.addr, self.size, self.small, self.free, self.segment = addr, size, small, True, segment
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None


class AllocatorOOM(RuntimeError):
    """A request that does not fit the capacity even after the cached segments were given back."""

    def __init__(self, nbytes: int, reserved: int, capacity: int):
        super().__init__(f"{nbytes} bytes requested with {reserved} of {capacity} bytes reserved by live segments")
        self.nbytes, self.reserved, self.capacity = nbytes, reserved, capacity


@dataclass
class AllocatorStats:
    """Byte counters as torch.cuda.memory_stats keeps them, plus ``in_use``: the bytes of segments
    holding at least one allocated block, the part of reserved that PyTorch cannot give back when a
    reservation fails. ``alloc_retries``: how often the cache was emptied to make room (torch's
    ``num_alloc_retries``)."""

    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    segments: int = 0
    in_use: int = 0
    peak_in_use: int = 0
    alloc_retries: int = 0


@dataclass
class CachingAllocator:
    """Replays malloc/free requests; ``stats`` follows torch.cuda.memory_stats' byte counters.
    ``capacity``: the bytes the device can give this process (None: as much as asked)."""

    stats: AllocatorStats = field(default_factory=AllocatorStats)
    capacity: Optional[int] = None

    def __post_init__(self):
        self._pools: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # (size, addr) of free blocks
        self._free_at: dict[int, _Block] = {}
        self._next_addr = 0

    def _cache(self, b: _Block) -> None:
        b.free = True
        bisect.insort(self._pools[b.small], (b.size, b.addr))
        self._free_at[b.addr] = b

    def _uncache(self, b: _Block) -> None:
        pool = self._pools[b.small]
        del pool[bisect.bisect_left(pool, (b.size, b.addr))]
        del self._free_at[b.addr]

    def malloc(self, nbytes: int) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i < len(pool):
            block = self._free_at[pool[i][1]]
            self._uncache(block)
        else:  # a new segment from the driver
            seg = segment_size(size)
            if self.capacity is not None and self.stats.reserved + seg > self.capacity:
                # cudaMalloc would fail: give back the wholly cached segments and try once more
                self.stats.alloc_retries += 1
                self.release_cached_blocks()
                if self.stats.reserved + seg > self.capacity:
                    raise AllocatorOOM(nbytes, self.stats.reserved, self.capacity)
            block = _Block(self._next_addr, seg, small, _Segment(seg))
            self._next_addr += seg + ROUND_LARGE  # segments never touch: no merging across them
            s = self.stats
            s.reserved += seg
            s.segments += 1
            s.peak_reserved = max(s.peak_reserved, s.reserved)
        remaining = block.size - size
        if (remaining >= MIN_BLOCK) if small else (remaining > SMALL_SIZE):
            rest = _Block(block.addr + size, remaining, small, block.segment)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._cache(rest)
        block.free = False
        s = self.stats
        s.allocated += block.size
        s.peak_allocated = max(s.peak_allocated, s.allocated)
        if block.segment.live == 0:
            s.in_use += block.segment.size
            s.peak_in_use = max(s.peak_in_use, s.in_use)
        block.segment.live += 1
        return block

    def release_cached_blocks(self) -> int:
        """Give every cached block that is a whole segment back to the driver (release_cached_blocks ->
        release_blocks, which skips blocks with a neighbour: a split segment stays); the bytes freed.
        This is also what torch.cuda.empty_cache does."""
        whole = [
            self._free_at[addr]
            for small in (True, False)
            for _, addr in self._pools[small]
            if self._free_at[addr].prev is None and self._free_at[addr].next is None
        ]
        for b in whole:
            self._uncache(b)
        freed = sum(b.size for b in whole)
        self.stats.reserved -= freed
        self.stats.segments -= len(whole)
        return freed

    def free(self, block: _Block) -> None:
        self.stats.allocated -= block.size
        block.segment.live -= 1
        if block.segment.live == 0:
            self.stats.in_use -= block.segment.size
        for other in (block.prev, block.next):
            if other is not None and other.free:  # merge with a free neighbour of the same segment
                self._uncache(other)
                if other is block.prev:
                    other.size += block.size
                    other.next = block.next
                    if block.next is not None:
                        block.next.prev = other
                    block = other
                else:
                    block.size += other.size
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
        self._cache(block)


def replay(events: Iterable[tuple], allocator: Optional[CachingAllocator] = None) -> CachingAllocator:
    """Feed ``("alloc", key, nbytes)`` / ``("free", key)`` events (memory.LiveTensorTracker) to an
    allocator; storages of zero bytes take no block, as on CUDA."""
    a = allocator or CachingAllocator()
    live: dict[int, _Block] = {}
    for ev in events:
        if ev[0] == "alloc":
            if ev[2] > 0:
                live[ev[1]] = a.malloc(ev[2])
        else:
            b = live.pop(ev[1], None)
            if b is not None:
                a.free(b)
    return a


def least_capacity(events: list) -> int:
    """The smallest capacity on which ``events`` replay without an out-of-memory error, the
    free-and-retry path taken wherever it is needed.

    Segments are whole multiples of 2 MiB, so only such capacities differ. Below the peak allocated
    bytes none can work and the unbounded replay's peak reserved always does; between the two,
    bisection. Where the cache is emptied changes which blocks later requests reuse, so success need
    not be monotone in the capacity: the answer is one that was replayed and survived, with one 2 MiB
    smaller that failed."""
    unbounded = replay(events).stats
    lo, hi = (unbounded.peak_allocated - 1) // ROUND_LARGE, -(-unbounded.peak_reserved // ROUND_LARGE)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            replay(events, CachingAllocator(capacity=mid * ROUND_LARGE))
            hi = mid
        except AllocatorOOM:
            lo = mid
    return hi * ROUND_LARGE
