"""The README and the user guide (docs/) hold together: the CLI reference is the parser's, every page is in
the site's nav and builds with `mkdocs build --strict`, every relative link names a file that exists, the
README stays a front door, and no heading is named after an issue, a date or a work milestone.

That every command and example in them runs is tests/test_readme.py's.
"""
from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))


def _gen_cli():
    spec = importlib.util.spec_from_file_location("gen_cli", DOCS / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_what_the_parser_gives():
    assert (DOCS / "cli.md").read_text() == _gen_cli().render(), (
        "docs/cli.md differs from memfit's argument parser: run `python docs/gen_cli.py`")


def test_cli_reference_has_every_subcommand():
    from memfit.cli import build_parser

    text = (DOCS / "cli.md").read_text()
    for name in _gen_cli()._subcommands(build_parser()):
        assert f"\n## memfit {name}\n" in text


def test_every_page_is_in_the_nav_and_the_readme_links_each():
    nav = re.findall(r"^\s*-\s*[^:\n]+:\s*(\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert sorted(nav) == sorted(p.name for p in PAGES)
    readme = (ROOT / "README.md").read_text()
    for page in PAGES:
        if page.name != "index.md":
            assert f"](docs/{page.name})" in readme, f"the README does not link docs/{page.name}"


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into a guide page"


@pytest.mark.parametrize("doc", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_relative_links_name_files_that_exist(doc):
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#")[0]
        assert (doc.parent / path).exists(), f"{doc.name} links {target}, which does not exist"


@pytest.mark.parametrize("doc", [ROOT / "README.md", *PAGES], ids=lambda p: p.name)
def test_headings_say_what_they_measure_or_do(doc):
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#+ .*$", text, flags=re.M):
        assert not re.search(r"(?i)\b(issue|stop|milestone)s? \d+|\b(19|20)\d\d\b|\b(january|february|march|"
                             r"april|may|june|july|august|september|october|november|december)\b", heading), (
            f"{doc.name}: heading named after an issue, a date or a milestone: {heading}")
    assert not re.search(r"(?i)\((issue|stop) \d+\)", text), f"{doc.name} names an issue or a stop"


def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]' installs it)")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                          "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "site" / "cli" / "index.html").is_file()
