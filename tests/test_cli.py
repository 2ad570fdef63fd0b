"""The `memfit` command: run in-process through `memfit.cli.main` (fast), and through the installed console
script in a subprocess (proves the entry point works and that nothing leaks onto the real stderr fd).

Contract checked here (see memfit/cli.py): success prints to stdout and returns 0; any bad input returns 2
with exactly one line on stderr, "memfit: error: ...", and no traceback; --debug lets the exception out.
Only tiny models are used, so the whole file stays well under a minute on 2 cores.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import memfit
from memfit.cli import main
from memfit.units import fmt_bytes, fmt_number

# ------------------------------------------------------------------------------------------ helpers

NOT_A_WORKLOAD = """
def workload():
    return 42
"""

FACTORY_RAISES = """
def workload():
    raise RuntimeError("boom in the workload factory")
"""

# The model takes 8 features, the batch has 5: the loss raises on fake tensors, the estimate falls back to
# a real CPU step, which raises too. The user must get one line, not two tracebacks.
LOSS_RAISES = """
import torch
import torch.nn.functional as F
import memfit

def workload():
    return memfit.Workload(
        model=lambda: torch.nn.Linear(8, 4),
        batch=lambda n: (torch.randn(n, 5), torch.randint(0, 4, (n,))),
        loss=lambda model, b: F.cross_entropy(model(b[0]), b[1]),
    )
"""


def _write(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


# gpt-tiny by hand: embedding and untied head 2 x 256 x 64; per layer (2) q, k, v, o 4 x 64^2, gate, up, down
# 3 x 64 x 256 and two RMSNorm weights; a final norm
GPT_TINY_PARAMETERS = 2 * 256 * 64 + 2 * (4 * 64**2 + 3 * 64 * 256 + 2 * 64) + 64


def _run(capfd, *argv: str) -> tuple[int, str, str]:
    """main(argv) -> (exit code, stdout, stderr). capfd (not capsys) so that writes straight to the file
    descriptors -- the forked tracing child, C++ warnings -- are seen as well."""
    code = main(list(argv))
    out, err = capfd.readouterr()
    return code, out, err


def _assert_one_line_error(code: int, out: str, err: str, *fragments: str) -> None:
    """One error line on stderr: a plan's progress lines before it (printed once it has traced for 2 s, as
    on a busy machine) are not part of the error."""
    lines = [line for line in err.strip().splitlines() if not _PROGRESS.fullmatch(line)]
    assert code == 2, f"exit code {code}, stderr:\n{err}"
    assert "Traceback" not in err and "Traceback" not in out, err
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{err}"
    assert lines[0].startswith("memfit: error:"), lines[0]
    assert out == "", f"nothing belongs on stdout after an error, got:\n{out}"
    for fragment in fragments:
        assert fragment.lower() in lines[0].lower(), f"{fragment!r} not in {lines[0]!r}"


_PROGRESS = re.compile(r"memfit: .*: \d+ of \d+ traced")


def _console_command() -> list[str]:
    """The installed `memfit` script next to this interpreter, else `python -m memfit.cli`."""
    script = Path(sys.executable).parent / "memfit"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    found = shutil.which("memfit")
    return [found] if found else [sys.executable, "-m", "memfit.cli"]


def _subprocess(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS="120")
    return subprocess.run([*_console_command(), *argv], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)


# ------------------------------------------------------------------------------------------ estimate


def test_estimate_json_breakdown_sums_to_peak(capfd):
    code, out, err = _run(capfd, "estimate", "mlp-tiny", "--micro-batch", "4", "--json")
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1, "--json prints exactly one JSON object on one line"
    d = json.loads(out)
    assert isinstance(d, dict)
    assert isinstance(d["peak_bytes"], int) and d["peak_bytes"] > 0
    assert set(d["breakdown"]) == set(memfit.memory.estimate.CATEGORIES)
    assert all(isinstance(v, int) and v >= 0 for v in d["breakdown"].values())
    assert sum(d["breakdown"].values()) == d["peak_bytes"]
    assert d["config"]["micro_batch"] == 4
    assert d["workload"] == "mlp-tiny"
    assert d["parameters"] > 0
    # A CPU target has no allocator model.
    assert d["peak_allocated_bytes"] is None and d["peak_reserved_bytes"] is None


def test_estimate_json_for_a_catalogue_gpu(capfd):
    code, out, err = _run(capfd, "estimate", "mlp-tiny", "--micro-batch", "4", "--device", "h100", "--json")
    assert code == 0, err
    d = json.loads(out)
    for key in ("peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "device_peak_bytes",
                "device_total_bytes"):
        assert isinstance(d[key], int) and d[key] > 0, (key, d[key])
    assert sum(d["breakdown"].values()) == d["peak_bytes"]
    assert d["peak_allocated_bytes"] <= d["peak_reserved_bytes"] <= d["device_peak_bytes"]
    assert d["device_peak_bytes"] < d["device_total_bytes"]
    assert d["device_total_bytes"] == memfit.memory.devices.get_device("h100").memory_bytes
    assert d["headroom_bytes"] == d["device_total_bytes"] - d["device_peak_bytes"]


def test_estimate_rich_output_mentions_the_peak(capfd):
    code, out, err = _run(capfd, "estimate", "mlp-tiny", "--micro-batch", "4", "--json")
    assert code == 0, err
    peak = json.loads(out)["peak_bytes"]
    code, out, err = _run(capfd, "estimate", "mlp-tiny", "--micro-batch", "4")
    assert code == 0, err
    text = re.sub(r"\s+", " ", out)
    assert "peak" in text.lower()
    assert fmt_bytes(peak) in text, f"{fmt_bytes(peak)!r} not in:\n{out}"
    assert "mlp-tiny" in text


def test_a_deep_models_estimate_is_counted_from_copies_unless_a_timeline_is_asked_for(capfd, tmp_path):
    """By default a deep model's step is counted from copies of 1, 2 and 3 blocks (the same bytes, in less
    time); --html draws the step's timeline, so it traces every block; --blocks auto with it is refused."""
    deep = ("estimate", "gpt-tiny", "-o", "layers=8", "--micro-batch", "2", "--device", "h100", "--json")
    code, out, err = _run(capfd, *deep)
    assert code == 0, err
    counted = json.loads(out)
    page = tmp_path / "t.html"
    code, out, err = _run(capfd, *deep, "--html", str(page))
    assert code == 0, err
    whole = json.loads(out)
    assert counted["extrapolated_from"] == [3, 8] and whole["extrapolated_from"] is None and page.is_file()
    assert not counted["timeline"]["index"] and whole["timeline"]["index"]
    for key in ("peak_bytes", "breakdown", "peak_allocated_bytes", "peak_reserved_bytes", "device_peak_bytes"):
        assert counted[key] == whole[key], key
    _assert_one_line_error(*_run(capfd, *deep, "--blocks", "auto", "--plot", str(tmp_path / "t.png")),
                           "needs every block traced")
    assert not (tmp_path / "t.png").exists()


