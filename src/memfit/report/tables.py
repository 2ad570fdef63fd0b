"""Rich renderings of estimates and summaries. Pure functions of the data: no tracing happens here.

Every table fits a terminal of 80 columns or more without an ellipsis: figures (bytes, times, counts,
shapes) never wrap, and the text columns beside them wrap at words, long names folded, to make the room."""
from __future__ import annotations

import re

from rich.console import Group
from rich.table import Table
from rich.text import Text

from memfit.memory.estimate import CATEGORIES, Estimate
from memfit.config import Config
from memfit.units import fmt_bytes, fmt_number, fmt_seconds

_CATEGORY_TITLES = {
    "parameters": "parameters & buffers", "gradients": "gradients", "optimizer_state": "optimizer state",
    "inputs": "inputs", "activations": "activations saved for backward", "temporaries": "temporaries",
}
_METHODS = {
    "fake": "traced on fake tensors",
    "measured": "measured on a real CPU step (fake tensors could not follow the model)",
    "extrapolated": "extrapolated from real CPU steps (fake tensors could not follow the model)",
}


def _config_line(cfg: dict) -> str:
    return Config.from_dict(cfg).describe()


def _text(table: Table, name: str, **kw) -> None:
    """A column of words: wraps, and folds a name longer than the column rather than cutting it."""
    table.add_column(name, overflow="fold", **kw)


def _figures(table: Table, *names: str) -> None:
    """Columns of figures: never wrapped or cut; the text columns give way."""
    for name in names:
        table.add_column(name, justify="right", no_wrap=True)


def estimate_view(est: Estimate) -> Group:
    head = Text.assemble(
        ("memfit estimate", "bold"), f"  {est.workload} · {_config_line(est.config)} · {est.device}\n",
        ("peak ", "bold"), (fmt_bytes(est.peak_bytes), "bold cyan"),
        f" of live tensors, reached in the {est.peak_phase} phase — {_METHODS[est.method]}",
        f", extrapolated from {est.extrapolated_from[0]} of {est.extrapolated_from[1]} blocks"
        if est.extrapolated_from else "",
    )
    cats = Table(title="at the peak", title_justify="left", show_edge=False)
    _text(cats, "category")
    _figures(cats, "bytes", "share")
    for c in CATEGORIES:
        n = est.breakdown[c]
        cats.add_row(_CATEGORY_TITLES[c], fmt_bytes(n), f"{100 * n / max(est.peak_bytes, 1):.1f}%")
    cats.add_row(Text("total", style="bold"), Text(fmt_bytes(est.peak_bytes), style="bold"), "100%")
    parts = [head, cats]
    if est.peak_allocated_bytes is not None:
        dev = Table(title=f"on {est.device}", title_justify="left", show_edge=False)
        _text(dev, "what")
        _figures(dev, "bytes")
        dev.add_row("max_memory_allocated (allocator rounding)", fmt_bytes(est.peak_allocated_bytes))
        dev.add_row("max_memory_reserved (caching allocator)", fmt_bytes(est.peak_reserved_bytes))
        dev.add_row("device use as nvidia-smi shows it", fmt_bytes(est.device_peak_bytes))
        dev.add_row("device memory", fmt_bytes(est.device_total_bytes))
        parts.append(dev)
    if est.headroom_bytes is not None:
        left = est.headroom_bytes
        parts.append(Text(f"fits: {fmt_bytes(left)} of {est.device} memory left" if left >= 0 else
                          f"does NOT fit: over {est.device}'s memory by {fmt_bytes(-left)}",
                          style="green" if left >= 0 else "bold red"))
    if est.stages:
        parts.append(_stages_view(est))
    if est.routing and est.routing["assumption"] != "invariant":  # invariant: the notes say so
        parts.append(_routing_view(est))
    if est.modules:
        title = "activations + temporaries at the peak, by module"
        mods = Table(title=title, title_justify="left", show_edge=False, min_width=len(title))  # title on one line
        _text(mods, "module")
        _figures(mods, "bytes")
        for name, n in est.modules[:8]:
            mods.add_row(name, fmt_bytes(n))
        parts.append(mods)
    big = Table(title="largest tensors at the peak", title_justify="left", show_edge=False)
    _figures(big, "bytes")
    for col in ("category", "shape", "dtype"):  # one word each
        big.add_column(col, no_wrap=True)
    for col in ("made by", "in module"):
        _text(big, col)
    for t in est.top_tensors[:6]:
        big.add_row(fmt_bytes(t["bytes"]), t["category"], "×".join(map(str, t["shape"])) or "scalar",
                    t["dtype"], t["op"], t["module"] or "-")
    parts.append(big)
    for note in est.notes:
        parts.append(Text(f"note: {note}", style="dim"))
    return Group(*parts)


