"""What a person sees in a terminal: at 80 to 120 columns no table cuts a figure or a word with an ellipsis,
the step times of one output share one unit, and a plan's family table stays short while `--json` keeps
every family's verdict."""
import dataclasses
import itertools
import json
import re

import pytest
from rich.console import Console

import memfit
from memfit.memory.summary import summarize
from memfit.planner.search import plan
from memfit.report.tables import counts_view, estimate_view, plan_view, run_view, summary_view
from memfit.runtime.run import RunResult
from memfit.units import fmt_bytes, fmt_number, fmt_seconds
from memfit.workloads import builtin

TIME = re.compile(r"\b\d[\d,.]* (ms|s)\b")


def _render(view, width: int) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))
    console.print(view)
    return console.export_text()


@pytest.fixture(scope="module")
def hf_estimate():
    """A transformers model on a GPU: long module and op names beside the device's figures."""
    return memfit.estimate(builtin("hf:llama"), memfit.Config(micro_batch=2, precision="bf16"), device="h100")


@pytest.fixture(scope="module")
def gpu_plan():
    return plan(builtin("gpt-tiny"), 64, device="h100", budget="700MiB")


def _run_result(out, predicted: float, measured: float) -> RunResult:
    """A run that trained in two configurations, the first one's step times `predicted` and `measured` s."""
    a = memfit.Config(micro_batch=16, grad_accum=4, precision="bf16", activation_checkpoint="selective").to_dict()
    b = dict(a, micro_batch=8, grad_accum=8)
    configs = [dict(config=a, first_step=0, steps=10, predicted_peak_bytes=1_234_567_890,
                    measured_peak_bytes=1_300_000_000, predicted_step_seconds=predicted,
                    measured_step_seconds=measured, prediction_source="plan"),
               dict(config=b, first_step=10, steps=10, predicted_peak_bytes=734_567_890,
                    measured_peak_bytes=750_000_000, predicted_step_seconds=predicted / 2,
                    measured_step_seconds=measured / 2, prediction_source="estimate")]
    report = dict(config=b, configs=configs, samples_per_second=12_345.6, oom_recoveries=1,
                  measured_peak_is="live tensor bytes (CPU)", process_peak_rss_bytes=2**31, batch_size_advice={})
    return RunResult(out=out, steps=20, config=memfit.Config.from_dict(b), final_loss=0.5,
                     metrics=[{"loss": 2.5}, {"loss": 0.5}], report=report)


@pytest.mark.parametrize("width", [80, 100, 120])
def test_tables_never_cut_a_figure_or_a_word(width, hf_estimate, gpu_plan, tmp_path):
    est, p = hf_estimate, gpu_plan
    rows = summarize(builtin("hf:llama"))
    counts = [dict(gpus=1, plan=None, efficiency=None,
                   why="nothing fits in 700 MiB on h100 for a global batch of 64: the smallest configuration "
                       "tried needs at least 900 MiB of budget"),
              dict(gpus=2, plan=p, why=None, efficiency=0.97)]
    largest = max([p.step_seconds] + [c.step_seconds for c in p.alternatives])
    views = {
        "estimate": (estimate_view(est), [fmt_bytes(est.peak_bytes), fmt_bytes(est.device_peak_bytes),
                                          *(fmt_bytes(n) for n in est.breakdown.values()),
                                          *("×".join(map(str, t["shape"])) for t in est.top_tensors[:6])]),
        "summary": (summary_view("hf:llama", rows), [f"{r.parameters:,}" for r in rows]
                    + [fmt_bytes(r.saved_bytes) for r in rows if r.saved_bytes] + [r.output_shape for r in rows]),
        "plan": (plan_view(p), [fmt_seconds(c.step_seconds, largest) for c in p.alternatives]
                 + [fmt_bytes(c.peak_bytes) for c in p.alternatives]),
        "counts": (counts_view(counts, "gpt-tiny", 64, "h100"), [fmt_number(p.samples_per_second), "97%"]),
        "run": (run_view(_run_result(tmp_path, 8.7441, 34.6)), ["1.15 GiB", "1.21 GiB", "8.74 s", "34.6 s"]),
    }
    for name, (view, figures) in views.items():
        text = _render(view, width)
        assert "…" not in text, f"{name} at {width} columns:\n{text}"
        assert max(map(len, text.splitlines())) <= width, name
        for figure in figures:
            assert figure in text, f"{name} at {width} columns lacks {figure!r} whole:\n{text}"


