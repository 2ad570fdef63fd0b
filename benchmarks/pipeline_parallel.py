"""Every pipeline rank's estimate against its own real rank: `Config.pp` ranks under GPipe, 1F1B, interleaved
1F1B and zero bubble (the last two with 2 stages a rank), with and without activation checkpointing, on forked
CPU processes joined by gloo (torch.distributed.pipelining's schedules, as `memfit train --pp` runs them).

    python benchmarks/pipeline_parallel.py [--stages 2,4] [--only gpt-tiny,hf-llama] [--schedules ...] [--no-deeper]
    python benchmarks/pipeline_parallel.py --tp-rows    # only the rows with tensor parallelism, merged in

Each rank is estimated as its own rank of a fake world, all its stages together (memfit.estimate traces them
all); each real rank measures its own peak with the CPU allocator's running total (truth.rank_step_peaks). The
interleaved schedules need pp x 2 blocks: grid rows whose model has fewer are left out, and a few rows on deeper
gpt-tinys (6 blocks, 3 stages a rank; 8 blocks, 4 ranks of 2) follow the grid. Then stages of tensor-parallel
ranks (pp x tp, and pp x dp x tp on the 3-D mesh): each stage is traced as its first rank and compared with the
lowest peak among its ranks over up to TP_RUNS runs (gloo's late frees only add); every rank's lowest is kept
too. Results: results/pipeline_parallel.json, rendered into BENCHMARKS.md by render.py.
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import time
from pathlib import Path

import torch

import memfit
from data_parallel import hf_llama
from memfit import Config
from memfit.workloads import builtin
from truth import rank_step_peaks

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = {"gpt-tiny": lambda: builtin("gpt-tiny", layers=4), "hf-llama": hf_llama,
             "gpt-tiny-6": lambda: builtin("gpt-tiny", layers=6), "gpt-tiny-8": lambda: builtin("gpt-tiny", layers=8)}
BLOCKS = 4  # the grid's models' repeated blocks
# the interleaved schedules beyond the grid: 3 stages a rank, and 4 ranks of 2 (deeper gpt-tinys)
DEEPER = [(name, pp, v, schedule, "none") for name, pp, v in (("gpt-tiny-6", 2, 3), ("gpt-tiny-8", 4, 2))
          for schedule in ("interleaved-1f1b", "zero-bubble")]
WORKLOADS["gpt-tiny-2"] = lambda: builtin("gpt-tiny")
# (workload, pp, data-parallel ranks, tp, schedule, checkpointing): stages of TP ranks; zero-bubble is refused
TP_GRID = [("gpt-tiny-2", 2, 1, 2, "1f1b", "none"), ("gpt-tiny", 2, 1, 2, "1f1b", "none"),
           ("gpt-tiny", 2, 1, 2, "gpipe", "all"), ("gpt-tiny", 2, 1, 2, "interleaved-1f1b", "none"),
           ("gpt-tiny-2", 2, 2, 2, "1f1b", "all"), ("hf-llama", 2, 1, 2, "gpipe", "none"),
           ("hf-llama", 2, 1, 2, "1f1b", "none")]
TP_RUNS = 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--only", default="gpt-tiny,hf-llama")
    ap.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b,zero-bubble")
    ap.add_argument("--no-deeper", dest="deeper", action="store_false",
                    help="leave out the rows of 3 stages a rank and of 4 ranks of 2 stages")
    ap.add_argument("--tp-rows", action="store_true", help="only the rows of stages of tensor-parallel ranks, "
                    "replacing those rows in the results")
    args = ap.parse_args()
    if args.tp_rows:
        old = json.loads((RESULTS / "pipeline_parallel.json").read_text())
        old["rows"] = [r for r in old["rows"] if r.get("tp", 1) == 1] + [_tp_row(*row) for row in TP_GRID]
        (RESULTS / "pipeline_parallel.json").write_text(json.dumps(old, indent=1))
        return
    rows = []
    grid = [(name, pp, 1 if schedule in ("gpipe", "1f1b") else 2, schedule, ck) for name, pp, schedule, ck in
            itertools.product(args.only.split(","), [int(s) for s in args.stages.split(",")],
                              args.schedules.split(","), ["none", "all"])]
    grid = [row for row in grid if row[1] * row[2] <= BLOCKS] + (DEEPER if args.deeper else [])
    for name, pp, virtual, schedule, ck in grid:
        wl = WORKLOADS[name]()
        cfg = Config(micro_batch=2, grad_accum=2 * pp, pp=pp, pp_schedule=schedule, pp_virtual=virtual,
                     activation_checkpoint=ck)
        start = time.perf_counter()
        est = memfit.estimate(wl, cfg)
        seconds = time.perf_counter() - start
        real = rank_step_peaks(wl, cfg)
        stages = [s["peak_bytes"] for s in est.stages]
        row = dict(workload=name, stages=pp, stages_per_rank=virtual, schedule=schedule, checkpoint=ck,
                   micro_batch=2, micro_batches=2 * pp,
                   estimates=stages, rank_peaks=real, diff_bytes=[e - r for e, r in zip(stages, real)],
                   worst_error=max(abs(e / r - 1) for e, r in zip(stages, real)), estimate_seconds=seconds)
        rows.append(row)
        print(f"{name:8} pp={pp}x{virtual} {schedule:16} ck={ck:4} est {stages} real {real} "
              f"diff {row['diff_bytes']} ({seconds:.1f} s)", flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = dict(date=datetime.date.today().isoformat(), torch=torch.__version__.split("+")[0], rows=rows)
    (RESULTS / "pipeline_parallel.json").write_text(json.dumps(out, indent=1))


def _tp_row(name: str, pp: int, dp: int, tp: int, schedule: str, ck: str) -> dict:
    """One layout of stages of TP ranks: each stage's estimate against the lowest peak among its ranks."""
    wl = WORKLOADS[name]()
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    cfg = Config(micro_batch=2, grad_accum=2 * pp, pp=pp, pp_schedule=schedule, pp_virtual=virtual,
                 activation_checkpoint=ck, tp=tp, gpus=dp, data_parallel="fsdp" if dp > 1 else "none")
    start = time.perf_counter()
    est = memfit.estimate(wl, cfg)
    seconds = time.perf_counter() - start
    stages, per = [s["peak_bytes"] for s in est.stages], dp * tp
    peaks, runs = rank_step_peaks(wl, cfg, settle=True), 1
    while runs < TP_RUNS:
        lowest = [min(peaks[s * per:(s + 1) * per]) for s in range(pp)]
        if all(abs(e / r - 1) <= 0.01 for e, r in zip(stages, lowest)):
            break
        peaks, runs = [min(a, b) for a, b in zip(peaks, rank_step_peaks(wl, cfg, settle=True))], runs + 1
    lowest = [min(peaks[s * per:(s + 1) * per]) for s in range(pp)]
    model = {"gpt-tiny-2": "gpt-tiny (2 layers)", "gpt-tiny": "gpt-tiny (4 layers)"}.get(name, name)
    label = f"{model}, {f'dp {dp} × ' if dp > 1 else ''}tp {tp}"
    row = dict(workload=label, stages=pp, stages_per_rank=virtual, schedule=schedule, checkpoint=ck, tp=tp, gpus=dp,
               micro_batch=2, micro_batches=2 * pp, estimates=stages, rank_peaks=lowest, every_rank_lowest=peaks,
               runs=runs, diff_bytes=[e - r for e, r in zip(stages, lowest)],
               worst_error=max(abs(e / r - 1) for e, r in zip(stages, lowest)), estimate_seconds=seconds)
    print(f"{label:30} pp={pp}x{virtual} {schedule:16} ck={ck:4} est {stages} lowest {lowest} every rank {peaks} "
          f"diff {row['diff_bytes']} ({runs} runs, {seconds:.1f} s)", flush=True)
    return row


if __name__ == "__main__":
    main()
