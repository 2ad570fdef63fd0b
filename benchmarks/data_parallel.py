"""Per-rank estimates of FSDP2 layouts against real ranks: each configuration is estimated in one process (rank
0 of a fake world) and run for real on N CPU processes joined by gloo, each rank measuring its own peak with
the CPU allocator's running total (truth.allocator_step_peak; gloo's own all-gather buffers left out).

    python benchmarks/data_parallel.py [--ranks 2,4]

Results: benchmarks/results/data_parallel.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import memfit
from memfit import Config
from memfit.workloads import builtin
from truth import rank_step_peaks

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4")
    args = ap.parse_args()
    workloads = {"gpt-tiny": builtin("gpt-tiny"), "sort": builtin("sort")}
    rows = []
    for (name, wl), n, layout, precision, ck in itertools.product(
            workloads.items(), [int(r) for r in args.ranks.split(",")], ["fsdp", "fsdp-no-reshard"],
            ["fp32", "bf16"], ["none", "all"]):
        cfg = Config(micro_batch=8, gpus=n, data_parallel=layout, precision=precision, activation_checkpoint=ck)
        est = memfit.estimate(wl, cfg).peak_bytes
        peaks = rank_step_peaks(wl, cfg)
        row = dict(workload=name, ranks=n, layout=layout, precision=precision, checkpoint=ck, estimate=est,
                   rank_peaks=peaks, error_vs_max=est / max(peaks) - 1, error_vs_min=est / min(peaks) - 1)
        rows.append(row)
        print(f"{name:8} N={n} {layout:15} {precision} ck={ck:4} est {est:>10,} ranks {peaks} "
              f"{row['error_vs_min']:+.2%} .. {row['error_vs_max']:+.2%}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "data_parallel.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
