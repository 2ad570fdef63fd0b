"""Find memory that a training loop keeps from every step: run real steps, note at each step's end which
storages made during it are still alive, and name the line that made them and the Python object that
keeps them.

A step that keeps nothing leaves no storage of its own behind once the next step has run: its activations
are freed by backward, its gradients by the next zero_grad, and optimizer state is updated in place. What
survives from step after step is a leak (`losses.append(loss)` keeps one loss tensor, and with it its
autograd graph, per step). What appears in one step only and then stays (optimizer state built lazily, a
cache filled once) is reported apart, as state that appeared late; it does not grow.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import re
import sys
import types
import warnings

import torch

from memfit.config import Config
from memfit.errors import ConfigError, HostMemoryError, WorkloadError, first_line, short_path
from memfit.memory.estimate import SAFE_HOST_SHARE, estimate
from memfit.memory.isolate import available_host_bytes, heap_frozen, host_memory_guard, run_isolated
from memfit.memory.tracker import LiveBytes, ModuleScope
from memfit.step import TrainStep
from memfit.units import fmt_bytes
from memfit.workload import Workload

WARMUP = 2  # steps whose new storages may stay: the optimizer's state, lazily built caches
PERSISTENT = 0.5  # a line leaks when storages it made survive from at least this share of the later steps


@dataclasses.dataclass
class Leak:
    """Storages made at one line that survive from step after step."""
    source: str            # "file:line in function" that allocated them ("" for autograd's own)
    module: str            # the module running then
    op: str
    bytes_per_step: int
    tensors_per_step: float
    steps: int             # of the steps watched after warm-up, how many left some behind
    holder: str            # what keeps them alive, in words
    fix: str               # one sentence


@dataclasses.dataclass
class LeakReport:
    workload: str
    steps: int
    live_after_step: list[int]   # bytes live after each step (everything tracked, state included)
    leaks: list[Leak]
    late: list[str]              # storages that appeared after warm-up in one step and stayed

    @property
    def growth_per_step(self) -> int:
        return sum(leak.bytes_per_step for leak in self.leaks)

    def render(self) -> str:
        lines = [f"{self.workload}: {self.steps} real steps watched; live memory after each step "
                 f"{fmt_bytes(self.live_after_step[0])} -> {fmt_bytes(self.live_after_step[-1])}"]
        if not self.leaks:
            lines.append("no leak: no step after the first ones left anything of its own alive")
        for leak in self.leaks:
            where = leak.source or f"autograd / optimizer ({leak.op} in {leak.module})"
            lines.append(f"LEAK {fmt_bytes(leak.bytes_per_step)} a step ({leak.tensors_per_step:g} tensor(s), "
                         f"from {leak.steps} steps) made at {where}")
            lines.append(f"  kept by {leak.holder}")
            lines.append(f"  fix: {leak.fix}")
        lines += [f"appeared late (stays, does not grow): {text}" for text in self.late]
        return "\n".join(lines)


def find_leaks(workload: Workload, config: Config | None = None, steps: int = 20) -> LeakReport:
    """Run `steps` real CPU steps of `workload` in a forked child and report what each step leaves alive.
    The step is estimated first: one that may not fit in a safe share of the host's free memory is not run."""
    config = config or Config()
    if steps < WARMUP + 3:
        raise ConfigError(f"--steps {steps}: the leak finder needs at least {WARMUP + 3} steps ({WARMUP} to warm up, "
                          "then steps to compare)")
    allowance = int(SAFE_HOST_SHARE * available_host_bytes())
    peak = estimate(workload, config, "cpu").peak_bytes
    if 2 * peak > allowance:  # room for the steps' own growth, which is what is being looked for
        raise HostMemoryError(f"{workload.name}: a real step needs about {fmt_bytes(peak)}; twice that is more "
                              f"than the safe share of this host ({fmt_bytes(allowance)}), so no step was run; try "
                              "a smaller --micro-batch")
    return run_isolated(lambda: _watch(workload, config, steps, allowance))


