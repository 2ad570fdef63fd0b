"""Run tracing in forked children: a C++ abort inside PyTorch becomes one clear EstimateError instead of
killing memfit, and fake tracing (single-threaded Python) uses every core."""
from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import gc
import os
import pickle
import signal
import tempfile
import threading
import time
from typing import Callable, TypeVar

import torch

from memfit.errors import EstimateError, first_line, raised_at
from memfit.torch_internals import add_fast_cache_entries, fast_cache_entries, fast_cache_size, import_dynamo
from memfit.units import fmt_bytes

T = TypeVar("T")

_result_path: str | None = None  # set in a forked child: where its result goes


def run_isolated(fn: Callable[[], T]) -> T:
    """Run `fn` in a forked child and return its result; a crash of the child becomes an EstimateError."""
    kind, value = run_isolated_many([fn], workers=1)[0]
    if kind == "error":
        raise value
    return value


def run_isolated_many(fns: list[Callable], workers: int | None = None,
                      on_done: Callable[[], None] | None = None) -> list[tuple[str, object]]:
    """Run each fn in its own forked child, `workers` at a time (fake tracing is single-threaded Python,
    so children use the cores in parallel). Returns ("ok", result) or ("error", exception) per fn;
    `on_done` is called as each child ends (a progress line)."""
    import_dynamo()  # fake tracing imports it on first use (~1 s): once here, not in every child
    workers = workers or os.cpu_count() or 1
    results: list = [None] * len(fns)
    running: dict[int, tuple[int, str]] = {}
    with tempfile.TemporaryDirectory(prefix="memfit-") as tmp:
        pending = list(enumerate(fns))
        while pending or running:
            while pending and len(running) < workers:
                i, fn = pending.pop(0)
                path = os.path.join(tmp, f"{i}.pkl")
                collecting = gc.isenabled()
                gc.disable()  # until the child has frozen what it inherits (see _child)
                try:
                    pid = os.fork()
                    if pid == 0:
                        try:
                            _child(fn, path, collecting)  # ends the process itself
                        finally:
                            os._exit(1)  # never back into the caller's code in the child
                finally:
                    if collecting:
                        gc.enable()
                running[pid] = (i, path)
            pid, status, stalled = _wait_any(running)  # only ours: a user's own subprocesses keep their status
            i, path = running.pop(pid)
            if on_done is not None:
                on_done()
            if stalled:
                results[i] = ("error", EstimateError(
                    f"the tracing child stopped making progress (no CPU time for {STALL_SECONDS:.0f} s) and was "
                    "ended: most likely a lock another thread of this process held when it was forked"))
                continue
            if os.WIFSIGNALED(status):
                sig = signal.Signals(os.WTERMSIG(status)).name
                hint = " (killed: out of host memory?)" if sig == "SIGKILL" else ""
                results[i] = ("error", EstimateError(f"PyTorch crashed with {sig}{hint} while tracing the training step"))
                continue
            with open(path, "rb") as f:
                results[i], ops_seen = pickle.load(f)
            if ops_seen:
                add_fast_cache_entries(ops_seen)
    return results


MAX_VALUE_BRANCHES = 3  # per traced step and path: at most 2**3 traces of one step


@dataclasses.dataclass
class Ways:
    """What the ways traced from one point of a step gave: the result with the largest peak (None: each
    way raised), the sites branched on, each finished way's peak, and what each way that raised said."""
    best: object | None
    sites: list[str]
    peaks: list[int]
    raised: list[str]


