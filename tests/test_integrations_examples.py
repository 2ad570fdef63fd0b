"""The integration examples the guide quotes (docs/integrations.md) run as shipped, each in its own
interpreter, and print the split of the global batch they were given."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name,needs,printed", [
    ("own_loop.py", None, r"micro-batch (\d+) x (\d+) accumulated"),
    ("lightning_fit.py", "lightning", r"(\d+) x (\d+): predicted peak"),
    ("hf_trainer.py", "transformers", r"(\d+) x (\d+), checkpointing"),
])
def test_example_runs_and_keeps_its_global_batch(name, needs, printed, tmp_path):
    if needs:
        pytest.importorskip(needs)
    run = subprocess.run([sys.executable, str(EXAMPLES / name)], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    micro, accum = map(int, re.search(printed, run.stdout).groups())
    assert micro * accum == {"hf_trainer.py": 32}.get(name, 512)
