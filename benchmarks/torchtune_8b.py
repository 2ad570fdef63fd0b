"""torchtune's single-GPU full fine-tune of Llama 3.1 8B on an RTX 4090, as memfit plans and estimates it.

    python benchmarks/torchtune_8b.py [--out benchmarks/results/torchtune_8b.json]   # about 10 minutes on 2 cores

torchtune's recipe (recipes/configs/llama3_1/8B_full_single_device.yaml): bf16 weights, gradients and states
(no fp32 master copy: memfit's bf16-pure), the optimizer step in backward, activation checkpointing of every
layer, a chunked cross-entropy (LinearCrossEntropyLoss, 8 chunks) and bitsandbytes' PagedAdamW8bit; batch 2
and no accumulation. Its README gives 18.9 GiB peak per GPU at batch 2 on a dataset packed to 2048 tokens,
torch.compile on. The model is transformers' LlamaForCausalLM from Llama 3.1 8B's config values (no download).

Three questions, each answered by memfit's own code:
1. `plan` with --host-memory 64GiB and only the techniques that keep the math: what the refusal says.
2. `plan` with --allow paged-optim: what it chooses, its peak and host memory.
3. `estimate` of torchtune's recipe: its peaks against the published 18.9 GiB.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if (HERE.parent / "src" / "memfit").is_dir():
    sys.path.insert(0, str(HERE.parent / "src"))

import memfit  # noqa: E402
from memfit import Config  # noqa: E402
from fit_8b import LLAMA3_8B, _workload  # noqa: E402

PUBLISHED = 18.9 * 2**30  # torchtune README, "Memory and training speed": Llama 3.1 8B, full finetune, 1x 4090
RECIPE = Config(micro_batch=2, precision="bf16-pure", activation_checkpoint="all", optimizer_in_backward=True,
                loss_chunks=8, optimizer_8bit=True, paged_optimizer=True)
LIMITS = dict(device="rtx-4090", host_memory="64GiB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results" / "torchtune_8b.json"))
    args = ap.parse_args()
    out: dict = dict(date=time.strftime("%Y-%m-%d"), published_bytes=PUBLISHED, recipe=RECIPE.to_dict())
    with tempfile.TemporaryDirectory() as tmp:
        wl = _workload(LLAMA3_8B, 2048, tmp)
        t0 = time.perf_counter()
        e = memfit.estimate(wl, RECIPE, device="rtx-4090")
        out["estimate"] = dict(seconds=round(time.perf_counter() - t0, 1), live_bytes=e.peak_bytes,
                               allocated_bytes=e.peak_allocated_bytes, reserved_bytes=e.peak_reserved_bytes,
                               device_bytes=e.device_peak_bytes, host_bytes=e.host_peak_bytes, phase=e.peak_phase,
                               breakdown={k.value: v for k, v in e.breakdown.items()})
        print(json.dumps(out["estimate"]), flush=True)
        for label, allow in (("keeps the math", ()), ("--allow paged-optim", ("paged-optim",))):
            t0 = time.perf_counter()
            try:
                p = memfit.plan(wl, 2, allow=allow, **LIMITS)
                row = dict(config=p.config.to_dict(), described=p.config.describe(), peak_bytes=p.peak_bytes,
                           host_bytes=p.estimate.host_peak_bytes, families=p.families, notes=p.notes)
            except memfit.MemfitError as err:
                row = dict(error=str(err))
            row.update(label=label, seconds=round(time.perf_counter() - t0, 1))
            out.setdefault("plans", []).append(row)
            print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
