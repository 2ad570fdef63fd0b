"""Batch-size advice from the gradient noise scale (memfit/runtime/noise.py), checked and shown on this CPU.

Part 1, a linear regression with known gradient noise: y = w*.x + eps, x ~ N(0, I_d), eps ~ N(0, sigma²),
the model y = w.x held at w = 0 (SGD, lr 0), MSE loss. Analytically B_simple = ((d + 1)|a|² + sigma² d) / |a|²
with a = w - w* (tests/test_noise_scale.py derives it). memfit's Trainer measures it over --linear-steps
steps at several noise levels and splits of the global batch; the measured value is the ratio of the means of
the per-step estimates, with its standard error (delta method, from the steps themselves).

Part 2, the built-in `sort` GPT trained by `memfit.train` (global batch 64 as micro-batch 16 x 4, the
default cosine schedule) for --sort-steps steps, twice (seeds 0 and 1): B_simple over each run (the moving
average memfit reports, and each step's own estimate), block estimates with standard errors over windows of
50 steps, and the spread of the moving average over the second half; the two seeds show how reproducible the
curve is. Plot: docs/noise-scale-sort.png.

Part 3, what measuring costs: a Trainer (measuring) and a bare TrainStep (not) built from the same seed, their
steps alternated on the same batches (order flipped every step), --overhead-steps pairs; the median of
the paired per-step ratios. Their losses must agree exactly.

    taskset -c 0,1 .venv/bin/python benchmarks/noise_scale.py   # ~2-3 minutes on 2 cores
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the shared workloads (tests/models.py)

import memfit  # noqa: E402
import models  # noqa: E402
from memfit import Config, Trainer  # noqa: E402
from memfit.step import TrainStep  # noqa: E402
from memfit.workloads import builtin  # noqa: E402

SORT_BATCH, SORT_MICRO = 64, 16
BLOCK = 50


def ratio_of_means(trace: list[float], grad_sq: list[float]) -> tuple[float, float]:
    """mean tr(Σ) / mean |G|² over steps and its standard error, var ~ var(T - R G) / (n mean(G)²)."""
    r = statistics.fmean(trace) / statistics.fmean(grad_sq)
    z = [t - r * g for t, g in zip(trace, grad_sq)]
    return r, statistics.stdev(z) / (math.sqrt(len(z)) * statistics.fmean(grad_sq))


def part_linear(steps: int) -> list[dict]:
    rows = []
    for d, sigma, micro, accum in [(16, 1.0, 8, 4), (16, 1.0, 16, 2), (16, 1.0, 4, 16), (16, 3.0, 8, 4),
                                   (64, 1.0, 8, 4)]:
        w_star = torch.ones(d) / math.sqrt(d)
        a_sq = float(w_star.square().sum())
        analytic = ((d + 1) * a_sq + sigma**2 * d) / a_sq
        trainer = Trainer(models.linear_regression(d, sigma, w_star), Config(micro_batch=micro, grad_accum=accum))
        trace, grad_sq = [], []
        t0 = time.perf_counter()
        for _ in range(steps):
            trainer.step()
            trace.append(trainer.noise.last.trace)
            grad_sq.append(trainer.noise.last.grad_sq)
        measured, error = ratio_of_means(trace, grad_sq)
        rows.append(dict(d=d, sigma=sigma, a_sq=a_sq, micro_batch=micro, grad_accum=accum, steps=steps,
                         analytic=analytic, measured=measured, standard_error=error,
                         relative_error=measured / analytic - 1, grad_sq_analytic=4 * a_sq,
                         grad_sq_measured=statistics.fmean(grad_sq), moving_average_at_end=trainer.noise.b_simple,
                         seconds=time.perf_counter() - t0))
        r = rows[-1]
        print(f"linear d={d} sigma={sigma} {micro}x{accum}: analytic {analytic:.1f}, measured {measured:.1f} "
              f"+- {error:.1f} ({100 * r['relative_error']:+.1f}%), |G|² {r['grad_sq_measured']:.3f} "
              f"vs {4 * a_sq:.3f}", flush=True)
    return rows


def part_sort(steps: int, seed: int, out: Path) -> dict:
    t0 = time.perf_counter()
    res = memfit.train(builtin("sort"), steps, SORT_BATCH, micro_batch=SORT_MICRO, seed=seed, progress=False,
                       out=out, checkpoint_every=None)
    recs = [r for r in res.metrics if "loss" in r]
    ema = [r["noise_scale"] for r in recs]
    blocks = []
    for start in range(0, steps - BLOCK + 1, BLOCK):
        window = recs[start:start + BLOCK]
        value, error = ratio_of_means([r["noise_trace"] for r in window], [r["noise_grad_sq"] for r in window])
        blocks.append(dict(steps=[start, start + BLOCK - 1], b_simple=value, standard_error=error,
                           mean_loss=statistics.fmean(r["loss"] for r in window)))
    half = [v for v in ema[steps // 2:] if v is not None]
    deciles = statistics.quantiles(half, n=10)
    summary = dict(seed=seed, steps=steps, seconds=time.perf_counter() - t0, final_loss=res.final_loss,
                   advice=res.report["batch_size_advice"], blocks=blocks,
                   second_half=dict(median=statistics.median(half), p10=deciles[0], p90=deciles[-1],
                                    min=min(half), max=max(half)),
                   records=[dict(step=r["step"], loss=r["loss"], noise_scale=r["noise_scale"],
                                 noise_trace=r["noise_trace"], noise_grad_sq=r["noise_grad_sq"]) for r in recs])
    print(f"sort seed {seed}: {steps} steps in {summary['seconds']:.0f} s, loss {res.final_loss:.3f}; "
          f"B_simple second half median {summary['second_half']['median']:.0f} "
          f"(p10 {deciles[0]:.0f}, p90 {deciles[-1]:.0f}); {res.report['batch_size_advice']['verdict']}", flush=True)
    for b in blocks:
        print(f"  steps {b['steps'][0]}-{b['steps'][1]}: {b['b_simple']:.1f} +- {b['standard_error']:.1f} "
              f"(loss {b['mean_loss']:.3f})", flush=True)
    return summary


def part_overhead(pairs: int) -> dict:
    wl, config = builtin("sort"), Config(micro_batch=SORT_MICRO, grad_accum=SORT_BATCH // SORT_MICRO)
    trainer = Trainer(wl, config, seed=0)
    torch.manual_seed(0)
    bare = TrainStep(wl, config)
    ratios, same = [], True
    for step in range(pairs + 2):
        batch = trainer.batch(step)
        seconds, losses = {}, {}
        for name in (("on", "off") if step % 2 else ("off", "on")):
            engine = trainer.engine if name == "on" else bare
            t0 = time.perf_counter()
            losses[name] = float(engine(batch))
            seconds[name] = time.perf_counter() - t0
        same &= losses["on"] == losses["off"]
        if step >= 2:  # the first steps make the optimizer state
            ratios.append(seconds["on"] / seconds["off"])
    overhead = statistics.median(ratios) - 1
    print(f"overhead of measuring (sort, {SORT_MICRO} x {SORT_BATCH // SORT_MICRO}): {100 * overhead:+.2f}% "
          f"(median of {pairs} paired steps); losses identical: {same}", flush=True)
    return dict(pairs=pairs, median_overhead=overhead, losses_identical=same)


def plot(runs: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(9.0, 6.5), dpi=120)
    FigureCanvasAgg(fig)
    top, bottom = fig.add_subplot(3, 1, (1, 2)), fig.add_subplot(3, 1, 3)
    colors = ["#0072B2", "#009E73"]
    for run, color in zip(runs, colors):
        recs = run["records"]
        own = [(r["step"], r["noise_trace"] / r["noise_grad_sq"]) for r in recs
               if r["noise_grad_sq"] > 0 and r["noise_trace"] > 0]
        top.plot([s for s, _ in own], [v for _, v in own], linestyle="none", marker="o", markersize=2, color=color,
                 alpha=0.2)
        top.plot([r["step"] for r in recs], [r["noise_scale"] for r in recs], color=color, linewidth=2,
                 label=f"seed {run['seed']}: B_simple (moving average); dots: one step's")
        for i, b in enumerate(run["blocks"]):
            first = run is runs[0] and i == 0
            top.errorbar((b["steps"][0] + b["steps"][1]) / 2, b["b_simple"], yerr=2 * b["standard_error"],
                         color=color, marker="s", markersize=4, capsize=3, linewidth=1,
                         label=f"ratio of means over {BLOCK} steps, +-2 standard errors" if first else None)
        bottom.plot([r["step"] for r in recs], [r["loss"] for r in recs], color=color, linewidth=1.2,
                    label=f"seed {run['seed']}")
    top.axhline(SORT_BATCH, color="#D55E00", linestyle="--", linewidth=1.4, label=f"global batch {SORT_BATCH}")
    top.set_yscale("log")
    top.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    top.set_ylabel("critical batch estimate (samples)")
    top.legend(loc="upper left", fontsize=8.5, framealpha=0.9)
    top.set_title(f"sort GPT, global batch {SORT_BATCH} = micro-batch {SORT_MICRO} x {SORT_BATCH // SORT_MICRO}: "
                  "gradient noise scale measured by memfit train", loc="left", fontsize=11)
    bottom.set_yscale("log")
    bottom.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    bottom.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else ""))
    bottom.set_ylabel("training loss")
    bottom.set_xlabel("step")
    bottom.legend(loc="upper right", fontsize=8.5)
    for ax in (top, bottom):
        ax.grid(color="#cccccc", linewidth=0.6, alpha=0.7)
        ax.spines["top"].set_visible(False)
        ax.spines["right"].set_visible(False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--linear-steps", type=int, default=800)
    ap.add_argument("--sort-steps", type=int, default=300)
    ap.add_argument("--overhead-steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "noise_scale.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "noise-scale-sort.png")
    args = ap.parse_args()
    t0 = time.perf_counter()
    linear = part_linear(args.linear_steps)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [part_sort(args.sort_steps, seed, Path(tmp) / f"sort-{seed}") for seed in (0, 1)]
    pairs = [(a["noise_scale"], b["noise_scale"]) for a, b in zip(runs[0]["records"], runs[1]["records"])]
    seeds = [abs(math.log(a / b)) for a, b in pairs[args.sort_steps // 2:] if a and b]
    overhead = part_overhead(args.overhead_steps)
    plot(runs, args.plot)
    result = dict(torch=torch.__version__, threads=torch.get_num_threads(), linear_regression=linear,
                  sort=runs, seeds_second_half=dict(median_ratio=math.exp(statistics.median(seeds)),
                                                    max_ratio=math.exp(max(seeds))),
                  overhead=overhead, seconds=time.perf_counter() - t0)
    print(f"seed 0 vs seed 1 over the second half: moving averages within a factor "
          f"{result['seeds_second_half']['median_ratio']:.2f} (median), {result['seeds_second_half']['max_ratio']:.2f}"
          f" (max); total {result['seconds']:.0f} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
