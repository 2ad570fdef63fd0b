"""Predicted vs measured step time on this CPU: resnet-tiny, the `sort` demo and gpt-tiny, fp32 and bf16.

Predicted: `costmodel.step_seconds` on a full estimate of the configuration (what `plan` confirms), with
the profile `plan` would use (the cached calibration, or a fresh one with --calibrate).
Measured: `memfit.Trainer` steps, after --warmup steps, median of --steps; a step during which other
processes used more than --foreign-max cores is redone once the machine is quiet (planner_cpu.py's meter).

    .venv/bin/python benchmarks/step_time.py --label after [--calibrate]

Results are appended to benchmarks/results/step_time.json under the label.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import memfit  # noqa: E402
from memfit import Config  # noqa: E402
from memfit.memory.devices import get_device  # noqa: E402
from memfit.memory.estimate import probe  # noqa: E402
from memfit.planner import costmodel  # noqa: E402
from memfit.planner.costmodel import KINDS, OpTable, step_seconds  # noqa: E402
from memfit.workloads import builtin  # noqa: E402
from planner_cpu import MAX_WAIT, timed_steps, wait_quiet  # noqa: E402

MODELS = ("resnet-tiny", "sort", "gpt-tiny")
SHAPES = ((64, 1), (8, 8))  # (micro-batch, accumulation): one large micro-step, and eight small ones


def parts(profile, ops) -> dict:
    """Where the predicted time goes: busy (device) milliseconds and op counts by class of op and dtype."""
    table = OpTable(ops)
    busy = costmodel._device_seconds(profile, table.flops, table.bytes, table.alloc, table.kind, table.cls)
    out = {"ops": len(ops), "dispatch_ms": round(1e3 * len(ops) * profile.op_overhead, 3)}
    for c, name in enumerate(costmodel.CLASSES):
        for kind in ("f32", "lp", "rng"):
            sel = (table.cls == c) & (table.kind == KINDS[kind])
            if int(sel.sum()):
                out[f"{name}.{kind}"] = dict(ops=int(sel.sum()), busy_ms=round(1e3 * float(busy[sel].sum()), 3))
    return out


def measure(wl, cfg: Config, warmup: int, steps: int, max_foreign: float) -> dict:
    gc.collect()
    wait_quiet(max_foreign, label=f"{wl.name} {cfg}")
    trainer = memfit.Trainer(wl, cfg)
    batches = [trainer.batch(i) for i in range(warmup + steps)]
    for b in batches[:warmup]:
        trainer.step(b)
    it = iter(batches[warmup:])
    times, foreign, redone = timed_steps(lambda: trainer.step(next(it, batches[-1])), steps, max_foreign)
    return dict(median_s=statistics.median(times), min_s=min(times), times_s=times,
                foreign_cores=[round(f, 3) for f in foreign], redone=redone)


def quiet_calibration(max_wait: float, tries: int = 10) -> costmodel.Profile:
    """A calibration that passed its own checks, measured when other processes left the cores alone."""
    for _ in range(tries):
        wait_quiet(0.1, max_wait, label="calibration")
        profile = costmodel.calibrate("cpu", attempts=1)
        if not profile.problems:
            return profile
        print(f"  calibration suspect ({'; '.join(profile.problems)}); again", flush=True)
    raise SystemExit("no clean calibration: the machine never stayed quiet")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", required=True)
    ap.add_argument("--calibrate", action="store_true", help="measure a fresh profile instead of the cached one")
    ap.add_argument("--profile", help="a profile saved as JSON (Profile.to_dict) instead of the cached one")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--foreign-max", type=float, default=0.3)
    ap.add_argument("--max-wait", type=float, default=120.0)
    args = ap.parse_args(argv)
    MAX_WAIT[0] = args.max_wait
    if args.profile:
        profile = costmodel.Profile(**json.loads(Path(args.profile).read_text()))
    elif args.calibrate:
        profile = quiet_calibration(args.max_wait)
    else:
        profile = costmodel.profile_for(get_device("cpu"))
    rows = []
    for name in args.models.split(","):
        wl = builtin(name)
        for precision in ("fp32", "bf16"):
            for m, accum in SHAPES:
                cfg = Config(micro_batch=m, grad_accum=accum, precision=precision)
                ops = probe(wl, cfg).ops
                predicted = step_seconds(profile, ops)
                got = measure(wl, cfg, args.warmup, args.steps, args.foreign_max)
                ratio = got["median_s"] / predicted
                rows.append(dict(model=name, precision=precision, micro_batch=m, grad_accum=accum,
                                 predicted_s=predicted, measured=got, measured_over_predicted=ratio,
                                 parts=parts(profile, ops)))
                print(f"{name:12s} {precision:5s} mb {m:3d} x {accum}: predicted {predicted * 1e3:8.1f} ms, "
                      f"measured {got['median_s'] * 1e3:8.1f} ms (min {got['min_s'] * 1e3:.1f}), "
                      f"measured/predicted {ratio:5.2f}", flush=True)
    out = HERE / "results" / "step_time.json"
    data = json.loads(out.read_text()) if out.exists() else {}
    data[args.label] = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), torch=torch.__version__,
                            threads=torch.get_num_threads(), profile=profile.to_dict(), rows=rows)
    out.write_text(json.dumps(data, indent=1))
    print(f"saved to {out} under {args.label!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