def test_one_time_unit_per_output(gpu_plan, tmp_path):
    # the unit of the largest time of the output, three significant figures, whole units kept
    assert fmt_seconds(8.7441, 34.6) == "8.74 s" and fmt_seconds(34.6, 34.6) == "34.6 s"
    assert fmt_seconds(0.0874) == "87.4 ms" and fmt_seconds(0.0051, 0.87) == "5.1 ms"
    assert fmt_seconds(12_345.6) == "12,346 s" and fmt_seconds(0.99996) == "1 s"
    # the run: "8744.1 ms" predicted beside "34.6 s" measured
    text = _render(run_view(_run_result(tmp_path, 8.7441, 34.6)), 120)
    assert {unit for unit in TIME.findall(text)} == {"s"}
    assert "8.74 s" in text and "34.6 s" in text
    assert {unit for unit in TIME.findall(_render(run_view(_run_result(tmp_path, 0.0874, 0.0912)), 120))} == {"ms"}
    # a plan whose chosen step takes 8 s and whose alternatives 12 s: all in seconds, the head line too
    slow = dataclasses.replace(gpu_plan, step_seconds=8.0,
                               alternatives=[dataclasses.replace(c, step_seconds=12.0 + i)
                                             for i, c in enumerate(gpu_plan.alternatives)])
    text = _render(plan_view(slow), 120)
    assert "step 8 s" in text and "12 s" in text
    assert {unit for unit in TIME.findall(text)} == {"s"}


# A 7B model's plan on an 80 GiB GPU: 27 families judged (verdicts as the planner writes them)
_STATE = ("does not fit: weights, gradients and optimizer state alone need 101 GiB; with the optimizer step in "
          "backward (no gradient buffer) 75.8 GiB: traced that way")
SEVEN_B = (
    [("bf16-pure, activation checkpointing none", "chosen at micro-batch 2")]
    + [(f"bf16, activation checkpointing {c}", _STATE)
       for c in ("none", "all", "all, loss in 8 chunks", "selective", "none, activation offload")]
    + [("bf16-pure, activation checkpointing none, optimizer in backward", "does not fit: its forward pass alone "
        "needs about 425 GiB at micro-batch 32, over by 349 GiB (not traced)"),
       ("bf16-pure, activation checkpointing selective, optimizer in backward", "does not fit: its forward pass "
        "alone needs about 258 GiB at micro-batch 32, over by 182 GiB (not traced)")]
    + [(f"bf16, activation checkpointing {c}, optimizer in backward", f"does not fit: over by {over} even at "
        "micro-batch 32") for c, over in (("none", "482 GiB"), ("all", "67.1 GiB"), ("selective", "249 GiB"),
                                          ("none, activation offload", "32.8 GiB"))]
    + [("bf16, activation checkpointing all, optimizer in backward, loss in 8 chunks",
        "does not fit: over by 50.9 GiB even at micro-batch 32")]
    + [(f"{p}, activation checkpointing {c}", f"fits, {x}x slower (best at micro-batch {m})") for p, c, x, m in (
        ("bf16", "none, optimizer offload", "5.38", 2), ("bf16", "all, optimizer offload", "2.38", 16),
        ("bf16", "all, optimizer offload, loss in 8 chunks", "2.39", 16),
        ("bf16", "selective, optimizer offload", "3.62", 4),
        ("bf16", "none, activation offload, optimizer offload", "7.05", 32), ("bf16-pure", "all", "1.22", 32),
        ("bf16-pure", "all, loss in 8 chunks", "1.23", 32), ("bf16-pure", "selective", "1.06", 2),
        ("bf16-pure", "none, optimizer offload", "2.69", 4), ("bf16-pure", "all, optimizer offload", "1.99", 32),
        ("bf16-pure", "all, optimizer offload, loss in 8 chunks", "1.99", 32),
        ("bf16-pure", "selective, optimizer offload", "2.22", 8),
        ("bf16-pure", "none, activation offload", "5.72", 32),
        ("bf16-pure", "none, activation offload, optimizer offload", "6.49", 32))]
)


def test_a_plans_family_table_is_short_and_its_json_keeps_every_family(gpu_plan):
    p = dataclasses.replace(gpu_plan, families=SEVEN_B)
    text = _render(plan_view(p), 400)  # wide: one line a row
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("by family")) + 3  # title, header, rule
    rows = [tuple(cell.strip() for cell in line.split("│"))
            for line in itertools.takewhile(lambda line: "│" in line, lines[start:])]
    assert len(rows) <= 10, text
    # every family is in a row of its own or counted in one
    counted = [int(m[1]) if (m := re.match(r"(\d+) (more )?families", family)) else 1 for family, _ in rows]
    assert sum(counted) == len(SEVEN_B) == 27
    # the chosen first, then those that fit, fastest first; those that do not, by reason
    assert rows[0] == SEVEN_B[0]
    slower = [float(m[1]) for _, v in rows if (m := re.match(r"fits, ([\d.]+)x", v))]
    assert slower == sorted(slower) and slower[0] == 1.06
    assert ("5 families: bf16", _STATE) in rows
    assert ("2 families: bf16-pure, optimizer in backward", "does not fit: its forward pass alone needs about "
            "258 GiB to 425 GiB at micro-batch 32, over by 182 GiB to 349 GiB (not traced)") in rows
    assert "each family's own verdict: the same command with --json" in text
    # --json keeps them all, each with its own verdict
    assert json.loads(json.dumps(p.to_dict()))["families"] == [dict(family=f, verdict=v) for f, v in SEVEN_B]
