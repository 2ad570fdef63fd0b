"""One self-contained HTML page of an estimate's memory timeline: a stacked area over the step (model state,
inputs, activations by the block that made them, temporaries), the peak marked, and what is live there, each
tensor with its shape, module and the source line that allocated it.

The chart is SVG drawn here, so the page shows without JavaScript and without a network; a short script
adds the hover read-out (bytes by layer at any point) and states the peak it reads from the page's own data.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from memfit.config import Config
from memfit.errors import EstimateError
from memfit.memory.estimate import Estimate, module_group
from memfit.report.plots import COLORS, LABELS, PHASE_SHADES, step_start
from memfit.units import fmt_bytes

WIDTH, HEIGHT = 1100, 420           # the chart's drawing area, in pixels
LEFT, TOP, BOTTOM, RIGHT = 70, 28, 40, 16
BAR_HEIGHT = 46                     # the peak's bar of tensors
TABLE_ROWS = 40
# activations by block: warm shades beside the category colours (Okabe-Ito orange and yellow, lighter and darker)
_GROUP_COLORS = ["#E69F00", "#F0B840", "#C98A00", "#F5CF7A", "#A97400", "#FBE3AE", "#8C6100", "#F2C15C",
                 "#D9A521"]
_BELOW = ("parameters", "gradients", "optimizer_state", "inputs")  # stacked under the activations


def _layers(est: Estimate, start: int) -> list[dict]:
    """The stack, bottom up: name, label, colour and values from the step's start."""
    tl = est.timeline
    layers = [dict(key=c, label=LABELS[c], color=COLORS[c], values=tl[c][start:]) for c in _BELOW]
    groups = est.module_timeline or {}
    if groups:
        for i, (group, values) in enumerate(groups.items()):
            layers.append(dict(key=f"activations:{group}", label=f"activations · {group}",
                               color=_GROUP_COLORS[i % len(_GROUP_COLORS)], values=values[start:]))
    else:
        layers.append(dict(key="activations", label=LABELS["activations"], color=COLORS["activations"],
                           values=tl["activations"][start:]))
    layers.append(dict(key="temporaries", label=LABELS["temporaries"], color=COLORS["temporaries"],
                       values=tl["temporaries"][start:]))
    return layers


def _path(xs: list[float], lower: list[float], upper: list[float]) -> str:
    top = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(xs, upper))
    bottom = " ".join(f"{x:.1f},{y:.1f}" for x, y in zip(reversed(xs), reversed(lower)))
    return f"M{top} L{bottom} Z"


def _ticks(top: float) -> tuple[list[float], str, int]:
    """About five round ticks up to `top` bytes, in one binary unit."""
    unit, scale = "B", 1
    for u, s in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)):
        if top >= s:
            unit, scale = u, s
    raw = top / scale / 5
    step = next(m * 10**e for e in range(-3, 7) for m in (1, 2, 2.5, 5) if m * 10**e >= raw)
    ticks, v = [], 0.0
    while v <= top / scale + 1e-9:
        ticks.append(v)
        v += step
    return ticks, unit, scale


