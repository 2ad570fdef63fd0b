"""Serving peaks traced on fake tensors: vLLM's profile run, and transformers' `generate` with a dynamic cache.

vLLM sizes its KV cache after one dummy forward of `max_num_batched_tokens` tokens split over
`min(tokens, max_num_seqs)` requests, then a dummy sampler run over one row of logits per request; the torch
peak of that run is subtracted from the budget. Here the transformers implementation of the model runs the
same forward on fake tensors: tokens flattened into one row, attention returning an empty output as vLLM's
backends do when profiling (no cache to write, no metadata), hidden states of the requests' last tokens only
through the LM head, then the sampler's steps as vLLM runs them for the dummy batch (fp32 logits, temperature,
top-k / top-p, softmax, exponential draw) in plain PyTorch: before vLLM 0.17 over sorted logits, from 0.17 on
masked in place by its Triton kernel (`vllm_sampler`). The activation peak of a
decoder lies inside one layer, so only the first layers are built (one of each attention kind, and of the
MoE's dense layers where it has them): every other layer repeats one traced.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys

import torch

from memfit.errors import ConfigError
from memfit.inference.kv import head_size, layer_kinds
from memfit.memory.fake import FakeBuild, new_fake_mode, quiet_fake_errors
from memfit.memory.kernels import CpuWorkspaces
from memfit.memory.routing import Routing
from memfit.memory.tracker import LiveBytes, PlainPaths
from memfit.torch_internals import DataDependentOutputException, TorchDispatchMode
from memfit.workloads.hf import masks_as_in_a_real_run

PROFILE_ATTENTION = "memfit_profile"


@dataclasses.dataclass
class Traced:
    bytes: int            # peak increase over the weights and inputs
    layers: int           # layers built and traced
    notes: list


def _profile_attention(module, query, key, value, attention_mask, **kwargs):
    """vLLM's attention when profiling: its output buffer, nothing computed (no metadata, no cache)."""
    b, heads, n, _ = query.shape
    return query.new_empty(b, n, heads, value.shape[-1]), None


def _no_mask(*args, **kwargs):
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PROFILE_ATTENTION, _profile_attention)
    AttentionMaskInterface.register(PROFILE_ATTENTION, _no_mask)


def layers_to_trace(config) -> int:
    """The first layers that hold one of each layer kind (and the first MoE layer after DeepSeek's dense ones)."""
    n = config.num_hidden_layers
    kinds = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or layer_kinds(config)
    first = {}
    for i, k in enumerate(kinds):
        first.setdefault(k, i)
    dense = getattr(config, "first_k_dense_replace", None) or 0
    return min(n, max(2, max(first.values()) + 1, dense + 1))


