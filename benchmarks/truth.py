"""Independent ground truth: the peak of a real CPU training step as the PyTorch profiler's memory
timeline sees it. Shares no counting code with memfit (only the step being measured)."""
from __future__ import annotations

import gc

import torch
from torch.profiler import ProfilerActivity, profile


def profiler_peak(fn) -> int:
    """Run fn() under the profiler and return the peak of CPU-allocator bytes, pre-existing included."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        fn()
    current = peak = 0
    for _, action, _, nbytes in prof._memory_profile().timeline:
        name = getattr(action, "name", str(action))
        if name in ("PREEXISTING", "CREATE"):
            current += nbytes
        elif name == "DESTROY":
            current -= nbytes
        peak = max(peak, current)
    return peak


def real_step_peak(workload, config) -> int:
    """Warm-up step, then the profiled step on a fresh global batch: the step memfit.estimate predicts."""
    from memfit.step import TrainStep

    torch.manual_seed(0)
    step = TrainStep(workload, config, "cpu")
    step(workload.batch(config.global_batch))
    batch = workload.batch(config.global_batch)
    return profiler_peak(lambda: step(batch))
