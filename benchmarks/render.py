"""Write BENCHMARKS.md from the section templates in benchmarks/report/ and the results in benchmarks/results/.

    python benchmarks/render.py           rewrite BENCHMARKS.md
    python benchmarks/render.py --check   exit 1, naming the sections that differ, when BENCHMARKS.md is not
                                          what rendering gives

Each file in report/ is one section (its numeric prefix fixes the order). A template is Markdown with two
kinds of placeholder, both filled from the JSON files in results/:

    {{ plan_cache.rows[0].seconds }}            a value: results/plan_cache.json, then the path into it
    {{ fit_8b.plans[0].peak_bytes | GiB .2f }}  ... with a unit (GiB, MiB, %: x100) and a format spec
    {{ table fit_8b }}                          a table written by the function TABLES["fit_8b"] below
    {{ toc }}                                   the table of contents (the intro only)

A figure quoted from a results file therefore cannot go stale without `--check` (and tests/test_benchmarks_render.py)
saying so. Standard library only.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPORT = HERE / "report"
RESULTS = HERE / "results"
OUTPUT = HERE.parent / "BENCHMARKS.md"

PLACEHOLDER = re.compile(r"\{\{\s*(.*?)\s*\}\}")
UNITS = {"GiB": 2**-30, "MiB": 2**-20, "KiB": 2**-10, "%": 100.0, "": 1.0}


def results(name: str):
    if name in DERIVED:
        return DERIVED[name]()
    return json.loads((RESULTS / f"{name}.json").read_text())


def _median(values: list[float]) -> float:
    v, mid = sorted(values), len(values) // 2
    return v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2


def hf_coverage_summary(name: str = "hf_coverage") -> dict:
    """Counts and times over results/hf_coverage.json, by outcome; `row` gives one architecture's row."""
    rows = results(name)
    fake = [r for r in rows if r["method"] == "fake"]
    by_method: dict[str, int] = {}
    for r in rows:
        by_method[r["method"]] = by_method.get(r["method"], 0) + 1
    builds = len(rows) - by_method.get("refused", 0)
    return {"total": len(rows), **{k.replace(" ", "_"): v for k, v in by_method.items()}, "builds": builds,
            "fake_share": len(fake) / builds,
            "median_wall": _median([r["wall_s"] for r in fake]), "median_cpu": _median([r["cpu_s"] for r in fake]),
            "largest_rss": max(r["tree_rss_bytes"] for r in fake),
            "row": {r["arch"]: r for r in rows}}


_BYTES = ("peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_peak_bytes")


def _default_vs_whole() -> list[tuple[dict, dict, str]]:
    """(row of results/hf_coverage_auto.json, the same architecture's row traced whole, what the default did:
    counted / fallback / whole) for each architecture the default estimated on fake tensors."""
    whole = {r["arch"]: r for r in results("hf_coverage")}
    out = []
    for r in results("hf_coverage_auto"):
        if r["method"] == "fake":
            fell = any(n.startswith("traced whole: its copies") for n in r.get("notes") or [])
            out.append((r, whole[r["arch"]], "counted" if r.get("extrapolated_from") else
                        "fallback" if fell else "whole"))
    return out


def hf_coverage_auto_summary() -> dict:
    """memfit estimate's default (counted from copies where that applies) against the whole-model table."""
    rows = _default_vs_whole()
    out: dict = {"rows": len(rows)}
    for kind in ("counted", "fallback", "whole"):
        group = [(r, w) for r, w, k in rows if k == kind]
        out[kind] = len(group)
        out[f"{kind}_equal"] = sum(all(r[b] == w[b] for b in _BYTES) for r, w in group)
        out[f"{kind}_cpu_delta"] = _median([r["cpu_s"] - w["cpu_s"] for r, w in group]) if group else 0.0
        out[f"{kind}_archs"] = ", ".join(r["arch"] for r, _ in group)
    return out


def heldout_summary(name: str) -> dict:
    """Rows of a held-out sweep (results/<name>.json) and how many are within 1%, 0.1% and 0.01% of the truth."""
    rows = results(name)
    errors = [abs(r["error_pct"]) for r in rows if r.get("error_pct") is not None]
    return {"rows": len(rows), "architectures": len({r["arch"] for r in rows}), "compared": len(errors),
            "within_1": sum(e <= 1 for e in errors), "within_0_1": sum(e <= 0.1 for e in errors),
            "within_0_01": sum(e <= 0.01 for e in errors),
            "row": {f"{r['arch']}_{r['precision']}": r for r in rows}}