def _stage_peak(stage: dict) -> int:
    """The figure a stage's budget must hold: nvidia-smi's on a GPU target, live tensor bytes otherwise (as
    the estimate picks its highest stage)."""
    return stage["device_peak_bytes"] if stage["device_peak_bytes"] is not None else stage["peak_bytes"]


def _stages_view(est: Estimate) -> Group:
    """A pipeline's ranks side by side: they hold different blocks and micro-batches in flight, so the figures
    above are only the highest rank's, and a budget per GPU is bound by that one. Under the interleaved
    schedules a rank holds several stages: a row per rank, naming them."""
    gpu = est.stages[0]["device_peak_bytes"] is not None
    looped = len(est.stages[0].get("holds", [0])) > 1
    title = (f"pipeline ranks ({len(est.stages)}, {est.config['pp_schedule']}): each its own rank, holding "
             f"{len(est.stages[0]['holds'])} stages" if looped else
             f"pipeline stages ({len(est.stages)}, {est.config['pp_schedule']}): each its own rank")
    table = Table(title=title, title_justify="left", show_edge=False)
    _figures(table, "rank" if looped else "stage")
    if looped:
        _text(table, "stages")
    _figures(table, "parameters", "peak", *(["device use\n(nvidia-smi)"] if gpu else []))
    table.add_column("peak phase", no_wrap=True)
    for s in est.stages:
        table.add_row(str(s["stage"]), *([", ".join(map(str, s["holds"]))] if looped else []),
                      f"{s['parameters']:,}", fmt_bytes(s["peak_bytes"]),
                      *([fmt_bytes(s["device_peak_bytes"])] if gpu else []), str(s["peak_phase"]))
    bound = max(est.stages, key=_stage_peak)
    what = "device use" if gpu else "live tensors"
    unit = "rank" if looped else "stage"
    line = Text(f"{unit} {bound['stage']} bounds the budget: {fmt_bytes(_stage_peak(bound))} of {what}, the highest "
                f"{unit}'s; the figures above are its own")
    return Group(table, line)


_BOUND_ROUTINGS = {"collapsed": "k experts take every token", "first": "the first expert takes every token",
                   "last": "the last expert takes every token", "balanced": "no extreme routing exceeds balanced"}


def _routing_view(est: Estimate) -> Table:
    """An MoE's peak under the routing it was estimated with, and its bound (memory/routing.py)."""
    r = est.routing
    table = Table(title=f"MoE routing ({r['routers']}) decides tensor sizes", title_justify="left", show_edge=False)
    _text(table, "routing")
    _figures(table, "peak", *(["device use\n(nvidia-smi)"] if est.device_peak_bytes is not None else []))
    rows = [("balanced (the estimate)", est.peak_bytes, est.device_peak_bytes)]
    if r.get("bound_peak_bytes") is not None:
        rows.append((f"bound: {_BOUND_ROUTINGS[r['bound_routing']]}", r["bound_peak_bytes"],
                     r["bound_device_peak_bytes"]))
    for name, peak, device in rows:
        table.add_row(name, fmt_bytes(peak), *([fmt_bytes(device)] if est.device_peak_bytes is not None else []))
    return table


