"""Run tracing in forked children: a C++ abort inside PyTorch becomes one clear EstimateError instead of
killing memfit, and fake tracing (single-threaded Python) uses every core."""
from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import tempfile
import time
from typing import Callable, TypeVar

import torch

from memfit.errors import EstimateError

T = TypeVar("T")


def run_isolated(fn: Callable[[], T]) -> T:
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
