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
import pickle
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


def _case(name, workload, options, micro_batch, precision, quick=False, needs=None, hf_config=None, lora=None,
          snapshot=False, **config) -> dict:
    return dict(name=name, workload=workload, options=options, hf_config=hf_config, needs=needs, quick=quick,
                lora=lora, snapshot=snapshot, config=dict(micro_batch=micro_batch, precision=precision, **config))


# BERT-large as published (24 layers, hidden 1024, 16 heads): the fp16-AMP case that CPU autocast's policy
# put 24% low (issue 11).
BERT_LARGE_CONFIG = dict(model_type="bert", hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                         intermediate_size=4096)


def all_cases() -> list[dict]:
    """Most informative first: if the time budget runs out, the tail is what gets skipped."""
    return [
        _case("gpt-small seq1024 mb4 bf16", "gpt-small", {"seq": 1024}, 4, "bf16", quick=True, snapshot=True),
        _case("hf:bert-large seq512 mb8 fp16", "hf:<config.json>", {"seq": 512}, 8, "fp16", needs="transformers",
              hf_config=BERT_LARGE_CONFIG),
        _case("hf:tinyllama-1.1b seq2048 mb2 bf16", "hf:<config.json>", {"seq": 2048}, 2, "bf16",
              needs="transformers", hf_config=TINYLLAMA_CONFIG),
        _case("moe seq1024 mb8 bf16", "moe", {"seq": 1024}, 8, "bf16"),
        _case("gpt-small seq1024 mb4 fp32", "gpt-small", {"seq": 1024}, 4, "fp32", quick=True),
        _case("resnet50 224px mb64 bf16", "resnet", {"image": 224}, 64, "bf16", quick=True),
        _case("hf:tinyllama lora-r16 seq2048 mb4 bf16", "hf:<config.json>", {"seq": 2048}, 4, "bf16",
              needs="transformers", hf_config=TINYLLAMA_CONFIG, lora={"r": 16}),
        _case("gpt-small seq1024 mb16 bf16 ckpt-all", "gpt-small", {"seq": 1024}, 16, "bf16",
              activation_checkpoint="all"),
        _case("hf:tinyllama seq2048 mb4 bf16 ckpt-selective", "hf:<config.json>", {"seq": 2048}, 4, "bf16",
              needs="transformers", hf_config=TINYLLAMA_CONFIG, activation_checkpoint="selective"),
        _case("gpt-small seq1024 mb8 bf16 offload-optimizer", "gpt-small", {"seq": 1024}, 8, "bf16",
              offload_optimizer=True),
        _case("gpt-1b seq2048 mb2 bf16", "gpt-1b", {"seq": 2048}, 2, "bf16"),
        _case("gpt-small seq1024 mb8 fp16", "gpt-small", {"seq": 1024}, 8, "fp16"),
        _case("resnet50 224px mb32 fp32", "resnet", {"image": 224}, 32, "fp32"),
        _case("mlp mb256 fp32", "mlp", {}, 256, "fp32"),
        _case("gpt-7b seq2048 mb2 bf16 ckpt-all", "gpt-7b", {"seq": 2048}, 2, "bf16", activation_checkpoint="all"),
        _case("gpt-1b seq2048 mb4 bf16 ckpt-all optimizer-in-backward", "gpt-1b", {"seq": 2048}, 4, "bf16",
              activation_checkpoint="all", optimizer_in_backward=True),
        _case("gpt-1b seq2048 mb4 bf16-pure ckpt-all offload-optimizer", "gpt-1b", {"seq": 2048}, 4, "bf16-pure",
              activation_checkpoint="all", offload_optimizer=True),
        _case("hf:tinyllama seq2048 mb4 bf16 ckpt-all loss-in-8-chunks", "hf:<config.json>", {"seq": 2048}, 4, "bf16",
              needs="transformers", hf_config=TINYLLAMA_CONFIG, activation_checkpoint="all", loss_chunks=8),
        _case("gpt-1b seq2048 mb2 bf16-pure ckpt-all in-backward 8-bit-states", "gpt-1b", {"seq": 2048}, 2,
              "bf16-pure", activation_checkpoint="all", optimizer_in_backward=True, optimizer_8bit=True),
        _case("hf:tinyllama qlora-r16 all-linear seq2048 mb4 bf16 ckpt-all", "hf:<config.json>", {"seq": 2048}, 4,
              "bf16", needs="transformers", hf_config=TINYLLAMA_CONFIG,
              lora={"r": 16, "alpha": 32, "targets": "all-linear"}, activation_checkpoint="all", base_4bit=True),
    ]


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
    wl = memfit.load_workload(spec, **case["options"])
    if case.get("lora"):
        from memfit.workloads import lora
        wl = lora(wl, **case["lora"])
    return wl


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


ARTIFACTS = os.environ.get("GPU_CHECK_ARTIFACTS")  # snapshots and the calibration go here when set
SNAPSHOT_ENTRIES = 40_000
SNAPSHOT_FRAMES = 12
TIMED_STEPS = 3


