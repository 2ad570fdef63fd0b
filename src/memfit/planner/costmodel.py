"""Step time from a traced step: a roofline per op, with measured (or catalogue) device rates.

Every aten op of the traced step is one record (FLOPs, bytes read and written, its largest new allocation,
kind, phase). An op takes max(its matmul time at that size, its bytes / memory bandwidth) plus a fixed
dispatch overhead. Matmul time comes from a curve of single matmuls timed at several sizes, so the
efficiency lost by small micro-batches is in the model; on a CPU bandwidth is a curve too (small ops run
from cache, 3x faster than large ones), random-number ops (dropout) cost per number drawn (~6 ns each,
whatever the dtype: a bf16 dropout is not half the price of an fp32 one), and
a large fresh allocation pays its page faults (glibc returns every allocation over 32 MiB to the kernel
when it is freed). On a CPU ops run back to back; on a GPU the host's dispatch overlaps the kernels, so
the step takes the longer of the two. Offloaded work runs at the host's rates, and the bytes it moves cross
the host link.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

from memfit.memory.devices import Device
from memfit.memory.tracker import LiveBytes

PROFILE_VERSION = 3  # a cached profile of another version is measured again
# glibc's mmap threshold adapts up to 32 MiB; larger blocks are mapped fresh and unmapped on free, so every
# step touches their pages anew (minor faults, the kernel zeroing each page)
LARGE_ALLOC = 32 * 2**20


@dataclasses.dataclass
class Profile:
    device: str
    kind: str                  # "cpu" | "cuda"
    source: str                # how the figures were obtained
    matmul: dict               # "f32" | "lp" -> [[flops, seconds], ...] for single matmuls, ascending
    bandwidth: float           # bytes/s achieved by a large copy (read + write)
    op_overhead: float         # seconds of host time per op (dispatch, autograd bookkeeping)
    link_bandwidth: float      # host <-> device bytes/s (inf on a CPU: nothing crosses)
    host: dict | None = None   # the host's Profile (as a dict) for offloaded work; None on a CPU
    cache_bandwidth: list | None = None  # [[bytes moved, bytes/s], ...] by op size; None: `bandwidth` for all
    rng_rate: float | None = None        # random numbers drawn per second (dropout); None: bytes at bandwidth
    fault_seconds: float = 0.0           # per byte of a fresh allocation over LARGE_ALLOC (a CPU's page faults)
    version: int = PROFILE_VERSION

    def matmul_seconds(self, kind: str, flops: torch.Tensor) -> torch.Tensor:
        return _curve_seconds(self.matmul["lp" if kind == "lp" else "f32"], flops)

    def memory_seconds(self, nbytes: torch.Tensor) -> torch.Tensor:
        if not self.cache_bandwidth:
            return nbytes / self.bandwidth
        return _curve_seconds([[b, b / rate] for b, rate in self.cache_bandwidth], nbytes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _curve_seconds(points: list, amount: torch.Tensor) -> torch.Tensor:
    """Seconds for `amount` (FLOPs or bytes) by log-log interpolation of measured [amount, seconds] points;
    beyond the ends, the end rates."""
    pts = torch.tensor(points, dtype=torch.float64)
    if len(amount) == 0:
        return amount
    la, lt = pts[:, 0].log(), pts[:, 1].log()
    x = amount.clamp(min=1).log()
    i = torch.searchsorted(la, x).clamp(1, len(la) - 1)
    w = (x - la[i - 1]) / (la[i] - la[i - 1])
    inside = (lt[i - 1] + w * (lt[i] - lt[i - 1])).exp()
    low = amount / (pts[0, 0] / pts[0, 1])
    high = amount / (pts[-1, 0] / pts[-1, 1])
    return torch.where(x < la[0], low, torch.where(x > la[-1], high, inside))


KINDS = {"f32": 0, "lp": 1, "view": 2, "rng": 3, "host": 4, "link": 5}  # device-side kinds first
PHASES = {"setup": 0, "forward": 1, "backward": 2, "optimizer": 3}


class OpTable:
    """An estimate's per-op records as tensors, built once: the planner prices them many times."""

    def __init__(self, ops: dict):
        self.flops = torch.tensor(ops["flops"], dtype=torch.float64)
        self.bytes = torch.tensor(ops["bytes"], dtype=torch.float64)
        self.alloc = torch.tensor(ops["alloc"], dtype=torch.float64)
        self.kind = torch.tensor([KINDS[k] for k in ops["kind"]], dtype=torch.int8)
        self.phase = torch.tensor([PHASES[p] for p in ops["phase"]], dtype=torch.int8)

    def mask(self, phases: tuple[str, ...]) -> torch.Tensor:
        m = torch.zeros_like(self.phase, dtype=torch.bool)
        for p in phases:
            m |= self.phase == PHASES[p]
        return m


