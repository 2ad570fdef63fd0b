"""A model of PyTorch's CUDA caching allocator, used to predict torch.cuda.max_memory_allocated() and
max_memory_reserved() from a trace of storage allocations and frees.

Why the trace alone is not enough: the allocator hands out rounded blocks carved from larger
segments it obtained with cudaMalloc, and it never gives a segment back during a step. So what
nvidia-smi sees (reserved) can be well above the live tensor bytes. The rules modelled here are
those of c10/cuda/CUDACachingAllocator.cpp with default settings (no PYTORCH_CUDA_ALLOC_CONF,
expandable_segments off, max_split_size unlimited, one stream, no empty_cache()):

* a request is rounded up to a multiple of 512 bytes (kMinBlockSize); 0 bytes takes no block;
* a rounded size <= 1 MiB (kSmallSize) is served from the small pool, whose segments are 2 MiB
  (kSmallBuffer). Larger sizes come from the large pool: a size under 10 MiB (kMinLargeAlloc)
  gets a 20 MiB segment (kLargeBuffer), anything bigger a segment rounded up to 2 MiB (kRoundLarge);
* a request takes the best-fitting cached free block of its pool: the smallest that fits,
  then the lowest address. Only when none fits is a new segment reserved;
* the block is split when the remainder is >= 512 B (small pool) or > 1 MiB (large pool);
  otherwise the whole block is handed out and counted as allocated;
* a freed block merges with free neighbours of the same segment. Segments are never released.

Not modelled: several streams, CUDA graphs' private pools, and the release of cached segments
and retry that the allocator attempts when cudaMalloc itself fails near the memory limit.

`CachingAllocator.snapshot()` writes the modelled state in the format of torch.cuda.memory._snapshot(),
so memfit's snapshot doctor, and PyTorch's own viewers, read a predicted layout like a measured one.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any, Hashable, Iterable, Sequence

from memfit.errors import EstimateError

MIN_BLOCK = 512              # kMinBlockSize
SMALL_SIZE = 1 << 20         # kSmallSize: largest request served by the small pool
SMALL_SEGMENT = 2 << 20      # kSmallBuffer
LARGE_SEGMENT = 20 << 20     # kLargeBuffer
MIN_LARGE_ALLOC = 10 << 20   # kMinLargeAlloc: below this a large request gets a whole kLargeBuffer
ROUND_LARGE = 2 << 20        # kRoundLarge

_ADDR_BITS = 64              # free-list entries are size << 64 | addr (see _FreeList)
_ADDR_MASK = (1 << _ADDR_BITS) - 1


def rounded(nbytes: int) -> int:
    """Size of the block the allocator hands out for a request of `nbytes` (before any
    no-split remainder is added). 0 bytes takes no block."""
    if nbytes < 0:
        raise EstimateError(f"negative allocation size: {nbytes}")
    if nbytes == 0:
        return 0
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


def segment_size(size: int) -> int:
    """cudaMalloc size of the segment reserved for a rounded request that no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return -(-size // ROUND_LARGE) * ROUND_LARGE


class _Block:
    """A piece of a segment: free or handed out. Neighbours within a segment are linked so
    that a freed block can merge with them."""
    __slots__ = ("addr", "size", "small", "free", "prev", "next", "requested", "frames")

    def __init__(self, addr: int, size: int, small: bool):
        self.addr, self.size, self.small = addr, size, small
        self.free = True
        self.requested = 0  # bytes asked for when last handed out (stale while free): a snapshot's requested_size
        self.frames: Sequence[dict] = ()  # shared empty default: no list per block during a long replay
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _FreeList:
    """One pool's free blocks in best-fit order: by size, then by address. Each block is one
    int, size << 64 | addr, because ints compare much faster than tuples. Kept as sorted
    chunks, so inserts and removals stay cheap even with tens of thousands of free blocks.
    A single flat list would make replay quadratic there."""
    _CHUNK = 256

    def __init__(self) -> None:
        self._chunks: list[list[int]] = []
        self._maxes: list[int] = []

    def add(self, item: int) -> None:
        if not self._chunks:
            self._chunks.append([item])
            self._maxes.append(item)
            return
        i = bisect_left(self._maxes, item)
        if i == len(self._chunks):
            i -= 1
        chunk = self._chunks[i]
        insort(chunk, item)
        self._maxes[i] = chunk[-1]
        if len(chunk) > 2 * self._CHUNK:
            self._chunks[i:i + 1] = [chunk[:self._CHUNK], chunk[self._CHUNK:]]
            self._maxes[i:i + 1] = [chunk[self._CHUNK - 1], chunk[-1]]

    def remove(self, item: int) -> None:
        i = bisect_left(self._maxes, item)
        chunk = self._chunks[i]
        del chunk[bisect_left(chunk, item)]
        if chunk:
            self._maxes[i] = chunk[-1]
        else:
            del self._chunks[i], self._maxes[i]

    def ceiling(self, item: int) -> int | None:
        """Smallest entry >= item, or None."""
        i = bisect_left(self._maxes, item)
        if i == len(self._chunks):
            return None
        chunk = self._chunks[i]
        return chunk[bisect_left(chunk, item)]

    def __len__(self) -> int:
        return sum(len(c) for c in self._chunks)


class CachingAllocator:
    """Replays malloc/free calls and keeps the statistics torch.cuda.memory_stats() reports:
    `allocated` (sizes of handed-out blocks) and `reserved` (sizes of cudaMalloc'd segments),
    with their peaks. With `record_trace`, it also keeps the events that
    torch.cuda.memory._record_memory_history() would record, for snapshot()'s device_traces."""

    def __init__(self, record_trace: bool = False) -> None:
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.segments = 0
        self._pools = {True: _FreeList(), False: _FreeList()}  # keyed by "small pool?"
        self._free_blocks: dict[int, _Block] = {}  # addr -> free block
        self._live: dict[Hashable, _Block | None] = {}  # key -> block (None: a 0-byte request)
        self._next_addr = 0  # segments get increasing, never-reused fake addresses
        self._heads: list[_Block] = []  # each segment's first block, which survives every split and merge
        self.trace: list[dict] | None = [] if record_trace else None

    def malloc(self, key: Hashable, nbytes: int, frames: Sequence[dict] | None = None) -> None:
        """Hand out a block for `nbytes` under `key`; `frames` (innermost first, as PyTorch records
        them: dicts of filename, line, name) say where it was allocated, for snapshots."""
        if key in self._live:
            raise EstimateError(f"allocation {key!r} is already live")
        size = rounded(nbytes)
        if size == 0:
            self._live[key] = None
            return
        small = size <= SMALL_SIZE
        block = self._take_free_block(size, small) or self._new_segment(size, small)
        remaining = block.size - size
        if (remaining >= MIN_BLOCK) if small else (remaining > SMALL_SIZE):
            self._split(block, size)
        block.free = False
        block.requested, block.frames = nbytes, frames or ()
        if self.trace is not None:
            self._record("alloc", block.addr, nbytes, block.frames)
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: Hashable) -> None:
        try:
            block = self._live.pop(key)
        except KeyError:
            raise EstimateError(f"free of unknown allocation {key!r}") from None
        if block is None:
            return
        self.allocated -= block.size
        if self.trace is not None:  # one stream: the free completes at once
            self._record("free_requested", block.addr, block.requested, block.frames)
            self._record("free_completed", block.addr, block.requested, block.frames)
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                block = self._merge(block, neighbour)
        self._release(block)

    def snapshot(self, device: int = 0) -> dict[str, Any]:
        """The state as torch.cuda.memory._snapshot() returns it (what _dump_snapshot pickles):
        segments in address order with their blocks, and the recorded trace (empty unless
        `record_trace`) as `device`'s entry of device_traces. One stream (0), default pool."""
        segments = []
        for head in self._heads:
            blocks, block = [], head
            while block is not None:
                blocks.append({"address": block.addr, "size": block.size,
                               "requested_size": 0 if block.free else block.requested,
                               "state": "inactive" if block.free else "active_allocated",
                               "frames": [] if block.free else list(block.frames)})
                block = block.next
            allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
            segments.append({
                "device": device, "address": head.addr, "total_size": sum(b["size"] for b in blocks),
                "allocated_size": allocated, "active_size": allocated,
                "requested_size": sum(b["requested_size"] for b in blocks), "stream": 0,
                "segment_type": "small" if head.small else "large", "segment_pool_id": (0, 0),
                "is_expandable": False, "frames": [], "blocks": blocks})
        traces: list[list[dict]] = [[] for _ in range(device + 1)]
        traces[device] = [dict(e) for e in self.trace or ()]
        return {"segments": segments, "device_traces": traces}

    # -- internals
    def _record(self, action: str, addr: int, size: int, frames: Sequence[dict]) -> None:
        self.trace.append({"action": action, "addr": addr, "size": size, "stream": 0, "frames": list(frames)})

    def _take_free_block(self, size: int, small: bool) -> _Block | None:
        pool = self._pools[small]
        found = pool.ceiling(size << _ADDR_BITS)  # smallest size >= request, then lowest address
        if found is None:
            return None
        pool.remove(found)
        return self._free_blocks.pop(found & _ADDR_MASK)

    def _new_segment(self, size: int, small: bool) -> _Block:
        seg = segment_size(size)
        block = _Block(self._next_addr, seg, small)
        self._heads.append(block)
        if self.trace is not None:
            self._record("segment_alloc", block.addr, seg, ())
        self._next_addr += seg
        self.reserved += seg
        self.segments += 1
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return block

    def _split(self, block: _Block, size: int) -> None:
        """Cut `block` down to `size`; the tail becomes a free block right after it."""
        tail = _Block(block.addr + size, block.size - size, block.small)
        tail.prev, tail.next = block, block.next
        if block.next is not None:
            block.next.prev = tail
        block.next = tail
        block.size = size
        self._release(tail)

    def _merge(self, block: _Block, neighbour: _Block) -> _Block:
        """Absorb the free `neighbour` (taken out of its pool) and return the merged block."""
        self._pools[neighbour.small].remove(neighbour.size << _ADDR_BITS | neighbour.addr)
        del self._free_blocks[neighbour.addr]
        first, second = (neighbour, block) if neighbour.addr < block.addr else (block, neighbour)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first

    def _release(self, block: _Block) -> None:
        self._pools[block.small].add(block.size << _ADDR_BITS | block.addr)
        self._free_blocks[block.addr] = block


def simulate(events: Iterable[tuple[object, int]]) -> tuple[int, int]:
    """Replay (key, +nbytes) allocations and (key, -nbytes) frees in order; return
    (peak_allocated, peak_reserved) as max_memory_allocated()/max_memory_reserved() would
    report them. Zero-byte events are skipped: such a request takes no block, and its free
    could not be told apart from its allocation anyway."""
    alloc = CachingAllocator()
    for key, delta in events:
        if delta > 0:
            alloc.malloc(key, delta)
        elif delta < 0:
            alloc.free(key)
    return alloc.peak_allocated, alloc.peak_reserved
