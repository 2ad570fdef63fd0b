"""A full fine-tune of a Llama-3-8B-shaped model on one RTX 4090 (issue 14): what `memfit plan` chooses, and
the chosen configuration's estimate against the PyTorch profiler on scaled-down copies on this CPU.

    python benchmarks/fit_8b.py [--out benchmarks/results/fit_8b.json]     # about 3 minutes on 2 cores

The model is transformers' LlamaForCausalLM built from Llama-3-8B's config.json values (no download): 32
layers, hidden 4096, ffn 14336, 32 heads, 8 KV heads, vocab 128256; seq 2048, global batch 32. The copies keep
the configuration and the architecture but shrink what the host cannot hold: layers, widths and vocabulary.
On a CPU device host and device memory are one, so the copy's estimate counts the offloaded master weights
and optimizer state too, and so does the profiler.
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
from memfit.planner.search import plan  # noqa: E402
from memfit.workloads import load_workload  # noqa: E402
from truth import real_step_peak  # noqa: E402

LLAMA3_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                 rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
COPIES = [  # (name, changes to the config, seq)
    ("2 layers, hidden 1024, ffn 3584, vocab 32000", dict(num_hidden_layers=2, hidden_size=1024,
                                                           intermediate_size=3584, num_attention_heads=8,
                                                           num_key_value_heads=2, vocab_size=32000), 512),
    ("2 layers, hidden 2048, ffn 7168, vocab 32000", dict(num_hidden_layers=2, hidden_size=2048,
                                                           intermediate_size=7168, num_attention_heads=16,
                                                           num_key_value_heads=4, vocab_size=32000), 1024),
]


def _workload(config: dict, seq: int, folder: str):
    path = Path(folder) / f"config-{len(list(Path(folder).iterdir()))}.json"
    path.write_text(json.dumps(config))
    return load_workload(f"hf:{path}", seq=seq)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results" / "fit_8b.json"))
    args = ap.parse_args()
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        chosen = plan(_workload(LLAMA3_8B, 2048, tmp), 32, device="rtx-4090")
        out["plan"] = dict(config=chosen.config.to_dict(), described=chosen.config.describe(),
                           peak_bytes=chosen.peak_bytes, device_peak_bytes=chosen.estimate.device_peak_bytes,
                           budget_bytes=chosen.budget_bytes, step_seconds=chosen.step_seconds,
                           families=chosen.families, notes=chosen.notes, seconds=round(time.perf_counter() - t0, 1))
        print(f"plan: {chosen.config.describe()}, device peak {chosen.estimate.device_peak_bytes / 2**30:.2f} GiB "
              f"of {chosen.budget_bytes / 2**30:.2f}, {chosen.step_seconds:.1f} s a step "
              f"({out['plan']['seconds']} s to plan)", flush=True)
        config = chosen.config.replace(micro_batch=1, grad_accum=2)
        out["copies"] = []
        for name, changes, seq in COPIES:
            wl = _workload({**LLAMA3_8B, **changes}, seq, tmp)
            est = memfit.estimate(wl, config, device="cpu")
            measured = real_step_peak(wl, config)
            err = (est.peak_bytes - measured) / measured
            out["copies"].append(dict(copy=name, seq=seq, config=config.to_dict(), estimate=est.peak_bytes,
                                      profiler=measured, error=err))
            print(f"{name}, seq {seq}, {config.describe()}: estimate {est.peak_bytes / 2**20:.1f} MiB, profiler "
                  f"{measured / 2**20:.1f} MiB ({100 * err:+.2f}%)", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
