"""The snapshot doctor: read a CUDA caching-allocator snapshot (what torch.cuda.memory._dump_snapshot()
pickles, or what CachingAllocator.snapshot() predicts) and say where the memory went and what would help;
and read PyTorch's CUDA out-of-memory message, which is often all a user has.

Why: a snapshot holds the facts (every segment cudaMalloc'd, every block in it, live or cached) but PyTorch's
viewers only draw them. The questions people bring are whether an OOM came from fragmentation or from real
use, why nvidia-smi shows more than their tensors, and whether empty_cache() or expandable_segments would
help. Each answer below is derived from the snapshot's numbers, and advice is given only when they call
for it: a snapshot with little free memory inside its segments gets no fragmentation advice.
"""
from __future__ import annotations

import os
import pickle
import re
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

from memfit.errors import ConfigError
from memfit.memory.allocator import SMALL_SIZE
from memfit.units import fmt_bytes

FREE_SHARE = 0.25         # free bytes inside segments count as "a lot" from this share of reserved
BIG_OTHER_USE = 256 << 20  # memory held by other processes worth a line in an OOM explanation
BIG_NON_PYTORCH = 2 << 30  # this process's memory outside PyTorch beyond what a CUDA context and libraries take

_LIVE = "active_allocated"
_PENDING = ("active_pending_free", "active_awaiting_free")  # the C++ writes the first, the docs name the second


@dataclass(frozen=True)
class SourceLine:
    """Live blocks grouped by the line that allocated them."""
    where: str  # "file:line in function", or "(no stack recorded)"
    bytes: int
    blocks: int


@dataclass(frozen=True)
class OomEvent:
    """The last `oom` entry of the device's trace, against the free blocks of the pool it would come from."""
    requested: int     # bytes the allocator looked for (the rounded request)
    device_free: int   # what cudaMemGetInfo reported free at that moment
    free_in_pool: int  # free bytes inside the segments of the request's pool (small: <= 1 MiB, else large)
    largest_free: int  # the largest of those free blocks

    @property
    def fragmentation(self) -> bool:
        """The request would fit in the free memory (cached plus device), but in no single piece of it."""
        return self.requested <= self.free_in_pool + self.device_free and self.largest_free < self.requested


@dataclass(frozen=True)
class SnapshotReport:
    """One device's allocator state. `allocated` counts live blocks (torch.cuda.memory_allocated()), `reserved`
    whole segments (memory_reserved()); blocks freed on one stream but still in use on another
    (`pending_free`) are neither live nor reusable. `context` is the assumed memory a CUDA process holds
    outside the allocator, which nvidia-smi adds."""
    device: int
    allocated: int
    reserved: int
    pending_free: int
    context: int
    small_segments: int
    large_segments: int
    free_in_segments: int  # inactive blocks: cached, reusable by this process only
    free_blocks: int
    largest_free: int
    largest_live: int
    releasable: int        # bytes in segments with no live block: all that empty_cache() can give back
    expandable: bool       # the run already used PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
    top: tuple[SourceLine, ...]
    oom: OomEvent | None
    advice: tuple[str, ...]

    @property
    def unallocated(self) -> int:
        """Reserved but not allocated: the "reserved by PyTorch but unallocated" of an OOM message."""
        return self.reserved - self.allocated

    @property
    def nvidia_smi(self) -> int:
        """Roughly what nvidia-smi shows for the process: every segment plus the CUDA context."""
        return self.reserved + self.context

    @property
    def segments(self) -> int:
        return self.small_segments + self.large_segments

    @property
    def fragmentation(self) -> float:
        """1 - largest free block / free bytes inside segments: the share of the cached free memory that a
        single request cannot use. 0 when the free memory is one block (or there is none)."""
        return 1 - self.largest_free / self.free_in_segments if self.free_in_segments else 0.0


class _PlainData(pickle.Unpickler):
    """A snapshot is dicts, lists, strings and numbers: refusing every class keeps a hostile pickle inert."""

    def find_class(self, module: str, name: str) -> Any:
        raise ConfigError(f"it names {module}.{name}, and a snapshot holds plain data only")


