"""Step time from a traced step: a roofline per op, with measured (or catalogue) device rates.

Every aten op of the traced step is one record (FLOPs, bytes read and written, dtype kind, phase). An op
takes max(its matmul time at that size, its bytes / memory bandwidth) plus a fixed dispatch overhead. Matmul
time comes from a curve of single matmuls timed at several sizes, so the efficiency lost by small
micro-batches is in the model. On a CPU ops run back to back; on a GPU the host's dispatch overlaps the
kernels, so the step takes the longer of the two. Offloaded work runs at the host's rates, and the bytes
it moves cross the host link.
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

    def matmul_seconds(self, kind: str, flops: torch.Tensor) -> torch.Tensor:
        """Log-log interpolation of the measured curve; beyond its ends, the end rates."""
        pts = torch.tensor(self.matmul["lp" if kind == "lp" else "f32"], dtype=torch.float64)
        lf, lt = pts[:, 0].log(), pts[:, 1].log()
        x = flops.clamp(min=1).log()
        i = torch.searchsorted(lf, x).clamp(1, len(lf) - 1)
        w = (x - lf[i - 1]) / (lf[i] - lf[i - 1])
        inside = (lt[i - 1] + w * (lt[i] - lt[i - 1])).exp()
        low = flops / (pts[0, 0] / pts[0, 1])
        high = flops / (pts[-1, 0] / pts[-1, 1])
        return torch.where(x < lf[0], low, torch.where(x > lf[-1], high, inside))

    def ops_seconds(self, flops: torch.Tensor, nbytes: torch.Tensor, kinds: list[str]) -> tuple[float, float]:
        """(device seconds, host dispatch seconds) for a list of ops."""
        kind = torch.tensor([{"f32": 0, "lp": 1, "view": 2}.get(k, 0) for k in kinds])
        mem = nbytes / self.bandwidth
        mm = torch.where(kind == 1, self.matmul_seconds("lp", flops), self.matmul_seconds("f32", flops))
        dev = torch.where(kind == 2, torch.zeros_like(mem), torch.maximum(torch.where(flops > 0, mm, 0), mem))
        return float(dev.sum()), len(kinds) * self.op_overhead

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def phase_seconds(profile: Profile, ops: dict, phases: tuple[str, ...], scale=None) -> float:
    """Seconds of the ops in `phases`. `scale` optionally replaces (flops, bytes) per op (tensors)."""
    idx = [i for i, p in enumerate(ops["phase"]) if p in phases]
    if not idx:
        return 0.0
    flops, nbytes = scale if scale is not None else (torch.tensor(ops["flops"], dtype=torch.float64),
                                                       torch.tensor(ops["bytes"], dtype=torch.float64))
    sel = torch.tensor(idx)
    flops, nbytes = flops[sel], nbytes[sel]
    kinds = [ops["kind"][i] for i in idx]
    host_mask = torch.tensor([k == "host" for k in kinds])
    dev_idx = (~host_mask).nonzero().flatten()
    d_dev, d_cpu = profile.ops_seconds(flops[dev_idx], nbytes[dev_idx], [kinds[i] for i in dev_idx.tolist()])
    host = Profile(**profile.host) if profile.host else profile
    h_idx = host_mask.nonzero().flatten()
    h_dev, h_cpu = host.ops_seconds(flops[h_idx], nbytes[h_idx], ["f32"] * len(h_idx))
    device = max(d_dev, d_cpu) if profile.kind == "cuda" else d_dev + d_cpu
    return device + h_dev + h_cpu


def step_seconds(profile: Profile, estimate) -> float:
    """Predicted wall time of the traced step."""
    t = phase_seconds(profile, estimate.ops, ("forward", "backward", "optimizer", "setup"))
    if profile.kind == "cuda" and estimate.moved_bytes:
        t += estimate.moved_bytes / profile.link_bandwidth
    return t


# ------------------------------------------------------------------------------------------ calibration

def _time(fn, min_seconds: float = 0.05, sync=lambda: None) -> float:
    fn()
    sync()
    reps, start = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and reps >= 3:
            return elapsed / reps


def calibrate(device: str = "cpu") -> Profile:
    """Measure this machine's device: matmul time at several sizes in fp32 and bf16 (on many CPUs bf16 is
    slower), copy bandwidth, per-op overhead and (GPU) the pinned host link. A few seconds."""
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
    x = torch.empty(16 * 2**20, device=dev)  # 64 MiB
    y = torch.empty_like(x)
    bandwidth = 2 * x.numel() * 4 / _time(lambda: y.copy_(x), sync=sync)
    tiny = torch.zeros(1, device=dev)
    overhead = _time(lambda: [tiny.add_(1) for _ in range(200)], sync=sync) / 200
    link = math.inf
    host = None
    name = "cpu"
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
                   bandwidth=bandwidth, op_overhead=overhead, link_bandwidth=link, host=host)


def catalogue_profile(dev: Device, host: Profile | None) -> Profile:
    """A GPU we cannot measure: its data-sheet peaks at 70% for matmuls (large ones reach 60-80% in
    practice) and 80% of its memory bandwidth, plus 10 us of host dispatch per op. Uncalibrated."""
    curves = {}
    for kind, rate in (("f32", dev.peak_flops.get("tf32", dev.peak_flops.get("fp32", 1e13))),
                       ("lp", dev.peak_flops.get("bf16" if dev.bf16 else "fp16", 1e13))):
        # a kernel costs at least ~5 us; efficiency reaches its plateau around 1e10 FLOPs
        curves[kind] = [[f, 5e-6 + f / (0.7 * rate)] for f in (1e6, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13)]
    return Profile(device=dev.name, kind="cuda", source="catalogue figures, not calibrated", matmul=curves,
                   bandwidth=0.8 * (dev.memory_bandwidth or 1e12), op_overhead=10e-6,
                   link_bandwidth=dev.host_bandwidth or 12e9, host=host.to_dict() if host else None)


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
        return Profile(**json.loads(path.read_text()))
    except (ValueError, TypeError):
        return None  # a stale or damaged profile is simply measured again


def profile_for(dev: Device) -> Profile:
    """The CPU and a present GPU are measured (once, then cached); a catalogue GPU uses its data sheet,
    with this machine's CPU as its host."""
    if dev.kind == "cpu" or dev.name.startswith("cuda"):
        key = "cpu" if dev.kind == "cpu" else dev.name
        profile = load_profile(key)
        if profile is None:
            profile = calibrate("cpu" if dev.kind == "cpu" else "cuda")
            save_profile(profile, key)
        return profile
    return catalogue_profile(dev, profile_for_cpu())


def profile_for_cpu() -> Profile:
    profile = load_profile("cpu")
    if profile is None:
        profile = calibrate("cpu")
        save_profile(profile, "cpu")
    return profile
