"""LoRA (peft) and torch.optim on fake tensors: memfit.estimate's peak against the PyTorch profiler's memory
timeline of the same real CPU step, and the estimate's time, for transformers Llama and GPT-2 at small but
not toy sizes, and for the optimizers that used to need real steps.

    nice -n 10 python benchmarks/lora_accuracy.py [--quick] [--out benchmarks/results/lora_accuracy.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import transformers  # noqa: E402

import memfit  # noqa: E402
from memfit.workloads import lora  # noqa: E402
from memfit.workloads.hf import from_config  # noqa: E402
from truth import real_step_peak  # noqa: E402

SEQ = 256
CONFIGS = {  # 4 layers, hidden 512, an 8,000-token vocabulary: 20-30M parameters
    "Llama": lambda: transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                              num_attention_heads=8, num_key_value_heads=4, vocab_size=8000,
                                              max_position_embeddings=SEQ),
    "GPT-2": lambda: transformers.GPT2Config(n_embd=512, n_layer=4, n_head=8, vocab_size=8000, n_positions=SEQ,
                                             bos_token_id=0, eos_token_id=0),
}
ALL_LINEAR = {"Llama": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "GPT-2": "c_attn,c_proj,c_fc"}
# (LoRA options, Config changes): peft's default targets, every linear layer with dropout, then precision
# and checkpointing as a LoRA fine-tune uses them
CASES = [
    (dict(r=16, alpha=32), {}),
    (dict(r=16, alpha=32, targets="all", dropout=0.05), {}),
    (dict(r=16, alpha=32), dict(precision="bf16")),
    (dict(r=16, alpha=32), dict(activation_checkpoint="all")),
]
OPTIMIZERS = {"Adafactor": lambda p: torch.optim.Adafactor(p, lr=1e-3), "ASGD": lambda p: torch.optim.ASGD(p),
              "RAdam": lambda p: torch.optim.RAdam(p), "Adadelta": lambda p: torch.optim.Adadelta(p)}


def row(label: str, wl: memfit.Workload, cfg: memfit.Config) -> dict:
    t = time.perf_counter()
    est = memfit.estimate(wl, cfg)
    seconds = time.perf_counter() - t
    truth = real_step_peak(wl, cfg)
    r = dict(model=label, config=cfg.describe(), method=est.method, estimate=est.peak_bytes, profiler=truth,
             error=est.peak_bytes / truth - 1, estimate_seconds=seconds,
             trainable=est.model_state_bytes["gradients"], optimizer_state=est.model_state_bytes["optimizer_state"])
    print(f"| {label} | {r['config']} | {r['method']} | {est.peak_bytes / 2**20:.2f} | {truth / 2**20:.2f} | "
          f"{r['error'] * 100:+.2f}% | {seconds:.1f} |", flush=True)
    return r


def peft_methods() -> list[dict]:
    """Which of peft's adapters trace on fake tensors (hf:llama's toy size: the question is fake or not)."""
    import peft

    from memfit.workloads import builtin

    base = builtin("hf:llama", seq=32)
    t = ["q_proj", "v_proj"]
    configs = {
        "LoRA": lambda: peft.LoraConfig(r=8, target_modules=t),
        "DoRA": lambda: peft.LoraConfig(r=8, target_modules=t, use_dora=True),
        "AdaLoRA": lambda: peft.AdaLoraConfig(r=8, target_modules=t, total_step=10),
        "IA3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"],
                                      feedforward_modules=["down_proj"]),
        "VeRA": lambda: peft.VeraConfig(r=8, target_modules=t),
        "LoHa": lambda: peft.LoHaConfig(r=8, target_modules=t),
        "LoKr": lambda: peft.LoKrConfig(r=8, target_modules=t),
        "OFT": lambda: peft.OFTConfig(oft_block_size=32, r=0, target_modules=t),
        "BOFT": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=t),
        "HRA": lambda: peft.HRAConfig(r=8, target_modules=t),
        "FourierFT": lambda: peft.FourierFTConfig(n_frequency=100, target_modules=t),
        "LN tuning": lambda: peft.LNTuningConfig(target_modules=["input_layernorm"]),
    }
    rows = []
    print("\n| peft method | method | trainable bytes | why not fake |\n|---|---|---|---|")
    for name, make in configs.items():
        wl = memfit.Workload(model=lambda make=make: peft.get_peft_model(base.model(), make()), batch=base.batch,
                             loss=base.loss, optimizer=lambda ps: torch.optim.AdamW([p for p in ps if p.requires_grad]),
                             name=name)
        est = memfit.estimate(wl, memfit.Config(micro_batch=2))
        why = "" if est.method == "fake" else est.notes[0].split("(", 1)[1].split(")")[0]
        rows.append(dict(peft_method=name, method=est.method, trainable=est.model_state_bytes["gradients"], why=why))
        print(f"| {name} | {est.method} | {rows[-1]['trainable']:,} | {why} |", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="the first LoRA case only, no optimizers")
    ap.add_argument("--out", default=str(HERE / "results" / "lora_accuracy.json"))
    args = ap.parse_args()
    rows = []
    print("| model | configuration | method | estimate MiB | profiler MiB | error | estimate s |")
    print("|---|---|---|---|---|---|---|")
    for name, make_config in CONFIGS.items():
        for options, changes in CASES[:1] if args.quick else CASES:
            options = dict(options)
            if options.get("targets") == "all":
                options["targets"] = ALL_LINEAR[name]
            base = from_config(make_config(), seq=SEQ, name=f"hf {name}")
            wl = lora(base, **options)
            described = ",".join(f"{k}={v}" for k, v in options.items())
            rows.append(row(f"{name} + LoRA {described}", wl, memfit.Config(micro_batch=4, **changes)))
    if not args.quick:
        import dataclasses
        for opt_name, make in OPTIMIZERS.items():
            base = from_config(CONFIGS["Llama"](), seq=SEQ, name="hf Llama")
            rows.append(row(f"Llama (full fine-tune), {opt_name}", dataclasses.replace(base, optimizer=make),
                            memfit.Config(micro_batch=4)))
    methods = [] if args.quick else peft_methods()
    import peft
    Path(args.out).write_text(json.dumps(dict(torch=torch.__version__, transformers=transformers.__version__,
                                              peft=peft.__version__, rows=rows, peft_methods=methods), indent=1))


if __name__ == "__main__":
    main()
