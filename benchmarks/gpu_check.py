"""Check memfit's CUDA predictions against a real GPU: estimate vs torch.cuda.max_memory_allocated(),
max_memory_reserved() and the process's use as nvidia-smi shows it.

    python benchmarks/gpu_check.py                 # every case, ~5 min on one H200 (hard cap: --budget 530 s)
    python benchmarks/gpu_check.py --quick         # a ~2-minute subset
    python benchmarks/gpu_check.py --only resnet   # cases whose name matches a regex
    python benchmarks/gpu_check.py --list          # the cases, without running anything

For each case (workload + Config): `memfit.estimate(workload, config, device="cuda")`, then the real thing
with `memfit.step.TrainStep(workload, config, "cuda")`: one warm-up step, `torch.cuda.reset_peak_memory_stats()`,
then the measured step on a fresh batch, synchronised. Each case runs in a fresh subprocess (clean peak
statistics and CUDA context) with its own timeout; an OOM or a crash is recorded and the run goes on. The
results go to --out (default benchmarks/results/gpu_check.json), rewritten after every case so that a
killed run keeps what it measured, and a table of estimate vs measured (relative error = (est - meas) /
meas) is printed at the end.

Device use ("nvidia-smi" column) is measured, in order of preference, as: the process's used_memory from
`nvidia-smi --query-compute-apps` (pid match); else the growth of the GPU's memory.used from
`nvidia-smi --query-gpu` between the start of the case process (before CUDA is touched) and the end of the
measured step (exact on a GPU nothing else uses; PID namespaces in containers often hide the pid);
else torch.cuda.mem_get_info's total - free (the whole device: other processes and the driver's own
reservation included). The method used is recorded per case.

Exit status: 0 when at least one case was measured; 1 when no CUDA GPU is present (the script says so
and writes nothing) or when no case could be measured; 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"  # the checkout's memfit, installed or not
if (SRC / "memfit").is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))
DEFAULT_OUT = HERE / "results" / "gpu_check.json"
RESULT_MARK = "GPU_CHECK_RESULT "
MiB = 1 << 20

# TinyLlama-1.1B's shape as a transformers config.json: the same shape as memfit's gpt-1b, built by HF code.
TINYLLAMA_CONFIG = dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                        num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _case(name, workload, options, micro_batch, precision, quick=False, needs=None, hf_config=None) -> dict:
    return dict(name=name, workload=workload, options=options, hf_config=hf_config, needs=needs, quick=quick,
                config=dict(micro_batch=micro_batch, precision=precision))


def all_cases() -> list[dict]:
    """Most informative first: if the time budget runs out, the tail is what gets skipped."""
    cases = []
    for mb in (4, 1, 8):
        for prec in ("bf16", "fp32"):
            cases.append(_case(f"gpt-small seq1024 mb{mb} {prec}", "gpt-small", {"seq": 1024}, mb, prec,
                               quick=(mb == 4)))
    for mb in (32, 64):
        for prec in ("fp32", "bf16"):
            cases.append(_case(f"resnet50 224px mb{mb} {prec}", "resnet", {"image": 224}, mb, prec,
                               quick=(mb == 32 and prec == "bf16")))
    cases.append(_case("gpt-1b seq2048 mb2 bf16", "gpt-1b", {"seq": 2048}, 2, "bf16"))
    cases.append(_case("mlp mb256 fp32", "mlp", {}, 256, "fp32", quick=True))
    cases.append(_case("mlp mb256 bf16", "mlp", {}, 256, "bf16"))
    cases.append(_case("hf:llama (small) seq1024 mb8 bf16", "hf:llama", {"seq": 1024}, 8, "bf16",
                       needs="transformers"))
    cases.append(_case("hf:tinyllama-1.1b seq2048 mb2 bf16", "hf:<config.json>", {"seq": 2048}, 2, "bf16",
                       needs="transformers", hf_config=TINYLLAMA_CONFIG))
    return cases


# ------------------------------------------------------------------------------------------ nvidia-smi

def _smi(query: list[str]) -> list[list[str]] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    return [[f.strip() for f in line.split(",")] for line in r.stdout.splitlines() if line.strip()]


def _smi_gpus() -> list[dict] | None:
    rows = _smi(["--query-gpu=index,uuid,memory.used,memory.total,name,driver_version"])
    if rows is None:
        return None
    out = []
    for row in rows:
        try:
            out.append(dict(index=int(row[0]), uuid=row[1], used_bytes=int(float(row[2])) * MiB,
                            total_bytes=int(float(row[3])) * MiB, name=row[4], driver=row[5]))
        except (IndexError, ValueError):
            continue
    return out


def _smi_process_bytes(pid: int) -> int | None:
    rows = _smi(["--query-compute-apps=pid,used_memory"])
    for row in rows or []:
        try:
            if int(row[0]) == pid:
                return int(float(row[1])) * MiB
        except (IndexError, ValueError):
            continue
    return None


# ------------------------------------------------------------------------------------------ one case (child)

def _workload(case: dict, tmp: str):
    import memfit

    spec = case["workload"]
    if case.get("hf_config"):
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(case["hf_config"]))
        spec = f"hf:{path}"
    return memfit.load_workload(spec, **case["options"])


def _pick_gpu(gpus: list[dict] | None, uuid: str | None) -> dict | None:
    if not gpus:
        return None
    for g in gpus:
        if uuid and g["uuid"].lower().endswith(uuid.lower().removeprefix("gpu-")):
            return g
    return gpus[0] if len(gpus) == 1 else None


def _emit(rec: dict) -> None:
    """One result line on stdout; the parent keeps the last one (so a timed-out case keeps its estimate)."""
    sys.stdout.flush()
    print(RESULT_MARK + json.dumps(rec, default=str), flush=True)


def run_case(case: dict) -> dict:
    """In a fresh process: estimate, then measure. Never raises; everything goes into the record."""
    rec: dict = {"name": case["name"], "case": case, "status": "error"}
    smi_before = _smi_gpus()  # before this process touches CUDA
    import torch

    import memfit
    rec["torch"] = torch.__version__
    rec["env"] = {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "CUBLAS_WORKSPACE_CONFIG",
                                                 "CUDA_MODULE_LOADING", "CUDA_VISIBLE_DEVICES")}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            wl = _workload(case, tmp)
            config = memfit.Config(**case["config"])
        except Exception as e:  # noqa: BLE001
            rec["error"] = f"workload: {type(e).__name__}: {e}"
            return rec

        # 1. the estimate
        t0 = time.perf_counter()
        try:
            est = memfit.estimate(wl, config, device="cuda")
            rec["estimate"] = {k: getattr(est, k) for k in (
                "method", "peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_peak_bytes",
                "device_total_bytes", "peak_phase", "breakdown", "model_state_bytes", "parameters", "notes")}
        except Exception as e:  # noqa: BLE001 - measure anyway
            rec["estimate_error"] = f"{type(e).__name__}: {e}"
            rec["estimate_traceback"] = traceback.format_exc()[-3000:]
        rec["estimate_s"] = round(time.perf_counter() - t0, 2)
        _emit(dict(rec, status="measuring"))

        # 2. the real step
        oom_error = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
        props = torch.cuda.get_device_properties(0)
        uuid = str(getattr(props, "uuid", "") or "")
        rec["gpu"] = {"name": props.name, "total_memory": int(props.total_memory),
                      "compute_capability": [props.major, props.minor], "uuid": uuid}
        m: dict = {}
        rec["measured"] = m
        t0 = time.perf_counter()
        try:
            torch.manual_seed(0)
            step = memfit.step.TrainStep(wl, config, "cuda")
            step(wl.batch(config.global_batch))  # warm-up: optimizer state, cuBLAS workspace, scaler state
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            batch = wl.batch(config.global_batch)
            loss = step(batch)
            torch.cuda.synchronize()
            rec["status"] = "ok"
            m["loss"] = float(loss)
        except oom_error as e:
            rec["status"] = "oom"
            rec["error"] = f"OutOfMemoryError: {str(e).splitlines()[0] if str(e) else ''}"
        except Exception as e:  # noqa: BLE001
            rec["status"] = "error"
            rec["error"] = f"step: {type(e).__name__}: {e}"
            rec["step_traceback"] = traceback.format_exc()[-3000:]
        rec["step_s"] = round(time.perf_counter() - t0, 2)
        try:
            torch.cuda.synchronize()
            m["max_allocated"] = int(torch.cuda.max_memory_allocated())
            m["max_reserved"] = int(torch.cuda.max_memory_reserved())
            m["allocated_now"] = int(torch.cuda.memory_allocated())
            m["reserved_now"] = int(torch.cuda.memory_reserved())
            stats = torch.cuda.memory_stats()
            m["num_alloc_retries"] = int(stats.get("num_alloc_retries", 0))
            m["num_ooms"] = int(stats.get("num_ooms", 0))
            m["smi_process_bytes"] = _smi_process_bytes(os.getpid())
            before, after = _pick_gpu(smi_before, uuid), _pick_gpu(_smi_gpus(), uuid)
            m["smi_device_growth_bytes"] = (after["used_bytes"] - before["used_bytes"]) if before and after else None
            free, total = torch.cuda.mem_get_info()
            m["mem_get_info_used_bytes"] = int(total - free)
            if m["smi_process_bytes"] is not None:
                m["device_bytes"], m["device_method"] = m["smi_process_bytes"], "nvidia-smi compute-apps (pid)"
            elif m["smi_device_growth_bytes"] is not None:
                m["device_bytes"], m["device_method"] = m["smi_device_growth_bytes"], "nvidia-smi memory.used growth"
            else:
                m["device_bytes"], m["device_method"] = m["mem_get_info_used_bytes"], "mem_get_info total-free"
            # What the CUDA context + libraries take outside the caching allocator (memfit assumes a figure).
            m["context_bytes"] = m["device_bytes"] - m["reserved_now"]
        except Exception as e:  # noqa: BLE001
            rec["measure_error"] = f"{type(e).__name__}: {e}"
    return rec


# ------------------------------------------------------------------------------------------ driver (parent)

PROBE = r"""
import importlib.util, json, sys
out = {"python": sys.version.split()[0], "transformers": importlib.util.find_spec("transformers") is not None}
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["cuda"] = bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0
    if out["cuda"]:
        p = torch.cuda.get_device_properties(0)
        out.update(count=torch.cuda.device_count(), name=p.name, total_memory=int(p.total_memory),
                   compute_capability=[p.major, p.minor])
        from memfit.memory.devices import get_device
        d = get_device("cuda")
        out["memfit_device"] = {"context_bytes": d.context_bytes, "cublas_workspace_bytes": d.cublas_workspace_bytes}
