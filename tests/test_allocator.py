"""The caching-allocator model against figures worked out by hand from the rules of
c10/cuda/CUDACachingAllocator.cpp (default settings)."""
from __future__ import annotations

import random
import time

import pytest

from memfit.errors import EstimateError
from memfit.memory.allocator import CachingAllocator, rounded, segment_size, simulate

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize("nbytes, expected", [
    (0, 0), (1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024), (1 * MiB, 1 * MiB),
    (1 * MiB + 1, 1 * MiB + 512),
])
def test_rounding_to_512_bytes(nbytes, expected):
    assert rounded(nbytes) == expected


def test_negative_size_is_rejected():
    with pytest.raises(EstimateError, match="negative allocation size"):
        rounded(-1)


@pytest.mark.parametrize("size, expected", [
    (512, 2 * MiB),                 # small pool
    (1 * MiB, 2 * MiB),             # the largest small request
    (1 * MiB + 512, 20 * MiB),      # large, under 10 MiB: a whole kLargeBuffer
    (10 * MiB - 512, 20 * MiB),
    (10 * MiB, 10 * MiB),           # from 10 MiB: rounded up to 2 MiB
    (30 * MiB, 30 * MiB),
    (30 * MiB + 512, 32 * MiB),
])
def test_segment_sizes(size, expected):
    assert segment_size(size) == expected


def test_two_small_blocks_share_one_small_segment():
    a = CachingAllocator()
    a.malloc("x", 1 * KiB)
    a.malloc("y", 1 * KiB)
    assert (a.allocated, a.reserved, a.segments) == (2 * KiB, 2 * MiB, 1)


def test_small_segment_fills_then_a_second_is_reserved():
    a = CachingAllocator()
    a.malloc("x", 1 * MiB)
    a.malloc("y", 1 * MiB)          # the other half of the 2 MiB segment
    assert a.reserved == 2 * MiB
    a.malloc("z", 512)
    assert (a.reserved, a.segments) == (4 * MiB, 2)


def test_five_mib_requests_share_a_twenty_mib_segment():
    a = CachingAllocator()
    a.malloc("x", 5 * MiB)
    assert (a.allocated, a.reserved) == (5 * MiB, 20 * MiB)
    a.malloc("y", 5 * MiB)          # fits in the 15 MiB remainder
    assert (a.allocated, a.reserved, a.segments) == (10 * MiB, 20 * MiB, 1)


def test_large_request_reserves_its_size_rounded_to_2_mib():
    a = CachingAllocator()
    a.malloc("x", 30 * MiB)
    assert (a.allocated, a.reserved) == (30 * MiB, 30 * MiB)
    b = CachingAllocator()
    b.malloc("x", 30 * MiB + 1)     # block 30 MiB + 512 B, segment 32 MiB, tail ~2 MiB is split off
    assert (b.allocated, b.reserved) == (30 * MiB + 512, 32 * MiB)


def test_large_remainder_of_at_most_1_mib_is_not_split():
    # 11 MiB -> 12 MiB segment; the 1 MiB tail is not > kSmallSize, so the whole segment is handed out
    a = CachingAllocator()
    a.malloc("x", 11 * MiB)
    assert (a.allocated, a.reserved) == (12 * MiB, 12 * MiB)
    # 19.5 MiB after a freed 20 MiB block: 0.5 MiB tail stays attached
    b = CachingAllocator()
    b.malloc("x", 20 * MiB)
    b.free("x")
    b.malloc("y", 19 * MiB + 512 * KiB)
    assert (b.allocated, b.reserved) == (20 * MiB, 20 * MiB)


def test_small_pool_splits_down_to_512_bytes():
    a = CachingAllocator()
    a.malloc("x", 2 * MiB - 512)    # too big for the small pool: large pool, 20 MiB segment
    assert a.reserved == 20 * MiB
    b = CachingAllocator()
    b.malloc("x", 1 * MiB)
    b.malloc("y", 1 * MiB - 512)    # leaves exactly 512 B, still split off
    b.malloc("z", 512)              # and used
    assert (b.allocated, b.reserved, b.segments) == (2 * MiB, 2 * MiB, 1)


