"""`plan`: the fastest configuration that fits a memory budget, from a handful of traced probes.

For each family (precision x checkpointing x offload) memfit traces two small micro-batches after one
primed optimizer state (1 and 2, or 2 and 4 for a model that cannot train at 1). Memory per phase and every op's FLOPs and bytes are linear in the micro-batch,
so the two probes predict any micro-batch; checkpointing every k-th block is interpolated between "none"
and "all" by the share of blocks it covers. Candidates are ranked by predicted step time and the best are
confirmed by a full estimate before one is chosen.

A deep model (DEEP or more identical repeated blocks in one ModuleList) is probed as two shallow copies
that keep only their first few blocks (`depths`): what a step holds and does is affine in the number of
identical blocks (their parameters, state, saved activations and ops each add the same amount), so the two copies
predict the full depth at a small share of the cost (a 70B model's 80 blocks traced as 4 and 8). Only
the ranking rests on that: every configuration offered is confirmed by a full estimate of the whole model
(on one rank, counted from three shallow copies and checked event for event: memory/extrapolate.py).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import time
from typing import Callable, NoReturn

import torch

from memfit.config import Config
from memfit.errors import ConfigError, EstimateError, LossChunkError, MicroBatchError, PlanError, WorkloadError
from memfit.memory.devices import Device, check_node, defaults_for, get_device
from memfit.memory.estimate import (Category, Estimate, MicroBatchLine, Phase, Probe, estimate, first_line,
                                    outside_tensors, probe, probe_pair, state_parts)
from memfit.memory.fake import FakeBuild, new_fake_mode
from memfit.memory.isolate import run_isolated, run_isolated_many
from memfit.memory.trace_cache import run_cached_many
from memfit.memory.copies import depths, shallow, stack_depth
from memfit.memory.extrapolate import probe_blocks
from memfit.planner.model_parallel import model_parallel
from memfit.planner.costmodel import (Comm, OpTable, Profile, accumulation_seconds, comm_for, describe, phase_seconds,
                                      profile_for, step_seconds)
from memfit.units import fmt_bytes, parse_size
from memfit.workload import Workload

_REPORT: contextvars.ContextVar = contextvars.ContextVar("memfit_plan_progress", default=None)


@contextlib.contextmanager
def progress_to(write: Callable[[str], None], after: float = 2.0):
    """While the plans inside run, tell `write` what is being traced and how many traces of it are done, once
    they have taken `after` seconds (a plan read from the trace cache says nothing)."""
    token = _REPORT.set((write, time.monotonic() + after))
    try:
        yield
    finally:
        _REPORT.reset(token)


class _Stage:
    """One stage of a plan's tracing, for `progress_to`: `done` is called as each of its traces ends."""

    def __init__(self, what: str, total: int):
        self.what, self.total, self.count = what, total, 0
        self._say()

    def done(self) -> None:
        self.count += 1
        self._say()

    def _say(self) -> None:
        report = _REPORT.get()
        if report is not None and time.monotonic() >= report[1]:
            report[0](f"{self.what}: {self.count} of {self.total} traced")


MARGIN = 0.05  # of the budget, kept free for what no trace sees: allocator growth, kernel workspaces
LOSS_CHUNKS = 8  # pieces a chunked loss is searched with (torchtune's choice for its chunked output)


@dataclasses.dataclass
class Candidate:
    config: Config
    peak_bytes: int           # predicted use compared against the budget (device view for GPUs)
    step_seconds: float
    confirmed: bool = False   # checked by a full estimate
    estimate: Estimate | None = None


@dataclasses.dataclass
class Plan:
    config: Config
    device: str
    budget_bytes: int
    usable_bytes: int
    peak_bytes: int
    step_seconds: float
    samples_per_second: float
    estimate: Estimate | None  # the chosen configuration's full estimate (None when not confirmed)
    alternatives: list        # [Candidate], fastest first, the chosen one excluded
    families: list            # [(family, verdict)] why each family was or was not chosen
    profile_source: str
    notes: list
    confirmed: bool = True    # False: peak and step time predicted from the probes, no full estimate made

    def to_dict(self) -> dict:
        return dict(config=self.config.to_dict(), device=self.device, budget_bytes=self.budget_bytes,
                    usable_bytes=self.usable_bytes, peak_bytes=self.peak_bytes, step_seconds=self.step_seconds,
                    samples_per_second=self.samples_per_second, profile=self.profile_source, notes=self.notes,
                    alternatives=[dict(config=c.config.to_dict(), peak_bytes=c.peak_bytes,
                                       step_seconds=c.step_seconds, confirmed=c.confirmed) for c in self.alternatives],
                    families=[dict(family=f, verdict=v) for f, v in self.families], confirmed=self.confirmed,
                    estimate=self.estimate.to_dict() if self.estimate is not None else None)


def resolve_budget(budget, dev: Device) -> int:
    if budget is None:
        return dev.memory_bytes
    if isinstance(budget, str) and budget.strip().endswith("%"):
        share = float(budget.strip()[:-1]) / 100
        if not 0 < share <= 1:
            raise ConfigError(f"budget {budget!r}: a share of the device must be in (0%, 100%]")
        return int(dev.memory_bytes * share)
    return parse_size(budget)


def _used(est: Estimate) -> int:
    """What the budget is compared with: nvidia-smi's view on a GPU, live tensor bytes on a CPU."""
    return est.device_peak_bytes if est.device_peak_bytes is not None else est.peak_bytes


@dataclasses.dataclass
class _Family:
    """Two probes of one family, and what they predict at any micro-batch."""
    base: Config
    probes: list  # [Probe, Probe] at the two smallest micro-batches the model trains at
    rejected: str | None = None  # why micro-batch 1 failed, when the probes had to start at 2
    _tables: tuple | None = None

    @property
    def sizes(self) -> tuple[int, int]:
        return tuple(p.micro_batch for p in self.probes)

    @property
    def line(self) -> MicroBatchLine:
        return MicroBatchLine(*self.sizes)

    @property
    def depth(self) -> int:
        """Repeated blocks in the probed model."""
        return len(self.probes[0].estimate.blocks)

    def sharded(self, phase: Phase, accum: int) -> int:
        """Bytes at `phase`'s peak that the shards hold: parameters, optimizer state, and the gradients live
        there (as traced at the step's peak; all of them in forward during accumulation; else none)."""
        e2 = self.probes[1].estimate
        rest = e2.model_state_bytes
        grads = (rest[Category.GRADIENTS] if phase == Phase.FORWARD and accum > 1 else
                 e2.breakdown[Category.GRADIENTS] if phase == e2.peak_phase else 0)
        return rest[Category.PARAMETERS] + rest[Category.OPTIMIZER_STATE] + grads

    def phases(self, m: int, accum: int) -> dict:
        """Live bytes at each phase's peak, at micro-batch m (the global batch's other inputs left out)."""
        e1, e2 = (p.estimate for p in self.probes)
        phases = {p: self.line.at(e1.phase_peaks.get(p, 0), e2.phase_peaks.get(p, 0), m)
                  for p in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)}
        if accum > 1:  # gradients of earlier micro-steps are alive during later forwards
            phases[Phase.FORWARD] += e2.model_state_bytes[Category.GRADIENTS] or e2.breakdown[Category.GRADIENTS]
        return phases

    def memory(self, m: int, accum: int, cpu: bool, phases: dict | None = None) -> int:
        e1, e2 = (p.estimate for p in self.probes)
        live = max((phases or self.phases(m, accum)).values())
        if cpu:  # on a CPU the whole global batch is device memory, not just one micro-batch
            live += self.line.per_sample(e1.breakdown[Category.INPUTS], e2.breakdown[Category.INPUTS]) * m * (accum - 1)
            return int(live)
        # what a GPU holds beyond live tensors (allocator rounding and caching, context, NCCL), added as the
        # larger probe has it: it grows far slower than the live bytes (gpt-tiny x 24 blocks on 4 H100s, no
        # checkpointing, micro-batch 64: +1.2% against the full estimate; scaled by the probe's reserved/live
        # ratio instead, +35%; a 70B's copies of 8 blocks, scaled, put 64 H100s at 57 GiB where it holds 50)
        return int(live + e2.device_peak_bytes - e2.peak_bytes)

    def host(self) -> int:
        """Host memory the step needs beyond the batch (offloaded master weights, gradients, optimizer state)."""
        return self.probes[1].estimate.host_peak_bytes or 0

    def moved_bytes(self, m: int, accum: int) -> float:
        """What a step moves between host and device at micro-batch m: each micro-step's (offloaded
        activations, gradients), and the optimizer step's once (offloaded weights back)."""
        o1, o2 = (p.ops for p in self.probes)
        (_, at1), (_, at2) = (o.optimizer_at or (0, o.moved_bytes) for o in (o1, o2))
        return accum * self.line.at(at1, at2, m) + self.line.at(o1.moved_bytes - at1, o2.moved_bytes - at2, m)

    def gradient_bytes(self) -> int:
        e2 = self.probes[1].estimate
        return e2.model_state_bytes[Category.GRADIENTS] or e2.breakdown[Category.GRADIENTS]

    def _scaled(self, m: int) -> tuple:
        """The second probe's op table and its FLOPs, bytes and fresh allocations at micro-batch m."""
        if self._tables is None:
            self._tables = _aligned(*(p.ops for p in self.probes), self.sizes)
        (flops1, bytes1, alloc1), t2 = self._tables
        return t2, *(self.line.at(a, b, m).clamp(min=0) for a, b in ((flops1, t2.flops), (bytes1, t2.bytes),
                                                                     (alloc1, t2.alloc)))

    def forward_backward_seconds(self, profile: Profile, m: int) -> float:
        """One micro-step's forward and backward at micro-batch m, collectives left out."""
        t2, flops, nbytes, alloc = self._scaled(m)
        return phase_seconds(profile, t2, ("forward", "backward"), flops, nbytes, alloc)

    def seconds(self, profile: Profile, m: int, accum: int, comm: Comm | None = None) -> float:
        t2, flops, nbytes, alloc = self._scaled(m)
        micro = phase_seconds(profile, t2, ("forward", "backward"), flops, nbytes, alloc)
        if comm is not None:  # parameter-sized collectives: the same at every micro-batch
            micro = comm.overlapped(micro, t2)
        rest = phase_seconds(profile, t2, ("optimizer", "setup"), flops, nbytes, alloc)
        if accum > 1:  # each later micro-step adds its gradients into those kept
            rest += (accum - 1) * accumulation_seconds(profile, self.probes[1].ops)
        if profile.kind != "cuda":
            return accum * micro + rest
        return accum * micro + rest + self.moved_bytes(m, accum) / profile.link_bandwidth


