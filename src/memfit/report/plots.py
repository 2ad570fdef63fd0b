"""PNG charts of an estimate's memory timeline, a run's loss curve and gradient noise scale, and a plan's
scaling over GPU counts.

Pure functions of the data, drawn with matplotlib's Agg canvas on a private `Figure` (no pyplot, so no
display is needed and no global figure state or backend is touched). Each function writes one PNG of a
fixed pixel size (`size` inches x `dpi`) and returns its path.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable, Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from memfit.memory.estimate import CATEGORIES, Estimate
from memfit.config import Config
from memfit.errors import EstimateError, RunError
from memfit.units import fmt_bytes

SIZE = (11.0, 5.5)        # inches: the memory timeline, 1320 x 660 pixels at DPI
LOSS_SIZE = (9.0, 5.0)    # the loss curve, 1080 x 600 pixels; the scaling chart too
DPI = 120

LABELS = {
    "parameters": "parameters & buffers", "gradients": "gradients", "optimizer_state": "optimizer state",
    "inputs": "inputs", "activations": "activations (saved for backward)", "temporaries": "temporaries",
}
# colour-blind-safe (Okabe-Ito), model state in cool colours, step-dependent memory in warm ones
COLORS = {
    "parameters": "#0072B2", "gradients": "#56B4E9", "optimizer_state": "#009E73",
    "inputs": "#999999", "activations": "#E69F00", "temporaries": "#D55E00",
}
PHASE_SHADES = {"setup": "#f2f2f2", "forward": "#eaf2fb", "backward": "#fbefe6", "optimizer": "#eaf6ef"}
_LABEL_BOX = dict(boxstyle="round,pad=0.15", facecolor="white", edgecolor="none", alpha=0.8)
_RC = {"font.size": 11, "axes.titlesize": 13, "axes.labelsize": 11, "legend.fontsize": 9.5,
       "xtick.labelsize": 10, "ytick.labelsize": 10}


def _unit(nbytes: float) -> tuple[str, int]:
    for name, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return name, scale
    return "bytes", 1


def _new_figure(size=SIZE) -> Figure:
    fig = Figure(figsize=size, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, path) -> Path:
    _lay_out(fig)
    return _write(fig, path)


def _write(fig: Figure, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")  # no bbox_inches="tight": the pixel size stays SIZE x DPI
    return path


def _lay_out(fig: Figure) -> None:
    """tight_layout, with each title wrapped at words to the room it has: a long workload name or
    configuration would otherwise run off the figure's right edge (the pixel size is fixed)."""
    fig.tight_layout()
    renderer = fig.canvas.get_renderer()
    wrapped = False
    for ax in fig.axes:
        for loc in ("left", "center", "right"):
            text = ax.get_title(loc)
            if not text:
                continue
            title = ax.set_title(text, loc=loc)  # (the title's Text, as it was)
            box, right = title.get_window_extent(renderer), fig.bbox.x1 - 8
            room = {"left": right - box.x0, "right": box.x1 - 8,
                    "center": 2 * min((box.x0 + box.x1) / 2 - 8, right - (box.x0 + box.x1) / 2)}[loc]
            font = title.get_fontproperties()
            lines = _wrap(text, room, lambda s: renderer.get_text_width_height_descent(s, font, ismath=False)[0])
            if lines != text:
                title.set_text(lines)
                wrapped = True
    if wrapped:  # more lines: more room above the axes
        fig.tight_layout()


def _wrap(text: str, room: float, width) -> str:
    """`text` with its lines broken at spaces where they are wider than `room` (`width` measures a line), and
    a word wider than that on its own (a long path) broken where it reaches it."""
    out = []
    for line in text.split("\n"):
        current = ""
        for word in line.split(" "):
            tried = f"{current} {word}" if current else word
            if current and width(tried) > room:
                out.append(current)
                tried = word
            while width(tried) > room and len(tried) > 1:
                cut = max(i for i in range(1, len(tried)) if i == 1 or width(tried[:i]) <= room)
                out.append(tried[:cut])
                tried = tried[cut:]
            current = tried
        out.append(current)
    return "\n".join(out)


def _phase_spans(index: Sequence[int], phases: Sequence[str]) -> list[tuple[str, int, int]]:
    """[(phase, first index, last index)] of consecutive runs in the timeline."""
    spans: list[tuple[str, int, int]] = []
    for i, ph in zip(index, phases):
        if spans and spans[-1][0] == ph:
            spans[-1] = (ph, spans[-1][1], i)
        else:
            spans.append((ph, i, i))
    # each span reaches to where the next one starts, so the shading has no gaps
    return [(ph, a, spans[k + 1][1] if k + 1 < len(spans) else b) for k, (ph, a, b) in enumerate(spans)]


