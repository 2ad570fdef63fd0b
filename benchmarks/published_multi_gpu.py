"""Per-rank estimates against published multi-GPU peaks (issue 12): torchtune's README table "Memory and
training speed" (pytorch/torchtune, Llama 3.1 rows measured on 8 A100s), each run rebuilt from its recipe
config and estimated on fake tensors for rank 0 of 8.

    python benchmarks/published_multi_gpu.py    # a few minutes on 2 cores

torchtune states for every row: batch size 2 without accumulation, a dataset packed to 2,048 tokens, torch
compile enabled; the recipes (recipes/configs/llama3_1/70B_lora.yaml, 405B_qlora.yaml) add: bf16 weights
(dtype bf16, no fp32 master copy: memfit's bf16-pure), activation checkpointing of every decoder layer, LoRA
rank 16, alpha 32 on q_proj, v_proj, the attention output and the three MLP projections, the loss in 8
chunks (CEWithChunkedOutputLoss), fused AdamW, FSDP2 `fully_shard` of each decoder layer and then the root,
reshard after forward. QLoRA's base is torchao's NF4 (blocks of 64, int8 block scales in groups of 256):
the same layout as memfit's 4-bit base. The README does not name the statistic ("Peak Memory per GPU";
torchtune logs the allocator's peak active, allocated and reserved bytes), so each estimate is printed as
allocated, reserved and the device's (nvidia-smi) view. torch.compile fuses elementwise ops, which an eager
step (memfit's trace) does not, so the eager estimate is expected to sit above a compiled run where
activations matter.

torchtitan's published Llama 3.1 8B FSDP rows (benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3,
"FSDP" without compile or Float8: 82.4 GiB on 8 H100s, 67.0 GiB on 128), run from train_configs/llama3_8b.toml
at torchtitan 9dec370 with the table's local batch 2: seq 8192, bf16 FSDP2 mixed precision (bf16 parameters,
fp32 reduction), AdamW, eager, op-level selective activation checkpointing, each decoder layer sharded, the
root last. torchtitan logs the allocator's peak reserved bytes, the figure compared here. The model is
memfit's GPT in Llama 3.1 8B's shape (32 layers, d 4096, 32 heads, 8 key/value heads, ffn 14336, vocab
128256), not torchtitan's code: its rotary embedding is real, not complex, and grouped-query attention is
SDPA's enable_gqa, not repeated key/value heads.

    python benchmarks/published_multi_gpu.py --only torchtitan   # only the rows whose source names this

torchtitan's tensor- and pipeline-parallel rows in the same report (Table 4: Llama 3.1 70B on 256 H100s, FSDP 32 x
TP 8, local batch 16, full activation checkpointing: 71.9 GiB, 67.6 GiB with AsyncTP; Table 5: Llama 3.1 405B
on 512, FSDP 8 x TP 8 x PP 8, local batch 32: 82.5 GiB under 1F1B, 72.7 GiB interleaved) are listed with the
reason memfit does not estimate them (`--only torchtitan-tp`): every one was compiled and trained its Linears
in Float8, and torchtitan's TP computes the loss on each rank's 1/8 of the logits (loss_parallel, its default),
where memfit's TP gathers them whole; the 405B rows are a 3-D layout memfit does not build. No published
per-rank peak of a tensor- or pipeline-parallel run in eager bf16 was found (searched: torchtitan's
benchmarks/ and docs/performance.md, its issues' training logs, torchtune's and Megatron-LM's reports).

Not comparable, and left out: the 70B full fine-tune (13.9 GiB), which keeps the sharded parameters and the
optimizer on the CPU (FSDP2's CPUOffloadPolicy, which memfit does not model), and the single-GPU rows (issue
14's benchmark compares the 8B one).

Results: benchmarks/results/published_multi_gpu.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if (HERE.parent / "src" / "memfit").is_dir():
    sys.path.insert(0, str(HERE.parent / "src"))

import memfit  # noqa: E402
from memfit import Config  # noqa: E402
from memfit.errors import ConfigError  # noqa: E402
from memfit.workloads import load_workload  # noqa: E402
from memfit.workloads.gpt import gpt  # noqa: E402
from memfit.workloads.lora import lora  # noqa: E402

GiB = 2**30
LLAMA_3_1 = dict(model_type="llama", max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                 vocab_size=128256, tie_word_embeddings=False, num_key_value_heads=8)
MODELS = {  # config.json values of the published checkpoints
    "Llama 3.1 70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64),
    "Llama 3.1 405B": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128),
}
TARGETS = "q_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
RECIPE = dict(micro_batch=2, precision="bf16-pure", activation_checkpoint="all", loss_chunks=8, gpus=8,
              data_parallel="fsdp")
ROWS = [  # model, method, Config fields, published peak per GPU in bytes, as printed
    ("Llama 3.1 70B", "LoRA", RECIPE, 27.6 * GiB, "27.6 GiB"),
    ("Llama 3.1 405B", "QLoRA", {**RECIPE, "base_4bit": True}, 44.8e9, "44.8 GB"),
]
DEVICE = "a100-80gb"

# torchtitan 9dec370's llama3_8b.toml with the benchmark's local batch: selective_ac_option "op"
TITAN = dict(micro_batch=2, precision="bf16", activation_checkpoint="selective-op", data_parallel="fsdp")
TITAN_ROWS = [  # gpus, published peak reserved per GPU in bytes, as printed
    (8, 82.4 * GiB, "82.4 GiB"),
    (128, 67.0 * GiB, "67.0 GiB"),
]
TITAN_DEVICE = "h100"  # the benchmark's H100s have 96 GB; the capacity does not enter the estimate

# the same report's TP and PP rows: model, layout, Config fields, published peak reserved (GiB, as printed), why not
COMPILED_FLOAT8 = ("torch.compile and Float8 Linears (memfit traces eager bf16), and loss_parallel: each rank's loss "
                   "on its 1/8 of the logits, which memfit's TP gathers whole")
TITAN_TP_ROWS = [
    ("Llama 3.1 70B", "2D (FSDP 32, TP 8), full AC", dict(micro_batch=16, gpus=32, tp=8), 256, "71.9 GiB",
     COMPILED_FLOAT8),
    ("Llama 3.1 70B", "2D + AsyncTP, full AC", dict(micro_batch=16, gpus=32, tp=8), 256, "67.6 GiB",
     COMPILED_FLOAT8 + "; AsyncTP's fused collective matmuls"),
    ("Llama 3.1 405B", "3D (FSDP 8, TP 8, PP 8) 1F1B, full AC", dict(micro_batch=1, grad_accum=32, gpus=8, tp=8, pp=8),
     512, "82.5 GiB", COMPILED_FLOAT8),
    ("Llama 3.1 405B", "3D (FSDP 8, TP 8, PP 8) interleaved 1F1B, full AC",
     dict(micro_batch=1, grad_accum=32, gpus=8, tp=8, pp=8), 512, "72.7 GiB",
     COMPILED_FLOAT8 + "; interleaved stages (two or more a rank)"),
]


def llama_3_1_8b():
    """memfit's GPT in Llama 3.1 8B's shape at torchtitan's seq_len."""
    return gpt("gpt-7b", seq=8192, kv_heads=8, ffn=14336, vocab=128256)