def _watch(workload: Workload, config: Config, steps: int, allowance: int) -> LeakReport:
    torch.manual_seed(0)
    step = TrainStep(workload, config, "cpu")
    tracker = LiveBytes("cpu")
    step.on_phase = tracker.mark
    scope = ModuleScope(step.model, tracker)
    born: dict[int, int] = {}
    live_after: list[int] = []
    with host_memory_guard(allowance, f"watching {workload.name} for leaks"):
        try:
            with tracker:
                for s in range(1, steps + 1):
                    first = len(tracker.events)
                    step(workload.batch(config.global_batch))
                    for key, delta in tracker.events[first:]:
                        if delta > 0:
                            born.setdefault(key, s)
                    live_after.append(tracker.current)
        finally:
            scope.remove()
            tracker.close()
    watched = range(WARMUP + 1, steps)  # the last step's gradients are rightly alive at the end
    survivors: dict[tuple, dict[int, list[int]]] = {}
    for key in tracker.live:
        s = born.get(key)
        if s in watched and tracker.live[key]:
            info = tracker.infos[key]
            survivors.setdefault((info.source, info.module, info.op), {}).setdefault(s, []).append(key)
    holders = _holders(tracker, {k for by_step in survivors.values() for keys in by_step.values() for k in keys})
    leaks, late = [], []
    for (source, module, op), by_step in survivors.items():
        keys = [k for ks in by_step.values() for k in ks]
        nbytes = sum(tracker.live[k] for k in keys)
        if len(by_step) >= PERSISTENT * len(watched):
            holder, fix = _explain([holders.get(k) for k in keys])
            leaks.append(Leak(source, module, op, nbytes // len(watched), round(len(keys) / len(watched), 2),
                              len(by_step), holder, fix))
        else:
            where = source or f"{op} in {module}"
            late.append(f"{fmt_bytes(nbytes)} made at {where} in step(s) {', '.join(map(str, sorted(by_step)))}")
    leaks.sort(key=lambda leak: -leak.bytes_per_step)
    return LeakReport(workload.name, steps, live_after, leaks, late)


def _holders(tracker: LiveBytes, keys: set[int]) -> dict[int, str]:
    """For each storage in `keys` that a Python tensor still holds: what holds that tensor, in words."""
    if not keys:
        return {}
    with warnings.catch_warnings(), _whole_heap():  # isinstance() on every object wakes deprecated attributes
        warnings.simplefilter("ignore")
        objects = gc.get_objects()
        tensors = [o for o in objects if isinstance(o, torch.Tensor) and tracker.uid(o) in keys]
        del objects
        return _described(tensors, tracker)


@contextlib.contextmanager
def _whole_heap():
    """The collector's searches skip frozen objects, and a tracing child starts with its parent's heap
    frozen (memory.isolate): the user's list that keeps the losses is one of them. They are thawed for the
    search with collection off, so the parent's garbage is still not finalised here, and frozen again."""
    if not heap_frozen():
        yield
        return
    enabled = gc.isenabled()
    gc.disable()
    gc.unfreeze()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def _described(tensors: list[torch.Tensor], tracker: LiveBytes) -> dict[int, str]:
    """What holds each tensor, in words, by its storage's id. One search of the heap for the referrers of them all
    (a search per tensor costs a heap scan each: seconds over a hundred leaked tensors), and one for each holder."""
    firsts: dict[int, torch.Tensor] = {}
    for t in tensors:
        firsts.setdefault(tracker.uid(t), t)
    wanted = {id(t) for t in firsts.values()}
    held: dict[int, list] = {}
    for ref in gc.get_referrers(*firsts.values()):
        if ref is tensors or isinstance(ref, types.FrameType) or ref is firsts or isinstance(ref, dict) and ref is held:
            continue
        for inner in gc.get_referents(ref):
            if id(inner) in wanted:
                held.setdefault(id(inner), []).append(ref)
    out: dict[int, str] = {}
    named: dict[int, str] = {}
    for key, t in firsts.items():
        what = f"a tensor with grad_fn {type(t.grad_fn).__name__}" if t.grad_fn is not None else "a tensor"
        for ref in held.get(id(t), []):
            direct = _name_of(t, ref)
            if direct:
                out[key] = f"{what} {direct}"
                break
            if isinstance(ref, (list, dict, set, tuple)):
                if id(ref) not in named:
                    named[id(ref)] = _named(ref, type(ref).__name__)
                out[key] = f"{what} in {named[id(ref)]}"
                break
        else:
            out[key] = what + " referenced from outside any list or dict"
    return out


