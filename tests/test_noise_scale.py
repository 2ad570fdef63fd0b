"""Batch-size advice from the gradient noise scale (runtime/noise.py): measured on a linear regression whose
gradient noise is known in closed form, whatever the split of the global batch and the precision; nothing
measured without accumulation; and measuring leaves a run's math and its measured memory as they were."""
from __future__ import annotations

import functools
import json
import math
import os
import signal
import statistics

import pytest
import torch

import memfit
import models
from memfit import Config, Trainer
from memfit.memory.tracker import LiveBytes
from memfit.runtime import checkpoints as ckpt
from memfit.runtime.noise import DECAY, advice, verdict
from memfit.step import TrainStep
from memfit.workloads import builtin

# y = w*.x + eps, x ~ N(0, I_D), eps ~ N(0, SIGMA²); the model y = w.x starts at w = 0 and never moves (lr 0),
# so a = w - w* = -w*. A sample's gradient of (w.x - y)² is g = 2 r x with r = a.x - eps: E g = 2a and
# E|g|² = 4 (|a|² (D + 2) + SIGMA² D) (E[(a.x)² |x|²] = |a|² (D + 2) for a Gaussian x). Hence
# |G|² = 4 |a|², tr(Σ) = E|g|² - |G|² = 4 (|a|² (D + 1) + SIGMA² D), and B_simple = tr(Σ) / |G|².
D, SIGMA = 16, 1.0
W_STAR = torch.ones(D) / math.sqrt(D)  # |a|² = 1
A_SQ = float(W_STAR.square().sum())
GRAD_SQ = 4 * A_SQ
B_SIMPLE = ((D + 1) * A_SQ + SIGMA**2 * D) / A_SQ  # 33
STEPS = 800


def linear_regression(lr: float = 0.0) -> memfit.Workload:
    return models.linear_regression(D, SIGMA, W_STAR, lr)


@functools.cache
def measured(precision: str, micro_batch: int, grad_accum: int, global_batch: int | None = None) -> dict:
    """Every step's estimates over STEPS steps at a fixed w (an fp16 step whose gradients overflowed, which
    GradScaler skips, has none), the ratio of their means and its standard error (delta method:
    var(mean T / mean G) ~ var(T - R G) / (n mean(G)²), from the steps themselves)."""
    trainer = Trainer(linear_regression(), Config(micro_batch=micro_batch, grad_accum=grad_accum,
                                                  precision=precision), global_batch=global_batch)
    samples = []
    for _ in range(STEPS):
        trainer.step()
        if trainer.noise.last is not None:
            samples.append(trainer.noise.last)
    g = [s.grad_sq for s in samples]
    t = [s.trace for s in samples]
    ratio = statistics.fmean(t) / statistics.fmean(g)
    error = statistics.stdev([ti - ratio * gi for ti, gi in zip(t, g)]) / (math.sqrt(len(g)) * statistics.fmean(g))
    return dict(trainer=trainer, samples=samples, ratio=ratio, error=error, grad_sq=statistics.fmean(g),
                grad_sq_error=statistics.stdev(g) / math.sqrt(len(g)))


CASES = [("fp32", 8, 4, None), ("fp32", 16, 2, None), ("fp32", 8, 4, 30),  # 30: micro-batches 8, 8, 8, 6
         ("fp16", 8, 4, None), ("bf16-pure", 8, 4, None)]


def test_linear_regression_matches_the_analytic_noise_scale():
    # Each run's standard error must be under 5% for the check to mean something: the 20% tolerance is then
    # at least 4 standard errors, which a correct estimator misses by chance with probability < 1e-4.
    for case in CASES:
        m = measured(*case)
        assert len(m["samples"]) >= STEPS - 5, case  # fp16: only the first steps overflow, then the scale fits
        assert m["error"] < 0.05 * m["ratio"] and m["grad_sq_error"] < 0.05 * m["grad_sq"], case
        assert abs(m["ratio"] - B_SIMPLE) < 0.2 * B_SIMPLE, (case, m["ratio"], B_SIMPLE)
        # |G|² alone: the loss weighting of each micro-batch and fp16's loss scale are undone
        assert abs(m["grad_sq"] - GRAD_SQ) < 0.2 * GRAD_SQ, (case, m["grad_sq"], GRAD_SQ)


def test_the_split_of_the_global_batch_does_not_matter():
    """Micro-batch 8 x 4 and 16 x 2 estimate the same thing: they differ by less than 4 standard errors of
    their difference, bounded as if they were independent (they see the same global batches, which only
    correlates them positively and narrows the true spread of the difference)."""
    a, b = measured("fp32", 8, 4, None), measured("fp32", 16, 2, None)
    assert abs(a["ratio"] - b["ratio"]) < 4 * math.hypot(a["error"], b["error"])


def test_the_reported_scale_is_the_ratio_of_moving_averages():
    m = measured("fp32", 8, 4, None)
    trace = grad_sq = 0.0
    for s in m["samples"]:
        trace, grad_sq = DECAY * trace + (1 - DECAY) * s.trace, DECAY * grad_sq + (1 - DECAY) * s.grad_sq
    assert math.isclose(m["trainer"].noise.b_simple, trace / grad_sq, rel_tol=1e-9)
    assert m["samples"][-1].global_batch == 32 and m["samples"][-1].micro_batch == 8
    assert math.isclose(measured("fp32", 8, 4, 30)["samples"][-1].micro_batch, 4 / (3 / 8 + 1 / 6))  # harmonic