def heldout_families_summary() -> dict:
    rows = results("heldout_families")
    ran = [r for r in rows if r.get("error_pct") is not None]
    return {"rows": len(rows), "models": len({r["model"] for r in rows}), "ran": len(ran),
            "fake": sum(r["method"] == "fake" for r in ran), "measured": sum(r["method"] == "measured" for r in ran),
            "within_1": sum(abs(r["error_pct"]) <= 1 for r in ran)}


DERIVED = {"heldout_families_summary": heldout_families_summary,"hf_coverage_summary": hf_coverage_summary,
           "hf_coverage_auto_summary": hf_coverage_auto_summary,
           "hf_coverage_vlm_summary": lambda: hf_coverage_summary("hf_coverage_vlm"),
           **{f"{n}_summary": (lambda n=n: heldout_summary(n))
              for n in ("hf_heldout", "hf_heldout_classification", "hf_heldout_image_text")}}


def lookup(data, path: str):
    """`rows[0].seconds` into `data`."""
    for name, index in re.findall(r"\.?([A-Za-z_][\w-]*)|\[(-?\d+)\]", path):
        data = data[name] if name else data[int(index)]
    return data


def fmt(value, spec: str = "") -> str:
    """`GiB .2f`, `,`, `+.2%`, or nothing: str()."""
    unit, _, spec = spec.strip().rpartition(" ") if " " in spec.strip() else ("", "", spec.strip())
    if spec in UNITS and not unit:
        unit, spec = spec, ""
    if unit:
        value = value * UNITS[unit]
    return format(value, spec) if spec else str(value)


def signed_pct(fraction: float, digits: int = 2) -> str:
    """An error as the tables print it: +0.00%, -0.68%; the sign is the fraction's own (-0.00% for -1e-9)."""
    text = f"{abs(fraction) * 100:.{digits}f}%"
    return ("-" if fraction < 0 else "+") + text


def table(header: list[str], rows: list[list], align: list[str] | None = None) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align or ["---"] * len(header)) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


# ---- tables written from results files ------------------------------------------------------------------

def _mib(b: int) -> str:
    return f"{b / 2**20:.2f}"


def t_estimate_accuracy() -> str:
    rows = []
    for r in results("estimate_accuracy"):
        err = signed_pct(r["error"])
        if abs(r["error"]) > 0.05:
            err = f"**{err}**"
        rows.append([r["model"], r["optimizer"], r["precision"], r["micro_batch"], r["method"], _mib(r["estimate"]),
                     _mib(r["profiler"]), err])
    return table(["model", "optimizer", "precision", "micro-batch", "method", "estimate MiB", "profiler MiB", "error"],
                 rows)


def t_hf_accuracy() -> str:
    rows = [[r["model"], r["precision"], r["micro_batch"], r["method"], _mib(r["estimate"]), _mib(r["profiler"]),
             signed_pct(r["error"]), f"{r['seconds']:.1f}"] for r in results("hf_accuracy")]
    return table(["model", "precision", "micro-batch", "method", "estimate MiB", "profiler MiB", "error",
                  "estimate s"], rows)


def _plan_gib(b: int) -> str:
    return f"{b / 2**30:.2f} GiB"


def t_fit_8b() -> str:
    chosen = {"keeps the math": "2 × 16, bf16-pure, checkpointing all, optimizer offload, loss in 8 chunks",
              "--allow 8bit-optim --host-memory 96GiB": "the same with 8-bit optimizer states (changes the math)",
              "--allow lora": "LoRA r=16 on every Linear layer, 1 × 32, bf16-pure, checkpointing all"}
    rows = []
    for p in results("fit_8b")["plans"]:
        label = p["label"] if p["label"] == "keeps the math" else f"`{p['label']}`"
        if p["label"] == "keeps the math":
            label += " (bf16-pure allowed)"
        host = p["host_peak_bytes"] / 2**30
        rows.append([label, chosen[p["label"]], _plan_gib(p["device_peak_bytes"]),
                     f"{host:.0f} GiB" if host >= 1 else "0", f"{p['step_seconds']:.1f} s", f"{p['seconds']:.1f} s"])
    return table(["allowed", "chosen", "device peak", "host", "step (predicted)", "planned in"], rows)


