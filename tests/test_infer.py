"""Serving memory (`memfit infer`): KV bytes per layer kind stated by hand from each engine's formula, vLLM's
block arithmetic, published vLLM start-up logs, transformers' generate against the profiler, and the errors."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from memfit.cli import main  # noqa: E402
from memfit.errors import ConfigError, PlanError  # noqa: E402
from memfit.inference import engines, kv  # noqa: E402
from memfit.inference.serve import infer, inverse, model_config  # noqa: E402
from memfit.memory.devices import get_device  # noqa: E402

CONFIGS = Path(__file__).parent / "data" / "hf_configs"
GiB = 2**30


def cfg(name):
    return model_config(f"hf:{CONFIGS / name}.json")


def model(name):
    return f"hf:{CONFIGS / name}.json"


# ------------------------------------------------------------------------------------ KV bytes by hand

def test_dense_gqa_counts_kv_heads_not_attention_heads():
    caches = kv.layer_caches(cfg("llama-3.1-8b"))
    # 32 layers x 8 KV heads x (128 + 128) x 2 bytes; the naive formula's 32 attention heads are 4x that
    assert kv.bytes_per_token(caches) == 32 * 8 * 256 * 2 == 131_072
    assert kv.naive_bytes_per_token(cfg("llama-3.1-8b")) == 4 * 131_072
    assert caches[0].page_bytes(16) == 16 * 8 * 256 * 2  # vLLM's FullAttentionSpec page
    assert kv.bytes_per_token(kv.layer_caches(cfg("llama-3.1-8b"), "fp8")) == 32 * 8 * 256 * 1
    assert kv.bytes_per_token(kv.layer_caches(cfg("llama-3.1-8b"), tp=2)) == 32 * 4 * 256 * 2
    # more ranks than KV heads: each rank holds one whole head, replicated
    assert kv.bytes_per_token(kv.layer_caches(cfg("llama-3.1-70b"), tp=16)) == 80 * 1 * 256 * 2


def test_mla_caches_one_latent_that_tensor_parallelism_does_not_split():
    for tp in (1, 8):
        caches = kv.layer_caches(cfg("deepseek-v3"), tp=tp)
        assert {c.kind for c in caches} == {kv.MLA}
        # 61 layers x (kv_lora_rank 512 + qk_rope_head_dim 64) x 2 bytes: no K and V, no heads
        assert kv.bytes_per_token(caches) == 61 * 576 * 2 == 70_272
        assert caches[0].page_bytes(16) == 16 * 576 * 2  # vLLM's MLAAttentionSpec page


def test_sliding_windows_keep_their_window_and_the_batch():
    gemma = kv.layer_caches(cfg("gemma-3-27b"))
    assert [c.kind for c in gemma[:6]] == [kv.SLIDING] * 5 + [kv.FULL]  # Gemma 3's 5:1 interleaving
    assert sum(c.kind == kv.FULL for c in gemma) == 10 and sum(c.kind == kv.SLIDING for c in gemma) == 52
    full, sliding = gemma[5], gemma[0]
    # pages of a 32,768-token request with 8,192 tokens batched: a full layer every token, a sliding layer
    # cdiv(min(1024 - 1 + 8192, 32768), 16) + 1 (vLLM's SlidingWindowSpec)
    assert full.pages(32_768, 16, 8192) == 2048
    assert sliding.pages(32_768, 16, 8192) == -(-9215 // 16) + 1 == 577
    # averaged over that request: 10 full layers hold every token, 52 sliding ones 9,215 of them
    per_layer = 16 * 256 * 2
    assert kv.bytes_per_token(gemma, 32_768, 8192) == pytest.approx((10 * 32_768 + 52 * 9215) * per_layer / 32_768)
    mistral = kv.layer_caches(cfg("mistral-7b-v0.1"))
    assert {c.kind for c in mistral} == {kv.SLIDING} and mistral[0].window == 4096
    assert mistral[0].pages(32_768, 16, 2048) == -(-(4095 + 2048) // 16) + 1 == 385


def test_hybrid_mamba_state_and_vllm_page_alignment():
    bamba = cfg("bamba-9b")
    caches = kv.layer_caches(bamba)
    assert sum(c is not None and c.kind == kv.MAMBA for c in caches) == 29
    # Mamba2 state: conv (4 - 1) x (128 x 64 + 2 x 1 x 128) and SSM 128 heads x 64 x 128, 2 bytes each
    state = (3 * (128 * 64 + 2 * 128) + 128 * 64 * 128) * 2
    assert state == 2_147_840 and caches[0].state_bytes == state
    layout = engines.vllm_layout(caches)
    # attention block: the smallest multiple of 16 tokens whose page (4,096 B a token) holds the state
    assert layout.block_size == 16 * -(-state // (16 * 4096)) == 528
    assert layout.page_bytes == 528 * 4096
    # 3 attention layers set the group size: 29 Mamba layers make 10 groups (one padded), attention 1
    assert layout.group_size == 3 and len(layout.groups) == 11
    assert layout.blocks_per_request(32_768, 2048) == -(-32_768 // 528) + 10


def test_vllm_groups_blocks_tokens_and_concurrency_by_hand():
    layout = engines.vllm_layout(kv.layer_caches(cfg("gemma-3-27b")))
    assert layout.group_size == 10 and len(layout.groups) == 1 + 6  # 52 sliding layers: 6 groups of 10
    page = 16 * 16 * 256 * 2
    available = 20 * GiB
    blocks = layout.num_blocks(available)
    assert blocks == available // page // 10
    assert layout.tokens(blocks) == blocks // 7 * 16
    assert layout.blocks_per_request(32_768, 8192) == 2048 + 6 * 577
    uniform = engines.vllm_layout(kv.layer_caches(cfg("llama-3.1-8b")))
    assert uniform.group_size == 32 and len(uniform.groups) == 1
    assert uniform.tokens(uniform.num_blocks(available)) == available // (16 * 131_072) * 16


# ------------------------------------------------------------------------------- published vLLM logs

def test_published_rtx_3090_row():
    """vllm-project/vllm#10517: Llama-3.1-8B-Instruct on an RTX 3090, max_model_len 20000 (V0: the profile run
    batches 20,000 tokens over 256 sequences): "Loading model weights took 14.9888 GB", kv_cache_size 3.81 GiB,
    1952 blocks, "Maximum concurrency for 20000 tokens per request: 1.56x"."""
    r = infer(model("llama-3.1-8b"), "rtx-3090", max_model_len=20_000, max_num_batched_tokens=20_000,
              max_num_seqs=256, vllm_version="0.6")
    assert r.weights_bytes / GiB == pytest.approx(14.9888, rel=0.02)
    assert r.kv_cache_bytes / GiB == pytest.approx(3.81, rel=0.10)
    assert r.kv_cache_tokens == pytest.approx(1952 * 16, rel=0.10)
    assert r.max_concurrency == pytest.approx(1.56, rel=0.10)
    # the same user's 29,000: vLLM refused it ("larger than ... (23648)"); memfit refuses it and names the length
    with pytest.raises(PlanError, match=r"longest that fits is 2[1-6],\d{3} tokens"):
        infer(model("llama-3.1-8b"), "rtx-3090", max_model_len=29_000, max_num_batched_tokens=29_000, max_num_seqs=256,
              vllm_version="0.6")


def test_published_70b_w8a8_row():
    """vllm-project/vllm#12569: Llama-3.1-70B-Instruct quantized.w8a8 (int8) on an H100 at 0.98, max_model_len 2048:
    "Loading model weights took 67.7229 GB", "# GPU blocks: 1381", "Maximum concurrency ... 10.79x"."""
    r = infer(model("llama-3.1-70b"), "h100", max_model_len=2048, gpu_memory_utilization=0.98, quantization="int8",
              vllm_version="0.7")
    assert r.weights_bytes / GiB == pytest.approx(67.7229, rel=0.02)
    assert r.num_blocks == pytest.approx(1381, rel=0.10)
    assert r.max_concurrency == pytest.approx(10.79, rel=0.10)


@pytest.mark.parametrize("name, published", [
    ("gemma-2-9b", dict(weights=17.22, kv=54.12, tokens=168_880, concurrency=20.60)),
    ("deepseek-v2-lite", dict(weights=29.43, kv=43.61, tokens=1_505_552, concurrency=183.78)),
])
def test_published_sliding_window_and_mla_rows(name, published):
    """llm-d-planner's vLLM 0.19.0 start-ups on an H100 (`--max-model-len 8192 --gpu-memory-utilization 0.95`):
    Gemma 2 9B (sliding-window layers beside full ones) and DeepSeek-V2-Lite (MLA). Weights within 2%, the KV cache
    within 10%; the tokens each GiB of cache holds equal the log's within its rounding of the GiB figure (0.01 GiB),
    so the pages per layer kind are vLLM's."""
    r = infer(model(name), "h100", max_model_len=8192, gpu_memory_utilization=0.95, max_num_batched_tokens=8192,
              max_num_seqs=1024, vllm_version="0.19")
    assert r.weights_bytes / GiB == pytest.approx(published["weights"], rel=0.02)
    assert r.kv_cache_bytes / GiB == pytest.approx(published["kv"], rel=0.10)
    assert r.kv_cache_tokens == pytest.approx(published["tokens"], rel=0.10)
    assert r.max_concurrency == pytest.approx(published["concurrency"], rel=0.10)
    rounding = 0.005 / published["kv"]
    assert r.kv_cache_tokens / (r.kv_cache_bytes / GiB) == pytest.approx(published["tokens"] / published["kv"],
                                                                           rel=rounding + 1e-4)


