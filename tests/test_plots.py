"""The PNG charts render from a real estimate and a loss log, at their fixed pixel size."""
import dataclasses
import math

import matplotlib.image
import pytest

import memfit
from memfit.errors import RunError
from memfit.memory.estimate import CATEGORIES
from memfit.report import plots
from memfit.workloads import builtin

WIDTH, HEIGHT = round(plots.SIZE[0] * plots.DPI), round(plots.SIZE[1] * plots.DPI)  # 1320 x 660
LOSS_PX = (round(plots.LOSS_SIZE[0] * plots.DPI), round(plots.LOSS_SIZE[1] * plots.DPI))  # 1080 x 600


@pytest.fixture(scope="module")
def est():
    return memfit.estimate(builtin("gpt-tiny"), memfit.Config(micro_batch=2))


def _check_png(path, width, height):
    assert path.exists()
    assert path.stat().st_size > 20_000  # a drawn chart, not an empty canvas
    img = matplotlib.image.imread(path)
    assert img.shape[:2] == (height, width)
    assert img[..., :3].std() > 0.05  # not one flat colour


def test_memory_timeline_png(est, tmp_path):
    out = plots.plot_memory_timeline(est, tmp_path / "timeline.png")
    assert out == tmp_path / "timeline.png"
    _check_png(out, WIDTH, HEIGHT)


def test_memory_timeline_with_device_line(est, tmp_path):
    # a GPU-shaped estimate whose device memory is on the chart's scale, and one far above it
    near = dataclasses.replace(est, device_total_bytes=2 * est.peak_bytes, peak_allocated_bytes=est.peak_bytes,
                               peak_reserved_bytes=int(1.2 * est.peak_bytes))
    far = dataclasses.replace(near, device_total_bytes=80 * 2**30)
    _check_png(plots.plot_memory_timeline(near, tmp_path / "near.png", title="fits"), WIDTH, HEIGHT)
    _check_png(plots.plot_memory_timeline(far, tmp_path / "sub" / "far.png"), WIDTH, HEIGHT)


def test_setup_ramp_is_trimmed(est):
    start = plots.step_start(est.timeline)
    tl = {k: v[start:] for k, v in est.timeline.items()}
    totals = [sum(tl[c][i] for c in CATEGORIES) for i in range(len(tl["index"]))]
    # the step starts with its whole state: weights, last step's gradients, optimizer state
    assert totals[0] >= sum(est.model_state_bytes.values())
    assert max(totals) == est.peak_bytes


def test_loss_png(tmp_path):
    records = [{"step": i, "loss": 5 * math.exp(-i / 40) + 0.2 + 0.05 * math.sin(i), "lr": 1e-3 * min(1, i / 10)}
               for i in range(200)]  # spans > 10x: log scale
    records.append({"step": 200, "loss": float("nan")})
    out = plots.plot_loss(records, tmp_path / "loss.png")
    _check_png(out, *LOSS_PX)
    short = plots.plot_loss([{"step": i, "loss": 2.0 - 0.1 * i} for i in range(5)], tmp_path / "short.png")
    _check_png(short, *LOSS_PX)


def test_loss_needs_a_finite_value(tmp_path):
    with pytest.raises(RunError, match="no records with a finite"):
        plots.plot_loss([{"step": 0, "loss": float("inf")}], tmp_path / "x.png")


def test_ema_is_bias_corrected():
    assert plots._ema([4.0, 4.0, 4.0], 0.9) == pytest.approx([4.0, 4.0, 4.0])


def test_scaling_png_from_plans_per_count(tmp_path):
    """`memfit plan --gpus A-B --plot`: throughput and efficiency per count, counts that do not fit marked;
    with none fitting there is nothing to draw, and it says so."""
    from types import SimpleNamespace

    from memfit import Config
    from memfit.errors import EstimateError

    def row(n, speed, efficiency):
        cfg = Config(gpus=n, data_parallel="fsdp") if n > 1 else Config()
        return dict(gpus=n, why=None, efficiency=efficiency, plan=SimpleNamespace(samples_per_second=speed, config=cfg))

    rows = [dict(gpus=1, plan=None, why="nothing fits"), row(2, 100.0, 1.0), row(4, 190.0, 0.95), row(8, 300.0, 0.75)]
    _check_png(plots.plot_scaling(rows, tmp_path / "scaling.png"), *LOSS_PX)
    with pytest.raises(EstimateError, match="no GPU count"):
        plots.plot_scaling(rows[:1], tmp_path / "none.png")