def estimate_row(source, model, method, wl, fields, gpus, device, published, printed) -> dict:
    """One published row estimated, or the reason memfit does not build its configuration."""
    t0 = time.perf_counter()
    try:
        config = Config(**fields, gpus=gpus)
        est = memfit.estimate(wl, config, device=device)
    except ConfigError as e:  # a combination memfit does not build yet: said, not guessed
        print(f"{model} {method} on {gpus} x {device}: published {printed}; not estimated: {e}", flush=True)
        return dict(source=source, model=model, method=method, gpus=gpus, device=device, published=printed,
                    published_bytes=published, not_estimated=str(e))
    seconds = time.perf_counter() - t0
    figures = {"allocated": est.peak_allocated_bytes, "reserved": est.peak_reserved_bytes,
               "device": est.device_peak_bytes}
    row = dict(source=source, model=model, method=method, gpus=gpus, device=device, published=printed,
               published_bytes=published, seconds=round(seconds, 1), config=config.to_dict(),
               estimate=figures, error={k: v / published - 1 for k, v in figures.items()},
               breakdown=est.breakdown, peak_phase=str(est.peak_phase))
    print(f"{model} {method} on {gpus} x {device}: published {printed}; memfit allocated "
          f"{figures['allocated'] / GiB:.1f} GiB ({row['error']['allocated']:+.1%}), reserved "
          f"{figures['reserved'] / GiB:.1f} GiB ({row['error']['reserved']:+.1%}), device "
          f"{figures['device'] / GiB:.1f} GiB ({row['error']['device']:+.1%}); {seconds:.0f} s", flush=True)
    return row


