"""`estimate`: the peak memory of one steady-state training step, traced on fake tensors.

How: build the model and optimizer under `FakeTensorMode` (no data, no real memory), run one step so the
optimizer state exists, then run the measured step with a `LiveBytes` counter and an `OpRecorder` active.
Everything live at the peak is labelled (parameters, gradients, optimizer state, inputs, activations saved
for backward, temporaries). For a GPU target the same trace is replayed through the CUDA caching-allocator
model. Where fake tensors cannot follow the model (data-dependent shapes, `.item()`), real CPU steps at small
micro-batches are measured and extrapolated, and the estimate says so.

`estimate` returns the user's result; the planner reads `Probe`s (`probe`, `probe_pair`), which add the
step's op trace.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import re
from pathlib import Path

import torch

from memfit.config import Config
from memfit.errors import (ConfigError, EstimateError, HostMemoryError, MemfitError, MicroBatchError, WorkloadError,
                           first_line)
from memfit.memory import allocator, streams
from memfit.memory.devices import Device, check_node, defaults_for, get_device, nccl_bytes, nccl_communicators
from memfit.memory.fake import FakeBuild, FakeTensor, LayerDropDraws, new_fake_mode, quiet_fake_errors, trace_optimizer
from memfit.memory.isolate import available_host_bytes, heap_frozen, host_memory_guard, run_isolated, value_branches
from memfit.memory.kernels import CpuWorkspaces, CudnnWorkspaces, rank_threads
from memfit.memory.routing import Routing, add_routing
from memfit.memory.tracker import (CATEGORIES, MODEL_STATE, Category, LiveBytes, ModuleScope, OpRecorder,
                                   OpTrace, Phase, PlainPaths, machinery, seeing_saved)
from memfit.step import TrainStep
from memfit.strategies import check_precision
from memfit.strategies.activation_checkpoint import find_blocks
from memfit.strategies.base_4bit import weight_count
from memfit.strategies.cuda_kernels import fused_elsewhere
from memfit.strategies.offload import host_side
from memfit.strategies.optimizer_8bit import chunks_traced_once, state_made_only
from memfit.torch_internals import (compiled_modules, fake_process_group, grad_scaler_tensors, held_by,
                                    stand_ins_for_rng_state_copies, storage_key)
from memfit.units import fmt_bytes
from memfit.workload import Workload, map_tensors, move_batch, tensors_of

__all__ = ["CATEGORIES", "Category", "Estimate", "EstimateError", "MicroBatchError", "MicroBatchLine", "Phase",
           "Probe", "estimate", "first_line", "probe", "probe_pair", "state_bytes", "state_parts", "state_split"]

# The planner's probes: micro-batches 1 and 2, or 2 and 4 for a model that rejects 1 (two samples always
# give batch statistics more than one value per channel).
PROBES = (1, 2)
PROBES_WITHOUT_1 = (2, 4)
TOP_TENSORS = 200   # the largest tensors live at the peak an estimate lists (with shape, module, source line)
MODULES = 20        # the modules with the most activations and temporaries at the peak an estimate lists
MODULE_GROUPS = 8   # blocks whose activations the timeline keeps apart
KEEP_STREAMS = False  # set by memory/extrapolate.py in its tracing child: probes keep their allocation stream


@dataclasses.dataclass
class Estimate:
    workload: str
    config: dict
    device: str
    method: str                 # "fake" (traced) | "measured" | "extrapolated" (real CPU steps, fallback)
    peak_bytes: int             # peak of live tensor bytes on the device during one step, inputs included
    breakdown: dict             # Category -> bytes live at the peak
    model_state_bytes: dict     # Category -> bytes at rest after the step (parameters, gradients, optimizer_state)
    peak_phase: Phase           # forward | backward | optimizer
    modules: list               # [(module, bytes)] activations + temporaries live at the peak, by creator
    top_tensors: list           # [dict] the largest storages live at the peak (TOP_TENSORS), with their source line
    timeline: dict              # {"index": [...], "phase": [...], category: [...]}: bytes by category over the step
    flops: int                  # FLOPs of the step (FlopCounterMode's formulas): forward + backward + recompute
    recompute_flops: int        # of which forward ops re-run in backward by activation checkpointing
    module_flops: dict          # innermost module (or "(phase)") -> FLOPs
    parameters: int             # parameter count (tied weights once)
    notes: list                 # assumptions and fallbacks, in words
    device_total_bytes: int | None = None
    peak_allocated_bytes: int | None = None   # CUDA: predicted torch.cuda.max_memory_allocated()
    peak_reserved_bytes: int | None = None    # CUDA: predicted torch.cuda.max_memory_reserved()
    device_peak_bytes: int | None = None      # CUDA: what nvidia-smi would show (reserved + context + NCCL)
    nccl_bytes: int | None = None             # CUDA across ranks: NCCL's communicators, outside the allocator
    host_peak_bytes: int | None = None        # GPU targets: peak host memory used by offloading
    moved_bytes: int = 0                      # bytes copied host <-> device by offloading in one step
    phase_peaks: dict = dataclasses.field(default_factory=dict)  # Phase -> highest live bytes in it
    blocks: list = dataclasses.field(default_factory=list)       # the model's repeated blocks (checkpointing units)
    routing: dict | None = None  # MoE: the routing assumption and the bound (memory/routing.py)
    # activations by the block that made them ({group: [...]}, at the timeline's points; module_group())
    module_timeline: dict = dataclasses.field(default_factory=dict)
    extrapolated_from: tuple | None = None  # (blocks traced, the model's blocks): counted from copies (extrapolate.py)
    stages: list | None = None  # a pipeline: each rank's stages, peak, parameters, breakdown (the figures: the highest)

    @property
    def headroom_bytes(self) -> int | None:
        used = self.device_peak_bytes if self.device_peak_bytes is not None else self.peak_bytes
        return None if self.device_total_bytes is None else self.device_total_bytes - used

    def to_dict(self) -> dict:
        """Plain data for JSON."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["headroom_bytes"] = self.headroom_bytes
        return d


@dataclasses.dataclass
class Probe:
    """One traced step as the planner reads it: the memory figures and the ops the step-time model prices."""
    estimate: Estimate
    ops: OpTrace
    stage_ops: list | None = None  # a pipeline: every stage's ops, stage 0 first (`ops` is the highest peak's)
    handoff_bytes: int = 0         # a pipeline: the hidden state a stage sends on for one micro-batch
    stream: list | None = None     # with KEEP_STREAMS: the allocation stream (streams.tokens), for extrapolate.py
    counted: tuple | None = None   # counted from copies (extrapolate.Counted): the first two's ops, the periods
                                   # added (`ops` is then the deepest copy's)

    @property
    def micro_batch(self) -> int:
        return self.estimate.config["micro_batch"]


