"""Fake-tensor coverage of transformers: every architecture of the causal-LM, masked-LM, seq2seq-LM and
image-classification auto tables, at the library's default size, estimated for an H100 in bf16 at micro-batch
1 and seq 256 (image models at their own image size), one child process per architecture. `--only` may name
vision-language models too (transformers' image-text-to-text table): seq 2048, one image per row.

    nice -n 10 python benchmarks/hf_coverage.py [--only vit,llama] [--timeout 60]

Each row: the method memfit used (fake / measured / extrapolated), or refused (the default config does not
build: broken, or needs a package that is not installed), error (memfit raised), timeout, or killed (the
child passed the RSS cap, set so that a stray real step of a large model cannot take the machine); the
child's wall time; its peak RSS (wait4: the largest of the child and the tracer it forks) and the peak of
their sum (sampled every 0.1 s); the parameter count. Results: benchmarks/results/hf_coverage.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SEQ = 256
VLM_SEQ = 2048  # a vision-language row holds its image's tokens too (LLaVA-1.5: 576, 1.6: 1,176, OneVision: 1,485)
RSS_CAP = 6 * 2**30  # far over the 3 GiB goal; only there to keep a runaway child from hurting the machine
TABLES = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
          "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES")


def architectures() -> list[str]:
    from transformers.models.auto import modeling_auto as ma

    return sorted({t for name in TABLES for t in getattr(ma, name)})


def one(model_type: str) -> dict:
    """In the child: build the workload, check the default config builds (on the meta device, no memory),
    then estimate. Prints one JSON line."""
    import torch
    import transformers

    import memfit
    from memfit.errors import MicroBatchError, WorkloadError
    from memfit.workloads import hf

    row: dict = {"arch": model_type}
    try:
        cfg = transformers.AutoConfig.for_model(model_type)  # the library default, not memfit's toy sizes
        task = hf.pick_task(cfg)
        row["task"] = task
        try:
            wl = hf.from_config(cfg, name=f"hf:{model_type}",
                                **({} if task == "image" else {"seq": VLM_SEQ if task == "image-text" else SEQ}))
        except WorkloadError as e:  # Reformer trains only at the length its axial position table factors;
            shorter = re.search(r"longer than this model's (\d+) positions", str(e))  # Florence-2: 1,024
            image = re.search(r"puts (\d+) tokens per image", str(e))  # Mistral 3's 1,540-pixel images: 3,025
            if "trains only at seq" not in str(e) and not (task == "image-text" and (shorter or image)):
                raise
            seq = {"seq": int(shorter.group(1))} if shorter else \
                {"seq": -(-(int(image.group(1)) + 512) // 1024) * 1024} if image else {}
            wl = hf.from_config(cfg, name=f"hf:{model_type}", **seq)
            row["seq"] = wl.batch(1)["input_ids"].shape[1]
        with torch.device("meta"):
            model = wl.model()
        row["parameters"] = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        del model
    except Exception as e:  # noqa: BLE001 - a default config that does not build is the row's answer
        row.update(method="refused", reason=_why(e))  # broken default config, or a package not installed
        return row
    try:
        try:
            est = _estimate(wl, memfit.Config(micro_batch=1, precision="bf16"))
        except MicroBatchError as e:  # BatchNorm1d (LeViT) needs two samples: estimate the smallest that trains
            row["micro_batch"] = e.smallest
            est = _estimate(wl, memfit.Config(micro_batch=e.smallest, precision="bf16"))
    except Exception as e:  # noqa: BLE001
        # HostMemoryError: fake tensors could not follow it and a real step would not fit this host; the hf
        # adapter's own WorkloadErrors ("hf: ...") refuse a model it cannot make batches or a loss for
        method = ("not traced" if type(e).__name__ == "HostMemoryError" else
                  "refused" if str(e).startswith("hf:") else "error")
        row.update(method=method, reason=_why(e))
        return row
    row.update(method=est.method, peak_bytes=est.peak_bytes, device_peak_bytes=est.device_peak_bytes,
               peak_allocated_bytes=est.peak_allocated_bytes, peak_reserved_bytes=est.peak_reserved_bytes,
               parameters=est.parameters, notes=est.notes, blocks=BLOCKS, extrapolated_from=est.extrapolated_from)
    return row


BLOCKS = os.environ.get("MEMFIT_HF_BLOCKS", "all")  # --blocks, passed to the children


def _estimate(wl, config):
    from memfit.memory.extrapolate import estimate_blocks

    return estimate_blocks(wl, config, "h100", BLOCKS)


def _why(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def _tree(root: int) -> list[int]:
    """root and its descendants, from /proc/*/stat."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
        tree += frontier
    return tree


def _rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def run_child(model_type: str, timeout: float) -> dict:
    """One architecture in its own process group: wall time, peak RSS, kill on timeout or RSS cap."""
    out_path = Path(f"/tmp/hf_coverage_{os.getpid()}_{model_type}.json")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, "--child", model_type, "--child-out", str(out_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    tree_peak, killed = 0, None
    status = rusage = None
    while True:
        pid, status, rusage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        tree_peak = max(tree_peak, _rss(_tree(proc.pid)))
        if killed is None and time.perf_counter() - t0 > timeout:
            killed = "timeout"
        elif killed is None and tree_peak > RSS_CAP:
            killed = "killed"
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
        time.sleep(0.1)
    proc.returncode = status
    wall = time.perf_counter() - t0
    stderr = proc.stderr.read().decode(errors="replace")
    proc.stderr.close()
    row = {"arch": model_type}
    if out_path.exists():
        row = json.loads(out_path.read_text())
        out_path.unlink()
    elif killed:
        row.update(method=killed, reason=f"over {timeout:.0f} s" if killed == "timeout"
                   else f"RSS over {RSS_CAP / 2**30:.0f} GiB")
    else:
        tail = [line for line in stderr.splitlines() if line.strip()][-1:] or [f"exit status {status}"]
        row.update(method="error", reason=f"child died: {tail[0]}"[:300])
    row.update(wall_s=round(wall, 2), cpu_s=round(rusage.ru_utime + rusage.ru_stime, 2),
               max_rss_bytes=rusage.ru_maxrss * 1024, tree_rss_bytes=tree_peak)
    return row


def markdown(rows: list[dict]) -> str:
    gib = 2**30
    lines = ["| architecture | task | method | wall s | CPU s | peak RSS GiB (max process / sum) | parameters | "
             "estimate (device peak) GiB | why, if not fake |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        params = f"{r['parameters']:,}" if r.get("parameters") else ""
        peak = f"{r['device_peak_bytes'] / gib:.2f}" if r.get("device_peak_bytes") else ""
        why = r.get("reason", "") if r["method"] != "fake" else ""
        if r["method"] in ("measured", "extrapolated"):
            why = (r.get("notes") or [""])[0]
        why = why.replace("|", "\\|")
        method = r["method"] + (f" (micro-batch {r['micro_batch']})" if r.get("micro_batch") else "") + (
            f" (seq {r['seq']})" if r.get("seq") else "")
        lines.append(f"| {r['arch']} | {r.get('task', '')} | {method} | {r['wall_s']:.1f} | {r.get('cpu_s', float('nan')):.1f} | "
                     f"{r['max_rss_bytes'] / gib:.2f} / {r['tree_rss_bytes'] / gib:.2f} | {params} | {peak} | {why} |")
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["method"]] = counts.get(r["method"], 0) + 1
    builds = [r for r in rows if r["method"] != "refused"]
    fake = counts.get("fake", 0)
    slow = [r for r in rows if r["wall_s"] > 60 or max(r["max_rss_bytes"], r["tree_rss_bytes"]) > 3 * 2**30]
    text = [f"{len(rows)} architectures: " + ", ".join(f"{n} {m}" for m, n in sorted(counts.items(), key=lambda kv: -kv[1])),
            f"fake share of those that build from their default config: {fake}/{len(builds)} = "
            f"{100 * fake / max(1, len(builds)):.1f}%",
            "slowest: " + ", ".join(f"{r['arch']} {r['wall_s']:.0f} s" for r in sorted(rows, key=lambda r: -r["wall_s"])[:5]),
            "over 60 s or 3 GiB: " + (", ".join(f"{r['arch']} ({r['method']}, {r['wall_s']:.0f} s, "
                                                f"{max(r['max_rss_bytes'], r['tree_rss_bytes']) / 2**30:.1f} GiB)"
                                                for r in slow) or "none")]
    return "\n".join(text) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated model types (default: every architecture of the four tables)")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--out", default=str(RESULTS / "hf_coverage.json"))
    ap.add_argument("--resume", action="store_true", help="keep the fake rows already in --out, run the others")
    ap.add_argument("--blocks", choices=("all", "auto"), default="all",
                    help="auto: deep models counted from copies of a few blocks (memfit estimate --blocks auto); "
                         "--resume then keeps only rows estimated the same way")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        Path(args.child_out).write_text(json.dumps(one(args.child)))
        return
    archs = args.only.split(",") if args.only else architectures()
    before = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else []
    os.environ["MEMFIT_HF_BLOCKS"] = args.blocks
    done = {r["arch"]: r for r in before if r["method"] == "fake" and r.get("blocks", "all") == args.blocks} \
        if args.resume else {}
    rows, table = [], before
    for i, arch in enumerate(archs):
        row = done.get(arch) or run_child(arch, args.timeout)
        rows.append(row)
        print(f"[{i + 1}/{len(archs)}] {arch}: {row['method']} {row['wall_s']:.1f} s "
              f"{max(row['max_rss_bytes'], row['tree_rss_bytes']) / 2**30:.2f} GiB {row.get('reason', '')}", flush=True)
        # --only redoes some rows of the table: the others stay as they were, in their places
        redone = {r["arch"]: r for r in rows}
        table = [redone.pop(r["arch"], r) for r in before] + list(redone.values()) if args.only else rows
        Path(args.out).write_text(json.dumps(table, indent=1))
    title = "transformers coverage, memfit estimate's default (`benchmarks/hf_coverage.py --blocks auto`)" \
        if args.blocks == "auto" else "transformers coverage (`benchmarks/hf_coverage.py`)"
    Path(args.out).with_suffix(".md").write_text(  # the whole table, rows redone by --only in their places
        f"# {title}\n\nH100 target, bf16, micro-batch 1, seq {SEQ} "
        f"(image models at their image size; vision-language models {VLM_SEQ}, one image per row), library-default "
        f"configs.\n\n{summary(table)}\n{markdown(table)}")
    print(summary(rows))


if __name__ == "__main__":
    main()