def not_estimated_row(model, method, fields, world, printed, why) -> dict:
    """A published TP/PP row memfit does not estimate: the reasons, and memfit's own refusal of the layout if it
    refuses it (a Config that builds is said to build: the reasons are then the run's, not the layout's)."""
    try:
        Config(**fields, data_parallel="fsdp", precision="bf16", activation_checkpoint="all")
        layout = "memfit builds this layout"
    except ConfigError as e:
        layout = f"memfit refuses the layout: {e}"
    row = dict(source="torchtitan-tp", model=model, method=method, gpus=world, device=TITAN_DEVICE, published=printed,
               published_bytes=float(printed.split()[0]) * GiB, not_estimated=f"{why}; {layout}")
    print(f"{model} {method} on {world} x {TITAN_DEVICE}: published {printed}; not estimated: {row['not_estimated']}",
          flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["torchtune", "torchtitan", "torchtitan-tp"],
                    help="re-run only this source's rows; the others' results are kept as they are")
    only = ap.parse_args().only
    out = HERE / "results" / "published_multi_gpu.json"
    old = json.loads(out.read_text()) if out.exists() else []
    rows = [r for r in old if only and r.get("source", "torchtune") != only]
    with tempfile.TemporaryDirectory() as tmp:
        for model, method, fields, published, printed in ROWS if only in (None, "torchtune") else []:
            path = Path(tmp) / "config.json"
            path.write_text(json.dumps({**LLAMA_3_1, **MODELS[model]}))
            wl = lora(load_workload(f"hf:{path}", seq=2048), r=16, alpha=32, targets=TARGETS)
            gpus = fields["gpus"]
            rows.append(estimate_row("torchtune", model, method, wl, {k: v for k, v in fields.items() if k != "gpus"},
                                     gpus, DEVICE, published, printed))
    for gpus, published, printed in TITAN_ROWS if only in (None, "torchtitan") else []:
        row = estimate_row("torchtitan", "Llama 3.1 8B", "FSDP, selective op AC", llama_3_1_8b(), TITAN, gpus,
                           TITAN_DEVICE, published, printed)
        # memfit's own selective policy on the same run (every matmul kept), for what the choice of policy moves
        other = estimate_row("torchtitan", "Llama 3.1 8B", "FSDP, memfit's selective AC", llama_3_1_8b(),
                             {**TITAN, "activation_checkpoint": "selective"}, gpus, TITAN_DEVICE, published, printed)
        row["memfit_selective"] = {k: other[k] for k in ("estimate", "error") if k in other}
        rows.append(row)
    for model, method, fields, world, printed, why in TITAN_TP_ROWS if only in (None, "torchtitan-tp") else []:
        rows.append(not_estimated_row(model, method, fields, world, printed, why))
    order = {"torchtune": 0, "torchtitan": 1, "torchtitan-tp": 2}
    rows.sort(key=lambda r: order[r.get("source", "torchtune")])  # a stable sort: each source's rows keep their order
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
