"""Independent ground truth: the peak of a real CPU training step as the PyTorch profiler's memory
timeline sees it. Shares no counting code with memfit (only the step being measured)."""
from __future__ import annotations

import gc

import torch
from torch.profiler import ProfilerActivity, profile

from memfit.torch_internals import profiler_memory_timeline


def profiler_peak(fn) -> int:
    """Run fn() under the profiler and return the peak of CPU-allocator bytes, pre-existing included."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        fn()
    current = peak = 0
    for _, action, _, nbytes in profiler_memory_timeline(prof):
        name = getattr(action, "name", str(action))
        if name in ("PREEXISTING", "CREATE"):
            current += nbytes
        elif name == "DESTROY":
            current -= nbytes
        peak = max(peak, current)
    return peak


def real_step_peak(workload, config, repeats: int = 2) -> int:
    """Warm-up step, then profiled steps on fresh global batches: the step memfit.estimate predicts.
    The minimum over `repeats` steps: the profiler also records the odd allocation made elsewhere in the
    process while it runs (seen: +42 KB once in three runs of a 62 KB step), which only ever adds."""
    from memfit.step import TrainStep

    torch.manual_seed(0)
    step = TrainStep(workload, config, "cpu")
    step(workload.batch(config.global_batch))
    peaks = []
    for _ in range(repeats):
        batch = workload.batch(config.global_batch)
        peaks.append(profiler_peak(lambda: step(batch)))
        del batch
    return min(peaks)
