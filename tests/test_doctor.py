"""memfit doctor and the HTML timeline (issue 13): the page's data adds up to the estimate's peak, activations
by block add up to the activations category, a leak is found and named by its line, and built-in workloads
raise no false alarm."""
import html
import inspect
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch

import memfit
from memfit.report.html import write_timeline_html
from memfit.runtime.leaks import find_leaks
from memfit.workloads import load_workload

LOSSES = []


def _page_data(path) -> dict:
    text = path.read_text(encoding="utf-8")
    return json.loads(re.search(r'<script type="application/json" id="data">(.*?)</script>', text, re.S).group(1))


@pytest.mark.parametrize("device", ["cpu", "h100"])
def test_the_html_timeline_adds_up_to_the_estimates_peak(tmp_path, device):
    est = memfit.estimate(load_workload("gpt-tiny"), memfit.Config(micro_batch=4, precision="bf16"), device=device)
    data = _page_data(write_timeline_html(est, tmp_path / "t.html"))
    at_peak = sum(layer["values"][data["peak_at"]] for layer in data["layers"])
    assert at_peak == est.peak_bytes
    # the blocks' activations are the activations category, point by point
    n = len(est.timeline["index"])
    blocks = [sum(v[i] for v in est.module_timeline.values()) for i in range(n)]
    assert blocks == est.timeline["activations"]
    assert {"layers.0", "layers.1"} <= set(est.module_timeline)
    # the forward's activations carry the line of the model that made them
    made = [t for t in est.top_tensors if str(t["category"]) == "activations" and str(t["phase"]) == "forward"]
    assert made and all(re.search(r"workloads/gpt\.py:\d+ in \w+", t["source"]) for t in made)
    assert sum(t["bytes"] for t in est.top_tensors) <= est.peak_bytes
    labels = [layer["label"] for layer in data["layers"]]
    assert labels[:4] == ["parameters & buffers", "gradients", "optimizer state", "inputs"]
    assert labels[-1] == "temporaries" and "activations · layers.0" in labels


@pytest.mark.skipif(shutil.which("chromium") is None, reason="headless Chromium is not installed")
def test_the_html_timeline_runs_in_headless_chromium(tmp_path):
    est = memfit.estimate(load_workload("gpt-tiny"), memfit.Config(micro_batch=2), device="cpu")
    page = write_timeline_html(est, tmp_path / "t.html")
    dom = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    # the page's script read its own data and wrote the peak it found
    assert f'data-bytes="{est.peak_bytes}">The chart\'s data at the peak adds up to {est.peak_bytes} bytes' in dom


def _live_at_peak(page) -> list[dict]:
    """The page's table of the tensors live at the peak: a dict per row, keyed by the table's headers."""
    table = page.read_text(encoding="utf-8").split("<table>")[1].split("</table>")[0]
    rows = [[html.unescape(re.sub(r"<.*?>", "", cell)) for cell in re.findall(r"<t[hd]>(.*?)</t[hd]>", row)]
            for row in re.findall(r"<tr>(.*?)</tr>", table)]
    return [dict(zip(rows[0], row)) for row in rows[1:]]


