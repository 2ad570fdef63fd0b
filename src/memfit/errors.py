"""Every error memfit raises on purpose derives from `MemfitError`, so `except memfit.MemfitError` catches
what memfit refuses or cannot do, and nothing else. Each class says which stage refused; the message is
one line that says why (the CLI prints it and exits 2)."""
from __future__ import annotations


class MemfitError(Exception):
    """Base class of memfit's errors."""


class ConfigError(MemfitError, ValueError):
    """A configuration that cannot be applied to this model or device; raised before anything changes."""


class WorkloadError(MemfitError):
    """The user's workload could not be loaded or does not behave as the contract says."""


class EstimateError(MemfitError):
    """The step could not be traced, measured or extrapolated."""


class PlanError(MemfitError):
    """Nothing fits, or the request cannot be planned; the message says what would make it fit."""


class CheckpointError(MemfitError):
    """A checkpoint that cannot be written, loaded or applied; the message names the file or the keys."""


class RunError(MemfitError):
    """The run cannot go on; the message says which checkpoint is intact."""
