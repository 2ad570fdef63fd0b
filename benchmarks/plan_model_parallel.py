"""A 70B model over 64 and 512 H100s with a global batch smaller than the GPUs: the plan memfit makes where data
parallelism alone cannot use the ranks, and why.

    python benchmarks/plan_model_parallel.py [--seq 8192] [--cases 64:32,512:64]   (GPUs:global batch)

The model is Llama 3 70B's shape as memfit's GPT (80 blocks, hidden 8192, 64 heads, 8 key/value heads, FFN
28672, vocabulary 128256), bf16, planned on fake tensors. Results: results/plan_model_parallel.json, rendered
into BENCHMARKS.md by render.py.
"""
from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import torch

from memfit.planner.search import plan
from memfit.workloads import builtin

RESULTS = Path(__file__).resolve().parent / "results"


def llama_70b(seq: int):
    return builtin("gpt-7b", layers=80, d_model=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=seq)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--cases", default="64:32,512:64")
    args = ap.parse_args()
    rows = []
    for case in args.cases.split(","):
        gpus, global_batch = (int(x) for x in case.split(":"))
        start = time.perf_counter()
        p = plan(llama_70b(args.seq), global_batch, device="h100", gpus=gpus)
        seconds = time.perf_counter() - start
        stages = [st["device_peak_bytes"] for st in (p.estimate.stages or [])] if p.estimate else []
        row = dict(gpus=gpus, seq=args.seq, global_batch=global_batch, chosen=p.config.describe(),
                   config=p.config.to_dict(), peak_bytes=p.peak_bytes, stage_peaks=stages,
                   step_seconds=p.step_seconds, samples_per_second=p.samples_per_second, plan_seconds=seconds,
                   families=[list(f) for f in p.families], notes=p.notes)
        rows.append(row)
        print(f"{gpus} H100s: {row['chosen']}, {p.peak_bytes / 2**30:.1f} GiB, {p.step_seconds:.2f} s a step "
              f"(planned in {seconds:.0f} s)", flush=True)
        for n in p.notes:
            print("  -", n, flush=True)
    RESULTS.mkdir(exist_ok=True)
    out = dict(date=datetime.date.today().isoformat(), torch=torch.__version__.split("+")[0], rows=rows)
    (RESULTS / "plan_model_parallel.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
