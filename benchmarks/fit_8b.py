"""Fine-tuning a Llama-3-8B-shaped model on one RTX 4090 (issue 14): what `memfit plan` chooses when only
techniques that keep the math may be used, with 8-bit optimizer states allowed (on a host with 96 GiB), and
with LoRA allowed; each chosen configuration's estimate against the PyTorch profiler on scaled-down copies on
this CPU.

    python benchmarks/fit_8b.py [--out benchmarks/results/fit_8b.json]     # about 12 minutes on 2 cores

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
from memfit.planner.search import LORA, plan  # noqa: E402
from memfit.workloads import load_workload  # noqa: E402
from memfit.workloads.lora import lora  # noqa: E402
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


PLANS = [  # what the user allows: nothing that changes the math; 8-bit states on a host of 96 GiB; LoRA
    ("keeps the math", {}),
    ("--allow 8bit-optim --host-memory 96GiB", dict(allow=["8bit-optim"], host_memory="96GiB")),
    ("--allow lora", dict(allow=["lora"])),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results" / "fit_8b.json"))
    args = ap.parse_args()
    out: dict = {"plans": []}
    with tempfile.TemporaryDirectory() as tmp:
        for label, options in PLANS:
            t0 = time.perf_counter()
            try:
                chosen = plan(_workload(LLAMA3_8B, 2048, tmp), 32, device="rtx-4090", **options)
            except memfit.MemfitError as e:
                out["plans"].append(dict(label=label, error=str(e)))
                print(f"{label}: {e}", flush=True)
                continue
            est = chosen.estimate
            row = dict(label=label, workload=est.workload, config=chosen.config.to_dict(),
                       described=chosen.config.describe(), peak_bytes=chosen.peak_bytes,
                       device_peak_bytes=est.device_peak_bytes, host_peak_bytes=est.host_peak_bytes,
                       budget_bytes=chosen.budget_bytes, step_seconds=chosen.step_seconds, families=chosen.families,
                       notes=chosen.notes, seconds=round(time.perf_counter() - t0, 1), copies=[])
            out["plans"].append(row)
            print(f"{label}: {chosen.config.describe()}{' with LoRA' if '+lora' in est.workload else ''}, device "
                  f"peak {est.device_peak_bytes / 2**30:.2f} GiB of {chosen.budget_bytes / 2**30:.2f}, host "
                  f"{(est.host_peak_bytes or 0) / 2**30:.0f} GiB, {chosen.step_seconds:.1f} s a step "
                  f"({row['seconds']} s to plan)", flush=True)
            # at 1 x 2 to exercise accumulation, where the configuration allows it
            config = chosen.config.replace(micro_batch=1, grad_accum=1 if chosen.config.optimizer_in_backward else 2)
            for name, changes, seq in COPIES:
                wl = _workload({**LLAMA3_8B, **changes}, seq, tmp)
                if "+lora" in est.workload:
                    wl = lora(wl, **LORA)
                copy_est = memfit.estimate(wl, config, device="cpu")
                measured = real_step_peak(wl, config)
                err = (copy_est.peak_bytes - measured) / measured
                row["copies"].append(dict(copy=name, seq=seq, config=config.to_dict(), estimate=copy_est.peak_bytes,
                                          profiler=measured, error=err))
                print(f"  {name}, seq {seq}, {config.describe()}: estimate {copy_est.peak_bytes / 2**20:.1f} MiB, "
                      f"profiler {measured / 2**20:.1f} MiB ({100 * err:+.2f}%)", flush=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
