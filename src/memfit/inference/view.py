"""`memfit infer` as a table: where the memory goes, what fits, the flags that serve it."""
from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from memfit.inference.serve import Inference
from memfit.units import fmt_bytes, fmt_number


def render(r: Inference, inverse: dict | None = None) -> Group:
    s = r.settings
    head = Text.assemble(("memfit infer", "bold"), f"  {r.model} · {r.engine} on {r.device}"
                         + (f" · per rank of {s['tensor_parallel_size']}" if s["tensor_parallel_size"] > 1 else "") + "\n",
                         ("KV cache ", "bold"), (f"{r.kv_cache_tokens:,} tokens", "bold cyan"),
                         f" ({fmt_bytes(r.kv_cache_bytes)}); ",
                         ("at most ", "bold"), (f"{fmt_number(r.max_concurrency)} requests", "bold cyan"),
                         f" of {s['max_model_len']:,} tokens at once")
    where = Table(title=f"where {s['gpu_memory_utilization']:g} of {r.device}'s memory goes", title_justify="left",
                  show_edge=False)
    where.add_column("what", overflow="fold")
    where.add_column("bytes", justify="right", no_wrap=True)
    where.add_row("weights", fmt_bytes(r.weights_bytes))
    if r.engine == "transformers":
        where.add_row(f"a step of {s['max_num_batched_tokens']:,} tokens over {s['max_num_seqs']:,} requests (traced), "
                      "cuBLAS workspace, masks and reads growing with the cache", fmt_bytes(r.activation_bytes))
        where.add_row("CUDA context (assumed)", fmt_bytes(r.non_torch_bytes))
    else:
        where.add_row(f"profile run: {s['max_num_batched_tokens']:,} tokens over "
                      f"{min(s['max_num_seqs'], s['max_num_batched_tokens']):,} requests, logits and sampler (traced)",
                      fmt_bytes(r.activation_bytes))
        where.add_row("non-torch memory (assumed)", fmt_bytes(r.non_torch_bytes))
    where.add_row(f"KV cache: {r.num_blocks:,} blocks of {r.block_size} tokens", fmt_bytes(r.kv_cache_bytes))
    cache = Text(f"cache per token: {fmt_bytes(r.kv_bytes_per_token)} on this rank ({r.layers})")
    fits = Table(title="requests that fit at once, by context length", title_justify="left", show_edge=False)
    fits.add_column("context", justify="right", no_wrap=True)
    fits.add_column("requests", justify="right", no_wrap=True)
    for row in r.table:
        fits.add_row(f"{row['context']:,}", f"{row['requests']:,}")
    parts = [head, where, cache, fits]
    if inverse:
        parts.append(Text.assemble(("smallest setting for ", "bold"),
                                   f"{inverse['concurrency']} requests of {inverse['context']:,} tokens: "
                                   f"--gpu-memory-utilization {inverse['gpu_memory_utilization']:g}"
                                   + (f", --kv-cache-dtype {inverse['kv_cache_dtype']}" if inverse["kv_cache_dtype"] != "auto" else "")
                                   + (f", --tensor-parallel-size {inverse['tp']}" if inverse["tp"] > 1 else "")))
    parts.append(Text(r.flags, style="green"))
    parts.append(Text("\n".join(f"- {n}" for n in r.notes), style="dim"))
    return Group(*parts)