def test_free_then_smaller_malloc_reuses_the_segment():
    a = CachingAllocator()
    a.malloc("x", 30 * MiB)
    a.free("x")
    assert (a.allocated, a.reserved) == (0, 30 * MiB)
    a.malloc("y", 12 * MiB)
    assert (a.allocated, a.reserved, a.segments) == (12 * MiB, 30 * MiB, 1)
    assert (a.peak_allocated, a.peak_reserved) == (30 * MiB, 30 * MiB)


def test_larger_request_than_any_cached_block_reserves_more():
    a = CachingAllocator()
    a.malloc("x", 12 * MiB)
    a.free("x")
    a.malloc("y", 14 * MiB)         # the cached 12 MiB block is too small
    assert (a.allocated, a.reserved, a.segments) == (14 * MiB, 26 * MiB, 2)


def test_pools_are_separate():
    a = CachingAllocator()
    a.malloc("big", 5 * MiB)        # 20 MiB large segment with 15 MiB free
    a.malloc("small", 4 * KiB)      # cannot use the large pool's free space
    assert (a.reserved, a.segments) == (22 * MiB, 2)


def test_best_fit_picks_the_smallest_block_that_fits():
    a = CachingAllocator()
    a.malloc("a", 12 * MiB)         # segment 1 (12 MiB)
    a.malloc("b", 16 * MiB)         # segment 2 (16 MiB)
    a.free("b")
    a.free("a")
    a.malloc("c", 11 * MiB)         # best fit is the 12 MiB block; remainder 1 MiB is not split
    assert a.allocated == 12 * MiB
    a.malloc("d", 16 * MiB)         # the 16 MiB block is still free
    assert (a.allocated, a.reserved, a.segments) == (28 * MiB, 28 * MiB, 2)


def test_freed_neighbours_merge_into_one_block():
    a = CachingAllocator()
    for k in "abc":
        a.malloc(k, 5 * MiB)        # 15 MiB of one 20 MiB segment, 5 MiB tail free
    a.free("a")
    a.free("c")                     # merges with the free tail: 10 MiB
    a.free("b")                     # merges both sides: the whole 20 MiB segment
    a.malloc("d", 20 * MiB)
    assert (a.allocated, a.reserved, a.segments) == (20 * MiB, 20 * MiB, 1)


def test_fragmentation_forces_a_new_segment():
    a = CachingAllocator()
    for k in "abcd":
        a.malloc(k, 5 * MiB)        # fills a 20 MiB segment exactly
    a.free("a")
    a.free("c")                     # two separate 5 MiB holes, 10 MiB free in total
    a.malloc("e", 10 * MiB)         # no hole fits: a new 10 MiB segment
    assert (a.allocated, a.reserved, a.segments) == (20 * MiB, 30 * MiB, 2)


def test_zero_byte_requests_take_no_block():
    a = CachingAllocator()
    a.malloc("z", 0)
    assert (a.allocated, a.reserved) == (0, 0)
    a.free("z")
    assert simulate([("z", 0), ("z", 0), ("x", 1)]) == (512, 2 * MiB)


def test_double_malloc_and_unknown_free_are_errors():
    a = CachingAllocator()
    a.malloc("x", 1)
    with pytest.raises(EstimateError, match="already live"):
        a.malloc("x", 1)
    with pytest.raises(EstimateError, match="free of unknown allocation"):
        a.free("nope")


def test_simulate_returns_peaks():
    events = [("w", 8 * MiB + 128 * KiB), ("a", 100 * MiB), ("b", 4 * KiB), ("a", -100 * MiB),
              ("c", 50 * MiB), ("b", -4 * KiB)]
    # w: 8.125 MiB -> 20 MiB segment. a: 100 MiB segment. b: 2 MiB small segment.
    # c reuses a's cached 100 MiB block (split, tail 50 MiB stays cached).
    peak_alloc, peak_reserved = simulate(events)
    assert peak_alloc == 8 * MiB + 128 * KiB + 100 * MiB + 4 * KiB
    assert peak_reserved == 20 * MiB + 100 * MiB + 2 * MiB


