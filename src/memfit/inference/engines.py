"""How serving engines turn memory into cache: vLLM's budget and block arithmetic, and transformers' continuous
batching cache geometry. Written from the engines' documented behaviour and source (vLLM `gpu_worker`,
`kv_cache_utils`, `kv_cache_interface`; transformers `generation/continuous_batching/cache.py`); none of it
needs the engines installed.

vLLM: `available = total × gpu_memory_utilization − (weights + the profile run's torch peak increase +
non-torch memory)`; the layers are put in groups of equal size with one page size (a hybrid model's Mamba
state padded to an attention page, the attention block grown to hold it); `num_blocks = available // page //
group_size`; the log's "GPU KV cache size" is `num_blocks // groups × block_size` tokens and "Maximum
concurrency for L tokens" is num_blocks over the pages one L-token request takes in every group.
"""
from __future__ import annotations

import dataclasses
import math

from memfit.errors import ConfigError, PlanError
from memfit.inference.kv import MAMBA, MLA, LayerCache

VLLM_BLOCK = 16           # default block size (tokens per page); FlashAttention needs a multiple of 16
MLA_ALIGNMENT = 64        # MLA backends' kernel block alignment


@dataclasses.dataclass(frozen=True)
class Group:
    cache: LayerCache
    block_size: int
    layers: int           # layers of this kind in the group (the group size, padding included)