def _named(container, kind: str) -> str:
    """`list losses (job.py:14: losses.append(loss))` when a module-level name or an attribute holds it; an
    attribute is named with its object's class and, where a module-level name holds that object, that name
    (`list outputs (attribute of Engine `engine` in module app.py; grows at ...)`)."""
    for ref in gc.get_referrers(container):
        if isinstance(ref, dict):
            module = next((m for m in list(sys.modules.values()) if getattr(m, "__dict__", None) is ref), None)
            owner = None if module is not None else next(
                (o for o in gc.get_referrers(ref) if getattr(o, "__dict__", None) is ref), None)
            namespace = ref
        elif isinstance(getattr(ref, "__dict__", None), dict):  # an object whose attributes live inline (3.11+)
            module, owner, namespace = None, ref, ref.__dict__
        else:
            continue
        for name, value in list(namespace.items()):
            if value is container:
                if module is not None:
                    where, line = f"module {_module_name(module)}", _grows_at(module, name)
                else:
                    where = _attribute_of(owner)
                    line = _grows_at(sys.modules.get(type(owner).__module__) if owner is not None else None, name)
                return f"{kind} `{name}` ({where}{'; grows at ' + line if line else ''})"
    return f"a {kind}"


def _name_of(value, ref) -> str:
    """Where `ref` holds `value` under a name of its own: a module-level name (`` `KV` (module app.py) ``) or an
    object's attribute (`` in attribute `kv` (attribute of ...) ``); "" where `ref` is no namespace."""
    namespace = ref if isinstance(ref, dict) else getattr(ref, "__dict__", None)
    if not isinstance(namespace, dict):
        return ""
    module = next((m for m in list(sys.modules.values()) if getattr(m, "__dict__", None) is namespace), None)
    owner = ref if namespace is not ref else next(
        (o for o in gc.get_referrers(namespace) if getattr(o, "__dict__", None) is namespace), None)
    if module is None and owner is None:
        return ""
    name = next((n for n, v in list(namespace.items()) if v is value), None)
    if name is None:
        return ""
    if module is not None:
        return f"`{name}` (module {_module_name(module)})"
    return f"in attribute `{name}` ({_attribute_of(owner)})"


def _module_name(module: types.ModuleType) -> str:
    """A module as the user knows it: a file memfit loaded by path by its file, any other by its name."""
    path = getattr(module, "__file__", None)
    return short_path(path) if module.__name__.startswith("memfit_user_") and path else module.__name__


def _attribute_of(owner) -> str:
    """"attribute of Engine `engine` in module app.py" for the object `owner`."""
    if owner is None:
        return "an object's attribute"
    for module in list(sys.modules.values()):
        for name, value in list(getattr(module, "__dict__", {}).items()):
            if value is owner:
                return f"attribute of {type(owner).__name__} `{name}` in module {_module_name(module)}"
    return f"attribute of a {type(owner).__name__} object"


def _grows_at(module: types.ModuleType | None, name: str) -> str:
    """The first line of the module's source that adds to `name` (append, extend, +=, item assignment)."""
    path = getattr(module, "__file__", None)
    if not path:
        return ""
    grows = r"\.\s*(append|extend|insert|add|update|setdefault)\s*\(|\+=|\[.*\]\s*="
    pattern = re.compile(rf"\b{re.escape(name)}\s*({grows})")
    try:
        with open(path, encoding="utf-8") as f:
            for number, text in enumerate(f, 1):
                if pattern.search(text):
                    return f"{short_path(path)}:{number}: {text.strip()}"
    except OSError:
        pass
    return ""