@pytest.mark.parametrize("version", [(0, 6), (0, 19)])
def test_the_sampler_holds_what_each_vllm_release_allocates(version):
    """The dummy sampler run over R rows of a V-token vocabulary (B = R x V x 4 bytes, one fp32 logits buffer),
    above its bf16 input, counted by hand from vLLM's code. Before 0.17 the peak is the top-p mask: the fp32
    copy, the sorted values, their int64 indices (2B), the cumulative softmax (B) and the boolean mask (B/4) live
    together, beside the greedy ids (8R), the top-k threshold (4R) and the mask's one-byte False: 5.25B. From
    0.17 the Triton kernel masks the copy in place with one fp32 vocabulary row per program as scratch (min(SMs,
    R) rounded up to a power of two, at most the SMs); the peak is the last op: the copy, its softmax, the
    exponential draw (3B), the scratch, and the greedy, argmax and chosen ids (8R each) with the choice's mask (R)."""
    from memfit.inference.trace import vllm_sampler
    from memfit.memory.fake import new_fake_mode
    from memfit.memory.tracker import LiveBytes

    rows, vocab, sms = 64, 1000, 40
    b = rows * vocab * 4
    with new_fake_mode():
        logits = torch.empty(rows, vocab, dtype=torch.bfloat16)
        tracker = LiveBytes("cpu", detail=False)
        tracker.track([logits])
        base = tracker.current
        with torch.no_grad(), tracker:
            vllm_sampler(logits, version, sms)
        tracker.close()
    if version < (0, 17):
        assert tracker.peak - base == 5 * b + b // 4 + 8 * rows + 4 * rows + 1
    else:
        scratch = 40 * vocab * 4  # min(40 SMs, 64 rows) programs, rounded up to 64, capped at the 40 SMs
        assert tracker.peak - base == 3 * b + scratch + 3 * 8 * rows + rows