class TwoLayers(torch.nn.Module):
    """A custom model whose forward makes each activation it keeps on a line of its own."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(32, 256), torch.nn.Linear(256, 8)

    def forward(self, x):
        h = self.fc1(x)
        gate = torch.sigmoid(h)
        return self.fc2(h * gate)


def test_allocated_at_is_each_tensors_own_line_of_a_custom_model(tmp_path):
    wl = memfit.Workload(model=TwoLayers, batch=lambda n: (torch.randn(n, 32), torch.randn(n, 8)),
                         loss=lambda model, b: torch.nn.functional.mse_loss(model(b[0]), b[1]))
    est = memfit.estimate(wl, memfit.Config(micro_batch=64))
    rows = _live_at_peak(write_timeline_html(est, tmp_path / "t.html"))
    code, first = inspect.getsourcelines(TwoLayers.forward)
    line = {op: first + next(i for i, text in enumerate(code) if statement in text)
            for op, statement in (("addmm", "h = self.fc1(x)"), ("sigmoid", "gate = torch.sigmoid(h)"))}
    # the two activations live at the peak (in backward), each at its own line
    made = {row["op"].split(".")[0]: row["allocated at"] for row in rows if row["category"] == "activations"}
    assert {op: where.rpartition("/")[2] for op, where in made.items()} == {
        op: f"test_doctor.py:{n} in forward" for op, n in line.items()}
    # what no line of the model allocated says who did: the weights and optimizer state, autograd
    assert all(row["allocated at"] not in ("", "—") for row in rows)
    assert {row["allocated at"] for row in rows if row["category"] == "parameters"} == {
        "before the step: the model's weights, made as it was built"}
    assert "autograd, in backward (no line of the model's own)" in {row["allocated at"] for row in rows}


def test_allocated_at_is_transformers_own_line_where_site_packages_is_inside_the_standard_library(tmp_path):
    """conda, pyenv and the python images install packages inside the standard library's folder
    (lib/python3.X/site-packages): transformers' modeling code there is the model's code all the same, not
    Python's library. The layout is made so for a child process."""
    child = f"""
import os, sysconfig
paths = sysconfig.get_paths
library = os.path.dirname(paths()["purelib"])  # lib/python3.X, site-packages inside it
sysconfig.get_paths = lambda *args, **kwargs: dict(paths(*args, **kwargs), stdlib=library)
import memfit
from memfit.report.html import write_timeline_html
from memfit.workloads import load_workload
est = memfit.estimate(load_workload("hf:llama"), memfit.Config(micro_batch=2))
write_timeline_html(est, {str(tmp_path / "t.html")!r})
"""
    subprocess.run([sys.executable, "-c", child], check=True, timeout=600)
    rows = _live_at_peak(tmp_path / "t.html")
    made = [row["allocated at"] for row in rows if row["category"] == "activations"]
    assert sum(bool(re.fullmatch(r"transformers/models/llama/modeling_llama\.py:\d+ in \w+", m)) for m in made) >= 2
    assert len(set(made)) > 1  # not one line of the loss for every tensor
    assert all(row["allocated at"] not in ("", "—") for row in rows)


def _leaky_loss(model, batch):
    x, y = batch
    value = torch.nn.functional.mse_loss(model(x), y)
    LOSSES.append(value)
    return value


def _linear_workload(loss) -> memfit.Workload:
    return memfit.Workload(model=lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                                             torch.nn.Linear(32, 1)),
                           batch=lambda n: (torch.randn(n, 16), torch.randn(n, 1)), loss=loss,
                           optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), name="leaky")


def test_the_leak_finder_names_the_line_that_keeps_the_loss():
    report = find_leaks(_linear_workload(_leaky_loss), memfit.Config(micro_batch=8), steps=10)
    assert len(report.leaks) == 1
    leak = report.leaks[0]
    lines, first = inspect.getsourcelines(_leaky_loss)
    made = first + next(i for i, text in enumerate(lines) if "mse_loss" in text)
    kept = first + next(i for i, text in enumerate(lines) if "LOSSES.append" in text)
    assert leak.source == f"tests/test_doctor.py:{made} in _leaky_loss" or leak.source.endswith(
        f"test_doctor.py:{made} in _leaky_loss")
    assert leak.tensors_per_step == 1 and leak.steps == 10 - 3  # every step after warm-up, but the last
    assert "grad_fn" in leak.holder and "`LOSSES`" in leak.holder and f"test_doctor.py:{kept}:" in leak.holder
    assert "loss.item()" in leak.fix
    assert "LEAK" in report.render()


def test_the_leak_finder_without_a_leak():
    def loss(model, batch):
        x, y = batch
        value = torch.nn.functional.mse_loss(model(x), y)
        LOSSES.append(value.item())  # a number: nothing kept
        return value

    report = find_leaks(_linear_workload(loss), memfit.Config(micro_batch=8), steps=8)
    assert report.leaks == [] and report.late == []


