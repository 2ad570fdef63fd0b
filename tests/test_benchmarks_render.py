"""BENCHMARKS.md is what benchmarks/render.py makes of benchmarks/report/ and benchmarks/results/, and it is
written for users: no internal milestone names, and every section says its command, machine and date."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "BENCHMARKS.md"


def _render():
    spec = importlib.util.spec_from_file_location("bench_render", ROOT / "benchmarks" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_md_is_what_rendering_gives():
    assert BENCHMARKS.read_text() == _render().render(), (
        "BENCHMARKS.md differs from benchmarks/report/ + benchmarks/results/: run `make bench-render`")


def test_check_mode_names_a_differing_section(tmp_path, monkeypatch, capsys):
    render = _render()
    stale = tmp_path / "BENCHMARKS.md"
    stale.write_text(BENCHMARKS.read_text().replace("Every point is 64 bytes over", "Every point is 60 bytes over"))
    monkeypatch.setattr(render, "OUTPUT", stale)
    assert render.main(["--check"]) == 1
    assert "report/32_infer.md" in capsys.readouterr().out
    stale.write_text(BENCHMARKS.read_text())
    assert render.main(["--check"]) == 0


MILESTONES = re.compile(r"(?i)\bstops? \d+|\bissues? \d+|\bsessions?\b|\bmilestones?\b|\bstop-\d+"
                        r"|^(january|february|march|april|may|june|july|august|september|october|november"
                        r"|december) \d+", re.M)


def test_no_milestone_names():
    text = BENCHMARKS.read_text()
    found = sorted({m.group(0) for m in MILESTONES.finditer(text)})
    assert not found, f"BENCHMARKS.md names internal milestones: {found}"


def test_every_section_names_its_command_machine_and_date():
    text = BENCHMARKS.read_text()
    sections = re.split(r"^(?=##+ )", text, flags=re.M)[1:]
    for section in sections:
        heading = section.splitlines()[0]
        if heading == "## Contents":
            continue
        head = " ".join(section.splitlines()[1:5])
        assert "**Command:**" in head and "**machine:**" in head, f"{heading}: no command or machine under it"
        assert re.search(r"\*\*date:\*\* 20\d\d-\d\d-\d\d", head), f"{heading}: no date under it"
        if re.search(r"^\|---", section, flags=re.M) and "benchmarks/" in heading:
            script = re.search(r"`benchmarks/(\w+\.py)", heading).group(1)
            assert script in head, f"{heading}: the command does not name {script}"