def t_plan_cache() -> str:
    rows = results("plan_cache")["rows"]
    short = {"micro-batch 2 x 16, bf16-pure, activation checkpointing all, optimizer offload, loss in 8 chunks":
             "2 × 16, bf16-pure, checkpointing all, optimizer offload, loss in 8 chunks",
             "micro-batch 1 x 32, bf16-pure, activation checkpointing all, optimizer offload":
             "1 × 32 without the chunked loss",
             "micro-batch 1 x 64, bf16-pure, activation checkpointing selective":
             "1 × 64, bf16-pure, checkpointing selective",
             "micro-batch 16 x 4, bf16-pure, activation checkpointing all, optimizer offload, loss in 8 chunks":
             "16 × 4, checkpointing all, optimizer offload, loss in 8 chunks",
             "micro-batch 1 x 32, bf16-pure, activation checkpointing all":
             "LoRA r=16 on every Linear layer, 1 × 32, bf16-pure, checkpointing all"}
    cases = {"Llama-3-8B shape, seq 2048, global batch 32": "Llama-3-8B shape, seq 2048, global batch 32, RTX 4090",
             "gpt-7b, seq 4096, global batch 64": "gpt-7b, seq 4096, global batch 64, A100 80GB",
             "Llama-3-8B shape, seq 2048, global batch 32, --allow 8bit-optim,lora":
             "Llama-3-8B shape as above, `--allow 8bit-optim,lora`"}
    out: dict[str, list[str]] = {}
    for r in rows:
        cells = out.setdefault(cases[r["case"]], ["", "", ""])
        if r["run"] == "first":
            cells[0] = f"{r['seconds']} s: {short[r['chosen']]}, {r['peak_bytes'] / 2**30:.2f} GiB"
        elif r["run"] == "again":
            same = r["chosen"] == next(x for x in rows if x["case"] == r["case"] and x["run"] == "first")["chosen"]
            cells[1] = f"{r['seconds']} s, " + ("the same plan" if same else short[r["chosen"]])
        else:
            cells[2] = (f"{r['budget'].replace('GiB', ' GiB')}: {r['seconds']} s, {short[r['chosen']]}, "
                        f"{r['peak_bytes'] / 2**30:.2f} GiB")
    return table(["case", "cold", "the same plan again", "another budget"], [[k, *v] for k, v in out.items()])


def t_estimate_accumulation() -> str:
    rows = results("estimate_accumulation")
    out = []
    for case in dict.fromkeys(r["case"] for r in rows):
        for blocks in ("all", "auto"):
            got = {r["code"]: r for r in rows if r["case"] == case and r["blocks"] == blocks}
            before, now = got.get("before"), got["now"]
            same = before is not None and all(before[k] == now[k] for k in ("peak_bytes", "device_peak_bytes"))
            traced = f"counted from {now['extrapolated_from'][0]} of {now['extrapolated_from'][1]} blocks" \
                if now.get("extrapolated_from") else "whole"
            out.append([case, f"`{blocks}`: {traced}", f"{before['seconds']} s" if before else "-", f"{now['seconds']} s",
                        f"{now['peak_bytes']:,}", f"{now['device_peak_bytes']:,}",
                        "the same" if same else "differ", f"{before['flops']:.3e} → {now['flops']:.3e}" if before else "-"])
    return table(["configuration", "--blocks", "before", "now", "peak bytes", "device peak bytes", "bytes before/now",
                  "FLOPs before → now"], out)


def t_torchtune_8b() -> str:
    d = results("torchtune_8b")
    e, pub = d["estimate"], d["published_bytes"]
    rows = []
    for label, key in [("torch's `max_memory_allocated` (torchtune logs it as peak memory active/alloc)",
                        "allocated_bytes"), ("torch's `max_memory_reserved`", "reserved_bytes"),
                       ("device use as nvidia-smi shows it (CUDA context added)", "device_bytes")]:
        rows.append([label, f"{e[key] / 2**30:.2f} GiB", f"{(e[key] / pub - 1) * 100:+.1f}%"])
    rows.append(["host memory (the paged 8-bit states)", f"{e['host_bytes'] / 2**30:.2f} GiB", ""])
    return table(["figure", "memfit", "vs 18.9 GiB"], rows)


def t_infer_generate() -> str:
    rows = [[r["model"], r["batch"], r["prompt"], r["new_tokens"], f"{r['estimate']:,}", f"{r['profiler']:,}",
             signed_pct(r["error"], 4)] for r in results("infer")["generate"]]
    return table(["model", "batch", "prompt", "new tokens", "memfit", "profiler", "error"], rows)


def _b(n: int) -> str:
    return f"{n:,} B"


def _args(args: dict) -> str:
    return ", ".join(f"`{k}={v}`" if isinstance(v, str) else f"`{k}={v!r}`" for k, v in args.items())


def _diff(n: int) -> str:
    return f"{n:+d} B"


def t_integrations_trainer() -> str:
    rows = [[r["model"], _args(r["args"]), _b(r["predicted"]), _b(r["profiled"]), _diff(r["diff_bytes"])]
            for r in results("integrations")["trainer"]]
    return table(["model", "arguments", "predicted", "profiled", "predicted − profiled"], rows)