def read_snapshot(source: str | os.PathLike | dict) -> dict:
    """The snapshot dict from a pickle file (torch.cuda.memory._dump_snapshot) or as given; checked for the
    keys the doctor reads, so a wrong file fails here in one line rather than deep in the analysis."""
    if isinstance(source, dict):
        data, name = source, "snapshot"
    else:
        name = os.fspath(source)
        try:
            with open(name, "rb") as f:
                data = _PlainData(f).load()
        except OSError as e:
            raise ConfigError(f"cannot read snapshot {name}: {e.strerror or e}") from None
        except Exception as e:  # a damaged pickle raises any of a dozen types
            raise ConfigError(f"{name} is not a readable snapshot pickle: {e}") from None
    _check(data, name)
    return data


def _check(data: Any, name: str) -> None:
    if not isinstance(data, dict) or not isinstance(data.get("segments"), list):
        raise ConfigError(f"{name} is not a CUDA memory snapshot: expected a dict with a 'segments' list, as "
                          f"torch.cuda.memory._dump_snapshot() writes")
    for seg in data["segments"]:
        if not (isinstance(seg, dict) and isinstance(seg.get("total_size"), int)
                and isinstance(seg.get("blocks"), list)
                and all(isinstance(b, dict) and isinstance(b.get("size"), int) and isinstance(b.get("state"), str)
                        for b in seg["blocks"])):
            raise ConfigError(f"{name}: a segment lacks total_size or blocks with size and state")
    traces = data.get("device_traces", [])
    if not (isinstance(traces, list) and all(isinstance(t, list) and all(isinstance(e, dict) for e in t)
                                             for t in traces)):
        raise ConfigError(f"{name}: device_traces is not a list of per-device lists of events")


def explain_snapshot(source: str | os.PathLike | dict, context_bytes: int = 0, device: int | None = None,
                     top: int = 10) -> SnapshotReport:
    """Explain one device of a snapshot. `context_bytes` is the CUDA context to add for the nvidia-smi figure
    (memfit.memory.devices.context_bytes_for). `device` may be left out when the snapshot holds one device.
    The state is the one at the dump: a snapshot taken in an OOM handler may already miss tensors freed while
    the exception unwound, so an OOM's free blocks are, if anything, overstated."""
    data = read_snapshot(source)
    devices = sorted({seg.get("device", 0) for seg in data["segments"]})
    if device is None:
        if len(devices) > 1:
            raise ConfigError(f"the snapshot holds devices {', '.join(map(str, devices))}: choose one")
        device = devices[0] if devices else 0
    segments = [seg for seg in data["segments"] if seg.get("device", 0) == device]

    live, pending, reserved, releasable = 0, 0, 0, 0
    counts = {"small": 0, "large": 0}
    free = {True: 0, False: 0}      # by "small pool?"
    largest = {True: 0, False: 0}
    largest_live = {True: 0, False: 0}
    free_blocks = 0
    by_line: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for seg in segments:
        small = seg.get("segment_type") == "small"
        counts["small" if small else "large"] += 1
        reserved += seg["total_size"]
        if all(b["state"] == "inactive" for b in seg["blocks"]):
            releasable += seg["total_size"]
        for b in seg["blocks"]:
            if b["state"] == _LIVE:
                live += b["size"]
                largest_live[small] = max(largest_live[small], b["size"])
                entry = by_line[_source_line(b.get("frames") or [])]
                entry[0] += b["size"]
                entry[1] += 1
            elif b["state"] in _PENDING:
                pending += b["size"]
            else:
                free[small] += b["size"]
                largest[small] = max(largest[small], b["size"])
                free_blocks += 1

    oom = None
    traces = data.get("device_traces", [])
    ooms = [e for e in (traces[device] if device < len(traces) else []) if e.get("action") == "oom"]
    if ooms:
        small = ooms[-1].get("size", 0) <= SMALL_SIZE
        oom = OomEvent(requested=ooms[-1].get("size", 0), device_free=ooms[-1].get("device_free", 0),
                       free_in_pool=free[small], largest_free=largest[small])

    lines = sorted((SourceLine(w, n, k) for w, (n, k) in by_line.items()), key=lambda s: (-s.bytes, s.where))
    report = SnapshotReport(
        device=device, allocated=live, reserved=reserved, pending_free=pending, context=context_bytes,
        small_segments=counts["small"], large_segments=counts["large"], free_in_segments=free[True] + free[False],
        free_blocks=free_blocks, largest_free=max(largest.values()), largest_live=max(largest_live.values()),
        releasable=releasable, expandable=any(seg.get("is_expandable") for seg in segments),
        top=tuple(lines[:top]), oom=oom, advice=())
    scattered = [(free[p], largest[p], largest_live[p]) for p in (False, True)
                 if free[p] >= largest_live[p] > largest[p]]  # large pool first: where fragmentation hurts
    return _with_advice(report, scattered[0] if scattered else None)