except Exception as e:
    out["cuda"] = False
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def _child_env() -> dict:
    env = dict(os.environ)
    if (SRC / "memfit").is_dir():
        env["PYTHONPATH"] = os.pathsep.join([str(SRC), *filter(None, [env.get("PYTHONPATH")])])
    return env


def probe() -> dict:
    """Ask a throw-away process what is there, so this one never touches CUDA."""
    try:
        r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                           env=_child_env())
        return json.loads(r.stdout.strip().splitlines()[-1])
    except Exception as e:  # noqa: BLE001
        return {"cuda": False, "error": f"probe failed: {type(e).__name__}: {e}"}


def _last_result(out: str) -> dict | None:
    for line in reversed((out or "").splitlines()):
        if line.startswith(RESULT_MARK):
            try:
                return json.loads(line[len(RESULT_MARK):])
            except ValueError:
                continue
    return None


def _run_subprocess(case: dict, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(case)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=_child_env())  # own process group: a timeout kills the forked tracer too
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        rec = _last_result(out) or {"name": case["name"], "case": case}
        rec.update(status="timeout", error=f"no result within {timeout:.0f} s", stderr_tail=(err or "")[-2000:],
                   wall_s=round(time.perf_counter() - t0, 1))
        return rec
    rec = _last_result(out)
    if rec is not None and rec.get("status") == "measuring":  # died during the real step
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"status {proc.returncode}"
        rec.update(status="crash", error=f"worker exited with {how} during the real step")
    if rec is None:
        how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"status {proc.returncode}"
        rec = {"name": case["name"], "case": case, "status": "crash", "error": f"worker exited with {how}"}
    if rec["status"] != "ok" or proc.returncode != 0:
        rec["stderr_tail"] = (err or "")[-2000:]
    rec["wall_s"] = round(time.perf_counter() - t0, 1)
    return rec