@pytest.mark.parametrize("name", ["gpt-tiny", "sort", "mlp-tiny", "resnet-tiny", "moe-tiny"])
def test_no_false_alarm_on_built_in_workloads_over_20_steps(name):
    report = find_leaks(load_workload(name), memfit.Config(micro_batch=4), steps=20)
    assert report.leaks == [], report.render()
    assert report.live_after_step[-1] == report.live_after_step[2]  # flat after warm-up


def test_the_leak_finder_refuses_too_few_steps():
    with pytest.raises(memfit.MemfitError, match="at least 5 steps"):
        find_leaks(load_workload("mlp-tiny"), steps=3)


def _doctor(capsys, *argv) -> tuple[int, str, str]:
    from memfit.cli import main

    rc = main(["doctor", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_doctor_reads_a_snapshot_and_advises_only_when_fragmented(tmp_path, capsys):
    import pickle

    from test_snapshot import checkerboard

    fragmented, clean = tmp_path / "fragmented.pickle", tmp_path / "clean.pickle"
    fragmented.write_bytes(pickle.dumps(checkerboard().snapshot()))
    clean.write_bytes(pickle.dumps(checkerboard(big=None).snapshot()))
    rc, out, _ = _doctor(capsys, str(fragmented), "--device", "h100")
    assert rc == 0 and "largest 4 MiB" in out and "expandable_segments:True" in out
    assert "reserved + 500 MiB assumed CUDA context" in out  # h100's catalogue context
    rc, out, _ = _doctor(capsys, str(clean))
    assert rc == 0 and "expandable_segments" not in out
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"not a pickle")
    rc, out, err = _doctor(capsys, str(bad))
    assert rc == 2 and err.startswith("memfit: error: ") and len(err.strip().splitlines()) == 1


def test_doctor_explains_an_oom_message_and_finds_a_configuration_that_fits(capsys):
    message = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 250.00 MiB. GPU 0 has a total "
               "capacity of 3.00 GiB of which 100.00 MiB is free. Including non-PyTorch memory, this process has "
               "2.90 GiB memory in use. Of the allocated memory 2.60 GiB is allocated by PyTorch, and 50.00 MiB is "
               "reserved by PyTorch but unallocated.")
    rc, out, _ = _doctor(capsys, "--oom", message)
    assert rc == 0 and "250 MiB" in out
    rc, out, _ = _doctor(capsys, "--oom", message, "gpt-tiny", "--micro-batch", "4096", "--device", "h100")
    assert rc == 0 and "peak" in out and "fastest configuration that fits 3 GiB" in out
    rc, _, err = _doctor(capsys, "--oom", "a message about something else")
    assert rc == 2 and "not a CUDA out-of-memory message" in err


def test_doctor_watches_a_workload_and_exits_1_on_a_leak(capsys):
    rc, out, _ = _doctor(capsys, "mlp-tiny", "--micro-batch", "4", "--steps", "6")
    assert rc == 0 and "no leak" in out
    rc, _, err = _doctor(capsys, "mlp-tiny", "--steps", "2")
    assert rc == 2 and "at least 5 steps" in err


def test_train_warns_when_live_memory_grows_between_steps(tmp_path):
    leaky = memfit.train(_linear_workload(_leaky_loss), steps=12, global_batch=8, micro_batch=4, budget="10MiB",
                         out=tmp_path / "leaky", progress=False)
    assert "grew in 7 of the last 7 steps" in leaky.report["live_growth"]
    assert "memfit doctor" in leaky.report["live_growth"]
    assert all(r["live_bytes"] > 0 for r in leaky.metrics if "loss" in r)
    clean = memfit.train(load_workload("mlp-tiny"), steps=12, global_batch=8, micro_batch=4, budget="10MiB",
                         out=tmp_path / "clean", progress=False)
    assert clean.report["live_growth"] is None