def _explain(holders: list[str | None], unit: str = "step") -> tuple[str, str]:
    """What keeps a leak alive and the fix, from the holders of its storages (None: no Python tensor holds it,
    autograd's graph does); `unit` is what repeats (a training step, a served request)."""
    known = [h for h in holders if h]
    if not known:
        return ("an autograd graph that something still references (its saved tensors have no Python name)",
                "keep `.item()` or `.detach()` of what you store, not tensors that carry grad_fn")
    holder = max(set(known), key=known.count)
    if "grad_fn" in holder and unit == "request":
        return holder, ("serve under torch.inference_mode() (or no_grad) and keep `.tolist()` or `.detach()` of "
                        "results: a tensor with grad_fn keeps its autograd graph, and the activations it saved, alive")
    if "grad_fn" in holder:
        return holder, ("store `loss.item()` (a number) or `loss.detach()` instead: the tensor keeps its autograd "
                        "graph, and every tensor that graph references, alive")
    if " in dict" in holder:
        return holder, f"the dict gains an entry every {unit}: bound the cache or clear it"
    if " in list" in holder or " in deque" in holder or " in set" in holder:
        return holder, f"the container gains a tensor every {unit}: keep a number (`.item()`) or clear it"
    return holder, f"a new tensor is kept every {unit}: drop the reference when the {unit} ends, or bound what is kept"


# ---------------------------------------------------------------------------------------- a serving process
#
# "My service's GPU memory is never released": after the requests the memory stays, and the question is whose it
# is. Three owners, told apart by measurement: tensors a request leaves behind that something keeps (each request
# adds more: a holder to name), tensors kept once and reused (a cache built on the first request: held, not
# growing), and memory that no tensor holds any more but the allocator keeps for the next request (CUDA's caching
# allocator: reserved but not allocated; on a CPU, freed blocks that the C library's malloc keeps).

SERVE_WARMUP = 2  # requests whose tensors may stay: a model loaded on first use, a cache made once


@dataclasses.dataclass
class Kept:
    """Tensors made during the requests and alive after the last one, made at one line."""
    source: str            # "file:line in function" ("" where no line of Python made them)
    bytes: int             # alive after the last request
    tensors: int
    requests: list[int]    # the requests that made them
    grows: bool            # made by most requests after warm-up: memory grows with every request
    holder: str
    fix: str

    @property
    def bytes_per_request(self) -> int:
        return self.bytes // max(1, len(self.requests))


@dataclasses.dataclass
class ServeReport:
    handler: str
    device: str                    # the device whose tensors were watched: "cpu" or "cuda"
    before: int                    # tensor bytes alive before the first request (the model)
    live_after: list[int]          # bytes of tensors made by the requests, alive after each request
    kept: list[Kept]
    process_after: list[int]       # CUDA: torch.cuda.memory_reserved(); CPU: resident set size (0: unknown)
    allocated_after: list[int]     # CUDA: torch.cuda.memory_allocated(); CPU: empty
    trimmed: int | None = None     # CPU: what malloc_trim(0) gave back after the last request
    snapshot: object = None        # CUDA: memory.snapshot.SnapshotReport of the allocator after the last request

    @property
    def requests(self) -> int:
        return len(self.live_after)

    @property
    def growing(self) -> list[Kept]:
        return [k for k in self.kept if k.grows]

    def render(self) -> str:
        lines = [f"{self.handler}: {self.requests} requests watched on {self.device}; tensors alive before the first "
                 f"{fmt_bytes(self.before)} (the model and what the module made on import); tensors made by the "
                 f"requests and alive after them: {fmt_bytes(self.live_after[0])} after request 1 -> "
                 f"{fmt_bytes(self.live_after[-1])} after request {self.requests}"]
        for k in self.kept:
            where = k.source or "no line of Python (a library's own thread or C++)"
            if k.grows:
                lines.append(f"GROWS {fmt_bytes(k.bytes_per_request)} a request ({k.tensors} tensor(s) from "
                             f"{len(k.requests)} of {self.requests} requests) made at {where}")
            else:
                made = ", ".join(map(str, k.requests))
                lines.append(f"HELD {fmt_bytes(k.bytes)}, not growing ({k.tensors} tensor(s) made in request(s) "
                             f"{made}) at {where}")
            lines.append(f"  kept by {k.holder}")
            lines.append(f"  fix: {k.fix}")
        if not self.growing:
            lines.append("no growth: no request after the first ones left tensors of its own alive")
        lines += allocator_lines(self)
        return "\n".join(lines)