def _device_seconds(profile: Profile, flops, nbytes, alloc, kind) -> torch.Tensor:
    busy = profile.memory_seconds(nbytes)
    if profile.rng_rate:
        busy = torch.where(kind == KINDS["rng"], torch.maximum(busy, flops / profile.rng_rate), busy)
    for name in ("f32", "lp"):  # only ops that do FLOPs consult the matmul curve (rng's FLOPs are draws)
        sel = ((kind == KINDS[name]) & (flops > 0)).nonzero().flatten()
        if len(sel):
            busy[sel] = torch.maximum(busy[sel], profile.matmul_seconds(name, flops[sel]))
    if profile.fault_seconds:
        busy = busy + torch.where(alloc > LARGE_ALLOC, alloc * profile.fault_seconds, 0.0)
    return torch.where(kind == KINDS["view"], torch.zeros_like(busy), busy)


def phase_seconds(profile: Profile, table: OpTable, phases: tuple[str, ...], flops=None, nbytes=None,
                  alloc=None) -> float:
    """Seconds of the ops in `phases`; `flops` / `nbytes` / `alloc` optionally replace the table's (scaled
    probes). Host-side ops (offloaded optimizer) run at the host's rates; host<->device copies are priced
    by the link, from the moved bytes, not here."""
    flops = table.flops if flops is None else flops
    nbytes = table.bytes if nbytes is None else nbytes
    alloc = table.alloc if alloc is None else alloc
    sel = table.mask(phases)
    dev = sel & (table.kind <= KINDS["rng"])
    host = sel & (table.kind == KINDS["host"])
    busy = float(_device_seconds(profile, flops[dev], nbytes[dev], alloc[dev], table.kind[dev]).sum())
    dispatch = int(dev.sum()) * profile.op_overhead
    device = max(busy, dispatch) if profile.kind == "cuda" else busy + dispatch
    hp = Profile(**profile.host) if profile.host else profile
    f32 = torch.zeros(int(host.sum()), dtype=torch.int8)
    host_s = float(_device_seconds(hp, flops[host], nbytes[host], alloc[host], f32).sum())
    return device + host_s + int(host.sum()) * hp.op_overhead


def step_seconds(profile: Profile, estimate, micro_steps: float = 1.0) -> float:
    """Predicted wall time of the traced step; `micro_steps` scales its forward/backward part (a trace of
    two micro-steps stands for an accumulation of many)."""
    table = OpTable(estimate.ops)
    t = micro_steps * phase_seconds(profile, table, ("forward", "backward"))
    t += phase_seconds(profile, table, ("optimizer", "setup"))
    if profile.kind == "cuda" and estimate.moved_bytes:
        t += micro_steps * estimate.moved_bytes / profile.link_bandwidth
    return t


# ------------------------------------------------------------------------------------------ calibration

def _time(fn, min_seconds: float = 0.02, rounds: int = 5, sync=lambda: None) -> float:
    """Seconds per call: the best of `rounds` rounds, so that a busy moment on a shared machine does not
    end up in the profile (a calibration taken under load once made every CPU prediction 3x too slow)."""
    fn()
    sync()
    best = math.inf
    for _ in range(rounds):
        reps, start = 0, time.perf_counter()
        while True:
            fn()
            reps += 1
            sync()
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds and reps >= 2:
                break
        best = min(best, elapsed / reps)
    return best


