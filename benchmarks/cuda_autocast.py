"""GPU-target fp16 estimates traced with CUDA autocast's op policy (memfit since issue 11) and with CPU
autocast's (memfit before): what the policy changes on LayerNorm models and on gpt-small.

    python benchmarks/cuda_autocast.py                 # markdown table on stdout
    python benchmarks/cuda_autocast.py --json out.json # the same numbers as JSON too ("-" for stdout)

"CPU policy" runs the same code with the policy switched off in memfit.step (in this script only): a
GPU-target trace under torch.autocast("cpu"), as memfit traced one before. BERT-large is the masked-LM
model at its published size (24 layers, hidden 1024, 16 heads), once as memfit's `hf:` loader builds it
(SDPA attention) and with transformers' eager attention (an explicit softmax), with and without dropout
on the attention probabilities (a CPU trace keeps dropout's mask in the input's dtype, where CUDA's fused
dropout keeps one byte per element: that part of the difference is not the autocast policy's).
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


def bert_large_config(folder: str) -> str:
    import transformers

    transformers.BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                            intermediate_size=4096).save_pretrained(folder)
    return folder


def bert_large_eager(folder: str, attention_dropout: bool = True) -> memfit.Workload:
    import transformers

    cfg = transformers.BertConfig.from_pretrained(folder)
    if not attention_dropout:
        cfg.attention_probs_dropout_prob = 0.0

    def batch(n):
        ids = torch.randint(0, cfg.vocab_size, (n, SEQ))
        return {"input_ids": ids, "labels": ids.clone()}

    return memfit.Workload(
        model=lambda: transformers.AutoModelForMaskedLM.from_config(cfg, attn_implementation="eager").train(),
        batch=batch, loss=lambda m, b: m(**b).loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
        name="bert-large (eager attention)" + ("" if attention_dropout else ", no attention dropout"))


@contextlib.contextmanager
def cpu_policy():
    """The step as memfit traced a GPU target before: CPU autocast's op lists."""
    autocast, policy = memfit.step.autocast_context, memfit.step.op_policy
    memfit.step.autocast_context = lambda config, device, cuda_target=False: autocast(config, device)
    memfit.step.op_policy = lambda config, cuda_target: contextlib.nullcontext()
    try:
        yield
    finally:
        memfit.step.autocast_context, memfit.step.op_policy = autocast, policy


def measure(workload, config: Config, device: str) -> dict:
    row = {"workload": workload.name, "device": device, "config": config.describe()}
    for policy, ctx in (("cpu_policy", cpu_policy), ("cuda_policy", contextlib.nullcontext)):
        start = time.perf_counter()
        with ctx():
            est = memfit.estimate(workload, config, device=device)
        row[policy] = {"peak_bytes": est.peak_bytes, "peak_reserved_bytes": est.peak_reserved_bytes,
                       "device_peak_bytes": est.device_peak_bytes, "activations": est.breakdown["activations"],
                       "seconds": round(time.perf_counter() - start, 1)}
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the rows as JSON to this file ('-' for stdout)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        bert = bert_large_config(folder)
        fp16 = Config(micro_batch=8, precision="fp16")
        cases = [(load_workload("gpt-small"), "h100"),
                 (dataclasses.replace(load_workload(f"hf:{bert}", seq=SEQ), name="bert-large (SDPA attention)"),
                  "v100-32gb"),
                 (bert_large_eager(bert), "v100-32gb"),
                 (bert_large_eager(bert, attention_dropout=False), "v100-32gb")]
        for workload, device in cases:
            rows.append(measure(workload, fp16, device))
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    print("| workload | device, config | peak GiB, CPU policy -> CUDA policy | reserved GiB | activations GiB "
          "| change |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        a, b = r["cpu_policy"], r["cuda_policy"]
        print(f"| {r['workload']} | {r['device']}, {r['config']} | {gib(a['peak_bytes'])} -> {gib(b['peak_bytes'])} | "
              f"{gib(a['peak_reserved_bytes'])} -> {gib(b['peak_reserved_bytes'])} | "
              f"{gib(a['activations'])} -> {gib(b['activations'])} | "
              f"{(b['peak_bytes'] - a['peak_bytes']) / a['peak_bytes']:+.1%} |")
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