def summary_view(title: str, rows, note: str | None = None) -> Table:
    table = Table(title=f"memfit summary — {title}", title_justify="left")
    _text(table, "module (type)")
    table.add_column("output\nshape", no_wrap=True)
    _figures(table, "params", "saved for\nbackward", "forward\nFLOPs")  # two-line headers: room for the names
    for r in rows:
        table.add_row(f"{r.name} ({r.kind})" if r.name != r.kind else r.name, r.output_shape, f"{r.parameters:,}",
                      fmt_bytes(r.saved_bytes) if r.saved_bytes else "-", _fmt_flops(r.flops))
    total_params = sum(r.parameters for r in rows)
    table.caption = (f"{total_params:,} parameters · saved activations {fmt_bytes(sum(r.saved_bytes for r in rows))}"
                     f" · {_fmt_flops(rows[0].flops if rows else 0)} forward per micro-batch"
                     + (f"\nnote: {note}" if note else ""))
    return table


def _fmt_flops(n: int) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{fmt_number(n / scale)} {unit}FLOP"
    return f"{n} FLOP" if n else "-"


def plan_view(plan) -> Group:
    cfg = plan.config
    largest = max([plan.step_seconds] + [c.step_seconds for c in plan.alternatives])  # one unit for all of them
    head = Text.assemble(
        ("memfit plan", "bold"), f"  {plan.estimate.workload} · global batch {cfg.global_batch} · {plan.device}\n"
                                 f"budget {fmt_bytes(plan.budget_bytes)} (usable {fmt_bytes(plan.usable_bytes)})\n",
        ("chosen: ", "bold"), (cfg.describe(), "bold cyan"),
        f"\npredicted peak {fmt_bytes(plan.peak_bytes)} — {fmt_bytes(plan.usable_bytes - plan.peak_bytes)} headroom"
        f" · step {fmt_seconds(plan.step_seconds, largest)} · {fmt_number(plan.samples_per_second)} samples/s",
        f"\nhost memory for offloading: {fmt_bytes(plan.estimate.host_peak_bytes)}"
        if plan.estimate is not None and plan.estimate.host_peak_bytes
        and (cfg.offload_optimizer or cfg.offload_activations or cfg.paged_optimizer) else "",
    )
    alts = Table(title="fastest alternatives", title_justify="left", show_edge=False)
    _text(alts, "configuration")
    _figures(alts, "peak", "step", "vs chosen")
    for c in plan.alternatives:
        alts.add_row(c.config.describe(), fmt_bytes(c.peak_bytes) + ("" if c.confirmed else " *"),
                     fmt_seconds(c.step_seconds, largest), f"{c.step_seconds / plan.step_seconds:.2f}x")
    fams = Table(title="by family", title_justify="left", show_edge=False)
    _text(fams, "family")
    _text(fams, "verdict")
    rows = family_rows(plan.families)
    for row in rows:
        fams.add_row(*row)
    parts = [head] + ([alts] if plan.alternatives else [])
    if any(not c.confirmed for c in plan.alternatives):
        parts.append(Text("* predicted from probes, not confirmed by a full estimate; on a GPU the allocator's "
                          "overhead is taken as the probe had it, and grows with the micro-batch: check one with "
                          "memfit estimate before training it", style="dim"))
    parts.append(fams)
    if len(rows) < len(plan.families):
        parts.append(Text("each family's own verdict: the same command with --json (families)", style="dim"))
    parts += [Text(f"note: {n}", style="dim") for n in plan.notes + [f"step times: {plan.profile_source}"]]
    return Group(*parts)


FITTING_ROWS = 5  # families that fit shown one by one, fastest first; the slower ones share a row
_FIGURE = re.compile(r"\d[\d,]*(?:\.\d+)?(?: ?(?:[KMGTPE]i?B|B)\b|x\b)?")
_SLOWER = re.compile(r"^fits, ([\d.]+)x slower")