def calibrate(device: str = "cpu") -> Profile:
    """Measure this machine's device: matmul time at several sizes in fp32 and bf16 (on many CPUs bf16 is
    slower), copy bandwidth by size, dropout's rate, page faults, per-op overhead and (GPU) the pinned
    host link. A few seconds."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sizes = [32, 64, 128, 256, 512, 1024] + ([2048, 4096] if dev.type == "cuda" else [])
    curves = {}
    for kind, dtype in (("f32", torch.float32), ("lp", torch.bfloat16)):
        pts = []
        for n in sizes:
            a = torch.randn(n, n, device=dev, dtype=dtype)
            b = torch.randn(n, n, device=dev, dtype=dtype)
            pts.append([2.0 * n ** 3, _time(lambda: a @ b, sync=sync)])
        curves[kind] = pts
    cache = []
    for mib in (0.25, 1, 4, 16, 64, 256):  # from inside L2 to far beyond any cache
        x = torch.ones(int(mib * 2**18), device=dev)
        y = torch.empty_like(x)
        moved = 2 * x.numel() * 4  # read + written, as the tracker counts an op's bytes
        cache.append([moved, moved / _time(lambda: y.copy_(x), sync=sync)])
    del x, y
    bandwidth = cache[-1][1]
    x = torch.ones(4 * 2**20, device=dev)  # CPU dropout draws its mask with bernoulli_, per element
    rng = x.numel() / _time(lambda: x.bernoulli_(0.9), sync=sync)
    faults = 0.0
    if dev.type == "cpu":  # a fresh 64 MiB block against the same block reused
        n = 16 * 2**20
        big = torch.empty(n)
        reused = _time(lambda: big.fill_(1.0))
        fresh = _time(lambda: torch.empty(n).fill_(1.0))
        faults = max(0.0, fresh - reused) / (n * 4)
    link = math.inf
    host = None
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        pinned = torch.empty(64 * 2**20, pin_memory=True)
        on_dev = torch.empty(64 * 2**20, device=dev)
        link = pinned.numel() * 4 / _time(lambda: on_dev.copy_(pinned, non_blocking=True), sync=sync)
        host = calibrate("cpu").to_dict()
    else:
        name = f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    stamp = datetime.date.today().isoformat()
    return Profile(device=name, kind=dev.type, source=f"calibrated on this machine, {stamp}", matmul=curves,
                   bandwidth=bandwidth, op_overhead=_op_overhead(dev, sync), link_bandwidth=link, host=host,
                   cache_bandwidth=cache, rng_rate=rng, fault_seconds=faults)


def _op_overhead(dev: torch.device, sync) -> float:
    """Host seconds per op of a real training step on tiny tensors: dispatch plus autograd's graph
    building and module calls, counted the way the tracker counts a step's ops. A bare op on a tiny
    tensor costs less than half of it, and pricing ops at that made small micro-batches look cheap."""
    layers = []
    for _ in range(20):
        layers += [torch.nn.Linear(8, 8), torch.nn.LayerNorm(8), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).to(dev)
    x = torch.randn(2, 8, device=dev)

    def step():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    counter = LiveBytes(dev.type)
    with counter:
        step()
    return _time(step, sync=sync) / len(counter.op_kind)


# A GPU server's host, for offloaded work when the GPU is only a catalogue entry (this machine's CPU is
# not the one that will drive it): ~100 GB/s of memory bandwidth reached by streaming ops, ~1 TFLOP/s.
SERVER_HOST = Profile(device="GPU server host (assumed)", kind="cpu", source="assumed figures",
                      matmul={"f32": [[1e6, 1e-5], [1e12, 1.0]], "lp": [[1e6, 1e-5], [1e12, 1.0]]},
                      bandwidth=100e9, op_overhead=10e-6, link_bandwidth=math.inf)


def catalogue_profile(dev: Device, host: Profile | None = None) -> Profile:
    """A GPU we cannot measure: its data-sheet peaks at 70% for matmuls (large ones reach 60-80% in
    practice) and 80% of its memory bandwidth, plus 10 us of host dispatch per op. Uncalibrated."""
    curves = {}
    for kind, rate in (("f32", dev.peak_flops.get("tf32", dev.peak_flops.get("fp32", 1e13))),
                       ("lp", dev.peak_flops.get("bf16" if dev.bf16 else "fp16", 1e13))):
        # a kernel costs at least ~5 us; efficiency reaches its plateau around 1e10 FLOPs
        curves[kind] = [[f, 5e-6 + f / (0.7 * rate)] for f in (1e6, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13)]
    return Profile(device=dev.name, kind="cuda", source="catalogue figures, not calibrated", matmul=curves,
                   bandwidth=0.8 * (dev.memory_bandwidth or 1e12), op_overhead=10e-6,
                   link_bandwidth=dev.host_bandwidth or 12e9, host=(host or SERVER_HOST).to_dict())


def _cache_dir() -> Path:
    return Path(os.environ.get("MEMFIT_CACHE", Path.home() / ".cache" / "memfit"))


def profile_path(device_name: str) -> Path:
    return _cache_dir() / f"profile-{device_name.replace(' ', '_').replace('/', '_')}.json"


def save_profile(profile: Profile, key: str) -> Path:
    path = profile_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile.to_dict(), indent=1))
    os.replace(tmp, path)
    return path


def load_profile(key: str) -> Profile | None:
    path = profile_path(key)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        # a damaged profile, or one measured by an older memfit, is simply measured again
        return Profile(**data) if data.get("version") == PROFILE_VERSION else None
    except (ValueError, TypeError, AttributeError):
        return None


def profile_for(dev: Device) -> Profile:
    """The CPU and a present GPU are measured (once, then cached); a catalogue GPU uses its data sheet and
    an assumed server host."""
    if dev.kind == "cpu" or dev.name.startswith("cuda"):
        key = "cpu" if dev.kind == "cpu" else dev.name
        profile = load_profile(key)
        if profile is None:
            profile = calibrate("cpu" if dev.kind == "cpu" else "cuda")
            save_profile(profile, key)
        return profile
    return catalogue_profile(dev)