def test_without_accumulation_nothing_is_measured():
    trainer = Trainer(linear_regression(), Config(micro_batch=32))
    for _ in range(3):
        trainer.step()
    assert trainer.noise.last is None and trainer.noise.b_simple is None and trainer.noise.metrics() == {}
    assert advice([{"step": 0, "loss": 1.0}], 32, gpus=1)["critical_batch"] is None
    assert "not measured" in advice([], 32, gpus=1)["verdict"] and "ranks" in advice([], 32, gpus=2)["verdict"]


def counted(step: TrainStep, batch) -> tuple[float, int, int]:
    """A step under memfit's CPU memory counter (what a run measures its peak with): loss, peak, allocations."""
    counter = LiveBytes("cpu")
    counter.track(step.state_tensors())
    with counter:
        loss = step(batch)
    counter.close()
    return float(loss), counter.peak, len(counter.events)


def test_measuring_changes_neither_the_math_nor_the_measured_memory():
    """The same steps with the measurement (a Trainer) and without (a bare TrainStep built from the same seed):
    bit-identical losses and weights, and not one allocation more under memfit's CPU memory counter, so a
    run's measured peak still equals its estimate byte for byte."""
    wl, config = builtin("mlp-tiny"), Config(micro_batch=4, grad_accum=2)
    trainer = Trainer(wl, config, seed=0)
    torch.manual_seed(0)
    bare = TrainStep(wl, config)
    batches = [trainer.batch(s) for s in range(4)]
    with_noise = [counted(trainer.engine, b) for b in batches]
    assert trainer.noise.last is not None  # it did measure
    assert with_noise == [counted(bare, b) for b in batches]
    for p, q in zip(trainer.model.parameters(), bare.model.parameters()):
        assert torch.equal(p, q)


def test_a_run_records_the_noise_scale_and_reports_a_verdict(tmp_path):
    res = memfit.train(linear_regression(), 30, 32, micro_batch=8, progress=False, out=tmp_path / "a")
    recs = [r for r in res.metrics if "loss" in r]
    assert all({"noise_grad_sq", "noise_trace", "noise_scale"} <= r.keys() for r in recs)
    report = json.loads((tmp_path / "a" / "report.json").read_text())["batch_size_advice"]
    assert report["measured_steps"] == 30 and report["critical_batch"] == recs[-1]["noise_scale"]
    assert "the critical batch ~" in report["verdict"] and (tmp_path / "a" / "noise_scale.png").exists()

    res = memfit.train(linear_regression(), 3, 32, micro_batch=32, progress=False, out=tmp_path / "b")
    assert not any("noise_scale" in r for r in res.metrics)
    assert res.report["batch_size_advice"]["critical_batch"] is None
    assert not (tmp_path / "b" / "noise_scale.png").exists()


def test_verdict():
    assert verdict(64, 2000) == ("global batch 64 is far below the critical batch ~2,000: a larger batch would "
                                 "train about as fast per step and need fewer steps")
    assert verdict(64, 210).startswith("global batch 64 is below the critical batch ~210:")
    assert verdict(64, 70).startswith("global batch 64 is near the critical batch ~70:")
    assert verdict(1024, 64).startswith("global batch 1024 is far above the critical batch ~64: smaller batches")
    assert verdict(64, 3.14).startswith("global batch 64 is far above the critical batch ~3.1:")


RUN = dict(steps=20, global_batch=32, micro_batch=8, seed=3, deterministic=True, progress=False)


def interrupted(out, at: int, lr: float) -> None:
    """The run of RUN stopped by Ctrl-C during step `at` - 1 (it checkpoints step `at`), then resumed to its end."""
    parent, calls, wl = os.getpid(), [0], linear_regression(lr)
    inner = wl.loss

    def loss(m, b):
        if os.getpid() == parent:  # not in the planner's forked traces
            calls[0] += 1
            if calls[0] == (at - 1) * RUN["global_batch"] // RUN["micro_batch"] + 1:
                os.kill(parent, signal.SIGINT)
        return inner(m, b)

    wl.loss = loss
    with pytest.raises(KeyboardInterrupt, match=f"checkpoint of step {at} written"):
        memfit.train(wl, out=out, **RUN)
    memfit.train(linear_regression(lr), out=out, resume=True, **RUN)


def noise_records(out) -> list[tuple]:
    return [(r["step"], r["noise_trace"], r["noise_grad_sq"], r["noise_scale"])
            for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("noise") / "whole"
    memfit.train(linear_regression(0.02), out=out, **RUN)
    return out


def test_a_resumed_run_reports_the_noise_scale_of_the_uninterrupted_run(uninterrupted, tmp_path):
    """The moving averages are saved with each checkpoint: a resume that started them again from zero
    reported its first step's own ratio as the scale (a spike), and the advice rested on a few steps."""
    interrupted(tmp_path / "run", at=10, lr=0.02)
    whole, resumed = noise_records(uninterrupted), noise_records(tmp_path / "run")
    assert len(whole) == RUN["steps"] and all(scale is not None for *_, scale in whole[5:])
    assert resumed == whole  # bit for bit (a deterministic run), at the resumed step and after it
    report = json.loads((tmp_path / "run" / "report.json").read_text())["batch_size_advice"]
    assert report == json.loads((uninterrupted / "report.json").read_text())["batch_size_advice"]
    assert report["measured_steps"] == RUN["steps"]


def test_a_checkpoint_without_the_averages_resumes_them_from_the_metrics(uninterrupted, tmp_path, monkeypatch):
    """A checkpoint written before the averages were saved with it: they are rebuilt from the metrics."""
    save = ckpt.save_checkpoint
    monkeypatch.setattr(ckpt, "save_checkpoint", lambda *a, **k: save(*a, **{**k, "noise": None}))
    interrupted(tmp_path / "run", at=10, lr=0.02)
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path / "run"))["noise"] is None
    assert noise_records(tmp_path / "run") == noise_records(uninterrupted)
