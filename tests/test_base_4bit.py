"""4-bit base weights (QLoRA, issue 14): the NF4 levels, the stored layout and its rounding, the layer's
math and what it keeps for backward, a transformers model trained with it, the estimate against the
profiler, the planner only when allowed, refusals, and a bit-identical resume."""
import contextlib
import math

import pytest
import torch

import memfit
from memfit import Config
from memfit.planner.search import plan
from memfit.step import TrainStep
from memfit.strategies.base_4bit import ABSMAX_BLOCK, BLOCK, Linear4bit, nf4_levels
from memfit.strategies.optimizer_8bit import STEPS
from memfit.workloads import load_workload
from memfit.workloads.lora import lora
from runs import whole_and_resumed
from truth import real_step_peak

# bitsandbytes' NF4 code (QLoRA, Dettmers et al. 2023, appendix E), as published
PUBLISHED_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                 -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                 0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]


def test_the_levels_are_qlora_nf4():
    assert torch.allclose(nf4_levels(), torch.tensor(PUBLISHED_NF4), rtol=0, atol=1e-6)


def test_each_weight_is_rounded_to_a_level_of_its_block_and_stored_in_the_layout():
    torch.manual_seed(0)
    out_f, in_f = 37, 3 * BLOCK + 11  # a partial last block
    weight = torch.randn(out_f, in_f) * torch.logspace(-2, 0, in_f)
    layer = Linear4bit(weight, None, None)
    n = weight.numel()
    blocks = math.ceil(n / BLOCK)
    stored = {k: (v.dtype, v.numel()) for k, v in layer.state_dict().items()}
    assert stored == {"codes": (torch.uint8, blocks * BLOCK // 2), "absmax": (torch.int8, blocks),
                      "absmax_scale": (torch.int32, math.ceil(blocks / ABSMAX_BLOCK)), "absmax_mean": (torch.int32, 1)}
    back = layer.dequantize(torch.float32)
    padded = torch.nn.functional.pad(weight.reshape(-1), (0, blocks * BLOCK - n)).view(blocks, BLOCK)
    absmax = padded.abs().amax(dim=1, keepdim=True)
    # half the widest gap between levels (-1 to -0.70) of the block's absmax, plus that absmax's own rounding:
    # it is kept as an 8-bit code on the eighth-octave grid of (absmax - mean absmax), within half a step
    mean = absmax.mean()
    gap = max(b - a for a, b in zip(PUBLISHED_NF4, PUBLISHED_NF4[1:]))
    bound = 0.5 * gap * absmax + (2 ** (0.5 / STEPS) - 1) * (absmax - mean).abs()
    err = (torch.nn.functional.pad(back.reshape(-1), (0, blocks * BLOCK - n)).view(blocks, BLOCK) - padded).abs()
    assert (err <= bound * (1 + 1e-5)).all()
    assert 0.4 * bound.mean() < err.max()  # rounded, not kept


def test_the_layer_is_the_linear_of_its_weight_and_keeps_nothing_for_backward():
    torch.manual_seed(0)
    dense = torch.nn.Linear(300, 70)
    layer = Linear4bit(dense.weight, dense.bias, None)
    x = torch.randn(4, 5, 300, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layer(x)
    assert saved == []  # the weight is made again in backward; the input's not needed: the base is frozen
    y.square().sum().backward()
    weight = layer.dequantize(torch.float32).detach().requires_grad_(False)
    x2 = x.detach().clone().requires_grad_()
    y2 = torch.nn.functional.linear(x2, weight, dense.bias.detach())
    y2.square().sum().backward()
    # fp32 sums of 300 products: a few ulps apart at most (different kernels may order them differently)
    assert torch.allclose(y, y2, rtol=1e-5, atol=1e-5) and torch.allclose(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    bf16 = Linear4bit(dense.weight, dense.bias, torch.bfloat16)
    assert bf16(x).dtype == torch.float32  # computed in bf16, handed back in the input's dtype (bitsandbytes')


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_qlora_on_a_transformers_model_and_the_estimate_equals_the_profiler(precision):
    wl = lora(load_workload("hf:llama"), r=8, targets="all-linear")
    config = Config(micro_batch=2, precision=precision, base_4bit=True)
    torch.manual_seed(0)
    step = TrainStep(wl, config)
    names = {n for n, m in step.model.named_modules() if isinstance(m, torch.nn.Linear) and "lora_" not in n}
    assert names and all("lm_head" in n for n in names)  # every base Linear quantized but the output head
    assert not any(p.requires_grad for m in step.model.modules() if isinstance(m, Linear4bit) for p in m.parameters())
    torch.manual_seed(1)
    batch = wl.batch(2)
    losses = [float(step(batch)) for _ in range(6)]
    assert losses[-1] < losses[0]
    est = memfit.estimate(wl, config, device="cpu")
    assert est.peak_bytes == pytest.approx(real_step_peak(wl, config), rel=0.01)
    plain = memfit.estimate(wl, config.replace(base_4bit=False), device="cpu")
    # the base's Linear weights (fp32: 4 bytes a weight) become 0.52 bytes a weight
    assert est.model_state_bytes["parameters"] < 0.6 * plain.model_state_bytes["parameters"]
    assert est.parameters == plain.parameters  # a 4-bit layer counts as its weights, not the bytes storing them


def test_what_it_cannot_do_is_refused():
    with pytest.raises(memfit.MemfitError, match="add --lora"):
        memfit.estimate(load_workload("gpt-tiny"), Config(base_4bit=True))


def test_the_planner_quantizes_the_base_only_when_allowed():
    """hf:llama, global batch 8 in 4.5 MiB: neither the full fine-tune nor LoRA on an fp32 base fits."""
    p = plan(load_workload("hf:llama"), 8, budget="4.5MiB", device="cpu", precision="fp32",
             activation_checkpoint="all", allow=["qlora"])
    assert p.config.base_4bit and p.confirmed and p.peak_bytes <= p.usable_bytes
    assert "changes the math" in p.config.describe()
    assert "--base-4bit" in p.notes[0] and "full fine-tune does not fit" in p.notes[1]


def test_a_resumed_run_ends_bit_identical(tmp_path):
    wl = lora(load_workload("hf:llama"), r=4, targets="q_proj,v_proj")
    whole, resumed = whole_and_resumed(tmp_path, wl, Config(micro_batch=4, base_4bit=True))
    assert resumed.config.base_4bit
    assert (whole.out / "model.safetensors").read_bytes() == (resumed.out / "model.safetensors").read_bytes()


def test_a_fake_trace_records_a_weights_identical_chunks_from_one(monkeypatch):
    """On fake tensors the first of a weight's identical chunks is traced and its ops recorded once for each
    of them: the peak, the allocator's figures and every recorded op as when each chunk is traced (a
    405B's step has ~575,000 chunks)."""
    import memfit.memory.estimate as estimate_module
    from memfit.strategies import base_4bit

    # many chunks a weight, and a partial last one (k_proj's 8,192 weights: 10 of 768 and 512 left over)
    monkeypatch.setattr(base_4bit, "CHUNK", 12 * BLOCK)
    wl = lora(load_workload("hf:llama"), r=4, targets="q_proj,v_proj")
    config = Config(micro_batch=2, precision="bf16", base_4bit=True, activation_checkpoint="all")
    once = estimate_module.probe(wl, config, device="h100")
    monkeypatch.setattr(estimate_module, "chunks_traced_once", lambda tracer: contextlib.nullcontext())
    each = estimate_module.probe(wl, config, device="h100")
    assert once.ops == each.ops and len(once.ops) > 1000
    for field in ("peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "phase_peaks", "flops",
                  "recompute_flops", "breakdown"):
        assert getattr(once.estimate, field) == getattr(each.estimate, field), field