def t_integrations_fit() -> str:
    rows = [[r["model"], _args(r["asked"]), r["budget"], ", ".join(r["allow"]) or "—", r["chosen"],
             _b(r["predicted"]), _b(r["profiled"]), _diff(r["diff_bytes"]), f"{r['plan_seconds']:.1f} s"]
            for r in results("integrations")["fit"]]
    return table(["model", "asked", "budget", "allow", "chosen", "predicted", "profiled", "predicted − profiled",
                  "planning"], rows)


def t_integrations_lightning() -> str:
    rows = [[r["precision"], r["clip"] or "off", r["budget"], r["chosen"], _b(r["predicted"]), _b(r["profiled"]),
             _diff(r["diff_bytes"])] for r in results("integrations")["lightning"]]
    return table(["precision", "clipping", "budget", "chosen", "predicted", "profiled", "predicted − profiled"], rows)


def t_pipeline_parallel() -> str:
    rows = [[r["workload"], f"{r['stages']} × {r['stages_per_rank']}" if r.get("stages_per_rank", 1) > 1 else r["stages"],
             r["schedule"], r["checkpoint"], " / ".join(_b(e) for e in r["estimates"]),
             " / ".join(_b(m) for m in r["rank_peaks"]), " / ".join(f"{d:+,}" for d in r["diff_bytes"]),
             f"{r['estimate_seconds']:.1f} s"] for r in results("pipeline_parallel")["rows"]]
    return table(["model", "stages (ranks × stages a rank)", "schedule", "checkpointing", "estimate per rank", "rank peaks",
                  "estimate − peak (bytes)", "estimated in"], rows)


def t_tensor_parallel(name: str = "tensor_parallel") -> str:
    rows = [[r["workload"], r["precision"], r["checkpoint"], _b(r["estimate"]), " / ".join(_b(m) for m in r["rank_peaks"]),
             signed_pct(r["error_vs_min"], 3), signed_pct(r["error_vs_max"], 2), r["runs"],
             f"{r['estimate_seconds']:.1f} s"] for r in results(name)["memory"]]
    return table(["model", "precision", "checkpointing", "estimate (rank 0)", "rank peaks (lowest of the runs)",
                  "vs lowest rank", "vs highest rank", "runs", "estimated in"], rows)


def t_tensor_parallel_numerics() -> str:
    rows = [[r["workload"], f"{r['terms']:,}", f"{r['sgd_loss_over_tolerance']:.3f}", f"{r['sgd_grad_over_tolerance']:.3f}",
             f"{r['sgd_weight_over_tolerance']:.3f}", f"{r['adamw_max_loss_diff']:.1e}", f"{r['adamw_max_weight_diff']:.1e}"]
            for r in results("tensor_parallel")["numerics"]]
    return table(["model", "terms per gradient entry", "SGD loss / tolerance", "gradients / tolerance",
                  "weights / tolerance", "AdamW ×3: loss diff", "AdamW ×3: weight diff"], rows)


def t_plan_model_parallel() -> str:
    rows = []
    for r in results("plan_model_parallel")["rows"]:
        why = next((n.split(": tensor-parallel")[0].replace("data parallelism alone does not fit ", "")
                    for n in r["notes"] if n.startswith("data parallelism alone does not fit")), "—")
        rows.append([r["gpus"], r["chosen"], f"{r['peak_bytes'] / 2**30:.1f} GiB", f"{r['step_seconds']:.1f} s",
                     why.strip("()"), f"{r['plan_seconds'] / 60:.0f} min"])
    return table(["H100s", "chosen", "per-rank peak (device)", "step", "FSDP alone", "planned in"], rows)


def t_step_time() -> str:
    d = results("step_time")

    def cell(r: dict) -> str:
        return f"{r['predicted_s'] * 1e3:.1f} / {r['measured']['median_s'] * 1e3:.1f} ({r['measured_over_predicted']:.2f})"
    rows = [[b["model"], b["precision"], f"{b['micro_batch']}×{b['grad_accum']}", cell(b), cell(a)]
            for b, a in zip(d["before"]["rows"], d["after"]["rows"])]
    return table(["model", "precision", "micro × accum", "before: pred / meas ms (ratio)",
                  "after: pred / meas ms (ratio)"], rows)


