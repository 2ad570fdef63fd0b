"""`estimate`: the peak memory of one steady-state training step, traced on fake tensors.

How: build the model and optimizer under `FakeTensorMode` (no data, no real memory), run one step so the
optimizer state exists, then run the measured step with a `LiveBytes` counter active. Everything live at the
peak is labelled (parameters, gradients, optimizer state, inputs, activations saved for backward,
temporaries). For a GPU target the same trace is replayed through the CUDA caching-allocator model.
Where fake tensors cannot follow the model (data-dependent shapes, `.item()`), real CPU steps at small
micro-batches are measured and extrapolated, and the estimate says so.
"""
from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import gc
import os
import pickle
import signal
import tempfile
import time
from typing import Callable

import torch

from memfit.config import Config, ConfigError
from memfit.memory import allocator
from memfit.memory.devices import Device, get_device
from memfit.memory.fake import FakeTensor, SameModeDeepcopy, new_fake_mode, quiet_fake_errors
from memfit.memory.tracker import LiveBytes, ModuleScope
from memfit.step import TrainStep
from memfit.strategies import check_precision
from memfit.strategies.activation_checkpoint import find_blocks
from memfit.workload import Workload, WorkloadError, map_tensors, move_batch, tensors_of

CATEGORIES = ("parameters", "gradients", "optimizer_state", "inputs", "activations", "temporaries")


class EstimateError(Exception):
    """The step could not be traced, measured or extrapolated; the message says why."""


class MicroBatchError(WorkloadError):
    """The model cannot train at this micro-batch, though it trains at a larger one: batch statistics of a
    single sample (BatchNorm whose features reach 1x1, any BatchNorm1d) are the common case."""

    def __init__(self, workload: str, micro_batch: int, smallest: int, reason: str):
        self.workload, self.micro_batch, self.smallest, self.reason = workload, micro_batch, smallest, reason
        super().__init__(f"{workload} cannot train at micro-batch {micro_batch} ({reason}); the smallest "
                         f"micro-batch it trains at is {smallest}")

    def __reduce__(self):  # crosses from a tracing child to the parent by pickle
        return MicroBatchError, (self.workload, self.micro_batch, self.smallest, self.reason)


# The planner's probes: micro-batches 1 and 2, or 2 and 4 for a model that rejects 1 (two samples always
# give batch statistics more than one value per channel).
PROBES = (1, 2)
PROBES_WITHOUT_1 = (2, 4)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


