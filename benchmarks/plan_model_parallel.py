"""A 70B model over 64 and 512 H100s with a global batch smaller than the GPUs: the plan memfit makes where data
parallelism alone cannot use the ranks, and why; and with a batch data parallelism does split (--beside), the
plan with the split layouts searched beside it (`split_layouts="also"`) against the data-parallel plan alone:
what the cost model says and how long each plan takes.

    python benchmarks/plan_model_parallel.py [--seq 8192] [--cases 64:32,512:64] [--beside 512:512]
                                             (GPUs:global batch)

The model is Llama 3 70B's shape as memfit's GPT (80 blocks, hidden 8192, 64 heads, 8 key/value heads, FFN
28672, vocabulary 128256), bf16, planned on fake tensors. Results: results/plan_model_parallel.json, rendered
into BENCHMARKS.md by render.py.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import time
from pathlib import Path

import torch

from memfit.planner import search
from memfit.planner.search import plan
from memfit.workloads import builtin

RESULTS = Path(__file__).resolve().parent / "results"


def llama_70b(seq: int):
    return builtin("gpt-7b", layers=80, d_model=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=seq)


@contextlib.contextmanager
def _watching(seen: dict):
    """Times the split search of a plan that searches it beside data parallelism, and keeps the data-parallel
    plan it is weighed against (the plan returns only the faster)."""
    faster_of, split_plan = search._faster_of, search._split_plan

    def timed_split(s, why_not, families):
        start = time.perf_counter()
        try:
            return split_plan(s, why_not, families)
        finally:
            seen["split_search_seconds"] = time.perf_counter() - start

    def weighed(s, chosen):
        seen["data_parallel"] = dict(chosen=chosen.config.describe(), config=chosen.config.to_dict(),
                                     peak_bytes=chosen.peak_bytes, step_seconds=chosen.step_seconds)
        return faster_of(s, chosen)

    search._faster_of, search._split_plan = weighed, timed_split
    try:
        yield
    finally:
        search._faster_of, search._split_plan = faster_of, split_plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cases", default="64:32,512:64")
    ap.add_argument("--beside", default="", help="GPUs:global batch cases planned with split_layouts='also' "
                    "(512:512 took 28 min here)")
    args = ap.parse_args()
    rows = []
    runs = [(case, "fallback") for case in args.cases.split(",") if case]
    runs += [(case, "also") for case in args.beside.split(",") if case]
    for case, mode in runs:
        gpus, global_batch = (int(x) for x in case.split(":"))
        seen = {}
        start = time.perf_counter()
        with _watching(seen):
            p = plan(llama_70b(args.seq), global_batch, device="h100", gpus=gpus, split_layouts=mode)
        seconds = time.perf_counter() - start
        stages = [st["device_peak_bytes"] for st in (p.estimate.stages or [])] if p.estimate else []
        row = dict(gpus=gpus, seq=args.seq, global_batch=global_batch, split_layouts=mode,
                   chosen=p.config.describe(), config=p.config.to_dict(), peak_bytes=p.peak_bytes, stage_peaks=stages,
                   step_seconds=p.step_seconds, samples_per_second=p.samples_per_second, plan_seconds=seconds,
                   families=[list(f) for f in p.families], notes=p.notes, **seen)
        rows.append(row)
        print(f"{gpus} H100s, batch {global_batch}, split layouts {mode}: {row['chosen']}, "
              f"{p.peak_bytes / 2**30:.1f} GiB, {p.step_seconds:.2f} s a step (planned in {seconds:.0f} s)", flush=True)
        for n in p.notes:
            print("  -", n, flush=True)
        RESULTS.mkdir(exist_ok=True)  # after each row: a long case cut short keeps the others
        out = dict(date=datetime.date.today().isoformat(), torch=torch.__version__.split("+")[0], rows=rows)
        (RESULTS / "plan_model_parallel.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
