"""What activation checkpointing buys and costs, measured on CPU: a 12-layer Llama-shaped transformer,
checkpoint "none" / "all" / every 2nd block / "selective".

For each mode:
  memory   activation memory = the step's peak minus the model state (parameters + gradients + AdamW state,
           the same in every mode), from memfit.estimate and from the PyTorch profiler's view of a real
           step (benchmarks/truth.py); also the estimate's activations + temporaries live at its peak
           (differs from the former when gradients are not yet live at the peak).
  time     real TrainStep calls, the modes interleaved round by round so that load from other processes
           falls on all of them alike: --warmup steps each, then the median of --steps steps, a step that
           another process disturbed (> 1.25 x its mode's fastest) being run again; also the median of the
           per-round ratios to "none", the fastest step, and the median of the first tries (no re-runs).
  FLOPs    the estimate's recompute FLOPs (forward ops re-run in backward; FlopCounterMode counts matmuls
           and attention only, so recomputed pointwise ops count zero).
Then the issue's two verdicts, with the numbers. Where selective misses its time criterion (or with
--analyse always), one decoder block is timed alone (short interleaved calls: robust to other processes)
under selective-policy variants (more op types kept; everything kept, i.e. the checkpoint machinery
with no recompute) and at 2x and 4x the width, and the block's forward is split by op under the profiler:
where the extra time goes, and whether a different `_SAVE` set would remove it.

Cases: the workload as the preset has it (vocab 32000), and, unless --only-preset, the same model with
the vocabulary scaled to 8 x d_model, the LM-head-to-width ratio of Llama-2-7B (32000 / 4096): with
d_model 256 the preset's vocabulary makes the logits, which no block checkpointing can touch, the largest
thing live at the peak.

    taskset -c 0,1 python benchmarks/checkpoint_tradeoff.py [--d-model 256 --seq 256 --micro-batch 4]
"""
from __future__ import annotations

import argparse
import functools
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
from memfit.step import TrainStep  # noqa: E402
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


# ------------------------------------------------------------------------------------------- measuring

def measure_memory(wl, mode, mb: int) -> dict:
    cfg = memfit.Config(micro_batch=mb, activation_checkpoint=mode)
    est = memfit.estimate(wl, cfg)
    state = sum(est.model_state_bytes.values())
    gc.collect()
    real = real_step_peak(wl, cfg)
    gc.collect()
    return dict(
        mode=label(mode), checkpoint=mode, estimate_peak=est.peak_bytes, real_peak=real, model_state=state,
        model_state_bytes=est.model_state_bytes,
        act_estimate=est.peak_bytes - state, act_real=real - state,
        act_tmp_at_peak=est.breakdown["activations"] + est.breakdown["temporaries"],
        breakdown=est.breakdown, peak_phase=est.peak_phase, method=est.method,
        top_tensors=est.top_tensors[:4], flops=est.flops, recompute_flops=est.recompute_flops,
    )


def measure_time(wl, mb: int, warmup: int, steps: int, tolerance: float = 1.25, retries: int = 6) -> dict:
    """Seconds per optimizer step for every mode, the modes interleaved step by step.

    Other processes on these cores do not slow a step a little: with two OpenMP threads on two cores, a
    thread that loses its core stalls its partner at every barrier and the step takes 3-10x as long. So a
    step slower than `tolerance` x the fastest step of its mode seen so far is taken as disturbed and
    run again (up to `retries` times; the last try is kept whatever it took). Both the accepted steps
    and the first tries are returned, and how many tries were thrown away."""
    trainers = {}
    for mode in MODES:
        torch.manual_seed(0)
        trainers[label(mode)] = TrainStep(wl, memfit.Config(micro_batch=mb, activation_checkpoint=mode), "cpu")
    torch.manual_seed(1)
    batches = [wl.batch(mb) for _ in range(warmup + steps)]
    wall = {k: [] for k in trainers}
    first = {k: [] for k in trainers}
    cpu = {k: [] for k in trainers}
    best = {k: float("inf") for k in trainers}
    rejected = {k: 0 for k in trainers}
    loads = [os.getloadavg()[0]]
    for i, batch in enumerate(batches):
        order = list(trainers) if i % 2 == 0 else list(trainers)[::-1]  # no mode always runs first
        for k in order:
            for attempt in range(1 if i < warmup else retries + 1):
                c0, t0 = time.process_time(), time.perf_counter()
                trainers[k](batch)
                t1, c1 = time.perf_counter(), time.process_time()
                dt = t1 - t0
                if i >= warmup and attempt == 0:
                    first[k].append(dt)
                clean = dt <= tolerance * best[k]
                best[k] = min(best[k], dt)
                if i < warmup or clean or attempt == retries:
                    break
                rejected[k] += 1
            if i >= warmup:
                wall[k].append(dt)
                cpu[k].append(c1 - c0)
        loads.append(os.getloadavg()[0])
    del trainers
    gc.collect()
    return dict(wall=wall, first_try=first, cpu=cpu, rejected=rejected, load_1min=loads, tolerance=tolerance)