# ------------------------------------------------------------------------------------------ summary


def test_summary_prints_module_rows(capfd):
    code, out, err = _run(capfd, "summary", "gpt-tiny")
    assert code == 0, err
    assert "Traceback" not in err
    for row in ("layers.0", "layers.1", "head"):
        assert row in out, f"{row!r} not in summary output:\n{out}"


def test_summary_json_rows(capfd):
    code, out, err = _run(capfd, "summary", "gpt-tiny", "--json")
    assert code == 0, err
    rows = json.loads(out)
    names = [r["name"] for r in rows]
    assert "layers.0" in names and "layers.0.attn" in names
    assert sum(r["parameters"] for r in rows) == GPT_TINY_PARAMETERS


# ------------------------------------------------------------------------------------------ errors


def test_missing_workload_file(capfd, tmp_path):
    missing = str(tmp_path / "nope.py")
    _assert_one_line_error(*_run(capfd, "estimate", f"{missing}:workload"), "no such workload file")
    _assert_one_line_error(*_run(capfd, "estimate", "nope.py:workload"), "nope.py")


def test_function_that_is_not_a_workload(capfd, tmp_path):
    path = _write(tmp_path, "not_a_workload.py", NOT_A_WORKLOAD)
    _assert_one_line_error(*_run(capfd, "estimate", f"{path}:workload"), "not a memfit.Workload")


def test_file_without_the_function(capfd, tmp_path):
    path = _write(tmp_path, "no_such_function.py", NOT_A_WORKLOAD)
    _assert_one_line_error(*_run(capfd, "estimate", f"{path}:other"), "other")


def test_workload_function_raises(capfd, tmp_path):
    path = _write(tmp_path, "factory_raises.py", FACTORY_RAISES)
    _assert_one_line_error(*_run(capfd, "estimate", f"{path}:workload"), "boom in the workload factory")


def test_workload_loss_raises(capfd, tmp_path):
    path = _write(tmp_path, "loss_raises.py", LOSS_RAISES)
    _assert_one_line_error(*_run(capfd, "estimate", f"{path}:workload", "--micro-batch", "2"), "raised")