def step_start(tl: dict) -> int:
    """Where the step's starting state is complete in a timeline. The tracer's first events register the
    tensors that already exist when the step begins (weights, last step's gradients, optimizer state) one by
    one: a ramp from zero that never happened. It rises monotonically until the step frees something
    (zero_grad), so charts start the setup phase at its maximum."""
    n = len(tl["index"])
    if not n or tl["phase"][0] != "setup":
        return 0
    totals = [sum(tl[c][i] for c in CATEGORIES) for i in range(n)]
    start = 0
    while start + 1 < n and tl["phase"][start + 1] == "setup" and totals[start + 1] >= totals[start]:
        start += 1
    return start


def plot_memory_timeline(estimate: Estimate, path, title: str | None = None) -> Path:
    """Stacked area chart of live bytes by category over the step's allocation events, phases shaded,
    the peak marked; on a GPU target, the device's memory (and the predicted reserved peak) as lines."""
    from matplotlib import rc_context

    start = step_start(estimate.timeline)
    tl = {k: list(v[start:]) for k, v in estimate.timeline.items()}
    x = list(tl["index"])
    if not x:
        raise EstimateError("the estimate has an empty timeline: nothing to plot")
    totals = [sum(tl[c][i] for c in CATEGORIES) for i in range(len(x))]
    peak_i = max(range(len(x)), key=totals.__getitem__)
    peak = totals[peak_i]

    gpu = estimate.peak_allocated_bytes is not None and estimate.device_total_bytes
    device_total = estimate.device_total_bytes if gpu else None
    reserved = estimate.peak_reserved_bytes if gpu else None
    # Draw the device / reserved lines only when they do not flatten the chart; otherwise say where they are.
    device_on_scale = device_total is not None and device_total <= 4 * max(peak, 1)
    reserved_on_scale = bool(reserved) and reserved <= 4 * max(peak, 1)
    top = max(peak, device_total if device_on_scale else 0, reserved if reserved_on_scale else 0)
    unit, scale = _unit(top)

    with rc_context(_RC):
        fig = _new_figure()
        ax = fig.add_subplot()
        ys = [[v / scale for v in tl[c]] for c in CATEGORIES]
        ax.stackplot(x, *ys, labels=[LABELS[c] for c in CATEGORIES], colors=[COLORS[c] for c in CATEGORIES],
                     alpha=0.9, linewidth=0)
        ax.plot(x, [t / scale for t in totals], color="#222222", linewidth=0.8)
        ax.set_xlim(x[0], x[-1])
        ymax = top / scale * 1.18
        ax.set_ylim(0, ymax)

        # phases: shaded spans, a dashed line where each starts (the names once the layout is final)
        spans = _phase_spans(x, tl["phase"])
        for k, (ph, a, b) in enumerate(spans):
            ax.axvspan(a, b, color=PHASE_SHADES.get(ph, "#f5f5f5"), zorder=-2, linewidth=0)
            if k:
                ax.axvline(a, color="#555555", linestyle="--", linewidth=0.9, zorder=3)

        # the peak
        px = x[peak_i]
        ax.plot([px], [peak / scale], marker="v", markersize=9, color="#B00020", zorder=6,
                markeredgecolor="white", markeredgewidth=0.8)
        ax.axvline(px, color="#B00020", linewidth=0.8, alpha=0.6, zorder=5)
        left = px > x[0] + 0.6 * (x[-1] - x[0])
        ax.annotate(f"peak {estimate.peak_bytes / scale:.2f} {unit} ({estimate.peak_phase})",
                    xy=(px, peak / scale), xytext=(-10 if left else 10, 6), textcoords="offset points",
                    ha="right" if left else "left", va="bottom", fontsize=10.5, fontweight="bold",
                    color="#B00020", zorder=7,
                    bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none", alpha=0.8))

        _device_lines(ax, estimate, x, scale, device_on_scale, reserved_on_scale)

        ax.set_xlabel("allocation event in the step")
        ax.set_ylabel(f"live tensor memory ({unit})")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.grid(axis="y", color="#cccccc", linewidth=0.6, alpha=0.7)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        config = Config.from_dict(estimate.config)
        if title is None:
            title = f"Memory over one training step — {estimate.workload} · {config.describe()} · {estimate.device}"
            if estimate.method != "fake":  # the timeline is of a real CPU step at a micro-batch that may differ
                title += f"\n(timeline of a real CPU step; peak {estimate.method})"
        drawn = sum(ph == "forward" for ph, _, _ in spans)
        if 0 < drawn < config.grad_accum:  # a long accumulation is traced as two (estimate.traced_steps)
            title += (f"\n{drawn} of its {config.grad_accum} micro-batches drawn; the other "
                      f"{config.grad_accum - drawn} repeat the last one drawn")
        ax.set_title(title, loc="left")
        # legend outside the plot, on the right, top-down in stacking order (as the areas appear)
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles[::-1], labels[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
                  title="category", title_fontsize=10)
        _lay_out(fig)
        _name_phases(ax, spans, ymax * 0.985)
        return _write(fig, path)


def _device_lines(ax, estimate: Estimate, x: list, scale: float, device_on_scale: bool, reserved_on_scale: bool):
    """On a GPU target: the device's memory and the predicted reserved peak as lines where they keep the chart
    readable, else in a note beside it."""
    off_scale = []
    gpu = estimate.peak_allocated_bytes is not None and estimate.device_total_bytes
    device_total = estimate.device_total_bytes if gpu else None
    reserved = estimate.peak_reserved_bytes if gpu else None
    if device_total is not None:
        name = estimate.device
        if device_on_scale:
            ax.axhline(device_total / scale, color="#B00020", linewidth=1.6, zorder=5)
            headroom = estimate.headroom_bytes
            verdict = "" if headroom is None else (f", {fmt_bytes(headroom)} to spare" if headroom >= 0 else
                                                    f": does not fit, {fmt_bytes(-headroom)} short")
            ax.text(x[0] + 0.005 * (x[-1] - x[0]), device_total / scale,
                    f"{name} memory {fmt_bytes(device_total)}{verdict}", va="bottom", ha="left", fontsize=10,
                    color="#B00020", zorder=7, bbox=_LABEL_BOX)
        else:
            off_scale.append(f"{name} memory: {fmt_bytes(device_total)}\n"
                             f"(the peak is {100 * estimate.peak_bytes / device_total:.2g}% of it)")
    if reserved:
        if reserved_on_scale:
            ax.axhline(reserved / scale, color="#6a3d9a", linewidth=1.1, linestyle=":", zorder=5)
            ax.text(x[-1] - 0.005 * (x[-1] - x[0]), reserved / scale,
                    f"predicted reserved peak {fmt_bytes(reserved)}", va="bottom", ha="right",
                    fontsize=9.5, color="#6a3d9a", zorder=7, bbox=_LABEL_BOX)
        else:
            off_scale.append(f"predicted reserved peak:\n{fmt_bytes(reserved)} (allocator cache,\n"
                             "cuBLAS workspace included)")
    if off_scale:
        ax.text(1.02, 0.42, "off the scale of this chart:\n" + "\n".join(off_scale), transform=ax.transAxes,
                ha="left", va="top", fontsize=9.5, color="#6a1010", linespacing=1.35)


def _name_phases(ax, spans: list[tuple[str, int, int]], y: float) -> None:
    """Each phase's name on top of its span. A micro-batch's forward and backward are named inside their
    spans, or, where one is too narrow for its name (many micro-batches), all of them by one name instead;
    setup and the optimizer may reach past a narrow span but not over another name or out of the axes.
    Names never overlap. Needs the final layout (it measures in pixels)."""
    renderer = ax.figure.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    placed = []

    def name(text: str, a: float, b: float, inside: bool):
        label = ax.text((a + b) / 2, y, text, ha="center", va="top", fontsize=10.5, color="#333333",
                        style="italic", zorder=4)
        box = label.get_window_extent(renderer)
        left, right = ax.transData.transform([(a, y), (b, y)])[:, 0]
        if not inside and (box.x0 < frame.x0 or box.x1 > frame.x1):  # at an end of the chart: flush with it
            if box.x0 < frame.x0:
                label.set(x=a, ha="left")
            else:
                label.set(x=b, ha="right")
            box = label.get_window_extent(renderer)
        fits = (left + 3 <= box.x0 and box.x1 <= right - 3) if inside else (
            box.width <= 2 * (right - left) and frame.x0 <= box.x0 and box.x1 <= frame.x1
            and not any(box.overlaps(other) for other in placed))
        if not fits:
            label.remove()
            return None
        placed.append(box)
        return label

    passes = [(ph, a, b) for ph, a, b in spans if ph in ("forward", "backward")]
    named = [name(ph, a, b, inside=True) for ph, a, b in passes]
    if None in named:
        for label in filter(None, named):
            label.remove()
        placed.clear()
        micro = sum(ph == "forward" for ph, _, _ in passes)
        name(f"forward and backward of {micro} micro-batches", passes[0][1], passes[-1][2], inside=True)
    for ph, a, b in spans:
        if ph not in ("forward", "backward"):
            name(ph, a, b, inside=False)


def _leading_digit(v: float) -> int:
    return int(f"{v:e}"[0]) if v > 0 else 0


def _ema(values: Sequence[float], alpha: float) -> list[float]:
    """Bias-corrected exponential moving average (as TensorBoard smooths): the first points are not
    dragged towards zero."""
    out, avg, weight = [], 0.0, 0.0
    for v in values:
        avg = alpha * avg + (1 - alpha) * v
        weight = alpha * weight + (1 - alpha)
        out.append(avg / weight)
    return out


def plot_loss(records: Iterable[dict], path, title: str | None = None, smoothing: float | None = None) -> Path:
    """Loss against step: the raw points, an EMA over them (smoothing 0..1; default picked from the
    number of points), a log y axis when the loss spans more than 10x, and the learning rate on a second
    axis when the records carry "lr". Non-finite losses are left out (and counted in the legend)."""
    from matplotlib import rc_context

    rows = [r for r in records if r.get("loss") is not None]
    good = [r for r in rows if math.isfinite(float(r["loss"]))]
    if not good:
        raise RunError("plot_loss: no records with a finite 'loss'")
    good.sort(key=lambda r: r["step"])
    steps = [r["step"] for r in good]
    loss = [float(r["loss"]) for r in good]
    n = len(loss)
    if smoothing is None:  # about a tenth of the run as the EMA's span, within sensible bounds
        smoothing = min(0.98, max(0.5, 1 - 2 / (n / 10 + 1)))
    smooth = _ema(loss, smoothing)
    log_y = min(loss) > 0 and max(loss) / min(loss) > 10

    with rc_context(_RC):
        fig = _new_figure(LOSS_SIZE)
        ax = fig.add_subplot()
        raw_label = "loss (per step)"
        if len(rows) > n:
            raw_label += f"; {len(rows) - n} non-finite left out"
        ax.plot(steps, loss, color="#0072B2", alpha=0.3 if n > 1 else 1.0, linewidth=0.9,
                marker="o" if n <= 60 else None, markersize=3 if n > 1 else 6, label=raw_label)
        if steps[0] == steps[-1]:  # one step: give the axis a width of whole steps
            ax.set_xlim(steps[0] - 1, steps[0] + 1)
        if n >= 2 and smoothing > 0:
            ax.plot(steps, smooth, color="#0072B2", linewidth=2.2, label=f"EMA (smoothing {smoothing:.2f})")
        if log_y:
            ax.set_yscale("log")
            plain = FuncFormatter(lambda v, _: f"{v:g}")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if _leading_digit(v) in (2, 3, 5) else ""))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel("loss" + (" (log scale)" if log_y else ""))
        ax.grid(color="#cccccc", linewidth=0.6, alpha=0.7, which="major")
        ax.set_axisbelow(True)
        ax.spines["top"].set_visible(False)
        handles, labels = ax.get_legend_handles_labels()

        lrs = [(r["step"], r["lr"]) for r in good if r.get("lr") is not None]
        if lrs:
            ax2 = ax.twinx()
            ax2.plot([s for s, _ in lrs], [v for _, v in lrs], color="#E69F00", linewidth=1.4, linestyle="--",
                     label="learning rate")
            ax2.set_ylabel("learning rate", color="#B07800")
            ax2.tick_params(axis="y", colors="#B07800")
            ax2.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
            ax2.spines["top"].set_visible(False)
            ax2.set_ylim(bottom=0)
            h2, l2 = ax2.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        else:
            ax.spines["right"].set_visible(False)
        ax.legend(handles, labels, loc="upper right", framealpha=0.9)
        last = f"last {loss[-1]:.4g}, EMA {smooth[-1]:.4g}" if n >= 2 and smoothing > 0 else f"last {loss[-1]:.4g}"
        ax.set_title(title or f"Training loss — {n} step{'s' if n != 1 else ''}, {last}", loc="left")
        return _save(fig, path)


