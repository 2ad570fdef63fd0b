"""Issue 11 (items 6 and 7): CPU estimate vs the profiler for convolution models (U-Net, ConvNeXt-style) and
for selective activation checkpointing on transformers' Llama, Qwen2 and GPT-2 as a user builds them
(library defaults: KV cache on).

    nice -n 10 .venv/bin/python benchmarks/conv_and_selective.py [--out benchmarks/results/conv_and_selective.json]

Each row: the estimate (fake trace), the profiler's peak of a real step (benchmarks/truth.py: warm-up, then
the smaller of two profiled steps) and the error, or what raised. Run it once per code version to compare
(the "before" figures in BENCHMARKS.md are this script run against the tree before the change).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import memfit  # noqa: E402
import models  # noqa: E402
from truth import real_step_peak  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)
TINY_GPT2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0, eos_token_id=0)


def user_built(model_type: str, seq: int = 64) -> memfit.Workload:
    """A transformers causal LM with the library's defaults (the same as tests/test_checkpoint_hf.py)."""
    import transformers

    cfg = transformers.AutoConfig.for_model(model_type, **(TINY_GPT2 if model_type == "gpt2" else TINY))

    def batch(n):
        ids = torch.randint(0, cfg.vocab_size, (n, seq))
        return {"input_ids": ids, "labels": ids}

    return memfit.Workload(model=lambda: transformers.AutoModelForCausalLM.from_config(cfg), batch=batch,
                           loss=lambda m, b: m(**b).loss, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                           name=model_type)


def row(name: str, wl: memfit.Workload, cfg: memfit.Config) -> dict:
    out = dict(model=name, config=cfg.describe())
    t0 = time.perf_counter()
    try:
        est = memfit.estimate(wl, cfg)
    except Exception as e:  # noqa: BLE001 - the row records what raised
        return dict(out, error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    out.update(estimate=est.peak_bytes, method=est.method, estimate_seconds=round(time.perf_counter() - t0, 1))
    try:
        real = real_step_peak(wl, cfg)
    except Exception as e:  # noqa: BLE001
        return dict(out, error=f"real step: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
    return dict(out, profiler=real, error_pct=round(100 * (est.peak_bytes - real) / real, 3))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "conv_and_selective.json"))
    args = ap.parse_args()
    rows = []
    for name, make in (("unet", models.unet), ("convnext", models.convnext)):
        for precision in ("fp32", "bf16"):
            for micro_batch in (4, 8):
                rows.append(row(name, make(), memfit.Config(micro_batch=micro_batch, precision=precision)))
                print(rows[-1], flush=True)
    for model_type in ("llama", "qwen2", "gpt2"):
        for precision in ("fp32", "bf16"):
            cfg = memfit.Config(micro_batch=4, precision=precision, activation_checkpoint="selective")
            rows.append(row(model_type, user_built(model_type), cfg))
            print(rows[-1], flush=True)
    result = dict(torch=torch.__version__, threads=torch.get_num_threads(), rows=rows)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