@dataclasses.dataclass
class Estimate:
    workload: str
    config: dict
    device: str
    method: str                 # "fake" (traced) | "measured" | "extrapolated" (real CPU steps, fallback)
    peak_bytes: int             # peak of live tensor bytes on the device during one step, inputs included
    breakdown: dict             # category -> bytes live at the peak
    model_state_bytes: dict     # category -> bytes at rest after the step (parameters, gradients, optimizer_state)
    peak_phase: str             # forward | backward | optimizer
    modules: list               # [(module, bytes)] activations + temporaries live at the peak, by creator
    top_tensors: list           # [dict] largest storages live at the peak
    timeline: dict              # {"index": [...], "phase": [...], category: [...]}: bytes by category over the step
    flops: int                  # FLOPs of the step (FlopCounterMode's formulas): forward + backward + recompute
    recompute_flops: int        # of which forward ops re-run in backward by activation checkpointing
    module_flops: dict          # innermost module (or "(phase)") -> FLOPs
    parameters: int             # parameter count (tied weights once)
    notes: list                 # assumptions and fallbacks, in words
    device_total_bytes: int | None = None
    peak_allocated_bytes: int | None = None   # CUDA: predicted torch.cuda.max_memory_allocated()
    peak_reserved_bytes: int | None = None    # CUDA: predicted torch.cuda.max_memory_reserved()
    device_peak_bytes: int | None = None      # CUDA: what nvidia-smi would show (reserved + context)
    host_peak_bytes: int | None = None        # GPU targets: peak host memory used by offloading
    moved_bytes: int = 0                      # bytes copied host <-> device by offloading in one step
    phase_peaks: dict = dataclasses.field(default_factory=dict)  # phase -> highest live bytes in it
    blocks: list = dataclasses.field(default_factory=list)       # the model's repeated blocks (checkpointing units)
    ops: dict = dataclasses.field(default_factory=dict)  # per-op records: the step-time model's input

    @property
    def headroom_bytes(self) -> int | None:
        used = self.device_peak_bytes if self.device_peak_bytes is not None else self.peak_bytes
        return None if self.device_total_bytes is None else self.device_total_bytes - used

    def to_dict(self) -> dict:
        """Plain data for JSON, without the per-op records (tens of thousands of numbers at 7B)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "ops"}
        d["headroom_bytes"] = self.headroom_bytes
        return d


def estimate(workload: Workload, config: Config | None = None, device: str | Device = "cpu",
             isolate: bool = True, **config_fields) -> Estimate:
    """Peak memory of one steady-state `TrainStep` call for `config` on `device` (a catalogue name).

    isolate: trace in a forked child so that a C++ abort inside PyTorch becomes an EstimateError.
    """
    config = config or Config()
    if config_fields:
        config = config.replace(**config_fields)
    dev = device if isinstance(device, Device) else get_device(device)
    check_precision(config, dev.name, dev.bf16)
    run = _run_isolated if isolate and hasattr(os, "fork") else (lambda fn: fn())
    try:
        return run(lambda: _trace(workload, config, dev, fake=True))
    except (WorkloadError, ConfigError):
        raise
    except Exception as fake_error:  # data-dependent shapes, `.item()`, an op fake tensors lack, a crash
        reason = first_line(fake_error)
    try:
        return run(lambda: _fallback(workload, config, dev, reason))
    except WorkloadError:  # the real step failed too: at micro-batch 1, say whether 2 would train
        if config.micro_batch != 1 or not _traces_at(run, workload, config, dev, PROBES_WITHOUT_1[0]):
            raise
        raise MicroBatchError(workload.name, 1, PROBES_WITHOUT_1[0], reason) from None


def _traces_at(run, workload: Workload, config: Config, dev: Device, micro_batch: int) -> bool:
    try:
        run(lambda: _trace(workload, config.replace(micro_batch=micro_batch, grad_accum=1), dev, True))
        return True
    except Exception:  # noqa: BLE001 - any failure means no
        return False


def probe_traces(workload: Workload, config: Config, dev: Device) -> tuple[list[Estimate], str | None]:
    """The planner's two probes (one build, primed state, a step at each of PROBES); for a model that cannot
    train at micro-batch 1, a fresh build probed at PROBES_WITHOUT_1, with the reason 1 failed (else None).
    A failure at both is reported as the first one."""
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
    dev = device if isinstance(device, Device) else get_device(device)
    with new_fake_mode(), quiet_fake_errors():
        with SameModeDeepcopy():
            step = TrainStep(workload, config, "cpu")
        step.prime()
        host = {t.untyped_storage()._cdata for t in step.host_tensors()}
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in step.state_tensors()}
    total = sum(n for address, n in storages.items() if address not in host)
    if dev.kind == "cuda":
        total += dev.context_bytes + dev.cublas_workspace_bytes
    return total


# ------------------------------------------------------------------------------------------- the trace

def _trace(workload: Workload, config: Config, dev: Device, fake: bool) -> Estimate:
    return _traces(workload, config, dev, fake, [config.global_batch])[0]


def _traces(workload: Workload, config: Config, dev: Device, fake: bool, sizes: list[int]) -> list[Estimate]:
    """Build once, prime the optimizer state, then measure one step per global batch size in `sizes`
    (a size other than config.global_batch runs as one micro-batch of that size: the planner's probes)."""
    cuda_target = dev.kind == "cuda"
    notes: list[str] = []
    # A GPU target is traced on (fake) CPU; model what differs: the micro-batch is copied host -> device,
    # and optimizers default to their foreach kernels on CUDA (one temporary per parameter at once).
    move = _copy_to_device if cuda_target else move_batch
    mode = new_fake_mode() if fake else None
    results = []
    with mode or contextlib.nullcontext(), quiet_fake_errors():
        with SameModeDeepcopy() if fake else contextlib.nullcontext():
            step = TrainStep(workload, config.replace(micro_batch=max(config.micro_batch, *sizes))
                             if sizes != [config.global_batch] else config, "cpu", move=move)
        step.tracing = fake
        if cuda_target and _use_foreach(step.optimizer):
            notes.append("optimizer uses its foreach kernels, PyTorch's default on CUDA")
        if cuda_target:
            notes.append("attention traced with the CPU flash kernel; it saves what CUDA flash / memory-efficient "
                         "attention save (output + fp32 logsumexp)")
        if not cuda_target and (config.offload_activations or config.offload_optimizer):
            notes.append("on a CPU device host and device memory are one: offloading only adds copies")
        step.prime()
        for size in sizes:
            est = _measure(workload, step, dev, mode, workload.batch(size), list(notes))
            est.method = "fake" if fake else "measured"
            if sizes != [config.global_batch]:
                est.config = config.replace(micro_batch=size, grad_accum=1).to_dict()
            results.append(est)
    return results


def _measure(workload: Workload, step: TrainStep, dev: Device, mode, batch, notes: list[str]) -> Estimate:
    """One step of `step` on `batch` with the counter running; everything live is labelled afterwards."""
    cuda_target = dev.kind == "cuda"
    move = step.move
    tracker = LiveBytes("cpu", host_apart=cuda_target)
    if cuda_target:  # the global batch stays in host memory; only micro-batch copies reach the GPU
        tracker.track(step.host_tensors(), host=True)
        tracker.exclude.update(t.untyped_storage()._cdata for t in tensors_of(batch))
    else:
        tracker.track(tensors_of(batch), category="inputs")
    tracker.track(_preexisting(step, mode))
    saved: set[int] = set()

    def pack(t):
        saved.add(tracker.uid(t))
        return t

    step.on_phase = tracker.mark
    step.move = lambda b, d: _tag(tracker, move(b, d))
    scope = ModuleScope(step.model, tracker)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), tracker:
            step(batch)
    finally:
        scope.remove()
        tracker.close()
        step.move, step.on_phase = move, (lambda phase: None)
    labels = _labels(step, tracker, saved)
    model_state = {c: sum(n for k, n in tracker.live.items() if labels.get(k) == c)
                   for c in ("parameters", "gradients", "optimizer_state")}
    n_params = sum(p.numel() for p in {id(p): p for p in step.model.parameters()}.values())
    est = _summarise(workload, step.config, dev, tracker, labels, model_state, n_params, notes)
    est.moved_bytes = step.moved_bytes
    est.host_peak_bytes = tracker.host_peak if cuda_target else None
    est.ops = {"flops": tracker.op_flops, "bytes": tracker.op_bytes, "alloc": tracker.op_alloc,
               "kind": tracker.op_kind, "phase": tracker.op_phase, "name": tracker.op_name}
    est.phase_peaks = dict(tracker.phase_peaks)
    est.blocks = find_blocks(step.model)
    if cuda_target:
        _add_cuda_figures(est, tracker, dev)
    return est