# ------------------------------------------------------------------------------------- what fits

def test_inverse_finds_the_smallest_utilization():
    answer = inverse(model("llama-3.1-8b"), 32, 4096, device="h100")
    u = answer["gpu_memory_utilization"]
    assert answer["kv_cache_dtype"] == "auto" and answer["tp"] == 1
    assert infer(model("llama-3.1-8b"), "h100", max_model_len=4096, gpu_memory_utilization=u,
                 max_num_seqs=32).max_concurrency >= 32
    assert infer(model("llama-3.1-8b"), "h100", max_model_len=4096, gpu_memory_utilization=round(u - 0.01, 2),
                 max_num_seqs=32).max_concurrency < 32


def test_tensor_parallel_halves_weights_and_kv_per_rank():
    one = infer(model("llama-3-8b"), "h100", max_num_batched_tokens=8192, max_num_seqs=256)
    two = infer(model("llama-3-8b"), "h100", max_num_batched_tokens=8192, max_num_seqs=256, tp=2)
    # vllm-project/vllm#10511: "model weights take 14.96GiB", with -tp 2 "7.48GiB" per rank
    assert one.weights_bytes / GiB == pytest.approx(14.96, rel=0.02)
    assert two.weights_bytes / GiB == pytest.approx(7.48, rel=0.02)
    assert two.kv_bytes_per_token * 2 == one.kv_bytes_per_token


