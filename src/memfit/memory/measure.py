"""The peak of one real training step: the one place `train` and `plan --verify` measure it.

On a CPU the peak is the live tensor bytes of the step, counted from the state it starts with (weights,
gradients, optimizer state: `TrainStep.state_tensors`), which is what an estimate predicts; the process's
memory is not. On a GPU it is what the CUDA caching allocator saw, `max_memory_allocated` and
`max_memory_reserved`, reset just before the step.
"""
from __future__ import annotations

import dataclasses

import torch

from memfit.memory.kernels import CpuWorkspaces
from memfit.memory.tracker import LiveBytes, PlainPaths


@dataclasses.dataclass(frozen=True)
class StepPeak:
    bytes: int                 # live tensor bytes (CPU), torch.cuda.max_memory_allocated (GPU)
    reserved: int | None = None  # torch.cuda.max_memory_reserved (GPU only)


def measure_step(step, batch, tracker: LiveBytes | None = None) -> tuple[torch.Tensor, StepPeak]:
    """Run `step(batch)` (a `TrainStep`) once and return its loss and peak. `tracker`: a live-bytes counter
    the caller keeps across steps (a virtual budget that raises OOM); a CPU step without one gets its own,
    which costs a few microseconds an op."""
    if step.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(step.device)
        loss = step(batch)
        return loss, StepPeak(torch.cuda.max_memory_allocated(step.device), torch.cuda.max_memory_reserved(step.device))
    counter = tracker or LiveBytes(step.device.type, detail=False, workspace=CpuWorkspaces())
    counter.track(step.state_tensors())
    counter.peak = counter.current  # a kept counter's peak is the previous step's
    counter.plain = PlainPaths()  # the counter is a dispatch mode: PyTorch then works out of place where a step does not
    with counter, counter.plain:
        loss = step(batch)
    if counter is not tracker:
        counter.close()
    return loss, StepPeak(counter.peak)