# ------------------------------------------------------------------------------------------- why selective costs time

def _block_runs(block, policies: dict) -> dict:
    """name -> (forward callable, selective policy or None) for one decoder block."""
    from memfit.strategies import activation_checkpoint as ck

    runs = {"none": (block.forward, None), "all": (functools.partial(ck._checkpointed, block.forward, False), None)}
    for name, policy in policies.items():
        runs[name] = (functools.partial(ck._checkpointed, block.forward, True), policy)
    return runs


def time_block(d_model: int, seq: int, mb: int, policies: dict, reps: int = 40) -> dict:
    """One decoder block, forward + backward, under each checkpoint variant: short calls interleaved, the
    fastest and the 20th-percentile call (noise from other processes only ever adds). ms."""
    from memfit.strategies import activation_checkpoint as ck
    from memfit.workloads.gpt import Block, config_for

    torch.manual_seed(0)
    block = Block(config_for("gpt-small", layers=1, d_model=d_model, seq=seq, vocab=256))
    x = torch.randn(mb, seq, d_model, requires_grad=True)
    g = torch.randn(mb, seq, d_model)
    runs = _block_runs(block, policies)
    original = ck._selective_policy

    def once(fn, policy):
        if policy is not None:
            ck._selective_policy = policy  # read by _checkpointed at call time
        try:
            for p in block.parameters():
                p.grad = None
            x.grad = None
            t0 = time.perf_counter()
            y = fn(x)
            t1 = time.perf_counter()
            y.backward(g)
            t2 = time.perf_counter()
        finally:
            ck._selective_policy = original
        return t1 - t0, t2 - t1

    for v in runs.values():
        for _ in range(3):
            once(*v)
    res = {k: [] for k in runs}
    for i in range(reps):
        for k in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
            res[k].append(once(*runs[k]))
    out = {}
    for k, v in res.items():
        tot = sorted(a + b for a, b in v)
        best = min(v, key=lambda ab: ab[0] + ab[1])
        out[k] = dict(min_ms=1e3 * tot[0], p20_ms=1e3 * tot[int(0.2 * (len(tot) - 1))],
                      fwd_ms=1e3 * best[0], bwd_ms=1e3 * best[1])
    return out


def forward_op_split(d_model: int, seq: int, mb: int) -> dict:
    """Self time of one block's forward under the profiler (best of 8 x 5 calls): matmuls and attention
    against everything else (what selective recomputes). ms per forward."""
    from torch.profiler import ProfilerActivity, profile

    from memfit.workloads.gpt import Block, config_for

    torch.manual_seed(0)
    block = Block(config_for("gpt-small", layers=1, d_model=d_model, seq=seq, vocab=256))
    x = torch.randn(mb, seq, d_model, requires_grad=True)
    for _ in range(3):
        block(x)
    best = None
    for _ in range(8):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                block(x)
        ops = {e.key: e.self_cpu_time_total / 5e3 for e in prof.key_averages() if e.key.startswith("aten::")}
        if best is None or sum(ops.values()) < sum(best.values()):
            best = ops
    heavy = {"aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product_flash_attention_for_cpu"}
    return dict(matmul_attention_ms=sum(v for k, v in best.items() if k in heavy),
                other_ms=sum(v for k, v in best.items() if k not in heavy),
                other_top=dict(sorted(((k, v) for k, v in best.items() if k not in heavy), key=lambda kv: -kv[1])[:8]))


