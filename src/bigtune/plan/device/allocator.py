"""A model of PyTorch's CUDA caching allocator, to predict *reserved* memory from an allocation trace.

``torch.cuda.memory_reserved`` is what the process holds from the driver (and what ``nvidia-smi``
shows, plus the CUDA context); it exceeds the allocated bytes because the caching allocator keeps
freed blocks for reuse and carves requests out of larger segments. The planner's simulation sees
every tensor storage created and freed during a training step, in order (memory.LiveTensorTracker
with ``events``); replaying that sequence through this model gives the reserved bytes a GPU would
show, instead of a fixed ratio.

What is modelled (c10/cuda/CUDACachingAllocator.cpp, torch 2.9-2.11, one stream), PyTorch's default settings
first, then the PYTORCH_CUDA_ALLOC_CONF settings further down:

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

PYTORCH_CUDA_ALLOC_CONF (``AllocatorConfig``, parsed in core/allocconf.py; recipe key ``train.cuda_alloc_conf``):

* ``max_split_size_mb``: blocks of at least that size are *oversize*. get_free_block does not hand a cached
  oversize block to a smaller request, and hands one to an oversize request only if it is less than
  ``max_non_split_rounding_mb`` (default 20 MiB) larger; should_split never splits a block for an oversize
  request (the whole block is handed out). When a new segment does not fit, release_available_cached_blocks
  first frees the smallest cached oversize block at least as large as the request (or as max_split_size,
  whichever is more), or else cached oversize blocks from the largest down until that many bytes are freed
  (they stay freed even when that falls short); only then does the full release_cached_blocks retry run.
* ``expandable_segments:True``: each pool has one segment that grows. Its address space is reserved once
  and physical pages are mapped as needed: 2 MiB pages in the small pool (kSmallBuffer), 20 MiB in the
  large pool (kLargeBuffer). Reserved is the mapped bytes. A request no cached block serves maps the pages
  it lacks at the lowest address with room (find_expandable_block: an unmapped range together with the free
  block just before it), so it extends the free space at the end of the mapped range instead of taking a
  segment of its own; every block is split while 512 bytes remain (should_split). Best fit counts a free
  block next to the unmapped tail at the size it could grow to, so another block that fits is preferred
  (get_free_block). The release on a retry (and empty_cache) unmaps every whole free page (unmap_block), so
  free space pinned in a segment by a live block comes back too, page by page; partial pages at a free
  block's ends stay mapped. The address space is taken as unbounded (PyTorch reserves 1.125 times the
  device memory, more than any replay here maps). ``stats.segments`` and ``in_use`` count cudaMalloc
  segments only, as torch.cuda.memory_stats' segment count does: an expandable segment gives its pages back
  one by one and has no whole-segment floor.
* ``garbage_collection_threshold``: parsed, never run. PyTorch calls garbage_collect_cached_blocks (from
  malloc, and counts block ages in get_free_block) only under a per-process memory fraction: ``set_fraction``
  in older releases, an ``allowed_memory_maximum`` set by a fraction below 1 since PR #161035 (which also
  added the per_process_memory_fraction key). The capacity here is the whole device, not such a fraction,
  so PyTorch would not collect either, and the recipe refuses the key because it would do nothing.

Not modelled: kernels' internal workspaces, several streams (NCCL, FSDP prefetch) and the other
PYTORCH_CUDA_ALLOC_CONF keys (core/allocconf.py refuses them).

Each rule above is checked against the C++ functions it models (round_size, get_allocation_size,
get_free_block, should_split, free_block's merge, release_cached_blocks, release_available_cached_blocks,
find_expandable_block, map_block, unmap_block) on synthetic traces reasoned by hand (tests/test_allocator.py).
The ratio of reserved to allocated is mostly the trace, not the replay: a loss that copied the shifted logits ((T-1) rows) made segments that could not serve the T-row fp32 logits'
gradient, so the backward reserved one more logits-sized segment (1.2-1.25 on Qwen's 152k vocabulary at
4 x 512). The engine's loss (core.stepmath.causal_lm_loss_sum) shifts the labels instead, as transformers'
ForCausalLMLoss does: 1.08-1.10 on the same plans.

Also not modelled: a run's micro-batches of different lengths. The planner replays steps of one shape
(full rows). Padded to their longest sample, real batches change shape every step, and cached blocks cut
for one shape often cannot serve the next, so reserved creeps up over a run. With this model, six steps of
random lengths (200-512 tokens) before the full-length one lift an 8-layer TinyLlama's reserved from 1.07
to 1.30-1.58 times its peak allocated (three seeds, bench/varlen_reserved.py), while the segments in use at
the peak move by 3 % at most. The lab's printouts, taken early in their runs, sit
0-19 % above the fixed-shape replay. Packed or fixed-length data does not creep.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Iterable, Optional

from bigtune.core.allocconf import AllocatorConfig

MIN_BLOCK = 512

SMALL_SIZE = 1 << 20  # requests up to 1 MiB use the small pool

SMALL_BUFFER = 2 << 20  # small-pool segments are 2 MiB (and an expandable small segment's pages)

LARGE_BUFFER = 20 << 20  # requests under 10 MiB get a 20 MiB segment (and an expandable large segment's pages)

MIN_LARGE_ALLOC = 10 << 20

ROUND_LARGE = 2 << 20  # larger requests: their own segment, rounded up to 2 MiB

ADDRESS_PAGES = 1 << 30  # an expandable segment's address space, in pages: more than any device maps


def round_size(nbytes: int) -> int:
    return MIN_BLOCK if nbytes < MIN_BLOCK else -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Segment:
    __slots__ = ("size", "live", "base", "page")

    def __init__(self, size: int, base: int = 0, page: int = 0):
        self.size, self.live = size, 0  # live: allocated blocks in it
        self.base, self.page = base, page  # page: the mapping granularity of an expandable segment, 0 for cudaMalloc


class _Block:
    __slots__ = ("addr", "size", "small", "free", "mapped", "prev", "next", "segment")

    def __init__(self, addr: int, size: int, small: bool, segment: _Segment):
        self.addr, self.size, self.small, self.free, self.segment = addr, size, small, True, segment
        self.mapped = True  # False: an unmapped range of an expandable segment (no physical pages)
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None

    def split(self, size: int) -> _Block:
        """Keep the first ``size`` bytes; the rest becomes the next block of the same segment (returned)."""
        rest = _Block(self.addr + size, self.size - size, self.small, self.segment)
        rest.prev, rest.next = self, self.next
        if self.next is not None:
            self.next.prev = rest
        self.next = rest
        self.size = size
        return rest


class AllocatorOOM(RuntimeError):
    """A request that does not fit the capacity even after the cached segments were given back."""

    def __init__(self, nbytes: int, reserved: int, capacity: int):
        super().__init__(f"{nbytes} bytes requested with {reserved} of {capacity} bytes reserved by live segments")
        self.nbytes, self.reserved, self.capacity = nbytes, reserved, capacity


@dataclass
class AllocatorStats:
    """Byte counters as torch.cuda.memory_stats keeps them, plus ``in_use``: the bytes of segments
    holding at least one allocated block, the part of reserved that PyTorch cannot give back when a
    reservation fails (cudaMalloc segments only). ``alloc_retries``: how often the cache was emptied to
    make room (torch's ``num_alloc_retries``)."""

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
    ``capacity``: the bytes the device can give this process (None: as much as asked). ``config``: the
    PYTORCH_CUDA_ALLOC_CONF settings (default: PyTorch's)."""

    stats: AllocatorStats = field(default_factory=AllocatorStats)
    capacity: Optional[int] = None
    config: AllocatorConfig = field(default_factory=AllocatorConfig)

    def __post_init__(self):
        self._pools: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # (size, addr) of free blocks
        self._free_at: dict[int, _Block] = {}
        self._unmapped: dict[bool, list[int]] = {True: [], False: []}  # addresses of unmapped ranges, in order
        self._unmapped_at: dict[int, _Block] = {}
        self._next_addr = 0

    def _cache(self, b: _Block) -> None:
        b.free = True
        bisect.insort(self._pools[b.small], (b.size, b.addr))
        self._free_at[b.addr] = b

    def _uncache(self, b: _Block) -> None:
        pool = self._pools[b.small]
        del pool[bisect.bisect_left(pool, (b.size, b.addr))]
        del self._free_at[b.addr]

    def _add_unmapped(self, b: _Block) -> None:
        b.free, b.mapped = True, False
        bisect.insort(self._unmapped[b.small], b.addr)
        self._unmapped_at[b.addr] = b

    def _drop_unmapped(self, b: _Block) -> None:
        addrs = self._unmapped[b.small]
        del addrs[bisect.bisect_left(addrs, b.addr)]
        del self._unmapped_at[b.addr]

    def malloc(self, nbytes: int) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._get_free_block(size, small)
        if block is None:
            block = self._new_block(size, small, nbytes)
        if self._should_split(block, size, small):
            self._cache(block.split(size))
        block.free = False
        s = self.stats
        s.allocated += block.size
        s.peak_allocated = max(s.peak_allocated, s.allocated)
        if block.segment.live == 0 and not block.segment.page:
            s.in_use += block.segment.size
            s.peak_in_use = max(s.peak_in_use, s.in_use)
        block.segment.live += 1
        return block

    def _get_free_block(self, size: int, small: bool) -> Optional[_Block]:
        """get_free_block: the smallest cached block that fits (ties: lowest address), or None."""
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1))
        if i == len(pool):
            return None
        block = self._free_at[pool[i][1]]
        # Expandable: a block before the unmapped tail counts at the size it could grow to, so the next
        # larger block that fits is taken instead where that is smaller.
        while block.segment.page and i + 1 < len(pool):
            bigger = self._free_at[pool[i + 1][1]]
            if _expandable_size(bigger) >= _expandable_size(block):
                break
            i, block = i + 1, bigger
        split_max = self.config.max_split_size
        if split_max is not None:
            if size < split_max <= block.size:  # no oversize block for a smaller request
                return None
            if size >= split_max and block.size >= size + self.config.max_non_split_rounding:
                return None  # an oversize block serves an oversize request only if not much larger
        self._uncache(block)
        return block

    def _should_split(self, block: _Block, size: int, small: bool) -> bool:
        remaining = block.size - size
        if small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK
        split_max = self.config.max_split_size
        return (split_max is None or size < split_max) and remaining > SMALL_SIZE

    def _new_block(self, size: int, small: bool, nbytes: int) -> _Block:
        """malloc's way to a block no cached one serves: alloc_block; if the device is full, free cached
        oversize blocks (release_available_cached_blocks) and try again; then free every cached segment
        (release_cached_blocks, a counted retry) and try once more; then out of memory."""
        block = self._alloc_block(size, small)
        if block is None and self._release_available_cached_blocks(size, small):
            block = self._alloc_block(size, small)
        if block is None:
            self.stats.alloc_retries += 1
            self.release_cached_blocks()
            block = self._alloc_block(size, small)
            if block is None:
                raise AllocatorOOM(nbytes, self.stats.reserved, self.capacity)
        return block

    def _alloc_block(self, size: int, small: bool) -> Optional[_Block]:
        """alloc_block: a new segment from the driver, or the pages an expandable segment lacks; None
        where the device has no room for it."""
        if self.config.expandable_segments:
            return self._try_allocate_expandable_block(size, small)
        seg = segment_size(size)
        if self.capacity is not None and self.stats.reserved + seg > self.capacity:
            return None
        block = _Block(self._next_addr, seg, small, _Segment(seg))
        self._next_addr += seg + ROUND_LARGE  # segments never touch: no merging across them
        s = self.stats
        s.reserved += seg
        s.segments += 1
        s.peak_reserved = max(s.peak_reserved, s.reserved)
        return block

    def _release_available_cached_blocks(self, size: int, small: bool) -> bool:
        """release_available_cached_blocks (only with max_split_size): free the smallest cached oversize
        block of at least max(size, max_split_size), or else oversize blocks from the largest down until
        that many bytes are freed; whether that was enough. Expandable blocks are skipped."""
        split_max = self.config.max_split_size
        if split_max is None:
            return False
        key = max(size, split_max)
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (key, -1))
        if i < len(pool) and not self._free_at[pool[i][1]].segment.page:
            self._release_block(self._free_at[pool[i][1]])
            return True
        released, j = 0, i - 1
        while j >= 0 and released < key and pool[j][0] >= split_max:
            b = self._free_at[pool[j][1]]
            if not b.segment.page:
                released += b.size
                self._release_block(b)  # below index j: the blocks still to visit keep their places
            j -= 1
        return released >= key

    def _release_block(self, b: _Block) -> None:
        """release_block: cudaFree a cached block that is a whole segment."""
        assert b.prev is None and b.next is None, "only whole segments go back to the driver"
        self._uncache(b)
        self.stats.reserved -= b.size
        self.stats.segments -= 1

    def release_cached_blocks(self) -> int:
        """Give every cached block that is a whole segment back to the driver (release_cached_blocks ->
        release_blocks, which skips blocks with a neighbour: a split segment stays), and unmap the whole
        free pages of expandable segments (unmap_block); the bytes freed. This is also what
        torch.cuda.empty_cache does."""
        before = self.stats.reserved
        for small in (False, True):
            cached = [self._free_at[addr] for _, addr in self._pools[small]]
            for b in cached:
                if not b.segment.page and b.prev is None and b.next is None:
                    self._release_block(b)
            for b in cached:
                if b.segment.page:
                    self._unmap_block(b)
                    if not b.mapped and b.prev is None and b.next is None:  # release_expandable_segment
                        self._drop_unmapped(b)
        return before - self.stats.reserved

    def free(self, block: _Block) -> None:
        self.stats.allocated -= block.size
        block.segment.live -= 1
        if block.segment.live == 0 and not block.segment.page:
            self.stats.in_use -= block.segment.size
        for other in (block.prev, block.next):
            self._merge(block, other)
        self._cache(block)

    def _merge(self, dst: _Block, src: Optional[_Block]) -> None:
        """try_merge_blocks: ``dst`` (in no pool now) takes in ``src`` when that is free and mapped alike."""
        if src is None or not src.free or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._uncache(src)
        else:
            self._drop_unmapped(src)
        if src is dst.prev:
            dst.addr, dst.prev = src.addr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    # -- expandable segments (Note [Expandable Segments]) ------------------------------------------

    def _try_allocate_expandable_block(self, size: int, small: bool) -> Optional[_Block]:
        """try_allocate_expandable_block: map what the lowest range with room lacks, merged into one free
        block of at least ``size`` bytes; None where the pages do not fit the device."""
        block = self._find_expandable_block(size, small)
        if not block.mapped:
            block = self._map_block(block, min(block.size, size))
            if block is None:
                return None
        while block.size < size:  # free, then unmapped: map the rest after it
            block = self._map_block(block.next, min(size - block.size, block.next.size))
            if block is None:
                return None
        self._uncache(block)
        return block

    def _find_expandable_block(self, size: int, small: bool) -> _Block:
        """find_expandable_block: the lowest unmapped range (with the free block before it) that, with
        the free or unmapped blocks after it, holds ``size`` bytes; else a new segment's address space."""
        for addr in self._unmapped[small]:
            c = self._unmapped_at[addr]
            if c.prev is not None and c.prev.free:
                c = c.prev
            room, b = 0, c
            while room < size and b is not None and b.free:
                room, b = room + b.size, b.next
            if room >= size:
                return c
        page = SMALL_BUFFER if small else LARGE_BUFFER
        base = -(-self._next_addr // page) * page
        self._next_addr = base + page * ADDRESS_PAGES + ROUND_LARGE
        block = _Block(base, page * ADDRESS_PAGES, small, _Segment(page * ADDRESS_PAGES, base, page))
        self._add_unmapped(block)
        return block

    def _map_block(self, b: _Block, nbytes: int) -> Optional[_Block]:
        """map_block: back the first ``nbytes`` of unmapped ``b`` with whole pages and merge it with free
        neighbours; None (nothing mapped) where the pages do not fit the device."""
        seg = b.segment
        end = seg.base + -(-(b.addr + nbytes - seg.base) // seg.page) * seg.page
        mapped = end - b.addr
        if self.capacity is not None and self.stats.reserved + mapped > self.capacity:
            return None  # cuMemCreate fails: the pages made for this call are released again
        self._drop_unmapped(b)
        b.mapped = True
        if mapped < b.size:
            self._add_unmapped(b.split(mapped))
        self._merge(b, b.prev)
        self._merge(b, b.next)
        self._cache(b)
        s = self.stats
        s.reserved += mapped
        s.peak_reserved = max(s.peak_reserved, s.reserved)
        return b

    def _unmap_block(self, b: _Block) -> None:
        """unmap_block: give back the whole pages inside cached ``b``; the partial pages at its ends stay
        mapped as free blocks of their own, and the unmapped range merges with unmapped neighbours."""
        seg = b.segment
        lo = seg.base + -(-(b.addr - seg.base) // seg.page) * seg.page
        hi = seg.base + (b.addr + b.size - seg.base) // seg.page * seg.page
        if lo >= hi:
            return
        self._uncache(b)
        if lo > b.addr:
            before = _Block(b.addr, lo - b.addr, b.small, seg)
            before.prev, before.next = b.prev, b
            if b.prev is not None:
                b.prev.next = before
            b.prev = before
            self._cache(before)
        if hi < b.addr + b.size:
            after = _Block(hi, b.addr + b.size - hi, b.small, seg)
            after.prev, after.next = b, b.next
            if b.next is not None:
                b.next.prev = after
            b.next = after
            self._cache(after)
        b.addr, b.size, b.mapped = lo, hi - lo, False
        self._merge(b, b.prev)
        self._merge(b, b.next)
        self._add_unmapped(b)
        self.stats.reserved -= hi - lo


def _expandable_size(b: _Block) -> int:
    """What a free block can grow to: itself and the unmapped range after it (get_free_block)."""
    return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)


def replay(
    events: Iterable[tuple], allocator: Optional[CachingAllocator] = None, config: Optional[AllocatorConfig] = None
) -> CachingAllocator:
    """Feed ``("alloc", key, nbytes)`` / ``("free", key)`` events (memory.LiveTensorTracker) to an
    allocator (default: a new one with ``config``, PyTorch's defaults if None); storages of zero bytes
    take no block, as on CUDA."""
    a = allocator or CachingAllocator(config=config or AllocatorConfig())
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


def least_capacity(events: list, config: Optional[AllocatorConfig] = None) -> int:
    """The smallest capacity on which ``events`` replay without an out-of-memory error under ``config``
    (PyTorch's defaults if None), the free-and-retry path taken wherever it is needed.

    Segments and pages are whole multiples of 2 MiB, so only such capacities differ. Below the peak
    allocated bytes none can work and the unbounded replay's peak reserved always does; between the two,
    bisection. Where the cache is emptied changes which blocks later requests reuse, so success need
    not be monotone in the capacity: the answer is one that was replayed and survived, with one 2 MiB
    smaller that failed."""
    config = config or AllocatorConfig()
    unbounded = replay(events, config=config).stats
    lo, hi = (unbounded.peak_allocated - 1) // ROUND_LARGE, -(-unbounded.peak_reserved // ROUND_LARGE)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            replay(events, CachingAllocator(capacity=mid * ROUND_LARGE, config=config))
            hi = mid
        except AllocatorOOM:
            lo = mid
    return hi * ROUND_LARGE
