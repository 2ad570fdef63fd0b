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
from memfit.errors import ConfigError, HostMemoryError, short_path
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
    out: dict[int, str] = {}
    for t in tensors:
        key = tracker.uid(t)
        if key in out:
            continue
        what = f"a tensor with grad_fn {type(t.grad_fn).__name__}" if t.grad_fn is not None else "a tensor"
        for ref in gc.get_referrers(t):
            if ref is tensors or isinstance(ref, types.FrameType):
                continue
            container = type(ref).__name__
            if isinstance(ref, (list, dict, set, tuple)):
                out[key] = f"{what} in {_named(ref, container)}"
                break
        else:
            out[key] = what + " referenced from outside any list or dict"
    return out


def _named(container, kind: str) -> str:
    """`list losses (job.py:14: losses.append(loss))` when a module-level name or an attribute holds it."""
    for ref in gc.get_referrers(container):
        if not isinstance(ref, dict):
            continue
        module = next((m for m in list(sys.modules.values()) if getattr(m, "__dict__", None) is ref), None)
        for name, value in list(ref.items()):
            if value is container:
                owner = f"module {module.__name__}" if module is not None else "an object's attribute"
                line = _grows_at(module, name) if module is not None else ""
                return f"{kind} `{name}` ({owner}{'; grows at ' + line if line else ''})"
    return f"a {kind}"


def _grows_at(module: types.ModuleType, name: str) -> str:
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


def _explain(holders: list[str | None]) -> tuple[str, str]:
    """What keeps a leak alive and the fix, from the holders of its storages (None: no Python tensor holds it,
    autograd's graph does)."""
    known = [h for h in holders if h]
    if not known:
        return ("an autograd graph that something still references (its saved tensors have no Python name)",
                "keep `.item()` or `.detach()` of what you store, not tensors that carry grad_fn")
    holder = max(set(known), key=known.count)
    if "grad_fn" in holder:
        return holder, ("store `loss.item()` (a number) or `loss.detach()` instead: the tensor keeps its autograd "
                        "graph, and every tensor that graph references, alive")
    if " in dict" in holder:
        return holder, "the dict gains an entry every step: bound the cache or clear it"
    return holder, "the container gains a tensor every step: keep a number (`.item()`) or clear it"
