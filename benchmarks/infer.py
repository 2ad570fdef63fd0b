"""Serving memory: transformers' generate on fake tensors vs the profiler, memfit infer vs published vLLM start-up
logs, and how long `memfit infer` takes.

    python benchmarks/infer.py [--out benchmarks/results/infer.json] [--only generate_batch,published]

1. `generate` (greedy, dynamic cache) of toy Llama, Qwen2 and a sliding-window Mistral (window 32, shorter than
   the prompts), fp32, at three batch x prompt x new-token points: memfit's traced peak against the profiler's
   peak of the real run (benchmarks/truth.py: the memory timeline's running sum, weights and prompts included).
   The same models' `generate_batch` (continuous batching, paged cache sized by memfit's plan) with max_batch_tokens
   every request's whole length, below the prompts' total (the prefill split over steps) and transformers' default:
   transformers' manager and batch processor traced on fake tensors against the allocator's peak in the manager's
   thread (truth.generate_batch_peak).
2. Published vLLM logs, each row's settings as its log gives them: weights ("Loading model weights took",
   "model weights take", "Model loading took") and the KV cache ("kv_cache_size", "# GPU blocks", "Available KV
   cache memory", "GPU KV cache size: N tokens", "Maximum concurrency").
3. Wall time of the `memfit infer` command (a fresh process: imports included) for Llama 3.1 8B and 70B on an H100.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if (HERE.parent / "src" / "memfit").is_dir():
    sys.path.insert(0, str(HERE.parent / "src"))

import torch  # noqa: E402
import transformers  # noqa: E402

from memfit.inference.serve import infer, model_config  # noqa: E402
from memfit.inference.run import planned_blocks  # noqa: E402
from memfit.inference.trace import (generate_batch_options, generate_batch_peak, generate_options,  # noqa: E402
                                    generate_peak)
from truth import generate_batch_peak as batch_truth  # noqa: E402
from truth import profiler_peak  # noqa: E402

CONFIGS = HERE.parent / "tests" / "data" / "hf_configs"
GiB = 2**30
POINTS = [(1, 16, 8), (4, 64, 16), (8, 128, 32)]
# requests, prompt, new tokens, max_batch_tokens: WHOLE is every request's whole length (one prefill step), a number
# below the prompts' total splits the prefill over steps, None is transformers' default (8,192)
WHOLE = "whole"
BATCH_POINTS = [(1, 16, 4, WHOLE), (2, 40, 4, WHOLE), (4, 60, 4, WHOLE), (4, 48, 4, 32), (4, 48, 4, 64),
                (8, 60, 4, 100), (4, 48, 4, None)]

# llm-d-planner's capacity-planner validation (github.com/llm-d-incubation/llm-d-planner, pull request 205): vLLM
# 0.19.0 start-up logs on an H100 80GB, `vllm serve MODEL --max-model-len 8192 --gpu-memory-utilization 0.95`
# (--enable-prefix-caching off, which sizes nothing), defaults otherwise: 8,192 batched tokens, 1,024 sequences
PLANNER_LOGS = ("https://github.com/llm-d-incubation/llm-d-planner/blob/d3121e059da88662db39a926a3ead964be97359b/"
                "accuracy/results/v0.19.0/logs")
V019_H100 = dict(device="h100", max_model_len=8192, gpu_memory_utilization=0.95, max_num_batched_tokens=8192,
                 max_num_seqs=1024, vllm_version="0.19")

# (source, model config, infer settings, published figures). GiB figures as the logs print them ("GB" in vLLM's
# older logs is GiB: 14.9888 = 8,030,261,248 bf16 parameters plus the 32 MiB rotary table, / 2**30).
ROWS = [
    ("https://github.com/vllm-project/vllm/issues/10517 (V0, RTX 3090, --max-model-len 20000)", "llama-3.1-8b",
     dict(device="rtx-3090", max_model_len=20000, max_num_batched_tokens=20000, max_num_seqs=256, vllm_version="0.6"),
     dict(weights=14.9888, kv=3.81, blocks=1952, concurrency=1.56)),
    ("https://github.com/vllm-project/vllm/issues/10517 (V0, RTX 3090, --max-model-len 29000, which vLLM then refused: "
     "the profile run of 29,000 tokens left 1478 blocks; memfit's figures for that run, its max_model_len check "
     "left out here)", "llama-3.1-8b",
     dict(device="rtx-3090", max_model_len=2048, max_num_batched_tokens=29000, max_num_seqs=256, vllm_version="0.6"),
     dict(weights=14.9888, kv=2.89, blocks=1478)),
    ("https://github.com/vllm-project/vllm/pull/12569 (V1, H100, w8a8 int8, 0.98, --max-model-len 2048)",
     "llama-3.1-70b", dict(device="h100", max_model_len=2048, gpu_memory_utilization=0.98, quantization="int8",
                           vllm_version="0.7"),
     dict(weights=67.7229, blocks=1381, concurrency=10.79)),
    ("https://github.com/vllm-project/vllm/pull/10511 (V0, H100, Meta-Llama-3-8B)", "llama-3-8b",
     dict(device="h100", max_num_batched_tokens=8192, max_num_seqs=256, vllm_version="0.6"),
     dict(weights=14.96, kv=53.29)),
    ("https://github.com/vllm-project/vllm/pull/10511 (V0, H100, Meta-Llama-3-8B -tp 2)", "llama-3-8b",
     dict(device="h100", max_num_batched_tokens=8192, max_num_seqs=256, tp=2, vllm_version="0.6"),
     dict(weights=7.48)),
    *[(f"{PLANNER_LOGS}/{log}.log (vLLM 0.19.0, H100 80GB, {what})", name, V019_H100, published)
      for log, name, what, published in [
          ("meta-llama-llama-3-1-8b---h100-80gb--tp1pp1dp1--8192", "llama-3.1-8b", "Llama-3.1-8B-Instruct",
           dict(weights=14.99, kv=58.11, tokens=476016, concurrency=58.11, profile=1.89)),
          ("google-gemma-2-2b-it--h100-80gb--tp1pp1dp1--8192", "gemma-2-2b", "gemma-2-2b-it, sliding window",
           dict(weights=4.9, kv=66.47, tokens=670160, concurrency=81.73, profile=3.62)),
          ("google-gemma-2-9b-it--h100-80gb--tp1pp1dp1--8192", "gemma-2-9b", "gemma-2-9b-it, sliding window",
           dict(weights=17.22, kv=54.12, tokens=168880, concurrency=20.60, profile=3.65)),
          ("google-gemma-2-27b-it--h100-80gb--tp1pp1dp1--8192", "gemma-2-27b", "gemma-2-27b-it, sliding window",
           dict(weights=50.72, kv=20.59, tokens=58672, concurrency=7.16, profile=3.66)),
          ("google-gemma-3-27b-it--h100-80gb--tp1pp1dp1--8192", "gemma-3-27b-it",
           "gemma-3-27b-it, its whole multimodal config: the SigLIP vision tower and projector counted",
           dict(weights=51.45, kv=19.53, tokens=36560, concurrency=4.46, profile=3.99)),
          ("deepseek-ai-deepseek-v2---h100-80gb--tp1pp1dp1--8192", "deepseek-v2-lite", "DeepSeek-V2-Lite-Chat, MLA",
           dict(weights=29.43, kv=43.61, tokens=1505552, concurrency=183.78, profile=1.93)),
      ]],
]


def toy_configs() -> dict:
    toy = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=1000, max_position_embeddings=2048)
    return {"llama": model_config("hf:llama"), "qwen2": model_config("hf:qwen2"),
            "mistral (sliding window 32)": transformers.AutoConfig.for_model("mistral", sliding_window=32, **toy)}


def generate_rows() -> list[dict]:
    rows = []
    for name, config in toy_configs().items():
        torch.manual_seed(0)
        net = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
        for batch, prompt, new in POINTS:
            ids = torch.randint(1, config.vocab_size, (batch, prompt))

            def run():
                with torch.no_grad():
                    net.generate(ids, **generate_options(new))

            est, real = generate_peak(config, batch, prompt, new), profiler_peak(run)
            rows.append(dict(model=name, batch=batch, prompt=prompt, new_tokens=new, estimate=est, profiler=real,
                             error=(est - real) / real))
            print(rows[-1], flush=True)
    return rows


def generate_batch_rows() -> list[dict]:
    rows = []
    for name, config in toy_configs().items():
        torch.manual_seed(0)
        net = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        for requests, prompt, new, tokens in BATCH_POINTS:
            tokens = requests * (prompt + new) if tokens == WHOLE else tokens
            _, blocks = planned_blocks(config, requests, prompt + new)
            cb = transformers.ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=tokens)
            prompts = torch.randint(1, config.vocab_size, (requests, prompt)).tolist()

            def run():
                with torch.no_grad():
                    net.generate_batch(prompts, generation_config=generate_batch_options(new),
                                       continuous_batching_config=cb, warmup=False)

            est, real = generate_batch_peak(config, requests, prompt, new, blocks, tokens), batch_truth(net, run)
            rows.append(dict(model=name, requests=requests, prompt=prompt, new_tokens=new, num_blocks=blocks,
                             max_batch_tokens=tokens, split=tokens is not None and tokens < requests * prompt,
                             estimate=est, allocator=real, error=(est - real) / real))
            print(rows[-1], flush=True)
    return rows


def published_rows() -> list[dict]:
    out = []
    for source, name, settings, published in ROWS:
        r = infer(f"hf:{CONFIGS / name}.json", **settings)
        mine = dict(weights=r.weights_bytes / GiB, kv=r.kv_cache_bytes / GiB, blocks=r.num_blocks,
                    tokens=r.kv_cache_tokens, concurrency=r.max_concurrency, profile=r.activation_bytes / GiB)
        row = dict(source=source, model=name, settings=settings, published=published,
                   memfit={k: mine[k] for k in published},
                   error={k: (mine[k] - v) / v for k, v in published.items()},
                   activation_gib=r.activation_bytes / GiB)
        out.append(row)
        print(row, flush=True)
    return out


def timings() -> list[dict]:
    out = []
    for name, extra in (("llama-3.1-8b", ["--max-model-len", "8192"]), ("llama-3.1-70b", ["--tp", "4"])):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "memfit.cli", "infer", f"hf:{CONFIGS / name}.json", "--device", "h100",
                        "--json", *extra], check=True, capture_output=True)
        out.append(dict(model=name, args=extra, seconds=time.perf_counter() - start))
        print(out[-1], flush=True)
    return out


PARTS = {"generate": generate_rows, "generate_batch": generate_batch_rows, "published": published_rows,
         "timings": timings}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(HERE / "results" / "infer.json"))
    parser.add_argument("--only", help=f"comma-separated parts to rerun ({', '.join(PARTS)}); the others are kept "
                                       "from --out")
    args = parser.parse_args()
    out = Path(args.out)
    parts = args.only.split(",") if args.only else list(PARTS)
    results = json.loads(out.read_text()) if args.only and out.exists() else {}
    results["date"] = time.strftime("%Y-%m-%d")
    for part in parts:
        results[part] = PARTS[part]()
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