def family_rows(families: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """`Plan.families` as a reader takes it in: the chosen family, then the fastest that fit, each on its own
    row, then one row for the slower ones that fit and one per reason the rest do not (the figures in the
    reason as ranges). A search with offload, checkpointing and the optimizer in backward judges some 25
    families; `--json` keeps every one's own verdict."""
    chosen = [(f, v) for f, v in families if v.startswith("chosen")]
    fitting = sorted(((f, v) for f, v in families if _SLOWER.match(v)), key=lambda fv: float(_SLOWER.match(fv[1])[1]))
    rows = chosen + fitting[:FITTING_ROWS]
    if fitting[FITTING_ROWS:]:
        rows.append(_grouped(fitting[FITTING_ROWS:], more=True))
    reasons: dict[str, list] = {}
    for f, v in families:
        if not v.startswith("chosen") and not _SLOWER.match(v):
            reasons.setdefault(_FIGURE.sub("#", v), []).append((f, v))
    rows += [_grouped(group) if len(group) > 1 else group[0] for group in reasons.values()]
    return rows


def _grouped(group: list[tuple[str, str]], more: bool = False) -> tuple[str, str]:
    """One row for families with one verdict but for its figures: what their names share, and each figure
    of the verdict as the range it takes across them."""
    names = [f.split(", ") for f, _ in group]
    common = [part for part in names[0] if all(part in n for n in names[1:])]
    label = f"{len(group)} {'more ' if more else ''}families" + (f": {', '.join(common)}" if common else "")
    slots = list(zip(*(_FIGURE.findall(v) for _, v in group)))
    ranges = [(min(slot, key=_magnitude), max(slot, key=_magnitude)) for slot in slots]
    spans = iter(lo if lo == hi else f"{lo} to {hi}" for lo, hi in ranges)
    return label, _FIGURE.sub(lambda m: next(spans), group[0][1])


def _magnitude(figure: str) -> float:
    """A verdict's figure as a number to order by: bytes in bytes, a factor or a count as itself."""
    number, unit = re.match(r"([\d.]+)x? ?(\w*)", figure.replace(",", "")).groups()
    return float(number) * (1024 ** ("KMGTPE".index(unit[0]) + 1) if unit.endswith("iB") else 1)


def counts_view(rows: list[dict], workload: str, global_batch: int, device: str) -> Group:
    """`memfit plan --gpus A-B`: the fastest plan at each GPU count, and the fewest GPUs that fit."""
    fits = [r for r in rows if r["plan"] is not None]
    head = Text.assemble(("memfit plan", "bold"), f"  {workload} · global batch {global_batch} · {device}\n",
                         ("fewest GPUs that fit: ", "bold"),
                         (str(fits[0]["gpus"]) if fits else "none in this range", "bold cyan"))
    table = Table(show_edge=False)
    _figures(table, "GPUs")
    _text(table, "fastest configuration")
    _figures(table, "peak per GPU", "step", "samples/s", "scaling")
    largest = max((r["plan"].step_seconds for r in fits), default=0)
    for r in rows:
        p = r["plan"]
        if p is None:
            table.add_row(str(r["gpus"]), Text(r["why"], style="dim"), "", "", "", "")
        else:
            mark = " ✓" if p.confirmed else " ~"
            table.add_row(str(r["gpus"]), p.config.describe(), fmt_bytes(p.peak_bytes) + mark,
                          fmt_seconds(p.step_seconds, largest), fmt_number(p.samples_per_second),
                          f"{r['efficiency']:.0%}")
    note = Text("✓ a full estimate of that configuration; ~ predicted from the probes traced at another count. "
                "scaling: samples/s per GPU against the smallest count that fits; step times from the catalogue's "
                "compute and link figures (not measured on this hardware)", style="dim")
    return Group(head, table, note)


def verify_view(v: dict) -> Table:
    table = Table(title="verified: predicted vs measured", title_justify="left")
    _text(table, "")
    _figures(table, "predicted", "measured", "error")
    pm, mm = v["predicted_peak_bytes"], v["measured_peak_bytes"]
    ps, ms = v["predicted_step_seconds"], v["measured_step_seconds"]
    table.add_row(f"peak memory ({v['peak_method']})", fmt_bytes(pm), fmt_bytes(mm), f"{100 * (pm / mm - 1):+.1f}%")
    table.add_row("step time", fmt_seconds(ps, max(ps, ms)), fmt_seconds(ms, max(ps, ms)),
                  f"{100 * (ps / ms - 1):+.1f}%")
    return table


def max_batch_view(r: dict) -> Text:
    return Text.assemble(("memfit plan --max-micro-batch", "bold"), f"  {_config_line(r['config'])} · {r['device']}\n",
                         ("largest micro-batch that fits: ", "bold"), (str(r["micro_batch"]), "bold cyan"),
                         f" (peak {fmt_bytes(r['peak_bytes'])} of usable {fmt_bytes(r['usable_bytes'])}; "
                         f"budget {fmt_bytes(r['budget_bytes'])})",
                         *(("\nnote: " + n, "dim") for n in r.get("notes", [])))


def run_view(result) -> Group:
    """Predicted vs measured, each pair for the configuration it belongs to: after OOM recovery a run has
    trained in more than one, and the first one's prediction says nothing about the last one's peak."""
    r = result.report
    finished = (result.out / "model.safetensors").exists()
    table = Table(title=f"run {'finished' if finished else 'stopped'} after {result.steps} steps · "
                        f"{_config_line(r['config'])} · {result.out}", title_justify="left")
    _text(table, "")
    _figures(table, "predicted", "measured")
    configs = r.get("configs") or [dict(r, steps=result.steps, first_step=0)]
    largest = max((c[k] or 0 for c in configs for k in ("predicted_step_seconds", "measured_step_seconds")), default=0)
    fmt_b = lambda v: fmt_bytes(v) if v is not None else "-"  # noqa: E731
    fmt_s = lambda v: fmt_seconds(v, largest) if v is not None else "-"  # noqa: E731
    measure = r.get("measured_peak_is", "measured")
    for c in configs:
        at = (f" · {_config_line(c['config'])}, steps {c['first_step']}-{c['first_step'] + c['steps'] - 1}"
              if len(configs) > 1 else "")
        table.add_row(f"peak memory, {measure}{at}", fmt_b(c["predicted_peak_bytes"]), fmt_b(c["measured_peak_bytes"]))
        table.add_row(f"step time{at}", fmt_s(c["predicted_step_seconds"]), fmt_s(c["measured_step_seconds"]))
    table.add_row("samples/s", "", fmt_number(r['samples_per_second']) if r["samples_per_second"] else "-")
    said = {"plan": "the plan's own figures (plan.json)", "estimate": "an estimate of the configuration measured"}
    sources = sorted({str(c.get("prediction_source")) for c in configs})
    table.caption = "predicted: " + " / ".join(said.get(s, s) for s in sources)
    losses = [m["loss"] for m in result.metrics if "loss" in m]
    lines = [table]
    if losses:
        lines.append(Text(f"loss {losses[0]:.4f} → {losses[-1]:.4f}"
                          + (f" · {r['oom_recoveries']} OOM recoveries" if r["oom_recoveries"] else "")))
    if r.get("process_peak_rss_bytes"):
        lines.append(Text(f"process peak RSS {fmt_bytes(r['process_peak_rss_bytes'])}: the whole process (Python, "
                          "PyTorch, allocator caches, the data), not only the tensors the peak above counts",
                          style="dim"))
    if r.get("deterministic"):
        lines.append(Text(f"deterministic: deterministic kernels, {r['threads']} intra-op threads", style="dim"))
    advice = r.get("batch_size_advice") or {}
    if advice.get("critical_batch") is not None:
        lines.append(Text(f"batch-size advice (gradient noise scale; the run is unchanged by it): {advice['verdict']}"))
    if r.get("live_growth"):
        lines.append(Text(r["live_growth"], style="yellow"))
    files = ("metrics.jsonl, loss.png, memory.png" + (", noise_scale.png" if advice.get("measured_steps") else "")
             + (", model.safetensors" if finished else ", checkpoints/"))
    lines.append(Text(f"files in {result.out}: {files}", style="dim"))
    return Group(*lines)