class ValueBranches:
    """A traced step that branches on a value fake tensors lack (`if x.min() > eps:` on activations, as
    I-BERT's quantisers do), traced both ways. Only in a forked tracing child: at each such branch it
    forks again, the new process takes the `False` way and this one waits for it to finish the step, then
    takes `True`; `join` keeps the result with the larger peak. A way whose own code raises (`assert
    x.min() >= 0`) is dropped, as a step that trains goes the other way; if every way raises, the error
    stands. A branch past MAX_VALUE_BRANCHES on one path fails the trace with an EstimateError that says so;
    outside a child (the caller's own process is never forked) the op raises as it would without this.
    Either way the estimate falls back."""

    def __init__(self):
        self.taken: list[tuple[str, Ways]] = []  # (site, what the False way gave) of each branch taken here
        self.depth = 0  # branches on this process's path, its ancestors' included
        self.result_path: str | None = None  # in a process forked at a branch: where its Ways go

    def branch(self, site: str) -> bool | None:
        """The answer to take at `site`; None outside a tracing child (the op raises as without this)."""
        if _result_path is None:
            return None
        if self.depth >= MAX_VALUE_BRANCHES:
            raise EstimateError(f"the step branches on values fake tensors lack more than {MAX_VALUE_BRANCHES} "
                                f"times on one path (at {site})")
        path = f"{_result_path}.branch{os.getpid()}-{len(self.taken)}"
        collecting = gc.isenabled()
        gc.disable()
        try:
            pid = os.fork()
            if pid == 0:
                self.taken, self.depth, self.result_path = [], self.depth + 1, path
                return False
        finally:
            if collecting:
                gc.enable()
        _, status = os.waitpid(pid, 0)
        if not os.WIFEXITED(status) or not os.path.exists(path):
            raise EstimateError(f"the trace of the other way at {site} ended without a result")
        with open(path, "rb") as f:
            kind, value = pickle.load(f)
        os.unlink(path)
        if kind == "error":  # refused further down, or memfit's own failure: nothing can be bounded
            raise value
        self.depth += 1
        self.taken.append((site, value))
        return True

    def join(self, run: Callable, peak: Callable, droppable: Callable[[BaseException], bool]) -> Ways:
        """`run()` (the rest of this way's step), then the ways forked from it. In a forked way, hand the
        Ways to the process waiting for it and end; where every way raised, raise this one's error."""
        try:
            result = run()
            ways = Ways(result, [], [peak(result)], [])
        except Exception as e:
            if not (droppable(e) and (self.taken or self.result_path is not None)):
                raise
            error, ways = e, Ways(None, [], [], [first_line(e)])
        for site, way in self.taken:
            ways.sites += [site, *way.sites]
            ways.peaks += way.peaks
            ways.raised += way.raised
            if way.best is not None and (ways.best is None or peak(way.best) > peak(ways.best)):
                ways.best = way.best
        if self.result_path is not None:
            _write_and_exit(self.result_path, ("ok", ways))
        if ways.best is None:
            raise error
        return ways


_branches: ValueBranches | None = None  # the traced step now running in this process, if any


@contextlib.contextmanager
def value_branches():
    """Around one traced step and the result made of it (see ValueBranches); a forked way that raises
    hands the error back instead of returning into the step's callers."""
    global _branches
    outer, _branches = _branches, ValueBranches()
    try:
        yield _branches
        if _branches.result_path is not None:  # a forked way ends in join(); never back into the callers
            _write_and_exit(_branches.result_path, ("error", EstimateError("a traced way ended without a result")))
    except BaseException as e:
        if _branches.result_path is not None:
            _write_and_exit(_branches.result_path, ("error", _picklable(e)))
        raise
    finally:
        _branches = outer


def branch(site: str) -> bool | None:
    """The way to take at a branch on a value fake tensors lack, or None (refused): see ValueBranches."""
    return _branches.branch(site) if _branches is not None else None


def heap_frozen() -> bool:
    """Whether objects sit in the collector's permanent generation: in a tracing child always (its parent's
    heap), elsewhere where the process froze them itself. Asked here because counting them walks the whole
    frozen list (~60 ms in a test session's child)."""
    return _result_path is not None or gc.get_freeze_count() > 0


STALL_SECONDS = 120.0  # a tracing child (with whatever it forked) that used no CPU this long is stuck
_STALL_CHECK_SECONDS = 5.0


def _wait_any(pids) -> tuple[int, int, bool]:
    """(pid, status, stalled) of the first of `pids` to end. A child whose process tree uses no CPU for
    STALL_SECONDS is ended (with its tree) and reported stalled: a fork copies only the forking thread, so a
    lock another thread held at that moment (a print's, a library's) is never released in the child, which
    then waits for ever at 0% CPU, and so would this process. Tracing is CPU-bound; what a child waits for
    (a way forked at a value branch, the kernel-measuring helper it started) is in its tree, and the
    measuring helper another child started answers within seconds."""
    stalls = _Stalls()
    while True:
        for pid in pids:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return done, status, False
        stuck = stalls.check(pids)
        if stuck is not None:
            _, status = os.waitpid(stuck, 0)
            return stuck, status, True
        time.sleep(0.01)


