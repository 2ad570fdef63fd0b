"""A run that changes world size and layout at each resume continues the one-process loss curve: gpt-tiny,
global batch 16, two steps on 4 ranks (fsdp), two more resumed on 2 ranks (ddp), two more on one process,
against six steps in one process (about a minute on 2 cores: too slow for the test suite).

    python benchmarks/resume_across_worlds.py
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

from memfit.cli import main

COMMON = ["gpt-tiny", "--global-batch", "16", "--micro-batch", "4", "--schedule", "constant", "--no-progress"]


def losses(out: Path) -> list[tuple[int, float, int]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], len(r.get("rank_peak_bytes", [0]))) for r in rows if "loss" in r]


def run() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out, one = Path(tmp) / "worlds", Path(tmp) / "one"
        for extra in (["--gpus", "4", "--steps", "2"],
                      ["--gpus", "2", "--data-parallel", "ddp", "--steps", "4", "--resume"],
                      ["--steps", "6", "--resume"]):
            assert main(["train", *COMMON, *extra, "--checkpoint-every", "2", "--out", str(out)]) == 0
        assert main(["train", *COMMON, "--steps", "6", "--out", str(one)]) == 0
        worlds, single = losses(out), losses(one)
    print("step  ranks  loss (4 -> 2 -> 1)  loss (one process)")
    for (step, loss, ranks), (_, ref, _) in zip(worlds, single):
        print(f"{step:>4}  {ranks:>5}  {loss:.9f}        {ref:.9f}")
    print(f"largest relative difference: {max(abs(a[1] - b[1]) / abs(b[1]) for a, b in zip(worlds, single)):.2e}")


if __name__ == "__main__":
    run()