@dataclasses.dataclass
class VllmLayout:
    """The KV cache groups vLLM makes of a model's layers, and the one page size they share."""
    groups: list[Group]
    group_size: int
    page_bytes: int
    notes: list

    @property
    def block_size(self) -> int:
        return min(g.block_size for g in self.groups)

    def blocks_per_request(self, length: int, batched_tokens: int) -> int:
        """Pages one request of `length` tokens takes, over every group (vLLM's max concurrency divisor)."""
        return sum(g.cache.pages(length, g.block_size, batched_tokens) for g in self.groups)

    def bytes_for(self, length: int, batched_tokens: int) -> int:
        """Cache one request of `length` tokens needs (what vLLM checks max_model_len against)."""
        return self.group_size * self.page_bytes * self.blocks_per_request(length, batched_tokens)

    def num_blocks(self, available: int) -> int:
        return max(0, available // self.page_bytes // self.group_size)

    def tokens(self, num_blocks: int) -> int:
        """"GPU KV cache size: N tokens" for a cache of num_blocks."""
        return num_blocks // len(self.groups) * self.block_size

    def longest(self, available: int, limit: int, batched_tokens: int) -> int:
        """The longest request that fits in `available` (vLLM's estimated maximum model length), up to limit."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.bytes_for(mid, batched_tokens) <= available:
                lo = mid
            else:
                hi = mid - 1
        return lo


def vllm_layout(caches: list[LayerCache | None], block_size: int | None = None) -> VllmLayout:
    """vLLM's grouping. One kind of layer everywhere: one group of all layers. Several kinds (Gemma's sliding
    and full layers, a hybrid's Mamba and attention layers): the page sizes are made equal first (a Mamba
    state padded to an attention page of the smallest aligned block size that holds it; a smaller attention
    page's block size multiplied up), then each kind is cut into groups of the smallest kind's layer count
    (the largest's where that is under 1.5 times it), the last group of a kind padded."""
    layers = [c for c in caches if c is not None]
    if not layers:
        raise ConfigError("the model has no layer that caches anything (an attention-free model needs no KV cache)")
    notes = []
    attention = [c for c in layers if c.kind != MAMBA]
    mamba = [c for c in layers if c.kind == MAMBA]
    base = block_size or VLLM_BLOCK
    if mamba and attention:
        per_token = max(c.token_bytes for c in attention)
        align = MLA_ALIGNMENT if any(c.kind == MLA for c in attention) else VLLM_BLOCK
        needed = align * -(-mamba[0].state_bytes // (align * per_token))
        if base < needed:
            notes.append(f"attention block size set to {needed} tokens so that an attention page holds a Mamba "
                         f"state ({mamba[0].state_bytes / 2**20:.2f} MiB), as vLLM sets it")
            base = needed
        page = base * per_token
        notes.append(f"Mamba state padded from {mamba[0].state_bytes:,} to {page:,} bytes (one attention page)")
        blocks = {c: base for c in attention}
        pages = {c: page for c in set(layers)}
    else:
        pages = {c: c.page_bytes(base) for c in set(layers)}
        blocks = {c: base for c in set(layers)}
    page = max(pages.values())
    for c, p in pages.items():
        if p != page:
            if c.kind == MAMBA or page % p:
                raise ConfigError("the layers' page sizes cannot be made equal by vLLM's rule (the largest is not a "
                                  "multiple of the others)")
            blocks[c] = blocks[c] * (page // p)
    counts: dict[LayerCache, int] = {}
    for c in layers:
        counts[c] = counts.get(c, 0) + 1
    if len(counts) == 1:
        (c, n), = counts.items()
        return VllmLayout([Group(c, blocks.get(c, base), n)], n, page, notes)
    size = min(counts.values())
    if max(counts.values()) < 1.5 * size:
        size = max(counts.values())
    groups = []
    for c, n in counts.items():
        groups += [Group(c, blocks.get(c, base), size)] * -(-n // size)
        if n % size:
            notes.append(f"{size - n % size} padding layer(s) added to the last group of {c.kind} layers, as vLLM does")
    return VllmLayout(groups, size, page, notes)


@dataclasses.dataclass
class Budget:
    """vLLM's memory budget on one rank, in bytes."""
    total: int
    utilization: float
    weights: int
    activation: int       # the profile run's torch peak increase
    non_torch: int        # memory outside PyTorch's allocator that the profile run adds (NCCL, kernels loaded)

    @property
    def requested(self) -> int:
        return int(self.total * self.utilization)

    @property
    def available(self) -> int:
        """Left for the KV cache (vLLM's "Available KV cache memory")."""
        return self.requested - self.weights - self.activation - self.non_torch

    @property
    def fixed(self) -> int:
        return self.weights + self.activation + self.non_torch

    def utilization_for(self, cache_bytes: int) -> float:
        """The smallest --gpu-memory-utilization (two decimals, rounded up) that leaves cache_bytes for the cache."""
        return math.ceil((self.fixed + cache_bytes) / self.total * 100) / 100


def check_vllm_fits(layout: VllmLayout, budget: Budget, max_model_len: int, batched_tokens: int) -> int:
    """The number of blocks, after vLLM's start-up checks; PlanError with what would fit where it refuses."""
    if budget.available <= 0:
        raise PlanError(f"no memory left for the KV cache: the weights ({budget.weights / 2**30:.2f} GiB), the profile "
                        f"run ({budget.activation / 2**30:.2f} GiB) and non-torch memory ({budget.non_torch / 2**30:.2f} GiB) "
                        f"take more than {budget.utilization:g} of {budget.total / 2**30:.2f} GiB")
    need = layout.bytes_for(max_model_len, batched_tokens)
    if need > budget.available:
        longest = layout.longest(budget.available, max_model_len, batched_tokens)
        higher = budget.utilization_for(need)
        raise PlanError(f"max_model_len {max_model_len:,} needs {need / 2**30:.2f} GiB of KV cache for one request, more "
                        f"than the {budget.available / 2**30:.2f} GiB left; the longest that fits is {longest:,} tokens "
                        f"(--max-model-len {longest})"
                        + (f", or --gpu-memory-utilization {higher:.2f} holds it" if higher <= 1 else ""))
    return layout.num_blocks(budget.available)


# ------------------------------------------------------------------------------- transformers' paged cache

TRANSFORMERS_PAGE = 256   # ContinuousBatchingConfig.page_size: tokens per page
TRASH_SECTORS = 2


@dataclasses.dataclass
class PagedGeometry:
    """transformers' PagedAttentionCache layout: one allocator per attention kind (full, sliding), a block
    being a page of every layer of that kind; sectors of lcm(blocks' bytes, 128) that every allocator can cut
    into its blocks; one flat uint8 tensor of num_sectors + 2 (never used) sectors."""
    page_tokens: int
    block_bytes: dict         # kind -> bytes of one block (a page of each of its layers)
    windows: dict             # kind -> sliding window (None: full)

    @property
    def sector_bytes(self) -> int:
        return math.lcm(*self.block_bytes.values(), 128)

    @property
    def model_block_bytes(self) -> int:
        """A page of every layer of the model: what ContinuousBatchingConfig.num_blocks counts."""
        return sum(self.block_bytes.values())

    def sectors(self, num_blocks: int) -> int:
        return max(1, -(-num_blocks * self.model_block_bytes // self.sector_bytes))

    def cache_bytes(self, num_blocks: int) -> int:
        """The cache tensor transformers allocates for num_blocks (two trash sectors included)."""
        return (self.sectors(num_blocks) + TRASH_SECTORS) * self.sector_bytes

    def readable_tokens(self, num_blocks: int) -> int:
        """Cache tokens a step may read back (transformers' max_tokens_read): the most any one kind's blocks hold."""
        data = self.sectors(num_blocks) * self.sector_bytes
        return max(data // b * self.page_tokens for b in self.block_bytes.values())

    def blocks_for(self, length: int) -> int:
        """Model blocks one request of `length` tokens holds (a sliding layer at most its window)."""
        bytes_needed = sum(-(-min(length, w or length) // self.page_tokens) * b
                           for (kind, b), w in zip(self.block_bytes.items(), self.windows.values()))
        return -(-bytes_needed // self.model_block_bytes)


def paged_geometry(caches: list[LayerCache | None], page_tokens: int = TRANSFORMERS_PAGE) -> PagedGeometry:
    """transformers' grouping: layers by attention kind (MLA layers in the full allocator with their latent
    pages); Mamba layers have no paged cache there."""
    blocks: dict[str, int] = {}
    windows: dict[str, int | None] = {}
    for c in caches:
        if c is None:
            continue
        if c.kind == MAMBA:
            raise ConfigError("transformers' continuous batching has no paged cache for Mamba layers; --engine vllm")
        kind = "sliding" if c.kind == "sliding" else "full"
        blocks[kind] = blocks.get(kind, 0) + c.page_bytes(page_tokens)
        windows[kind] = c.window if kind == "sliding" else None
    return PagedGeometry(page_tokens, blocks, windows)


TRANSFORMERS_BATCH_TOKENS = 8192   # PagedAttentionMemoryHandler._default_max_batch_tokens
TRANSFORMERS_REQUESTS = 1024       # FALLBACK_DEFAULTS["max_requests_per_batch"] (continuous_batching/initialization.py)


def transformers_handler(config, geometry: PagedGeometry, dtype, max_batch_tokens: int, free_bytes: int,
                         num_blocks: int | None = None):
    """transformers' own PagedAttentionMemoryHandler (generation/continuous_batching/cache.py, 5.x) for this
    geometry, as `generate_batch` builds it on a GPU with SDPA: its config resolved by transformers (no async
    batching, no decode block table without flash attention; `max_memory_percent` 0.9 without logits processors),
    the memory it measures (`total - used` from `mem_get_info`) given as `free_bytes`. Its arithmetic, used as is:
    with num_blocks None it takes 0.9 of the free memory, subtracts the two trash sectors, the LM head rows of 1,024
    requests (a model taking `logits_to_keep`), `max_batch_tokens` times its per-batch-token reckoning (I/O tensors
    and the larger of the LM head and attention peaks) and the attention masks, and makes the rest sectors, each
    costing its cache bytes plus, per cache token, the keys and values read back at the attention peak and the read
    index."""
    import inspect

    import torch
    import transformers
    from transformers.generation.continuous_batching import cache as cb_cache
    from transformers.generation.continuous_batching.initialization import resolve_continuous_batching_config

    cb = resolve_continuous_batching_config(
        config, transformers.ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens),
        None, False, torch.device("cuda"))
    share = cb.max_memory_percent

    class Measured(cb_cache.PagedAttentionMemoryHandler):
        def get_available_memory(self) -> int:
            return int(free_bytes * share)

    model_class = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    kinds = {"full": "full_attention", "sliding": "sliding_attention"}
    return Measured(config=config, cb_config=cb, dtype=dtype, bytes_per_sector=geometry.sector_bytes,
                    tokens_per_sector=max(geometry.sector_bytes // b * geometry.page_tokens
                                          for b in geometry.block_bytes.values()),
                    bytes_per_block=geometry.model_block_bytes,
                    attn_types=[kinds[k] for k in geometry.block_bytes],
                    model_supports_logits_to_keep="logits_to_keep" in inspect.signature(model_class.forward).parameters)