def allocator_lines(r: ServeReport) -> list[str]:
    """What the memory that no tensor holds is, from the figures measured after the requests."""
    if r.device == "cuda":
        if not r.process_after:
            return []
        reserved, allocated = r.process_after[-1], r.allocated_after[-1]
        cached = reserved - allocated
        out = [f"CUDA caching allocator after request {r.requests}: {fmt_bytes(reserved)} reserved, "
               f"{fmt_bytes(allocated)} allocated to tensors, {fmt_bytes(cached)} cached (reserved, no tensor in it; "
               f"nvidia-smi counts it as this process's, with the CUDA context)"]
        if cached > 0:
            released = r.snapshot.releasable if r.snapshot is not None else None
            out.append("  the cache is not a leak: the allocator keeps freed blocks to hand to the next request "
                       "without a cudaMalloc" + (f"; torch.cuda.empty_cache() would return {fmt_bytes(released)} of "
                                                f"it to the driver (segments with no live block)" if released is not None
                                                else "") + ", which helps other processes, not this one")
            out.append("  every worker process (gunicorn -w N) holds its own CUDA context and its own cache: N workers "
                       "on one GPU hold N of them; one worker per GPU, or torch.cuda.set_per_process_memory_fraction "
                       "to cap each")
        if r.snapshot is not None:
            out += [f"  {a}" for a in r.snapshot.advice]
        return out
    rss = [n for n in r.process_after if n]
    if not rss:
        return ["CPU: PyTorch's CPU allocator caches nothing but pinned memory (every other freed tensor goes back to "
                "malloc); the process's resident memory could not be read here"]
    out = [f"process resident memory: {fmt_bytes(rss[0])} after request 1 -> {fmt_bytes(rss[-1])} after request "
           f"{len(rss)} (PyTorch's CPU allocator caches nothing but pinned memory: a freed tensor goes back to malloc)"]
    if r.trimmed is not None:
        out.append(f"  malloc_trim(0) after the last request gave back {fmt_bytes(r.trimmed)}: memory freed in this "
                   "process (freed tensors among it) that glibc's malloc had kept for reuse, not a leak; "
                   "MALLOC_TRIM_THRESHOLD_ and MALLOC_MMAP_THRESHOLD_ make malloc give such memory back sooner")
    return out


def load_handler(spec: str):
    """The request handler `spec` names: `path/to/file.py:function` or `package.module:function`; called with no
    arguments, once a request. A file's folder goes on sys.path, as `python file.py` puts it."""
    import importlib
    import importlib.util
    from pathlib import Path

    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ConfigError(f"--serve {spec}: name the handler as file.py:function or module:function")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise WorkloadError(f"no such handler file: {path}")
            if str(path.resolve().parent) not in sys.path:
                sys.path.insert(0, str(path.resolve().parent))
            module_name = f"memfit_user_{path.stem}"
            found = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(found)
            sys.modules[module_name] = module
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except WorkloadError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's module, in one line
        raise WorkloadError(f"{where} raised while importing: {first_line(e)}") from None
    handler = getattr(module, name, None)
    if not callable(handler):
        raise WorkloadError(f"{where} has no function {name!r}")
    return handler