def _copy_to_device(batch, device):
    return map_tensors(batch, lambda t: t.clone())


def _tag(tracker: LiveBytes, batch):
    tracker.tag(tensors_of(batch), "inputs")
    return batch


def _use_foreach(opt: torch.optim.Optimizer) -> bool:
    changed = False
    for group in opt.param_groups:
        if group.get("foreach", False) is None and not group.get("fused"):
            group["foreach"] = True
            changed = True
    return changed


def _preexisting(step: TrainStep, mode) -> list[torch.Tensor]:
    """Tensors alive before the measured step: on fake tensors every one of this mode (anything a model
    keeps in a plain attribute too); on real ones, what the step owns."""
    if mode is not None:
        return [o for o in gc.get_objects() if issubclass(type(o), FakeTensor) and o.fake_mode is mode]
    return step.state_tensors()


def _labels(step: TrainStep, tracker: LiveBytes, saved: set[int]) -> dict[int, str]:
    """Category of every storage seen; earlier rules win (a weight saved for backward is a parameter)."""
    labels: dict[int, str] = {}

    def put(tensors, category):
        for t in tensors:
            uid = tracker.uid(t)
            if uid is not None:
                labels.setdefault(uid, category)

    for key, info in tracker.infos.items():
        if info.category:
            labels[key] = info.category
    put(step.model.parameters(), "parameters")
    put(step.model.buffers(), "parameters")
    put([p.grad for p in step.model.parameters() if p.grad is not None], "gradients")
    put([t for s in step.optimizer.state.values() for t in tensors_of(dict(s))], "optimizer_state")
    if step.optimizer_offload is not None:  # the fp32 master weights are optimizer state, as in ZeRO
        put([m.grad for m in step.optimizer_offload.master if m.grad is not None], "gradients")
        put(step.optimizer_offload.master, "optimizer_state")
    if step.scaler is not None and step.scaler._scale is not None:
        put([step.scaler._scale, step.scaler._growth_tracker], "optimizer_state")
    for key in tracker.infos:
        labels.setdefault(key, "activations" if key in saved else "temporaries")
    return labels