@dataclasses.dataclass
class _DeepFamily:
    """One family of a deep model, from its two shallow copies (`shallow`): each phase's memory and the
    step time at the full depth, by extending the line through the two copies' figures."""
    short: _Family
    tall: _Family
    full_depth: int

    @property
    def base(self) -> Config:
        return self.short.base

    @property
    def rejected(self) -> str | None:
        return self.short.rejected or self.tall.rejected

    @property
    def sizes(self) -> tuple[int, int]:
        return self.tall.sizes

    @property
    def depth(self) -> int:
        return self.full_depth

    def sharded(self, phase: Phase, accum: int) -> int:
        return round(self._extend(self.short.sharded(phase, accum), self.tall.sharded(phase, accum)))

    def _extend(self, short: float, tall: float) -> float:
        a, b = self.short.depth, self.tall.depth
        return short + (self.full_depth - a) * (tall - short) / (b - a)

    def phases(self, m: int, accum: int) -> dict:
        short, tall = self.short.phases(m, accum), self.tall.phases(m, accum)
        return {p: self._extend(short[p], tall[p]) for p in tall}

    def memory(self, m: int, accum: int, cpu: bool, phases: dict | None = None) -> int:
        return self.tall.memory(m, accum, cpu, phases=phases or self.phases(m, accum))

    def host(self) -> int:
        return round(self._extend(self.short.host(), self.tall.host()))

    def seconds(self, profile: Profile, m: int, accum: int, comm: Comm | None = None) -> float:
        return self._extend(self.short.seconds(profile, m, accum, comm), self.tall.seconds(profile, m, accum, comm))

    def forward_backward_seconds(self, profile: Profile, m: int) -> float:
        return self._extend(self.short.forward_backward_seconds(profile, m),
                            self.tall.forward_backward_seconds(profile, m))

    def gradient_bytes(self) -> float:
        return self._extend(self.short.gradient_bytes(), self.tall.gradient_bytes())

    def moved_bytes(self, m: int, accum: int) -> float:
        return self._extend(self.short.moved_bytes(m, accum), self.tall.moved_bytes(m, accum))


@dataclasses.dataclass
class _AtCount:
    """A family traced at one GPU count, predicted at a larger one (plan_counts traces each family at the
    first count it may fit at). Between counts only the shards change, by the ratio r of the two counts'
    state floors (1/N for fsdp with its padding; 1 for hsdp's node-sized shard group and ddp's replicas):
    the sharded parameters, optimizer state and the gradient shards live at a phase's peak shrink by r (the
    gradients as traced at the step's peak, all of them in forward during accumulation), and the optimizer
    step's own temporaries with them.
    Activations, gathered units and the buckets reduced are whole-size at any count; NCCL's communicators
    follow the count's nodes; collectives are priced at the new count by the Comm the planner passes."""
    family: object      # _Family | _DeepFamily, traced at `traced_at`
    traced_at: Config
    base: Config        # this count's
    floors: tuple       # (live state floor at traced_at, at base): the state floors less what lies outside
    nccl: int           # NCCL bytes at base less at traced_at

    rejected = property(lambda self: self.family.rejected)
    host = property(lambda self: self.family.host)
    sizes = property(lambda self: self.family.sizes)
    depth = property(lambda self: self.family.depth)

    def phases(self, m: int, accum: int) -> dict:
        then, now = self.floors
        r = now / max(then, 1)
        traced = self.family.phases(m, accum)
        phases = {p: v + self.family.sharded(p, accum) * (r - 1) for p, v in traced.items()}
        phases[Phase.OPTIMIZER] = now + (traced[Phase.OPTIMIZER] - then) * r
        return phases

    def memory(self, m: int, accum: int, cpu: bool, phases: dict | None = None) -> int:
        return self.family.memory(m, accum, cpu, phases=phases or self.phases(m, accum)) + (0 if cpu else self.nccl)

    def seconds(self, profile: Profile, m: int, accum: int, comm: Comm | None = None) -> float:
        return self.family.seconds(profile, m, accum, comm)


DEEP = 24  # repeated blocks from which a model is probed as two shallow copies


def _depth_and_floors(workload: Workload, states: list[Config], dev: Device,
                      on_done: Callable[[], None] | None = None) -> tuple[str, object]:
    """("ok", (the model's stack depth, None where not probed shallow; each state's floors: state_parts's on
    the device, on the host, the gradients' share of the first, and its optimizer step's ops, a tuple of the
    two copies' for a deep model)), or ("error", why). A deep model's floors are the line through two shallow
    copies' at the full depth (states add up per block). Two forked children:
    the depth and the shallower copy's floors (a model probed whole: its own) in one, the deeper copy's in the
    other, taken on the chance that the model is deep."""
    a, b = depths(states[0].gpus if states else 1)
    (kind, value), (tall_kind, tall) = run_cached_many(
        [functools.partial(_depth_and_short_floors, workload, states, dev),
         functools.partial(_state_floors_of_copy, workload, b, states, dev)], on_done=on_done)
    if kind != "ok":
        return kind, value
    if value[0] is None:
        return kind, (None, [(*f[:3], f[3:]) for f in value[1]])
    if tall_kind != "ok":
        return tall_kind, tall
    depth, short = value
    return "ok", (depth, [(*(round(x + (depth - a) * (y - x) / (b - a)) for x, y in zip(s[:3], t[:3])), (s[3], t[3]))
                          for s, t in zip(short, tall)])


def _depth_and_short_floors(workload: Workload, states: list[Config], dev: Device) -> tuple[int | None, list]:
    """(stack depth, the shallower copy's floors) for a deep model, else (None, the model's own floors)."""
    try:
        with new_fake_mode() as mode, FakeBuild(mode):
            depth = stack_depth(workload.model())
    except Exception:  # noqa: BLE001 - a model that needs more than a plain fake build: probed whole
        depth = None
    if depth is None or depth < DEEP:
        return None, _state_floors(workload, states, dev)
    return depth, _state_floors_of_copy(workload, depths(states[0].gpus if states else 1)[0], states, dev)


def _state_floors_of_copy(workload: Workload, blocks: int, states: list[Config], dev: Device) -> list[tuple]:
    return _state_floors(shallow(workload, blocks), states, dev)


def _aligned(o1, o2, sizes: tuple[int, int]) -> tuple[tuple, OpTable]:
    """The second probe's op table, and the first probe's FLOPs, bytes and fresh allocations row by row
    onto the second's ops. The lists differ where the micro-batch changes an op (a reshape is a view at
    micro-batch 1 and a copy at 2; every op after it shifts): each op of the second is matched to the same
    op of the first (a shortest edit script), and one the first lacks is taken as growing with the micro-batch."""
    t1, t2 = OpTable(o1), OpTable(o2)
    index = torch.full((len(o2),), -1, dtype=torch.long)
    for a, b in _matches(o2.name, o1.name):
        index[a] = b
    found = index >= 0
    first = []
    for field in ("flops", "bytes", "alloc"):
        values = getattr(t2, field) * (sizes[0] / sizes[1])
        values[found] = getattr(t1, field)[index[found]]
        first.append(values)
    return tuple(first), t2


def _matches(a: list, b: list) -> list[tuple[int, int]]:
    """Index pairs (i, j) with a[i] == b[j] of a longest common subsequence: Myers' O((N+M)·D) diff, fast
    because two probes' traces differ in few places (D), however long they are (difflib takes minutes on
    a 10,000-op step whose op names repeat thousands of times)."""
    ids: dict = {}
    a = [ids.setdefault(x, len(ids)) for x in a]
    b = [ids.setdefault(x, len(ids)) for x in b]
    n, m = len(a), len(b)
    v = {1: 0}
    trace = []
    for d in range(n + m + 1):
        trace.append(dict(v))
        for k in range(-d, d + 1, 2):
            x = v[k + 1] if k == -d or (k != d and v[k - 1] < v[k + 1]) else v[k - 1] + 1
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x, y = x + 1, y + 1
            v[k] = x
            if x >= n and y >= m:
                return _backtrack(trace, n, m)
    return []


def _backtrack(trace: list[dict], x: int, y: int) -> list[tuple[int, int]]:
    """Walk Myers' furthest-reaching paths back from (x, y), collecting the diagonal (matching) steps."""
    pairs = []
    for d in range(len(trace) - 1, 0, -1):
        v, k = trace[d], x - y
        down = k == -d or (k != d and v[k - 1] < v[k + 1])
        px = v[k + 1] if down else v[k - 1]
        py = px - (k + 1 if down else k - 1)
        mx, my = (px, py + 1) if down else (px + 1, py)  # after the edit, before the snake
        while x > mx:
            x, y = x - 1, y - 1
            pairs.append((x, y))
        x, y = px, py
    while x > 0 and y > 0:  # d = 0: the common prefix
        x, y = x - 1, y - 1
        pairs.append((x, y))
    return pairs[::-1]


def _family_name(cfg: Config) -> str:
    parts = [cfg.precision, f"activation checkpointing {cfg.activation_checkpoint}"]
    if cfg.gpus > 1:
        parts.insert(0, cfg.data_parallel)
    return ", ".join(parts + cfg.techniques())


def check_batches(global_batch: int, micro_batch: int | None) -> None:
    """A request the search can honour: whole numbers >= 1, a fixed micro-batch that divides the global batch
    (accumulation runs whole micro-batches: 10 = 4 x 2 would train on 8)."""
    for name, value in (("global batch", global_batch), ("micro-batch", micro_batch)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"{name} must be a whole number >= 1, got {value!r}")
    if micro_batch is not None and global_batch % micro_batch:
        raise ConfigError(f"micro-batch {micro_batch} does not divide the global batch {global_batch}")


