"""Batch-size advice from the gradient noise scale (McCandlish et al., 2018, "An Empirical Model of
Large-Batch Training"), measured during training from gradients the step computes anyway.

With accumulation a step computes k micro-batch gradients g_b of b samples each, and their mean G_B over
B = k b samples. A batch of n samples has E|g_n|² = |G|² + tr(Σ)/n (G the true gradient, Σ the per-sample
gradient covariance), so the two batch sizes give unbiased estimates of both (the paper's appendix A.1):

    |G|² ≈ (B |G_B|² - b |g_b|²) / (B - b)        tr(Σ) ≈ (|g_b|² - |G_B|²) / (1/b - 1/B)

and the simple noise scale B_simple = tr(Σ) / |G|², the paper's estimate of the critical batch size: well
below it a larger batch needs proportionally fewer steps for the same loss; well above it, more samples per
step buy few steps and cost compute. One step's estimates are noisy (its |G|² may even be negative), so the
scale reported is the ratio of exponential moving averages of the two, as in the paper.

It is advice: measuring reads gradients and changes nothing a step computes.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from memfit.workload import batch_size

DECAY = 0.95  # per step: the moving averages remember about the last 1 / (1 - DECAY) = 20 steps
FAR = 10  # a global batch this many times below or above the critical batch is "far" from it


@dataclasses.dataclass(frozen=True)
class NoiseSample:
    """One step's unbiased estimates. `micro_batch` is b, the harmonic mean of the micro-batch sizes (an
    uneven last one included: E of the mean of |g_j|² over micro-batches is |G|² + tr(Σ) mean(1/b_j))."""
    grad_sq: float  # |G|²
    trace: float  # tr(Σ)
    micro_batch: float
    global_batch: int


def unbiased(small_sq: float, big_sq: float, b: float, big_b: float) -> tuple[float, float]:
    """(|G|², tr(Σ)) from the mean squared norm of gradients over b samples and that of their mean over B."""
    return (big_b * big_sq - b * small_sq) / (big_b - b), (small_sq - big_sq) / (1 / b - 1 / big_b)


def _squared_norm(t: torch.Tensor):
    """|t|² in fp32 or better. On a CPU it is taken with NumPy on the tensor's memory: a CPU run's peak is
    measured by a dispatch mode that counts every tensor a torch op makes (memory/tracker.py), and a scalar of
    ours must not show up in it. Elsewhere, a device scalar: no host sync before the step ends. A sparse
    gradient (`Embedding(sparse=True)`) gives NaN: its step is not measured."""
    if t.layout != torch.strided:
        return math.nan
    if t.device.type != "cpu":
        return torch.linalg.vector_norm(t, dtype=torch.float32).square()
    if t.dtype == torch.bfloat16:  # NumPy has no bf16; its bits are the upper half of an fp32's
        a = (t.view(torch.int16).numpy().astype(np.int32) << 16).view(np.float32)
    else:
        a = t.numpy()
    a = a.astype(np.float64 if a.dtype == np.float64 else np.float32, copy=False).ravel()
    return float(np.dot(a, a))


class NoiseScale:
    """Measures the gradient noise scale of every step of `engine` (a `TrainStep`) that accumulates, on one
    rank. A hook on each trainable parameter sees a micro-batch's gradient before it is added to `.grad`
    and adds its squared norm up (a reduction: no gradient is kept); when the step reaches its optimizer,
    `.grad` holds G_B. Each micro-batch's loss is weighted by its share of the global batch (and by the loss
    scale under fp16): both are undone here.

    `last` is the newest step's `NoiseSample` (None when it did not accumulate, or its fp16 gradients
    overflowed); `b_simple` the moving-average noise scale so far. The moving averages are part of a run's
    state (`state_dict`, saved with each checkpoint): a resume that started them again from zero reported
    its first step's own ratio as the scale, a spike a hundred times the run's.
    """

    def __init__(self, engine):
        self.engine = engine
        self.last: NoiseSample | None = None
        self._averages = [0.0, 0.0]  # tr(Σ), |G|²; no start-up bias correction: it cancels in their ratio
        self._sizes: list[int] = []  # the samples of each micro-batch of the step in progress
        self._sums: list = []  # each one's squared gradient norm as the hooks saw it
        self._params = list({id(p): p for p in engine.model.parameters() if p.requires_grad}.values())
        for p in self._params:
            p.register_hook(self._micro_gradient)
        move, on_phase = engine.move, engine.on_phase

        def moved(batch, device):
            if engine.config.grad_accum > 1:
                self._sizes.append(batch_size(batch))
                self._sums.append(0.0)
            return move(batch, device)

        def entered(phase: str) -> None:
            on_phase(phase)
            if phase == "optimizer":
                self._finish()

        engine.move, engine.on_phase = moved, entered

    def reset(self) -> None:
        """Forget a step cut short (an OOM): its micro-batches are redone."""
        self._sizes, self._sums = [], []

    def state_dict(self) -> dict:
        """What a checkpoint keeps so that a resumed run's moving averages go on where they stopped."""
        return {"averages": list(self._averages)}

    def load_state_dict(self, state: dict) -> None:
        self._averages = [float(v) for v in state["averages"]]

    def replay(self, records: list[dict]) -> None:
        """The moving averages rebuilt from a run's metrics records, in step order (each measured step logs
        the estimates it added): for a checkpoint written before the averages were saved with it."""
        for r in records:
            if "noise_trace" in r:
                self._add(r["noise_trace"], r["noise_grad_sq"])

    def _add(self, trace: float, grad_sq: float) -> None:
        self._averages = [DECAY * a + (1 - DECAY) * x for a, x in zip(self._averages, (trace, grad_sq))]

    @property
    def b_simple(self) -> float | None:
        """tr(Σ) / |G|² from the moving averages; None before a step measured it or while the average |G|²
        is not positive (the gradient's mean has not stood out of its noise)."""
        trace, grad_sq = self._averages
        return trace / grad_sq if trace > 0 and grad_sq > 0 else None

    def metrics(self) -> dict:
        """The last step's figures for a run's metrics line; none when it measured nothing."""
        if self.last is None:
            return {}
        return dict(noise_grad_sq=self.last.grad_sq, noise_trace=self.last.trace, noise_scale=self.b_simple)

    def _micro_gradient(self, grad: torch.Tensor) -> None:
        if self._sums:
            self._sums[-1] = self._sums[-1] + _squared_norm(grad)

    def _finish(self) -> None:
        sizes, sums = self._sizes, self._sums
        self.reset()
        self.last = None
        if len(sizes) < 2:
            return
        e = self.engine
        scale = e.scaler.get_scale() if e.scaler is not None else 1.0
        holders = e.optimizer_offload.master if e.optimizer_offload is not None else self._params
        total = sum(sizes)
        big = sum(_squared_norm(p.grad) for p in holders if p.grad is not None)
        small = sum(s / (n / total) ** 2 for s, n in zip(sums, sizes)) / len(sizes)
        b = len(sizes) / sum(1 / n for n in sizes)
        grad_sq, trace = unbiased(float(small) / scale**2, float(big) / scale**2, b, total)
        if not (math.isfinite(grad_sq) and math.isfinite(trace)):  # fp16 gradients overflowed, or sparse ones
            return
        self.last = NoiseSample(grad_sq, trace, b, total)
        self._add(trace, grad_sq)