def _chart(est: Estimate, layers: list[dict], index: list[int], phases: list[str], peak_at: int) -> str:
    n = len(index)
    totals = [sum(layer["values"][i] for layer in layers) for i in range(n)]
    device = est.device_total_bytes if est.peak_allocated_bytes is not None else None
    shown_device = device if device and device <= 4 * max(est.peak_bytes, 1) else None
    top = max(max(totals), shown_device or 0) * 1.1 or 1
    x0, x1 = index[0], max(index[-1], index[0] + 1)

    def X(i):
        return LEFT + (index[i] - x0) / (x1 - x0) * WIDTH

    def Y(v):
        return TOP + HEIGHT - v / top * HEIGHT

    xs = [X(i) for i in range(n)]
    out = [f'<svg id="chart" width="{LEFT + WIDTH + RIGHT}" height="{TOP + HEIGHT + BOTTOM}" '
           f'xmlns="http://www.w3.org/2000/svg" font-family="sans-serif" font-size="12">']
    # phases
    a = 0
    for i in range(1, n + 1):
        if i == n or phases[i] != phases[a]:
            right = xs[i] if i < n else LEFT + WIDTH
            out.append(f'<rect x="{xs[a]:.1f}" y="{TOP}" width="{max(right - xs[a], 0):.1f}" height="{HEIGHT}" '
                       f'fill="{PHASE_SHADES.get(phases[a], "#f5f5f5")}"/>')
            if right - xs[a] > 50:
                out.append(f'<text x="{(xs[a] + right) / 2:.1f}" y="{TOP + 14}" text-anchor="middle" '
                           f'font-style="italic" fill="#444">{html.escape(phases[a])}</text>')
            a = i
    # axes and grid
    ticks, unit, scale = _ticks(top)
    for t in ticks:
        y = Y(t * scale)
        out.append(f'<line x1="{LEFT}" x2="{LEFT + WIDTH}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ccc" '
                   'stroke-width="0.6"/>')
        out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{t:g}</text>')
    out.append(f'<text x="14" y="{TOP + HEIGHT / 2}" transform="rotate(-90 14 {TOP + HEIGHT / 2})" '
               f'text-anchor="middle">live memory ({unit})</text>')
    out.append(f'<text x="{LEFT + WIDTH / 2}" y="{TOP + HEIGHT + 32}" text-anchor="middle">'
               'allocation event in the step</text>')
    # the stack
    lower = [0.0] * n
    for layer in layers:
        upper = [lo + v for lo, v in zip(lower, layer["values"])]
        if any(layer["values"]):
            out.append(f'<path d="{_path(xs, [Y(v) for v in lower], [Y(v) for v in upper])}" '
                       f'fill="{layer["color"]}" fill-opacity="0.92">'
                       f'<title>{html.escape(layer["label"])}</title></path>')
        lower = upper
    # the device's memory, the peak
    if shown_device:
        y = Y(shown_device)
        out.append(f'<line x1="{LEFT}" x2="{LEFT + WIDTH}" y1="{y:.1f}" y2="{y:.1f}" stroke="#B00020" '
                   f'stroke-width="1.6"/><text x="{LEFT + 4}" y="{y - 4:.1f}" fill="#B00020">{html.escape(est.device)} '
                   f'memory {fmt_bytes(shown_device)}</text>')
    px, py = xs[peak_at], Y(totals[peak_at])
    anchor = "end" if px > LEFT + 0.6 * WIDTH else "start"
    out.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{TOP}" y2="{TOP + HEIGHT}" stroke="#B00020" '
               f'stroke-opacity="0.6"/><path d="M{px - 6:.1f},{py - 10:.1f} L{px + 6:.1f},{py - 10:.1f} '
               f'L{px:.1f},{py:.1f} Z" fill="#B00020"/>'
               f'<text x="{px + (-9 if anchor == "end" else 9):.1f}" y="{py - 12:.1f}" text-anchor="{anchor}" '
               f'font-weight="bold" fill="#B00020">peak {fmt_bytes(est.peak_bytes)} '
               f'({html.escape(str(est.peak_phase))})</text>')
    out.append(f'<line id="cursor" x1="0" x2="0" y1="{TOP}" y2="{TOP + HEIGHT}" stroke="#222" stroke-width="0.8" '
               'visibility="hidden"/>')
    out.append("</svg>")
    return "\n".join(out)


def _peak_bar(est: Estimate, colors: dict[str, str]) -> str:
    """The tensors live at the peak as one bar, each as wide as its bytes; hover names it."""
    total = est.peak_bytes or 1
    out = [f'<svg id="peakbar" width="{WIDTH}" height="{BAR_HEIGHT}" xmlns="http://www.w3.org/2000/svg">']
    x = 0.0
    for t in est.top_tensors:
        w = t["bytes"] / total * WIDTH
        color = colors.get(_layer_key(t, est.module_timeline), "#888")
        out.append(f'<rect x="{x:.2f}" y="0" width="{max(w, 0.5):.2f}" height="{BAR_HEIGHT}" fill="{color}" '
                   f'stroke="white" stroke-width="{0.4 if w > 2 else 0}">'
                   f'<title>{html.escape(_describe(t))}</title></rect>')
        x += w
    rest = est.peak_bytes - sum(t["bytes"] for t in est.top_tensors)
    if rest > 0:
        out.append(f'<rect x="{x:.2f}" y="0" width="{max(WIDTH - x, 0.5):.2f}" height="{BAR_HEIGHT}" fill="#ddd">'
                   f'<title>{fmt_bytes(rest)} in smaller tensors</title></rect>')
    out.append("</svg>")
    return "\n".join(out)


