import pytest

from memfit.memory import kernels


@pytest.fixture
def without_cpu_workspaces(monkeypatch):
    """The CPU target's oneDNN workspaces (bf16 matmul scratchpads) are measured on the processor that runs the
    test and differ between processors (AVX512-BF16/AMX or not); a test comparing what the CPU and GPU targets'
    policies keep counts none on the CPU side."""
    monkeypatch.setattr(kernels.CpuWorkspaces, "__call__", lambda self, func, args, kwargs, out: 0)
