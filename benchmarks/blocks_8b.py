"""`memfit estimate` of the Llama-3-8B shape (transformers' LlamaForCausalLM from its config values, as
`fit_8b.py` builds it) on an RTX 4090, traced whole and counted from copies (`--blocks auto`): wall and CPU
seconds of the command, peak RSS, and the bytes of each. Results: benchmarks/results/blocks_8b.json.

    nice -n 10 python benchmarks/blocks_8b.py [--seq 2048] [--micro-batch 1]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent / "tests" / "data" / "hf_configs" / "llama-3-8b.json"
FIGURES = ("peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_peak_bytes", "breakdown",
           "model_state_bytes", "flops", "parameters", "peak_phase")


def run(blocks: str, seq: int, micro_batch: int) -> dict:
    cmd = [sys.executable, "-m", "memfit.cli", "estimate", f"hf:{CONFIG}", "--seq", str(seq), "--micro-batch",
           str(micro_batch), "--precision", "bf16", "--device", "rtx-4090", "--json", "--blocks", blocks]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, rusage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if status:
        raise SystemExit(f"{' '.join(cmd)} exited {status}")
    est = json.loads(out)
    return dict(blocks=blocks, wall_s=round(wall, 1), cpu_s=round(rusage.ru_utime + rusage.ru_stime, 1),
                max_rss_bytes=rusage.ru_maxrss * 1024, extrapolated_from=est["extrapolated_from"],
                **{k: est[k] for k in FIGURES})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=1)
    args = ap.parse_args()
    rows = [run(b, args.seq, args.micro_batch) for b in ("all", "auto")]
    same = {k: rows[0][k] == rows[1][k] for k in FIGURES}
    result = dict(case=f"Llama-3-8B shape, seq {args.seq}, micro-batch {args.micro_batch}, bf16, rtx-4090",
                  rows=rows, same=same)
    (HERE / "results" / "blocks_8b.json").write_text(json.dumps(result, indent=1))
    for r in rows:
        print(f"{r['blocks']:>4}: {r['wall_s']} s wall, {r['cpu_s']} s CPU, {r['max_rss_bytes'] / 2**30:.2f} GiB RSS, "
              f"peak {r['peak_bytes']:,} allocated {r['peak_allocated_bytes']:,} reserved {r['peak_reserved_bytes']:,}"
              f" extrapolated_from {r['extrapolated_from']}")
    print("same figures:", all(same.values()), {k: v for k, v in same.items() if not v})


if __name__ == "__main__":
    main()