class MicroBatchLine:
    """Memory and work of a step are linear in the micro-batch: every activation, input and op grows with
    the samples, while weights, gradients and optimizer state do not. Two steps at micro-batches m1 < m2
    therefore predict any other; this is the one place that straight line is drawn."""

    def __init__(self, m1: int, m2: int):
        self.m1, self.m2 = m1, m2

    def at(self, a, b, m: int):
        """The value at micro-batch m of a quantity that is `a` at m1 and `b` at m2 (numbers or tensors)."""
        return a + (b - a) * (m - self.m1) / (self.m2 - self.m1)

    def per_sample(self, a, b):
        return (b - a) / (self.m2 - self.m1)


def estimate(workload: Workload, config: Config | None = None, device: str | Device = "cpu",
             isolate: bool = True, **config_fields) -> Estimate:
    """Peak memory of one steady-state `TrainStep` call for `config` on `device`.

    Args:
        workload: the model, batches, loss and optimizer (`memfit.Workload`).
        config: micro-batch, accumulation, precision, activation checkpointing, offload. Without one, the
            defaults of `Config` in the device's default precision (`devices.defaults_for`).
        device: a catalogue name ("h100", "cpu", ...) or a `Device`.
        isolate: trace in a forked child so that a C++ abort inside PyTorch becomes an EstimateError.
        config_fields: changes to `config` (e.g. ``micro_batch=8``).

    Example::

        est = memfit.estimate(workload, Config(micro_batch=8, precision="bf16"), device="a100")
        print(est.peak_bytes, est.breakdown["activations"])
    """
    return probe(workload, config, device, isolate, **config_fields).estimate


def probe(workload: Workload, config: Config | None = None, device: str | Device = "cpu", isolate: bool = True,
          **config_fields) -> Probe:
    """`estimate`, with the step's op trace: what the planner prices a configuration from."""
    dev = device if isinstance(device, Device) else get_device(device)
    if config is None and "precision" not in config_fields:
        config_fields["precision"] = defaults_for(dev).precision
    config = config or Config()
    if config_fields:
        config = config.replace(**config_fields)
    check_precision(config, dev.name, dev.bf16)
    check_node(dev, config.gpus_per_node)
    traced = traced_steps(config)
    if traced != config:
        p = probe(workload, traced, dev, isolate)
        p.estimate = accumulated(p.estimate, config, dev, *micro_step(p.ops))
        return p
    run = run_isolated if isolate and hasattr(os, "fork") else (lambda fn: fn())
    try:
        return run(lambda: _on_fake(workload, config, dev))
    except (WorkloadError, ConfigError):
        raise
    except Exception as fake_error:  # data-dependent shapes, `.item()`, an op fake tensors lack, a crash
        reason = first_line(fake_error)
        partial = getattr(fake_error, "memfit_partial", None)
        own = getattr(fake_error, "memfit_workload_raised", False)
    if config.world > 1 and not own:
        raise EstimateError(f"{workload.name}: fake tensors could not follow the per-rank step ({reason}); across "
                            "ranks memfit traces on fake tensors only")
    try:
        if own:  # a real step would raise it too: none is run (for a large model, none could be)
            raise WorkloadError(f"the workload's training step raised: {reason}")
        return run(lambda: _fallback(workload, config, dev, reason, partial))
    except WorkloadError:  # the real step failed too: at micro-batch 1, say whether 2 would train
        if config.micro_batch != 1 or not _traces_at(run, workload, config, dev, PROBES_WITHOUT_1[0]):
            raise
        raise MicroBatchError(workload.name, 1, PROBES_WITHOUT_1[0], reason) from None


def traced_steps(config: Config) -> Config:
    """What is traced of `config`: an accumulation's first two micro-steps, as from the second on every
    micro-step makes the same allocations and frees (its gradients added into those kept), so the rest add
    no new peak; a pipeline's every micro-batch (its schedule interleaves them)."""
    return config.replace(grad_accum=2) if config.grad_accum > 2 and config.pp == 1 else config


def micro_step(ops: OpTrace) -> tuple[int, int]:
    """FLOPs and bytes moved by a two-micro-step trace's second micro-step, which every later one repeats."""
    (begin, moved), (end, moved_end) = ops.micro_steps[1], ops.optimizer_at
    return sum(f for f, k in zip(ops.flops[begin:end], ops.kind[begin:end]) if k != "rng"), moved_end - moved


def accumulated(est: Estimate, config: Config, dev: Device, flops: int, moved: int) -> Estimate:
    """`est`, traced as two micro-steps (`traced_steps`), as the step of `config.grad_accum` of them: each
    later one adds the second's work (`flops`, bytes `moved`: `micro_step`), and on a CPU its micro-batch's
    inputs, which the whole step holds (the global batch is handed over at once; a GPU copies each in)."""
    more = config.grad_accum - 2
    est.flops += more * flops
    est.moved_bytes += more * moved
    est.recompute_flops = est.recompute_flops // 2 * config.grad_accum
    est.module_flops = {k: v if k in ("(setup)", "(optimizer)") else v // 2 * config.grad_accum
                        for k, v in est.module_flops.items()}
    if dev.kind == "cpu":
        extra = est.breakdown[Category.INPUTS] // 2 * more
        est.peak_bytes += extra
        est.breakdown[Category.INPUTS] += extra
        est.phase_peaks = {p: v + extra for p, v in est.phase_peaks.items()}
        est.timeline[Category.INPUTS] = [v + extra for v in est.timeline[Category.INPUTS]]
        est.top_tensors = sorted((_whole_batch(t, config.grad_accum) for t in est.top_tensors),
                                 key=lambda t: t["bytes"], reverse=True)
    est.config = config.to_dict()
    est.notes.append(f"accumulation over {config.grad_accum} micro-steps traced as 2; later micro-steps repeat "
                     "the second")
    return est