def watch_service(handler, requests: int = 20, name: str | None = None, device: str | None = None) -> ServeReport:
    """Call `handler()` `requests` times in this process, as a server's worker calls its view, and report the
    tensors each request leaves alive (grouped by the line that made them, with what keeps them) and the memory
    the allocator keeps after them. Tensors are followed on this thread, on `device` ("cuda" where a GPU is
    there, else "cpu")."""
    if requests < SERVE_WARMUP + 3:
        raise ConfigError(f"--requests {requests}: the serving doctor needs at least {SERVE_WARMUP + 3} requests "
                          f"({SERVE_WARMUP} to warm up, then requests to compare)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    name = name or getattr(handler, "__qualname__", "handler")
    tracker = LiveBytes(device)
    # what exists already (the model's weights) is counted as there before: a request's view of a weight (a Linear's
    # transpose) is not a new tensor
    tracker.track(_existing_tensors(device))
    base = tracker.current
    before = torch.cuda.memory_allocated() if device == "cuda" else base
    born: dict[int, int] = {}
    live_after, process_after, allocated_after = [], [], []
    try:
        for r in range(1, requests + 1):
            first = len(tracker.events)
            with tracker:
                try:
                    handler()
                except Exception as e:  # noqa: BLE001 - the user's handler, in one line
                    raise WorkloadError(f"{name} raised on request {r}: {first_line(e)}") from None
            gc.collect(1 if r < requests else 2)  # a request's own cycles are young; once in full at the end
            for key, delta in tracker.events[first:]:
                if delta > 0:
                    born.setdefault(key, r)
            live_after.append(tracker.current - base)
            if device == "cuda":
                torch.cuda.synchronize()
                process_after.append(torch.cuda.memory_reserved())
                allocated_after.append(torch.cuda.memory_allocated())
            else:
                process_after.append(_resident_bytes())
    finally:
        tracker.close()
    kept = _kept(tracker, born, requests)
    report = ServeReport(name, device, before, live_after, kept, process_after, allocated_after)
    if device == "cuda":
        from memfit.memory.snapshot import explain_snapshot
        from memfit.torch_internals import memory_snapshot

        report.snapshot = explain_snapshot(memory_snapshot(), device=torch.cuda.current_device())
    else:
        report.trimmed = _trimmed()
    return report


def _kept(tracker: LiveBytes, born: dict[int, int], requests: int) -> list[Kept]:
    watched = range(SERVE_WARMUP + 1, requests + 1)
    groups: dict[str, list[int]] = {}
    for key, nbytes in tracker.live.items():
        if nbytes and key in born:
            info = tracker.infos[key]
            groups.setdefault(info.source or f"{info.op} in {info.module}", []).append(key)
    holders = _holders(tracker, {k for keys in groups.values() for k in keys})
    out = []
    for source, keys in groups.items():
        made = sorted({born[k] for k in keys})
        grows = sum(r in watched for r in made) >= PERSISTENT * len(watched)
        holder, fix = _explain([holders.get(k) for k in keys], "request")
        if not grows:
            holder = holder.replace("; grows at ", "; filled at ")
            fix = ("none needed if this is a cache the service means to keep (it does not grow); if it is one "
                   "request's result, drop the reference when the request ends")
        out.append(Kept(source if tracker.infos[keys[0]].source else "", sum(tracker.live[k] for k in keys), len(keys),
                        made, grows, holder, fix))
    out.sort(key=lambda k: (not k.grows, -k.bytes))
    return out


def _existing_tensors(device: str) -> list[torch.Tensor]:
    """Every dense tensor on `device` that Python can reach now."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on every object wakes deprecated attributes
        return [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and type(o) in (torch.Tensor,
                torch.nn.Parameter) and o.device.type == device and o.layout is torch.strided]


def _resident_bytes() -> int:
    """This process's resident set size (Linux's /proc; 0 where it cannot be read)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _trimmed() -> int | None:
    """What glibc's malloc_trim(0) gives back to the system now (None where there is no glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    before = _resident_bytes()
    trim(0)
    after = _resident_bytes()
    return max(0, before - after) if before else None