def plot_scaling(rows: list[dict], path, title: str | None = None) -> Path:
    """`plan_counts`' rows as two panels over the GPU count (log 2 axis): predicted samples/s of the fastest
    plan at each count against linear scaling from the smallest count that fits, and the scaling efficiency
    (samples/s per GPU against that count's), each point labelled with its layout. Counts where nothing
    fits are marked on the axis."""
    from matplotlib import rc_context

    fits = [r for r in rows if r["plan"] is not None]
    if not fits:
        raise EstimateError("plot_scaling: no GPU count in the range fits")
    n = [r["gpus"] for r in fits]
    speed = [r["plan"].samples_per_second for r in fits]
    with rc_context(_RC):
        fig = _new_figure(LOSS_SIZE)
        top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2, sharex=None)
        top.plot(n, [speed[0] * g / n[0] for g in n], color="#999999", linestyle="--", linewidth=1.2,
                 label=f"linear from {n[0]} GPU" + ("s" if n[0] > 1 else ""))
        top.plot(n, speed, color="#0072B2", marker="o", linewidth=2, label="fastest plan (predicted)")
        for g, v, r in zip(n, speed, fits):
            top.annotate(r["plan"].config.data_parallel if g > 1 else "1 GPU", (g, v), textcoords="offset points",
                         xytext=(0, 7), ha="center", fontsize=8.5, bbox=_LABEL_BOX)
        top.set_ylabel("samples/s")
        top.legend(loc="upper left", frameon=False)
        bottom.plot(n, [100 * r["efficiency"] for r in fits], color="#D55E00", marker="o", linewidth=2)
        bottom.set_ylabel("scaling efficiency (%)")
        bottom.set_ylim(0, max(105, 5 + max(100 * r["efficiency"] for r in fits)))
        bottom.set_xlabel("GPUs")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks([r["gpus"] for r in rows], [str(r["gpus"]) for r in rows])
            ax.minorticks_off()
            ax.grid(color="#cccccc", linewidth=0.6, alpha=0.7)
            ax.set_axisbelow(True)
            ax.spines["top"].set_visible(False)
            ax.spines["right"].set_visible(False)
        for r in rows:
            if r["plan"] is None:
                bottom.annotate("does not fit", (r["gpus"], 0), textcoords="offset points", xytext=(0, 4),
                                ha="center", fontsize=8, color="#777777", rotation=90)
        top.set_title(title or "throughput and scaling by GPU count")
        return _save(fig, path)


