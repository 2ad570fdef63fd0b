"""What activation checkpointing buys and costs, measured on CPU: a 12-layer Llama-shaped transformer,
checkpoint "none" / "all" / every 2nd block / "selective".

For each mode:
  memory   activation memory = peak of the step minus the model state (parameters + gradients + optimizer
           state, the same in every mode), from memfit.estimate and from the PyTorch profiler's view of
           a real step (benchmarks/truth.py); also the estimate's activations + temporaries at its peak.
  time     real TrainStep calls, the modes interleaved round by round so that load from other processes
           falls on all of them alike: 2 warm-up steps each, then the median of --steps steps (wall clock,
           and process CPU time as a cross-check that is less sensitive to other processes).
  FLOPs    the estimate's recompute FLOPs (forward ops re-run in backward).
Then the two verdicts of the issue, and (with --profile, the default) a per-op profile of one step of
"selective" against "none": which recomputed ops the extra time goes to.

    taskset -c 0,1 python benchmarks/checkpoint_tradeoff.py [--d-model 256 --seq 256 --micro-batch 4]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import memfit  # noqa: E402
from memfit.workloads import builtin  # noqa: E402
from truth import real_step_peak  # noqa: E402

MODES = ["none", "all", 2, "selective"]
# the criteria (not to be tuned)
ALL_MIN_CUT, ALL_MAX_EXTRA = 0.70, 0.40
SEL_MIN_KEEP, SEL_MAX_EXTRA = 0.40, 0.10


def mib(n: float) -> float:
    return n / 2**20


def label(mode) -> str:
    return f"every {mode}" if isinstance(mode, int) else str(mode)


def measure_memory(wl, mode, mb: int) -> dict:
    cfg = memfit.Config(micro_batch=mb, checkpoint=mode)
    est = memfit.estimate(wl, cfg)
    state = sum(est.model_state_bytes.values())
    gc.collect()
    real = real_step_peak(wl, cfg)
    gc.collect()
    return dict(
        mode=label(mode), checkpoint=mode, estimate_peak=est.peak_bytes, real_peak=real, model_state=state,
        act_estimate=est.peak_bytes - state, act_real=real - state,
        act_tmp_at_peak=est.breakdown["activations"] + est.breakdown["temporaries"],
        breakdown=est.breakdown, peak_phase=est.peak_phase,
        flops=est.flops, recompute_flops=est.recompute_flops,
    )


def measure_time(wl, mb: int, warmup: int, steps: int) -> dict:
    """Median seconds per optimizer step for every mode, the modes interleaved step by step."""
    trainers, batches = {}, {}
    for mode in MODES:
        torch.manual_seed(0)
        trainers[label(mode)] = memfit.TrainStep(wl, memfit.Config(micro_batch=mb, checkpoint=mode), "cpu")
    torch.manual_seed(1)
    batches = [wl.batch(mb) for _ in range(warmup + steps)]
    wall = {k: [] for k in trainers}
    cpu = {k: [] for k in trainers}
    loads = [os.getloadavg()[0]]
    for i, batch in enumerate(batches):
        order = list(trainers) if i % 2 == 0 else list(trainers)[::-1]  # no mode always runs first
        for k in order:
            c0, t0 = time.process_time(), time.perf_counter()
            trainers[k](batch)
            t1, c1 = time.perf_counter(), time.process_time()
            if i >= warmup:
                wall[k].append(t1 - t0)
                cpu[k].append(c1 - c0)
        loads.append(os.getloadavg()[0])
    del trainers
    gc.collect()
    return dict(wall=wall, cpu=cpu, load_1min=loads)


def profile_ops(wl, mb: int, modes=("none", "selective"), repeats: int = 3) -> dict:
    """Self CPU time (ms, median over `repeats` steps) and call count of each aten op in one step."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for mode in modes:
        torch.manual_seed(0)
        step = memfit.TrainStep(wl, memfit.Config(micro_batch=mb, checkpoint=mode), "cpu")
        for _ in range(2):
            step(wl.batch(mb))
        runs = []
        for _ in range(repeats):
            batch = wl.batch(mb)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step(batch)
            runs.append({e.key: (e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()
                         if e.key.startswith("aten::")})
        keys = set().union(*runs)
        out[label(mode)] = {k: (statistics.median(r.get(k, (0.0, 0))[0] for r in runs),
                                max(r.get(k, (0.0, 0))[1] for r in runs)) for k in keys}
        del step
        gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=None, help="default: the preset's (32000)")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--no-profile", dest="profile", action="store_false")
    ap.add_argument("--out", default=str(HERE / "results" / "checkpoint_tradeoff.json"))
    args = ap.parse_args()
    if args.steps < 7:
        ap.error("--steps must be at least 7")

    opts = dict(layers=args.layers, d_model=args.d_model, seq=args.seq)
    if args.vocab:
        opts["vocab"] = args.vocab
    wl = builtin("gpt-small", **opts)
    mb = args.micro_batch
    threads = torch.get_num_threads()
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    print(f"gpt layers={args.layers} d_model={args.d_model} seq={args.seq} vocab={args.vocab or 'preset (32000)'} "
          f"micro-batch {mb}, fp32, AdamW; torch {torch.__version__}, {threads} threads, cpus {affinity}; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)

    t0 = time.perf_counter()
    rows = []
    for mode in MODES:
        rows.append(measure_memory(wl, mode, mb))
        r = rows[-1]
        print(f"  memory {r['mode']:>9}: estimate peak {mib(r['estimate_peak']):8.1f} MiB, profiler peak "
              f"{mib(r['real_peak']):8.1f} MiB, model state {mib(r['model_state']):.1f} MiB", flush=True)
    timing = measure_time(wl, mb, args.warmup, args.steps)
    for r in rows:
        r["step_s"] = statistics.median(timing["wall"][r["mode"]])
        r["step_cpu_s"] = statistics.median(timing["cpu"][r["mode"]])
        r["step_s_all"] = timing["wall"][r["mode"]]
        r["step_cpu_s_all"] = timing["cpu"][r["mode"]]
    base = rows[0]
    for r in rows:
        for key in ("act_estimate", "act_real", "act_tmp_at_peak"):
            r[f"cut_{key}"] = 1 - r[key] / base[key]
        r["extra_time"] = r["step_s"] / base["step_s"] - 1
        r["extra_cpu_time"] = r["step_cpu_s"] / base["step_cpu_s"] - 1

    print(f"\nmeasured in {time.perf_counter() - t0:.0f} s; 1-min load during timing "
          f"{min(timing['load_1min']):.2f}..{max(timing['load_1min']):.2f}\n")
    print("| mode | activation memory, profiler (peak − model state) | cut vs none | estimate (peak − model state) "
          "| cut | estimate: activations + temporaries at peak | cut | step time (median) | extra vs none "
          "| CPU time / step | extra | recompute GFLOPs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {mib(r['act_real']):.1f} MiB | {100 * r['cut_act_real']:.1f}% "
              f"| {mib(r['act_estimate']):.1f} MiB | {100 * r['cut_act_estimate']:.1f}% "
              f"| {mib(r['act_tmp_at_peak']):.1f} MiB | {100 * r['cut_act_tmp_at_peak']:.1f}% "
              f"| {r['step_s']:.3f} s | {100 * r['extra_time']:+.1f}% "
              f"| {r['step_cpu_s']:.3f} s | {100 * r['extra_cpu_time']:+.1f}% "
              f"| {r['recompute_flops'] / 1e9:.2f} ({100 * r['recompute_flops'] / r['flops']:.0f}% of {r['flops'] / 1e9:.0f}) |")
    print(f"\nmodel state (parameters + gradients + AdamW state): {mib(base['model_state']):.1f} MiB in every mode")

    by = {r["mode"]: r for r in rows}
    full, sel = by["all"], by["selective"]
    verdicts = {}
    for key, name in (("act_real", "profiler"), ("act_estimate", "estimate")):
        cut_all = full[f"cut_{key}"]
        saving_all = base[key] - full[key]
        keep = (base[key] - sel[key]) / saving_all if saving_all > 0 else float("nan")
        verdicts[name] = dict(
            all_cut=cut_all, all_extra_time=full["extra_time"],
            all_pass=bool(cut_all >= ALL_MIN_CUT and full["extra_time"] <= ALL_MAX_EXTRA),
            selective_keep=keep, selective_extra_time=sel["extra_time"],
            selective_pass=bool(keep >= SEL_MIN_KEEP and sel["extra_time"] <= SEL_MAX_EXTRA),
        )
    print()
    for name, v in verdicts.items():
        pf = lambda ok: "PASS" if ok else "FAIL"  # noqa: E731
        why_all = []
        if v["all_cut"] < ALL_MIN_CUT:
            why_all.append(f"cut short by {100 * (ALL_MIN_CUT - v['all_cut']):.1f} points")
        if v["all_extra_time"] > ALL_MAX_EXTRA:
            why_all.append(f"time over by {100 * (v['all_extra_time'] - ALL_MAX_EXTRA):.1f} points")
        why_sel = []
        if v["selective_keep"] < SEL_MIN_KEEP:
            why_sel.append(f"keeps {100 * (SEL_MIN_KEEP - v['selective_keep']):.1f} points too little")
        if v["selective_extra_time"] > SEL_MAX_EXTRA:
            why_sel.append(f"time over by {100 * (v['selective_extra_time'] - SEL_MAX_EXTRA):.1f} points")
        print(f"[{name} memory] checkpoint all cuts activation memory by >= 70% at <= 40% extra step time: "
              f"{pf(v['all_pass'])} (cut {100 * v['all_cut']:.1f}%, extra time {100 * v['all_extra_time']:+.1f}%"
              f"{'; ' + ', '.join(why_all) if why_all else ''})")
        print(f"[{name} memory] selective keeps >= 40% of that saving at <= 10% extra time: "
              f"{pf(v['selective_pass'])} (keeps {100 * v['selective_keep']:.1f}% of the saving, extra time "
              f"{100 * v['selective_extra_time']:+.1f}%{'; ' + ', '.join(why_sel) if why_sel else ''})")

    profile = None
    if args.profile:
        profile = profile_ops(wl, mb)
        none_p, sel_p = profile["none"], profile["selective"]
        total_none = sum(t for t, _ in none_p.values())
        total_sel = sum(t for t, _ in sel_p.values())
        diffs = sorted(((k, sel_p.get(k, (0, 0))[0] - none_p.get(k, (0, 0))[0],
                         sel_p.get(k, (0, 0))[1] - none_p.get(k, (0, 0))[1]) for k in set(none_p) | set(sel_p)),
                       key=lambda d: -d[1])
        print(f"\nprofiler, one step (median of 3): aten self CPU time none {total_none:.0f} ms, selective "
              f"{total_sel:.0f} ms ({100 * (total_sel / total_none - 1):+.1f}%). Ops with the most extra time:")
        print("| op | extra ms | extra calls |")
        print("|---|---|---|")
        for k, dt, dn in diffs[:15]:
            print(f"| {k} | {dt:+.1f} | {dn:+d} |")

    out = dict(
        workload=dict(name="gpt", **opts, vocab_effective=args.vocab or 32000, micro_batch=mb, precision="fp32",
                      optimizer="AdamW"),
        torch=torch.__version__, threads=threads, cpus=affinity, warmup=args.warmup, steps=args.steps,
        load_1min=timing["load_1min"], rows=rows, verdicts=verdicts,
        criteria=dict(all_min_cut=ALL_MIN_CUT, all_max_extra_time=ALL_MAX_EXTRA,
                      selective_min_keep=SEL_MIN_KEEP, selective_max_extra_time=SEL_MAX_EXTRA),
        profile={m: {k: dict(self_ms=t, calls=n) for k, (t, n) in ops.items()} for m, ops in profile.items()}
        if profile else None,
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