def test_keys_may_be_reused_after_free():
    assert simulate([(1, 1000), (1, -1000), (1, 2000), (1, -2000)]) == (2048, 2 * MiB)


def test_allocated_returns_to_zero_and_reserved_never_shrinks():
    rng = random.Random(0)
    a = CachingAllocator()
    live = []
    for i in range(5000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            a.malloc(i, rng.choice([rng.randrange(1, 4096), rng.randrange(1, 2 * MiB), rng.randrange(1, 64 * MiB)]))
            live.append(i)
        assert a.allocated <= a.reserved
    reserved = a.reserved
    for k in live:
        a.free(k)
    assert (a.allocated, a.reserved) == (0, reserved)


def test_1e5_events_replay_quickly():
    rng = random.Random(1)
    events, live = [], []
    for i in range(50_000):  # 50k allocations and their frees, many small blocks left cached
        events.append((i, rng.choice([rng.randrange(1, 8 * KiB), rng.randrange(1, 32 * MiB)])))
        live.append(i)
        if rng.random() < 0.5:
            k = live.pop(rng.randrange(len(live)))
            events.append((k, -1))
    events += [(k, -1) for k in live]
    start = time.perf_counter()
    simulate(events)
    assert time.perf_counter() - start < 2.0


def _naive_peaks(events):
    """The same rules written the slow, obvious way: every segment a list of [addr, size, free, key]
    in address order, best fit by a full scan. Checks the fast free lists and merging."""
    segments = {True: [], False: []}  # small pool? -> list of segments
    where, alloc, reserved, peaks, next_addr = {}, 0, 0, [0, 0], 0
    for key, delta in events:
        if delta > 0:
            size = -(-delta // 512) * 512
            small = size <= MiB
            fits = [(b[1], b[0], seg, i) for seg in segments[small] for i, b in enumerate(seg)
                    if b[2] and b[1] >= size]
            if fits:
                _, _, seg, i = min(fits, key=lambda f: (f[0], f[1]))
            else:
                seg_size = 2 * MiB if small else 20 * MiB if size < 10 * MiB else -(-size // (2 * MiB)) * 2 * MiB
                seg, i = [[next_addr, seg_size, True, None]], 0
                segments[small].append(seg)
                next_addr += seg_size
                reserved += seg_size
            b = seg[i]
            rest = b[1] - size
            if (rest >= 512) if small else (rest > MiB):
                seg.insert(i + 1, [b[0] + size, rest, True, None])
                b[1] = size
            b[2], b[3] = False, key
            where[key] = seg
            alloc += b[1]
        else:
            seg = where.pop(key)
            i = next(j for j, b in enumerate(seg) if b[3] == key)
            seg[i][2], seg[i][3] = True, None
            alloc -= seg[i][1]
            if i + 1 < len(seg) and seg[i + 1][2]:
                seg[i][1] += seg.pop(i + 1)[1]
            if i > 0 and seg[i - 1][2]:
                seg[i - 1][1] += seg.pop(i)[1]
        peaks = [max(peaks[0], alloc), max(peaks[1], reserved)]
    return tuple(peaks)


@pytest.mark.parametrize("seed", range(5))
def test_matches_a_naive_model_on_random_traces(seed):
    rng = random.Random(seed)
    events, live = [], []
    for i in range(1500):
        if live and rng.random() < 0.5:
            events.append((live.pop(rng.randrange(len(live))), -1))
        else:
            events.append((i, rng.choice([rng.randrange(1, 4 * KiB), rng.randrange(1, 3 * MiB),
                                          rng.randrange(1, 40 * MiB)])))
            live.append(i)
    assert simulate(events) == _naive_peaks(events)
