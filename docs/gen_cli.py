"""Writes docs/cli.md, the CLI reference, from memfit's argument parser (`memfit.cli.build_parser()`).

Run `python docs/gen_cli.py` after changing an option; tests/test_docs.py fails while docs/cli.md differs
from what the parser gives, so the reference cannot drift from the command.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

CLI_MD = Path(__file__).resolve().parent / "cli.md"
WIDTH = 100  # argparse wraps help to the terminal's width: fix it, so the page is the same on every machine


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def render() -> str:
    from memfit.cli import build_parser

    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH + 2)
    try:
        parser = build_parser()
        parts = ["# CLI reference", "",
                 "Every `memfit` command and option, as `memfit <command> --help` prints them. This page is "
                 "generated from the argument parser by `docs/gen_cli.py`; do not edit it by hand.", "",
                 "## memfit", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, sub in _subcommands(parser).items():
            parts += [f"## memfit {name}", "", "```text", sub.format_help().rstrip(), "```", ""]
    finally:
        if saved is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved
    return "\n".join(parts)


if __name__ == "__main__":
    CLI_MD.write_text(render())
    print(f"wrote {CLI_MD}", file=sys.stderr)