def _with_advice(r: SnapshotReport, scattered: tuple[int, int, int] | None) -> SnapshotReport:
    """Advice that the numbers call for, one sentence each. `scattered`, for a pool whose free memory inside
    segments would hold its largest live block but none of whose free blocks does: (free bytes, largest free
    block, largest live block)."""
    advice = []
    much_free = r.free_in_segments >= FREE_SHARE * r.reserved > 0
    remedy = ("expandable_segments is already on, so only fewer distinct tensor sizes help" if r.expandable else
              "set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True so the allocator can map free pages into one range")
    if r.oom is not None and r.oom.fragmentation:
        advice.append(f"Fragmentation caused the OOM: the {fmt_bytes(r.oom.requested)} request would have fit in the "
                      f"free memory ({fmt_bytes(r.oom.free_in_pool)} cached, {fmt_bytes(r.oom.device_free)} on the "
                      f"device) but its largest free block is {fmt_bytes(r.oom.largest_free)}; {remedy}.")
    elif r.oom is not None and r.oom.largest_free >= r.oom.requested:
        advice.append(f"This snapshot was taken after memory was freed: its largest free block now holds the "
                      f"{fmt_bytes(r.oom.requested)} request, so it cannot show the layout at the failure; dump it "
                      f"at the OOM itself.")
    elif r.oom is not None:
        short = r.oom.requested - r.oom.free_in_pool - r.oom.device_free
        advice.append(f"The memory is really in use: the {fmt_bytes(r.oom.requested)} request needed "
                      f"{fmt_bytes(short)} more than was free, cached and on the device together, so the step's "
                      f"memory must shrink by at least that much.")
    elif much_free and scattered:
        pool_free, pool_largest, pool_live = scattered
        advice.append(f"The cache is fragmented: {fmt_bytes(pool_free)} free inside segments would hold the largest "
                      f"live tensor ({fmt_bytes(pool_live)}) but its largest free block is {fmt_bytes(pool_largest)}, "
                      f"so tensors that large take new segments; {remedy}.")
    if (much_free and scattered) or (r.oom is not None and r.oom.fragmentation):
        advice.append("Allocate the largest long-lived buffers first (or run the first step at the largest shape "
                      "the run will see), so that smaller tensors later fill their gaps instead of splitting "
                      "new segments.")
    if r.oom is not None:
        advice.append("torch.cuda.empty_cache() would not have prevented this OOM: before raising it the allocator "
                      "already returned every wholly free segment to the driver and retried.")
    elif much_free:
        if r.releasable:
            advice.append(f"torch.cuda.empty_cache() would hand back only the {fmt_bytes(r.releasable)} of segments "
                          f"that hold no live block: that helps other processes, not this one, whose allocator "
                          f"reuses cached blocks anyway, and each later cudaMalloc costs time.")
        else:
            advice.append("torch.cuda.empty_cache() would hand back nothing: it releases only segments that hold no "
                          "live block, and every segment here holds one.")
    return replace(r, advice=tuple(advice))


def _source_line(frames: list[dict]) -> str:
    """The innermost frame of the user's own code: not PyTorch's, not the standard library's, not C++."""
    for f in frames:
        path = str(f.get("filename", "")).replace("\\", "/")
        if not (path.endswith(".py") or path.startswith("<ipython")):
            continue
        if "/torch/" in path or ("/lib/python3" in path and "-packages/" not in path):
            continue
        return f"{path}:{f.get('line', '?')} in {f.get('name', '?')}"
    return "(no stack recorded)" if not frames else "(only PyTorch or library frames)"


