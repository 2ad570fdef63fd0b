"""GPU-target estimates with CUDA's dropout and attention kernels (strategies/cuda_kernels.py, since issue 11)
and without them (memfit before): BERT-large in training (dropout after every sublayer and on the attention
probabilities) and gpt-small (no dropout).

    python benchmarks/gpu_dropout.py                 # markdown table on stdout
    python benchmarks/gpu_dropout.py --json out.json # the same numbers as JSON too ("-" for stdout)

"Before" runs the same code with the kernels switched off in memfit.step (in this script only): CPU dropout
(noise in the input's dtype) and, for SDPA with dropout, the CPU's math path. BERT-large is the masked-LM
model at its published size (24 layers, hidden 1024, 16 heads, seq 512), as memfit's `hf:` loader builds it
(SDPA attention) and with transformers' eager attention.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
if os.path.isdir(os.path.join(SRC, "memfit")) and SRC not in sys.path:
    sys.path.insert(0, SRC)  # the checkout's memfit, installed or not

import torch  # noqa: E402

import memfit  # noqa: E402
import memfit.step  # noqa: E402
from memfit import Config  # noqa: E402
from memfit.workloads import load_workload  # noqa: E402

SEQ = 512


def bert_large(folder: str, attention: str) -> memfit.Workload:
    import transformers

    cfg = transformers.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                  intermediate_size=4096)
    if attention == "sdpa":  # memfit's own hf: loader, from the config file
        cfg.save_pretrained(folder)
        return dataclasses.replace(load_workload(f"hf:{folder}", seq=SEQ), name="bert-large (SDPA)")

    def batch(n):
        ids = torch.randint(0, cfg.vocab_size, (n, SEQ))
        return {"input_ids": ids, "labels": ids.clone()}

    return memfit.Workload(
        model=lambda: transformers.AutoModelForMaskedLM.from_config(cfg, attn_implementation="eager").train(),
        batch=batch, loss=lambda m, b: m(**b).loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        name="bert-large (eager)")


@contextlib.contextmanager
def before():
    """The step as memfit traced a GPU target before: the CPU's dropout and attention kernels."""
    kernels = memfit.step.cuda_kernels
    memfit.step.cuda_kernels = lambda active=True: contextlib.nullcontext()
    try:
        yield
    finally:
        memfit.step.cuda_kernels = kernels


def measure(workload, config: Config, device: str) -> dict:
    row = {"workload": workload.name, "device": device, "config": config.describe()}
    for label, ctx in (("before", before), ("after", contextlib.nullcontext)):
        start = time.perf_counter()
        with ctx():
            est = memfit.estimate(workload, config, device=device)
        row[label] = {"peak_bytes": est.peak_bytes, "peak_reserved_bytes": est.peak_reserved_bytes,
                      "activations": est.breakdown["activations"], "flops": est.flops,
                      "seconds": round(time.perf_counter() - start, 1)}
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows as JSON to this file ('-' for stdout)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        cases = [(bert_large(folder, "sdpa"), Config(micro_batch=8, precision="fp16"), "v100-32gb"),
                 (bert_large(folder, "sdpa"), Config(micro_batch=8, precision="bf16"), "h100"),
                 (bert_large(folder, "eager"), Config(micro_batch=8, precision="fp16"), "v100-32gb"),
                 (bert_large(folder, "eager"), Config(micro_batch=8, precision="fp32"), "v100-32gb"),
                 (load_workload("gpt-small"), Config(micro_batch=8, precision="bf16"), "h100")]
        for workload, config, device in cases:
            rows.append(measure(workload, config, device))
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    print("| workload | device, config | peak GiB, before -> after | reserved GiB | activations GiB | change "
          "| FLOPs change |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["before"], r["after"]
        print(f"| {r['workload']} | {r['device']}, {r['config']} | {gib(a['peak_bytes'])} -> {gib(b['peak_bytes'])} | "
              f"{gib(a['peak_reserved_bytes'])} -> {gib(b['peak_reserved_bytes'])} | "
              f"{gib(a['activations'])} -> {gib(b['activations'])} | "
              f"{(b['peak_bytes'] - a['peak_bytes']) / a['peak_bytes']:+.1%} | "
              f"{(b['flops'] - a['flops']) / a['flops']:+.1%} |")
    if args.json:
        text = json.dumps({"torch": torch.__version__, "rows": rows}, indent=1)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
