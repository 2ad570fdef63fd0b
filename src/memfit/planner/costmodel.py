"""Step time from a traced step: a roofline per op, with measured (or catalogue) device rates.

Every aten op of the traced step is one record (name, FLOPs, bytes read and written, its largest new
allocation, kind, phase). An op costs a fixed host overhead (dispatch, autograd; measured on a real
training step) plus its device time, from curves measured on this machine for its class of op, on
inputs that come from memory rather than a hot cache (as a step's tensors do):
  matmuls, convolutions and attention (forward and backward apart) at the slower of two curves, one by
  FLOPs (wide shapes) and one by bytes (narrow ones: a 3x3 convolution over 8 channels costs per pixel,
  ~100 us at least; the CPU's bf16 attention backward ~100 ns per element, 10x fp32's time);
  elementwise ops, and the costlier per-element ones (exp-like functions, norms, softmax, pooling), by
  their bytes, per dtype (a bf16 multiply is no faster than an fp32 one per element, so it is slower
  per byte);
  random numbers (dropout) per number drawn, whatever the dtype;
  and a large fresh allocation its page faults (glibc returns every allocation over 32 MiB to the kernel
  when it is freed).
What no curve covers falls back to the matmul curve (FLOPs) and the copy bandwidth (bytes); a GPU from the
catalogue has only those. On a CPU ops run back to back; on a GPU the host's dispatch overlaps the
kernels, so the step takes the longer of the two. Offloaded work runs at the host's rates, and the bytes
it moves cross the host link. benchmarks/step_time.py measures the result against real steps.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from memfit.memory.devices import Device
from memfit.memory.tracker import OpRecorder, OpTrace

PROFILE_VERSION = 5  # a cached profile of another version is measured again
# When a cached profile is measured again (`stale`): another profile version; another torch version, CPU
# model or thread count; older than MAX_AGE_DAYS; or, if its figures looked wrong, older than an hour.
MAX_AGE_DAYS = 30
SUSPECT_AGE = 3600.0
# A calibration taken on a busy machine once priced every op at 2.16 ms (a quiet one measures 5-10 us) and
# was kept for good. Checks (`_problems`): per-op cost over MAX_OP_OVERHEAD; figures measured twice (start
# and end) that differ by more than REPEAT_SPREAD; a curve whose smallest size takes over MAX_SMALL_OP, or
# whose larger size ran faster than a smaller one by more than CURVE_DIP; other processes using more
# than BUSY_CORES cores meanwhile. A suspect calibration is measured once more; if it is still suspect it
# is rejected: kept an hour in a file of its own (not measured again at every plan) and used only where no
# earlier good calibration of this processor is left, marked wherever its step times are shown
# (`profile_for`, `describe`). `memfit calibrate` refuses to save one.
MAX_OP_OVERHEAD = 200e-6
CURVE_DIP = 2.0  # a larger size may run faster than a smaller one by this much (tiny sizes are noisy)
MAX_SMALL_OP = 5e-3  # the smallest size of a curve takes microseconds (the CPU's bf16 attention backward: 2 ms)
REPEAT_SPREAD = 1.5
BUSY_CORES = 0.5
# glibc's mmap threshold adapts up to 32 MiB; larger blocks are mapped fresh and unmapped on free, so every
# step touches their pages anew (minor faults, the kernel zeroing each page)
LARGE_ALLOC = 32 * 2**20

# Classes of ops with their own curves (`Profile.curves`, keyed "<class>.<f32|lp>"). The first five are
# priced by FLOPs, the last two by bytes; any other op is elementwise, or a matmul if it has FLOPs.
CLASSES = ("mm", "conv", "conv_bwd", "attn", "attn_bwd", "elementwise", "special")
FLOP_CLASSES = CLASSES[:5]
_ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
_SPECIAL = ("exp", "exp2", "expm1", "log", "log1p", "log2", "tanh", "sigmoid", "silu", "gelu", "erf", "erfinv",
            "sin", "cos", "softplus", "elu", "mish", "_softmax", "_log_softmax", "logsumexp", "native_layer_norm",
            "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
            "_native_batch_norm_legit_no_training", "native_group_norm", "_fused_rms_norm", "max_pool2d_with_indices",
            "avg_pool2d", "_adaptive_avg_pool2d")
_CLASS_OF = {"mm": "mm", "addmm": "mm", "bmm": "mm", "baddbmm": "mm", "addbmm": "mm",
             "convolution": "conv", "convolution_backward": "conv_bwd",
             **{n: "attn" for n in _ATTENTION}, **{n + "_backward": "attn_bwd" for n in _ATTENTION},
             **{n: "special" for n in _SPECIAL}, **{n + "_backward": "special" for n in _SPECIAL},
             "_softmax_backward_data": "special", "_log_softmax_backward_data": "special"}


@dataclasses.dataclass
class Profile:
    device: str
    kind: str                  # "cpu" | "cuda"
    source: str                # how the figures were obtained
    matmul: dict               # "f32" | "lp" -> [[flops, seconds], ...] for matmuls, ascending
    bandwidth: float           # bytes/s achieved by a large copy (read + write)
    op_overhead: float         # seconds of host time per op (dispatch, autograd bookkeeping)
    link_bandwidth: float      # host <-> device bytes/s (inf on a CPU: nothing crosses)
    host: dict | None = None   # the host's Profile (as a dict) for offloaded work; None on a CPU
    cache_bandwidth: list | None = None  # [[bytes moved, bytes/s], ...] by op size; None: `bandwidth` for all
    rng_rate: float | None = None        # random numbers drawn per second (dropout); None: bytes at bandwidth
    fault_seconds: float = 0.0           # per byte of a fresh allocation over LARGE_ALLOC (a CPU's page faults)
    version: int = PROFILE_VERSION
    curves: dict | None = None           # "<class>.<f32|lp>" -> [[FLOPs or bytes, seconds], ...] (CLASSES)
    machine: dict | None = None          # what the figures hold for: torch version, CPU model, threads (`machine`)
    measured_at: float | None = None     # seconds since the epoch
    problems: list = dataclasses.field(default_factory=list)  # why the figures look wrong; empty if they do not
    fallback: str | None = None          # why these figures stand in for a newer, rejected calibration (profile_for)

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


KINDS = {"f32": 0, "lp": 1, "view": 2, "rng": 3, "host": 4, "link": 5, "comm": 6}  # device-side kinds first
PHASES = {"setup": 0, "forward": 1, "backward": 2, "optimizer": 3}


# Ops aten does not mark as views that still move no data: dispatch only.
ALIASES = frozenset({"_unsafe_view", "alias", "lift_fresh"})


class OpTable:
    """A step's op trace as tensors, built once: the planner prices them many times. Rows stay
    in step with the records (two probes' tables are compared row by row)."""

    def __init__(self, ops: OpTrace):
        names = ops.name
        self.flops = torch.tensor(ops.flops, dtype=torch.float64)
        self.bytes = torch.tensor(ops.bytes, dtype=torch.float64)
        self.alloc = torch.tensor(ops.alloc, dtype=torch.float64)
        self.kind = torch.tensor([KINDS["view" if n in ALIASES else k] for n, k in zip(names, ops.kind)],
                                 dtype=torch.int8)
        self.phase = torch.tensor([PHASES[p] for p in ops.phase], dtype=torch.int8)
        self.cls = torch.tensor([CLASSES.index(_CLASS_OF.get(n, "elementwise")) for n in names], dtype=torch.int8)
        # collectives: 1 all-gather / reduce-scatter (S (n-1)/n through each rank), 2 all-reduce (twice that),
        # across the data-parallel ranks; 3 and 4 the same within a tensor-parallel group (DTensor's); a pipeline's
        # sends and receives are priced apart (pipeline_seconds)
        self.collective = torch.tensor([_collective(n) if k == "comm" else 0 for n, k in zip(names, ops.kind)],
                                       dtype=torch.int8)

    def rows(self, start: int, stop: int) -> "OpTable":
        """The table of the ops from `start` up to `stop` (one micro-step's)."""
        out = object.__new__(OpTable)
        for field in ("flops", "bytes", "alloc", "kind", "phase", "cls", "collective"):
            setattr(out, field, getattr(self, field)[start:stop])
        return out

    def mask(self, phases: tuple[str, ...]) -> torch.Tensor:
        m = torch.zeros_like(self.phase, dtype=torch.bool)
        for p in phases:
            m |= self.phase == PHASES[p]
        return m


def _device_seconds(profile: Profile, flops, nbytes, alloc, kind, cls) -> torch.Tensor:
    busy = profile.memory_seconds(nbytes)  # a floor for ops with FLOPs; the price of the rest without curves
    if profile.rng_rate:
        busy = torch.where(kind == KINDS["rng"], torch.maximum(busy, flops / profile.rng_rate), busy)
    # rng's FLOPs are draws: only f32 / lp ops are priced by class
    cls = torch.where((cls == CLASSES.index("elementwise")) & (flops > 0), CLASSES.index("mm"), cls)
    curves = profile.curves or {}
    for c, name in enumerate(CLASSES):
        for tag in ("f32", "lp"):
            sel = ((cls == c) & (kind == KINDS[tag])).nonzero().flatten()
            if not len(sel):
                continue
            if name in FLOP_CLASSES:
                sel = sel[flops[sel] > 0]
                points = curves.get(f"{name}.{tag}") or profile.matmul[tag]
                busy[sel] = torch.maximum(busy[sel], _curve_seconds(points, flops[sel]))
                if f"{name}_bytes.{tag}" in curves:
                    busy[sel] = torch.maximum(busy[sel], _curve_seconds(curves[f"{name}_bytes.{tag}"], nbytes[sel]))
            else:
                points = curves.get(f"{name}.{tag}") or curves.get(f"elementwise.{tag}")
                if points:
                    busy[sel] = _curve_seconds(points, nbytes[sel])
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
    busy = float(_device_seconds(profile, flops[dev], nbytes[dev], alloc[dev], table.kind[dev], table.cls[dev]).sum())
    dispatch = int(dev.sum()) * profile.op_overhead
    device = max(busy, dispatch) if profile.kind == "cuda" else busy + dispatch
    hp = Profile(**profile.host) if profile.host else profile
    f32 = torch.zeros(int(host.sum()), dtype=torch.int8)
    host_s = float(_device_seconds(hp, flops[host], nbytes[host], alloc[host], f32, table.cls[host]).sum())
    return device + host_s + int(host.sum()) * hp.op_overhead


def step_seconds(profile: Profile, ops: OpTrace, micro_steps: int = 1, comm: "Comm | None" = None) -> float:
    """Predicted wall time of a step of `micro_steps` micro-steps from its trace, which may hold fewer: the
    traced micro-steps first, the last one traced repeating for the rest (from the second on, each adds its
    gradients into those kept, which the first only makes: a trace of one adds that work, `OpTrace.accumulate`).
    The bytes offloading moves are counted the same way, the optimizer step's once. `comm`: the step's
    collectives across ranks, overlapped within each micro-step."""
    table = OpTable(ops)
    marks = ops.micro_steps or [(0, 0)]
    end, moved_end = ops.optimizer_at or (len(ops), ops.moved_bytes)
    times, moved = [], []
    for (start, before), (stop, after) in zip(marks, [*marks[1:], (end, moved_end)]):
        part = table.rows(start, stop)
        t = phase_seconds(profile, part, ("forward", "backward"))
        times.append(comm.overlapped(t, part) if comm is not None else t)
        moved.append(after - before)
    more = max(micro_steps - len(times), 0)
    t = sum(times) + more * times[-1]
    if len(times) == 1 and micro_steps > 1:
        t += (micro_steps - 1) * accumulation_seconds(profile, ops)
    t += phase_seconds(profile, table, ("optimizer", "setup"))
    if profile.kind == "cuda":
        t += (sum(moved) + more * moved[-1] + ops.moved_bytes - moved_end) / profile.link_bandwidth
    return t


def accumulation_seconds(profile: Profile, ops: OpTrace) -> float:
    """What each micro-step after the first adds to a one-micro-step trace: an add_ of each gradient into the
    one kept (`OpTrace.accumulate`). On the device an add takes the place of the first micro-step's taking
    the gradient over (a view, dispatched as well): only its kernel time is added. On the host (optimizer
    offload) it is new work, dispatch included."""
    def table(rows: list) -> OpTable:
        n = len(rows)
        return OpTable(OpTrace(flops=[0] * n, bytes=[b for b, _ in rows], alloc=[0] * n, kind=[k for _, k in rows],
                               phase=["backward"] * n, name=["add_"] * n))

    device = table([r for r in ops.accumulate if r[1] != "host"])
    host = [r for r in ops.accumulate if r[1] == "host"]
    busy = _device_seconds(profile, device.flops, device.bytes, device.alloc, device.kind, device.cls)
    return float(busy.sum()) + (phase_seconds(profile, table(host), ("backward",)) if host else 0.0)


def _collective(name: str) -> int:
    if name in ("send", "recv_", "recv_any_source_"):
        return 0
    if name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        return 3
    if name == "all_reduce":
        return 4
    return 2 if name.startswith("allreduce") else 1


def pipeline_slots(schedule: str, ranks: int, micro_batches: int, virtual: int = 1,
                   forward_share: float = 1 / 3) -> float:
    """A pipeline step's compute, in slots of one micro-batch's forward and backward on one rank (all its stages):
    the n slots every schedule needs and its bubble, (p - 1) slots times what the schedule leaves of it.

    - ``gpipe``, ``1f1b``: p - 1 slots, a bubble of (p - 1) / n of the ideal (Huang et al. 2019, GPipe;
      Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
      section 2.2.1: the same bubble, 1F1B only holds fewer micro-batches).
    - ``interleaved-1f1b``: each rank runs v stages of 1/v of its blocks, so the fill and drain take chunks of
      1/v of a slot: (p - 1) / v slots, (p - 1) / (v n) of the ideal (Narayanan et al. 2021, section 2.2.2).
    - ``zero-bubble``: torch's ``ScheduleInterleavedZeroBubble`` (ZB1P, Qi et al. 2023, "Zero Bubble Pipeline
      Parallelism") is the interleaved order with each backward split into its input gradient (I) and a weight
      gradient (W) held back to fill the bubble. ZB-H1's bubble is (p - 1)(F + I - W), a third of 1F1B's
      (p - 1)(F + I + W) when F = I = W; torch interleaves it, so (p - 1)(F + I - W) / v. The trace does not
      part I from W; with I = W (their matmuls' FLOPs are equal) it is (p - 1) F / v: `forward_share` of the
      interleaved schedule's bubble, F / (F + I + W). Checked against torch's own order, replayed with
      those durations (tests/test_closed_forms.py)."""
    bubble = {"gpipe": 1.0, "1f1b": 1.0, "interleaved-1f1b": 1 / virtual,
              "zero-bubble": forward_share / virtual}[schedule]
    return micro_batches + (ranks - 1) * bubble


def pipeline_receives(schedule: str, ranks: int, micro_batches: int, virtual: int = 1) -> int:
    """Blocking waits for an activation or a gradient along a step's critical path: one per chunk slot. A rank
    of an interleaved schedule receives v times a micro-batch (once per stage it holds): v n + p - 1, v times
    the point-to-point traffic (Narayanan et al. 2021, section 2.2.2); one stage a rank: n + p - 1."""
    v = virtual if schedule in ("interleaved-1f1b", "zero-bubble") else 1
    return v * micro_batches + ranks - 1


def pipeline_seconds(profile: Profile, stage_ops: list, micro_batches: int, comm: "Comm | None" = None,
                     send_seconds: float = 0.0, schedule: str = "1f1b", virtual: int = 1) -> float:
    """Predicted wall time of a pipeline step from every pipeline rank's traced step (all its stages and
    micro-batches): `pipeline_slots` slots, each as long as the slowest rank's forward and backward of one
    micro-batch (its collectives overlapped as `comm` says), plus `pipeline_receives` waits of `send_seconds`
    (the schedules block on a receive before computing), then the slowest rank's optimizer step."""
    slot, share, update = pipeline_parts(profile, stage_ops, micro_batches, comm)
    ranks = len(stage_ops)
    return (pipeline_slots(schedule, ranks, micro_batches, virtual, share) * slot
            + pipeline_receives(schedule, ranks, micro_batches, virtual) * send_seconds + update)


def pipeline_parts(profile: Profile, stage_ops: list, micro_batches: int, comm: "Comm | None" = None) -> tuple:
    """The slowest rank's slot (forward and backward of one micro-batch, collectives overlapped), the forward's
    share of that slot (what zero bubble's bubble is made of), and the slowest rank's optimizer step."""
    slot, forward, update = 0.0, 0.0, 0.0
    for ops in stage_ops:
        table = OpTable(ops)
        t = phase_seconds(profile, table, ("forward", "backward"))
        if comm is not None:
            t = comm.overlapped(t, table)
        slot = max(slot, t / micro_batches)
        forward = max(forward, phase_seconds(profile, table, ("forward",)) / micro_batches)
        update = max(update, phase_seconds(profile, table, ("optimizer", "setup")))
    return slot, (forward / slot if slot else 1 / 3), update


def send_seconds(links, nbytes: int, inside_node: bool) -> float:
    """One point-to-point send of `nbytes` between neighbouring stages, at the link's bus bandwidth."""
    bandwidth = links.within_node if inside_node else links.across_nodes
    return links.latency + nbytes / bandwidth


@dataclasses.dataclass(frozen=True)
class Comm:
    """Collectives across ranks, priced with an alpha-beta model in NCCL's bus-bandwidth convention
    (devices.Links): S bytes over a group of n ranks take latency * ceil(log2 n) + S * f / bandwidth, f =
    (n-1)/n for an all-gather or reduce-scatter and 2(n-1)/n for an all-reduce, at the within-node bandwidth
    when the group fits in a node and the across-nodes one otherwise. FSDP2 gathers a unit's parameters ahead
    of its compute (prefetch) and reduces its gradients during the next unit's backward, so collectives
    overlap compute except the first all-gather of forward and the last reduce-scatter of backward:
    a micro-step takes compute + those two + whatever the rest exceeds compute by. DDP all-reduces each
    gradient bucket as soon as it is full, during the rest of backward: the same rule, with its first
    (DDP's small first bucket) and last buckets counted as exposed."""
    links: object   # devices.Links
    gpus: int
    shard: int      # ranks in an all-gather / reduce-scatter group (all for fsdp, a node's for hsdp)
    per_node: int
    tp: int = 1     # ranks of a tensor-parallel group, within a node: their collectives wait on compute

    def tensor_parallel_seconds(self, table: OpTable, phases: tuple[str, ...] = ("forward", "backward")) -> float:
        """Seconds of the tensor-parallel collectives in `phases`: each sits between two matmuls that need
        its result, so none overlaps compute."""
        sel = table.mask(phases) & (table.collective >= 3)
        if self.tp == 1 or not bool(sel.any()):
            return 0.0
        factor = (table.collective[sel] - 2).to(torch.float64) * (self.tp - 1) / self.tp
        steps = self.links.latency * math.ceil(math.log2(self.tp))
        return float((steps + table.bytes[sel] * factor / self.links.within_node).sum())

    def op_seconds(self, table: OpTable, phases: tuple[str, ...] = ("forward", "backward")) -> torch.Tensor:
        """Seconds of each collective across data-parallel ranks in `phases`, in step order."""
        sel = table.mask(phases) & (table.collective > 0) & (table.collective < 3)
        kind, size = table.collective[sel], table.bytes[sel]
        # an all-reduce across ranks is HSDP's across nodes (its replicas); anything else runs in the shard group
        n = torch.where(kind == 2, torch.tensor(self.gpus // self.shard if self.shard < self.gpus else self.gpus),
                        torch.tensor(self.shard)).to(torch.float64).clamp(min=1)
        inside = torch.where(kind == 2, torch.tensor(self.gpus <= self.per_node), torch.tensor(self.shard <= self.per_node))
        bandwidth = torch.where(inside, torch.tensor(self.links.within_node), torch.tensor(self.links.across_nodes))
        factor = kind.to(torch.float64) * (n - 1) / n
        return torch.where(n > 1, self.links.latency * torch.ceil(torch.log2(n)) + size * factor / bandwidth,
                           torch.zeros_like(size))

    def overlapped(self, compute: float, table: OpTable) -> float:
        """A micro-step's time: its compute with its collectives overlapped as the class says (tensor
        parallelism's added whole)."""
        compute += self.tensor_parallel_seconds(table)
        each = self.op_seconds(table)
        if not len(each):
            return compute
        edges = float(each[0] + each[-1]) if len(each) > 1 else float(each[0])
        return compute + edges + max(0.0, float(each.sum()) - edges - compute)


def comm_for(dev: Device, config) -> Comm | None:
    """The collectives' model for `config` on `dev`; None for one rank, and where the catalogue has no
    figures (a CPU's gloo, V100)."""
    from memfit.memory.devices import links

    tp = getattr(config, "tp", 1)
    if config.gpus == 1 and tp == 1:
        return None
    speeds = links(dev)
    if speeds is None:
        return None
    return Comm(speeds, config.gpus, config.shard_group, config.gpus_per_node or min(config.gpus, 8), tp)


# ------------------------------------------------------------------------------------------ calibration

def _time(fn, sync=lambda: None, budget: float = 0.1) -> float:
    """Seconds per call: the median of short rounds (~5 ms each, 5 to 15 of them within `budget`). The
    median, not the best: a step's ops run at the machine's usual speed. On a 2-core VM the best of a few
    calls priced gpt-tiny's bf16 step at 65 ms where it took 116; the median, at 94 ms. A busy machine,
    which moves the median, is caught by `_problems`."""
    start = time.perf_counter()
    fn()
    sync()
    first = max(time.perf_counter() - start, 1e-7)
    reps = max(1, math.ceil(0.005 / first))
    rounds = []
    for _ in range(min(15, max(5, int(budget / (reps * first))))):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        rounds.append((time.perf_counter() - start) / reps)
    return statistics.median(rounds)


def calibrate(device: str = "cpu", attempts: int = 2) -> Profile:
    """Measure this machine's device (about 10 s on a 2-core CPU). A calibration whose figures look wrong (see
    `_problems`) is measured again, up to `attempts` times; the last one is returned with its problems."""
    dev = torch.device(device)
    for _ in range(attempts):
        try:
            profile = _calibrate_once(dev)
        finally:  # the random numbers the measurements took their inputs from (`_cold`)
            for key in [k for k in _POOLS if k[0] == str(dev)]:
                del _POOLS[key]
        if not profile.problems:
            break
    return profile


def _calibrate_once(dev: torch.device) -> Profile:
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    cpu = dev.type == "cpu"
    with _OtherProcesses() as others:
        overheads = [_op_overhead(dev, sync)]
        one = torch.ones(1, device=dev)
        dispatch = _time(lambda: one.neg(), sync=sync)  # what calling any op costs the host: in op_overhead
        # 8 tokens per unit of width (FLOPs dominate), and width 64 over many tokens (bytes do)
        square = [(8 * d, d) for d in (16, 32, 64, 128, 256, 512) + (() if cpu else (1024, 2048, 4096))]
        matmul = {tag: _matmul_curve(dev, dtype, square, dispatch, sync) for tag, dtype in _DTYPES}
        curves = {}
        if cpu:  # a GPU's kernels are priced by the matmul curve and bandwidth alone (not measured here)
            for tag, dtype in _DTYPES:
                curves[f"mm_bytes.{tag}"] = _matmul_curve(dev, dtype, [(t, 64) for t in (256, 1024, 4096, 16384)],
                                                          dispatch, sync, by_bytes=True)
                curves.update(_conv_curves(dev, dtype, tag, dispatch, sync))
                curves.update(_attention_curves(dev, dtype, tag, dispatch, sync))
                curves[f"elementwise.{tag}"] = _elementwise_curve(dev, dtype, _binary, dispatch, sync)
                curves[f"special.{tag}"] = _elementwise_curve(dev, dtype, _special, dispatch, sync)
        cache = []  # a CPU prices elementwise ops by their own curves: its copy bandwidth is only reported
        for mib in (0.25, 1, 4, 16, 64, 256) if not cpu else (64,):  # from inside L2 to far beyond any cache
            x = torch.ones(int(mib * 2**18), device=dev)
            y = torch.empty_like(x)
            moved = 2 * x.numel() * 4  # read + written, as the tracker counts an op's bytes
            cache.append([moved, moved / _time(lambda: y.copy_(x), sync=sync)])
        del x, y
        bandwidth = cache[-1][1]
        x = torch.ones(4 * 2**20, device=dev)  # CPU dropout draws its mask with bernoulli_, per element
        rng = x.numel() / _time(lambda: x.bernoulli_(0.9), sync=sync)
        faults = 0.0
        if cpu:  # a fresh 64 MiB block against the same block reused
            n = 16 * 2**20
            big = torch.empty(n)
            reused = _time(lambda: big.fill_(1.0))
            fresh = _time(lambda: torch.empty(n).fill_(1.0))
            faults = max(0.0, fresh - reused) / (n * 4)
            del big
        link = math.inf
        host = None
        if not cpu:
            pinned = torch.empty(64 * 2**20, pin_memory=True)
            on_dev = torch.empty(64 * 2**20, device=dev)
            link = pinned.numel() * 4 / _time(lambda: on_dev.copy_(pinned, non_blocking=True), sync=sync)
            host = calibrate("cpu").to_dict()
        overheads.append(_op_overhead(dev, sync))
        last = _matmul_curve(dev, torch.float32, square[-1:], dispatch, sync)[0]  # the first figure, again
    name = (torch.cuda.get_device_name(dev) if not cpu else
            f"cpu ({_cpu_model()}, {torch.get_num_threads()} threads)")
    profile = Profile(device=name, kind=dev.type, source="calibrated on this machine", matmul=matmul,
                      bandwidth=bandwidth, op_overhead=min(overheads), link_bandwidth=link, host=host,
                      cache_bandwidth=None if cpu else cache, rng_rate=rng, fault_seconds=faults, curves=curves,
                      machine=machine(dev.type), measured_at=time.time())
    profile.problems = _problems(profile, {"per-op cost": overheads, "largest matmul": [matmul["f32"][-1][1], last[1]]},
                                 others.cores)
    return profile


_DTYPES = (("f32", torch.float32), ("lp", torch.bfloat16))


def _kernel(seconds: float, dispatch: float) -> float:
    """A timed call less the host's cost of any call (priced per op by op_overhead), never below a ns."""
    return max(seconds - dispatch, 1e-9)


COLD_BYTES = 96 * 2**20  # more than a last-level cache holds


POOL_BYTES = COLD_BYTES + 16 * 2**20
_POOLS: dict = {}  # (device, dtype) -> POOL_BYTES of random normal numbers, for the calibration under way


def _cold(shapes, dtype, dev, nbytes: int, grads: int = 0):
    """A function returning the next of as many sets of tensors of `shapes` as it takes for each to be used
    again only after COLD_BYTES of others (`nbytes` counted for a set): a step's tensors come from memory,
    not from a hot cache. The sets are consecutive slices of one buffer of random normal numbers, each
    tensor on a 64-byte line, made once per calibration: making every set afresh took over half of a
    calibration. The first `grads` tensors of a set are leaves that require grad; a set larger than the
    buffer is made on its own."""
    key = (str(dev), dtype)
    if key not in _POOLS:
        _POOLS[key] = torch.randn(POOL_BYTES // dtype.itemsize, device=dev, dtype=dtype)
    pool = _POOLS[key]
    align = 64 // dtype.itemsize
    sizes = [math.prod(s) for s in shapes]
    ends = list(itertools.accumulate(-(-n // align) * align for n in sizes))  # within a set, aligned
    count = min(max(1, COLD_BYTES // max(nbytes, 1)), pool.numel() // ends[-1])
    sets = []
    for base in range(0, count * ends[-1], ends[-1]):
        starts = [base + end for end in [0] + ends[:-1]]
        sets.append(tuple(pool[start:start + n].view(shape).requires_grad_(i < grads)
                          for i, (start, n, shape) in enumerate(zip(starts, sizes, shapes))))
    if not sets:
        sets.append(tuple(torch.randn(*shape, device=dev, dtype=dtype).requires_grad_(i < grads)
                          for i, shape in enumerate(shapes)))
    turn = itertools.count()
    return lambda: sets[next(turn) % len(sets)]


def _matmul_curve(dev, dtype, shapes, dispatch, sync, by_bytes: bool = False) -> list:
    """A linear layer's three matmuls (forward, input gradient, weight gradient) for each (tokens, width):
    [FLOPs or bytes moved (as the tracker counts them), seconds] of the three."""
    pts = []
    for tokens, d in shapes:
        moved = (2 * tokens * d + d * d) * dtype.itemsize  # each of the three reads two of x, w, g, writes one
        nxt = _cold([(tokens, d), (d, d), (tokens, d)], dtype, dev, moved)
        matmuls = (lambda x, w, g: x @ w.t(), lambda x, w, g: g @ w, lambda x, w, g: g.t() @ x)
        t = sum(_kernel(_time(lambda: mm(*nxt()), sync=sync), dispatch) for mm in matmuls)
        pts.append([3 * moved if by_bytes else 3 * 2.0 * tokens * d * d, t])
    return pts


def _records(fn, name: str) -> tuple[float, float]:
    """(FLOPs, bytes) of the op `name` in fn(), as the tracker records them for a traced step."""
    with OpRecorder() as counter:
        fn()
    [(flops, nbytes)] = [(f, b) for n, f, b in zip(counter.trace.name, counter.trace.flops, counter.trace.bytes) if n == name]
    return flops, nbytes


def _heavy_curves(dev, dtype, tag, cls, fn, name, families, dispatch, sync) -> dict:
    """Curves of `fn`'s forward op `name` (class `cls`) and of its backward op, from two families of inputs:
    one where bytes dominate (curve "<cls>_bytes", by bytes) and one where FLOPs do (by FLOPs). An op is
    priced at the slower of the two (a roofline whose two rates are measured for the kind of op)."""
    out = {}
    for key, shapes in zip(("_bytes", ""), families):
        fwd, bwd = [], []
        for shape in shapes:
            with torch.no_grad():
                result = fn(*(torch.empty(*s, device=dev, dtype=dtype) for s in shape)).shape
            n = len(shape)
            numel = sum(math.prod(s) for s in (*shape, result))
            nxt = _cold([*shape, result], dtype, dev, 2 * numel * dtype.itemsize, grads=n)
            *inputs, grad = nxt()
            backward = lambda inputs, grad: torch.autograd.grad(fn(*inputs), inputs, grad)  # noqa: E731

            def forward_backward():
                *ins, g = nxt()
                return backward(ins, g)

            forward = _time(lambda: fn(*nxt()[:n]), sync=sync)
            both = _time(forward_backward, sync=sync)
            f_rec = _records(lambda: fn(*inputs), name)
            b_rec = _records(lambda: backward(inputs, grad), name + "_backward")
            index = 1 if key else 0  # by bytes, or by FLOPs
            fwd.append([f_rec[index], _kernel(forward, dispatch)])
            bwd.append([b_rec[index], _kernel(both - forward, 2 * dispatch)])
        out[f"{cls}{key}.{tag}"] = sorted(fwd)
        out[f"{cls}_bwd{key}.{tag}"] = sorted(bwd)
    return out


def _conv_curves(dev, dtype, tag, dispatch, sync) -> dict:
    """3x3 convolutions, batch 8: 8 channels on maps of 4x4 to 64x64 (narrow convolutions cost per pixel,
    ~100 us at least, far below a matmul's rate) and 32 to 256 channels on 8x8 maps."""
    narrow = [((8, 8, side, side), (8, 8, 3, 3)) for side in (4, 8, 16, 32, 64)]
    wide = [((8, c, 8, 8), (c, c, 3, 3)) for c in (32, 64, 128, 256)]
    return _heavy_curves(dev, dtype, tag, "conv", lambda x, w: F.conv2d(x, w, padding=1), "convolution",
                         (narrow, wide), dispatch, sync)


def _attention_curves(dev, dtype, tag, dispatch, sync) -> dict:
    """Causal attention with heads of 32: 8 to 512 heads (x batch) over 16 positions, where the cost goes
    with the tensors' size (the CPU's bf16 backward: ~100 ns per element), and 8 heads over 64 to 512."""
    short = [((h // 8, 8, 16, 32),) * 3 for h in (8, 32, 128, 512)]
    long = [((1, 8, seq, 32),) * 3 for seq in (64, 128, 256, 512)]
    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    return _heavy_curves(dev, dtype, tag, "attn", sdpa, "_scaled_dot_product_flash_attention_for_cpu",
                         (short, long), dispatch, sync)


def _binary(x, y, out):
    torch.mul(x, y, out=out)
    return 3  # tensors of x's size read or written


def _special(x, y, out):
    F.silu(x)
    torch.log_softmax(x, -1)
    F.layer_norm(x, x.shape[-1:])
    return 6


def _elementwise_curve(dev, dtype, fn, dispatch, sync) -> list:
    """[bytes moved, seconds] of `fn` on tensors of 16 KiB to 16 MiB (fp32; fresh outputs stay under
    LARGE_ALLOC), cold (`_cold`)."""
    pts = []
    for numel in (4096, 65536, 2**20, 2**22):
        nxt = _cold([(numel // 256, 256)] * 3, dtype, dev, 3 * numel * dtype.itemsize)
        tensors = fn(*nxt())
        seconds = _time(lambda: fn(*nxt()), sync=sync)
        pts.append([tensors * numel * dtype.itemsize, _kernel(seconds, dispatch * (tensors // 3))])
    return pts


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

    counter = OpRecorder()
    with counter:
        step()
    return _time(step, sync=sync) / len(counter.trace)


class _OtherProcesses:
    """Cores used by other processes over a window (Linux): all busy CPU time less this process's."""

    cores: float | None = None

    def __enter__(self):
        self.start = (time.perf_counter(), _busy_seconds(), _own_seconds())
        return self

    def __exit__(self, *exc):
        (wall, busy, own), (wall0, busy0, own0) = (time.perf_counter(), _busy_seconds(), _own_seconds()), self.start
        if busy is not None and busy0 is not None:
            self.cores = max(0.0, (busy - busy0) - (own - own0)) / max(wall - wall0, 1e-3)
        return False


def _busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            user, nice, system, idle, iowait, irq, softirq, steal = ([int(v) for v in f.readline().split()[1:9]]
                                                                     + [0] * 8)[:8]
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _problems(profile: Profile, repeats: dict, other_cores: float | None) -> list[str]:
    """What makes a calibration suspect (the checks are listed at the top of this file)."""
    out = []
    if profile.op_overhead > MAX_OP_OVERHEAD:
        out.append(f"{profile.op_overhead * 1e6:.0f} us per op (a CPU takes 5-20)")
    for what, (first, second) in repeats.items():
        if max(first, second) > REPEAT_SPREAD * min(first, second):
            out.append(f"the {what} measured {first * 1e6:.1f} us, then {second * 1e6:.1f} us")
    named = {f"matmul.{k}": v for k, v in profile.matmul.items()} | (profile.curves or {})
    for key, pts in named.items():
        if pts[0][1] > MAX_SMALL_OP:
            out.append(f"{key}: its smallest size took {pts[0][1] * 1e3:.1f} ms")
        elif any(later * CURVE_DIP < earlier for (_, earlier), (_, later) in zip(pts, pts[1:])):
            out.append(f"{key}: a larger size ran faster than a smaller one")
    if other_cores is not None and other_cores > BUSY_CORES:
        out.append(f"other processes used {other_cores:.1f} cores meanwhile")
    return out


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


BUSY = "measured on a busy machine"  # how `describe` begins for a rejected calibration


def describe(profile: Profile) -> str:
    """One line for a plan: where the figures come from, when, and the ones that matter most. A rejected
    calibration is not presented as calibrated: the line begins with BUSY and says what its times are worth."""
    best = {k: max(f / t for f, t in pts) for k, pts in profile.matmul.items()}
    when = ""
    if profile.measured_at:
        m = profile.machine or {}
        when = (f" {datetime.datetime.fromtimestamp(profile.measured_at):%Y-%m-%d %H:%M} ({m.get('cpu')}, "
                f"{m.get('threads')} threads, torch {m.get('torch')})")
    figures = (f"{profile.op_overhead * 1e6:.1f} us per op, matmul up to {best['f32'] / 1e9:.0f} GFLOP/s fp32 / "
               f"{best['lp'] / 1e9:.0f} bf16, copy {profile.bandwidth / 1e9:.0f} GB/s")
    if profile.problems:
        return (f"{BUSY}{when}: {figures}; rejected ({'; '.join(profile.problems)}): step times may be several "
                "times off, and so may the choice between configurations, which rests on them; rerun "
                "`memfit calibrate` on a quiet machine")
    return f"{profile.source}{when}: {figures}" + (f"; {profile.fallback}" if profile.fallback else "")


def step_time_caveat(described: str | None) -> str | None:
    """What a step time must say with it when it was priced by a rejected calibration (`described`: its
    `describe` line, as a plan keeps it in `profile`); None when the calibration was not rejected."""
    if described and described.startswith(BUSY):
        return f"its step time is from a calibration {BUSY}: it may be several times off"
    return None


def machine(kind: str) -> dict:
    """What a calibration holds for: the same torch, processor and thread count."""
    out = {"torch": torch.__version__, "cpu": _cpu_model(), "threads": torch.get_num_threads()}
    if kind == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def stale(profile: Profile, now: float | None = None) -> str | None:
    """Why a cached profile must be measured again (the rule is at the top of this file), or None."""
    if profile.version != PROFILE_VERSION:
        return "measured by another memfit version"
    for key, value in machine(profile.kind).items():
        old = (profile.machine or {}).get(key)
        if old != value:
            return f"{key} changed from {old} to {value}"
    age = (time.time() if now is None else now) - (profile.measured_at or 0)
    if age > MAX_AGE_DAYS * 86400:
        return f"measured {age / 86400:.0f} days ago"
    if profile.problems and age > SUSPECT_AGE:
        return f"its figures looked wrong ({profile.problems[0]})"
    return None


def cpu_key() -> str:
    """Profiles are cached per thread count: test runs under OMP_NUM_THREADS 1, 2, 4 keep their own."""
    return f"cpu-{torch.get_num_threads()}threads"


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


REJECTED = ".rejected"  # a rejected calibration's cache key: the key of the calibration it failed to replace


def profile_for(dev: Device) -> Profile:
    """The CPU and a present GPU are measured (once, then cached); a catalogue GPU uses its data sheet and
    an assumed server host. When a new calibration is rejected (a busy machine), an earlier good one of the
    same processor stands in, saying so; without one the rejected figures are used, marked (`describe`)."""
    if dev.kind != "cpu" and not dev.name.startswith("cuda"):
        return catalogue_profile(dev)
    key = cpu_key() if dev.kind == "cpu" else dev.name
    profile = load_profile(key)
    why = "no calibration yet" if profile is None else stale(profile)
    if not why:
        return profile
    rejected, measured = load_profile(key + REJECTED), False
    kind = "CPU" if dev.kind == "cpu" else "GPU"
    if rejected is None or stale(rejected):  # a rejected one is kept an hour, not measured again at every plan
        took = "; ~10 s" if dev.kind == "cpu" else ""  # a GPU's has not been timed here
        print(f"memfit: calibrating this {kind} for step times ({why}{took}), cached at {profile_path(key)}",
              file=sys.stderr, flush=True)
        rejected, measured = calibrate("cpu" if dev.kind == "cpu" else "cuda"), True
        if not rejected.problems:
            save_profile(rejected, key)
            profile_path(key + REJECTED).unlink(missing_ok=True)
            return rejected
        save_profile(rejected, key + REJECTED)
    earlier = _earlier(profile, why, rejected)
    if measured:
        instead = (f"the earlier calibration of this {kind} stands in ({why})" if earlier
                   else "step times may be several times off")
        print(f"memfit: warning: calibration rejected, {BUSY} ({'; '.join(rejected.problems)}); {instead}; rerun "
              "`memfit calibrate` on a quiet machine", file=sys.stderr, flush=True)
    return earlier or rejected


def _earlier(profile: Profile | None, why: str, rejected: Profile) -> Profile | None:
    """`profile`, an earlier good calibration (`why`: what made it stale), where it may stand in for
    `rejected`: measured on the same processor (older, or under another torch, it still beats figures
    several times off). None otherwise."""
    if profile is None or profile.problems:
        return None
    now = machine(profile.kind)
    if any((profile.machine or {}).get(k) != now[k] for k in ("cpu", "gpu") if k in now):
        return None
    return dataclasses.replace(profile, fallback=(
        f"an earlier calibration ({why}), used because a new one was rejected, {BUSY} "
        f"({'; '.join(rejected.problems)}); rerun `memfit calibrate` on a quiet machine"))