def render(report: SnapshotReport) -> str:
    """A few plain-text lines for a terminal."""
    r = report
    out = [f"device {r.device}",
           f"  allocated   {fmt_bytes(r.allocated)} in live tensors",
           f"  reserved    {fmt_bytes(r.reserved)} in {r.segments} segments ({r.small_segments} small, "
           f"{r.large_segments} large); {fmt_bytes(r.unallocated)} of it cached but not allocated",
           f"  nvidia-smi  about {fmt_bytes(r.nvidia_smi)} (reserved + {fmt_bytes(r.context)} assumed CUDA context)",
           f"  free inside segments {fmt_bytes(r.free_in_segments)} in {r.free_blocks} blocks, largest "
           f"{fmt_bytes(r.largest_free)} (fragmentation {r.fragmentation:.0%}: free share outside the largest block)"]
    if r.pending_free:
        out.append(f"  {fmt_bytes(r.pending_free)} freed but still in use on another stream")
    if r.oom is not None:
        out.append(f"  OOM: a {fmt_bytes(r.oom.requested)} request failed with {fmt_bytes(r.oom.device_free)} free on "
                   f"the device; the largest free block of its pool is {fmt_bytes(r.oom.largest_free)}")
    if r.top:
        out.append("largest allocations by source line:")
        width = max(len(fmt_bytes(s.bytes)) for s in r.top)
        out += [f"  {fmt_bytes(s.bytes):>{width}}  {s.blocks:>4} block{'s' if s.blocks != 1 else ' '}  {s.where}"
                for s in r.top]
    out.append("advice:" if r.advice else "advice: none, the cached free memory is small or usable as it is")
    out += [f"  - {a}" for a in r.advice]
    return "\n".join(out)


# -- PyTorch's CUDA out-of-memory message

_UNITS = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
_SIZE = r"(\d+(?:\.\d+)?) ?(bytes|B|KiB|MiB|GiB|TiB)"
# since PyTorch 2.1 (c10/cuda/CUDACachingAllocator.cpp); 2.1 spelled "capacty"
_NEW = re.compile(r"[Oo]ut of memory\. Tried to allocate " + _SIZE + r"\. GPU (\d+) has a total capaci?ty of " + _SIZE
                  + r" of which " + _SIZE + r" is free\.")
_PROCESS = re.compile(r"(Including non-PyTorch memory, this process|Process (\d+)) has " + _SIZE + " memory in use")
_ALLOWED = re.compile(_SIZE + " allowed;")
_OWN = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch, (?:with " + _SIZE
                  + r" allocated in private pools \(e\.g\., CUDA Graphs\), )?and " + _SIZE
                  + " is reserved by PyTorch but unallocated")
# before 2.1
_OLD = re.compile(r"[Oo]ut of memory\. Tried to allocate " + _SIZE + r" \(GPU (\d+); " + _SIZE + " total capacity; "
                  + _SIZE + " already allocated; " + _SIZE + r" free; (?:" + _SIZE + " allowed; )?" + _SIZE
                  + " reserved in total by PyTorch")


def _bytes(number: str | None, unit: str | None) -> int | None:
    return None if number is None else round(float(number) * _UNITS[unit])


