"""memfit: fit a PyTorch training run into the memory you have, and run it as fast as that memory allows.

What a user needs: describe the run (`Workload`, `Config`, or `load_workload` for a built-in or a job file),
`estimate` its peak, `plan` the fastest configuration that fits, step it (`Trainer`) or `train` it whole;
`find_batch_size` for a loop of one's own, `infer` for what serving a model holds.
Every error memfit raises on purpose is a `MemfitError`; the per-stage classes are in `memfit.errors`.
"""
from importlib import metadata as _metadata

from memfit.config import Config
from memfit.errors import MemfitError
from memfit.integrations.loops import find_batch_size
from memfit.inference.serve import Inference, infer
from memfit.memory.estimate import Estimate, estimate
from memfit.planner.search import Plan, plan
from memfit.runtime.run import RunResult, train
from memfit.runtime.trainer import Trainer
from memfit.workload import Workload
from memfit.workloads import load_workload

__all__ = ["Workload", "Config", "load_workload", "estimate", "Estimate", "plan", "Plan", "Trainer", "train",
           "RunResult", "MemfitError", "infer", "Inference", "find_batch_size"]
try:
    __version__ = _metadata.version("memfit")  # pyproject.toml is the one place the version is written
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "unknown (not installed)"