def _layer_key(t: dict, groups: dict) -> str:
    """The chart's layer a tensor live at the peak belongs to."""
    if str(t["category"]) != "activations" or not groups:
        return str(t["category"])
    group = module_group(t["module"])
    return f"activations:{group if group in groups else 'other modules'}"


def _describe(t: dict) -> str:
    shape = "×".join(map(str, t["shape"])) or "scalar"
    return (f"{fmt_bytes(t['bytes'])} · {t['category']} · [{shape}] {t['dtype']} · module {t['module']} · "
            f"op {t['op']} · {t.get('source') or _made_by(t)}")


_BEFORE_THE_STEP = {"parameters": "before the step: the model's weights, made as it was built",
                    "gradients": "before the step: the last step's gradients",
                    "optimizer_state": "before the step: the optimizer's state, made by its first step",
                    "inputs": "before the step: the batch"}
_NO_LINE = {"backward": "autograd, in backward (no line of the model's own)",
            "optimizer": "the optimizer step (no line of the model's own)"}


def _made_by(t: dict) -> str:
    """Who made a tensor that no line of the model's code allocated: it existed before the step, or autograd's
    backward or the optimizer made it (their frames are all torch's), or a kernel's workspace."""
    if t["op"] == "preexisting":
        return _BEFORE_THE_STEP.get(str(t["category"]), "before the step")
    return _NO_LINE.get(str(t["phase"]), "torch or memfit, outside the model's code")


def _table(est: Estimate) -> str:
    rows = ["<tr><th>bytes</th><th>category</th><th>module</th><th>shape</th><th>dtype</th><th>op</th>"
            "<th>allocated at</th></tr>"]
    for t in est.top_tensors[:TABLE_ROWS]:
        shape = "×".join(map(str, t["shape"])) or "scalar"
        where = (html.escape(t["source"]) if t.get("source") else
                 f'<span class="who">{html.escape(_made_by(t))}</span>')
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
            fmt_bytes(t["bytes"]), t["category"], t["module"], shape, t["dtype"], t["op"])) + f"<td>{where}</td></tr>")
    return "<table>" + "\n".join(rows) + "</table>"


_CSS = """
body { font-family: sans-serif; margin: 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 4px 0; } h2 { font-size: 16px; margin: 22px 0 6px 0; }
.sub, .note { color: #555; font-size: 13px; } .facts span { margin-right: 22px; font-size: 14px; }
#wrap { position: relative; display: inline-block; }
#tip { position: absolute; pointer-events: none; background: rgba(255,255,255,0.95); border: 1px solid #999;
       padding: 6px 8px; font-size: 12px; display: none; white-space: nowrap; }
.legend span { display: inline-block; margin: 2px 12px 2px 0; font-size: 12px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -1px; }
table { border-collapse: collapse; font-size: 12px; } td, th { padding: 3px 8px; border-bottom: 1px solid #eee;
text-align: left; } td:first-child { text-align: right; white-space: nowrap; }
.who { color: #777; font-style: italic; }
"""