def plot_noise_scale(records: Iterable[dict], path, global_batch: int, title: str | None = None) -> Path:
    """The gradient noise scale over a run (runtime/noise.py) on a log axis: each step's own tr(Σ)/|G|²
    (faint; a step whose |G|² estimate is not positive has none), their moving-average ratio, the critical
    batch estimate, and the run's global batch beside it."""
    from matplotlib import rc_context

    rows = sorted((r for r in records if "noise_scale" in r), key=lambda r: r["step"])
    if not rows:
        raise RunError("plot_noise_scale: no records with a 'noise_scale' (the run did not accumulate)")
    own = [(r["step"], r["noise_trace"] / r["noise_grad_sq"]) for r in rows
           if r["noise_grad_sq"] > 0 and r["noise_trace"] > 0]
    avg = [(r["step"], r["noise_scale"]) for r in rows if r["noise_scale"] is not None]
    with rc_context(_RC):
        fig = _new_figure(LOSS_SIZE)
        ax = fig.add_subplot()
        if own:
            ax.plot([s for s, _ in own], [v for _, v in own], linestyle="none", marker="o", markersize=2.5,
                    color="#0072B2", alpha=0.25, label="one step's tr(Σ)/|G|²")
        if avg:
            ax.plot([s for s, _ in avg], [v for _, v in avg], color="#0072B2", linewidth=2.2,
                    label="B_simple: ratio of moving averages (the critical batch)")
        ax.axhline(global_batch, color="#D55E00", linestyle="--", linewidth=1.4, label=f"global batch {global_batch}")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel("batch size (samples, log scale)")
        ax.grid(color="#cccccc", linewidth=0.6, alpha=0.7, which="major")
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.legend(loc="best", framealpha=0.9)
        last = f"last B_simple {avg[-1][1]:,.0f}" if avg else "not resolved"
        ax.set_title(title or f"Gradient noise scale — {len(rows)} steps, {last}", loc="left")
        return _save(fig, path)
