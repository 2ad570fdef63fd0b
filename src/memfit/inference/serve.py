"""`infer`: where a serving engine's GPU memory goes, and how many requests of what length fit.

For vLLM every figure is the engine's own arithmetic (engines.py) on memfit's figures: the weights counted on
the meta device (weights.py), the profile run's activation peak traced on fake tensors (trace.py), the KV
cache per layer kind from the config (kv.py). Non-torch memory is the one assumption: a catalogue figure, said
in the notes. For transformers' continuous batching (`_transformers`) the same weights, a traced generation step
and transformers' own memory handler's per-cache-token reckoning (engines.transformers_handler).
"""
from __future__ import annotations

import dataclasses

from memfit.errors import ConfigError, PlanError
from memfit.inference import engines, kv
from memfit.inference.trace import profile_peak
from memfit.inference.weights import weight_bytes
from memfit.memory.devices import Device, get_device, nccl_bytes

ENGINES = ("vllm", "transformers")
KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16")
NON_TORCH = 256 << 20       # kernels loaded by the first forward, outside PyTorch's allocator (assumed)
HIGH_MEMORY = 70 << 30      # vLLM's server defaults differ above this device memory
TABLE_CONTEXTS = (2048, 8192, 32768, 131072)
VLLM_VERSION = "0.19"       # the release whose profile run is traced unless told otherwise