def _about(x: float) -> str:
    v = float(f"{x:.2g}")
    return f"{v:,.0f}" if v >= 10 else f"{v:g}"


def verdict(global_batch: int, critical: float) -> str:
    """One line: where the global batch stands against the critical batch, and what that means."""
    ratio, about = global_batch / critical, _about(critical)
    if ratio < 0.5:
        far = "far " if ratio < 1 / FAR else ""
        return (f"global batch {global_batch} is {far}below the critical batch ~{about}: a larger batch would "
                "train about as fast per step and need fewer steps")
    if ratio > 2:
        far = "far " if ratio > FAR else ""
        return (f"global batch {global_batch} is {far}above the critical batch ~{about}: smaller batches would "
                "reach the same loss with less compute")
    return (f"global batch {global_batch} is near the critical batch ~{about}: a balance of steps and compute "
            "per step")


def advice(records: list[dict], global_batch: int, gpus: int) -> dict:
    """A run report's batch-size advice from its metrics records: the critical batch (the noise scale's
    moving average at the last measured step) and the verdict. Advice only: the run was not changed by it."""
    measured = [r for r in records if "noise_scale" in r]
    critical = measured[-1]["noise_scale"] if measured else None
    if critical is not None:
        text = verdict(global_batch, critical)
    elif measured:
        text = (f"the gradient noise scale was measured over {len(measured)} steps but not resolved: the "
                "gradient's mean did not stand out of its noise")
    elif gpus > 1:
        text = "the gradient noise scale is not measured across ranks"
    else:
        text = ("the gradient noise scale was not measured: it needs gradient accumulation (a micro-batch below "
                "the global batch), which gives two batch sizes per step")
    return dict(critical_batch=critical, global_batch=global_batch, measured_steps=len(measured), verdict=text)
