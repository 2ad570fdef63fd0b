"""A traced step's allocation stream, written so that the streams of two depths of one model line up.

`LiveBytes` records (storage id, +bytes) and (storage id, -bytes); ids differ between traces, so each event
is written instead as its storage's class (size, category, phase, op, dtype, shape, module with its block
index left out, source line) and a free as which live storage of its class it frees (`written`: the newest
but n, or the oldest but n). A copy with one more block then reads as the shallower
stream with runs inserted (one block's forward, backward, optimizer update...): `insertions` finds them,
`repeat` writes the stream with k blocks more, `events` turns it back into (id, ±bytes) for the allocator.
"""
from __future__ import annotations

import re
from bisect import bisect_left
from typing import Callable

_INDEX = re.compile(r"\.\d+(?=\.|$)")


def storage_class(category, info) -> tuple:
    """What a storage is, the same for the same tensor of another block of the same kind."""
    return (str(category), str(info.phase), info.op, info.dtype, tuple(info.shape), _INDEX.sub(".#", info.module),
            info.source)


def tokens(events: list[tuple[int, int]], classes: dict, marks: list[tuple[int, object]] = ()) -> list[tuple]:
    """(+bytes, class) for an allocation, (-bytes, class, newer, older) for a free: how many live storages
    of its class are newer and older than the one it frees; (0, "phase", name) where a phase begins (`marks`:
    (event index, phase), as LiveBytes keeps them), which `insertions` lines up first."""
    live: dict[tuple, list[int]] = {}
    made: dict[int, int] = {}
    out: list[tuple] = []
    bounds = [0] + [i for i, _ in marks] + [len(events)]
    names = [None] + [str(p) for _, p in marks]
    for begin, end, name in zip(bounds, bounds[1:], names):
        if name is not None:
            out.append((0, "phase", name))
        out += _tokens(events[begin:end], classes, live, made)
    return out


def _tokens(events: list[tuple[int, int]], classes: dict, live: dict[tuple, list[int]],
            made: dict[int, int]) -> list[tuple]:
    out: list[tuple] = []
    for key, delta in _frees_in_order(events, made):
        c = (abs(delta), classes[key])
        if delta > 0:
            live.setdefault(c, []).append(key)
            out.append(c)
            continue
        keys = live[c]
        i = bisect_left(keys, key)  # ids grow with each allocation; one made again (a resize) may be out of order
        if i == len(keys) or keys[i] != key:
            i = keys.index(key)
        del keys[i]
        out.append((delta, c[1], len(keys) - i, i))
    return out


def _frees_in_order(events: list[tuple[int, int]], made: dict[int, int]) -> list[tuple[int, int]]:
    """The events without empty ones, and each run of frees with no allocation between them in the order
    their storages were allocated. What a run of frees leaves is the same in any order (the allocator merges
    each freed block with its free neighbours), but the order is not always the blocks' (autocast lets its
    cache go in its hash table's order)."""
    out: list[tuple[int, int]] = []
    frees: list[tuple[int, int]] = []
    for key, delta in events:
        if delta < 0:
            frees.append((key, delta))
            continue
        out += sorted(frees, key=lambda e: made[e[0]])
        frees.clear()
        if delta > 0:
            made[key] = len(made)
            out.append((key, delta))
    return out + sorted(frees, key=lambda e: made[e[0]])


def written(streams: list[list[tuple]]) -> list[list[tuple]]:
    """The streams with each free saying which storage it frees in words that hold at any depth: a class
    whose frees take its newest live storage in every stream (a backward freeing what its block saved)
    says "the newest but n"; one that always takes the oldest (an autocast cache let go in the order it
    was filled) says "the oldest but n"; any other class the smaller count (ties: the newest)."""
    not_newest = {t[1] for s in streams for t in s if t[0] < 0 and t[2]}
    not_oldest = {t[1] for s in streams for t in s if t[0] < 0 and t[3]}

    def word(t: tuple) -> tuple:
        if t[0] >= 0:
            return t
        newest = t[1] not in not_newest or (t[1] in not_oldest and t[2] <= t[3])
        return (t[0], t[1], "n", t[2]) if newest else (t[0], t[1], "o", t[3])

    return [[word(t) for t in s] for s in streams]


def events(stream: list[tuple]) -> list[tuple[int, int]]:
    """`tokens` undone: (id, ±bytes), ids numbered in allocation order."""
    live: dict[tuple, list[int]] = {}
    out: list[tuple[int, int]] = []
    for t in stream:
        if t[0] == 0:
            continue
        if t[0] > 0:
            live.setdefault(t, []).append(len(out))
            out.append((len(out), t[0]))
        else:
            keys = live[(-t[0], t[1])]
            out.append((keys.pop(len(keys) - 1 - t[3] if t[2] == "n" else t[3]), t[0]))
    return out


def peak(stream: list[tuple]) -> int:
    """The highest live total along the stream."""
    current = top = 0
    for t in stream:
        current += t[0]
        top = max(top, current)
    return top


def live_at_peak(stream: list[tuple]) -> list[tuple]:
    """The allocations (+bytes, class) alive where the live total first reaches its highest, in the order
    they were made, as LiveBytes lists a trace's."""
    current = top = end = 0
    for i, t in enumerate(stream):
        current += t[0]
        if current > top:
            top, end = current, i + 1
    made = [t for t in stream[:end] if t[0]]  # `events` numbers each storage by its allocation's place here
    alive: dict[int, tuple] = {}
    for key, delta in events(stream[:end]):
        if delta > 0:
            alive[key] = made[key]
        else:
            del alive[key]
    return list(alive.values())


