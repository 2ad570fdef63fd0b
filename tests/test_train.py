"""`memfit train` / `memfit.train`: OOM recovery that keeps the math, exact resume after kill -9 (at a random
moment and in the middle of a checkpoint write) and after Ctrl-C, resume errors, metrics / report / plots,
and the default sort demo actually learning.

Checkpoint atomicity and loading on their own are tests/test_checkpoints.py; here they are driven by a run.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import memfit
from memfit import Config, RunError
from memfit.runtime import checkpoints as ckpt
from memfit.runtime.run import train
from memfit.workloads import builtin

sys.path.insert(0, str(Path(__file__).parent))
import models  # noqa: E402

# The run the subprocess tests share: 12 steps of gpt-tiny (no dropout), checkpoints every 2 steps, cosine LR.
STEPS = 12
ARGS = ["gpt-tiny", "--steps", str(STEPS), "--global-batch", "4", "--micro-batch", "2", "--checkpoint-every", "2",
        "--no-progress", "--seed", "3"]
# One thread: on 2 cores shared with other test processes, OpenMP's spinning workers make these tiny steps
# ~50x slower. Every process of a comparison runs with the same setting, so bit-exactness is unaffected.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# ------------------------------------------------------------------------------------------------ helpers


def command(out: Path, *extra: str, args=ARGS) -> list[str]:
    return [sys.executable, "-m", "memfit.cli", "train", *args, "--out", str(out), *extra]


def run_cli(out: Path, *extra: str, args=ARGS, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(command(out, *extra, args=args), capture_output=True, text=True, env=ENV,
                          timeout=timeout, cwd=out.parent)


def start_cli(out: Path, log: Path, argv: list[str] | None = None) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:  # a file, not a pipe: nobody reads a pipe while we poll
        return subprocess.Popen(argv or command(out), stdout=f, stderr=subprocess.STDOUT, env=ENV, cwd=out.parent)


def wait_for(condition, proc: subprocess.Popen, what: str, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"run ended (exit {proc.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.002)


def metric_lines(out: Path) -> list[dict]:
    """Every complete line of metrics.jsonl (a line being written by a live run is skipped)."""
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return rows


def step_records(out: Path) -> list[dict]:
    return [r for r in metric_lines(out) if "loss" in r]


def saved_steps(out: Path) -> list[int]:
    return [s for s, _ in ckpt.list_checkpoints(out)]


def tmp_files(out: Path) -> list[str]:
    d = ckpt.checkpoint_dir(out)
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp")) if d.is_dir() else []


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "model.safetensors"))


def assert_bit_identical(out: Path, ref: Path) -> None:
    a, b = weights(out), weights(ref)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"weights differ from the uninterrupted run: {different[:5]}"
    # the same per-step losses and learning rates (the LR schedule resumed too), one record per step
    got, want = step_records(out), step_records(ref)
    assert [r["step"] for r in got] == list(range(STEPS)), "metrics.jsonl must hold exactly one record per step"
    assert [(r["loss"], r["lr"]) for r in got] == [(r["loss"], r["lr"]) for r in want]


def resume_until_done(out: Path, tries: int = 3) -> None:
    for _ in range(tries):
        r = run_cli(out, "--resume")
        assert r.returncode == 0, r.stderr[-3000:]
        if (out / "model.safetensors").exists():
            return
    raise AssertionError(f"--resume did not finish the run in {tries} tries")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run every interrupted one must reproduce bit for bit."""
    out = tmp_path_factory.mktemp("reference") / "run"
    r = run_cli(out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [r["step"] for r in step_records(out)] == list(range(STEPS))
    assert saved_steps(out)[-1] == STEPS and not tmp_files(out)
    return out


# ------------------------------------------------------------------------------------------------ OOM recovery


def test_oom_recovery_keeps_the_math(tmp_path):
    """Under a virtual budget micro-batch 8 does not fit: the run must fall back to a smaller micro-batch,
    redo the same global batch, and end where a run started at that micro-batch ends."""
    G = 8
    wl = models.gpt_sdpa()  # RoPE + SDPA, AdamW; no dropout, so a redone step draws nothing random
    assert not any(isinstance(m, torch.nn.Dropout) for m in wl.model().modules())
    p8 = memfit.estimate(wl, Config(micro_batch=8, grad_accum=1)).peak_bytes
    p2 = memfit.estimate(wl, Config(micro_batch=2, grad_accum=4)).peak_bytes
    assert p2 < p8
    budget = (p8 + p2) // 2

    out = tmp_path / "oom"
    res = train(wl, 4, G, budget=budget, config=Config(micro_batch=8), seed=5, progress=False, out=out)
    recs = step_records(out)
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    events = [e for r in recs for e in r["events"]]
    assert events, "no OOM recovery was recorded"
    assert all("out of memory" in e and "redoing the same global batch" in e for e in events)
    assert "micro-batch 8" in events[0]
    final = res.config
    assert final.micro_batch < 8 and recs[-1]["micro_batch"] == final.micro_batch
    assert final.micro_batch * final.grad_accum == G and final.checkpoint == "none"
    assert res.report["oom_recoveries"] == len(events)
    assert res.report["config"]["micro_batch"] == final.micro_batch
    assert all(r["peak_bytes"] is not None and r["peak_bytes"] <= budget for r in recs)  # measured under budget

    ref_out = tmp_path / "plain"
    ref = train(models.gpt_sdpa(), 4, G, config=Config(micro_batch=final.micro_batch), seed=5, progress=False,
                out=ref_out)
    assert not any(r["events"] for r in step_records(ref_out)) and ref.config.micro_batch == final.micro_batch
    got, want = weights(out), weights(ref_out)
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    for a, b in zip(recs, step_records(ref_out)):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5), (a, b)


