"""How long, and how much host memory, memfit needs to estimate a Llama-2-7B training step.

    python benchmarks/estimate_7b.py                 # markdown table on stdout
    python benchmarks/estimate_7b.py --json out.json # the same numbers as JSON too ("-" for stdout)
    taskset -c 0,1 python benchmarks/estimate_7b.py  # as measured on a 2-core machine

Times `memfit.estimate(load_workload("gpt-7b", seq=4096), Config(micro_batch=1, precision="bf16"),
device="a100-80gb")`. The estimate traces in a forked child by default, so the host memory is reported for
this process (RUSAGE_SELF) and for the child (RUSAGE_CHILDREN: the largest waited-for child). ru_maxrss
counts resident pages, copy-on-write pages shared with the parent included.

Also checks the model-state accounting: with bf16 autocast (fp32 master weights) and AdamW, ZeRO's
mixed-precision Adam accounting gives 16 bytes per parameter at rest (fp32 params 4 + fp32 grads 4 +
Adam m and v 8).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

EXPECTED_BYTES_PER_PARAM = 16
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
if os.path.isdir(os.path.join(SRC, "memfit")) and SRC not in sys.path:
    sys.path.insert(0, SRC)  # the checkout's memfit, installed or not


def _maxrss_bytes(who: int) -> int:
    """ru_maxrss is KiB on Linux and bytes on macOS."""
    rss = resource.getrusage(who).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def run(workload: str, seq: int, micro_batch: int, precision: str, device: str, isolate: bool) -> dict:
    t0 = time.perf_counter()
    import torch

    import memfit
    import_s = time.perf_counter() - t0
    rss_after_import = _maxrss_bytes(resource.RUSAGE_SELF)

    t1 = time.perf_counter()
    wl = memfit.load_workload(workload, seq=seq)
    config = memfit.Config(micro_batch=micro_batch, precision=precision)
    est = memfit.estimate(wl, config, device=device, isolate=isolate)
    wall_s = time.perf_counter() - t1

    state = sum(est.model_state_bytes.values())
    per_param = state / est.parameters
    return {
        "workload": workload, "seq": seq, "micro_batch": micro_batch, "precision": precision, "device": device,
        "isolate": isolate,
        "wall_s": round(wall_s, 2),
        "import_s": round(import_s, 2),
        "rss_self_after_import_bytes": rss_after_import,
        "rss_self_peak_bytes": _maxrss_bytes(resource.RUSAGE_SELF),
        "rss_children_peak_bytes": _maxrss_bytes(resource.RUSAGE_CHILDREN) if isolate else None,
        "method": est.method,
        "parameters": est.parameters,
        "model_state_bytes": est.model_state_bytes,
        "model_state_bytes_per_param": round(per_param, 4),
        "expected_bytes_per_param": EXPECTED_BYTES_PER_PARAM,
        "bytes_per_param_ok": abs(per_param - EXPECTED_BYTES_PER_PARAM) < 0.01,
        "peak_bytes": est.peak_bytes,
        "peak_phase": est.peak_phase,
        "breakdown": est.breakdown,
        "peak_allocated_bytes": est.peak_allocated_bytes,
        "peak_reserved_bytes": est.peak_reserved_bytes,
        "device_peak_bytes": est.device_peak_bytes,
        "device_total_bytes": est.device_total_bytes,
        "headroom_bytes": est.headroom_bytes,
        "flops": est.flops,
        "notes": est.notes,
        "host": {"python": platform.python_version(), "torch": torch.__version__,
                 "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                 "machine": platform.machine()},
    }


def markdown(r: dict) -> str:
    rows = [
        ("workload", f"{r['workload']} seq {r['seq']}, micro-batch {r['micro_batch']}, {r['precision']}, "
                     f"device {r['device']}"),
        ("wall time of estimate()", f"{r['wall_s']:.1f} s"),
        ("import torch + memfit", f"{r['import_s']:.1f} s"),
        ("peak RSS, this process", _gib(r["rss_self_peak_bytes"])),
        ("peak RSS, forked tracing child", _gib(r["rss_children_peak_bytes"])),
        ("method", r["method"]),
        ("parameters", f"{r['parameters']:,}"),
        ("model state bytes / parameter",
         f"{r['model_state_bytes_per_param']:.3f} (expected {r['expected_bytes_per_param']}: "
         f"{'ok' if r['bytes_per_param_ok'] else 'MISMATCH'})"),
        ("peak live tensors", f"{_gib(r['peak_bytes'])} ({r['peak_phase']})"),
        ("predicted max_memory_allocated", _gib(r["peak_allocated_bytes"])),
        ("predicted max_memory_reserved", _gib(r["peak_reserved_bytes"])),
        ("predicted nvidia-smi use", _gib(r["device_peak_bytes"])),
        ("device memory", _gib(r["device_total_bytes"])),
        ("headroom", _gib(r["headroom_bytes"])),
    ]
    lines = ["| quantity | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    lines += ["", "| at the peak | bytes |", "|---|---|"]
    lines += [f"| {k} | {_gib(v)} |" for k, v in r["breakdown"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="gpt-7b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--device", default="a100-80gb")
    p.add_argument("--in-process", action="store_true", help="estimate(isolate=False): no forked child")
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON to PATH ('-' for stdout)")
    args = p.parse_args(argv)
    r = run(args.workload, args.seq, args.micro_batch, args.precision, args.device, not args.in_process)
    if args.json == "-":
        print(json.dumps(r, indent=2))
    else:
        print(markdown(r))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=2)
            print(f"\nwrote {args.json}")
    return 0 if r["bytes_per_param_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
