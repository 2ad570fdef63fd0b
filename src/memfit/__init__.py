"""memfit: fit a PyTorch training run into the memory you have, and run it as fast as that memory allows.

Public API: Workload, Config, estimate, plan, Trainer, train (and the `memfit` command).
"""
from importlib import metadata as _metadata

from memfit.config import Config, ConfigError
from memfit.memory.estimate import Estimate, EstimateError, estimate
from memfit.planner.search import Plan, PlanError, plan
from memfit.runtime.run import RunError, train
from memfit.runtime.trainer import Trainer
from memfit.step import TrainStep
from memfit.workload import Workload
from memfit.workloads import load_workload
from memfit.errors import WorkloadError

__all__ = ["Plan", "PlanError", "RunError", "plan", "train", "Config", "ConfigError", "Estimate", "EstimateError", "TrainStep", "Trainer", "Workload", "WorkloadError", "estimate",
           "load_workload"]
try:
    __version__ = _metadata.version("memfit")  # pyproject.toml is the one place the version is written
except _metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "unknown (not installed)"
