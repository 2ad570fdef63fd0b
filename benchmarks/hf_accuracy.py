"""Estimate vs the profiler on transformers models memfit was not written against: image classifiers (ViT,
ConvNeXt, Swin, ResNet), CLIP trained contrastively, and Llama / BERT with transformers' own
`gradient_checkpointing_enable()`. CPU target, small configs (tens of MB), fp32 and bf16 autocast; the
truth is benchmarks/truth.py (the profiler's memory timeline of the same real step).

    nice -n 10 python benchmarks/hf_accuracy.py [--only vit,clip] [--out benchmarks/results/hf_accuracy.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import memfit  # noqa: E402
from truth import real_step_peak  # noqa: E402

LLAMA = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=8000)
BERT = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4, vocab_size=8000)
# (label, model type, config changes, workload options, micro-batch, transformers' gradient checkpointing)
CASES = [
    ("ViT", "vit", dict(hidden_size=192, num_hidden_layers=6, num_attention_heads=3, intermediate_size=768,
                        image_size=224, patch_size=16, num_labels=100), {}, 8, False),
    ("ConvNeXt", "convnext", dict(hidden_sizes=[48, 96, 192, 384], depths=[2, 2, 4, 2], image_size=128,
                                  num_labels=100, drop_path_rate=0.1), {}, 8, False),
    ("Swin", "swin", dict(embed_dim=48, depths=[2, 2, 4, 2], num_heads=[2, 4, 8, 16], image_size=224, window_size=7,
                          num_labels=100), {}, 4, False),
    ("ResNet (transformers)", "resnet", dict(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[2, 2, 2, 2],
                                             layer_type="basic", num_labels=100), {"image_size": 128}, 8, False),
    ("CLIP (contrastive)", "clip", dict(
        text_config=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         vocab_size=8000, max_position_embeddings=77),
        vision_config=dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                           image_size=96, patch_size=16), projection_dim=64), {"task": "contrastive"}, 16, False),
    ("Llama, gradient_checkpointing_enable()", "llama", LLAMA, {"seq": 256}, 4, True),
    ("BERT, gradient_checkpointing_enable()", "bert", BERT, {"seq": 256}, 4, True),
]
PRECISIONS = ("fp32", "bf16")


def workload(model_type: str, changes: dict, options: dict, checkpointing: bool) -> memfit.Workload:
    import transformers

    from memfit.workloads import hf

    wl = hf.from_config(transformers.AutoConfig.for_model(model_type, **changes), name=f"hf:{model_type}", **options)
    if not checkpointing:
        return wl
    build = wl.model

    def model():
        m = build()
        m.gradient_checkpointing_enable()  # transformers' own, not memfit's activation_checkpoint
        return m

    return dataclasses.replace(wl, model=model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated model types")
    ap.add_argument("--out", default=str(HERE / "results" / "hf_accuracy.json"))
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    rows = []
    print("| model | precision | micro-batch | method | estimate MiB | profiler MiB | error | estimate s |")
    print("|---|---|---|---|---|---|---|---|")
    for label, model_type, changes, options, mb, checkpointing in CASES:
        if args.only and model_type not in args.only.split(","):
            continue
        for precision in PRECISIONS:
            wl = workload(model_type, changes, options, checkpointing)
            cfg = memfit.Config(micro_batch=mb, precision=precision)
            t0 = time.perf_counter()
            est = memfit.estimate(wl, cfg)
            seconds = time.perf_counter() - t0
            truth = real_step_peak(wl, cfg)
            err = est.peak_bytes / truth - 1
            rows.append(dict(model=label, precision=precision, micro_batch=mb, method=est.method,
                             estimate=est.peak_bytes, profiler=truth, error=err, seconds=seconds,
                             parameters=est.parameters))
            print(f"| {label} | {precision} | {mb} | {est.method} | {est.peak_bytes / 2**20:.2f} | "
                  f"{truth / 2**20:.2f} | {100 * err:+.2f}% | {seconds:.1f} |", flush=True)
    within = sum(abs(r["error"]) <= 0.01 for r in rows)
    print(f"\n{within}/{len(rows)} within 1%; worst {max(abs(r['error']) for r in rows) * 100:.2f}%")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