def _dump_small_snapshot(path: Path, limit: int = 15 * MiB) -> dict:
    """torch.cuda.memory._dump_snapshot's format, with each stack cut to its innermost frames and, if still
    too large to bring back, the oldest trace events dropped."""
    from memfit.torch_internals import memory_snapshot

    snap = memory_snapshot()
    for seg in snap.get("segments", []):
        for block in seg.get("blocks", []):
            if "frames" in block:
                block["frames"] = block["frames"][:SNAPSHOT_FRAMES]
    for trace in snap.get("device_traces", []):
        for event in trace:
            if "frames" in event:
                event["frames"] = event["frames"][:SNAPSHOT_FRAMES]
    events = sum(map(len, snap.get("device_traces", [])))
    data = pickle.dumps(snap)
    while len(data) > limit and snap.get("device_traces"):
        snap["device_traces"] = [t[len(t) // 2:] for t in snap["device_traces"]]
        data = pickle.dumps(snap)
    path.write_bytes(data)
    return {"file": path.name, "bytes": len(data), "events": events,
            "events_kept": sum(map(len, snap.get("device_traces", [])))}


def probe_step(wl, config, device):
    from memfit.memory.estimate import probe as memfit_probe

    return memfit_probe(wl, config, device)


def _predicted_seconds(p, config) -> dict:
    """memfit's step time for this trace: with the catalogue's h200 (data-sheet rates, uncalibrated) and with
    this GPU's own calibration (GPU_CHECK_PROFILE, when the parent measured one)."""
    from memfit.memory.devices import get_device
    from memfit.planner.costmodel import Profile, catalogue_profile, step_seconds

    micro = config.grad_accum / min(config.grad_accum, 2)
    out = {"catalogue_h200": step_seconds(catalogue_profile(get_device("h200")), p.ops, micro)}
    path = os.environ.get("GPU_CHECK_PROFILE")
    if path and Path(path).is_file():
        out["calibrated"] = step_seconds(Profile(**json.loads(Path(path).read_text())), p.ops, micro)
    return out


def run_case(case: dict) -> dict:
    """In a fresh process: estimate, then measure. Never raises; everything goes into the record."""
    rec: dict = {"name": case["name"], "case": case, "status": "error"}
    smi_before = _smi_gpus()  # before this process touches CUDA
    import torch

    import memfit
    from memfit.torch_internals import memory_history
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
            p = probe_step(wl, config, "cuda")  # memfit.estimate's own trace, with its ops for the step time
            est = p.estimate
            rec["estimate"] = {k: getattr(est, k) for k in (
                "method", "peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_peak_bytes",
                "device_total_bytes", "peak_phase", "breakdown", "model_state_bytes", "parameters", "notes")}
            rec["estimate_s"] = round(time.perf_counter() - t0, 2)
            rec["predicted_s"] = _predicted_seconds(p, config)
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
            if case.get("snapshot") and ARTIFACTS:
                memory_history(SNAPSHOT_ENTRIES)
            step = memfit.step.TrainStep(wl, config, "cuda")
            step(wl.batch(config.global_batch))  # warm-up: optimizer state, cuBLAS workspace, scaler state
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            batch = wl.batch(config.global_batch)
            loss = step(batch)
            torch.cuda.synchronize()
            rec["status"] = "ok"
            m["loss"] = float(loss)
            if case.get("snapshot") and ARTIFACTS:
                path = Path(ARTIFACTS) / f"snapshot_{re.sub(r'[^A-Za-z0-9]+', '_', case['name'])}.pickle"
                m["snapshot"] = _dump_small_snapshot(path)
                memory_history(0)
            # step time: the median of TIMED_STEPS steps on batches made beforehand (the warm-up compiled nothing:
            # memfit runs eager)
            batches = [wl.batch(config.global_batch) for _ in range(TIMED_STEPS)]
            times = []
            for b in batches:
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                step(b)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t1)
            m["step_seconds"] = sorted(times)[len(times) // 2]
            m["step_seconds_all"] = [round(t, 5) for t in times]
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


# ------------------------------------------------------------------------------------------ extras (children)

def calibrate_gpu(out: Path) -> dict:
    """memfit's own calibration of this GPU (`memfit calibrate` on CUDA), written as a profile JSON."""
    from memfit.planner.costmodel import calibrate, describe

    t0 = time.perf_counter()
    profile = calibrate("cuda")
    out.write_text(json.dumps(profile.to_dict(), indent=1))
    return {"seconds": round(time.perf_counter() - t0, 1), "describe": describe(profile), "path": out.name,
            "problems": profile.problems}


def allocator_extras(folder: Path) -> dict:
    """Two caching-allocator snapshots for `memfit doctor` (issue 13): one fragmented on purpose (4 MiB blocks
    share 20 MiB segments; every other one freed, then a 12 MiB request needs a segment of its own), one
    without holes; and NCCL's memory for one communicator on this GPU (a world of one rank)."""
    import torch

    from memfit.torch_internals import memory_history, memory_snapshot

    out: dict = {}
    MB4 = 4 * MiB
    torch.cuda.init()
    memory_history(10_000)
    blocks = [torch.empty(MB4, dtype=torch.uint8, device="cuda") for _ in range(50)]
    del blocks[::2]
    big = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")
    (folder / "snapshot_fragmented.pickle").write_bytes(pickle.dumps(memory_snapshot()))
    out["fragmented"] = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}
    del blocks, big
    torch.cuda.empty_cache()
    memory_history(0)
    memory_history(10_000)
    keep = [torch.empty(64 * MiB, dtype=torch.uint8, device="cuda") for _ in range(10)]
    (folder / "snapshot_clean.pickle").write_bytes(pickle.dumps(memory_snapshot()))
    out["clean"] = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}
    del keep
    memory_history(0)
    torch.cuda.empty_cache()

    try:
        out["nccl_one_rank"] = _nccl_one_rank()
    except Exception as e:  # noqa: BLE001 - keep the snapshots
        out["nccl_one_rank"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _nccl_one_rank() -> dict:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    x = torch.ones(16 * MiB, dtype=torch.float32, device="cuda")
    torch.cuda.synchronize()
    free0, total = torch.cuda.mem_get_info()
    reserved0 = torch.cuda.memory_reserved()
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    dist.all_reduce(x)
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    out = {"device_growth_bytes": int(free0 - free1),
           "reserved_growth_bytes": int(torch.cuda.memory_reserved() - reserved0),
           "nccl_version": ".".join(map(str, torch.cuda.nccl.version())),
           "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}}
    dist.destroy_process_group()
    return out


def _extra(kind: str, timeout: float) -> dict:
    """Run an extra in a fresh process (its own CUDA context); its result, or what went wrong."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--extra", kind]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_child_env())
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "error": f"no result within {timeout:.0f} s"}
    rec = _last_result(r.stdout)
    if rec is None:
        return {"status": "crash", "error": f"exit status {r.returncode}", "stderr_tail": r.stderr[-3000:]}
    return rec


CALIBRATION_S = 120.0


def _run_extra_into(results: dict, kind: str, timeout: float, out: Path) -> None:
    t0 = time.perf_counter()
    results["meta"][kind] = dict(_extra(kind, timeout), wall_s=round(time.perf_counter() - t0, 1))
    print(f"  {kind}: {json.dumps(results['meta'][kind], default=str)[:1500]}", flush=True)
    _write(out, results)


def run_extra(kind: str) -> dict:
    folder = Path(ARTIFACTS or tempfile.mkdtemp())
    try:
        if kind == "calibrate":
            return {"status": "ok", **calibrate_gpu(folder / "profile_cuda.json")}
        return {"status": "ok", **allocator_extras(folder)}
    except Exception as e:  # noqa: BLE001
        return {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}


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
    p.add_argument("--artifacts", type=Path, help="a folder for allocator snapshots and this GPU's calibration; "
                                                     "with it, the calibration and the allocator extras run first")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--extra", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.worker:  # inside a case process
        _emit(run_case(json.loads(args.worker)))
        return 0
    if args.extra:
        _emit(run_extra(args.extra))
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
    if args.artifacts:
        args.artifacts.mkdir(parents=True, exist_ok=True)
        os.environ["GPU_CHECK_ARTIFACTS"] = str(args.artifacts.resolve())
        _run_extra_into(results, "allocator", 90.0, args.out)
        deadline -= CALIBRATION_S  # memfit's calibration of this GPU runs after the cases, in time kept for it
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

    if args.artifacts:
        _run_extra_into(results, "calibrate", CALIBRATION_S, args.out)

    print()
    print(table(results["cases"]))
    ctx = [r["measured"].get("context_bytes") for r in results["cases"]
           if r["status"] == "ok" and (r.get("measured") or {}).get("context_bytes") is not None]
    if ctx:
        assumed = (info.get("memfit_device") or {}).get("context_bytes")
        print(f"measured CUDA context outside the allocator: {min(ctx) / MiB:.0f}-{max(ctx) / MiB:.0f} MiB"
              + (f" (memfit assumes {assumed / MiB:.0f} MiB)" if assumed else ""))
    for r in results["cases"]:
        pred, meas = r.get("predicted_s") or {}, (r.get("measured") or {}).get("step_seconds")
        if meas:
            print(f"step time {r['name']}: measured {meas * 1e3:.1f} ms; predicted "
                  + ", ".join(f"{k} {v * 1e3:.1f} ms ({_p(_rel(v, meas))})" for k, v in pred.items()))
    print(f"wrote {args.out} in {time.time() - started:.0f} s")
    measured = sum(r["status"] in ("ok", "oom") for r in results["cases"])
    return 0 if measured else 1


if __name__ == "__main__":
    sys.exit(main())