def test_nothing_fits_raises_a_clear_run_error_and_leaves_a_checkpoint(tmp_path):
    out = tmp_path / "tiny-budget"
    with pytest.raises(RunError) as info:
        train(builtin("gpt-tiny"), 3, 4, budget=100_000, config=Config(micro_batch=4), seed=0, progress=False,
              out=out)
    msg = str(info.value)
    assert "out of memory" in msg and "nothing smaller is left to try" in msg and "step 0" in msg
    assert "\n" not in msg
    latest = ckpt.latest_checkpoint(out)
    assert latest is not None and str(latest) in msg
    state = ckpt.load_checkpoint(latest)
    assert state["step"] == 0 and state["data_state"] == {"seed": 0, "global_batch": 4}
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)


# ------------------------------------------------------------------------------------------------ kill -9


STALL = """\
# Runs `python -m memfit.cli ...`, but the checkpoint of step $MEMFIT_TEST_STALL_STEP is left half written in
# its temporary file and the process hangs there: the test's kill -9 lands in the middle of the write.
import os, runpy, sys, time
from memfit.runtime import checkpoints as c
stall = int(os.environ["MEMFIT_TEST_STALL_STEP"])
atomic_write = c._atomic_write
def patched(final, write):
    if final.name == "step-%08d.pt" % stall:
        whole = write
        def write(tmp):
            whole(tmp)
            data = tmp.read_bytes()
            with open(tmp, "wb") as f:
                f.write(data[: len(data) // 2])
                f.flush()
                os.fsync(f.fileno())
            open(os.environ["MEMFIT_TEST_STALLED"], "w").close()
            time.sleep(600)
    return atomic_write(final, write)
c._atomic_write = patched
sys.argv[0] = "memfit"
runpy.run_module("memfit.cli", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("where", ["random-moment", "mid-checkpoint-write"])
def test_kill_9_then_resume_is_bit_exact(reference, tmp_path, where):
    rnd = random.Random(f"memfit-kill-{where}")  # reproducible "random" kill points
    out = tmp_path / "run"
    log = tmp_path / "killed.log"
    if where == "random-moment":
        after, delay = rnd.choice([2, 4, 6, 8]), rnd.uniform(0.0, 0.08)
        proc = start_cli(out, log)
        wait_for(lambda: max(saved_steps(out), default=0) >= after, proc, f"checkpoint {after}", log)
        time.sleep(delay)
    else:
        stall = rnd.choice([4, 6, 8, 10])
        stalled = tmp_path / "stalled"
        script = tmp_path / "stall.py"
        script.write_text(STALL)
        ENV["MEMFIT_TEST_STALL_STEP"], ENV["MEMFIT_TEST_STALLED"] = str(stall), str(stalled)
        try:
            proc = start_cli(out, log, [sys.executable, str(script), *command(out)[3:]])
        finally:
            del ENV["MEMFIT_TEST_STALL_STEP"], ENV["MEMFIT_TEST_STALLED"]
        wait_for(stalled.exists, proc, f"the write of checkpoint {stall}", log)
        assert tmp_files(out), "no temporary checkpoint file while the write is in progress"
        assert stall not in saved_steps(out) and stall - 2 in saved_steps(out)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert not (out / "model.safetensors").exists(), "the run finished before it was killed: nothing was tested"
    assert saved_steps(out) and max(saved_steps(out)) < STEPS

    resume_until_done(out)
    assert_bit_identical(out, reference)
    assert not tmp_files(out), "a temporary file of the killed write was left behind"
    assert any("resumed from" in r.get("event", "") for r in metric_lines(out))


# ------------------------------------------------------------------------------------------------ Ctrl-C


def test_ctrl_c_writes_a_checkpoint_at_the_step_it_stopped_and_resume_finishes(reference, tmp_path):
    out = tmp_path / "run"
    log = tmp_path / "interrupted.log"
    proc = start_cli(out, log)
    wait_for(lambda: bool(step_records(out)), proc, "the first step", log)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
    assert "interrupted: checkpoint at step" in log.read_text()
    done = step_records(out)[-1]["step"] + 1
    assert done < STEPS, "the run finished before Ctrl-C reached it"
    latest = ckpt.latest_checkpoint(out)
    assert latest == ckpt.checkpoint_path(out, done)
    assert ckpt.load_checkpoint(latest)["step"] == done
    assert not (out / "model.safetensors").exists()

    r = run_cli(out, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    assert_bit_identical(out, reference)


# ------------------------------------------------------------------------------------------------ resume errors


def test_resume_without_a_checkpoint_is_one_line_and_exit_2(tmp_path):
    r = run_cli(tmp_path / "empty", "--resume", timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit: error:") and "no complete checkpoint" in lines[0], r.stderr
    with pytest.raises(RunError, match="no complete checkpoint"):
        train(builtin("mlp-tiny"), 2, 8, micro_batch=4, resume=True, progress=False, out=tmp_path / "empty")


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("small") / "run"
    train(builtin("mlp-tiny"), 2, 8, micro_batch=4, seed=1, checkpoint_every=1, progress=False, out=out)
    return out


@pytest.mark.parametrize("change, pattern", [(dict(seed=2), r"seed 1 .*seed 2"),
                                              (dict(global_batch=16), r"global batch 8.*global batch 16")])
def test_resume_with_another_seed_or_global_batch_is_refused(small_run, tmp_path, change, pattern):
    out = tmp_path / "run"
    shutil.copytree(small_run, out)
    before = (out / "metrics.jsonl").read_text(), saved_steps(out)
    kw = dict(global_batch=8, seed=1) | change
    with pytest.raises(RunError, match=pattern):
        train(builtin("mlp-tiny"), 4, kw["global_batch"], micro_batch=4, seed=kw["seed"], resume=True,
              progress=False, out=out)
    assert ((out / "metrics.jsonl").read_text(), saved_steps(out)) == before  # nothing was touched


# ------------------------------------------------------------------------------------------------ metrics, report


def test_metrics_report_and_plots(tmp_path):
    out = tmp_path / "run"
    res = train(builtin("mlp-tiny"), 6, 8, config=Config(micro_batch=4), schedule="onecycle", seed=0,
                progress=False, out=out)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]  # every line is JSON
    recs = [r for r in lines if "loss" in r]
    assert len(recs) == len(lines) == 6 and [r["step"] for r in recs] == list(range(6))
    for r in recs:
        assert {"step", "loss", "lr", "step_seconds", "peak_bytes", "micro_batch", "events"} <= r.keys()
        assert math.isfinite(r["loss"]) and r["lr"] > 0 and r["step_seconds"] > 0
        assert r["micro_batch"] == 4 and r["events"] == []
        assert r["peak_bytes"] is None or r["peak_bytes"] > 0
    assert recs[0]["peak_bytes"] is not None  # the first steps of a CPU run are measured
    lrs = [r["lr"] for r in recs]
    assert len(set(lrs)) == len(lrs), f"onecycle: the lr must change every step, got {lrs}"
    assert lrs[0] < max(lrs) and lrs[-1] < max(lrs)  # warms up, then anneals

    report = json.loads((out / "report.json").read_text())
    assert report == res.report
    for key in ("predicted_peak_bytes", "measured_peak_bytes", "predicted_step_seconds", "measured_step_seconds"):
        assert isinstance(report[key], (int, float)) and report[key] > 0, key
    assert 0.5 < report["measured_peak_bytes"] / report["predicted_peak_bytes"] < 2
    assert report["steps"] == 6 and report["oom_recoveries"] == 0
    for name in ("loss.png", "memory.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000, name
    assert res.steps == 6 and res.final_loss == recs[-1]["loss"] and (out / "model.safetensors").exists()


def test_lr_schedules_differ(tmp_path):
    """cosine warms up then decays to 10%; constant stays put (and the schedule is what the run records)."""
    lrs = {}
    for schedule in ("cosine", "constant"):
        train(builtin("mlp-tiny"), 4, 4, config=Config(micro_batch=4), schedule=schedule, warmup=1, progress=False,
              out=tmp_path / schedule)
        lrs[schedule] = [r["lr"] for r in step_records(tmp_path / schedule)]
    base = lrs["constant"][0]
    assert lrs["constant"] == [base] * 4
    # warm-up of 1 step, then cosine from the full lr over the 3 remaining steps
    expected = [base] + [base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (s - 1) / 3))) for s in (1, 2, 3)]
    assert lrs["cosine"] == pytest.approx(expected)


# ------------------------------------------------------------------------------------------------ the default run


def test_the_sort_demo_learns(tmp_path):
    """What `memfit train` with no arguments runs (shortened): planned, and the loss clearly falls."""
    res = train(builtin("sort"), steps=30, global_batch=32, progress=False, out=tmp_path / "sort")
    losses = [r["loss"] for r in step_records(tmp_path / "sort")]
    assert len(losses) == 30 and (tmp_path / "sort" / "plan.json").exists()
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.1, f"loss did not fall: first 5 {first:.3f}, last 5 {last:.3f}"
    assert res.final_loss == losses[-1]