def _micro_batches(global_batch: int, fixed: int | None, smallest: int = 1) -> list[int]:
    """The micro-batches to price: the fixed one, else every divisor of the global batch the model trains at."""
    if fixed is not None:
        return [fixed] if fixed >= smallest else []
    small = [d for d in range(1, math.isqrt(global_batch) + 1) if global_batch % d == 0]
    return [m for m in sorted({*small, *(global_batch // d for d in small)}) if m >= smallest]


@dataclasses.dataclass
class _Search:
    """One plan's request, read by every stage, and what the stages report, added to in the order the plan
    gives it: one object instead of the same dozen arguments to each stage."""
    workload: Workload
    global_batch: int
    dev: Device
    allowed: frozenset             # the techniques that change the math, allowed (check_allow's)
    budget_bytes: int
    host_bytes: int | None         # host_memory; None: not limited
    rates: Callable[[], Profile]   # the step-time profile, measured (a first calibration takes a while) only
    #                                once something fits: "nothing fits" comes at once
    # the caller's fixed choices (None: searched), as plan's defaults
    precision: str | None = None
    micro_batch: int | None = None
    activation_checkpoint: object = None
    offload_activations: bool | None = None
    offload_optimizer: bool | None = None
    gpus: int = 1
    data_parallel: str | None = None
    gpus_per_node: int | None = None
    notes: list = dataclasses.field(default_factory=list)
    verdicts: list = dataclasses.field(default_factory=list)       # [(family, verdict)]: Plan.families
    smallest_need: dict = dataclasses.field(default_factory=dict)  # family: the least memory it was found to need
    host_need: dict = dataclasses.field(default_factory=dict)      # family over host_bytes: the host memory it needs
    deep: bool = False  # probed as shallow copies (_floors): one rank's candidates are confirmed counted
    optimizer_steps: dict = dataclasses.field(default_factory=dict)  # state key: its optimizer step's ops (_floors)

    @property
    def usable(self) -> int:
        return int(self.budget_bytes * (1 - MARGIN))

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.gpus

    @property
    def cpu(self) -> bool:
        return self.dev.kind == "cpu"

    @property
    def adapted(self) -> bool:
        """Whether the workload is one with LoRA adapters already (lora's name for it)."""
        return "+lora:" in self.workload.name

    @property
    def precisions(self) -> list[str]:
        """The fixed precision, else the device's (fp16 left out across ranks)."""
        if self.precision:
            return [self.precision]
        precisions = list(defaults_for(self.dev).precisions)
        if self.gpus > 1 and "fp16" in precisions:
            precisions = [p for p in precisions if p != "fp16"] or ["fp32"]
        return precisions

    @property
    def bf16_pure_too(self) -> bool:
        """Whether bf16-pure is searched, a fallback for tight memory: bf16 autocast searched alone, on one GPU."""
        return self.precision is None and self.precisions == ["bf16"] and self.gpus == 1


def plan(workload: Workload, global_batch: int, budget=None, device: str | Device = "cpu", *,
         precision: str | None = None, micro_batch: int | None = None, activation_checkpoint=None,
         offload_activations: bool | None = None, offload_optimizer: bool | None = None,
         profile: Profile | None = None, confirm: int = 2, gpus: int = 1, data_parallel: str | None = None,
         gpus_per_node: int | None = None, traced: dict | None = None, allow=(), host_memory=None,
         split_layouts: str = "fallback") -> Plan:
    """The fastest configuration for `global_batch` samples per optimizer step within `budget` (a size,
    "50%" of the device, or the whole device; per rank with `gpus`). Fixed choices are honoured; the rest is
    searched, across ranks the layout too (ddp, fsdp, fsdp-no-reshard, and hsdp over more than one node).
    `confirm`: how many of the fastest candidates get a full estimate (0: the best prediction is returned
    unconfirmed). `traced`: families traced at other GPU counts, reused and filled in (plan_counts).
    `allow`: techniques that change the math, searched with the rest when named (ALLOW); the plan labels them.
    `host_memory`: the host memory offloading may use (a size); None: not limited (each plan says its need).
    `split_layouts`: "fallback" searches the layouts that split the model (tensor parallel, pipelines) only where
    data parallelism alone has nothing that fits or cannot split the batch over the ranks; "also" searches them
    beside a data-parallel plan that fits too and keeps the faster (minutes more on a 70B: BENCHMARKS.md,
    "Planning a 70B where data parallelism alone cannot use the GPUs")."""
    dev = device if isinstance(device, Device) else get_device(device)
    check_batches(global_batch, micro_batch)
    allowed = check_allow(allow)
    options = dict(budget=budget, device=dev, precision=precision, micro_batch=micro_batch,
                   activation_checkpoint=activation_checkpoint, offload_activations=offload_activations,
                   offload_optimizer=offload_optimizer, profile=profile, confirm=confirm, gpus=gpus,
                   data_parallel=data_parallel, gpus_per_node=gpus_per_node, host_memory=host_memory)
    if allowed & {"lora", "qlora"} and "+lora:" not in workload.name:
        return _full_or_lora(workload, global_batch, allowed, options)
    split_only = None  # why data parallelism alone cannot use the ranks (splitting the model may)
    try:
        layouts = _layouts(dev, gpus, data_parallel, gpus_per_node, global_batch, micro_batch)
    except ConfigError as e:
        if not (str(e).startswith("global batch") and data_parallel in (None, "fsdp") and dev.kind != "cpu"):
            raise
        layouts, split_only = [], e
    s = _Search(workload, global_batch, dev, allowed, budget_bytes=resolve_budget(budget, dev),
                host_bytes=parse_size(host_memory) if host_memory is not None else None,
                rates=functools.cache(lambda: profile or profile_for(dev)), precision=precision,
                micro_batch=micro_batch, activation_checkpoint=activation_checkpoint,
                offload_activations=offload_activations, offload_optimizer=offload_optimizer, gpus=gpus,
                data_parallel=data_parallel, gpus_per_node=gpus_per_node)
    if split_only:  # the ranks can still be used by splitting the model
        found = _split_plan(s, str(split_only), {})
        if found is None:
            raise ConfigError(f"{split_only}; no tensor-parallel or pipeline layout fits either: {s.notes[-1]}")
        return found
    bases, floors, depth = _floors(s, _search_space(s, layouts))
    families, failed, candidates, confirmed = _rounds(s, bases, floors, depth, traced, confirm)
    if failed and not families:
        return _all_raised(s, failed, dict(options, traced=traced, allow=allow))
    if not confirmed and s.gpus > 1 and not s.cpu and s.data_parallel in (None, "fsdp"):
        found = _split_plan(s, "; ".join(_nothing_hints(s, families, untried=False)), families)
        if found is not None:
            return found
    if not confirmed:
        _nothing_fits(s, families)
    chosen = _choose(s, families, candidates, confirmed[0])
    if split_layouts == "also" and s.gpus > 1 and not s.cpu and s.data_parallel in (None, "fsdp"):
        return _faster_of(s, chosen)
    return chosen


def _faster_of(s: _Search, chosen: Plan) -> Plan:
    """`chosen` (data parallel) or the fastest split layout that fits, whichever the cost model says is faster,
    the other's step time in the notes."""
    notes, verdicts = list(s.notes), list(s.verdicts)
    split = _split_plan(s, None, {})
    if split is not None and split.step_seconds < chosen.step_seconds:
        ratio = chosen.step_seconds / split.step_seconds
        split.notes.append(f"data parallelism alone fits ({chosen.config.describe()}: {chosen.step_seconds:.3g} s a "
                           f"step); this layout is {ratio:.2f}x faster")
        was = [(f, v) for f, v in verdicts if v.startswith("chosen")]  # the data-parallel family's, not chosen now
        split.families = [(f, f"fits, {ratio:.2f}x slower (micro-batch {chosen.config.micro_batch})")
                          if (f, v) in was else (f, v) for f, v in split.families]
        return split
    s.notes[:], s.verdicts[:] = notes, verdicts  # the split search's notes described a plan not taken
    chosen.notes.append("tensor-parallel and pipeline layouts searched too: " +
                        (f"the fastest that fits ({split.config.describe()}) takes {split.step_seconds:.3g} s a "
                         f"step, {split.step_seconds / chosen.step_seconds:.2f}x this plan's" if split is not None
                         else "none fits"))
    return chosen


def _split_plan(s: _Search, why_not: str | None, families: dict) -> Plan | None:
    """A plan of the fastest tensor-parallel or pipeline layout that fits (planner/model_parallel.py), or None.
    `why_not`: why data parallelism alone does not fit; None where it does (the split layouts searched beside it)."""
    found = model_parallel(s, why_not)
    if found is None:
        return None
    best, others, verdicts = found
    return Plan(config=best.config, device=s.dev.name, budget_bytes=s.budget_bytes, usable_bytes=s.usable,
                peak_bytes=best.peak_bytes, step_seconds=best.step_seconds,
                samples_per_second=s.global_batch / best.step_seconds, estimate=best.estimate,
                alternatives=others[:5], families=verdicts + s.verdicts, profile_source=describe(s.rates()),
                notes=s.notes, confirmed=True)



def _search_space(s: _Search, layouts: list[str]) -> list[Config]:
    """Every family's base at micro-batch 1: layout x precision x offload x checkpointing x the techniques
    allowed. The notes say what is left out and why, and what each technique allowed changes."""
    notes = s.notes
    notes.append(f"{MARGIN:.0%} of the budget is kept free for allocator growth and kernel workspaces")
    if s.gpus == 1 and s.data_parallel not in (None, "none"):
        notes.append(f"one GPU holds the whole model: {s.data_parallel} has no ranks to shard or replicate across, "
                     "so it is planned unsharded")
    defaults = defaults_for(s.dev)
    precisions = s.precisions
    if s.gpus > 1 and not s.precision and "fp16" in defaults.precisions:
        notes.append("fp16 not searched across ranks: loss scaling across ranks is not built yet")
    if not s.precision and "fp32" not in precisions:
        notes.append(f"fp32 not searched on a GPU: {precisions[0]} autocast is smaller and faster; fix it to force")
    checkpoints = [s.activation_checkpoint] if s.activation_checkpoint is not None else ["none", "all", "selective"]
    offloads = _offloads(s)
    # bf16 weights on the GPU, traced only when memory is tight (no bf16 family without optimizer offload fits
    # its state floor: _floors): with optimizer offload, fp32 master weights and optimizer state on the host (the
    # same mixed precision as FSDP's bf16 policy: bf16 compute, fp32 update); without, no fp32 copy at all
    variants = [(p, act, opt) for p in precisions for act, opt in offloads]
    if s.bf16_pure_too:
        variants += [("bf16-pure", act, opt) for act, opt in offloads]
    paging = "paged-optim" in s.allowed and s.gpus == 1 and defaults.search_offload
    eights = [(False, False)] + [(True, False)] * ("8bit-optim" in s.allowed) + [(True, True)] * paging
    fours = (False, True) if "qlora" in s.allowed and s.adapted else (False,)
    bases = [Config(micro_batch=1, precision=p, activation_checkpoint=ck, offload_activations=act,
                    offload_optimizer=opt, optimizer_8bit=eight, paged_optimizer=paged, base_4bit=four,
                    loss_chunks=chunks, gpus=s.gpus,
                    data_parallel=layout, gpus_per_node=s.gpus_per_node or 8 if layout == "hsdp" else None)
             for layout in layouts for p, act, opt in variants for ck in checkpoints for eight, paged in eights
             for four in fours
             if not (paged and opt)  # paged states are the host's already
             # a chunked loss where the blocks keep only their inputs: the logits are then the largest activation
             for chunks in ((1, LOSS_CHUNKS) if ck == "all" else (1,))
             # offloading what checkpointing already dropped is traced only when asked for
             if not (act and ck != "none" and s.activation_checkpoint is None)]
    if "8bit-optim" in s.allowed:
        notes.append("8-bit optimizer states allowed (they change the math): Adam's moments in 8 bits a value "
                     "with one fp32 scale per 256 (bitsandbytes' block-wise layout), 2.03 bytes a parameter "
                     "instead of 8")
    if "paged-optim" in s.allowed and paging:
        notes.append("paged 8-bit optimizer states allowed (they change the math as 8-bit states do): the moments in "
                     "host memory, each parameter's paged to the GPU for its own update (bitsandbytes' paged 8-bit "
                     "AdamW when the GPU is short of memory)")
    elif "paged-optim" in s.allowed:
        notes.append("paged optimizer states not searched: " + ("they are built for one GPU" if s.gpus > 1 else
                                                                "on a CPU device host and device memory are one"))
    if "qlora" in s.allowed and s.adapted:
        notes.append("4-bit base weights allowed (they change the math): the frozen Linear layers in NF4 with double "
                     "quantization (bitsandbytes' QLoRA layout), 0.52 bytes a weight")
    return bases


def _offloads(s: _Search) -> list[tuple[bool, bool]]:
    """The (activations, optimizer) offloads searched: both ways where the device searches offload and the
    caller left them open; the notes say why not elsewhere."""
    fixed = [(bool(s.offload_activations), bool(s.offload_optimizer))]
    open_ = s.offload_activations is None and s.offload_optimizer is None
    if s.gpus > 1:
        if open_:
            s.notes.append("offload not searched across ranks: not built with data parallelism yet")
        return fixed
    if not defaults_for(s.dev).search_offload:
        if open_:
            s.notes.append("offload not searched on a CPU device: host and device memory are one")
        return fixed
    acts = [s.offload_activations] if s.offload_activations is not None else [False, True]
    opts = [s.offload_optimizer] if s.offload_optimizer is not None else [False, True]
    if s.precisions == ["fp16"] and s.offload_optimizer is None:  # if the user fixes both, Config says why not
        opts = [False]
        s.notes.append("optimizer offload not searched with fp16: memfit's offload does not support loss scaling")
    return [(a, o) for a in acts for o in opts]


def _floors(s: _Search, bases: list[Config]) -> tuple[list[Config], dict, int | None]:
    """The bases whose state floor fits, the floors (by _state_key) and the model's stack depth (None: probed
    whole). What stays between steps (weights, gradients, optimizer state) is a floor that costs no forward or
    backward pass to find: families already over the budget there are not traced (a 7B model's are half); one
    over it only by its gradient buffer is traced with the optimizer step in backward instead, which keeps
    none; one whose offloaded state is over host_bytes is not traced either. (Only a shortcut: if the floors
    cannot be found, the families' own traces report what is wrong.)"""
    usable = s.usable
    states = list({_state_key(b): b for b in bases}.values())
    stage = _Stage(f"weights, gradients and optimizer state of {len(states)} families", 2)
    kind, value = _depth_and_floors(s.workload, states, s.dev, on_done=stage.done)
    depth, split = (value[0], dict(zip(map(_state_key, states), value[1]))) if kind == "ok" else (None, {})
    floors = {key: on_device for key, (on_device, *_) in split.items()}
    host_floors = {key: on_host for key, (_, on_host, *_) in split.items()}
    s.optimizer_steps = {key: ops for key, (*_, ops) in split.items()}
    if depth:
        s.deep = True
        a, b = depths(s.gpus)
        s.notes.append(f"{s.workload.name}'s {depth} identical blocks probed as copies of {a} and {b} blocks, "
                       "extended to the full depth; every plan offered is confirmed on the whole model" +
                       (" (counted from three copies where that checks out)" if s.gpus == 1 else ""))
    if s.bf16_pure_too:
        if any(floors.get(_state_key(b), 0) <= usable for b in bases
               if b.precision == "bf16" and not b.offload_optimizer):
            bases = [b for b in bases if b.precision != "bf16-pure"]  # a weaker fallback, for tight memory
        else:
            s.notes.append("bf16-pure searched (bf16 autocast's weights, gradients and optimizer state do not fit): "
                           "bf16 weights and gradients on the GPU; with optimizer offload, fp32 master weights and "
                           "optimizer state on the host (bf16 compute, fp32 update), without it no fp32 copy at all")
    in_backward = {b: b.replace(optimizer_in_backward=True) for b in bases if floors.get(_state_key(b), 0) > usable
                   and _state_key(b) in split and _may_step_in_backward(b, s.workload, s.micro_batch, s.per_rank)}
    for b, alt in in_backward.items():  # the same state less the gradients (state_parts)
        floors[_state_key(alt)] = floors[_state_key(b)] - split[_state_key(b)][2]
        host_floors[_state_key(alt)] = host_floors[_state_key(b)]
    for b in list(bases):
        floor = floors.get(_state_key(b), 0)
        alt = in_backward.get(b)
        if floor > usable and alt is not None and floors.get(_state_key(alt), floor) <= usable:
            s.verdicts.append((_family_name(b), f"does not fit: weights, gradients and optimizer state alone need "
                                                f"{fmt_bytes(floor)}; with the optimizer step in backward (no "
                                                f"gradient buffer) {fmt_bytes(floors[_state_key(alt)])}: traced "
                                                "that way"))
            bases[bases.index(b)] = b = alt
            floor = floors[_state_key(alt)]
        if floor > usable:
            bases.remove(b)
            s.smallest_need[_family_name(b)] = floor
            s.verdicts.append((_family_name(b), f"does not fit: weights, gradients and optimizer state alone need "
                                                f"{fmt_bytes(floor)}, over by {fmt_bytes(floor - usable)}"))
            continue
        host_floor = host_floors.get(_state_key(b), 0)
        if s.host_bytes is not None and not s.cpu and host_floor > s.host_bytes:
            bases.remove(b)
            s.host_need[_family_name(b)] = host_floor
            s.verdicts.append((_family_name(b), f"does not fit the host: offloading keeps {fmt_bytes(host_floor)} "
                                                f"of weights, gradients and optimizer state there, over --host-memory "
                                                f"by {fmt_bytes(host_floor - s.host_bytes)} (not traced)"))
    return bases, floors, depth


def _rounds(s: _Search, bases: list[Config], floors: dict, depth: int | None, traced: dict | None,
            confirm: int) -> tuple[dict, list, list, list]:
    """The families traced (_probes), their candidates and those confirmed, in up to three rounds:
    1. every family but those below, its fastest candidates confirmed;
    2. the families that differ from a plain one of round 1 only in their optimizer (_siblings): traced
       only where a bound from the plain one may beat the plan of round 1 (_beaten);
    3. bf16 autocast with optimizer offload beside its bf16-pure twin (_dominated): only where the twin raised.
    Every family left untraced gets a verdict saying why."""
    twins = _dominated(s, bases)
    siblings = _siblings(s, [b for b in bases if b not in twins]) if confirm and traced is None else {}
    families, failed = _probes(s, [b for b in bases if b not in twins and b not in siblings], floors, depth, traced)
    candidates = _candidates(s, families) if families else []
    confirmed = _confirm(s, candidates, confirm) if candidates else []
    bound = confirmed[0].step_seconds if confirmed else math.inf
    second = []
    for group in _paired(s, siblings):
        for base, why in _beaten(s, group, siblings, families, floors, bound).items():
            if why is None:
                second.append(base)
            else:
                s.verdicts.append((_family_name(base), why))
    more, raised = _probes(s, second, floors, depth, None)
    failed += raised
    third = [b for b, twin in twins.items() if twin in {f for f, _ in failed}]
    for base, twin in twins.items():
        if base not in third:
            s.verdicts.append((_family_name(base), "not traced: its bf16-pure twin, searched, holds less and runs "
                                                   "faster (bf16 weights on the GPU, no casts, half the gradient "
                                                   "bytes to the host)"))
    last, raised = _probes(s, third, floors, depth, None)
    failed += raised
    more.update(last)
    if more:
        candidates += _candidates(s, more)  # (it drops families that cannot be used)
        families.update(more)
        candidates.sort(key=lambda c: c.step_seconds)
        confirmed = _confirm(s, candidates, confirm)
    return families, failed, candidates, confirmed


def _siblings(s: _Search, bases: list[Config]) -> dict[Config, Config]:
    """{family: its plain sibling} for the families that differ from another searched only in their optimizer
    (8-bit or paged states, optimizer offload), on one GPU: their forward and backward are the sibling's ops
    (offload adds host work), their state is smaller by what the state floors say."""
    if s.gpus != 1:
        return {}
    present, out = set(bases), {}
    for b in bases:  # the plainest searched: without those techniques, else (offloaded) without 8-bit states
        for p in (b.replace(optimizer_8bit=False, paged_optimizer=False, offload_optimizer=False),
                  b.replace(optimizer_8bit=False, paged_optimizer=False)):
            if p != b and p in present:
                out[b] = p
                break
    return out


def _paired(s: _Search, siblings: dict) -> list[tuple]:
    """The siblings, those without checkpointing and with every block checkpointed in one pair where the plan
    interpolates checkpointing every k-th block between them (_every_k): both are traced, or neither."""
    groups, seen = [], set()
    for b in siblings:
        if b in seen:
            continue
        other = b.replace(activation_checkpoint="all" if b.activation_checkpoint == "none" else "none")
        pair = (b.activation_checkpoint in ("none", "all") and b.loss_chunks == 1 and other in siblings
                and s.activation_checkpoint is None)
        groups.append(tuple(sorted((b, other), key=lambda c: c.activation_checkpoint != "none")) if pair else (b,))
        seen.update(groups[-1])
    return groups


def _beaten(s: _Search, group: tuple, siblings: dict, families: dict, floors: dict, bound: float) -> dict:
    """{family of `group`: why it cannot beat `bound` (the step seconds of round 1's plan), or None where it
    may}. At each micro-batch, a lower bound from the plain family: its forward and backward time (a
    sibling's are the same ops, or more under offload) and, on a GPU, the link time of the bytes the plain
    family moves (offloaded activations; offloaded optimizer) and, where only the sibling offloads its
    optimizer, of every gradient to the host each micro-step and every weight back once; plus the sibling's
    own optimizer step and its adds of later micro-steps' gradients (_optimizer_seconds); where it may fit,
    by the plain family's forward and backward peaks less what the sibling's smaller state saves (state
    floors). A pair without and with every block
    checkpointed is bounded at the every-k checkpointing between them too (_every_k interpolates it): where
    that may beat the plan, both are traced."""
    plains = [families.get(siblings[b]) for b in group]
    if any(p is None for p in plains) or not math.isfinite(bound):
        return dict.fromkeys(group)
    rates, cuda = s.rates(), s.dev.kind == "cuda"
    updates = [_optimizer_seconds(s, b, p) for b, p in zip(group, plains)]
    shares = [0.0, 1.0, *_every_k_shares(plains[1].depth).values()] if len(group) == 2 else [0.0]
    best = dict.fromkeys(shares, math.inf)  # the least time that may fit
    for m in _sizes(s, group[0], plains[0]):
        accum = s.per_rank // m
        need, seconds = [], []
        for b, p, update in zip(group, plains, updates):
            phases = p.phases(m, accum)
            saved = floors.get(_state_key(siblings[b]), 0) - floors.get(_state_key(b), 0)
            need.append(max(phases[Phase.FORWARD], phases[Phase.BACKWARD]) - saved)
            t = accum * p.forward_backward_seconds(rates, m) + update[0] + (accum - 1) * update[1]
            if cuda:  # what the plain family moves, and what offloading the optimizer adds to it
                offloads = b.offload_optimizer and not siblings[b].offload_optimizer
                t += (p.moved_bytes(m, accum) + (accum + 1) * p.gradient_bytes() * offloads) / rates.link_bandwidth
            seconds.append(t)
        for share in best:  # (a pair's none is group[0], all group[1]; the shares in between interpolate)
            at = lambda values: values[0] + share * (values[-1] - values[0])  # noqa: E731
            if at(need) <= s.usable:
                best[share] = min(best[share], at(seconds))
    between = any(t < bound for share, t in best.items() if 0 < share < 1)
    kept = [between or best[0.0] < bound] + ([between or best[1.0] < bound] if len(group) == 2 else [])
    out = {}
    for b, keep, share, update in zip(group, kept, (0.0, 1.0), updates):
        plain = _family_name(siblings[b])
        moved = (" and the bytes it moves" if cuda else "") + (
            ", plus the optimizer step of the family left out" if any(update) else "")
        out[b] = None if keep else (
            f"not traced: over the budget at every micro-batch by {plain}'s forward and backward peaks, less the "
            "state it saves" if not math.isfinite(best[share]) else
            f"not traced: at least {best[share]:.3g} s a step at any micro-batch that may fit ({plain}'s forward "
            f"and backward{moved}), no faster than the plan's {bound:.3g} s")
    return out


def _optimizer_seconds(s: _Search, cfg: Config, plain) -> tuple[float, float]:
    """`cfg`'s optimizer step and one later micro-step's gradient adds, at the full depth, from its state
    floor's trace of that step alone (the ops its probes' optimizer phase records; the adds they price);
    (0, 0) where there is none, or where the plain family's probe left a parameter without a gradient (a
    trace over every parameter would then be more than the step's)."""
    traces = s.optimizer_steps.get(_state_key(cfg))
    if not traces or None in traces or not isinstance(plain, (_Family, _DeepFamily)):
        return 0.0, 0.0
    probe = (plain.tall if isinstance(plain, _DeepFamily) else plain).probes[1]
    if any("get no gradient" in note for note in probe.estimate.notes):
        return 0.0, 0.0
    rates = s.rates()
    seconds = [(phase_seconds(rates, OpTable(ops), ("optimizer",)), accumulation_seconds(rates, ops)) for ops in traces]
    if len(seconds) == 1:
        return seconds[0]
    a, b = depths(s.gpus)
    return tuple(max(0.0, x + (plain.depth - a) * (y - x) / (b - a)) for x, y in zip(*seconds))


def _probes(s: _Search, bases: list[Config], floors: dict, depth: int | None,
            traced: dict | None) -> tuple[dict, list]:
    """Each base's family (two probes), as {base: family}, and the bases whose tracing raised, as [(base,
    error)]. A family plan_counts traced at another GPU count (`traced`) is predicted at this one (_AtCount);
    one traced here is added to `traced`. Then the optimizer step in backward for the families that would
    accumulate (_in_backward_bases)."""
    reused = {}
    for b in bases if traced is not None else []:
        hit = traced.get(_count_free(b)) if _state_key(b) in floors else None  # scaled by the floors
        if hit is not None:
            fam, at, floor = hit
            then, now = outside_tensors(s.dev, at), outside_tensors(s.dev, b)
            reused[b] = _AtCount(fam, at, b, (floor - then, floors[_state_key(b)] - now), now - then)
    fresh = [b for b in bases if b not in reused]
    results = dict(zip(fresh, _probe_families(s.workload, fresh, s.dev, depth, "probing")))
    families, failed = {}, []
    for base in bases:
        kind, value = ("ok", reused[base]) if base in reused else results[base]
        _take(s, families, failed, base, kind, value)
        if kind == "ok" and traced is not None and base not in reused and _state_key(base) in floors:
            traced[_count_free(base)] = (value, base, floors[_state_key(base)])
    tight = _in_backward_bases(s, families)
    for base, (kind, value) in zip(tight, _probe_families(s.workload, tight, s.dev, depth,
                                                          "probing, with the optimizer step in backward,")):
        _take(s, families, failed, base, kind, value)
    return families, failed


def _dominated(s: _Search, bases: list[Config]) -> dict[Config, Config]:
    """Where bf16-pure is searched (bf16 autocast's own state does not fit), each bf16 autocast family with
    optimizer offload and its bf16-pure twin with the same techniques, searched too: both keep fp32 master
    weights and optimizer state on the host, and the twin holds bf16 weights on the GPU where autocast holds
    fp32 ones and their bf16 casts, runs no casts, and moves half the gradient bytes. Only traced if the twin
    raises (tests/test_planner.py checks the dominance on a traced pair)."""
    if not any(b.precision == "bf16-pure" for b in bases):
        return {}
    present = set(bases)
    return {b: b.replace(precision="bf16-pure") for b in bases if b.precision == "bf16" and b.offload_optimizer
            and b.replace(precision="bf16-pure") in present}


def _take(s: _Search, families: dict, failed: list, base: Config, kind: str, value) -> None:
    """One probe's result: the family into `families`, or why not into the notes or verdicts (and a raise
    into `failed`: the workload's own code, an op fake tensors lack, a crash; the plan goes on without it)."""
    if kind == "ok":
        families[base] = value
    elif isinstance(value, LossChunkError):  # said once, in the notes
        if not any(n.startswith("loss not chunked") for n in s.notes):
            s.notes.append(f"loss not chunked: {value}")
    elif isinstance(value, ConfigError):
        s.verdicts.append((_family_name(base), f"cannot apply: {value}"))
    else:
        failed.append((base, value))
        s.verdicts.append((_family_name(base), f"skipped: tracing it raised {first_line(value)}"))


def _in_backward_bases(s: _Search, families: dict) -> list[Config]:
    """The families to trace again with the optimizer step in backward, which holds no gradients but runs one
    micro-batch a step: those that would need accumulation (they do not fit the whole rank batch in one
    micro-batch), unless their forward pass alone is over the budget there: it is the same pass with or
    without the optimizer in backward, so its peak is a floor under that family's."""
    usable, per_rank = s.usable, s.per_rank
    accumulating = [(b, fam) for b, fam in families.items()
                    if s.gpus == 1 and not (b.offload_optimizer or b.precision == "fp16" or b.optimizer_in_backward)
                    and s.micro_batch in (None, per_rank) and per_rank >= fam.sizes[0]
                    and fam.memory(per_rank, 1, s.cpu) > usable]
    if accumulating and s.workload.max_grad_norm is not None:
        s.verdicts.extend((_family_name(b.replace(optimizer_in_backward=True)), "cannot apply: clipping by the "
                           "total gradient norm (max_grad_norm) needs every gradient before any update")
                          for b, _ in accumulating)
        return []
    tight = []
    for b, fam in accumulating:
        in_backward = b.replace(optimizer_in_backward=True)
        forward = fam.memory(per_rank, 1, s.cpu, phases={Phase.FORWARD: fam.phases(per_rank, 1)[Phase.FORWARD]})
        if forward <= usable:
            tight.append(in_backward)
            continue
        name = _family_name(in_backward)
        s.smallest_need[name] = forward
        s.verdicts.append((name, f"does not fit: its forward pass alone needs about {fmt_bytes(forward)} at "
                                 f"micro-batch {per_rank}, over by {fmt_bytes(forward - usable)} (not traced)"))
    return tight


def _all_raised(s: _Search, failed: list, options: dict) -> Plan:
    """Every family's tracing raised: the first error is the answer, unless fp32 was left out (a model that
    cannot run in low precision, an FFT): then the plan in fp32 (`options`: plan's, to search it again)."""
    base, error = failed[0]
    answer = error if isinstance(error, (WorkloadError, EstimateError)) else WorkloadError(
        f"tracing {_family_name(base)} at micro-batch 1 raised: {first_line(error)}")
    if s.precision is None and "fp32" not in s.precisions:
        return _in_fp32(s.workload, s.global_batch, f"{_family_name(base)}: {first_line(error)}", answer, options)
    raise answer from (None if answer is error else error)


def _sizes(s: _Search, base: Config, fam: _Family) -> list[int]:
    """The micro-batches a family is priced at (with the optimizer step in backward: the rank batch only)."""
    sizes = _micro_batches(s.per_rank, s.micro_batch, fam.sizes[0])
    return [m for m in sizes if m == s.per_rank] if base.optimizer_in_backward else sizes


def _candidates(s: _Search, families: dict) -> list[Candidate]:
    """Every micro-batch x accumulation of each family that its probes predict to fit, and checkpointing every
    k-th block (between a family's "none" and "all"), fastest first. Families over host_bytes or with no
    micro-batch they train at are taken out of `families`."""
    usable, cpu = s.usable, s.cpu
    rejected = next((f for f in families.values() if f.rejected), None)
    if rejected:
        s.notes.append(f"{s.workload.name} cannot train at micro-batch 1 ({rejected.rejected}): probed at "
                       f"{rejected.sizes[0]} and {rejected.sizes[1]}; micro-batch 1 is not offered")
    candidates: list[Candidate] = []
    too_small: list[_Family] = []  # families with no micro-batch they train at
    for base, fam in list(families.items()):
        name = _family_name(base)
        if s.host_bytes is not None and not cpu and fam.host() > s.host_bytes:
            del families[base]
            s.host_need[name] = fam.host()
            s.verdicts.append((name, f"does not fit the host: offloading needs {fmt_bytes(fam.host())} of host "
                                     f"memory, over --host-memory by {fmt_bytes(fam.host() - s.host_bytes)}"))
            continue
        sizes = _sizes(s, base, fam)
        if not sizes:
            too_small.append(families.pop(base))
            s.verdicts.append((name, f"cannot train at micro-batch {s.micro_batch or s.per_rank} ({fam.rejected})"))
            continue
        comm = comm_for(s.dev, base)
        for m in sizes:
            accum = s.per_rank // m
            need = fam.memory(m, accum, cpu)
            s.smallest_need[name] = min(s.smallest_need.get(name, need), need)
            if need <= usable:
                cfg = fam.base.replace(micro_batch=m, grad_accum=accum)
                candidates.append(Candidate(cfg, need, fam.seconds(s.rates(), m, accum, comm)))
        # every k-th block: between "none" and "all", by the share of blocks checkpointed
        none = families.get(base.replace(activation_checkpoint="none"))
        if base.activation_checkpoint == "all" and none is not None and s.activation_checkpoint is None and s.gpus == 1:
            candidates += _every_k(none, fam, s.global_batch,
                                   s.per_rank if base.optimizer_in_backward else s.micro_batch, usable, cpu, s.rates)
    if too_small and not families:
        fam = too_small[0]
        raise MicroBatchError(s.workload.name, s.micro_batch or s.global_batch, fam.sizes[0], fam.rejected)
    candidates.sort(key=lambda c: c.step_seconds)
    return candidates


def _confirm(s: _Search, candidates: list[Candidate], confirm: int) -> list[Candidate]:
    """The `confirm` fastest candidates a full estimate (full_probe, a core each) says fit, fastest first: one
    whose estimate raises or refutes it is taken out of `candidates` and the next is confirmed instead. Once
    the fastest confirmed is at least as fast as every prediction left, no more are confirmed: none of them
    could be chosen (the rest stay alternatives, predicted). `confirm` 0: the best prediction, said to be one.
    If every candidate raised, the first error is raised: "nothing fits" would be wrong."""
    confirmed = [c for c in candidates if c.confirmed]  # (by an earlier round)
    raised: list[Exception] = []
    queue = [c for c in candidates if not c.confirmed]
    # a counted confirmation keeps both cores busy with its copies: one at a time, each maybe the last needed
    at_once = 1 if s.deep and s.gpus == 1 else confirm
    while queue and len(confirmed) < confirm and not (
            confirmed and confirmed[0].step_seconds <= min(c.step_seconds for c in queue)):
        batch, queue = queue[:at_once], queue[at_once:]
        stage = _Stage(f"confirming the {len(confirmed) + len(batch)} fastest of {len(candidates)} candidates by "
                       "full estimates", len(batch))
        results = run_cached_many([functools.partial(full_probe, s.workload, c.config, s.dev) for c in batch],
                                  on_done=stage.done)
        for cand, (kind, value) in zip(batch, results):
            label = _family_name(cand.config) + f", micro-batch {cand.config.micro_batch}"
            if kind != "ok":  # not offered; the next candidate is confirmed instead
                raised.append(value)
                candidates.remove(cand)
                s.verdicts.append((label, f"skipped: its full estimate raised {first_line(value)}"))
                continue
            cand.peak_bytes, cand.confirmed, cand.estimate = _used(value.estimate), True, value.estimate
            cand.step_seconds = _seconds(s.rates(), value, cand.config, s.dev)
            host = value.estimate.host_peak_bytes or 0
            if s.host_bytes is not None and host > s.host_bytes:
                candidates.remove(cand)
                s.host_need[label] = host
                s.verdicts.append((label, f"predicted to fit, but the full estimate needs {fmt_bytes(host)} of host"))
            elif cand.peak_bytes <= s.usable:
                confirmed.append(cand)
            else:  # refuted: never offered, not even as an alternative
                candidates.remove(cand)
                s.verdicts.append((label, f"predicted to fit, but the full estimate needs "
                                          f"{fmt_bytes(cand.peak_bytes)}"))
        confirmed.sort(key=lambda c: c.step_seconds)
    if confirm == 0 and candidates:
        confirmed = candidates[:1]
    if not confirmed and raised and not queue:
        raise raised[0]
    return confirmed


def _nothing_fits(s: _Search, families: dict) -> NoReturn:
    """Raises "nothing fits", with what would: the budget the smallest configuration tried needs, the families
    host_bytes ruled out, and on a GPU the techniques not allowed that may fit (_untried)."""
    hints = _nothing_hints(s, families)
    raise PlanError(f"nothing fits in {fmt_bytes(s.budget_bytes)} on {s.dev.name} for a global batch of "
                    f"{s.global_batch}: {'; '.join(hints)}")


def _nothing_hints(s: _Search, families: dict, untried: bool = True) -> list[str]:
    hints = []
    if s.smallest_need:
        name = min(s.smallest_need, key=s.smallest_need.get)
        traced_need = any(_family_name(b) == name for b in families)  # else only its state floor is known
        hints.append(f"the smallest configuration tried needs {'about' if traced_need else 'at least'} "
                     f"{fmt_bytes(s.smallest_need[name] / (1 - MARGIN))} of budget")
    elif not s.host_need:
        hints.append("no family could be traced")
    if s.host_need:
        untraced = all(_family_name(b) not in s.host_need for b in families)  # ruled out by state floors alone
        count = len(s.host_need)
        hints.append(f"{count} {'family' if count == 1 else 'families'} that offload to the host were ruled out "
                     f"by --host-memory {fmt_bytes(s.host_bytes)} (the least needs "
                     f"{fmt_bytes(min(s.host_need.values()))} of host memory{'; not traced' if untraced else ''})")
    if not s.cpu:
        lean = Config(precision="bf16-pure" if s.bf16_pure_too else s.precisions[0],
                      offload_optimizer=bool(s.offload_optimizer), gpus=s.gpus,
                      data_parallel="fsdp" if s.gpus > 1 else "none")
        hints += _untried(s, lean) if untried else []
    return hints


def _choose(s: _Search, families: dict, candidates: list[Candidate], best: Candidate) -> Plan:
    """The plan: `best`, the other candidates as alternatives, a verdict for every family probed (chosen,
    how much slower, or by how much it is over), and where the plan offloads, the techniques that may not."""
    verdicts = s.verdicts
    for base in families:
        name = _family_name(base)
        mine = [c for c in candidates if _family_name(c.config) == name]
        if name == _family_name(best.config):
            verdicts.insert(0, (name, f"chosen at micro-batch {best.config.micro_batch}"))
        elif not mine and s.smallest_need[name] > s.usable:  # (else its candidates raised: said above)
            over = s.smallest_need[name] - s.usable
            verdicts.append((name, f"does not fit: over by {fmt_bytes(over)} even at micro-batch "
                                   f"{min(_sizes(s, base, families[base]))}"))
        elif mine:
            fastest = min(mine, key=lambda c: c.step_seconds)
            verdicts.append((name, f"fits, {fastest.step_seconds / best.step_seconds:.2f}x slower "
                                   f"(best at micro-batch {fastest.config.micro_batch})"))
    if not any(v.startswith("chosen") for _, v in verdicts):
        verdicts.insert(0, (_family_name(best.config), f"chosen at micro-batch {best.config.micro_batch}"))
    if best.config.offload_optimizer and not {"8bit-optim", "paged-optim"} & s.allowed:
        host = f"{fmt_bytes(best.estimate.host_peak_bytes)} of " if best.estimate is not None else ""
        s.notes.append(f"this plan keeps {host}master weights, gradients and optimizer state in host "
                       "memory; not searched, as they change the math: --allow 8bit-optim (Adam's moments in 2 bytes "
                       "a parameter instead of 8, which may fit on the GPU without offloading) and --allow "
                       "paged-optim (those moments in host memory, paged to the GPU one parameter at a time)")
    alternatives = [c for c in candidates if c is not best][:5]
    return Plan(config=best.config, device=s.dev.name, budget_bytes=s.budget_bytes, usable_bytes=s.usable,
                peak_bytes=best.peak_bytes, step_seconds=best.step_seconds,
                samples_per_second=s.global_batch / best.step_seconds, estimate=best.estimate,
                alternatives=alternatives, families=verdicts, profile_source=describe(s.rates()), notes=s.notes,
                confirmed=best.confirmed)


# what `allow` may name (they change the math): 8-bit optimizer states, the same paged from the host, LoRA, QLoRA
# (LoRA on a 4-bit base; it allows LoRA's bf16 base too)
ALLOW = ("8bit-optim", "paged-optim", "lora", "qlora")
LORA = dict(r=16, alpha=32, targets="all-linear")  # the adapters a plan allowed LoRA tries (QLoRA's choice of layers)


def check_allow(allow) -> frozenset:
    allowed = frozenset([allow] if isinstance(allow, str) else allow or ())
    unknown = sorted(allowed - set(ALLOW))
    if unknown:
        raise ConfigError(f"cannot allow {', '.join(unknown)}: the techniques that change the math are "
                          f"{', '.join(ALLOW)}")
    return allowed


def _full_or_lora(workload: Workload, global_batch: int, allowed: frozenset, options: dict) -> Plan:
    """The faster of the full fine-tune's plan and LoRA's (LORA's adapters; with qlora, on a 4-bit base too),
    each said in the other's notes."""
    from memfit.workloads.lora import lora

    adapted = lora(workload, **LORA)
    plans, why = {}, {}
    for kind, wl in (("full fine-tune", workload), ("LoRA", adapted)):
        try:
            plans[kind] = plan(wl, global_batch, allow=allowed - {"lora", "qlora"} if wl is workload else allowed,
                               **options)
        except (PlanError, WorkloadError) as e:  # (a model peft cannot adapt: planned without LoRA)
            if kind != "LoRA" and not isinstance(e, PlanError):
                raise
            why[kind] = str(e)
    if not plans:
        raise PlanError(f"{why['full fine-tune']}; with LoRA too: {why['LoRA'].partition(': ')[2] or why['LoRA']}")
    kind = min(plans, key=lambda k: plans[k].step_seconds)
    best = plans[kind]
    other = "full fine-tune" if kind == "LoRA" else "LoRA"
    if other in plans:
        said = (f"{other} fits too ({plans[other].config.describe()}, peak {fmt_bytes(plans[other].peak_bytes)}), "
                f"{plans[other].step_seconds / best.step_seconds:.2f}x slower")
    else:
        said = f"{other} does not fit: {why[other]}"
    if kind == "LoRA":
        four = best.config.base_4bit
        best.notes.insert(0, f"{'QLoRA' if four else 'LoRA'} allowed (it changes the math: the base is frozen"
                             f"{' and its Linear weights in 4 bits' if four else ''}, only adapters train): "
                             f"adapters of rank {LORA['r']} (alpha {LORA['alpha']}) on every Linear layer of the "
                             f"blocks; train it with --lora {lora_flag()}{' --base-4bit' if four else ''}")
    best.notes.insert(1 if kind == "LoRA" else 0, f"LoRA allowed; {said}")
    return best


def lora_flag() -> str:
    """LORA in `--lora` syntax, for the plan's note and train's refusal."""
    return ",".join(f"{k}={v}" for k, v in LORA.items())


def gpu_counts(text: str) -> list[int]:
    """`--gpus` as a count ("64") or a range ("8-512": both ends and the powers of two between)."""
    try:
        low, _, high = text.partition("-")
        low, high = int(low), int(high or low)
    except ValueError:
        raise ConfigError(f"--gpus takes a count (64) or a range (8-512), got {text!r}") from None
    if not 1 <= low <= high:
        raise ConfigError(f"--gpus {text}: counts are whole numbers >= 1, the smaller first")
    return sorted({low, high} | {2**k for k in range(high.bit_length()) if low <= 2**k <= high})


def plan_counts(workload: Workload, global_batch: int, counts: list[int], **options) -> list[dict]:
    """`plan` at each GPU count: per count the plan, or why nothing fits; throughput and each count's
    scaling efficiency (samples/s per GPU against the smallest count that fits). Each family is traced at
    the first count it may fit at and predicted at the others (_AtCount); the fewest GPUs that fit are
    confirmed by full estimates, the other counts' plans are predictions (Plan.confirmed)."""
    rows, traced = [], {}
    for n in counts:
        if global_batch % n:
            rows.append(dict(gpus=n, plan=None, why=f"global batch {global_batch} does not split over {n} GPUs"))
            continue
        try:
            rows.append(dict(gpus=n, plan=plan(workload, global_batch, gpus=n, confirm=0, traced=traced, **options),
                             why=None))
        except PlanError as e:
            rows.append(dict(gpus=n, plan=None, why=str(e)))
    for r in rows:  # the fewest GPUs that fit: confirmed by full estimates (predicted elsewhere)
        if r["plan"] is not None:
            try:
                r["plan"] = plan(workload, global_batch, gpus=r["gpus"], traced=traced, **options)
                break
            except PlanError as e:
                r["plan"], r["why"] = None, str(e)
    fits = [r for r in rows if r["plan"] is not None]
    for r in fits:
        base = fits[0]
        r["efficiency"] = (r["plan"].samples_per_second / r["gpus"]) / (base["plan"].samples_per_second / base["gpus"])
    return rows


def _in_fp32(workload: Workload, global_batch: int, why: str, answer: Exception, kept: dict) -> Plan:
    """`plan` in fp32, after every family in the device's low precision raised (`why`). If fp32 raises too,
    the model itself does not run: `answer`, the low-precision failure, is raised."""
    try:
        found = plan(workload, global_batch, **dict(kept, precision="fp32"))
    except PlanError as e:
        raise PlanError(f"{e} (fp32 searched: every family in low precision raised: {why})") from e
    except (WorkloadError, EstimateError, ConfigError):
        raise answer from None
    found.notes.insert(0, f"fp32 searched: every family in low precision raised ({why})")
    return found


def _count_free(cfg: Config) -> tuple:
    """A family whatever the GPU count: layout, precision, checkpointing, offload, hsdp's node."""
    return _family_name(cfg), cfg.gpus_per_node


def _state_key(cfg: Config) -> tuple:
    """What decides a family's state floor: precision, optimizer offload, 8-bit states and their paging, a 4-bit
    base, a gradient buffer (none with the optimizer step in backward), the layout across ranks."""
    return (cfg.precision, cfg.offload_optimizer, cfg.optimizer_8bit, cfg.paged_optimizer, cfg.base_4bit,
            cfg.optimizer_in_backward, cfg.gpus, cfg.data_parallel, cfg.gpus_per_node)


def _may_step_in_backward(cfg: Config, workload: Workload, micro_batch: int | None, per_rank: int) -> bool:
    """Whether `cfg`'s family can take the optimizer step in backward (Config's rules: one GPU, no fp16, no
    optimizer offload, one micro-batch a step; and no clipping by the total norm)."""
    return (cfg.gpus == 1 and not (cfg.offload_optimizer or cfg.precision == "fp16" or cfg.optimizer_in_backward)
            and workload.max_grad_norm is None and micro_batch in (None, per_rank))


def _more_floors(workload: Workload, configs: list[Config], dev: Device, floors: dict, host_floors: dict):
    """`floors` and `host_floors` with those of `configs` added (traced in a child, as plan's first ones)."""
    kind, value = _depth_and_floors(workload, configs, dev)
    floors, host_floors = dict(floors), dict(host_floors)
    if kind == "ok":
        for cfg, (on_device, on_host, *_) in zip(configs, value[1]):
            floors[_state_key(cfg)], host_floors[_state_key(cfg)] = on_device, on_host
    return floors, host_floors


def _untried(s: _Search, base: Config) -> list[str]:
    """For "nothing fits": the techniques that change the math and were not allowed, each with what its state
    floor needs in its leanest family (`base`'s precision and offload, the optimizer step in backward where it
    may), traced here; a floor within the limits says it may fit, the activations deciding."""
    tries = {}
    if "8bit-optim" not in s.allowed and "paged-optim" not in s.allowed:
        tries["8bit-optim"] = base.replace(optimizer_8bit=True)
    if "paged-optim" not in s.allowed and base.gpus == 1 and not base.offload_optimizer:
        tries["paged-optim"] = base.replace(optimizer_8bit=True, paged_optimizer=True)
    for name, cfg in tries.items():
        if _may_step_in_backward(cfg, s.workload, s.micro_batch, s.per_rank):
            tries[name] = cfg.replace(optimizer_in_backward=True)
    floors, host_floors = _more_floors(s.workload, list(tries.values()), s.dev, {}, {})
    out = []
    for name, cfg in tries.items():
        key = _state_key(cfg)
        if key not in floors:
            continue
        on_device, on_host = floors[key], host_floors[key]
        fits = on_device <= s.usable and (s.host_bytes is None or on_host <= s.host_bytes)
        where = f"{fmt_bytes(on_device)} on the GPU" + (f" and {fmt_bytes(on_host)} on the host" if on_host else "")
        family = ", ".join([cfg.precision] + [t for t in cfg.techniques() if "8-bit" not in t])
        out.append(f"--allow {name} {'may fit' if fits else 'does not help'}: in {family}, weights and optimizer "
                   f"state need {where}" + (" (the activations decide)" if fits else ""))
    if not ({"lora", "qlora"} & s.allowed or s.adapted):
        out.append("--allow lora or qlora: only adapters train, their gradients and optimizer state a small share "
                   "of the model's")
    return out


def _probe_families(workload: Workload, bases: list[Config], dev: Device, depth: int | None, doing: str) -> list:
    """Each base's family as ("ok", family) or ("error", exception): the whole model's probe pair, or for a
    deep model (`depth`) the pairs of its two shallow copies. `doing`: the stage's words for progress."""
    if not bases:
        return []
    if not depth:
        stage = _Stage(f"{doing} {len(bases)} families", len(bases))
        return [(kind, _Family(base, *value) if kind == "ok" else value)
                for base, (kind, value) in zip(bases, run_cached_many(
                    [functools.partial(probe_pair, workload, b, dev) for b in bases], on_done=stage.done))]
    keep = depths(bases[0].gpus)
    copies = [shallow(workload, k) for k in keep]
    stage = _Stage(f"{doing} {len(bases)} families as copies of {keep[0]} and {keep[1]} blocks", 2 * len(bases))
    traced = run_cached_many([functools.partial(probe_pair, c, b, dev) for b in bases for c in copies],
                             on_done=stage.done)
    out = []
    for i, base in enumerate(bases):
        (k1, v1), (k2, v2) = traced[2 * i], traced[2 * i + 1]
        out.append(("ok", _DeepFamily(_Family(base, *v1), _Family(base, *v2), depth)) if k1 == k2 == "ok"
                   else (k1, v1) if k1 != "ok" else (k2, v2))
    return out


def _state_floors(workload: Workload, states: list[Config], dev: Device) -> list[tuple]:
    """state_parts's, with the optimizer step's ops of the states a sibling family has (_siblings, on one GPU;
    else None)."""
    out = []
    for s in states:
        sibling = (s.optimizer_8bit or s.paged_optimizer or s.offload_optimizer) and s.gpus == 1
        parts = state_parts(workload, s.replace(activation_checkpoint="none", offload_activations=False), dev,
                            optimizer_ops=sibling)
        out.append(parts if sibling else (*parts, None))
    return out


def _layouts(dev: Device, gpus: int, layout: str | None, per_node: int | None, global_batch: int,
             micro_batch: int | None) -> list[str]:
    """The layouts to search for `gpus` ranks (one fixed, or every one that applies)."""
    if gpus == 1:  # a layout named for a range of counts (--gpus 1-64 --data-parallel fsdp): one GPU is unsharded
        return ["none"]
    if dev.kind == "cpu":
        raise ConfigError("planning across ranks needs a GPU from the catalogue (--device h100, ...): the step "
                          "time of gloo's collectives on CPUs is not modelled")
    if global_batch % gpus or (micro_batch and (global_batch // gpus) % micro_batch):
        raise ConfigError(f"global batch {global_batch} does not split into {gpus} ranks"
                          + (f" x micro-batch {micro_batch}" if micro_batch else ""))
    check_node(dev, per_node)
    if layout is not None:
        return [layout]
    node = per_node or 8
    return ["ddp", "fsdp", "fsdp-no-reshard"] + (["hsdp"] if gpus > node and gpus % node == 0 else [])


def full_probe(workload: Workload, config: Config, dev: Device) -> Probe:
    """A full estimate with its ops (a long accumulation traced as two micro-steps: `traced_steps`). A deep
    model (DEEP blocks or more) on one rank is counted from three shallow copies in forked children where that
    checks out (memory/extrapolate.py: the same bytes), else traced whole in this process."""
    counted = probe_blocks(workload, config, dev, least_blocks=DEEP)
    return (probe(workload, config, dev, isolate=False) if counted is None else
            Probe(counted.estimate, counted.ops, counted=(counted.copies, counted.steps)))


def _seconds(profile: Profile, p: Probe, config: Config, dev: Device) -> float:
    """Step time of a full probe: its traced micro-steps stand for all `config.grad_accum` of them; a counted
    one's is the first copy's and its periods' more (one rank: no collectives to overlap)."""
    accum, comm = config.grad_accum, comm_for(dev, config)
    if p.counted is None:
        return step_seconds(profile, p.ops, accum, comm)
    copies, steps = p.counted
    first, second = (step_seconds(profile, ops, accum, comm) for ops in copies)
    return first + (second - first) * steps


def price(workload: Workload, config: Config, device: str | Device = "cpu",
          profile: Profile | None = None, timed: bool = True) -> tuple[Estimate, float | None]:
    """The plan's own pricing of one configuration, as it confirms a candidate: its full estimate and its
    predicted step seconds (`profile`, else the device's calibration; None without `timed`, which then
    never starts a calibration). Traces in a forked child.

    Example::

        est, seconds = price(workload, Config(micro_batch=4, grad_accum=8), "cpu")
    """
    dev = device if isinstance(device, Device) else get_device(device)
    p = run_isolated(functools.partial(full_probe, workload, config, dev))
    return p.estimate, _seconds(profile or profile_for(dev), p, config, dev) if timed else None


def refusals(workload: Workload, configs: list[Config], device: str | Device = "cpu") -> list[str | None]:
    """For each configuration, why its strategies cannot run on this model, in words, or None when they
    can: the planner's fake probe of it (micro-batches 1 and 2, or 2 and 4), traced in forked children.
    OOM recovery asks this before it moves a running job to a checkpointing it has not run. A model the
    fake trace cannot follow even without checkpointing cannot be judged this way, and is not refused."""
    dev = device if isinstance(device, Device) else get_device(device)
    small = [c.replace(micro_batch=1, grad_accum=1) for c in configs]
    results = run_isolated_many([functools.partial(probe_pair, workload, c, dev) for c in small])
    out = [None if kind == "ok" else f"cannot apply: {value}" if isinstance(value, ConfigError)
           else f"tracing it raised {first_line(value)}" for kind, value in results]
    raised = [i for i, (kind, value) in enumerate(results) if kind != "ok" and not isinstance(value, ConfigError)]
    if raised:
        plain = small[raised[0]].replace(activation_checkpoint="none")
        [(kind, _)] = run_isolated_many([functools.partial(probe_pair, workload, plain, dev)], workers=1)
        if kind != "ok":  # the model itself does not trace: no verdict on the strategies
            for i in raised:
                out[i] = None
    return out


def _every_k_shares(n: int) -> dict[int, float]:
    """{k: the share of a model's n blocks checkpointed when every k-th block is}, k = 2, 3, 4, a share once."""
    out: dict[int, float] = {}
    for k in (2, 3, 4):
        share = math.ceil(n / k) / n
        if k < n and share not in out.values():
            out[k] = share
    return out


def _every_k(none: _Family, full: _Family, global_batch, micro_batch, usable, cpu, rates):
    out = []
    for k, share in _every_k_shares(full.depth).items():
        for m in _micro_batches(global_batch, micro_batch, max(none.sizes[0], full.sizes[0])):
            accum = global_batch // m
            need = int(none.memory(m, accum, cpu) + share * (full.memory(m, accum, cpu) - none.memory(m, accum, cpu)))
            if need <= usable:
                t = none.seconds(rates(), m, accum)
                t += share * (full.seconds(rates(), m, accum) - t)
                out.append(Candidate(full.base.replace(activation_checkpoint=k, micro_batch=m, grad_accum=accum), need, t))
    return out


def _largest_predicted(fam: _Family, usable: int, cpu: bool, name: str) -> int:
    """The largest micro-batch the probes predict to fit (the smallest if none). Memory is the highest of
    the phases' lines, so it can stay flat while a phase that does not grow (the optimizer's) dominates:
    searched, not solved from one slope."""
    lo = fam.sizes[0]
    if fam.memory(lo, 1, cpu) > usable:
        return lo
    hi = 2 * lo
    while fam.memory(hi, 1, cpu) <= usable:
        lo, hi = hi, 2 * hi
        if hi > 1 << 50:
            raise PlanError(f"{name}'s memory does not grow with the micro-batch (does workload.batch(n) "
                            f"return n samples?): there is no largest micro-batch")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fam.memory(mid, 1, cpu) <= usable else (lo, mid)
    return lo


def max_micro_batch(workload: Workload, budget=None, device: str | Device = "cpu", *, precision: str | None = None,
                    micro_batch: int | None = None, activation_checkpoint=None, offload_activations: bool | None = None,
                    offload_optimizer: bool | None = None) -> dict:
    """The largest micro-batch that fits with everything else fixed: the straight line through two probes
    proposes it, full estimates confirm it and its successor. No upper bound: memory grows with every
    sample (the inputs at least), so the search ends."""
    dev = device if isinstance(device, Device) else get_device(device)
    budget_bytes = resolve_budget(budget, dev)
    usable = int(budget_bytes * (1 - MARGIN))
    base = Config(micro_batch=1, precision=precision or defaults_for(dev).precision,
                  activation_checkpoint=activation_checkpoint or "none", offload_activations=bool(offload_activations),
                  offload_optimizer=bool(offload_optimizer))
    fam = _Family(base, *run_isolated(functools.partial(probe_pair, workload, base, dev)))
    cpu = dev.kind == "cpu"
    smallest = fam.sizes[0]
    guess = _largest_predicted(fam, usable, cpu, workload.name)

    def fits(m: int) -> tuple[bool, int]:
        used = _used(estimate(workload, base.replace(micro_batch=m), device=dev))
        return used <= usable, used

    ok, used = fits(guess)
    if ok:  # gallop up until the first that does not fit
        lo, lo_used, hi = guess, used, None
        step = 1
        while hi is None:
            ok, u = fits(lo + step)
            if ok:
                lo, lo_used, step = lo + step, u, step * 2
            else:
                hi, hi_used = lo + step, u
    else:
        lo, lo_used, hi, hi_used = smallest - 1, None, guess, used
    # between the last that fits and the first that does not: where the line through the nearest full
    # estimates on each side (below, the probes' prediction until one is made) meets the budget, which
    # lands on the answer in a step or two as memory is nearly linear in the micro-batch; a step that
    # does not halve the interval is followed by a bisection, so the search cannot crawl
    bisect = False
    while hi - lo > 1:
        width = hi - lo
        below = (lo, lo_used) if lo_used is not None else (smallest, fam.memory(smallest, 1, cpu))
        slope = (hi_used - below[1]) / (hi - below[0]) if hi_used is not None and hi > below[0] else 0
        mid = (lo + hi) // 2 if bisect or slope <= 0 else below[0] + int((usable - below[1]) // slope)
        mid = min(max(mid, lo + 1), hi - 1)
        ok, u = fits(mid)
        lo, lo_used, hi, hi_used = (mid, u, hi, hi_used) if ok else (lo, lo_used, mid, u)
        bisect = not bisect and hi - lo > width / 2
    if lo < smallest:
        raise PlanError(f"even micro-batch {smallest} does not fit in {fmt_bytes(budget_bytes)} on {dev.name} "
                        f"with {_family_name(base)}: it needs {fmt_bytes(fits(smallest)[1])}")
    notes = [f"{workload.name} cannot train at micro-batch 1 ({fam.rejected})"] if fam.rejected else []
    return dict(config=base.replace(micro_batch=lo).to_dict(), micro_batch=lo, peak_bytes=lo_used,
                budget_bytes=budget_bytes, usable_bytes=usable, device=dev.name, linear_guess=guess, notes=notes)
