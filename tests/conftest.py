import json
import os
import tempfile
import time
from pathlib import Path

import pytest

from memfit.memory import kernels

STORED = Path(__file__).parent / "data"


def pytest_configure(config):
    """The suite runs as on a new machine: memfit's caches (this CPU's calibration, measured kernel
    workspaces) start empty in a folder of the run's own, as in CI, so nothing measured by an earlier run
    or an older memfit can hide a fault in measuring. Step times come from a calibration stored with the
    tests (tests/data: measured on the 2-core Xeon the suite is developed on, at 2 threads and 1, the count
    test_train.py and `memfit train` subprocesses run with), written into that cache for this machine: the
    planner's choices then do not follow this machine's speed or load, and no test waits ~10 s for the
    calibration its thread count needs. `memfit calibrate` itself runs for real in test_readme.py (in its
    own cache), and the calibration's rules are tested in test_planner.py. A stored profile that this memfit
    no longer reads is measured here instead."""
    os.environ["MEMFIT_CACHE"] = tempfile.mkdtemp(prefix="memfit-test-cache-")
    os.environ["MEMFIT_TRACE_CACHE"] = "0"  # every test traces; tests/test_trace_cache.py turns it on
    import torch

    from memfit.memory.devices import get_device
    from memfit.planner.costmodel import PROFILE_VERSION, Profile, cpu_key, machine, profile_for, save_profile
    threads = torch.get_num_threads()
    for n in sorted({threads, 1}, reverse=True):
        torch.set_num_threads(n)
        stored = json.loads((STORED / f"profile-cpu-{min(n, 2)}threads.json").read_text())
        if stored.get("version") != PROFILE_VERSION:
            profile_for(get_device("cpu"))
            continue
        profile = Profile(**stored)
        profile.machine, profile.measured_at = machine("cpu"), time.time()
        profile.source = "stored with memfit's tests (tests/data), measured on the 2-core Xeon they are developed on"
        save_profile(profile, cpu_key())
    torch.set_num_threads(threads)


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, peft, the test modules) lives for the whole run: it is
    frozen out of the garbage collector's way. Each full collection otherwise walked ~1.1 M objects (0.4 s;
    173 of them took 72 s of a 580 s run). memfit's forked children freeze what they inherit on their own
    and leave the parent's freeze alone."""
    import gc

    gc.collect()
    gc.freeze()


@pytest.fixture
def without_cpu_workspaces(monkeypatch):
    """The CPU target's oneDNN workspaces (bf16 matmul scratchpads) are measured on the processor that runs the
    test and differ between processors (AVX512-BF16/AMX or not); a test comparing what the CPU and GPU targets'
    policies keep counts none on the CPU side."""
    monkeypatch.setattr(kernels.CpuWorkspaces, "__call__", lambda self, func, args, kwargs, out: 0)
