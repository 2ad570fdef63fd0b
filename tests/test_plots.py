"""The PNG charts render from a real estimate and a loss log, at their fixed pixel size."""
import dataclasses
import math

import matplotlib.image
import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text

import memfit
from memfit.errors import RunError
from memfit.memory import estimate as estimate_module
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


def _saved(monkeypatch, draw) -> Figure:
    """The figure `draw()` saves, as it was when saved (its layout final)."""
    saved, real = [], Figure.savefig

    def keep(fig, *args, **kwargs):
        saved.append(fig)
        return real(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    draw()
    return saved[-1]


def _titles(fig: Figure):
    """Each axes' title Texts that have text (left, centre, right)."""
    return [t for ax in fig.axes for t in ax.get_children()
            if isinstance(t, Text) and t.get_text() and t.get_text() in {ax.get_title(loc) for loc in
                                                                         ("left", "center", "right")}]


def test_long_titles_are_wrapped_inside_the_figure(est, tmp_path, monkeypatch):
    run_title = ("examples/my_project/train_job.py:workload: memory of one step at micro-batch 16 x 4, bf16, "
                 "activation checkpointing 1 block in 4, optimizer offload, loss in 8 chunks (predicted)")
    loss_title = run_title.replace("memory of one step", "training loss")
    long_name = "examples/job.py:" + "w" * 90  # one word wider than the figure
    charts = [(lambda: plots.plot_memory_timeline(est, tmp_path / "m.png", title=run_title), run_title),
              (lambda: plots.plot_loss([{"step": i, "loss": 1 / (i + 1)} for i in range(9)], tmp_path / "l.png",
                                       title=loss_title), loss_title),
              (lambda: plots.plot_memory_timeline(dataclasses.replace(est, workload=long_name), tmp_path / "d.png"),
               None)]
    for draw, given in charts:
        fig = _saved(monkeypatch, draw)
        [title] = _titles(fig)
        box = title.get_window_extent(fig.canvas.get_renderer())
        assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1, title.get_text()
        assert "\n" in title.get_text()  # wrapped, not shrunk or cut: every word still there
        if given:
            assert " ".join(title.get_text().split()) == given  # broken at spaces only
        else:
            assert long_name in title.get_text().replace("\n", "")


def test_phase_names_never_overlap_at_16_micro_batches(tmp_path, monkeypatch):
    with monkeypatch.context() as m:  # all 16 traced (an estimate traces two: estimate.traced_steps)
        m.setattr(estimate_module, "traced_steps", lambda c: c)
        est = memfit.estimate(builtin("gpt-tiny"), memfit.Config(micro_batch=1, grad_accum=16))
    fig = _saved(monkeypatch, lambda: plots.plot_memory_timeline(est, tmp_path / "acc.png"))
    renderer = fig.canvas.get_renderer()
    [ax] = [a for a in fig.axes if a.texts]
    names = [t for t in ax.texts if t.get_style() == "italic"]
    boxes = [t.get_window_extent(renderer) for t in names]
    assert names and not [(a.get_text(), b.get_text()) for i, (a, box) in enumerate(zip(names, boxes))
                          for b, other in zip(names[i + 1:], boxes[i + 1:]) if box.overlaps(other)]
    assert all(ax.bbox.x0 <= box.x0 and box.x1 <= ax.bbox.x1 for box in boxes)
    # the 16 micro-batches named once together, not a name per forward and backward
    assert "forward and backward of 16 micro-batches" in [t.get_text() for t in names]


def test_the_title_says_how_many_micro_batches_the_timeline_draws(tmp_path, monkeypatch):
    """An estimate (the planner's, `memfit train`'s memory.png, `memfit estimate --plot`) traces a long
    accumulation as its first two micro-batches: a chart titled "micro-batch 1 x 4" draws two forward and
    backward passes."""
    from memfit.memory.devices import get_device
    from memfit.planner.search import full_probe

    traced = full_probe(builtin("gpt-tiny"), memfit.Config(micro_batch=1, grad_accum=4), get_device("cpu")).estimate
    fig = _saved(monkeypatch, lambda: plots.plot_memory_timeline(
        traced, tmp_path / "memory.png", title="gpt-tiny: memory of one step at micro-batch 1 x 4, fp32 (predicted)"))
    assert "2 of its 4 micro-batches drawn" in _titles(fig)[0].get_text()
    [ax] = [a for a in fig.axes if a.texts]
    assert [t.get_text() for t in ax.texts if t.get_style() == "italic"].count("forward") == 2
