"""memfit.find_batch_size: a plain loop's micro-batch and accumulation from an estimate of its own step,
the global batch kept, the loop's real step peaking where the plan says; importing memfit imports no other
training stack."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from truth import allocator_step_peak

import memfit
from memfit.errors import ConfigError, PlanError


def _workload() -> memfit.Workload:
    return memfit.Workload(
        model=lambda: torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 10)),
        batch=lambda n: (torch.randn(n, 256), torch.randint(0, 10, (n,))),
        loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]), name="mlp")


def test_the_function_gets_a_split_of_the_global_batch_whose_real_step_fits():
    calls = []

    @memfit.find_batch_size(_workload(), global_batch=512, budget="16MiB", device="cpu")
    def train(batch_size, grad_accum, tag):
        calls.append((batch_size, grad_accum, tag))
        return "done"

    assert train("x") == "done"
    [(batch_size, grad_accum, tag)] = calls
    assert batch_size * grad_accum == 512 and grad_accum > 1 and tag == "x"
    plan = train.plan
    truth = allocator_step_peak(_workload(), plan.config)  # the loop's step, run for real
    assert truth <= plan.usable_bytes and plan.peak_bytes == truth


def test_refusals_are_one_line_and_nothing_runs():
    called = []
    run = memfit.find_batch_size(_workload(), global_batch=512, budget="1MiB", device="cpu")(called.append)
    with pytest.raises(PlanError, match="nothing fits in 1 MiB") as e:
        run()
    assert "\n" not in str(e.value) and not called
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device here: name the device"):
            memfit.find_batch_size(_workload(), global_batch=8)(called.append)()


def test_importing_memfit_imports_no_training_stack():
    code = ("import sys, memfit; memfit.find_batch_size; "
            "print(sorted(m for m in ('transformers', 'trl', 'lightning', 'accelerate') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