def parse_oom_message(text: str) -> dict | None:
    """The figures of a CUDA OOM message, in bytes (as precise as its two decimals), or None if `text` holds
    none. Keys: device, requested, total, free, allocated, reserved_unallocated; in_use (this process
    including non-PyTorch memory; None when the message does not say, as before 2.1 or without NVML),
    processes ({pid: bytes} of the others NVML listed), allowed (the per-process cap, or None), private_pools.
    `requested` is what the allocator tried to cudaMalloc: for a request under 10 MiB a whole 20 MiB segment."""
    text = " ".join(text.split())  # tracebacks wrap the message over lines
    m = _NEW.search(text)
    if m:
        g = m.groups()
        rest = text[m.end():]
        own = _OWN.search(rest)
        if not own:
            return None
        o = own.groups()
        in_use, processes = None, {}
        for p in _PROCESS.finditer(rest[:own.start()]):
            if p.group(2) is None:
                in_use = _bytes(p.group(3), p.group(4))
            else:
                processes[int(p.group(2))] = _bytes(p.group(3), p.group(4))
        allowed = _ALLOWED.search(rest[:own.start()])
        return {"device": int(g[2]), "requested": _bytes(g[0], g[1]), "total": _bytes(g[3], g[4]),
                "free": _bytes(g[5], g[6]), "in_use": in_use, "processes": processes,
                "allowed": _bytes(*allowed.groups()) if allowed else None,
                "allocated": _bytes(o[0], o[1]), "private_pools": _bytes(o[2], o[3]) or 0,
                "reserved_unallocated": _bytes(o[4], o[5])}
    m = _OLD.search(text)
    if m:
        g = m.groups()
        allocated, reserved = _bytes(g[5], g[6]), _bytes(g[11], g[12])
        return {"device": int(g[2]), "requested": _bytes(g[0], g[1]), "total": _bytes(g[3], g[4]),
                "free": _bytes(g[7], g[8]), "in_use": None, "processes": {}, "allowed": _bytes(g[9], g[10]),
                "allocated": allocated, "private_pools": 0, "reserved_unallocated": max(reserved - allocated, 0)}
    return None


def explain_oom(parsed: dict) -> list[str]:
    """What a parsed OOM message says, one sentence a line: fragmentation or real use, and whose memory the
    rest of the GPU is. Needs are stated, not solved: choosing a configuration that fits is the planner's."""
    req, free, total = parsed["requested"], parsed["free"], parsed["total"]
    cached = parsed["reserved_unallocated"]
    reserved = parsed["allocated"] + cached
    lines = [f"GPU {parsed['device']} could not allocate {fmt_bytes(req)}: {fmt_bytes(free)} of its "
             f"{fmt_bytes(total)} was free, and PyTorch held {fmt_bytes(reserved)} "
             f"({fmt_bytes(parsed['allocated'])} allocated, {fmt_bytes(cached)} cached but unallocated)."]
    if cached >= req:
        lines.append(f"Fragmentation caused it: the {fmt_bytes(cached)} PyTorch holds unallocated exceeds the request, "
                     f"but in pieces too small for it; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.")
    elif req <= free + cached:
        lines.append(f"Fragmentation tipped it: the free {fmt_bytes(free)} and the {fmt_bytes(cached)} cached would "
                     f"hold the request together but neither does alone; "
                     f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets the allocator join them.")
    else:
        lines.append(f"The memory is really in use: this allocation needs {fmt_bytes(req - free - cached)} more than "
                     f"is free (counting PyTorch's unallocated cache), so the step's memory must shrink by at least "
                     f"that much.")
    if parsed.get("allowed") is not None:
        lines.append(f"This process may use only {fmt_bytes(parsed['allowed'])} of the GPU "
                     f"(torch.cuda.set_per_process_memory_fraction).")
    in_use = parsed.get("in_use")
    if in_use is not None:
        others = total - free - in_use
        if others >= BIG_OTHER_USE:
            lines.append(f"Other processes use {fmt_bytes(others)} of this GPU (total - free - this process's "
                         f"{fmt_bytes(in_use)}): stop them or move to a GPU of its own.")
        if in_use - reserved >= BIG_NON_PYTORCH:
            lines.append(f"This process holds {fmt_bytes(in_use - reserved)} outside PyTorch's allocator, more than a "
                         f"CUDA context and its libraries usually take (0.3-1 GiB): look for NCCL buffers, cuDNN "
                         f"workspaces or another library allocating on its own.")
    else:
        outside = total - free - reserved
        if outside >= BIG_OTHER_USE:
            listed = ", ".join(f"process {pid} {fmt_bytes(n)}" for pid, n in parsed.get("processes", {}).items())
            lines.append(f"{fmt_bytes(outside)} of the GPU is outside PyTorch's allocator: this process's CUDA context "
                         f"and libraries, and any other process" + (f" (NVML lists {listed})." if listed else "."))
    return lines
