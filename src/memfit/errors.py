"""Every error memfit raises on purpose derives from `MemfitError`, so `except memfit.MemfitError` catches
what memfit refuses or cannot do, and nothing else. Each class says which stage refused; the message is
one line that says why (the CLI prints it and exits 2)."""
from __future__ import annotations

import functools
import os
import sys
import sysconfig


class MemfitError(Exception):
    """Base class of memfit's errors."""


class ConfigError(MemfitError, ValueError):
    """A configuration that cannot be applied to this model or device; raised before anything changes."""


class LossChunkError(ConfigError):
    """The workload's loss cannot be computed in chunks (Config.loss_chunks): the planner then leaves chunking out."""


class WorkloadError(MemfitError):
    """The user's workload could not be loaded or does not behave as the contract says."""


class MicroBatchError(WorkloadError):
    """The model cannot train at this micro-batch, though it trains at a larger one: batch statistics of a
    single sample (BatchNorm whose features reach 1x1, any BatchNorm1d) are the common case."""

    def __init__(self, workload: str, micro_batch: int, smallest: int, reason: str):
        self.workload, self.micro_batch, self.smallest, self.reason = workload, micro_batch, smallest, reason
        super().__init__(f"{workload} cannot train at micro-batch {micro_batch} ({reason}); the smallest "
                         f"micro-batch it trains at is {smallest}")

    def __reduce__(self):  # crosses from a tracing child to the parent by pickle
        return MicroBatchError, (self.workload, self.micro_batch, self.smallest, self.reason)


class EstimateError(MemfitError):
    """The step could not be traced, measured or extrapolated."""


class HostMemoryError(EstimateError):
    """Fake tensors could not follow the step, and a real CPU step to measure instead might not fit in a safe
    share of the host's free memory, so none was run. `partial` is what could be traced: the state floor and
    how far the fake step got (plain data, so it crosses from a tracing child)."""

    def __init__(self, message: str, partial: dict | None = None):
        self.partial = partial or {}
        super().__init__(message)

    def __reduce__(self):
        return HostMemoryError, (str(self), self.partial)


class PlanError(MemfitError):
    """Nothing fits, or the request cannot be planned; the message says what would make it fit."""


class CheckpointError(MemfitError):
    """A checkpoint that cannot be written, loaded or applied; the message names the file or the keys."""


class RunError(MemfitError):
    """The run cannot go on; the message says which checkpoint is intact."""


# ------------------------------------------------------------------------------------------ one line


def first_line(e: BaseException) -> str:
    """`e` as a clause of one line, for a message that wraps it: its type, its message's first line and, when
    the user's own code raised it, where ("ValueError: bad shape (job.py:42 in forward)")."""
    text = str(e).strip()
    line = f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__
    where = raised_at(e)
    return f"{line} ({where})" if where else line


def raised_at(e: BaseException) -> str:
    """Where the user's own code raised `e`, "job.py:42 in forward": the innermost frame of its traceback that
    is not torch, Python's library, an installed package or memfit; "" where none is. A traceback does not
    cross a pickle, so a forked tracing child records the answer on the error (`memfit_raised_at`) before it
    sends it back, and that answer is the one given."""
    if hasattr(e, "memfit_raised_at"):
        return e.memfit_raised_at
    where, tb = "", e.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if _users_code(code.co_filename):
            where = f"{short_path(code.co_filename)}:{tb.tb_lineno} in {code.co_name}"
        tb = tb.tb_next
    return where


_MEMFIT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")


def _users_code(filename: str) -> bool:
    """Whether `filename` is the user's own code (their model, loss, batch), whose line they can act on."""
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    path = os.path.abspath(filename)
    if {"site-packages", "dist-packages"} & set(path.split(os.sep)):
        return False
    torch = sys.modules.get("torch")  # a source build of torch is not in site-packages
    theirs = (_MEMFIT, _STDLIB, *([os.path.join(os.path.dirname(torch.__file__), "")] if torch else []))
    return not path.startswith(theirs)


def short_path(filename: str) -> str:
    """A source file as memfit prints it: an installed package's from its package folder on; else relative
    to the working directory when under it, else its folder and name."""
    return _short_path(filename, os.getcwd())


@functools.lru_cache(maxsize=4096)  # asked for every allocation a traced step makes, of a few hundred files
def _short_path(filename: str, cwd: str) -> str:
    path = os.path.abspath(os.path.join(cwd, filename))
    parts = path.split(os.sep)
    for folder in ("site-packages", "dist-packages"):  # an installed package (a virtualenv under cwd too)
        if folder in parts:
            return os.sep.join(parts[len(parts) - parts[::-1].index(folder):])
    cwd = os.path.join(cwd, "")
    if path.startswith(cwd):
        return path[len(cwd):]
    return os.sep.join(parts[-2:])