_SCRIPT = """
const D = JSON.parse(document.getElementById('data').textContent);
const svg = document.getElementById('chart'), tip = document.getElementById('tip');
const cursor = document.getElementById('cursor');
const fmt = b => { const u = ['B','KiB','MiB','GiB','TiB']; let i = 0;
  while (Math.abs(b) >= 1000 && i < u.length - 1) { b /= 1024; i++; } return (i ? b.toPrecision(3) : b) + ' ' + u[i]; };
const total = i => D.layers.reduce((s, l) => s + l.values[i], 0);
svg.addEventListener('mousemove', e => {
  const r = svg.getBoundingClientRect(), x = e.clientX - r.left;
  if (x < D.left || x > D.left + D.width) { tip.style.display = 'none'; cursor.setAttribute('visibility', 'hidden'); return; }
  const ev = D.index[0] + (x - D.left) / D.width * (D.index[D.index.length - 1] - D.index[0]);
  let i = 0; while (i + 1 < D.index.length && D.index[i + 1] <= ev) i++;
  const rows = D.layers.filter(l => l.values[i]).reverse()
    .map(l => `<i style="display:inline-block;width:9px;height:9px;background:${l.color}"></i> ${l.label}: ${fmt(l.values[i])}`);
  tip.innerHTML = `<b>${fmt(total(i))}</b> live · ${D.phase[i]} · event ${D.index[i]}<br>` + rows.join('<br>');
  tip.style.display = 'block'; tip.style.left = (x + 14) + 'px'; tip.style.top = (e.clientY - r.top + 10) + 'px';
  cursor.setAttribute('x1', x); cursor.setAttribute('x2', x); cursor.setAttribute('visibility', 'visible');
});
svg.addEventListener('mouseleave', () => { tip.style.display = 'none'; cursor.setAttribute('visibility', 'hidden'); });
const check = document.getElementById('check');
check.textContent = `The chart's data at the peak adds up to ${total(D.peak_at)} bytes`;
check.dataset.bytes = total(D.peak_at);
"""


def write_timeline_html(est: Estimate, path) -> Path:
    """Write the page for `est` to `path` and return the path."""
    if not est.timeline.get("index"):
        raise EstimateError("the estimate has an empty timeline: nothing to draw")
    start = step_start(est.timeline)
    index = est.timeline["index"][start:]
    phases = [str(p) for p in est.timeline["phase"][start:]]
    layers = _layers(est, start)
    totals = [sum(layer["values"][i] for layer in layers) for i in range(len(index))]
    peak_at = max(range(len(index)), key=totals.__getitem__)
    colors = {layer["key"]: layer["color"] for layer in layers}
    described = Config.from_dict(est.config).describe()
    gpu = ""
    if est.peak_reserved_bytes is not None:
        gpu = (f"<span>predicted max_memory_allocated {fmt_bytes(est.peak_allocated_bytes)}</span>"
               f"<span>max_memory_reserved {fmt_bytes(est.peak_reserved_bytes)}</span>"
               f"<span>nvidia-smi {fmt_bytes(est.device_peak_bytes)}</span>")
    data = dict(index=index, phase=phases, peak_at=peak_at, left=LEFT, width=WIDTH,
                layers=[dict(label=layer["label"], color=layer["color"], values=layer["values"]) for layer in layers])
    legend = "".join(f'<span><i style="background:{layer["color"]}"></i>{html.escape(layer["label"])}</span>'
                     for layer in reversed(layers) if any(layer["values"]))
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in est.notes)
    payload = json.dumps(data).replace("</", "<\\/")  # no "</script>" inside the script
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>memfit · {html.escape(est.workload)} · {html.escape(described)} · {html.escape(est.device)}</title>
<style>{_CSS}</style></head>
<body>
<h1>Memory over one training step — {html.escape(est.workload)}</h1>
<div class="sub">{html.escape(described)} · {html.escape(est.device)} · estimated by memfit ({html.escape(est.method)})</div>
<p class="facts"><span id="peak" data-bytes="{est.peak_bytes}">peak <b>{fmt_bytes(est.peak_bytes)}</b>
({est.peak_bytes:,} bytes) in {html.escape(str(est.peak_phase))}</span>{gpu}</p>
<div id="wrap">{_chart(est, layers, index, phases, peak_at)}<div id="tip"></div></div>
<div class="legend">{legend}</div>
<h2>Live at the peak</h2>
<div class="note">Each tensor as wide as its bytes (hover for its shape, module and the line that allocated it);
grey: smaller ones.</div>
{_peak_bar(est, colors)}
{_table(est)}
<p class="note" id="check"></p>
<h2>Notes</h2><ul class="note">{notes}</ul>
<script type="application/json" id="data">{payload}</script>
<script>{_SCRIPT}</script>
</body></html>
"""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path


