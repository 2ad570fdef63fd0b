"""`memfit infer --run`: transformers' continuous batching on this CPU with the cache memfit plans.

The plan: enough blocks for every request at its full length (transformers' paged geometry, engines.py), so no
request waits or is preempted. The run: `generate_batch` on a model built from the config with random weights
(toy sizes are the point: any CPU), greedy, every request generating all its tokens. What is checked: the
cache tensor transformers allocates against memfit's figure for it (to the byte), and every request served.
"""
from __future__ import annotations

import time

import torch

from memfit.errors import ConfigError, HostMemoryError
from memfit.inference import engines, kv
from memfit.inference.serve import model_config
from memfit.inference.weights import meta_model
from memfit.memory.estimate import SAFE_HOST_SHARE
from memfit.memory.isolate import available_host_bytes
from memfit.units import fmt_bytes

NEW_TOKENS = 16


def planned_blocks(config, requests: int, context: int) -> tuple[engines.PagedGeometry, int]:
    """transformers' geometry for `config` and the model blocks that hold `requests` requests of `context`
    tokens each at once."""
    geometry = engines.paged_geometry(kv.layer_caches(config, "float32"))
    return geometry, requests * geometry.blocks_for(context)


def _refuse_what_may_not_fit(config, cache_bytes: int) -> None:
    """A real run holds the fp32 weights and the planned cache at least: where that is over the safe share of
    the host's available memory (an 8B config on a laptop), none is started."""
    weights = 4 * sum(p.numel() for p in meta_model(config).parameters())
    allowance = int(SAFE_HOST_SHARE * available_host_bytes())
    if weights + cache_bytes > allowance:
        raise HostMemoryError(f"--run builds the model for real on this CPU: its fp32 weights ({fmt_bytes(weights)}) "
                              f"and the planned cache ({fmt_bytes(cache_bytes)}) are over {fmt_bytes(allowance)}, "
                              f"{SAFE_HOST_SHARE:.0%} of the host memory available, so none was run; --run is for "
                              "toy sizes (hf:llama)")


def run_generate_batch(model, requests: int = 4, context: int = 256, num_blocks: int | None = None,
                       max_batch_tokens: int | None = None, dtype: str = "float32") -> dict:
    """Serve `requests` prompts of `context - 16` tokens, 16 new tokens each, with generate_batch on the CPU; with
    num_blocks and max_batch_tokens (a GPU plan's ContinuousBatchingConfig) those instead of memfit's CPU plan, in
    the model's `dtype`."""
    import transformers

    if context <= NEW_TOKENS:
        raise ConfigError(f"--context {context} leaves no prompt before the {NEW_TOKENS} generated tokens")
    config = model_config(model)
    positions = getattr(config, "max_position_embeddings", None)
    if positions and context > positions:
        raise ConfigError(f"--context {context:,} is longer than the model's {positions:,} positions")
    geometry, blocks = planned_blocks(config, requests, context)
    if num_blocks is not None:
        geometry, blocks = engines.paged_geometry(kv.layer_caches(config, dtype)), num_blocks
    max_batch_tokens = max_batch_tokens or requests * context
    _refuse_what_may_not_fit(config, geometry.cache_bytes(blocks))
    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).eval()
    prompts = torch.randint(1, config.vocab_size, (requests, context - NEW_TOKENS)).tolist()
    cb = transformers.ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=max_batch_tokens)
    generation = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                               do_sample=False, eos_token_id=None, pad_token_id=0)
    caches = []
    keep = transformers.generation.continuous_batching.cache.PagedAttentionCache.__init__

    def seen(self, *args, **kwargs):  # the engine's own cache object, to read its tensor's size
        keep(self, *args, **kwargs)
        caches.append(self)

    transformers.generation.continuous_batching.cache.PagedAttentionCache.__init__ = seen
    try:
        start = time.perf_counter()
        with torch.no_grad():
            out = net.generate_batch(prompts, generation_config=generation, continuous_batching_config=cb,
                                     warmup=False)
        seconds = time.perf_counter() - start
    finally:
        transformers.generation.continuous_batching.cache.PagedAttentionCache.__init__ = keep
    served = sum(len(o.generated_tokens) == NEW_TOKENS for o in out.values())
    real = caches[0].cache_tensor.nbytes
    planned = geometry.cache_bytes(blocks)
    summary = (f"{requests} requests of {context:,} tokens on this CPU: {served} served in full in {seconds:.2f} s; "
               f"num_blocks={blocks} (ContinuousBatchingConfig(num_blocks={blocks}, max_batch_tokens="
               f"{max_batch_tokens})): cache tensor {fmt_bytes(real)}, memfit's figure {fmt_bytes(planned)}"
               + (" (equal)" if real == planned else f" (differs by {real - planned:+,} B)"))
    return {"requests": requests, "context": context, "served": served, "num_blocks": blocks,
            "cache_bytes": real, "planned_cache_bytes": planned, "seconds": seconds, "summary": summary}
