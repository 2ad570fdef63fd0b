"""How long an estimate of a long accumulation takes, whole and counted from copies (`--blocks all|auto`), at
the configurations the planner chooses for the Llama-3-8B shape (seq 2048, 1 x 32 on an RTX 4090) and gpt-7b
(seq 4096, 16 x 4 on an A100 80GB, optimizer offload): what `memfit estimate` and the training-stack
integrations run for the plan they are handed. Each estimate in a child process of its own, with the memfit
source given by `--src` (another checkout measures older code beside this one in the same run).

    python benchmarks/estimate_accumulation.py [--src src] [--label now] [--out results/estimate_accumulation.json]

Rows are appended to --out (one per case and --blocks): wall seconds, the peak, the device peak and FLOPs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = {
    "Llama-3-8B shape, seq 2048, RTX 4090, micro-batch 1 x 32, bf16-pure, checkpointing all":
        ("8b", "rtx-4090", dict(micro_batch=1, grad_accum=32, precision="bf16-pure", activation_checkpoint="all")),
    "gpt-7b, seq 4096, A100 80GB, micro-batch 16 x 4, bf16-pure, checkpointing all, optimizer offload, loss in 8 chunks":
        ("7b", "a100-80gb", dict(micro_batch=16, grad_accum=4, precision="bf16-pure", activation_checkpoint="all",
                                 offload_optimizer=True, loss_chunks=8)),
}


def child(model: str, device: str, config: dict, blocks: str) -> dict:
    from memfit.config import Config
    from memfit.memory.extrapolate import estimate_blocks
    from memfit.workloads import builtin

    if model == "8b":
        sys.path.insert(0, str(HERE))
        from fit_8b import LLAMA3_8B, _workload
        workload = _workload(LLAMA3_8B, 2048, tempfile.mkdtemp())
    else:
        workload = builtin("gpt-7b", seq=4096)
    t0 = time.perf_counter()
    est = estimate_blocks(workload, Config(**config), device, blocks)
    return dict(seconds=round(time.perf_counter() - t0, 1), peak_bytes=est.peak_bytes,
                device_peak_bytes=est.device_peak_bytes, flops=est.flops, extrapolated_from=est.extrapolated_from)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default=str(HERE.parent / "src"))
    ap.add_argument("--label", default="now")
    ap.add_argument("--blocks", default="auto,all")
    ap.add_argument("--out", default=str(HERE / "results" / "estimate_accumulation.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*json.loads(args.child))))
        return
    out = Path(args.out)
    rows = json.loads(out.read_text()) if out.exists() else []
    env = dict(os.environ, PYTHONPATH=str(Path(args.src).resolve()), MEMFIT_TRACE_CACHE="0")
    for case, (model, device, config) in CASES.items():
        for blocks in args.blocks.split(","):
            job = json.dumps([model, device, config, blocks])
            done = subprocess.run([sys.executable, __file__, "--child", job], env=env, capture_output=True, text=True)
            lines = done.stdout.strip().splitlines()
            row = dict(case=case, blocks=blocks, code=args.label,
                       **(json.loads(lines[-1]) if done.returncode == 0 and lines else
                          {"error": (done.stderr.strip().splitlines() or ["?"])[-1]}))
            rows.append(row)
            print(json.dumps(row), flush=True)
            out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
