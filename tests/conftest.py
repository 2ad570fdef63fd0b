import os
import tempfile

import pytest

from memfit.memory import kernels


def pytest_configure(config):
    """The suite runs as on a new machine: memfit's caches (this CPU's calibration, measured kernel
    workspaces) start empty in a folder of the run's own, as in CI, so nothing measured by an earlier run
    or an older memfit can hide a fault in measuring. The CPU is calibrated here, once per thread count the
    tests run at (~25 s each: this process's, and the one thread test_train.py and `memfit train` subprocesses
    run with), so that no test's time depends on whether it happens to be the first to need step times."""
    os.environ["MEMFIT_CACHE"] = tempfile.mkdtemp(prefix="memfit-test-cache-")
    import torch

    from memfit.memory.devices import get_device
    from memfit.planner.costmodel import profile_for
    threads = torch.get_num_threads()
    for n in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(n)
        profile_for(get_device("cpu"))
    torch.set_num_threads(threads)


@pytest.fixture
def without_cpu_workspaces(monkeypatch):
    """The CPU target's oneDNN workspaces (bf16 matmul scratchpads) are measured on the processor that runs the
    test and differ between processors (AVX512-BF16/AMX or not); a test comparing what the CPU and GPU targets'
    policies keep counts none on the CPU side."""
    monkeypatch.setattr(kernels.CpuWorkspaces, "__call__", lambda self, func, args, kwargs, out: 0)