def test_unknown_device(capfd):
    _assert_one_line_error(*_run(capfd, "estimate", "mlp-tiny", "--device", "h1000"), "h1000", "h100")


# The model wants 5 features and raises on the 8 the batch has, in its own code: every command's one line says
# where. With RAISE_AFTER, only after that many real (not fake, not forked) forward passes: in `memfit train`'s
# steps, after the estimate has traced the step.
FORWARD_RAISES = """
import os
import torch
import torch.nn.functional as F
import memfit

PARENT, CALLS, RAISE_AFTER = os.getpid(), [0], {after}


class Picky(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)

    def forward(self, x):
        CALLS[0] += os.getpid() == PARENT
        if x.shape[1] != 5 and CALLS[0] > RAISE_AFTER:
            raise ValueError(f"expected 5 features, got {{x.shape[1]}}")
        return self.linear(x)


def workload():
    return memfit.Workload(model=Picky, batch=lambda n: (torch.randn(n, 8), torch.randint(0, 4, (n,))),
                           loss=lambda model, b: F.cross_entropy(model(b[0]), b[1]))
"""


def _raising_job(tmp_path: Path, after: int = -1) -> tuple[str, str]:
    """The job's path, and where its forward raises as the one line must say it ("folder/picky.py:N in forward")."""
    source = textwrap.dedent(FORWARD_RAISES.format(after=after))
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "raise ValueError" in text)
    return _write(tmp_path, "picky.py", source), f"{tmp_path.name}/picky.py:{line} in forward"


@pytest.mark.parametrize("command", [["estimate", "--micro-batch", "2"], ["plan", "--global-batch", "4"]])
def test_an_error_in_the_users_model_says_where_it_was_raised(capfd, tmp_path, command):
    """The estimate traces in a forked child: the place crosses back with the error."""
    path, where = _raising_job(tmp_path)
    _assert_one_line_error(*_run(capfd, command[0], f"{path}:workload", *command[1:]),
                           f"raised: ValueError: expected 5 features, got 8 ({where})")


def test_an_error_in_the_users_model_during_training_says_where_and_which_checkpoint_is_intact(capfd, tmp_path):
    path, where = _raising_job(tmp_path, after=2)  # the third real forward: step 2's
    code, out, err = _run(capfd, "train", f"{path}:workload", "--steps", "4", "--global-batch", "2", "--micro-batch",
                          "2", "--checkpoint-every", "1", "--no-progress", "--out", str(tmp_path / "run"))
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [f"memfit: error: step 2: the workload's training step raised: ValueError: "
                                        f"expected 5 features, got 8 ({where}); the checkpoint of step 2 is intact"]


def test_options_and_seq_reach_a_workload_function_as_keyword_arguments(capfd, tmp_path):
    path = _write(tmp_path, "sized.py", """
        import torch
        import torch.nn.functional as F
        import memfit

        def workload(width=4, lr=1e-3, seq=None):
            return memfit.Workload(model=lambda: torch.nn.Linear(width, 2),
                                   batch=lambda n: (torch.randn(n, width), torch.randint(0, 2, (n,))),
                                   loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                                   name=f"width={width!r} lr={lr!r} seq={seq!r}")
        """)
    code, out, err = _run(capfd, "estimate", f"{path}:workload", "-o", "width=8", "-o", "lr=3e-4", "--seq", "16",
                          "--json")
    assert code == 0, err
    assert json.loads(out)["workload"] == "width=8 lr=0.0003 seq=16"  # a number, not the text "3e-4"
    _assert_one_line_error(*_run(capfd, "estimate", f"{path}:workload", "-o", "depth=2"),
                           "unexpected keyword argument 'depth'; its keyword arguments: width, lr, seq")


def test_unknown_builtin(capfd):
    _assert_one_line_error(*_run(capfd, "estimate", "no-such-model"), "unknown workload")
    _assert_one_line_error(*_run(capfd, "summary", "gpt-huge"), "unknown workload")


def test_unknown_builtin_option(capfd):
    _assert_one_line_error(*_run(capfd, "estimate", "gpt-tiny", "-o", "sqe=4"), "sqe")
    _assert_one_line_error(*_run(capfd, "estimate", "gpt-tiny", "-o", "seq"), "key=value")


@pytest.mark.parametrize("config, fragment", [
    ('{"micro_batch": 4', ""),                   # not JSON
    ('{"micro_batch": 0}', "micro_batch"),        # a size out of range
    ('{"micro_batch": "four"}', "micro_batch"),   # a size of the wrong type
    ('{"micro_batchez": 4}', "micro_batchez"),    # an unknown field
    ('{"precision": "fp8"}', "precision"),
])
def test_bad_config(capfd, config, fragment):
    _assert_one_line_error(*_run(capfd, "estimate", "mlp-tiny", "--config", config), fragment)