def _whole_batch(tensor: dict, micro_steps: int) -> dict:
    """A top tensor of a CPU step traced as two micro-steps, as the step of `micro_steps` holds it: an input
    is the whole batch, two micro-batches of rows traced."""
    if tensor["category"] != Category.INPUTS:
        return tensor
    rows = tensor["shape"][0] // 2 * micro_steps
    return dict(tensor, bytes=tensor["bytes"] // 2 * micro_steps, shape=[rows, *tensor["shape"][1:]])


def _traces_at(run, workload: Workload, config: Config, dev: Device, micro_batch: int) -> bool:
    try:
        run(lambda: _trace(workload, config.replace(micro_batch=micro_batch, grad_accum=1), dev, True))
        return True
    except Exception:  # noqa: BLE001 - any failure means no
        return False


def probe_pair(workload: Workload, config: Config, dev: Device) -> tuple[list[Probe], str | None]:
    """The planner's two probes (one build, primed state, a step at each of PROBES); for a model that cannot
    train at micro-batch 1, a fresh build probed at PROBES_WITHOUT_1, with the reason 1 failed (else None).
    A failure at both is reported as the first one. Runs in this process (the planner forks)."""
    try:
        return _traces(workload, config, dev, True, list(PROBES)), None
    except (WorkloadError, ConfigError, EstimateError):
        raise
    except Exception as first:
        try:
            return _traces(workload, config, dev, True, list(PROBES_WITHOUT_1)), first_line(first)
        except Exception:  # noqa: BLE001 - the first failure is the one to report
            raise first from None


def state_bytes(workload: Workload, config: Config, device: str | Device = "cpu") -> int:
    """What a step keeps on the device between steps (parameters, buffers, gradients, optimizer state; the
    CUDA context and cuBLAS workspace on a GPU), from an optimizer primed on fake tensors without a
    forward or backward pass: a floor that no micro-batch or checkpointing goes under, in seconds even for
    a 7B model. The planner skips families whose floor is already over the budget."""
    return state_split(workload, config, device)[0]


def state_split(workload: Workload, config: Config, device: str | Device = "cpu") -> tuple[int, int]:
    """(`state_bytes`, what optimizer offload keeps on the host between steps: fp32 master weights,
    gradient copies, optimizer state). The planner skips families whose host part is over --host-memory."""
    return state_parts(workload, config, device)[:2]


def state_parts(workload: Workload, config: Config, device: str | Device = "cpu",
                optimizer_ops: bool = False) -> tuple:
    """`state_split`'s two figures and the gradients' share of the first: what the same family keeps with the
    optimizer step in backward, which holds no gradient buffer, is the first less the third. With
    `optimizer_ops`, a fourth: the ops of one optimizer step over every trainable parameter (an OpTrace; None
    where that step raises), the same ops a probe's optimizer phase records, at no forward or backward's cost
    (the planner's bound on a family that differs from one traced only in its optimizer)."""
    dev = device if isinstance(device, Device) else get_device(device)
    world = fake_process_group(config.world) if config.world > 1 else contextlib.nullcontext()
    with world, new_fake_mode() as mode, quiet_fake_errors():
        with FakeBuild(mode):
            step = TrainStep(workload, config, "cpu")
        trace_optimizer(step.optimizer)
        with state_made_only():
            step.prime()
        host = {storage_key(t): t.untyped_storage().nbytes() for t in step.host_tensors()}
        storages = {storage_key(t): t.untyped_storage().nbytes() for s in step.state_tensors() for t in held_by(s)}
        grads = {storage_key(t) for p in step.model.parameters() if p.grad is not None for t in held_by(p.grad)}
        if optimizer_ops:
            try:
                ops = _optimizer_ops(step, dev.kind == "cuda")
            except Exception:  # noqa: BLE001 - an optimizer fake tensors cannot step: its probes say why
                ops = None
    on_device = {address: n for address, n in storages.items() if address not in host}
    parts = (sum(on_device.values()) + outside_tensors(dev, config), sum(host.values()),
             sum(n for address, n in on_device.items() if address in grads))
    return (*parts, ops) if optimizer_ops else parts


def _optimizer_ops(step: TrainStep, cuda_target: bool):
    """The ops of `step`'s optimizer step on the gradients prime left (zeros, every trainable parameter's),
    with the foreach kernels a probe of a GPU step uses, and the adds a later micro-step makes into the
    gradients kept (`OpTrace.accumulate`, as a probe has them)."""
    if cuda_target:
        _use_foreach(step.optimizer)
    recorder = OpRecorder()
    recorder.mark("optimizer")
    step.tracing = True  # no host sync of a loss scale (prime's own rule)
    with recorder, chunks_traced_once(recorder):
        step.optimizer_step()
    if step.config.world == 1 and step.pipeline is None:
        recorder.trace.accumulate = _accumulate_rows(step)
    return recorder.trace


def _accumulate_rows(step: TrainStep) -> list[tuple[int, str]]:
    """(bytes, kind) of the add_ of each gradient kept into which a later micro-step adds its own."""
    return [(3 * g.numel() * g.element_size(), "host" if step.optimizer_offload is not None else
             "lp" if g.dtype in (torch.bfloat16, torch.float16) else "f32") for g in step.kept_gradients()]


def outside_tensors(dev: Device, config: Config) -> int:
    """What a state floor counts on a GPU besides live tensors: the CUDA context, cuBLAS's workspace and
    NCCL's communicators (none on a CPU)."""
    if dev.kind != "cuda":
        return 0
    nccl = nccl_bytes(dev, config.gpus, config.data_parallel, config.gpus_per_node, config.tp, config.pp) or 0
    return dev.context_bytes + dev.cublas_workspace_bytes + nccl


# ------------------------------------------------------------------------------------------- the trace

def _on_fake(workload: Workload, config: Config, dev: Device) -> Probe:
    """`_trace` on fake tensors; an error it raises says whether the workload raised it (`_raised_by_workload`)."""
    try:
        return _trace(workload, config, dev, fake=True)
    except Exception as e:
        e.memfit_workload_raised = _raised_by_workload(e)
        raise


# Errors fake tensors do not cause, when raised by a `raise` in the workload's own code (its model, loss or
# batch: not `tracker.machinery`; a check it asks torch to make, `torch._check_with(ValueError, ...)`, is its
# own too), or by torch's argument parser before any kernel runs: a real step raises them too. Fake tensors'
# own failures (data-dependent values, missing meta kernels) are RuntimeErrors or NotImplementedErrors, and
# torch's checks inside kernels (ValueError, IndexError too) raise in torch's code. Except sizes that do not
# fit together (a view, a matmul, a broadcast, a split): fake tensors carry exact shapes, so a real step
# fails the same check (a default config whose patch grid does not divide by its pixel shuffle).
_WORKLOAD_ERRORS = (TypeError, ValueError, KeyError, AttributeError, IndexError, AssertionError, NameError,
                    ZeroDivisionError)
_ARGUMENT_PARSER = re.compile(r"^[\w.]+\(\)(: argument '\w+'| received an invalid combination of arguments)")
_SHAPE_MISMATCH = re.compile(r"^(shape '\[[-\d, ]*\]' is invalid for input of size \d+|mat1 and mat2 shapes cannot be "
                             r"multiplied|The size of tensor a \(\d+\) must match the size of tensor b \(\d+\)|"
                             r"split_with_sizes expects split_sizes to sum exactly to \d+)")


def _raised_by_workload(e: BaseException) -> bool:
    if type(e) is RuntimeError and _SHAPE_MISMATCH.match(str(e)):
        return True
    if not isinstance(e, _WORKLOAD_ERRORS) or isinstance(e, MemfitError):
        return False
    if isinstance(e, TypeError) and _ARGUMENT_PARSER.match(str(e)):
        return True
    frames = []
    tb = e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    while frames and _torch_check(frames[-1]):  # `torch._check_with(ValueError, ...)`: the caller's own check
        frames.pop()
    return bool(frames) and not machinery(frames[-1].co_filename)


def _torch_check(code) -> bool:
    """A frame of torch's `_check*` helpers, which raise the error type their caller asks for."""
    return code.co_name.startswith("_check") and Path(code.co_filename).parent.name == "torch" \
        and Path(code.co_filename).name == "__init__.py"


def _trace(workload: Workload, config: Config, dev: Device, fake: bool) -> Probe:
    return _traces(workload, config, dev, fake, [config.rank_batch], routing_bound=fake)[0]


def _traces(workload: Workload, config: Config, dev: Device, fake: bool, sizes: list[int],
            routing_bound: bool = False) -> list[Probe]:
    """Per rank: across many GPUs, this process traces rank 0 of a fake world of config.world ranks (every
    tensor-parallel rank holds and does the same amount)."""
    if config.world == 1:
        return _rank_traces(workload, config, dev, fake, sizes, routing_bound)
    if not fake:
        raise EstimateError(f"{workload.name}: a step across ranks is traced on fake tensors only")
    if config.pp > 1:
        return _stage_traces(workload, config, dev, sizes, routing_bound)
    with fake_process_group(config.world):
        return _rank_traces(workload, config, dev, fake, sizes, routing_bound)


def _stage_traces(workload: Workload, config: Config, dev: Device, sizes: list[int],
                  routing_bound: bool) -> list[Probe]:
    """A pipeline's ranks hold different parts and different numbers of micro-batches in flight: each is
    traced as its own rank of a fake world, all its stages together under the schedule (the interleaved
    schedules give a rank several), and the rank with the highest peak is the estimate (the one a budget must
    hold), every rank's figures in `stages`."""
    by_rank = []
    # each pipeline rank's first rank of its stage: the mesh is (pp, data parallel, tp), the pipeline outermost
    for rank in range(config.pp):
        with fake_process_group(config.world, rank=rank * config.gpus * config.tp):
            by_rank.append(_rank_traces(workload, config, dev, True, sizes, routing_bound))
    out = []
    for probes in zip(*by_rank):
        worst = max(probes, key=_peak_of)
        worst.estimate.stages = [_stage_figures(r, config, p.estimate) for r, p in enumerate(probes)]
        worst.stage_ops = [p.ops for p in probes]
        what = (f"{config.pp} stages" if config.pp_virtual == 1 else
                f"{config.stages} stages over {config.pp} ranks, {config.pp_virtual} a rank")
        unit = "stage" if config.pp_virtual == 1 else "rank"
        worst.estimate.notes.append(f"pipeline of {what} ({config.pp_schedule}): the figures are {unit} "
                                    f"{probes.index(worst)}'s, the highest peak; every {unit}'s in `stages`")
        out.append(worst)
    return out


def _stage_figures(rank: int, config: Config, e: "Estimate") -> dict:
    """One pipeline rank's figures: `stage` is its coordinate on the pipeline axis, `holds` the stages it
    runs (the looped placement: rank, rank + pp, ...)."""
    return {"stage": rank, "holds": [rank + k * config.pp for k in range(config.pp_virtual)],
            "peak_bytes": e.peak_bytes, "device_peak_bytes": e.device_peak_bytes,
            "peak_reserved_bytes": e.peak_reserved_bytes, "parameters": e.parameters, "peak_phase": e.peak_phase,
            "breakdown": dict(e.breakdown)}


def _rank_traces(workload: Workload, config: Config, dev: Device, fake: bool, sizes: list[int],
                 routing_bound: bool = False) -> list[Probe]:
    """Build once, prime the optimizer state, then measure one step per global batch size in `sizes`
    (a size other than config.rank_batch runs as one micro-batch of that size: the planner's probes).
    On fake tensors, shapes that depend on an MoE router's choices follow balanced routing; with
    `routing_bound`, such a step is traced again under each of the bound's routings (memory/routing.py)."""
    cuda_target = dev.kind == "cuda"
    notes: list[str] = []
    # A GPU target is traced on (fake) CPU; model what differs: the micro-batch is copied host -> device,
    # and optimizers default to their foreach kernels on CUDA (one temporary per parameter at once).
    move = _copy_to_device if cuda_target else move_batch
    mode = new_fake_mode() if fake else None
    router = Routing() if fake else None  # just above the fake mode, below the counters
    draws = LayerDropDraws() if fake else None
    results = []
    with _heap_set_aside(fake), mode or contextlib.nullcontext(), router or contextlib.nullcontext(), \
            draws or contextlib.nullcontext(), quiet_fake_errors(), \
            stand_ins_for_rng_state_copies(_host_bytes) if fake else contextlib.nullcontext():
        with FakeBuild(mode) if fake else contextlib.nullcontext(), \
                router.building() if router is not None else contextlib.nullcontext():
            step = TrainStep(workload, config.replace(micro_batch=max(config.micro_batch, *sizes))
                             if sizes != [config.rank_batch] else config, "cpu", move=move, cuda_target=cuda_target)
        if router is not None:
            router.keep_built_values(step.model)
        step.tracing = fake
        scalars = trace_optimizer(step.optimizer) if fake else None
        notes += _step_notes(workload, step, config, cuda_target)
        with state_made_only() if fake else contextlib.nullcontext(), \
                router.priming() if router is not None else contextlib.nullcontext():
            step.prime()
        # on fake tensors a later size starts from the buffers as built, whose values are known: I-BERT
        # reassigns its running minimum from activations every forward, so after one step they are not. Held
        # here, a buffer the step replaces could not be freed: the last size lets go of them (a size between
        # counts the replaced ones, a few bytes of statistics)
        built = [(m, name, b) for m in step.model.modules() for name, b in m.named_buffers(recurse=False)] \
            if fake and len(sizes) > 1 else []

        def draw(size):  # on fake tensors, the batch is drawn for real beside them where it is small
            with router.drawing() if router is not None else contextlib.nullcontext():
                return workload.batch(size)

        for i, size in enumerate(sizes):
            if i:
                _restore_buffers(built)
            if i == len(sizes) - 1:
                built.clear()
            p = _measure(workload, step, dev, mode, draw(size), list(notes))
            if i == 0 and step.pipeline is not None:  # the first step made the engine's buffers
                p = _measure(workload, step, dev, mode, draw(size), list(notes))
            if step.pipeline is not None:
                p.handoff_bytes = step.pipeline.handoff_bytes
            if i == 0 and step.ungraded:  # traced again in the steady state a real run reaches
                notes.append(_drop_ungraded_state(step))
                p = _measure(workload, step, dev, mode, draw(size), list(notes))
            elif i == 0 and any(w.grad is not None and w.grad.layout is not torch.strided
                                for w in step.model.parameters()):
                # prime left sparse gradients holding nothing; the step before a steady one leaves its own
                p = _measure(workload, step, dev, mode, draw(size), list(notes))
            p.estimate.method = "fake" if fake else "measured"
            if router is not None:
                add_routing(p.estimate, router, (lambda: _measure(workload, step, dev, mode, draw(size),
                                                                  []).estimate) if routing_bound else None)
            p.estimate.notes += _fake_notes(router, scalars, draws)
            if sizes != [config.rank_batch]:
                p.estimate.config = config.replace(micro_batch=size, grad_accum=1).to_dict()
            results.append(p)
    return results


def _step_notes(workload: Workload, step: TrainStep, config: Config, cuda_target: bool) -> list[str]:
    """What a trace of this step assumes or models, said in its notes before any step runs."""
    notes: list[str] = []
    if workload.max_grad_norm is not None:
        notes.append(f"gradients clipped to a total norm of {workload.max_grad_norm:g} before each optimizer step")
    if cuda_target and _use_foreach(step.optimizer):
        notes.append("optimizer uses its foreach kernels, PyTorch's default on CUDA")
    if cuda_target and config.precision in ("fp16", "bf16") and not config.fsdp:
        notes.append("mixed precision traced with CUDA autocast's op policy")
    if config.gpus > 1:
        how = ("DDP: whole model, gradients in DDP's all-reduced buckets (gradient_as_bucket_view), "
               "modelled as DDP's reducer fills them" if config.data_parallel == "ddp" else
               f"{config.data_parallel}, FSDP2 fully_shard of each repeated block and the root")
        of = f"{config.gpus} data-parallel groups of {config.tp} TP ranks" if config.tp > 1 else config.gpus
        notes.append(f"per rank: rank 0 of {of} ({how}), traced with a fake process group" +
                     ("; bf16 is FSDP2's MixedPrecisionPolicy (bf16 compute, fp32 shards and reduction)"
                      if config.precision == "bf16" and config.fsdp else ""))
        if cuda_target and config.fsdp:
            notes.append("not modelled yet: the separate streams FSDP2 gathers and reduces on (the caching "
                         "allocator is modelled as one stream's)")
        else:
            notes.append("not counted: what gloo allocates on its own threads (an all-gather's output-sized "
                         "buffer while it runs; after an all-reduce, at times a bucket-sized one held to the "
                         "next)")
            notes.append(f"each rank runs {rank_threads()} intra-op thread(s) (OMP_NUM_THREADS, as `memfit train "
                         "--gpus` starts them): kernel workspaces measured at that count")
    if config.tp > 1:
        notes.append(f"per rank: rank 0 of {config.world}, tensor parallel over {config.tp} (DTensor: q/k/v and MLP "
                     "gate/up split by output, attention and MLP outputs by input and reduce-scattered; norms "
                     "sequence-parallel; whole logits on every rank), traced with a fake process group")
        if not cuda_target:
            notes.append("not counted: what gloo allocates on its own threads while a collective runs")
    if config.pp > 1 and config.pp_schedule == "zero-bubble" and config.activation_checkpoint != "none":
        # counted on real gloo ranks: gpt-tiny's checkpointed blocks ran 44 forwards a step for 4 micro-batches
        notes.append("zero bubble with activation checkpointing: torch's weight-gradient pass runs one autograd "
                     "pass per parameter group, and each recomputes the checkpointed block and keeps what it "
                     "recomputed until the block's weight pass ends (traced as it runs: often more than without "
                     "checkpointing)")
    if cuda_target:
        notes.append("attention traced with the CPU flash kernel; it saves what CUDA flash / memory-efficient "
                     "attention save (output + fp32 logsumexp), with dropout too, which they apply inside "
                     "(assumed: sm80+ kernel choice, no cuDNN attention, no logsumexp or head padding); "
                     "dropout keeps a 1-byte mask, as CUDA's fused dropout does")
        fused = fused_elsewhere(step.model)
        if fused:
            notes.append(f"traced transformers' reference PyTorch path for {' and '.join(fused)}: what a GPU runs "
                         "without those packages; with them installed it runs their fused kernels instead, "
                         "whose memory is not modelled")
    compiled = compiled_modules(step.model)
    if compiled:
        named = ", ".join(name or "the model" for name in compiled[:3]) + (", ..." if len(compiled) > 3 else "")
        notes.append(f"torch.compile'd ({named}): traced as eager PyTorch runs it; inductor's compiled step "
                     "keeps fewer tensors for backward (it recomputes cheap pointwise ops) and fuses "
                     "temporaries away, so it may need less (a pointwise-heavy MLP on the CPU: half)")
    if not cuda_target and (config.offload_activations or config.offload_optimizer):
        notes.append("on a CPU device host and device memory are one: offloading only adds copies")
    return notes


def _fake_notes(router, scalars, draws) -> list[str]:
    """What fake tensors answered in a traced step for values they lack, said in its notes."""
    notes: list[str] = []
    if router is not None and router.ctc_targets:
        notes.append(f"CTC loss sized by the traced batch's longest target ({max(router.ctc_targets)} labels): a "
                     "batch with longer targets holds more (log-alpha kept for backward, log-beta during it)")
    if router is not None and router.assumed_finite:
        notes.append("the model checks its values for NaN/inf, which fake tensors lack: answered as all finite, the "
                     "values of a step that trains")
    if router is not None and router.assumed_valid:
        notes.append("torch.distributions checks its arguments' values, which fake tensors lack: answered as valid, "
                     "as in a step that trains")
    if scalars is not None and scalars.answered:
        notes.append("the optimizer reads values of its tensors (.item()), which fake tensors lack: traced with 1 in "
                     "their place (in torch.optim they only scale the update; ASGD's averaging weight is 1 until "
                     "step t0)")
    if draws is not None and draws.answered:
        notes.append("single random numbers drawn in the step (LayerDrop: a layer is skipped when its draw is below "
                     "layerdrop) traced as just below 1: no layer skipped, the step's largest memory; a real step "
                     "skips some and holds less")
    return notes

def _restore_buffers(built: list) -> None:
    for module, name, buffer in built:
        setattr(module, name, buffer)


def _drop_ungraded_state(step: TrainStep) -> str:
    """`prime` gave every trainable parameter optimizer state, but torch.optim makes none for a parameter
    whose gradient is None, and the traced step gave some parameters none (a head the loss does not use):
    their state goes, and the note says which."""
    names = {id(p): n for n, p in step.model.named_parameters()}
    for p in step.ungraded:
        step.optimizer.state.pop(p, None)
    first = ", ".join(names.get(id(p), "?") for p in step.ungraded[:3])
    return (f"{len(step.ungraded)} trainable parameter(s) get no gradient from this loss ({first}"
            f"{', ...' if len(step.ungraded) > 3 else ''}): no optimizer state for them, as torch.optim makes none")


def _measure(workload: Workload, step: TrainStep, dev: Device, mode, batch, notes: list[str]) -> Probe:
    """One step of `step` on `batch` with both tracers running; everything live is labelled afterwards.
    Where the step branches on values fake tensors lack, each way is traced and the larger peak kept."""
    with value_branches() as branches:
        ways = branches.join(lambda: _measure_step(workload, step, dev, mode, batch, notes), _peak_of,
                             _raised_by_workload)
    probe = ways.best
    if ways.sites:
        where = ", ".join(dict.fromkeys(ways.sites))
        dropped = f"; dropped {len(ways.raised)} way(s) that raised in the model's own code ({ways.raised[0]})" \
            if ways.raised else ""
        probe.estimate.notes.append(
            f"the step branches on values fake tensors lack ({where}): traced each way "
            f"({len(ways.peaks) + len(ways.raised)} traces), the largest peak kept; the ways' peaks "
            f"{fmt_bytes(min(ways.peaks))} to {fmt_bytes(max(ways.peaks))}{dropped}")
    return probe


def _peak_of(p: Probe) -> int:
    e = p.estimate
    return e.device_peak_bytes if e.device_peak_bytes is not None else e.peak_bytes


def _measure_step(workload: Workload, step: TrainStep, dev: Device, mode, batch, notes: list[str]) -> Probe:
    cuda_target = dev.kind == "cuda"
    move = step.move
    # what kernels hold while they run; a CPU rank runs with its launch's thread count
    workspaces = CudnnWorkspaces() if cuda_target else CpuWorkspaces(rank_threads() if step.config.world > 1 else None)
    tracker = LiveBytes("cpu", host_apart=cuda_target, workspace=workspaces)
    recorder = OpRecorder()
    if cuda_target:  # the global batch stays in host memory; only micro-batch copies reach the GPU
        tracker.track(step.host_tensors(), host=True)
        tracker.exclude.update(storage_key(t) for t in tensors_of(batch))
    else:
        tracker.track(tensors_of(batch), category=Category.INPUTS)
    tracker.track(_preexisting(step, mode))
    saved: set[int] = set()

    def pack(t):
        saved.update(tracker.uid(x) for x in held_by(t))

    ops = recorder.trace

    def on_phase(phase: str) -> None:
        tracker.mark(phase)
        if phase == "forward" and recorder.phase != Phase.FORWARD:  # a micro-step begins
            ops.micro_steps.append((len(ops), step.moved_bytes))
        elif phase == "optimizer":
            ops.optimizer_at = (len(ops), step.moved_bytes)
        recorder.mark(phase)

    step.on_phase = on_phase
    step.move = lambda b, d: _tag(tracker, move(b, d))
    scope = ModuleScope(step.model, tracker, recorder)
    tracker.plain = PlainPaths()
    try:
        with seeing_saved(pack), tracker.recording(recorder), tracker.plain, \
                chunks_traced_once(recorder) if mode is not None else contextlib.nullcontext():
            step(batch)
    except Exception as e:
        if mode is not None:  # what the fake step got through, for the fallback's host check and its message
            with contextlib.suppress(Exception):
                e.memfit_partial = _partial(step, tracker, saved)
        raise
    finally:
        scope.remove()
        tracker.close()
        step.move, step.on_phase = move, (lambda phase: None)
    notes = notes + workspaces.notes()
    if tracker.sparse_seen:
        notes.append("sparse tensors counted as their indices and values; what sparse kernels allocate inside "
                     "themselves is not seen (a sparse matmul's backward coalesces a transposed copy of the "
                     "sparse matrix: 13% of a small GCN's step)")
    labels = _labels(step, tracker, saved)
    model_state = {c: sum(n for k, n in tracker.live.items() if labels.get(k) == c) for c in MODEL_STATE}
    n_params = weight_count(step.model)
    est = _summarise(workload, step.config, dev, tracker, recorder, labels, model_state, n_params, notes)
    est.moved_bytes = ops.moved_bytes = step.moved_bytes
    if step.config.world == 1 and step.pipeline is None:  # (across ranks, later micro-steps are priced as the first)
        ops.accumulate = _accumulate_rows(step)
    est.host_peak_bytes = tracker.host_peak if cuda_target else None
    est.phase_peaks = dict(tracker.phase_peaks)
    est.blocks = find_blocks(step.model)
    if cuda_target:
        _add_cuda_figures(est, tracker, dev, step.config)
    probe = Probe(est, recorder.trace)
    if KEEP_STREAMS:
        probe.stream = streams.tokens(tracker.events, {k: streams.storage_class(labels[k], info)
                                                       for k, info in tracker.infos.items()}, tracker.marks)
    return probe


def _copy_to_device(batch, device):
    return map_tensors(batch, lambda t: t.clone())


def _tag(tracker: LiveBytes, batch):
    tracker.tag(tensors_of(batch), Category.INPUTS)
    return batch


def _host_bytes(nbytes: int) -> torch.Tensor:
    """A stand-in for a copy the step makes in host memory outside the dispatcher (the CPU RNG state): on a
    CPU target that is the device's memory, on a GPU target the host's."""
    with host_side():
        return torch.empty(nbytes, dtype=torch.uint8)


def _use_foreach(opt: torch.optim.Optimizer) -> bool:
    changed = False
    for group in opt.param_groups:
        if group.get("foreach", False) is None and not group.get("fused"):
            group["foreach"] = True
            changed = True
    return changed


@contextlib.contextmanager
def _heap_set_aside(active: bool):
    """While `active`, every object alive on entry (the process's heap: imports, a test session, a forked
    child's parent's objects) sits in the collector's permanent generation, where `gc.get_objects()` does not
    look, so `_preexisting` walks the trace's own objects only (walking a test session's whole heap was ~15%
    of the planner's tests). The trace makes its fake tensors after entering. A process that froze objects
    itself (a server before it forks workers) keeps them frozen, and only those are set aside."""
    if not active or heap_frozen():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _preexisting(step: TrainStep, mode) -> list[torch.Tensor]:
    """Tensors alive before the measured step: what the step owns, in its order (parameters as registered,
    buffers, gradients, optimizer state); on fake tensors then every other one of this mode (anything a
    model keeps in a plain attribute; all made inside `_heap_set_aside`), largest first. The simulated
    allocator lays blocks out in the order it is given them, and the collector's order moves from run to
    run: given that, one gpt-small estimate for an H100 took five allocated peaks across runs (4.5 MB
    apart), and a change of memfit's own bookkeeping moved Zamba's reserved peak by 0.7%."""
    owned = step.state_tensors()
    if mode is None:
        return owned
    rest = [o for o in gc.get_objects() if issubclass(type(o), FakeTensor) and o.fake_mode is mode
            and o.layout == torch.strided and not o.is_nested]  # sparse and nested ones have no storage to size
    return owned + sorted(rest, key=lambda t: -t.untyped_storage().nbytes())


def _labels(step: TrainStep, tracker: LiveBytes, saved: set[int]) -> dict[int, Category]:
    """Category of every storage seen; earlier rules win (a weight saved for backward is a parameter)."""
    labels: dict[int, Category] = {}

    def put(tensors, category):
        for t in tensors:
            for x in held_by(t):  # a sparse tensor's indices and values
                uid = tracker.uid(x)
                if uid is not None:
                    labels.setdefault(uid, category)

    for key, info in tracker.infos.items():
        if info.category:
            labels[key] = info.category
    put(step.model.parameters(), Category.PARAMETERS)
    put(step.model.buffers(), Category.PARAMETERS)
    put([p.grad for p in step.model.parameters() if p.grad is not None], Category.GRADIENTS)
    put([t for s in step.optimizer.state.values() for t in tensors_of(dict(s))], Category.OPTIMIZER_STATE)
    if step.optimizer_offload is not None:  # the fp32 master weights are optimizer state, as in ZeRO
        put([m.grad for m in step.optimizer_offload.master if m.grad is not None], Category.GRADIENTS)
        put(step.optimizer_offload.master, Category.OPTIMIZER_STATE)
    if step.scaler is not None:
        put(grad_scaler_tensors(step.scaler), Category.OPTIMIZER_STATE)
    for key in tracker.infos:
        labels.setdefault(key, Category.ACTIVATIONS if key in saved else Category.TEMPORARIES)
    return labels


def _summarise(workload, config, dev, tracker: LiveBytes, recorder: OpRecorder, labels, model_state, n_params,
               notes) -> Estimate:
    live = tracker.live_at_peak()
    timeline, module_timeline = _timeline(tracker, labels)
    breakdown = dict.fromkeys(CATEGORIES, 0)
    by_module: dict[str, int] = {}
    for key, nbytes in live.items():
        cat = labels[key]
        breakdown[cat] += nbytes
        if cat in (Category.ACTIVATIONS, Category.TEMPORARIES):
            mod = tracker.infos[key].module
            by_module[mod] = by_module.get(mod, 0) + nbytes
    top = sorted(live, key=live.get, reverse=True)[:TOP_TENSORS]
    top_tensors = [dict(bytes=live[k], category=labels[k], **{f: getattr(tracker.infos[k], f) for f in
                                                             ("shape", "dtype", "op", "module", "phase", "source")})
                   for k in top]
    for t in top_tensors:
        t["shape"] = list(t["shape"])
    peak_phase = Phase.SETUP
    for index, phase in tracker.marks:
        if index <= tracker.peak_index:
            peak_phase = phase
    return Estimate(
        workload=workload.name, config=config.to_dict(), device=dev.name, method="fake",
        peak_bytes=tracker.peak, breakdown=breakdown, model_state_bytes=model_state, peak_phase=peak_phase,
        modules=sorted(by_module.items(), key=lambda kv: -kv[1])[:MODULES], top_tensors=top_tensors,
        timeline=timeline, flops=sum(recorder.flops_by_module.values()),
        recompute_flops=recorder.recompute_flops, module_flops=dict(recorder.flops_by_module),
        parameters=n_params, notes=notes, device_total_bytes=dev.memory_bytes, module_timeline=module_timeline,
    )


def module_group(module: str) -> str:
    """The block a module belongs to: its name up to the first list index ("model.layers.3" of
    "model.layers.3.mlp.up_proj"), else its first part ("lm_head", "(backward)")."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0]


def _timeline(tracker: LiveBytes, labels: dict[int, Category], points: int = 1500) -> tuple[dict, dict]:
    """Bytes by category after each event, thinned to about `points` samples (the peak always kept); and the
    activations by module_group at the same points, the MODULE_GROUPS largest at the peak apart, the rest
    together as "other modules"."""
    events = tracker.events
    stride = max(1, len(events) // points)
    totals = dict.fromkeys(CATEGORIES, 0)
    groups: dict[str, int] = {}
    out: dict[str, list] = {"index": [], "phase": [], **{c: [] for c in CATEGORIES}}
    samples: list[dict[str, int]] = []
    group_of = {key: module_group(info.module) for key, info in tracker.infos.items()
                if labels[key] == Category.ACTIVATIONS}
    marks = dict(tracker.marks)
    phase = Phase.SETUP
    for i, (key, delta) in enumerate(events):
        phase = marks.get(i, phase)
        totals[labels[key]] += delta
        if key in group_of:
            groups[group_of[key]] = groups.get(group_of[key], 0) + delta
        if i % stride == 0 or i == tracker.peak_index or i == len(events) - 1:
            out["index"].append(i)
            out["phase"].append(phase)
            for c in CATEGORIES:
                out[c].append(totals[c])
            samples.append({g: v for g, v in groups.items() if v})
    at_peak = samples[out["index"].index(tracker.peak_index)] if tracker.peak_index in out["index"] else {}
    apart = sorted(at_peak, key=at_peak.get, reverse=True)[:MODULE_GROUPS]
    by_module = {g: [s.get(g, 0) for s in samples] for g in apart}
    rest = [sum(v for g, v in s.items() if g not in by_module) for s in samples]
    if any(rest):
        by_module["other modules"] = rest
    return out, by_module


def _add_cuda_figures(est: Estimate, tracker: LiveBytes, dev: Device, config: Config) -> None:
    """Replay the trace through the caching-allocator model. cuBLAS keeps a workspace in PyTorch's pool
    from the first matmul on; the CUDA context and NCCL's communicators sit outside the pool altogether."""
    events = [("cublas-workspace", dev.cublas_workspace_bytes)] + tracker.events
    est.peak_allocated_bytes, est.peak_reserved_bytes = allocator.simulate(events)
    est.device_peak_bytes = est.peak_reserved_bytes + dev.context_bytes
    est.notes.append(f"CUDA context and library handles assumed {dev.context_bytes / 2**20:.0f} MiB "
                     f"(catalogue figure for {dev.name}, outside PyTorch's allocator)")
    if config.world == 1:
        return
    nccl = nccl_bytes(dev, config.gpus, config.data_parallel, config.gpus_per_node, config.tp, config.pp)
    if nccl is None:
        est.notes.append(f"not counted: NCCL's communicator buffers (no catalogue figure for {dev.name})")
        return
    est.device_peak_bytes += nccl
    est.nccl_bytes = nccl
    count, spanning = nccl_communicators(dev, config.gpus, config.data_parallel, config.gpus_per_node, config.tp,
                                         config.pp)
    est.notes.append(f"NCCL assumed {nccl / 2**20:,.0f} MiB outside PyTorch's allocator: {count} communicator(s)"
                     + (f", {spanning} across nodes" if spanning else "") + " (catalogue figures, devices.Links)")


# ------------------------------------------------------------------------------------------- fallback

# A real CPU step measured in place of a trace may use at most this share of the host's available memory.
SAFE_HOST_SHARE = 0.5


def _partial(step: TrainStep, tracker: LiveBytes, saved: set[int]) -> dict:
    """How far a fake step got before it raised: where, the bytes live then by category, and the modules
    holding the most activations and temporaries."""
    labels = _labels(step, tracker, saved)
    by_category = dict.fromkeys(CATEGORIES, 0)
    by_module: dict[str, int] = {}
    for key, nbytes in tracker.live.items():
        by_category[labels[key]] += nbytes
        if labels[key] in (Category.ACTIVATIONS, Category.TEMPORARIES):
            module = tracker.infos[key].module
            by_module[module] = by_module.get(module, 0) + nbytes
    module, phase, op = tracker.failed_at or ("?", tracker.phase, "?")
    # gradients are freed between steps in this trace (zero_grad(set_to_none)); the floor counts them
    grads = sum(p.numel() * p.element_size() for p in {id(p): p for p in step.model.parameters()}.values()
                if p.requires_grad) if step.optimizer_offload is None else by_category[Category.GRADIENTS]
    return {"module": module, "phase": str(phase), "op": op, "live_bytes": tracker.current,
            "state_bytes": by_category[Category.PARAMETERS] + by_category[Category.OPTIMIZER_STATE] + grads,
            "breakdown": {str(c): n for c, n in by_category.items()},
            "modules": sorted(by_module.items(), key=lambda kv: -kv[1])[:8]}


def _host_allowance(workload: Workload, config: Config, reason: str, partial: dict | None) -> int:
    """The host memory a real CPU step may take, after checking that what is already known it needs (the
    state floor, the bytes the fake step had live when it stopped) fits in the safe share; else
    HostMemoryError with what could be traced, and no real step."""
    allowance = int(SAFE_HOST_SHARE * available_host_bytes())
    known = dict(partial or {})
    if not known.get("state_bytes"):
        with contextlib.suppress(Exception):  # the model may not even build on fake tensors
            known["state_bytes"] = state_bytes(workload, config, "cpu")
    need = max(known.get("live_bytes", 0), known.get("state_bytes", 0))
    if need <= allowance:
        return allowance
    where = (f"; the fake step stopped in {known['module']} ({known['phase']}, {known['op']}) with "
             f"{fmt_bytes(known['live_bytes'])} live" if "module" in known else "")
    modules = ", ".join(f"{m} {fmt_bytes(n)}" for m, n in known.get("modules", []) if not m.startswith("("))
    raise HostMemoryError(
        f"{workload.name}: fake tensors could not follow the step ({reason}); measuring a real CPU step instead "
        f"needs at least {fmt_bytes(need)}, more than the safe share of this host ({fmt_bytes(allowance)}, "
        f"{SAFE_HOST_SHARE:.0%} of what is available), so none was run. Traced: model state "
        f"{fmt_bytes(known.get('state_bytes', 0))}{where}" + (f"; largest modules then: {modules}" if modules else ""),
        known)


def _fallback(workload: Workload, config: Config, dev: Device, reason: str, partial: dict | None = None) -> Probe:
    """Fake tensors could not follow the step: measure real CPU steps instead, never one that may not fit
    the host (`_host_allowance` before, `host_memory_guard` during). Small micro-batches are measured as
    asked. Larger ones are first measured at a quarter and a half of the size; if the straight line
    through those predicts a step that fits comfortably in the allowance, the real size is measured too
    (data-dependent models are not linear: a top-2 MoE was 7% off extrapolated), else the line is used.
    The op trace kept is the largest measured step's."""
    m = config.micro_batch
    allowance = _host_allowance(workload, config, reason, partial)
    try:
        with host_memory_guard(allowance, f"a real CPU step of {workload.name} (measured because fake tensors "
                                          f"could not follow it: {reason})"):
            if m <= 8:
                points, small = [_trace(workload, config, dev, fake=False)], [m]
            else:
                small = [m // 4, m // 2]
                points = [_trace(workload, config.replace(micro_batch=k), dev, fake=False) for k in small]
                line = MicroBatchLine(*small)
                predicted = line.at(points[0].estimate.peak_bytes, points[1].estimate.peak_bytes, m)
                if predicted < 0.5 * allowance:
                    points, small = [_trace(workload, config, dev, fake=False)], [m]
    except (ConfigError, EstimateError):
        raise
    except Exception as e:
        raise WorkloadError(f"the workload's training step raised: {first_line(e)}") from e
    est = points[-1].estimate
    why = f"fake tensors could not follow this step ({reason})"
    if len(points) == 1:
        est.method = "measured"
        est.notes.insert(0, f"{why}; measured a real CPU step at micro-batch {config.micro_batch}; "
                            "data-dependent memory may differ on other data")
        return points[-1]
    line = MicroBatchLine(*small)
    e1, e2 = points[0].estimate, est

    def extrapolate(a: int, b: int) -> int:
        return int(round(line.at(a, b, m)))

    est.config = config.to_dict()
    est.method = "extrapolated"
    est.peak_bytes = extrapolate(e1.peak_bytes, e2.peak_bytes)
    est.breakdown = {c: extrapolate(e1.breakdown[c], e2.breakdown[c]) for c in CATEGORIES}
    est.flops = extrapolate(e1.flops, e2.flops)
    est.recompute_flops = extrapolate(e1.recompute_flops, e2.recompute_flops)
    for field in ("peak_allocated_bytes", "peak_reserved_bytes", "device_peak_bytes"):
        if getattr(est, field) is not None:
            setattr(est, field, extrapolate(getattr(e1, field), getattr(e2, field)))
    est.notes.insert(0, f"{why}; measured real CPU steps at micro-batch {line.m1} and {line.m2} and extrapolated "
                        f"linearly to {config.micro_batch}; data-dependent memory may differ on other data")
    return points[-1]