SERVICE = '''
import torch

W = torch.randn(64, 64)
OUTPUTS = []
CACHE = {}


class Engine:
    def __init__(self):
        self.history = []
        self.kv = None

    def step(self):
        if self.kv is None:
            self.kv = torch.zeros(256, 64)
        out = torch.relu(torch.randn(8, 64) @ W)
        self.history.append(out)
        return out


engine = Engine()


def leaky():
    kept = torch.relu(torch.randn(8, 64) @ W)
    OUTPUTS.append(kept)
    return kept.sum().item()


def cached():
    if "kv" not in CACHE:
        CACHE["kv"] = torch.zeros(1024, 64)
    return (torch.randn(8, 64) @ W).sum().item()


def engined():
    return engine.step().sum().item()
'''


def _line(text: str) -> int:
    return next(i for i, line in enumerate(SERVICE.splitlines(), 1) if text in line)


def test_the_serving_doctor_names_what_keeps_each_requests_tensors(tmp_path, capsys, monkeypatch):
    """A handler that keeps every request's output in a global list grows by that output (8 x 64 fp32) a request,
    named with the list and the line that appends; an engine object's list is named through the global holding
    the engine, and its cache made once is held, not growing. CLI exit status 1 on growth, as for training leaks."""
    from memfit.runtime.leaks import load_handler, watch_service

    (tmp_path / "svc.py").write_text(SERVICE)
    monkeypatch.chdir(tmp_path)
    rc, out, _ = _doctor(capsys, "--serve", "svc.py:leaky", "--requests", "6")
    assert rc == 1
    assert f"GROWS 2 KiB a request (6 tensor(s) from 6 of 6 requests) made at svc.py:{_line('kept = torch.relu')}" in out
    assert f"list `OUTPUTS` (module svc.py; grows at svc.py:{_line('OUTPUTS.append')}: OUTPUTS.append(kept))" in out
    report = watch_service(load_handler("svc.py:engined"), 6)
    growing, held = report.kept
    assert growing.grows and growing.bytes_per_request == 8 * 64 * 4 and growing.tensors == 6
    assert "list `history` (attribute of Engine `engine` in module svc.py; grows at" in growing.holder
    assert not held.grows and held.bytes == 256 * 64 * 4 and held.requests == [1]
    assert "attribute `kv` (attribute of Engine `engine`" in held.holder
    assert report.live_after == [256 * 64 * 4 + 8 * 64 * 4 * r for r in range(1, 7)]


def test_the_serving_doctor_holds_a_cache_made_once_without_alarm(tmp_path, capsys, monkeypatch):
    """A cache filled on the first request and reused is held, not growing (exit 0); the rest of the process's
    memory is the allocator's: on a CPU PyTorch caches nothing and malloc_trim says what malloc kept."""
    (tmp_path / "svc.py").write_text(SERVICE)
    monkeypatch.chdir(tmp_path)
    rc, out, _ = _doctor(capsys, "--serve", "svc.py:cached", "--requests", "5")
    assert rc == 0 and "no growth" in out
    assert "HELD 256 KiB, not growing (1 tensor(s) made in request(s) 1)" in out
    assert "dict `CACHE` (module svc.py; filled at" in out
    assert "PyTorch's CPU allocator caches nothing" in out
    rc, _, err = _doctor(capsys, "--serve", "svc.py:missing")
    assert rc == 2 and "has no function 'missing'" in err and len(err.strip().splitlines()) == 1


def test_the_serving_doctor_tells_cached_cuda_memory_from_tensors():
    """On a GPU the figures after the requests are the caching allocator's: what is reserved and not allocated is
    its cache, and the snapshot reader says what empty_cache() would hand back (the allocator model's checkerboard:
    ten 4 MiB tensors freed between live ones leave no segment empty)."""
    from test_snapshot import checkerboard

    from memfit.memory.snapshot import explain_snapshot
    from memfit.runtime.leaks import ServeReport, allocator_lines

    snap = explain_snapshot(checkerboard(big=None).snapshot())
    report = ServeReport("app:handle", "cuda", 0, [0] * 5, [], [snap.reserved] * 5, [snap.allocated] * 5,
                         snapshot=snap)
    text = "\n".join(allocator_lines(report))
    assert "80 MiB reserved, 40 MiB allocated to tensors, 40 MiB cached" in text
    assert "empty_cache() would return 0 B" in text and "gunicorn -w N" in text
