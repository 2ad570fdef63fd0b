"""The floor under any fake-tensor trace of a model: its forward, loss and backward under FakeTensorMode
alone, with none of memfit's modes, at transformers' default size (bf16 weights, micro-batch 1, seq 256, as
hf_coverage.py runs it), beside memfit's own estimate of the same step. A model whose bare fake step already
takes longer than a goal cannot meet it by any tracer built on FakeTensorMode.

    nice -n 10 python benchmarks/fake_floor.py [--only rwkv,zamba] [--no-memfit]

One child process per model (fresh caches). Results: benchmarks/results/fake_floor.json.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEQ = 256


def bare(arch: str) -> dict:
    import torch
    import transformers

    from memfit.torch_internals import FakeTensorMode  # torch's own, re-exported by memfit's shim

    cfg = transformers.AutoConfig.for_model(arch)
    with FakeTensorMode():
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        ids = torch.randint(0, cfg.vocab_size, (1, SEQ))
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
    return {"forward_s": round(t1 - t0, 1), "backward_s": round(t2 - t1, 1), "bare_s": round(t2 - t0, 1),
            "bare_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024}


def with_memfit(arch: str) -> dict:
    import transformers

    import memfit
    from memfit.workloads import hf

    wl = hf.from_config(transformers.AutoConfig.for_model(arch), name=f"hf:{arch}", seq=SEQ)
    t0 = time.perf_counter()
    est = memfit.estimate(wl, memfit.Config(micro_batch=1, precision="bf16"), device="h100")
    return {"memfit_s": round(time.perf_counter() - t0, 1), "method": est.method,
            "device_peak_bytes": est.device_peak_bytes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="rwkv,zamba")
    ap.add_argument("--no-memfit", action="store_true", help="the bare step only")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, arch = args.child
        print(json.dumps(bare(arch) if kind == "bare" else with_memfit(arch)))
        return
    rows = []
    for arch in args.only.split(","):
        row = {"arch": arch}
        for kind in ("bare",) if args.no_memfit else ("bare", "memfit"):
            out = subprocess.run([sys.executable, __file__, "--child", kind, arch], capture_output=True, text=True)
            lines = out.stdout.strip().splitlines()
            row.update(json.loads(lines[-1]) if out.returncode == 0 and lines else
                       {f"{kind}_error": (out.stderr.strip().splitlines() or ["?"])[-1]})
        rows.append(row)
        print(json.dumps(row), flush=True)
    (HERE / "results" / "fake_floor.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