class _Stalls:
    """The CPU time each child's process tree has used, read from /proc every _STALL_CHECK_SECONDS; where
    there is no /proc, nothing is ever stalled."""

    def __init__(self):
        self.last_check = time.monotonic()
        self.seen: dict[int, tuple[int, float]] = {}  # pid: (CPU ticks of its tree, when they last grew)

    def check(self, pids) -> int | None:
        """A child whose tree stalled, killed with its tree (its status still to be collected), or None."""
        now = time.monotonic()
        if now - self.last_check < _STALL_CHECK_SECONDS:
            return None
        if now - self.last_check > 3 * _STALL_CHECK_SECONDS:  # this process was stopped or starved too:
            self.seen.clear()  # the children's silence meanwhile says nothing
        self.last_check = now
        table = _processes()
        if not table:
            return None
        children: dict[int, list[int]] = {}
        for p, (parent, _) in table.items():
            children.setdefault(parent, []).append(p)
        for pid in pids:
            tree, todo = [], [pid]
            while todo:
                tree.append(todo.pop())
                todo += children.get(tree[-1], [])
            ticks = sum(table[p][1] for p in tree if p in table)
            before = self.seen.get(pid)
            if before is None or ticks != before[0]:
                self.seen[pid] = (ticks, now)
            elif now - before[1] >= STALL_SECONDS:
                for p in tree:
                    with contextlib.suppress(OSError):
                        os.kill(p, signal.SIGKILL)
                return pid
        return None


def _processes() -> dict[int, tuple[int, int]]:
    """{pid: (parent pid, CPU ticks of the process and of its children it has waited for)} from /proc."""
    out = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # (the command, in parentheses, may hold spaces)
        except (OSError, IndexError):
            continue  # (it ended meanwhile)
        out[int(name)] = (int(fields[1]), sum(int(x) for x in fields[11:15]))  # ppid; utime stime cutime cstime
    return out


def _child(fn: Callable, path: str, collecting: bool) -> None:
    """Run in the forked child. It freezes everything it inherited before its collector may run, so the
    collector never finalises the parent's garbage: a DDP reducer left in a cycle by the user (or an earlier
    test) would join its gloo threads, which do not exist after a fork, and hang the child for ever. (The
    parent's own frozen objects, if it froze any, stay frozen in the parent.)"""
    gc.freeze()
    if collecting:
        gc.enable()
    global _result_path
    _result_path = path
    cached = fast_cache_size()
    torch.set_num_threads(1)  # an OpenMP pool does not survive fork; one thread never enters it
    faulthandler.disable()  # a crash is reported by the parent, in one line
    try:
        result = ("ok", fn())
    except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
        result = ("error", _picklable(e))
    try:  # what this child's fake tensors learned about ops, for the children forked after it
        ops_seen = fast_cache_entries(cached)
    except Exception:  # noqa: BLE001 - only a speed-up
        ops_seen = None
    _write_and_exit(path, (result, ops_seen))


def _picklable(e: BaseException) -> BaseException:
    """`e` itself, or where it does not pickle an EstimateError with its name, first line and the notes
    memfit attached to it; either way with where the user's code raised it (`raised_at`), which needs the
    traceback, and that stays in this child."""
    e.memfit_raised_at = raised_at(e)
    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001 - whatever pickling raises
        error = EstimateError(first_line(e))
        error.memfit_partial = getattr(e, "memfit_partial", None)
        error.memfit_workload_raised = getattr(e, "memfit_workload_raised", False)
        return error


def _write_and_exit(path: str, result) -> None:
    """`result` is (("ok" | "error", value), the child's cache entries or None), as the parent reads it."""
    try:
        with open(path, "wb") as f:
            pickle.dump(result, f)
    finally:
        os._exit(0)


def available_host_bytes() -> int:
    """Memory the host can give without swapping: MemAvailable (free + reclaimable cache) where Linux says
    it, else the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _resident_bytes(field: str) -> int | None:
    """VmRSS (now) or VmHWM (the peak so far; a forked child's starts at its size when forked)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def host_memory_guard(limit_bytes: int, what: str, poll_s: float = 0.01):
    """Inside a child of `run_isolated`, end the child with an EstimateError as soon as its peak resident
    memory has grown by more than `limit_bytes` (polled every `poll_s`, checked once more at the end, so a
    peak between polls is caught too): a real step that turns out larger than foreseen stops long before
    the host swaps. Elsewhere (no fork, no /proc) it does nothing."""
    path, start = _result_path, _resident_bytes("VmRSS")
    if path is None or start is None:
        yield
        return
    done = threading.Event()
    error = EstimateError(f"stopped {what}: it grew past {fmt_bytes(limit_bytes)} of host memory, the safe share "
                          "of what the host had available")

    def over() -> bool:
        peak = _resident_bytes("VmHWM")
        return peak is not None and peak - start > limit_bytes

    def watch():
        while not done.wait(poll_s):
            if over():
                _write_and_exit(path, (("error", error), None))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    if over():
        raise error
