"""Every error memfit raises on purpose derives from `MemfitError`, so `except memfit.MemfitError` catches
what memfit refuses or cannot do, and nothing else. Each class says which stage refused; the message is
one line that says why (the CLI prints it and exits 2)."""
from __future__ import annotations


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