# ------------------------------------------------------------------------------------------ errors

@pytest.mark.parametrize("argv, words", [
    (["--max-model-len", "200000"], "longest it takes is --max-model-len 131072"),
    (["--engine", "tgi"], "memfit models vllm and transformers"),
    (["--device", "rtx-4090", "--tp", "1"], "try --tp"),
])
def test_bad_input_is_one_line(argv, words, capsys):
    name = "llama-3.1-70b" if "rtx-4090" in argv else "llama-3.1-8b"
    assert main(["infer", model(name), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err


def test_a_missing_config_is_named_as_such_when_asked_for_a_concurrency(capsys, tmp_path):
    """The search over settings for --concurrency says the model could not be read, not that nothing fits."""
    missing = tmp_path / "nope.json"
    assert main(["infer", f"hf:{missing}", "--concurrency", "4", "--context", "2048"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no such config file" in err and "do not fit" not in err


def test_json_has_the_figures(capsys):
    import json

    assert main(["infer", model("llama-3.1-8b"), "--max-model-len", "8192", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("weights_bytes", "activation_bytes", "kv_cache_bytes", "kv_cache_tokens", "max_concurrency"):
        assert out[key] > 0
    assert out["kv_cache_tokens"] == out["num_blocks"] * 16


def test_a_gpu_is_needed_for_engine_sizing():
    with pytest.raises(ConfigError, match="name one"):
        infer(model("llama-3.1-8b"), "cpu")


# --------------------------------------------------------------------------- transformers on this CPU

def test_generate_peak_matches_the_profiler():
    """transformers' generate with a dynamic cache, traced on fake tensors, against the profiler's peak of the real
    run (fp32 toy Llama): within 1% (BENCHMARKS.md has three models at three points each)."""
    import transformers

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from truth import profiler_peak

    from memfit.inference.trace import generate_options, generate_peak

    config = model_config("hf:llama")
    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(1, config.vocab_size, (4, 64))

    def run():
        with torch.no_grad():
            net.generate(ids, **generate_options(16))

    assert generate_peak(config, 4, 64, 16) == pytest.approx(profiler_peak(run), rel=0.01)


def test_run_allocates_the_planned_cache(capsys):
    assert main(["infer", "hf:llama", "--run", "--concurrency", "2", "--context", "64", "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["served"] == 2
    assert out["cache_bytes"] == out["planned_cache_bytes"]


TOY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=1000, max_position_embeddings=2048)


@pytest.mark.parametrize("name", ["llama", "qwen2", "mistral"])
def test_generate_batch_peak_matches_the_profiler(name):
    """transformers' generate_batch with a paged cache, its manager and batch processor traced on fake tensors,
    against the allocator's peak of the real run in the manager's thread (fp32 toy sizes; Mistral's 32-token window
    shorter than the longer prompts), at three requests x prompt points batched whole and one whose prefill is split
    over steps (4 x 48 tokens at 64 a step, where CPU flash attention's blocks are the peak's last 1.3%): within 1%."""
    import transformers

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    from truth import generate_batch_peak as measured

    from memfit.inference.run import planned_blocks
    from memfit.inference.trace import generate_batch_options, generate_batch_peak

    config = (transformers.AutoConfig.for_model("mistral", sliding_window=32, **TOY) if name == "mistral"
              else model_config(f"hf:{name}"))
    torch.manual_seed(0)
    net = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for requests, prompt, new, step in [(1, 16, 4, 20), (2, 40, 4, 88), (4, 60, 4, 256), (4, 48, 4, 64)]:
        _, blocks = planned_blocks(config, requests, prompt + new)
        cb = transformers.ContinuousBatchingConfig(num_blocks=blocks, max_batch_tokens=step)
        prompts = torch.randint(1, config.vocab_size, (requests, prompt)).tolist()

        def run():
            with torch.no_grad():
                net.generate_batch(prompts, generation_config=generate_batch_options(new),
                                   continuous_batching_config=cb, warmup=False)

        predicted = generate_batch_peak(config, requests, prompt, new, blocks, step)
        assert predicted == pytest.approx(measured(net, run), rel=0.01), (requests, prompt)


def test_run_refuses_a_model_that_may_not_fit_the_host(monkeypatch):
    """`--run` builds the model for real: an 8B config on this CPU is refused before anything is built."""
    import memfit.inference.run as run
    from memfit.errors import HostMemoryError

    monkeypatch.setattr(run, "available_host_bytes", lambda: 8 * 2**30)
    config = run.model_config("hf:tests/data/hf_configs/llama-3.1-8b.json")
    with pytest.raises(HostMemoryError, match="--run builds the model for real"):
        run._refuse_what_may_not_fit(config, 0)
    run._refuse_what_may_not_fit(run.model_config("hf:llama"), 0)  # a toy size runs


# ------------------------------------------------------------------------ transformers sized on a GPU

def test_transformers_engine_on_a_gpu_by_hand():
    """TOY Llama in bf16 on an H100, 256 tokens a step. By hand: 551,552 parameters (embeddings and LM head 128,000
    each, a layer 147,712, the final norm 128) at 2 bytes; a token's cache 2 layers x K,V x 2 heads x 32 x 2 B =
    512 B, a 256-token block and sector 131,072 B; per cache token transformers reckons the keys and values read
    back at SDPA's peak ((2 x 4 + 2) heads x 32 x 2 B = 640) and the read index (8), per sector the mask's 256 x 256
    x 2 B. The sectors are the most that fit in 0.05 of the device beside the weights, the 500 MiB context, the
    32 MiB cuBLAS workspace and the traced step; transformers' own default is its handler's arithmetic on 0.9 of
    the memory free after loading."""
    import transformers

    config = transformers.AutoConfig.for_model("llama", **TOY)
    r = infer(config, "h100", engine="transformers", gpu_memory_utilization=0.05, max_num_batched_tokens=256,
              max_model_len=1024)
    MiB, sector = 2**20, 131_072
    assert r.weights_bytes == 551_552 * 2 and r.kv_bytes_per_token == 512 and r.non_torch_bytes == 500 * MiB
    per_sector = sector + 256 * 648 + 256 * 256 * 2
    sectors = r.num_blocks  # one model block a sector here
    traced = r.activation_bytes - 32 * MiB - sectors * (per_sector - sector)
    assert 0 < traced < 64 * MiB
    fixed = r.weights_bytes + 500 * MiB + 32 * MiB + traced + 2 * sector
    budget = int(get_device("h100").memory_bytes * 0.05)
    assert fixed + sectors * per_sector <= budget < fixed + (sectors + 1) * per_sector
    assert r.kv_cache_bytes == (sectors + 2) * sector and r.kv_cache_tokens == sectors * 256
    assert r.max_concurrency == sectors / 4
    assert r.flags == f"ContinuousBatchingConfig(num_blocks={sectors}, max_batch_tokens=256)"
    # transformers' default: 0.9 of what mem_get_info leaves after the context and the weights, less the trash
    # sectors, 1,024 LM head rows (128 x 2 + 1000 x 4 B), 256 batch tokens at (2 x 704 + 48) B, then masks
    free = get_device("h100").memory_bytes - 500 * MiB - r.weights_bytes
    rest = int(free * 0.9) - 2 * sector - 1024 * 4256 - 256 * 1456
    s = rest // (sector + 256 * 648)
    s -= -(-(2 * 256 * (s * 256 + 256)) // (sector + 256 * 648 + 2 * 256 * 256))
    assert r.settings["transformers_default_num_blocks"] == s


def test_transformers_plan_runs_for_real_and_allocates_what_it_plans(capsys):
    """The ContinuousBatchingConfig the GPU plan prints (a sliver of an H100: a 35 MiB cache), served with
    generate_batch on this CPU in the model's dtype: transformers allocates the cache tensor memfit planned."""
    import json

    assert main(["infer", "hf:llama", "--engine", "transformers", "--run", "--gpu-memory-utilization", "0.008",
                 "--max-num-batched-tokens", "256", "--max-model-len", "256", "--concurrency", "2", "--context", "64",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["served"] == 2 and out["cache_bytes"] == out["planned_cache_bytes"] > 30 * 2**20


def test_multimodal_config_counts_the_vision_tower_and_projector():
    """Gemma 3 27B's whole config (Gemma3ForConditionalGeneration, as vLLM loads it). SigLIP by hand: patch embedding
    3 x 14 x 14 x 1152 + 1152, 4,096 positions x 1152; a layer's q, k, v, o 4 x (1152^2 + 1152), MLP 1152 x 4304 +
    4304 and 4304 x 1152 + 1152, two LayerNorms 4 x 1152, 27 of them; the post-LayerNorm 2 x 1152; the projector
    1152 x 5376 and its RMSNorm 1152: 423,060,336 parameters. With them the weights are within 2% of the published
    vLLM 0.19 start-up (51.45 GiB; the text model alone was -2.2%), the KV cache (the text layers') within 10%."""
    r = infer(model("gemma-3-27b-it"), "h100", max_model_len=8192, gpu_memory_utilization=0.95,
              max_num_batched_tokens=8192, max_num_seqs=1024, vllm_version="0.19")
    siglip = 3 * 14 * 14 * 1152 + 1152 + 4096 * 1152 + 27 * (4 * (1152**2 + 1152) + 1152 * 4304 + 4304
                                                             + 4304 * 1152 + 1152 + 4 * 1152) + 2 * 1152
    assert siglip + 1152 * 5376 + 1152 == 423_060_336
    assert any(n.startswith("Gemma3ForConditionalGeneration: 423,060,336 parameters") for n in r.notes)
    text = infer(model("gemma-3-27b"), "h100", max_model_len=8192, gpu_memory_utilization=0.95,
                 max_num_batched_tokens=8192, max_num_seqs=1024, vllm_version="0.19")
    assert r.weights_bytes - text.weights_bytes == 423_060_336 * 2
    assert r.weights_bytes / GiB == pytest.approx(51.45, rel=0.02)
    assert r.kv_cache_bytes / GiB == pytest.approx(19.53, rel=0.10)
    assert r.kv_bytes_per_token == text.kv_bytes_per_token


def test_transformers_inverse_finds_the_smallest_utilization():
    """--concurrency with --engine transformers: the utilization found holds the requests, one hundredth less does
    not (the masks and reads that grow with transformers' cache counted per request, not as fixed memory)."""
    import transformers

    config = transformers.AutoConfig.for_model("llama", **TOY)
    answer = inverse(config, 2000, 2048, device="h100", engine="transformers", max_num_batched_tokens=256)
    u = answer["gpu_memory_utilization"]
    assert answer["inference"].max_concurrency >= 2000 and answer["gpu_memory_utilization"] > 0.05
    assert infer(config, "h100", engine="transformers", gpu_memory_utilization=u - 0.01, max_num_batched_tokens=256,
                 max_model_len=2048).max_concurrency < 2000