def _summarise(workload, config, dev, tracker: LiveBytes, labels, model_state, n_params, notes) -> Estimate:
    live = tracker.live_at_peak()
    breakdown = dict.fromkeys(CATEGORIES, 0)
    by_module: dict[str, int] = {}
    for key, nbytes in live.items():
        cat = labels[key]
        breakdown[cat] += nbytes
        if cat in ("activations", "temporaries"):
            mod = tracker.infos[key].module
            by_module[mod] = by_module.get(mod, 0) + nbytes
    top = sorted(live, key=live.get, reverse=True)[:12]
    top_tensors = [dict(bytes=live[k], category=labels[k], **{f: getattr(tracker.infos[k], f) for f in
                                                             ("shape", "dtype", "op", "module", "phase")})
                   for k in top]
    for t in top_tensors:
        t["shape"] = list(t["shape"])
    peak_phase = "setup"
    for index, phase in tracker.marks:
        if index <= tracker.peak_index:
            peak_phase = phase
    return Estimate(
        workload=workload.name, config=config.to_dict(), device=dev.name, method="fake",
        peak_bytes=tracker.peak, breakdown=breakdown, model_state_bytes=model_state, peak_phase=peak_phase,
        modules=sorted(by_module.items(), key=lambda kv: -kv[1])[:20], top_tensors=top_tensors,
        timeline=_timeline(tracker, labels), flops=sum(tracker.flops_by_module.values()),
        recompute_flops=tracker.recompute_flops, module_flops=dict(tracker.flops_by_module),
        parameters=n_params, notes=notes, device_total_bytes=dev.memory_bytes,
    )