def _rel(est, meas) -> float | None:
    if est is None or meas is None or meas <= 0:
        return None
    return (est - meas) / meas


def _compare(rec: dict) -> dict:
    """Relative errors, for a measured step only (after an OOM the peaks are those of a partial step)."""
    e, m = rec.get("estimate") or {}, rec.get("measured") or {}
    if rec.get("status") != "ok":
        e = {}
    return {
        "allocated": _rel(e.get("peak_allocated_bytes"), m.get("max_allocated")),
        "reserved": _rel(e.get("peak_reserved_bytes"), m.get("max_reserved")),
        "device": _rel(e.get("device_peak_bytes"), m.get("device_bytes")),
    }


def _g(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _p(x) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def table(records: list[dict]) -> str:
    head = ("case", "status", "est alloc", "meas alloc", "err", "est resv", "meas resv", "err",
            "est smi", "meas smi", "err")
    rows = [head]
    for r in records:
        e, m, c = r.get("estimate") or {}, r.get("measured") or {}, r.get("compare") or {}
        rows.append((r["name"], r["status"], _g(e.get("peak_allocated_bytes")), _g(m.get("max_allocated")),
                     _p(c.get("allocated")), _g(e.get("peak_reserved_bytes")), _g(m.get("max_reserved")),
                     _p(c.get("reserved")), _g(e.get("device_peak_bytes")), _g(m.get("device_bytes")),
                     _p(c.get("device"))))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    lines = ["  ".join(str(v).ljust(w) if i < 2 else str(v).rjust(w) for i, (v, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines) + "\n(GiB; err = (estimate - measured) / measured)"


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="memfit's CUDA estimates vs a real GPU")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"JSON results (default {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true", help="a ~2-minute subset")
    p.add_argument("--only", metavar="REGEX", help="only cases whose name matches")
    p.add_argument("--case-timeout", type=float, default=180.0, help="seconds per case (default 180)")
    p.add_argument("--budget", type=float, help="seconds for the whole run (default 530, --quick 110); "
                                                "cases that would start later are recorded as skipped")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:  # inside a case process
        _emit(run_case(json.loads(args.worker)))
        return 0

    cases = [c for c in all_cases() if c["quick"]] if args.quick else all_cases()
    if args.only:
        cases = [c for c in cases if re.search(args.only, c["name"])]
    if args.list:
        for c in cases:
            print(c["name"])
        return 0
    if not cases:
        print("gpu_check: no case matches", file=sys.stderr)
        return 2

    started = time.time()
    budget = args.budget if args.budget is not None else (110.0 if args.quick else 530.0)
    deadline = time.perf_counter() + budget
    info = probe()
    if not info.get("cuda"):
        why = f" ({info['error']})" if info.get("error") else ""
        print(f"gpu_check: no CUDA GPU is available to torch {info.get('torch', '?')}{why}; nothing to check, "
              "no results written. Run this on a machine with an NVIDIA GPU.", file=sys.stderr)
        return 1
    print(f"gpu_check: {info['name']} ({info['total_memory'] / 2**30:.2f} GiB), torch {info['torch']} "
          f"(CUDA {info['torch_cuda']}), {len(cases)} case(s), budget {budget:.0f} s -> {args.out}", flush=True)

    results = {"meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
                        "probe": info, "smi": _smi_gpus(), "argv": sys.argv[1:], "budget_s": budget},
               "cases": []}
    for case in cases:
        remaining = deadline - time.perf_counter()
        if case.get("needs") and not info.get(case["needs"]):
            rec = {"name": case["name"], "case": case, "status": "skipped", "error": f"{case['needs']} not installed"}
        elif remaining < 30:
            rec = {"name": case["name"], "case": case, "status": "skipped", "error": "time budget spent"}
        else:
            rec = _run_subprocess(case, min(args.case_timeout, remaining))
        rec["compare"] = _compare(rec)
        results["cases"].append(rec)
        results["meta"]["elapsed_s"] = round(time.time() - started, 1)
        _write(args.out, results)
        c = rec["compare"]
        print(f"  {rec['name']}: {rec['status']} ({rec.get('wall_s', 0)} s)  "
              f"alloc {_p(c['allocated'])}  reserved {_p(c['reserved'])}  smi {_p(c['device'])}"
              + (f"  [{rec['error']}]" if rec.get("error") else ""), flush=True)

    print()
    print(table(results["cases"]))
    ctx = [r["measured"].get("context_bytes") for r in results["cases"]
           if r["status"] == "ok" and (r.get("measured") or {}).get("context_bytes") is not None]
    if ctx:
        assumed = (info.get("memfit_device") or {}).get("context_bytes")
        print(f"measured CUDA context outside the allocator: {min(ctx) / MiB:.0f}-{max(ctx) / MiB:.0f} MiB"
              + (f" (memfit assumes {assumed / MiB:.0f} MiB)" if assumed else ""))
    print(f"wrote {args.out} in {time.time() - started:.0f} s")
    measured = sum(r["status"] in ("ok", "oom") for r in results["cases"])
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
