"""Run tracing in forked children: a C++ abort inside PyTorch becomes one clear EstimateError instead of
killing memfit, and fake tracing (single-threaded Python) uses every core."""
from __future__ import annotations

import contextlib
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

from memfit.errors import EstimateError
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


def run_isolated_many(fns: list[Callable], workers: int | None = None) -> list[tuple[str, object]]:
    """Run each fn in its own forked child, `workers` at a time (fake tracing is single-threaded Python,
    so children use the cores in parallel). Returns ("ok", result) or ("error", exception) per fn."""
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
            pid, status = _wait_any(running)  # only our children: a user's own subprocesses keep their status
            i, path = running.pop(pid)
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


def heap_frozen() -> bool:
    """Whether objects sit in the collector's permanent generation: in a tracing child always (its parent's
    heap), elsewhere where the process froze them itself. Asked here because counting them walks the whole
    frozen list (~60 ms in a test session's child)."""
    return _result_path is not None or gc.get_freeze_count() > 0


def _wait_any(pids) -> tuple[int, int]:
    while True:
        for pid in pids:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return done, status
        time.sleep(0.01)


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
        try:
            pickle.dumps(e)
            result = ("error", e)
        except Exception:  # not picklable: keep its name, first line and the notes memfit attached to it
            error = EstimateError(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            error.memfit_partial = getattr(e, "memfit_partial", None)
            error.memfit_workload_raised = getattr(e, "memfit_workload_raised", False)
            result = ("error", error)
    try:  # what this child's fake tensors learned about ops, for the children forked after it
        ops_seen = fast_cache_entries(cached)
    except Exception:  # noqa: BLE001 - only a speed-up
        ops_seen = None
    _write_and_exit(path, (result, ops_seen))


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
