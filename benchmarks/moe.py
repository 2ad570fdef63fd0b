"""MoE on fake tensors (issue 11, item 2): time, host memory and figures at full size, and accuracy.

    nice -n 10 python benchmarks/moe.py                      # both parts, results/moe.json, markdown on stdout
    nice -n 10 python benchmarks/moe.py --part scale --only mixtral,deepseek_v3
    nice -n 10 python benchmarks/moe.py --part accuracy

scale: transformers' Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 built from the library's default config
(Mixtral-8x7B, Qwen1.5-MoE-A2.7B-, Qwen3-MoE- and DeepSeek-V3-sized; no weights), estimated for an H100 in
bf16 at micro-batch 1, seq 256, each row in a fresh child process: wall and CPU time (the child and the
tracer it forks), peak RSS (getrusage: the largest of the child and its tracer), the balanced figure and the
bound. Twice per model: with transformers' default experts (grouped_mm: every tensor sized by tokens x k,
routing-invariant) and with `experts_implementation="eager"` (a Python loop over the experts hit:
data-dependent, traced under balanced routing plus the three bound routings). The eager loop costs one
iteration per expert and layer per trace: Mixtral and Qwen3-MoE run at full depth, Qwen2-MoE and
DeepSeek-V3 with one MoE layer (EAGER_LAYERS).

accuracy: small models, fake figures against real CPU steps whose router is forced (indices overwritten after
the real top-k) to the same routing: memfit's measured path (live tensor bytes of the real step, from the
estimate's steady state) and the PyTorch profiler (benchmarks/truth.py), and the largest of four random
routings measured, which the bound must not be under.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT / "src"), str(HERE), str(ROOT / "tests")]

MODELS = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")
# eager rows at full depth but these, cut to one MoE layer (DeepSeek-V3's first 3 are dense): a full-depth
# Qwen3-MoE took 493 s of CPU (4 traces x 24 layers x 128 experts), DeepSeek-V3's 58 x 256 would take hours
EAGER_LAYERS = {"qwen2_moe": 1, "deepseek_v3": 4}
SEQ, DEVICE, PRECISION = 256, "h100", "bf16"


# ----------------------------------------------------------------------------------------------- scale

def one(model_type: str, experts: str, seq: str, micro_batch: str, checkpoint: str) -> dict:
    """In a child process: one estimate at full width. Prints one JSON line."""
    seq, micro_batch = int(seq), int(micro_batch)
    import transformers

    import memfit
    from memfit.workloads import hf

    options = {} if experts == "default" else {"experts_implementation": experts}
    if experts == "eager" and model_type in EAGER_LAYERS:
        options["num_hidden_layers"] = EAGER_LAYERS[model_type]
    cfg = transformers.AutoConfig.for_model(model_type, **options)
    t0 = time.perf_counter()
    est = memfit.estimate(hf.from_config(cfg, seq=seq, name=f"hf:{model_type}"),
                          memfit.Config(micro_batch=micro_batch, precision=PRECISION, activation_checkpoint=checkpoint),
                          device=DEVICE)
    wall = time.perf_counter() - t0
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    r = est.routing or {}
    return {"model": model_type, "experts": experts, "seq": seq, "micro_batch": micro_batch, "checkpoint": checkpoint,
            "layers": cfg.num_hidden_layers, "method": est.method,
            "parameters": est.parameters, "wall_s": round(wall, 1),
            "cpu_s": round(me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime, 1),
            "peak_rss_bytes": 1024 * max(me.ru_maxrss, kids.ru_maxrss),
            "routing": r.get("assumption"), "routers": r.get("routers"), "bound_routing": r.get("bound_routing"),
            "peak_bytes": est.peak_bytes, "device_peak_bytes": est.device_peak_bytes,
            "bound_peak_bytes": r.get("bound_peak_bytes", est.peak_bytes),
            "bound_device_peak_bytes": r.get("bound_device_peak_bytes", est.device_peak_bytes)}


# (model, experts, seq, micro-batch, activation checkpointing): each model both ways at seq 256, micro-batch 1;
# and Mixtral where activations outgrow the optimizer step, without checkpointing (the peak is at the loss,
# where everything saved is live: the same under any routing) and with it (the peak is in a block's
# recomputation, where the largest expert's tensors are)
ROWS = [*((m, e, SEQ, 1, "none") for m in MODELS for e in ("default", "eager")),
        ("mixtral", "eager", 4096, 8, "none"), ("mixtral", "eager", 4096, 8, "all")]


def scale(models: list[str], timeout: int) -> list[dict]:
    rows = []
    for model_type, experts, seq, micro_batch, checkpoint in ROWS:
        if model_type in models:
            cmd = [sys.executable, __file__, "--one", f"{model_type}:{experts}:{seq}:{micro_batch}:{checkpoint}"]
            t0 = time.perf_counter()
            key = {"model": model_type, "experts": experts, "seq": seq, "micro_batch": micro_batch,
                   "checkpoint": checkpoint}
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
                lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
                row = json.loads(lines[-1]) if lines else {
                    **key, "method": "error", "reason": (done.stderr.strip().splitlines() or ["no output"])[-1]}
            except subprocess.TimeoutExpired:
                row = {**key, "method": f"timeout after {timeout} s", "wall_s": round(time.perf_counter() - t0, 1)}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------- accuracy

def accuracy() -> list[dict]:
    import torch
    import transformers

    import memfit
    import models as zoo
    from memfit.memory.kernels import CpuWorkspaces
    from memfit.memory.measure import measure_step
    from memfit.memory.routing import MAX_CHOICES, assumed_choices
    from memfit.memory.tracker import LiveBytes
    from memfit.step import TrainStep
    from memfit.torch_internals import TorchDispatchMode
    from memfit.workload import tensors_of
    from memfit.workloads import builtin, hf
    from truth import profiler_peak

    class Forced(TorchDispatchMode):
        """Overwrites every real top-k's indices over an expert-sized dimension with `choose(rows, k, E)`,
        computed once per shape (a profiled step then allocates nothing for it)."""

        def __init__(self, choose):
            super().__init__()
            self.choose, self.cache = choose, {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.topk.default and args[0].shape[-1] <= MAX_CHOICES:
                k, experts, indices = args[1], args[0].shape[-1], out[1]
                key = (indices.numel() // k, k, experts)
                if key not in self.cache:
                    self.cache[key] = self.choose(*key).to(indices.dtype).contiguous()
                indices.copy_(self.cache[key].view(indices.shape))
            return out

    def assumed(name):
        return lambda rows, k, e: assumed_choices(name, rows, k, e)

    def random(seed):
        return lambda rows, k, e: torch.rand(rows, e, generator=torch.Generator().manual_seed(seed)).argsort(-1)[:, :k]

    def real_peaks(wl, cfg, choose) -> tuple[int, int]:
        """(memfit's measured path, profiler) for real steps from the primed state under `choose`."""
        forced = Forced(choose)
        torch.manual_seed(0)
        step = TrainStep(wl, cfg, "cpu")
        step.prime()
        batch = wl.batch(cfg.global_batch)
        counter = LiveBytes("cpu", detail=False, workspace=CpuWorkspaces())  # measure_step's, batch counted
        counter.track(tensors_of(batch))
        with forced:
            _, measured = measure_step(step, batch, counter)
            del batch
            # the batch made inside is counted; the least of two: the profiler also records the odd
            # allocation made elsewhere in the process while it runs (benchmarks/truth.py)
            profiled = min(profiler_peak(lambda: step(wl.batch(cfg.global_batch))) for _ in range(2))
        return measured.bytes, profiled

    def mixtral_eager(layers=1):
        small = {**hf.SMALL_CONFIGS["mixtral"], "num_hidden_layers": layers}
        cfg = transformers.AutoConfig.for_model("mixtral", **small, experts_implementation="eager")
        return hf.from_config(cfg, seq=32, name="hf:mixtral (eager experts)")

    cases = [("moe-tiny, 1 layer, seq 32", lambda: builtin("moe-tiny", layers=1, seq=32)),
             ("hf:mixtral toy, eager experts, 1 layer, seq 32", mixtral_eager),
             ("hf:qwen2_moe toy, grouped_mm experts, seq 32", lambda: builtin("hf:qwen2_moe", seq=32)),
             ("tests/models.py moe (top-2 of 4, nonzero)", lambda: zoo.moe())]
    rows = []
    for label, make in cases:
        for precision in ("fp32", "bf16"):
            wl, cfg = make(), memfit.Config(micro_batch=2, precision=precision)
            est = memfit.estimate(wl, cfg)
            r = est.routing or {}
            bound_routing = r.get("bound_routing") or "balanced"
            balanced = real_peaks(wl, cfg, assumed("balanced"))
            bound = real_peaks(wl, cfg, assumed(bound_routing))
            rand = max(real_peaks(wl, cfg, random(s))[0] for s in range(4))
            row = {"model": label, "precision": precision, "method": est.method, "routing": r.get("assumption"),
                   "fake_balanced": est.peak_bytes, "measured_balanced": balanced[0],
                   "profiler_balanced": balanced[1], "bound_routing": bound_routing,
                   "fake_bound": r.get("bound_peak_bytes", est.peak_bytes), "measured_bound": bound[0],
                   "profiler_bound": bound[1], "measured_random_max": rand}
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------- report

def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:,.1f}"


