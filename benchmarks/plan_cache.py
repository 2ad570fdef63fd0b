"""How long a plan takes the first time and again from the trace cache ($MEMFIT_CACHE/traces): the same plan,
and the same model with another budget, on this machine.

    python benchmarks/plan_cache.py [--out benchmarks/results/plan_cache.json]    # about 5 minutes on 2 cores

Cases: the Llama-3-8B shape (transformers' LlamaForCausalLM from its config values) at seq 2048, global
batch 32, on an RTX 4090 (the whole card, then 22 GiB); gpt-7b at seq 4096, global batch 64, on an A100 80GB
(the whole card, then 60 GiB). The cache starts empty in a folder of this run's own. Each plan's chosen
configuration and peak are recorded: from the cache they must be the first plan's. Last, the 8B plan with
`--allow 8bit-optim,lora`, cold (a cache of its own).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if (HERE.parent / "src" / "memfit").is_dir():
    sys.path.insert(0, str(HERE.parent / "src"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results" / "plan_cache.json"))
    args = ap.parse_args()
    os.environ["MEMFIT_CACHE"] = tempfile.mkdtemp(prefix="memfit-plan-cache-")
    os.environ["MEMFIT_TRACE_CACHE"] = "1"
    from fit_8b import LLAMA3_8B, _workload
    from memfit.planner.search import plan
    from memfit.workloads import builtin

    folder = tempfile.mkdtemp()
    cases = [("Llama-3-8B shape, seq 2048, global batch 32", lambda: _workload(LLAMA3_8B, 2048, folder), 32,
              "rtx-4090", (None, None, "22GiB")),
             ("gpt-7b, seq 4096, global batch 64", lambda: builtin("gpt-7b", seq=4096), 64, "a100-80gb",
              (None, None, "60GiB"))]
    rows = []
    for label, make, batch, device, budgets in cases:
        workload = make()
        for run, budget in zip(("first", "again", "another budget"), budgets):
            t0 = time.perf_counter()
            p = plan(workload, batch, budget=budget, device=device)
            row = dict(case=label, device=device, run=run, budget=budget, seconds=round(time.perf_counter() - t0, 1),
                       chosen=p.config.describe(), peak_bytes=p.peak_bytes, step_seconds=p.step_seconds)
            rows.append(row)
            print(json.dumps(row), flush=True)
    os.environ["MEMFIT_CACHE"] = tempfile.mkdtemp(prefix="memfit-plan-cache-")
    t0 = time.perf_counter()
    p = plan(_workload(LLAMA3_8B, 2048, folder), 32, device="rtx-4090", allow=["8bit-optim", "lora"])
    row = dict(case="Llama-3-8B shape, seq 2048, global batch 32, --allow 8bit-optim,lora", device="rtx-4090",
               run="first", budget=None, seconds=round(time.perf_counter() - t0, 1), chosen=p.config.describe(),
               workload=p.estimate.workload if p.estimate else None, peak_bytes=p.peak_bytes,
               step_seconds=p.step_seconds)
    rows.append(row)
    print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d"), load=os.getloadavg(), rows=rows),
                                         indent=1))


if __name__ == "__main__":
    main()
