"""What one request's cache holds per layer, read off a transformers config: the layer kinds a serving engine
pages (full attention, sliding window, chunked local attention, MLA's latent, Mamba's state) and their bytes.

The per-token figures are the engines' own (vLLM's `kv_cache_interface` page sizes, transformers' cache
allocators): a full-attention page of B tokens holds `B × kv_heads × (head_size + head_size_v) × dtype`
bytes, an MLA page `B × (kv_lora_rank + qk_rope_head_dim) × dtype` (one latent, no K and V, not split by
tensor parallelism), a Mamba layer one state per request whatever its length. Naive `2 × layers × heads ×
dim` formulas count attention heads instead of KV heads and every layer as full; this module does neither.
"""
from __future__ import annotations

import dataclasses

from memfit.errors import ConfigError

FULL, SLIDING, CHUNKED, MLA, MAMBA = "full", "sliding", "chunked", "mla", "mamba"

# bytes of one cached element, by the names --kv-cache-dtype and transformers' dtypes take
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}


@dataclasses.dataclass(frozen=True)
class LayerCache:
    """One layer's cache on one tensor-parallel rank."""
    kind: str                 # FULL | SLIDING | CHUNKED | MLA | MAMBA
    kv_heads: int = 0         # KV heads this rank holds (MLA: 1, the shared latent)
    head_size: int = 0        # key width (MLA: the latent and the rotary key together)
    head_size_v: int = 0      # value width (MLA: 0, its latent is read as both)
    dtype_bytes: int = 2
    window: int | None = None  # sliding window or attention chunk, in tokens
    state_bytes: int = 0      # MAMBA: one request's conv and SSM state

    @property
    def token_bytes(self) -> int:
        """Bytes one token adds to this layer's cache (0 for a Mamba layer, whose state does not grow)."""
        return self.kv_heads * (self.head_size + self.head_size_v) * self.dtype_bytes

    def page_bytes(self, block_size: int) -> int:
        """One page: `block_size` tokens of this layer (a Mamba layer's page is its state)."""
        return self.state_bytes if self.kind == MAMBA else block_size * self.token_bytes

    def tokens_held(self, length: int, batched_tokens: int) -> int:
        """Tokens of a `length`-token request this layer keeps, as vLLM allocates them during chunked prefill:
        a sliding window keeps its last window - 1 tokens plus the newly scheduled ones, a chunked layer its
        chunk plus them, never more than the request."""
        if self.kind == SLIDING:
            return min(self.window - 1 + batched_tokens, length)
        if self.kind == CHUNKED:
            return min(self.window + batched_tokens, length)
        return length

    def pages(self, length: int, block_size: int, batched_tokens: int) -> int:
        """Pages one request of `length` tokens takes in this layer (vLLM's max_memory_usage_bytes / page):
        a sliding window one page more, as its window need not start at a page's edge."""
        if self.kind == MAMBA:
            return 1
        held = -(-self.tokens_held(length, batched_tokens) // block_size)
        return held + 1 if self.kind == SLIDING else held


def dtype_bytes(name) -> int:
    """Bytes of one element of a dtype named as a string or given as a torch dtype."""
    key = str(name).replace("torch.", "").lower()
    if key not in DTYPE_BYTES:
        raise ConfigError(f"unknown cache dtype {name!r}; known: {', '.join(sorted(DTYPE_BYTES))}")
    return DTYPE_BYTES[key]


def model_dtype(config) -> str:
    """The dtype the checkpoint is published in (config.torch_dtype / dtype), bf16 when it names none."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "bfloat16"
    key = str(value).replace("torch.", "")
    return "bfloat16" if key == "float32" else key  # engines serve fp32 checkpoints in half precision


def layer_kinds(config) -> list[str]:
    """The cache kind of every layer: transformers' `layer_types` where the config has them (Gemma 2/3's
    interleaving, Llama 4's chunked layers, the Mamba layers of hybrids), else sliding everywhere where a
    window is set (Mistral 7B v0.1), else full; MLA where the config has a KV latent (DeepSeek V2/V3)."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    if getattr(config, "kv_lora_rank", None):
        return [MLA] * n
    if types is None:
        window = getattr(config, "sliding_window", None)
        use = getattr(config, "use_sliding_window", True)
        return [SLIDING if window and use is not False else FULL] * n
    names = {"full_attention": FULL, "attention": FULL, "sliding_attention": SLIDING, "chunked_attention": CHUNKED,
             "linear_attention": MAMBA, "mamba": MAMBA, "mlp": None, "moe": None}
    kinds = []
    for t in types:
        if t not in names:
            raise ConfigError(f"{config.model_type}: layer type {t!r} has no cache model in memfit (known: "
                              f"{', '.join(k for k in names)})")
        kinds.append(names[t])
    if MAMBA in kinds and not hasattr(config, "mamba_d_state"):
        raise ConfigError(f"{config.model_type}: its linear-attention layers' state is not modelled by memfit "
                          "(Mamba and Mamba2 hybrids are)")
    return kinds


def head_size(config) -> int:
    explicit = getattr(config, "head_dim", None)
    return explicit or config.hidden_size // config.num_attention_heads


def kv_heads_per_rank(config, tp: int) -> int:
    """KV heads one rank holds: vLLM splits them over the ranks and replicates them when there are fewer
    heads than ranks (each rank then holds one)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if config.num_attention_heads % tp:
        raise ConfigError(f"--tp {tp} does not divide {config.model_type}'s {config.num_attention_heads} attention "
                          f"heads; tensor parallelism needs it to (e.g. --tp {_divisor_near(config.num_attention_heads, tp)})")
    if heads >= tp and heads % tp:
        raise ConfigError(f"--tp {tp} does not divide {config.model_type}'s {heads} KV heads")
    return max(1, heads // tp)


def _divisor_near(n: int, k: int) -> int:
    return max(d for d in range(1, k + 1) if n % d == 0)


def mamba_state_bytes(config, tp: int, element_bytes: int) -> int:
    """One request's Mamba state on one rank, as vLLM sizes it: Mamba2 (`mamba_n_heads`) a conv state of
    (d_conv - 1) × (inner + 2 × groups × d_state) and an SSM state of heads × d_head × d_state; Mamba1 a
    conv state of inner × (d_conv - 1) and an SSM state of inner × d_state; both in the model's dtype."""
    d_state, d_conv = config.mamba_d_state, config.mamba_d_conv
    heads = getattr(config, "mamba_n_heads", None)
    if heads is None:  # Mamba1 (Jamba)
        inner = config.mamba_expand * config.hidden_size // tp
        return (inner * (d_conv - 1) + inner * d_state) * element_bytes
    d_head = getattr(config, "mamba_d_head", None) or config.mamba_expand * config.hidden_size // heads
    groups = config.mamba_n_groups
    groups_per_rank = (groups + (0 if groups % tp == 0 else tp - groups)) // tp  # vLLM replicates groups
    inner = heads * d_head // tp
    conv = (d_conv - 1) * (inner + 2 * groups_per_rank * d_state)
    ssm = heads // tp * d_head * d_state
    return (conv + ssm) * element_bytes


def layer_caches(config, kv_dtype: str | None = None, tp: int = 1) -> list[LayerCache | None]:
    """Every layer's cache on one rank (None for a layer that caches nothing: NemotronH's MLP layers)."""
    kinds = layer_kinds(config)
    element = dtype_bytes(kv_dtype) if kv_dtype not in (None, "auto") else dtype_bytes(model_dtype(config))
    state_element = dtype_bytes(model_dtype(config))
    out: list[LayerCache | None] = []
    for kind in kinds:
        if kind is None:
            out.append(None)
        elif kind == MLA:
            out.append(LayerCache(MLA, 1, config.kv_lora_rank + config.qk_rope_head_dim, 0, element))
        elif kind == MAMBA:
            out.append(LayerCache(MAMBA, state_bytes=mamba_state_bytes(config, tp, state_element),
                                  dtype_bytes=state_element))
        else:
            window = {SLIDING: getattr(config, "sliding_window", None),
                      CHUNKED: getattr(config, "attention_chunk_size", None)}.get(kind)
            size = head_size(config)
            size_v = getattr(config, "v_head_dim", None) or size
            out.append(LayerCache(kind, kv_heads_per_rank(config, tp), size, size_v, element, window))
    return out


def bytes_per_token(caches: list[LayerCache | None], length: int | None = None, batched_tokens: int = 0) -> float:
    """Cache bytes per token of context on one rank: at `length`, the layers that hold fewer tokens (a
    window, a chunk) and Mamba's fixed state averaged over the request; without a length, the bytes a token
    adds to every layer that grows with context (what the cache costs per token while a request is short)."""
    if length is None:
        return sum(c.token_bytes for c in caches if c is not None)
    total = sum(c.state_bytes if c.kind == MAMBA else c.tokens_held(length, batched_tokens) * c.token_bytes
                for c in caches if c is not None)
    return total / length


def naive_bytes_per_token(config) -> int:
    """The formula calculators use, for comparison: 2 × layers × attention heads × head size × 2 bytes, every
    layer full and no GQA."""
    return 2 * config.num_hidden_layers * config.num_attention_heads * head_size(config) * 2


def describe(caches: list[LayerCache | None]) -> str:
    """"32 full (128 KiB/token)" style summary of the layer kinds."""
    counts: dict[str, int] = {}
    for c in caches:
        if c is not None:
            counts[c.kind] = counts.get(c.kind, 0) + 1
    words = {FULL: "full attention", SLIDING: "sliding window", CHUNKED: "chunked local", MLA: "MLA latent",
             MAMBA: "Mamba"}
    parts = []
    for kind, n in counts.items():
        c = next(x for x in caches if x is not None and x.kind == kind)
        extra = f" of {c.window:,} tokens" if c.window else ""
        parts.append(f"{n} {words[kind]}{extra}")
    return ", ".join(parts)


__all__ = ["LayerCache", "layer_caches", "layer_kinds", "bytes_per_token", "naive_bytes_per_token", "dtype_bytes",
           "model_dtype", "mamba_state_bytes", "describe", "FULL", "SLIDING", "CHUNKED", "MLA", "MAMBA"]
