"""Per-rank estimates of DDP and FSDP2 layouts against real ranks: each configuration is estimated in one process (rank
0 of a fake world) and run for real on N CPU processes joined by gloo, each rank measuring its own peak with
the CPU allocator's running total (truth.allocator_step_peak; gloo's own all-gather buffers left out).
gloo's worker thread can free a collective's tensors late, which only ever adds to a rank's peak: where the
lowest rank misses the estimate by more than 1%, the configuration runs again (up to --runs times) and each
rank keeps its lowest peak, as tests/test_data_parallel.py does.

    python benchmarks/data_parallel.py [--ranks 2,4] [--only gpt-tiny,sort,hf-llama] [--layouts ddp,fsdp]
                                       [--optimizer-8bit]

Results: benchmarks/results/data_parallel.json (with --optimizer-8bit: data_parallel_8bit.json).
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import memfit
from memfit import Config
from memfit.workloads import builtin
from truth import rank_step_peaks

RESULTS = Path(__file__).resolve().parent / "results"


def hf_llama() -> memfit.Workload:
    """transformers' own LlamaForCausalLM (a model memfit was not written for), small: 4 decoder layers."""
    import transformers

    from memfit.workloads import hf

    config = transformers.AutoConfig.for_model("llama", hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                                               num_attention_heads=4, num_key_value_heads=2, vocab_size=8000)
    return hf.from_config(config, name="hf:llama", seq=128)


WORKLOADS = {"gpt-tiny": lambda: builtin("gpt-tiny"), "sort": lambda: builtin("sort"), "hf-llama": hf_llama}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--only", default="gpt-tiny,sort,hf-llama")
    ap.add_argument("--layouts", default="ddp,fsdp,fsdp-no-reshard")
    ap.add_argument("--optimizer-8bit", action="store_true", help="AdamW's moments in 8 bits (Config.optimizer_8bit)")
    ap.add_argument("--runs", type=int, default=3, help="real runs at most, while the lowest rank misses by 1%%")
    args = ap.parse_args()
    workloads = {name: WORKLOADS[name]() for name in args.only.split(",")}
    rows = []
    for (name, wl), n, layout, precision, ck in itertools.product(
            workloads.items(), [int(r) for r in args.ranks.split(",")], args.layouts.split(","),
            ["fp32", "bf16"], ["none", "all"]):
        mb = 4 if name == "hf-llama" else 8
        cfg = Config(micro_batch=mb, gpus=n, data_parallel=layout, precision=precision, activation_checkpoint=ck,
                     optimizer_8bit=args.optimizer_8bit)
        est = memfit.estimate(wl, cfg).peak_bytes
        peaks, runs = rank_step_peaks(wl, cfg), 1
        while runs < args.runs and abs(est / min(peaks) - 1) > 0.01:  # gloo's late frees only ever add
            peaks, runs = [min(a, b) for a, b in zip(peaks, rank_step_peaks(wl, cfg))], runs + 1
        row = dict(workload=name, ranks=n, layout=layout, precision=precision, checkpoint=ck, estimate=est,
                   rank_peaks=peaks, runs=runs, error_vs_max=est / max(peaks) - 1, error_vs_min=est / min(peaks) - 1)
        rows.append(row)
        print(f"{name:8} N={n} {layout:15} {precision} ck={ck:4} est {est:>10,} ranks {peaks} "
              f"{row['error_vs_min']:+.2%} .. {row['error_vs_max']:+.2%} ({runs} run{'s' if runs > 1 else ''})",
              flush=True)
    RESULTS.mkdir(exist_ok=True)
    name = "data_parallel_8bit.json" if args.optimizer_8bit else "data_parallel.json"
    (RESULTS / name).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