def test_config_file_missing(capfd, tmp_path):
    _assert_one_line_error(*_run(capfd, "estimate", "mlp-tiny", "--config", str(tmp_path / "none.json")),
                           "none.json")


def test_config_from_file(capfd, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"micro_batch": 3}))
    code, out, err = _run(capfd, "estimate", "mlp-tiny", "--config", str(path), "--json")
    assert code == 0, err
    assert json.loads(out)["config"]["micro_batch"] == 3


def test_debug_shows_the_traceback(capfd, tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(memfit.errors.WorkloadError, match="no such workload file"):
        main(["--debug", "estimate", f"{missing}:workload"])
    with pytest.raises(memfit.errors.ConfigError, match="unknown device"):
        main(["--debug", "estimate", "mlp-tiny", "--device", "h1000"])


@pytest.mark.parametrize("command", [["estimate", "mlp-tiny"], ["summary", "mlp-tiny"], ["train", "mlp-tiny"],
                                     ["plan", "mlp-tiny", "--global-batch", "4"], ["list"], ["calibrate"]])
def test_debug_is_read_anywhere_on_the_line(command, capfd):
    """`memfit plan ... --debug` as well as `memfit --debug plan ...`: the flag reaches main, and without it the
    same error is one line and exit 2."""
    if command[0] in ("list", "calibrate"):  # nothing of theirs fails on bad input: the flag must parse
        from memfit.cli import build_parser
        assert build_parser().parse_args([*command, "--debug"]).debug is True
        assert build_parser().parse_args(["--debug", *command]).debug is True
        assert build_parser().parse_args(command).debug is False
        return
    bad = [*command, "--micro-batch", "0"]  # refused before anything is traced or written
    with pytest.raises(memfit.errors.ConfigError, match="micro-batch must be"):
        main([*bad, "--debug"])
    capfd.readouterr()
    assert main(bad) == 2
    err = capfd.readouterr().err
    assert re.fullmatch(r"memfit: error: -*micro-batch must be .*0\n", err), err


# ------------------------------------------------------------------------------------------ console script


def test_console_script_estimate_json(tmp_path):
    r = _subprocess("estimate", "mlp-tiny", "--micro-batch", "4", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["peak_bytes"] > 0 and sum(d["breakdown"].values()) == d["peak_bytes"]


def test_console_script_error_is_one_line_on_the_real_stderr(tmp_path):
    """In a fresh process, so that anything PyTorch logs straight to fd 2 (e.g. fake-tensor kernel
    failures, logged with their traceback before they are raised) is caught too."""
    path = _write(tmp_path, "loss_raises.py", LOSS_RAISES)
    r = _subprocess("estimate", f"{path}:workload", "--micro-batch", "2", cwd=tmp_path)
    _assert_one_line_error(r.returncode, r.stdout, r.stderr, "raised")


# ------------------------------------------------------------------------------------------ version, list, help


def test_version_is_the_installed_package_version(tmp_path):
    import importlib.metadata
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert memfit.__version__ == importlib.metadata.version("memfit") == pyproject["project"]["version"]
    r = _subprocess("--version", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"memfit {memfit.__version__}"


def test_every_option_of_every_command_has_help():
    import argparse

    from memfit.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert {"estimate", "summary", "plan", "train", "calibrate", "list"} <= set(commands)
    missing = [f"{name} {'/'.join(a.option_strings) or a.dest}" for name, p in [("memfit", parser), *commands.items()]
               for a in p._actions if not isinstance(a, argparse._SubParsersAction) and not (a.help or "").strip()]
    assert not missing, f"options without help: {missing}"


def test_train_help_says_what_the_schedule_does_and_the_checkpoint_defaults():
    import argparse

    from memfit.cli import build_parser

    parser = build_parser()
    train = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    text = " ".join(train.format_help().split())
    assert "--schedule {cosine,onecycle,constant} learning-rate schedule, which changes the optimizer's own rate. " \
           "cosine (the default): linear warm-up over the first 5% of steps to the optimizer's rate, then down to " \
           "10% of it at the end" in text
    assert re.search(r"--checkpoint-every N save a checkpoint every N steps, [^()]*\(default: 100\)", text)
    assert re.search(r"--keep-checkpoints N checkpoints the run folder keeps, the newest N[^()]*\(default: 2\)", text)


def test_list_shows_the_builtin_workloads_and_the_gpu_catalogue(capfd):
    from memfit.memory.devices import DEVICES, get_device
    from memfit.workloads import BUILTIN_NAMES

    code, out, err = _run(capfd, "list", "--json")
    assert code == 0, err
    listing = json.loads(out)
    workloads = {w["name"]: w for w in listing["workloads"]}
    assert set(BUILTIN_NAMES) - {"hf:<model_type|config.json>"} <= set(workloads)
    assert workloads["gpt-tiny"]["parameters"] == GPT_TINY_PARAMETERS
    assert workloads["sort"]["parameters"] == 2 * 11 * 128 + 2 * (4 * 128**2 + 3 * 128 * 512 + 2 * 128) + 128
    assert workloads["mlp-tiny"]["parameters"] == (32 * 64 + 64) + (64 * 64 + 64) + (64 * 10 + 10)
    assert workloads["gpt-7b"]["parameters"] == 6_738_415_616  # Llama-2-7B
    assert "3×224×224" in workloads["resnet"]["sample"] and "4097" in workloads["gpt-7b"]["sample"]
    if importlib.util.find_spec("transformers"):
        # hf:gpt2 is a toy, and says so: GPT-2 small has 124M parameters
        assert "toy" in workloads["hf:gpt2"]["model"] and workloads["hf:gpt2"]["parameters"] < 1_000_000
    devices = {d["name"]: d for d in listing["devices"]}
    assert set(devices) == set(DEVICES)
    for name, d in devices.items():
        assert d["memory_bytes"] == DEVICES[name].memory_bytes and d["bf16"] == DEVICES[name].bf16
        assert all(get_device(alias) is DEVICES[name] for alias in d["aliases"])
    assert devices["a100-80gb"]["aliases"] == ["a100"] and devices["t4"]["bf16"] is False

    code, out, err = _run(capfd, "list")
    assert code == 0, err
    for word in ["gpt-tiny", "hf:gpt2", "toy", "h100", "79.1 GiB", "a100-80gb", "a100"]:
        assert word in out, word


# ------------------------------------------------------------------------------------------ numbers as printed


def test_sizes_print_in_binary_units_without_exponents():
    assert fmt_bytes(0) == "0 B" and fmt_bytes(999) == "999 B"
    assert fmt_bytes(1.5 * 2**30) == "1.5 GiB" and fmt_bytes(-1.5 * 2**30) == "-1.5 GiB"
    assert fmt_bytes(1000 * 2**20) == "0.977 GiB"    # was "1e+03 MiB"
    assert fmt_bytes(1.32e3 * 2**40) == "1.29 PiB"   # was "1.32e+03 TiB"
    assert fmt_bytes(3 * 2**60) == "3 EiB" and fmt_bytes(5000 * 2**60) == "5,000 EiB"
    for exponent in range(0, 70):
        assert "e" not in fmt_bytes(1.7 * 2**exponent).split()[0], exponent


def test_rates_print_with_three_figures_grouped_not_in_scientific_notation():
    assert fmt_number(2.62e5) == "262,000"           # was "2.62e+05 samples/s"
    assert fmt_number(262144) == "262,000" and fmt_number(1234.5) == "1,230"
    assert fmt_number(56.78) == "56.8" and fmt_number(1.0) == "1" and fmt_number(0.5) == "0.5"
    assert fmt_number(999.7) == "1,000" and fmt_number(1.23e-5) == "0.0000123" and fmt_number(0) == "0"
    for exponent in range(-8, 20):
        assert "e" not in fmt_number(3.21 * 10**exponent), exponent


def test_an_estimate_that_raises_in_the_default_precision_says_so_and_how_to_choose(tmp_path, capsys):
    """FNet-style token mixing (an FFT: no bf16 kernel, on CUDA neither) in the bf16 a GPU defaults to: the
    one line names the precision memfit chose and the flag that estimates it in fp32."""
    job = tmp_path / "fourier.py"
    job.write_text("from models import fourier as workload\n")  # tests/models.py
    assert main(["estimate", f"{job}:workload", "--device", "h100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "BFloat16" in err[0] and "(in bf16, the default on h100; --precision fp32" in err[0]
    assert main(["estimate", f"{job}:workload", "--device", "h100", "--precision", "fp32"]) == 0


def test_importing_memfit_leaves_torch_distributed_tensor_unloaded():
    """Every `memfit` command imports memfit; torch.distributed.tensor alone costs it half a second (1.05 ->
    1.55 s here when the 8-bit optimizer imported DTensor at the top), so it is loaded only where it is used."""
    code = "import sys, memfit; print('torch.distributed.tensor' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