def _pct(a, b) -> str:
    return f"{100 * (a / b - 1):+.3f}%"


def markdown(result: dict) -> str:
    out = []
    if result.get("scale"):
        out += ["| model (library default) | experts | layers | seq x micro-batch | checkpointing | params | method | "
                "routing | wall s | CPU s | peak RSS GiB | balanced peak GiB | balanced device GiB | bound peak GiB | "
                "bound device GiB |", "|---|---|---:|---|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in result["scale"]:
            if "parameters" not in r:
                out.append(f"| {r['model']} | {r['experts']} | | {r.get('seq', SEQ)} x {r.get('micro_batch', 1)} | "
                           f"{r.get('checkpoint', 'none')} | | {r['method']} {r.get('reason', '')} | | "
                           f"{r.get('wall_s', '')} | | | | | | |")
                continue
            routing = r["routing"] or "-"
            if r["bound_routing"]:
                routing += f" (bound: {r['bound_routing']})"
            out.append(f"| {r['model']} | {r['experts']} | {r['layers']} | {r.get('seq', SEQ)} x {r.get('micro_batch', 1)} | "
                       f"{r.get('checkpoint', 'none')} | {r['parameters'] / 1e9:.1f}B | "
                       f"{r['method']} | {routing} | {r['wall_s']} | {r['cpu_s']} | "
                       f"{r['peak_rss_bytes'] / 2**30:.2f} | {_gib(r['peak_bytes'])} | {_gib(r['device_peak_bytes'])} | "
                       f"{_gib(r['bound_peak_bytes'])} | {_gib(r['bound_device_peak_bytes'])} |")
    if result.get("accuracy"):
        out += ["", "| model | precision | routing | fake balanced | measured | profiler | bound routing | fake bound "
                "| measured | profiler | largest of 4 random (measured) |",
                "|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|"]
        for r in result["accuracy"]:
            out.append(f"| {r['model']} | {r['precision']} | {r['routing']} | {r['fake_balanced']:,} | "
                       f"{_pct(r['fake_balanced'], r['measured_balanced'])} | "
                       f"{_pct(r['fake_balanced'], r['profiler_balanced'])} | {r['bound_routing']} | "
                       f"{r['fake_bound']:,} | {_pct(r['fake_bound'], r['measured_bound'])} | "
                       f"{_pct(r['fake_bound'], r['profiler_bound'])} | {r['measured_random_max']:,} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("all", "scale", "accuracy"), default="all")
    ap.add_argument("--only", help="comma-separated model types for the scale part")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per scale row")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one.split(":"))))
        return
    result = {"seq": SEQ, "device": DEVICE, "precision": PRECISION, "cpus": os.cpu_count()}
    if args.part in ("all", "scale"):
        result["scale"] = scale(args.only.split(",") if args.only else list(MODELS), args.timeout)
    if args.part in ("all", "accuracy"):
        result["accuracy"] = accuracy()
    path = HERE / "results" / "moe.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    if "scale" in result:  # rows of models not run this time are kept
        rows = {(r["model"], r["experts"], r.get("seq", SEQ), r.get("micro_batch", 1), r.get("checkpoint", "none")): r
                for r in old.get("scale", []) + result["scale"]}
        result["scale"] = [rows[key] for key in ROWS if key in rows]
    old.update(result)
    path.write_text(json.dumps(old, indent=1) + "\n")
    print(markdown(old))


if __name__ == "__main__":
    main()