def _timeline(tracker: LiveBytes, labels: dict[int, str], points: int = 1500) -> dict:
    """Bytes by category after each event, thinned to about `points` samples (the peak always kept)."""
    events = tracker.events
    stride = max(1, len(events) // points)
    totals = dict.fromkeys(CATEGORIES, 0)
    out: dict[str, list] = {"index": [], "phase": [], **{c: [] for c in CATEGORIES}}
    marks = dict(tracker.marks)
    phase = "setup"
    for i, (key, delta) in enumerate(events):
        phase = marks.get(i, phase)
        totals[labels[key]] += delta
        if i % stride == 0 or i == tracker.peak_index or i == len(events) - 1:
            out["index"].append(i)
            out["phase"].append(phase)
            for c in CATEGORIES:
                out[c].append(totals[c])
    return out


def _add_cuda_figures(est: Estimate, tracker: LiveBytes, dev: Device) -> None:
    """Replay the trace through the caching-allocator model. cuBLAS keeps a workspace in PyTorch's pool
    from the first matmul on, and the CUDA context sits outside the pool altogether."""
    events = [("cublas-workspace", dev.cublas_workspace_bytes)] + tracker.events
    est.peak_allocated_bytes, est.peak_reserved_bytes = allocator.simulate(events)
    est.device_peak_bytes = est.peak_reserved_bytes + dev.context_bytes
    est.notes.append(f"CUDA context and library handles assumed {dev.context_bytes / 2**20:.0f} MiB "
                     f"(catalogue figure for {dev.name}, outside PyTorch's allocator)")


# ------------------------------------------------------------------------------------------- fallback

def _fallback(workload: Workload, config: Config, dev: Device, reason: str) -> Estimate:
    """Fake tensors could not follow the step: measure real CPU steps instead. Small micro-batches are
    measured as asked. Larger ones are first measured at a quarter and a half of the size; if the straight
    line through those predicts a step that fits comfortably in free host memory, the real size is measured
    too (data-dependent models are not linear: a top-2 MoE was 7% off extrapolated), else the line is used."""
    m = config.micro_batch
    try:
        if m <= 8:
            points, small = [_trace(workload, config, dev, fake=False)], [m]
        else:
            small = [m // 4, m // 2]
            points = [_trace(workload, config.replace(micro_batch=k), dev, fake=False) for k in small]
            (m1, e1), (m2, e2) = zip(small, points)
            predicted = e2.peak_bytes + (e2.peak_bytes - e1.peak_bytes) * (m - m2) / (m2 - m1)
            if predicted < 0.5 * _free_host_bytes():
                points, small = [_trace(workload, config, dev, fake=False)], [m]
    except ConfigError:
        raise
    except Exception as e:
        raise WorkloadError(f"the workload's training step raised: {type(e).__name__}: {e}") from e
    est = points[-1]
    why = f"fake tensors could not follow this step ({reason})"
    if len(points) == 1:
        est.method = "measured"
        est.notes.insert(0, f"{why}; measured a real CPU step at micro-batch {config.micro_batch}; "
                            "data-dependent memory may differ on other data")
        return est
    (m1, e1), (m2, e2) = zip(small, points)
    scale = (config.micro_batch - m2) / (m2 - m1)

    def extrapolate(a: int, b: int) -> int:
        return int(round(b + (b - a) * scale))

    est.config = config.to_dict()
    est.method = "extrapolated"
    est.peak_bytes = extrapolate(e1.peak_bytes, e2.peak_bytes)
    est.breakdown = {c: extrapolate(e1.breakdown[c], e2.breakdown[c]) for c in CATEGORIES}
    est.flops = extrapolate(e1.flops, e2.flops)
    est.recompute_flops = extrapolate(e1.recompute_flops, e2.recompute_flops)
    for field in ("peak_allocated_bytes", "peak_reserved_bytes", "device_peak_bytes"):
        if getattr(est, field) is not None:
            setattr(est, field, extrapolate(getattr(e1, field), getattr(e2, field)))
    est.notes.insert(0, f"{why}; measured real CPU steps at micro-batch {m1} and {m2} and extrapolated "
                        f"linearly to {config.micro_batch}; data-dependent memory may differ on other data")
    return est


def _free_host_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# ------------------------------------------------------------------------------------------- isolation

def _run_isolated(fn: Callable[[], Estimate]) -> Estimate:
    """Run `fn` in a forked child and return its result; a crash of the child becomes an EstimateError."""
    kind, value = run_isolated_many([fn], workers=1)[0]
    if kind == "error":
        raise value
    return value


def run_isolated_many(fns: list[Callable], workers: int | None = None) -> list[tuple[str, object]]:
    """Run each fn in its own forked child, `workers` at a time (fake tracing is single-threaded Python,
    so children use the cores in parallel). Returns ("ok", result) or ("error", exception) per fn."""
    workers = workers or os.cpu_count() or 1
    results: list = [None] * len(fns)
    running: dict[int, tuple[int, str]] = {}
    with tempfile.TemporaryDirectory(prefix="memfit-") as tmp:
        pending = list(enumerate(fns))
        while pending or running:
            while pending and len(running) < workers:
                i, fn = pending.pop(0)
                path = os.path.join(tmp, f"{i}.pkl")
                pid = os.fork()
                if pid == 0:
                    _child(fn, path)
                running[pid] = (i, path)
            pid, status = _wait_any(running)  # only our children: a user's own subprocesses keep their status
            i, path = running.pop(pid)
            if os.WIFSIGNALED(status):
                sig = signal.Signals(os.WTERMSIG(status)).name
                hint = " (killed: out of host memory?)" if sig == "SIGKILL" else ""
                results[i] = ("error", EstimateError(f"PyTorch crashed with {sig}{hint} while tracing the training step"))
                continue
            with open(path, "rb") as f:
                results[i] = pickle.load(f)
    return results


def _wait_any(pids) -> tuple[int, int]:
    while True:
        for pid in pids:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return done, status
        time.sleep(0.01)


def _child(fn: Callable, path: str) -> None:
    torch.set_num_threads(1)  # an OpenMP pool does not survive fork; one thread never enters it
    faulthandler.disable()  # a crash is reported by the parent, in one line
    try:
        result = ("ok", fn())
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        try:
            pickle.dumps(e)
            result = ("error", e)
        except Exception:  # not picklable: keep its name and first line
            result = ("error", EstimateError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    try:
        with open(path, "wb") as f:
            pickle.dump(result, f)
    finally:
        os._exit(0)
