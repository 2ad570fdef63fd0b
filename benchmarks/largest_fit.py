"""The largest Llama-shaped model each technique fits on an RTX 4090, an L40S, an A100 80GB and an H100 (issue 14).

    python benchmarks/largest_fit.py [--out benchmarks/results/largest_fit.json]    # about 40 minutes, 2 cores
    python benchmarks/largest_fit.py --only "QLoRA r=16, 4-bit base,LLaMA-33B"     # one column, one row: redone

Each model is transformers' LlamaForCausalLM built from the published config.json values (no download), one
sample of 2,048 tokens a step, in the least-memory configuration of each technique (memfit's estimate for an
H100 target; the other cards differ only by their CUDA context, added as the catalogue has it):

- full fine-tune: bf16 weights and gradients, AdamW in bf16, the optimizer step in backward, checkpointing
  every block, the loss in 8 chunks (keeps the math of pure-bf16 training);
- full fine-tune, optimizer offloaded: the same with fp32 master weights and AdamW on the host (bf16 compute,
  fp32 update); the host memory it needs is listed;
- full fine-tune, 8-bit states: as the first, with AdamW's moments in 8 bits (changes the math);
- LoRA: bf16 base frozen, rank-16 adapters on every Linear layer of the blocks;
- QLoRA: the same on a 4-bit NF4 base (double quantization), QLoRA's layout (changes the math).

LLaMA-33B and LLaMA-65B are the QLoRA paper's models (33B on 24 GB, 65B on 48 GB: the L40S is the 48 GB card).

A size is tried only when its weights, gradients and optimizer state alone fit the largest card (80 GB).
A model "fits" a card when the estimate's device peak (nvidia-smi's view) is within 95% of its memory, the
share the planner offers.
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
from memfit.memory.devices import get_device  # noqa: E402
from memfit.memory.estimate import state_bytes  # noqa: E402
from memfit.workloads import load_workload  # noqa: E402
from memfit.workloads.lora import lora  # noqa: E402

LLAMA = dict(model_type="llama", max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0)
MODELS = [  # name, parameters (billions), config.json values
    ("Llama-3.2-1B", 1.24, dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)),
    ("Llama-3.2-3B", 3.21, dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                               num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)),
    ("Llama-3-8B", 8.03, dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                             num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)),
    ("Llama-2-13B", 13.0, dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                              num_key_value_heads=40, vocab_size=32000, tie_word_embeddings=False)),
    ("LLaMA-33B", 32.5, dict(hidden_size=6656, intermediate_size=17920, num_hidden_layers=60, num_attention_heads=52,
                            num_key_value_heads=52, vocab_size=32000, tie_word_embeddings=False)),
    ("CodeLlama-34B", 33.7, dict(hidden_size=8192, intermediate_size=22016, num_hidden_layers=48, num_attention_heads=64,
                                num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False)),
    ("LLaMA-65B", 65.3, dict(hidden_size=8192, intermediate_size=22016, num_hidden_layers=80, num_attention_heads=64,
                            num_key_value_heads=64, vocab_size=32000, tie_word_embeddings=False)),
    ("Llama-3-70B", 70.6, dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                              num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)),
]
BASE = Config(micro_batch=1, precision="bf16-pure", activation_checkpoint="all", loss_chunks=8)
TECHNIQUES = [  # name, configuration, LoRA
    ("full fine-tune", BASE.replace(optimizer_in_backward=True), False),
    ("full fine-tune, optimizer offloaded", BASE.replace(offload_optimizer=True), False),
    ("full fine-tune, 8-bit states", BASE.replace(optimizer_in_backward=True, optimizer_8bit=True), False),
    ("LoRA r=16, bf16 base", BASE, True),
    ("QLoRA r=16, 4-bit base", BASE.replace(base_4bit=True), True),
]
DEVICES = ["rtx-4090", "l40s", "a100-80gb", "h100"]
SHARE = 0.95
PUBLISHED = [
    "torchtune: Llama 3.1 8B full fine-tune on one RTX 4090 at 18.9 GiB peak (bf16, optimizer step in backward, "
    "bitsandbytes' paged 8-bit AdamW, activation checkpointing)",
    "QLoRA (Dettmers et al. 2023): a 65B model fine-tuned on one 48 GB GPU, 33B on 24 GB (4-bit NF4 base)",
]


def _on_cards(row: dict, h100_peak: int) -> None:
    """Each card's need and verdict from the H100 estimate: the cards differ only by their CUDA context."""
    h100 = get_device("h100")
    need = {d: h100_peak - h100.context_bytes + get_device(d).context_bytes for d in DEVICES}
    row.update(device_peak=need, fits={d: need[d] <= SHARE * get_device(d).memory_bytes for d in DEVICES})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(HERE / "results" / "largest_fit.json"))
    ap.add_argument("--only", help="estimate only these techniques and models (comma-separated names, either kind); "
                                   "the other rows are kept from --out, their cards' verdicts redone")
    args = ap.parse_args()
    only = {n.strip() for n in args.only.split(",")} if args.only else None
    kept = {}
    if only and Path(args.out).is_file():
        for row in json.loads(Path(args.out).read_text())["rows"]:
            if "device_peak" in row:
                _on_cards(row, row["device_peak"]["h100"])
            else:
                row["fits"] = {d: False for d in DEVICES}
            kept[row["model"], row["technique"]] = row
    h100 = get_device("h100")
    largest = max(get_device(d).memory_bytes for d in DEVICES)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, billions, values in MODELS:
            path = Path(tmp) / f"{name}.json"
            path.write_text(json.dumps({**LLAMA, **values}))
            base = load_workload(f"hf:{path}", seq=2048)
            for technique, config, adapted in TECHNIQUES:
                if only and (name, technique) in kept and not {name, technique} & only:
                    rows.append(kept[name, technique])
                    continue
                wl = lora(base, r=16, alpha=32, targets="all-linear") if adapted else base
                row = dict(model=name, billions=billions, technique=technique)
                floor = state_bytes(wl, config.replace(activation_checkpoint="none"), h100)
                if floor > largest:
                    row.update(state_floor=floor, fits={d: False for d in DEVICES})
                    print(f"{name:14} {technique:36} state alone {floor / 2**30:6.1f} GiB: over every card", flush=True)
                    rows.append(row)
                    continue
                t0 = time.perf_counter()
                est = memfit.estimate(wl, config, device=h100)
                _on_cards(row, est.device_peak_bytes)
                row.update(host_peak=est.host_peak_bytes, seconds=round(time.perf_counter() - t0, 1))
                print(f"{name:14} {technique:36} {row['device_peak']['h100'] / 2**30:6.1f} GiB on an H100"
                      + (f", host {est.host_peak_bytes / 2**30:.0f} GiB" if est.host_peak_bytes else "")
                      + f" ({row['seconds']} s)", flush=True)
                rows.append(row)
    table = {t: {d: max((r["model"] for r in rows if r["technique"] == t and r["fits"][d]),
                        key=lambda m: dict((n, b) for n, b, _ in MODELS)[m], default=None) for d in DEVICES}
             for t, _, _ in TECHNIQUES}
    for t, by_device in table.items():
        print(f"{t:36} " + "  ".join(f"{d}: {m or '-'}" for d, m in by_device.items()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(rows=rows, largest=table, published=PUBLISHED, share=SHARE), indent=1))


if __name__ == "__main__":
    main()
