"""`memfit plan --verify`: run the plan for a few real steps on the device and compare with the prediction."""
from __future__ import annotations

import statistics
import time

import torch

from memfit.errors import ConfigError
from memfit.memory.measure import measure_step
from memfit.planner.search import Plan
from memfit.runtime.trainer import Trainer
from memfit.workload import Workload


def verify(workload: Workload, plan: Plan, steps: int = 3) -> dict:
    if plan.device != "cpu" and not plan.device.startswith("cuda"):
        raise ConfigError(f"--verify runs the plan here; this machine is not a {plan.device} "
                          f"(plan for --device cpu or cuda to verify)")
    device = "cpu" if plan.device == "cpu" else plan.device
    trainer = Trainer(workload, plan.config, device=device)
    trainer.step()  # first step: optimizer state, allocator warm-up
    times, peak = [], 0
    if device == "cpu":  # the peak from a step of its own: the live-bytes counter slows every op down
        peak = measure_step(trainer.engine, trainer.batch())[1].bytes
        trainer.step_count += 1
    for _ in range(max(1, steps)):
        if device == "cpu":
            start = time.perf_counter()
            trainer.step()
            times.append(time.perf_counter() - start)
        else:
            torch.cuda.synchronize()
            start = time.perf_counter()
            batch = trainer.batch()
            _, measured = measure_step(trainer.engine, batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            trainer.step_count += 1
            peak = max(peak, measured.reserved)
    measured = statistics.median(times)
    return dict(predicted_peak_bytes=plan.peak_bytes, measured_peak_bytes=peak,
                predicted_step_seconds=plan.step_seconds, measured_step_seconds=measured,
                measured_samples_per_second=plan.config.global_batch / measured,
                peak_method="live tensor bytes (CPU)" if device == "cpu" else "torch.cuda.max_memory_reserved")