def at_peak(stream: list[tuple], first: str) -> tuple[dict[str, int], str]:
    """The live bytes by category (each class's first part) where the live total first reaches its highest,
    and the phase it is in, as LiveBytes reads its peak."""
    current = top = 0
    live: dict[str, int] = {}
    name, best = first, ({}, first)
    for t in stream:
        if t[0] == 0:
            name = t[2]
            continue
        live[t[1][0]] = live.get(t[1][0], 0) + t[0]
        current += t[0]
        if current > top:
            top, best = current, ({k: v for k, v in live.items() if v}, name)
    return best


def phase_peaks(stream: list[tuple], first: str) -> dict[str, int]:
    """The highest live total in each phase, as LiveBytes keeps them: from the total a phase begins with and
    after each allocation in it; what comes before the first phase's mark is `first`'s."""
    current, name, out = 0, first, {}
    for t in stream:
        if t[0] == 0:
            name = t[2]
        current += t[0]
        if t[0] >= 0:
            out[name] = max(out.get(name, current), current)
    return out


def insertions(shallow: list[tuple], deeper: list[tuple], accept: Callable[[list], bool] | None = None,
               tries: int = 16) -> list[tuple[int, list[tuple]]] | None:
    """[(position in `shallow`, the run inserted there)] that make `deeper` and that `accept` takes; None
    unless `deeper` is exactly `shallow` with runs inserted (nothing changed or left out). Where the streams
    part, the run inserted is first taken to be the one after which they agree longest (ties: the shortest),
    found by hashes of their prefixes; difflib took minutes where a model loops over tokens (rwkv: 84,000
    events in a 2-block copy). Runs can be read more than one way (a run of frees ending in one of the same
    class as the token after it: split around it, or whole): where a reading leads nowhere or is not accepted,
    the next best is tried, the latest parting first, `tries` readings in all."""
    extra = len(deeper) - len(shallow)
    if extra < 0:
        return None
    ha, hb = _Prefixes(shallow), _Prefixes(deeper)
    first = {}  # token -> its positions in `deeper`
    for j, t in enumerate(deeper):
        first.setdefault(t, []).append(j)
    stack: list[tuple[int, int, tuple]] = [(0, 0, ())]  # (i, j, the (i, j, length) of the runs so far)
    while stack and tries > 0:
        i, j, runs = stack.pop()
        k = _agree(ha, i, hb, j)
        i, j = i + k, j + k
        if i == len(shallow):
            out = [(at, deeper[b:b + n]) for at, b, n in runs + (((i, j, len(deeper) - j),) if j < len(deeper) else ())]
            if repeat(shallow, out, 1) == deeper and (accept is None or accept(out)):
                return out
            tries -= 1
            continue
        left = extra - (j - i)
        places = first.get(shallow[i], [])
        options = []
        for at in places[bisect_left(places, j + 1):]:
            if at - j > left:
                break
            options.append((_agree(ha, i, hb, at), at - j))
        options.sort(key=lambda o: (-o[0], o[1]))  # popped best first
        stack += [(i, j + skip, runs + ((i, j, skip),)) for _, skip in reversed(options)]
        tries -= not options
    return None


class _Prefixes:
    """Polynomial hashes of a stream's prefixes: two stretches agree (with near certainty, and `insertions`
    checks its answer) where their hashes do."""
    MOD = (1 << 61) - 1
    BASE = 1_000_003

    def __init__(self, stream: list[tuple]):
        codes: dict[tuple, int] = {}
        self.h = h = [0]
        self.p = p = [1]
        for t in stream:
            code = codes.setdefault(t, hash(t) & 0xFFFFFFFFFFFF | 1)
            h.append((h[-1] * self.BASE + code) % self.MOD)
            p.append(p[-1] * self.BASE % self.MOD)
        self.n = len(stream)

    def of(self, i: int, k: int) -> int:
        return (self.h[i + k] - self.h[i] * self.p[k]) % self.MOD


def _agree(a: _Prefixes, i: int, b: _Prefixes, j: int) -> int:
    """How many tokens a[i:] and b[j:] have in common from their start."""
    lo, hi = 0, min(a.n - i, b.n - j)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a.of(i, mid) == b.of(j, mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def differs(written: list[tuple], traced: list[tuple]) -> str | None:
    """How a stream written for a copy differs from the copy's own: None (event for event the same), "setup
    order" (the same from the step's first phase on, and before it the same tensors made and freed in
    another order: the step's owner lays out tensors it finds alive by size, ties in the collector's order,
    which moves with the depth: falcon_mamba's norm weights), or "other" (a reading of the runs that frees a
    tensor of a kind none is alive of, too, is no stream at all)."""
    try:
        if events(written) == events(traced):
            return None
    except (IndexError, KeyError):
        return "other"
    cut = [next((i for i, t in enumerate(x) if t[0] == 0), len(x)) for x in (written, traced)]
    if written[cut[0]:] == traced[cut[1]:] and sorted(map(repr, written[:cut[0]])) == \
            sorted(map(repr, traced[:cut[1]])):
        return "setup order"
    return "other"


def repeat(shallow: list[tuple], runs: list[tuple[int, list[tuple]]], times: int) -> list[tuple]:
    """`shallow` with each run inserted `times` times at its place."""
    out: list[tuple] = []
    done = 0
    for at, run in runs:
        out += shallow[done:at]
        out += run * times
        done = at
    return out + shallow[done:]