@dataclasses.dataclass
class Inference:
    """One serving configuration's memory on one rank of one device."""
    model: str
    device: str
    engine: str
    settings: dict             # the engine's settings used (given or defaulted)
    weights_bytes: int
    activation_bytes: int      # the profile run's torch peak increase (cuBLAS workspace included)
    non_torch_bytes: int
    kv_cache_bytes: int        # what the engine gives the cache
    kv_cache_tokens: int       # "GPU KV cache size: N tokens"
    kv_bytes_per_token: int    # on this rank, every growing layer
    max_concurrency: float     # requests of max_model_len at once
    num_blocks: int
    block_size: int
    layers: str                # the layer kinds, in words
    table: list = dataclasses.field(default_factory=list)  # [{"context": L, "requests": how many of L fit at once}]
    flags: str = ""            # the command line that serves this
    notes: list = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def vllm_defaults(device: Device) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) of `vllm serve` with chunked prefill: 8192 and 1024 on GPUs of
    70 GiB and more, 2048 and 256 below."""
    return (8192, 1024) if device.memory_bytes >= HIGH_MEMORY else (2048, 256)


def model_config(model):
    """The transformers config `model` names (hf: prefix optional), as a ConfigError where it cannot be read."""
    from memfit.workloads.hf import load_config

    name = model[3:] if isinstance(model, str) and model.startswith("hf:") else model
    try:
        return load_config(name)
    except Exception as e:  # WorkloadError: say it as a configuration problem of this command
        raise ConfigError(str(e).strip().splitlines()[0]) from None


def infer(model, device: str | Device = "h100", engine: str = "vllm", max_model_len: int | None = None,
          gpu_memory_utilization: float = 0.9, max_num_seqs: int | None = None,
          max_num_batched_tokens: int | None = None, kv_cache_dtype: str = "auto", quantization: str = "none",
          tp: int = 1, block_size: int | None = None, vllm_version: str = VLLM_VERSION) -> Inference:
    """Memory of serving `model` (a transformers config, a config.json path, a cached Hub id or a model type)
    on `device` with `engine`, per rank of `tp`. `vllm_version` ("0.19") picks the sampler its profile run
    traces: before 0.17 it sorts the dummy batch's logits, from 0.17 it masks them in place.

    Example::

        r = memfit.infer("hf:path/to/Llama-3.1-8B/config.json", device="h100", max_model_len=8192)
        print(r.kv_cache_tokens, r.max_concurrency)
    """
    if engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; memfit models {' and '.join(ENGINES)}")
    if kv_cache_dtype not in KV_DTYPES:
        raise ConfigError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}; known: {', '.join(KV_DTYPES)}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    for name, value in (("tp", tp), ("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs),
                        ("max_num_batched_tokens", max_num_batched_tokens), ("block_size", block_size)):
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    dev = device if isinstance(device, Device) else get_device(device)
    if dev.kind != "cuda":
        raise ConfigError(f"serving engines size their cache on a GPU; name one (--device h100), not {dev.name} "
                          "(`memfit infer --run` generates on this CPU)")
    whole = model_config(model)
    config = whole.get_text_config()  # a multimodal config's text model: its layers hold the KV cache
    positions = getattr(config, "max_position_embeddings", None)
    max_model_len = max_model_len or positions
    if positions and max_model_len > positions:
        raise ConfigError(f"--max-model-len {max_model_len:,} is longer than {config.model_type}'s "
                          f"{positions:,} positions; the longest it takes is --max-model-len {positions}")
    name = model if isinstance(model, str) else config.model_type
    if engine == "transformers":
        if tp != 1 or quantization != "none" or kv_cache_dtype != "auto":
            raise ConfigError("--engine transformers is sized for one GPU, the checkpoint's dtype and its KV dtype so "
                              "far: leave out --tp, --quantization and --kv-cache-dtype (or --engine vllm)")
        if config is not whole:
            raise ConfigError(f"--engine transformers sizes text models so far; {whole.model_type} is multimodal "
                              "(--engine vllm counts its vision tower)")
        return _transformers(name, config, dev, max_model_len, gpu_memory_utilization, max_num_batched_tokens)
    return _vllm(name, config, dev, max_model_len, gpu_memory_utilization, max_num_seqs, max_num_batched_tokens,
                 kv_cache_dtype, quantization, tp, block_size, release(vllm_version), whole)


def release(version: str) -> tuple[int, int]:
    """"0.19" or "0.19.1" -> (0, 19)."""
    parts = str(version).split(".")
    if len(parts) < 2 or not all(p.isdigit() for p in parts[:2]):
        raise ConfigError(f"--vllm-version {version!r}: give the release as MAJOR.MINOR, e.g. 0.19")
    return int(parts[0]), int(parts[1])


def _vllm(name, config, dev, max_model_len, utilization, max_num_seqs, batched, kv_dtype, quantization, tp,
          block_size, version: tuple[int, int], whole=None) -> Inference:
    default_tokens, default_seqs = vllm_defaults(dev)
    batched = batched or default_tokens
    seqs = max_num_seqs or default_seqs
    caches = kv.layer_caches(config, kv_dtype, tp)
    layout = engines.vllm_layout(caches, block_size)
    weights = weight_bytes(config, quantization, tp, whole=whole if whole is not config else None)
    traced = profile_peak(config, batched, min(seqs, batched), tp, version=version,
                          multiprocessors=dev.multiprocessors)
    nccl = nccl_bytes(dev, tp, "ddp", None) or 0
    budget = engines.Budget(dev.memory_bytes, utilization, weights.bytes, traced.bytes + dev.cublas_workspace_bytes,
                            NON_TORCH + nccl)
    if budget.available <= 0:
        raise PlanError(_too_big(name, config, dev, budget, tp, quantization))
    num_blocks = engines.check_vllm_fits(layout, budget, max_model_len, batched)
    per_request = layout.blocks_per_request(max_model_len, batched)
    notes = weights.notes + traced.notes + layout.notes + [
        f"non-torch memory assumed {NON_TORCH / 2**20:.0f} MiB" + (f" plus NCCL's {nccl / 2**30:.2f} GiB for --tp {tp}"
                                                                   if nccl else "") + " (catalogue figure)",
        "CUDA graphs are captured after the cache is sized (outside the budget, as vLLM up to 0.11 does); "
        "--enforce-eager leaves them out"]
    settings = dict(gpu_memory_utilization=utilization, max_model_len=max_model_len, max_num_seqs=seqs,
                    max_num_batched_tokens=batched, block_size=layout.block_size, kv_cache_dtype=kv_dtype,
                    quantization=quantization, tensor_parallel_size=tp, vllm_version=".".join(map(str, version)))
    flags = (f"vllm serve MODEL --gpu-memory-utilization {utilization:g} --max-model-len {max_model_len} "
             f"--max-num-seqs {seqs} --max-num-batched-tokens {batched}"
             + (f" --kv-cache-dtype {kv_dtype}" if kv_dtype != "auto" else "")
             + (f" --tensor-parallel-size {tp}" if tp > 1 else ""))
    table = [{"context": c, "requests": int(num_blocks // layout.blocks_per_request(c, batched))}
             for c in sorted({*TABLE_CONTEXTS, max_model_len}) if c <= max_model_len]
    return Inference(name, dev.name, "vllm", settings, weights.bytes, budget.activation, budget.non_torch,
                     budget.available, layout.tokens(num_blocks), int(kv.bytes_per_token(caches)),
                     num_blocks / per_request, num_blocks, layout.block_size, kv.describe(caches), table, flags, notes)


def _transformers(name, config, dev, max_model_len, utilization, batched) -> Inference:
    """transformers' continuous batching on one GPU. Weights as weights.py counts them in the model's dtype; the
    CUDA context and cuBLAS workspace from the device catalogue (assumed); a step of `max_batch_tokens` traced on
    fake tensors (trace.generation_step_peak); the static tensors that grow with the cache (attention masks, read
    index) and the keys and values read back at the attention peak, per cache token, as transformers' own memory
    handler reckons them. memfit's num_blocks is the most whose sectors fit in `utilization` of the device with all
    that; transformers' own choice when num_blocks is not given is its handler's arithmetic on the memory free after
    loading (engines.transformers_handler)."""
    import torch

    from memfit.inference.trace import generation_step_peak

    dtype = getattr(torch, kv.model_dtype(config))
    caches = kv.layer_caches(config)
    geometry = engines.paged_geometry(caches)
    batched = batched or engines.TRANSFORMERS_BATCH_TOKENS
    weights = weight_bytes(config, engine="transformers")
    traced = generation_step_peak(config, batched, dtype)
    non_torch = dev.context_bytes
    loaded = non_torch + weights.bytes
    handler = engines.transformers_handler(config, geometry, dtype, batched, dev.memory_bytes - loaded)
    sector, per_token = geometry.sector_bytes, handler.tokens_per_sector
    mask_per_sector = handler.attention_mask_bytes(batched, 1) - handler.attention_mask_bytes(batched, 0)
    per_sector = sector + per_token * handler.bytes_per_cache_token + mask_per_sector
    fixed = loaded + dev.cublas_workspace_bytes + traced.bytes + engines.TRASH_SECTORS * sector
    sectors = (int(dev.memory_bytes * utilization) - fixed) // per_sector
    per_request = geometry.blocks_for(max_model_len)
    num_blocks = max(0, sectors) * sector // geometry.model_block_bytes
    if num_blocks < per_request:
        raise PlanError(f"{name} on one {dev.name} at {utilization:g}: the weights ({weights.bytes / 2**30:.2f} GiB) and a "
                        f"step of {batched:,} tokens ({traced.bytes / 2**30:.2f} GiB) leave no cache for one request of "
                        f"{max_model_len:,} tokens; try a smaller --max-num-batched-tokens or --max-model-len, or "
                        "--engine vllm --tp 2")
    sectors = geometry.sectors(num_blocks)
    grows = sectors * (per_token * handler.bytes_per_cache_token + mask_per_sector)
    _, default_sectors = handler.infer_max_batch_tokens_and_num_sectors()
    default_blocks = default_sectors * sector // geometry.model_block_bytes
    default_total = fixed + default_sectors * per_sector
    requests = min(batched, engines.TRANSFORMERS_REQUESTS)
    notes = weights.notes + traced.notes + [
        f"CUDA context {non_torch / 2**20:.0f} MiB and cuBLAS workspace {dev.cublas_workspace_bytes / 2**20:.0f} MiB "
        "assumed (device catalogue)",
        f"growing with the cache: attention masks and read index (transformers' static tensors) and the keys and values "
        f"read back at the attention peak, {grows / 2**30:.2f} GiB, as transformers' memory handler reckons them",
        f"transformers' own num_blocks when not given: {default_blocks:,} (0.9 of the memory free after loading, its "
        f"handler's arithmetic), {default_total / dev.memory_bytes:.0%} of the device by memfit's count",
        "no GPU measured: the step's peak is checked against the CPU allocator, the cache tensor against transformers' "
        "own allocation (memfit infer --run)"]
    settings = dict(gpu_memory_utilization=utilization, max_model_len=max_model_len, max_num_seqs=requests,
                    max_num_batched_tokens=batched, block_size=geometry.page_tokens, kv_cache_dtype="auto",
                    quantization="none", tensor_parallel_size=1, num_blocks=num_blocks,
                    transformers_default_num_blocks=default_blocks, cache_growing_bytes=grows)
    flags = f"ContinuousBatchingConfig(num_blocks={num_blocks}, max_batch_tokens={batched})"
    table = [{"context": c, "requests": num_blocks // geometry.blocks_for(c)}
             for c in sorted({*TABLE_CONTEXTS, max_model_len}) if c <= max_model_len]
    return Inference(name, dev.name, "transformers", settings, weights.bytes,
                     traced.bytes + dev.cublas_workspace_bytes + grows, non_torch, geometry.cache_bytes(num_blocks),
                     num_blocks * geometry.page_tokens, int(kv.bytes_per_token(caches)), num_blocks / per_request,
                     num_blocks, geometry.page_tokens, kv.describe(caches), table, flags, notes)


def _too_big(name, config, dev, budget: engines.Budget, tp: int, quantization: str) -> str:
    """Nothing fits: what would (more ranks, a leaner layout), in one line."""
    need = budget.weights + budget.activation + budget.non_torch
    hints = []
    if quantization != "int4":
        hints.append("--quantization int4" if quantization != "none" else "--quantization fp8 or int4")
    heads = config.num_attention_heads
    more = next((n for n in (2, 4, 8, 16) if n > tp and heads % n == 0 and need * tp / n < dev.memory_bytes * 0.9), None)
    if more:
        hints.insert(0, f"--tp {more}")
    return (f"{name} does not fit one {dev.name} ({dev.memory_bytes / 2**30:.2f} GiB) at any setting: its weights "
            f"alone take {budget.weights / 2**30:.2f} GiB per rank and the profile run {budget.activation / 2**30:.2f} GiB"
            + (f"; try {' or '.join(hints)}" if hints else ""))


def inverse(model, concurrency: int, context: int, device: str | Device = "h100", **settings) -> dict:
    """The leanest vLLM setting that holds `concurrency` requests of `context` tokens at once: the smallest
    --gpu-memory-utilization at the given KV dtype and --tp, else an fp8 KV cache, else more GPUs."""
    trials = [dict(kv_cache_dtype=settings.pop("kv_cache_dtype", "auto"), tp=settings.pop("tp", 1))]
    trials += [dict(kv_cache_dtype="fp8", tp=trials[0]["tp"])] if trials[0]["kv_cache_dtype"] == "auto" else []
    trials += [dict(kv_cache_dtype=t["kv_cache_dtype"], tp=n) for n in (2, 4, 8) if n > trials[0]["tp"] for t in
               trials[:1]]
    settings["max_num_seqs"] = settings.get("max_num_seqs") or concurrency
    last = None
    for trial in trials:
        try:
            full = infer(model, device, max_model_len=context, gpu_memory_utilization=1.0, **settings, **trial)
        except (PlanError, ConfigError) as e:
            if isinstance(e, ConfigError) and trial is trials[0]:  # the user's own settings: not a matter of fit
                raise
            last = e
            continue
        grows = full.settings.get("cache_growing_bytes", 0)  # transformers' tensors that scale with its cache
        per_request = (full.kv_cache_bytes + grows) / full.max_concurrency if full.max_concurrency else float("inf")
        cache = per_request * concurrency
        fixed = full.weights_bytes + full.activation_bytes - grows + full.non_torch_bytes
        total = get_device(device).memory_bytes if not isinstance(device, Device) else device.memory_bytes
        utilization = -(-int(100 * (fixed + cache)) // total) / 100
        if utilization <= 1:
            chosen = infer(model, device, max_model_len=context, gpu_memory_utilization=max(utilization, 0.01),
                           **settings, **trial)
            if chosen.max_concurrency < concurrency:  # whole blocks: one hundredth more
                chosen = infer(model, device, max_model_len=context, gpu_memory_utilization=min(1.0, utilization + 0.01),
                               **settings, **trial)
            return {"concurrency": concurrency, "context": context, "gpu_memory_utilization": chosen.settings[
                "gpu_memory_utilization"], "kv_cache_dtype": trial["kv_cache_dtype"], "tp": trial["tp"],
                    "inference": chosen}
    raise PlanError(f"{concurrency} requests of {context:,} tokens do not fit on up to 8 {get_device(device).name if not isinstance(device, Device) else device.name}"
                    f" GPUs even with an fp8 KV cache" + (f" ({str(last).splitlines()[0]})" if last else ""))