def policy_variants() -> dict:
    """Selective as it is, with more op types kept, and keeping everything (no recompute at all: what
    the checkpoint machinery costs by itself)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from memfit.strategies import activation_checkpoint as ck

    aten = torch.ops.aten

    def keeping(extra):
        keep = frozenset(ck._SAVE) | extra
        return lambda ctx, func, *a, **k: (CheckpointPolicy.MUST_SAVE if func in keep
                                          else CheckpointPolicy.PREFER_RECOMPUTE)

    return {
        "selective": ck._selective_policy,
        "selective + silu": keeping({aten.silu.default}),
        "selective + rope (mul, add, neg, cat)": keeping({aten.mul.Tensor, aten.add.Tensor, aten.neg.default,
                                                          aten.cat.default}),
        "selective + norm statistics (pow, mean, rsqrt)": keeping({aten.pow.Tensor_Scalar, aten.mean.dim,
                                                                   aten.rsqrt.default}),
        "keep everything (no recompute)": lambda ctx, func, *a, **k: CheckpointPolicy.MUST_SAVE,
    }


def variant_memory(wl, mb: int, policies: dict) -> dict:
    """Estimated peak − model state for activation_checkpoint="selective" under each policy (MiB)."""
    from memfit.strategies import activation_checkpoint as ck

    original, out = ck._selective_policy, {}
    for name, policy in policies.items():
        ck._selective_policy = policy  # the estimate's forked child inherits it
        try:
            est = memfit.estimate(wl, memfit.Config(micro_batch=mb, activation_checkpoint="selective"))
        finally:
            ck._selective_policy = original
        out[name] = mib(est.peak_bytes - sum(est.model_state_bytes.values()))
    return out


def analyse_selective(wl, opts: dict, mb: int, rows: dict) -> dict:
    d, seq = opts["d_model"], opts["seq"]
    policies = policy_variants()
    print(f"\n### why selective costs time (one block, d_model {d}, seq {seq}, micro-batch {mb}; "
          f"load {os.getloadavg()[0]:.2f})")
    split = forward_op_split(d, seq, mb)
    print(f"block forward under the profiler: matmuls + attention {split['matmul_attention_ms']:.2f} ms, all other ops "
          f"{split['other_ms']:.2f} ms (what selective recomputes: "
          + ", ".join(f"{k[6:]} {v:.2f}" for k, v in split["other_top"].items()) + ")")
    memory = variant_memory(wl, mb, policies)
    memory.update(none=mib(rows["none"]["act_estimate"]), all=mib(rows["all"]["act_estimate"]))
    timing = {}
    for width in (d, 2 * d, 4 * d):
        chosen = policies if width == d else {k: policies[k] for k in ("selective", "keep everything (no recompute)")}
        timing[width] = time_block(width, seq, mb, chosen, reps=40 if width == d else 20)
    print("\n| block variant | activation memory (whole model, estimate) | d_model | fwd + bwd, fastest | extra vs none "
          "| 20th percentile | extra | forward | backward |")
    print("|---|---|---|---|---|---|---|---|---|")
    for width, res in timing.items():
        base = res["none"]
        for k, r in res.items():
            mem = f"{memory[k]:.1f} MiB" if width == d and k in memory else ""
            print(f"| {k} | {mem} | {width} | {r['min_ms']:.2f} ms | {100 * (r['min_ms'] / base['min_ms'] - 1):+.1f}% "
                  f"| {r['p20_ms']:.2f} ms | {100 * (r['p20_ms'] / base['p20_ms'] - 1):+.1f}% "
                  f"| {r['fwd_ms']:.2f} ms | {r['bwd_ms']:.2f} ms |")
    return dict(forward_op_split=split, variant_memory_mib=memory, block_timing={str(k): v for k, v in timing.items()})


# ------------------------------------------------------------------------------------------- one case

def run_case(name: str, opts: dict, mb: int, warmup: int, steps: int, analyse: str) -> dict:
    wl = builtin("gpt-small", **opts)
    print(f"\n## {name}: gpt {', '.join(f'{k}={v}' for k, v in opts.items())}, micro-batch {mb}, fp32, AdamW; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)
    t0 = time.perf_counter()
    rows = []
    for mode in MODES:
        rows.append(measure_memory(wl, mode, mb))
        r = rows[-1]
        print(f"  memory {r['mode']:>9}: estimate peak {mib(r['estimate_peak']):8.1f} MiB, profiler peak "
              f"{mib(r['real_peak']):8.1f} MiB, model state {mib(r['model_state']):.1f} MiB", flush=True)
    timing = measure_time(wl, mb, warmup, steps)
    base_wall = timing["wall"]["none"]
    for r in rows:
        w, c = timing["wall"][r["mode"]], timing["cpu"][r["mode"]]
        f = timing["first_try"][r["mode"]]
        r.update(step_s=statistics.median(w), step_cpu_s=statistics.median(c), step_min_s=min(w),
                 step_s_all=w, step_cpu_s_all=c, step_first_try_s=f, step_first_try_median_s=statistics.median(f),
                 rejected_tries=timing["rejected"][r["mode"]],
                 extra_time_paired=statistics.median(a / b for a, b in zip(w, base_wall)) - 1)
    base = rows[0]
    for r in rows:
        for key in ("act_estimate", "act_real", "act_tmp_at_peak"):
            r[f"cut_{key}"] = 1 - r[key] / base[key]
        r["extra_time"] = r["step_s"] / base["step_s"] - 1
        r["extra_cpu_time"] = r["step_cpu_s"] / base["step_cpu_s"] - 1
        r["extra_time_min"] = r["step_min_s"] / base["step_min_s"] - 1
        r["extra_time_first_try"] = r["step_first_try_median_s"] / base["step_first_try_median_s"] - 1
    loads = timing["load_1min"]
    print(f"  measured in {time.perf_counter() - t0:.0f} s; 1-min load average during timing "
          f"{min(loads):.2f}..{max(loads):.2f}; disturbed tries run again (> {timing['tolerance']}x the mode's "
          f"fastest): " + ", ".join(f"{r['mode']} {r['rejected_tries']}" for r in rows) + "\n")

    print("| mode | activation memory (profiler peak − model state) | cut vs none | estimate: peak − model state | cut "
          "| estimate: activations + temporaries at peak | cut | step time (median) | extra vs none "
          "| paired median / fastest step / first tries | recompute GFLOPs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {mib(r['act_real']):.1f} MiB | {100 * r['cut_act_real']:.1f}% "
              f"| {mib(r['act_estimate']):.1f} MiB | {100 * r['cut_act_estimate']:.1f}% "
              f"| {mib(r['act_tmp_at_peak']):.1f} MiB | {100 * r['cut_act_tmp_at_peak']:.1f}% "
              f"| {r['step_s']:.3f} s | {100 * r['extra_time']:+.1f}% "
              f"| {100 * r['extra_time_paired']:+.1f}% / {100 * r['extra_time_min']:+.1f}% / "
              f"{100 * r['extra_time_first_try']:+.1f}% "
              f"| {r['recompute_flops'] / 1e9:.2f} ({100 * r['recompute_flops'] / r['flops']:.0f}% of "
              f"{r['flops'] / 1e9:.0f}) |")
    ms = base["model_state_bytes"]
    print(f"\nmodel state {mib(base['model_state']):.1f} MiB in every mode (parameters {mib(ms['parameters']):.1f}, "
          f"gradients {mib(ms['gradients']):.1f}, optimizer state {mib(ms['optimizer_state']):.1f}); "
          f"the peaks are in the {', '.join(sorted({r['peak_phase'] for r in rows}))} phase")
    top = base["top_tensors"][0]
    print(f"largest tensor live at the 'none' peak: {mib(top['bytes']):.1f} MiB {top['category']} {top['shape']} "
          f"from {top['op']}")

    verdicts = {}
    by = {r["mode"]: r for r in rows}
    full, sel = by["all"], by["selective"]
    for key, what in (("act_real", "profiler"), ("act_estimate", "estimate")):
        cut_all = full[f"cut_{key}"]
        saving_all = base[key] - full[key]
        keep = (base[key] - sel[key]) / saving_all if saving_all > 0 else float("nan")
        verdicts[what] = dict(
            all_cut=cut_all, all_extra_time=full["extra_time"],
            all_pass=bool(cut_all >= ALL_MIN_CUT and full["extra_time"] <= ALL_MAX_EXTRA),
            selective_keep=keep, selective_extra_time=sel["extra_time"],
            selective_pass=bool(keep >= SEL_MIN_KEEP and sel["extra_time"] <= SEL_MAX_EXTRA),
        )
    print()
    for what, v in verdicts.items():
        print(f"[{what} memory] checkpoint all cuts activation memory by >= 70% at <= 40% extra step time: "
              f"{_verdict_all(v)}")
        print(f"[{what} memory] selective keeps >= 40% of that saving at <= 10% extra time: {_verdict_sel(v)}")

    analysis = None
    if analyse == "always" or (analyse == "auto" and sel["extra_time"] > SEL_MAX_EXTRA):
        analysis = analyse_selective(wl, opts, mb, by)
    return dict(name=name, workload=dict(**opts, micro_batch=mb, precision="fp32", optimizer="AdamW"),
                load_1min=loads, rows=rows, verdicts=verdicts, selective_analysis=analysis)


def _verdict_all(v) -> str:
    why = []
    if v["all_cut"] < ALL_MIN_CUT:
        why.append(f"cut short by {100 * (ALL_MIN_CUT - v['all_cut']):.1f} points")
    if v["all_extra_time"] > ALL_MAX_EXTRA:
        why.append(f"time over by {100 * (v['all_extra_time'] - ALL_MAX_EXTRA):.1f} points")
    return (f"{'PASS' if v['all_pass'] else 'FAIL'} (cut {100 * v['all_cut']:.1f}%, extra time "
            f"{100 * v['all_extra_time']:+.1f}%{'; ' + ', '.join(why) if why else ''})")


def _verdict_sel(v) -> str:
    why = []
    if v["selective_keep"] < SEL_MIN_KEEP:
        why.append(f"keeps {100 * (SEL_MIN_KEEP - v['selective_keep']):.1f} points too little")
    if v["selective_extra_time"] > SEL_MAX_EXTRA:
        why.append(f"time over by {100 * (v['selective_extra_time'] - SEL_MAX_EXTRA):.1f} points")
    return (f"{'PASS' if v['selective_pass'] else 'FAIL'} (keeps {100 * v['selective_keep']:.1f}% of the saving, "
            f"extra time {100 * v['selective_extra_time']:+.1f}%{'; ' + ', '.join(why) if why else ''})")


# ------------------------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--only-preset", action="store_true", help="skip the case with the vocabulary scaled to 8 x d_model")
    ap.add_argument("--analyse", choices=("auto", "always", "never"), default="auto",
                    help="time one block under selective-policy variants and wider d_model; auto: when selective "
                         "misses the 10%% time criterion")
    ap.add_argument("--out", default=str(HERE / "results" / "checkpoint_tradeoff.json"))
    args = ap.parse_args()
    if args.steps < 7:
        ap.error("--steps must be at least 7")
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpus {affinity}; warm-up {args.warmup}, "
          f"median of {args.steps} steps per mode")
    shape = dict(layers=args.layers, d_model=args.d_model, seq=args.seq)
    cases = [("preset vocabulary (32000)", shape)]
    if not args.only_preset:
        cases.append((f"vocabulary 8 x d_model ({8 * args.d_model}, the head-to-width ratio of Llama-2-7B)",
                      dict(shape, vocab=8 * args.d_model)))
    results = [run_case(name, opts, args.micro_batch, args.warmup, args.steps, args.analyse) for name, opts in cases]
    out = dict(torch=torch.__version__, threads=torch.get_num_threads(), cpus=affinity, warmup=args.warmup,
               steps=args.steps,
               criteria=dict(all_min_cut=ALL_MIN_CUT, all_max_extra_time=ALL_MAX_EXTRA,
                             selective_min_keep=SEL_MIN_KEEP, selective_max_extra_time=SEL_MAX_EXTRA),
               cases=results)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