def per_rank(config, tp: int):
    """The config one tensor-parallel rank computes: heads and MLP width divided (head size kept)."""
    cfg = copy.deepcopy(config)
    if tp == 1:
        return cfg
    cfg.head_dim = head_size(config)
    cfg.num_attention_heads = config.num_attention_heads // tp
    kv = getattr(config, "num_key_value_heads", None)
    if kv:
        cfg.num_key_value_heads = max(1, kv // tp)
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if isinstance(getattr(config, name, None), int):
            setattr(cfg, name, getattr(config, name) // tp)
    return cfg


def _truncated(config, layers: int):
    cfg = copy.deepcopy(config)
    cfg.num_hidden_layers = layers
    for name in ("layer_types", "layers_block_type"):
        value = getattr(config, name, None)
        if isinstance(value, list):
            with contextlib.suppress(AttributeError):  # a property derived from other fields
                setattr(cfg, name, value[:layers])
    return cfg


def _build(config, dtype: torch.dtype, attention: str):
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
    except Exception as e:  # noqa: BLE001 - the config's own fault, in one line
        raise ConfigError(f"{config.model_type}: transformers cannot build a causal LM from this config "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


TRITON_SAMPLER = (0, 17)  # the vLLM release whose CUDA sampler masks top-k / top-p in place (vLLM PR 33538)


def vllm_sampler(logits: torch.Tensor, version: tuple[int, int], multiprocessors: int) -> torch.Tensor:
    """The memory-relevant steps of vLLM's sampler on its dummy batch (temperature 0.5, top-p 0.9, top-k the
    vocabulary less one): what the profile run holds after the forward. Before vLLM 0.17 the native top-k/top-p
    path sorts the logits (values and int64 indices, then a scatter back); from 0.17 a Triton kernel masks them
    in place, its scratch one fp32 vocabulary row per program (at most one a multiprocessor, a power of two
    below that, cached for later steps), so the sort's three logits-sized buffers are gone."""
    rows, vocab = logits.shape
    x = logits.to(torch.float32)
    greedy = x.argmax(dim=-1)
    x.div_(torch.full((rows, 1), 0.5, device=x.device))
    if version >= TRITON_SAMPLER:
        programs = min(multiprocessors, rows)
        scratch = torch.empty(min(1 << (programs - 1).bit_length(), multiprocessors), vocab, device=x.device)
        probs = x.softmax(dim=-1, dtype=torch.float32)  # scratch stays to the end: vLLM keeps it cached
    else:
        ordered, index = x.sort(dim=-1)
        kth = ordered.gather(1, torch.full((rows, 1), 1, dtype=torch.long, device=x.device))
        ordered.masked_fill_(ordered < kth, float("-inf"))
        probs = ordered.softmax(dim=-1)
        torch.cumsum(probs, dim=-1, out=probs)
        below = probs <= 1 - 0.9
        below[:, -1] = False
        ordered.masked_fill_(below, float("-inf"))
        del probs, below
        x = ordered.scatter(dim=-1, index=index, src=ordered)
        del ordered, index
        probs = x.softmax(dim=-1, dtype=torch.float32)
    draw = torch.empty_like(probs).exponential_()
    return torch.where(greedy >= 0, probs.div_(draw).argmax(dim=-1), greedy)


@contextlib.contextmanager
def _quiet_transformers():
    """transformers warns that its Mamba kernels fall back to PyTorch on a CPU: true, and not the user's concern
    (vLLM runs its own kernels)."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def profile_peak(config, tokens: int, requests: int, tp: int = 1, dtype: torch.dtype = torch.bfloat16,
                 version: tuple[int, int] = TRITON_SAMPLER, multiprocessors: int = 0) -> Traced:
    """The torch peak increase of vLLM `version`'s profile run for `tokens` tokens over `requests` requests, on
    one rank of a GPU with `multiprocessors` SMs."""
    _register()
    layers = layers_to_trace(config)
    cfg = _truncated(per_rank(config, tp), layers)
    mode = new_fake_mode()
    with mode, quiet_fake_errors(), _quiet_transformers():
        with FakeBuild(mode):
            model = _build(cfg, dtype, PROFILE_ATTENTION)
        model.eval()
        ids = torch.zeros(1, tokens, dtype=torch.long)
        positions = torch.arange(tokens).unsqueeze(0)
        step = tokens // requests
        last = torch.arange(1, requests + 1) * step - 1
        tracker = LiveBytes("cpu", detail=False)
        tracker.track(list(model.parameters()) + list(model.buffers()) + [ids, positions, last])
        base = tracker.current
        with torch.no_grad(), tracker:
            hidden = model.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
            chosen = hidden[0, last]
            del hidden
            logits = model.get_output_embeddings()(chosen)
            del chosen
            vllm_sampler(logits, version, multiprocessors)
            del logits
        tracker.close()
    notes = [f"profile forward traced over {layers} of {config.num_hidden_layers} layers (each further layer repeats "
             "one traced: the peak lies inside one layer or in the sampler)"]
    notes.append(f"vLLM {version[0]}.{version[1]}'s sampler: " + (
        f"top-k/top-p masked in place by its Triton kernel (scratch: one vocabulary row for each of up to "
        f"{multiprocessors} SMs)" if version >= TRITON_SAMPLER else "top-k/top-p over sorted logits"))
    if tp > 1:
        notes.append(f"per rank of {tp}: attention heads and MLP width divided, logits gathered whole for the sampler")
    return Traced(tracker.peak - base, layers, notes)


class _ReadsAnswered(TorchDispatchMode):
    """The values continuous batching reads back from tensors (the seed it broadcasts, the tokens each step
    sampled) are not in fake tensors; answered 0, which with end-of-sequence disabled changes no schedule: the
    scheduler's decisions come from the requests' lengths, not the tokens."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:
            if func is not torch.ops.aten._local_scalar_dense.default:
                raise
            return self.answer(args[0])

    def answer(self, read: torch.Tensor):
        return False if read.dtype is torch.bool else 0


class _RunsToTheEnd(_ReadsAnswered):
    """`generate` reads values fake tensors lack: whether every sequence has finished (its stop check, once a
    token) and whether the prompt holds negative ids. Answered as a run that generates all `new_tokens`
    (no end-of-sequence token before then: the longest, largest run): the stop check says "not finished"
    until the last token, every other read "no"."""

    def __init__(self, new_tokens: int):
        super().__init__()
        self.new_tokens = new_tokens
        self.checks = 0

    def answer(self, read: torch.Tensor):
        if _in_stop_check():
            self.checks += 1
            return self.checks >= self.new_tokens
        return super().answer(read)


def _in_stop_check() -> bool:
    """Whether the value is read by the stopping check called from generate's decoding loop (`_sample`)."""
    frame, callee = sys._getframe(1), None
    while frame is not None:
        if frame.f_code.co_name == "_sample":
            return callee == "__call__"
        callee, frame = frame.f_code.co_name, frame.f_back
    return False


def generate_peak(config, batch: int, prompt: int, new_tokens: int, dtype: torch.dtype = torch.float32) -> int:
    """Peak live bytes of `model.generate` (greedy, transformers' dynamic cache) on `batch` prompts of `prompt`
    tokens generating `new_tokens` each, weights and prompts included: the real `generate` run on fake tensors."""
    mode = new_fake_mode()
    with mode, quiet_fake_errors(), _quiet_transformers():
        with FakeBuild(mode):
            model = _build(config, dtype, "sdpa")
        model.eval()
        router = Routing()
        with router:
            ids = torch.ones(batch, prompt, dtype=torch.long)  # no pad token (0): every row full
        tracker = LiveBytes("cpu", detail=False, workspace=CpuWorkspaces())  # kernels' blocks, as generate_batch's
        tracker.track(list(model.parameters()) + list(model.buffers()) + [ids])
        tracker.plain = PlainPaths()  # what a run without dispatch modes makes in place (SDPA's mask add)
        # the prompt's and the attention mask's values ride beside the fake tensors (Routing's shadows), so
        # transformers leaves out the causal mask where the real run does (no padding)
        with torch.no_grad(), masks_as_in_a_real_run(), router, tracker, tracker.plain, _RunsToTheEnd(new_tokens):
            model.generate(ids, **generate_options(new_tokens))
        tracker.close()
    return tracker.peak


def generate_options(new_tokens: int) -> dict:
    """What memfit generates with, traced and measured alike: greedy, exactly `new_tokens` tokens."""
    return dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                attention_mask=None)





def generate_batch_peak(config, requests: int, prompt: int, new_tokens: int, num_blocks: int,
                        max_batch_tokens: int | None, dtype: torch.dtype = torch.float32,
                        cpu_kernels: bool = True, attention: str = "sdpa") -> int:
    """Peak live bytes of `model.generate_batch` (greedy, every request generating all `new_tokens`) on `requests`
    prompts of `prompt` tokens with `ContinuousBatchingConfig(num_blocks, max_batch_tokens)`, weights included;
    max_batch_tokens None is transformers' default (8,192).

    transformers' own manager and batch processor run on fake tensors, the loop its background thread runs
    (schedule, forward over the flattened batch, sample, update) stepped here in the caller's thread until every
    request is done: the paged cache and the static input/output tensors as transformers allocates them, and every
    step's forward and logits. CPU flash attention's per-thread blocks are counted at each call (measured, as
    `estimate` counts them): where the prefill is split over steps the peak is inside a step's attention (its chunk of
    queries against the keys read back from the cache), and those blocks were the 1.3% missing at 4 x 48-token
    prompts, 64 tokens a step."""
    import transformers
    from transformers.generation.continuous_batching.utils import WorkloadHints

    mode = new_fake_mode()
    with mode, quiet_fake_errors(), _quiet_transformers():
        with FakeBuild(mode):
            model = _build(config, dtype, attention)
        model.eval()
        tracker = LiveBytes("cpu", detail=False, workspace=CpuWorkspaces() if cpu_kernels else None)
        tracker.track(list(model.parameters()) + list(model.buffers()))
        hints = WorkloadHints(max_prompt_length=prompt, max_generated_length=new_tokens, num_requests=requests)
        with torch.no_grad(), tracker, _ReadsAnswered():
            manager = model.init_continuous_batching(
                generation_config=generate_batch_options(new_tokens), workload_hints=hints,
                continuous_batching_config=transformers.ContinuousBatchingConfig(num_blocks=num_blocks,
                                                                                 max_batch_tokens=max_batch_tokens))
            manager.add_requests(inputs=[[1] * prompt] * requests, max_new_tokens=new_tokens)
            processor = manager.batch_processor = manager._create_batch_processor()
            while processor.prepare_next_batch():
                processor._generation_step(model)
                processor.update_batch()
        tracker.close()
    return tracker.peak


def generation_step_peak(config, max_batch_tokens: int, dtype: torch.dtype, max_requests: int = 1024) -> Traced:
    """The live bytes of transformers' continuous batching on a GPU beyond its weights and its paged cache, at its
    largest step: `max_batch_tokens` tokens over min(tokens, max_requests) requests (1,024 is transformers'
    max_requests_per_batch), one logits row each, with SDPA. transformers' static batch tensors (inputs, outputs,
    write/read indices, the attention masks for this run's small cache) and the step's forward, logits and sampling,
    traced on fake tensors over the first layers only (each further one repeats one traced), CPU kernels' blocks
    left out (a GPU's are not theirs)."""
    from memfit.inference import engines, kv

    layers = layers_to_trace(config)
    cfg = _truncated(config, layers)
    requests = min(max_batch_tokens, max_requests)
    prompt = max_batch_tokens // requests
    geometry = engines.paged_geometry(kv.layer_caches(cfg, str(dtype).replace("torch.", "")))
    blocks = requests * geometry.blocks_for(prompt + 1)
    attention = "sdpa" if _supports_sdpa(config) else "eager"  # transformers then serves it with paged|eager
    from unittest import mock

    from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler

    # fake tensors take no memory: transformers' check of its footprint against this machine's free memory would
    # refuse a GPU-sized step on a small host
    with mock.patch.object(PagedAttentionMemoryHandler, "get_available_memory", lambda self: 1 << 62):
        peak = generate_batch_peak(cfg, requests, prompt, 1, blocks, requests * prompt, dtype, cpu_kernels=False,
                                   attention=attention)
    with torch.device("meta"):
        weights = sum(t.numel() * t.element_size() for m in [_build(cfg, dtype, attention)]
                      for t in [*m.parameters(), *m.buffers()])
    # the static tensors that grow with the cache (attention masks, read index) are this run's small cache's here;
    # the caller counts them for the cache it plans
    readable = geometry.readable_tokens(blocks)
    masks = len(geometry.block_bytes) if "sliding" in geometry.block_bytes else 1
    grows = readable * (masks * requests * prompt * dtype.itemsize + len(geometry.block_bytes) * 8)
    notes = [f"a step of {requests * prompt:,} tokens over {requests:,} requests traced over {layers} of "
             f"{config.num_hidden_layers} layers, " + ("SDPA (transformers' choice without a flash-attention package)"
             if attention == "sdpa" else "paged eager attention (the model has no SDPA path)")]
    return Traced(peak - weights - geometry.cache_bytes(blocks) - grows, layers, notes)


def _supports_sdpa(config) -> bool:
    import transformers

    return getattr(transformers.AutoModelForCausalLM._model_mapping[type(config)], "_supports_sdpa", True)


def generate_batch_options(new_tokens: int):
    """What `memfit infer --run` generates with, traced and measured alike: greedy, exactly `new_tokens` tokens."""
    import transformers

    return transformers.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)