def t_published_multi_gpu() -> str:
    rows = []
    for r in results("published_multi_gpu"):
        published = r["published"]
        if published.endswith(" GB"):  # a figure published in GB: its GiB beside it
            published += f" ({r['published_bytes'] / 2**30:.1f} GiB)"
        run = f"{r['model']} {r['method']}, {r['gpus']} x {r['device'].split('-')[0].upper()}"
        if "not_estimated" in r:  # a row memfit cannot rebuild: why, in place of the figures
            rows.append([run, published, f"not estimated: {r['not_estimated']}", "", "", ""])
            continue
        e, err = r["estimate"], r["error"]
        rows.append([run, published,
                     *(f"{e[k] / 2**30:.1f} GiB ({err[k] * 100:+.1f}%)" for k in ("allocated", "reserved", "device")),
                     f"{r['seconds']:.0f} s"])
    return table(["run", "published", "memfit allocated", "reserved", "device (+ context, NCCL)", "estimated in"], rows)


def t_hf_coverage_auto() -> str:
    rows = [[r["arch"], f"{r['extrapolated_from'][0]} of {r['extrapolated_from'][1]}",
             f"{r['wall_s']:.1f} s, {r['cpu_s']:.1f} s", f"{w['wall_s']:.1f} s, {w['cpu_s']:.1f} s",
             "yes" if all(r[b] == w[b] for b in _BYTES) else "**no**"]
            for r, w, kind in _default_vs_whole() if kind == "counted" and w["wall_s"] > 20]
    return table(["architecture", "blocks traced", "default: wall, CPU", "traced whole: wall, CPU",
                  "every byte figure the same"], rows)


TABLES = {"hf_coverage_auto": t_hf_coverage_auto, "published_multi_gpu": t_published_multi_gpu, "step_time": t_step_time, "estimate_accuracy": t_estimate_accuracy, "hf_accuracy": t_hf_accuracy, "fit_8b": t_fit_8b,
          "plan_cache": t_plan_cache, "estimate_accumulation": t_estimate_accumulation, "torchtune_8b": t_torchtune_8b, "infer_generate": t_infer_generate,
          "integrations_trainer": t_integrations_trainer,
          "pipeline_parallel": t_pipeline_parallel, "plan_model_parallel": t_plan_model_parallel, "tensor_parallel": t_tensor_parallel,
          "tensor_parallel_2d": lambda: t_tensor_parallel("tensor_parallel_2d"),
          "tensor_parallel_numerics": t_tensor_parallel_numerics,
          "integrations_fit": t_integrations_fit, "integrations_lightning": t_integrations_lightning}


# ---- rendering ------------------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def toc(sections: list[str]) -> str:
    lines = []
    for text in sections:
        for level, title in re.findall(r"^(##+) (.*)$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M),
                                       flags=re.M):
            lines.append("  " * (len(level) - 2) + f"- [{title}](#{slug(title)})")
    return "\n".join(lines)


def fill(template: str, name: str) -> str:
    def one(match: re.Match) -> str:
        expr = match.group(1)
        if expr.startswith("table "):
            return TABLES[expr.split()[1]]()
        if expr == "toc":
            return match.group(0)  # filled once every section is rendered
        path, _, spec = expr.partition("|")
        stem, rest = re.match(r"(\w+)(.*)", path.strip()).groups()
        try:
            return fmt(lookup(results(stem), rest), spec)
        except (KeyError, IndexError, FileNotFoundError, TypeError) as e:
            raise SystemExit(f"report/{name}: cannot fill {{{{ {expr} }}}}: {e!r}")
    return PLACEHOLDER.sub(one, template)


def sections() -> list[tuple[str, str]]:
    """(template name, rendered text) in order."""
    return [(p.name, fill(p.read_text(), p.name)) for p in sorted(REPORT.glob("*.md"))]


def rendered_sections() -> list[tuple[str, str]]:
    """(template name, final text), the table of contents filled in."""
    parts = [(name, text.strip("\n")) for name, text in sections()]
    contents = toc([text for _, text in parts[1:]])
    return [(name, text.replace("{{ toc }}", contents)) for name, text in parts]


def render() -> str:
    return "\n\n".join(text for _, text in rendered_sections()) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if BENCHMARKS.md is not what rendering gives")
    args = parser.parse_args(argv)
    text = render()
    if not args.check:
        OUTPUT.write_text(text)
        print(f"wrote {OUTPUT.name} ({len(text.splitlines())} lines) from {len(list(REPORT.glob('*.md')))} sections")
        return 0
    current = OUTPUT.read_text() if OUTPUT.exists() else ""
    if current == text:
        return 0
    stale = [name for name, t in rendered_sections() if t not in current]
    print("BENCHMARKS.md is not what `python benchmarks/render.py` gives; differing sections: "
          + (", ".join(f"report/{n}" for n in stale) or "the blank lines between sections"))
    return 1


if __name__ == "__main__":
    sys.exit(main())
