"""Every example in the README and in the user guide (docs/*.md) runs as written.

The commands of every ```bash block -- each guide page's in the order of mkdocs.yml's nav, then the
README's -- are run line by line, in that order (a `--resume` follows the run it resumes), each once: a
command the README and a page share (the README's tour repeats the guide's) runs where it first appears. They run in
a fresh folder holding a copy of `examples/` and `tests/data/hf_configs/` (the configs `memfit infer`'s
examples read) -- what a user typing them from the repository root has --
with a calibration cache (MEMFIT_CACHE) holding only the calibration stored with the tests (conftest.py), as the
rest of the suite plans with: a fresh one made every planning command calibrate first, and on a busy machine,
whose calibrations are refused and not kept, every one after it again. `memfit calibrate` itself measures for
real, into a fresh cache of its own. Each line goes, split as a shell splits
it, to the function the installed `memfit` script calls (`memfit.cli.main`), in this process: a fresh
interpreter per line cost ~1.6 s each (importing torch) and tests nothing of the docs' (test_cli runs the
installed script itself). The README's set-up lines (`make demo`, `make test`) are not run here (one
installs and trains, the other is the whole suite): each is checked to be a target of the Makefile.

Each Python block is run in its own interpreter, once however many pages show it. A block opening with
`# from <path>` shows part of a shipped file: it is checked to be a verbatim excerpt of that file instead
of being run.

Convention for lines that need hardware: a bash line ending in the comment `# needs a GPU` is run only where
torch sees a CUDA device and skipped elsewhere, and any line naming `--device cuda` must carry that marker.

Each command's wall time is recorded (printed, and as a junit property), never asserted: time depends on
the machine. On the 2-core CPU the README speaks of, every command takes well under two minutes.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from memfit.cli import main

ROOT = Path(__file__).resolve().parents[1]
GPU_MARKER = "# needs a GPU"


def guide_pages() -> list[Path]:
    """docs/*.md in the order of mkdocs.yml's nav, then any page the nav does not name (test_docs fails
    on those)."""
    named = re.findall(r"^\s*-\s*[^:\n]+:\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    pages = [ROOT / "docs" / name for name in named]
    return pages + sorted(set((ROOT / "docs").glob("*.md")) - set(pages))


def documents() -> list[Path]:
    return [*guide_pages(), ROOT / "README.md"]


def blocks(language: str) -> list[str]:
    """Every block of `language` in the README and the guide, in order, each distinct block once."""
    found = [b for doc in documents()
             for b in re.findall(rf"^```{language}\n(.*?)^```", doc.read_text(), flags=re.S | re.M)]
    return list(dict.fromkeys(found))


def shell_lines() -> list[str]:
    lines = [line.strip() for block in blocks("bash") for line in block.splitlines()
             if line.strip() and not line.strip().startswith("#")]
    return list(dict.fromkeys(lines))


def bash_lines() -> list[str]:
    """The memfit commands, each once: two lines that differ only in their comment are one command."""
    commands = {}
    for line in shell_lines():
        if not line.startswith("make "):
            commands.setdefault(tuple(shlex.split(line, comments=True)), line)
    return list(commands.values())


def _memfit_bin() -> Path:
    """The folder of the installed `memfit` script: the one next to this interpreter."""
    script = Path(sys.executable).parent / "memfit"
    assert script.is_file(), f"memfit is not installed next to {sys.executable}"
    return script.parent


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A fresh folder with the repository's examples/ and a cache holding the suite's stored calibration,
    shared by the commands in order, as one user session."""
    root = tmp_path_factory.mktemp("readme")
    (root / "cache").mkdir()
    for profile in Path(os.environ["MEMFIT_CACHE"]).glob("profile-*"):
        shutil.copy(profile, root / "cache")
    shutil.copytree(ROOT / "examples", root / "examples")
    shutil.copytree(ROOT / "tests" / "data" / "hf_configs", root / "tests" / "data" / "hf_configs")
    env = dict(os.environ, MEMFIT_CACHE=str(root / "cache"), COLUMNS="120",
               PATH=f"{_memfit_bin()}{os.pathsep}{os.environ.get('PATH', '')}")
    return root, env


def _run(argv: list[str], cwd: Path, env: dict, record_property, label: str) -> subprocess.CompletedProcess:
    start = time.perf_counter()
    result = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    record_property("seconds", round(seconds, 1))
    print(f"{seconds:6.1f} s  {line_label(label)}")
    return result


def line_label(text: str) -> str:
    return text if len(text) < 100 else text[:97] + "..."


def test_the_docs_have_runnable_examples():
    lines = bash_lines()
    assert len(lines) >= 8 and any(line.startswith("memfit train") for line in lines)
    assert blocks("python"), "no Python example in the README or the guide"
    for line in lines:
        assert line.startswith("memfit "), f"not a memfit command: {line}"
        if "--device cuda" in line:
            assert line.endswith(GPU_MARKER), f"needs a GPU but is not marked {GPU_MARKER!r}: {line}"


def test_the_set_up_lines_are_makefile_targets():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    makes = [shlex.split(line, comments=True) for line in shell_lines() if line.startswith("make ")]
    assert ["make", "demo"] in makes and ["make", "test"] in makes, "the README's set-up lines are gone"
    for argv in makes:
        assert len(argv) == 2 and argv[1] in targets, f"{' '.join(argv)}: no such target in the Makefile"


@pytest.mark.parametrize("line", bash_lines(), ids=lambda line: line_label(line.split("#")[0].strip()))
def test_readme_command(line, workdir, record_property, monkeypatch, capfd):
    if line.endswith(GPU_MARKER) and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    root, env = workdir
    program, *argv = shlex.split(line, comments=True)
    assert program == "memfit"
    monkeypatch.chdir(root)
    for name in ("MEMFIT_CACHE", "COLUMNS"):
        monkeypatch.setenv(name, env[name])
    cache = root / "cache"
    if line.startswith("memfit calibrate"):  # measured for real, on its own
        cache = root / "calibrate-cache"
        monkeypatch.setenv("MEMFIT_CACHE", str(cache))
    profiles = lambda: {p: p.stat().st_mtime_ns for p in cache.glob("profile-*")}  # noqa: E731
    before = profiles()
    capfd.readouterr()
    start = time.perf_counter()
    code = main(argv)
    seconds = time.perf_counter() - start
    record_property("seconds", round(seconds, 1))
    out, err = capfd.readouterr()
    if line.startswith("memfit calibrate") and code == 2 and "calibration rejected" in err:
        # its documented answer on a busy machine (a shared CI box has bursts): nothing is saved
        assert profiles() == before, "a rejected calibration was saved"
        pytest.skip(f"the machine was too noisy to calibrate: {err.strip()}")
    print(f"{seconds:6.1f} s  {line_label(line)}")
    assert code == 0, f"{line}\nexit {code}\nstdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}"


@pytest.mark.parametrize("index", range(len(blocks("python"))))
def test_readme_python(index, workdir, record_property):
    source = blocks("python")[index]
    first = source.splitlines()[0]
    if first.startswith("# from "):
        shipped = (ROOT / first.removeprefix("# from ").strip()).read_text()
        excerpt = source.split("\n", 1)[1]
        assert excerpt in shipped, f"the excerpt is not verbatim in {first[7:]}"
        return
    root, env = workdir
    r = _run([sys.executable, "-c", source], root, env, record_property, f"python block {index}")
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
