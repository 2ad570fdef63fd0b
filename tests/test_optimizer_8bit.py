"""8-bit optimizer states (issue 14): the block-wise code, torch's AdamW where the moments stay fp32, the
estimate against the profiler, the planner only when allowed, refusals, and a bit-identical resume."""
import copy
import math

import pytest
import torch

import memfit
from memfit import Config
from memfit.errors import PlanError
from memfit.planner.search import plan
from memfit.step import TrainStep
from memfit.strategies.optimizer_8bit import BLOCK, MIN_SIZE, STEPS, dequantize, eight_bit, quantize
from memfit.workloads import load_workload
from runs import whole_and_resumed
from truth import real_step_peak


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8])
def test_every_value_is_kept_within_one_grid_step(dtype):
    torch.manual_seed(0)
    x = torch.randn(3 * BLOCK + 17) * torch.logspace(-3, 0, 3 * BLOCK + 17)  # a partial last block
    x = x if dtype == torch.int8 else x.abs()
    codes, scales = quantize(x, dtype)
    assert codes.dtype == dtype and codes.shape == x.shape and scales.shape == (4,)
    back = dequantize(codes, scales)
    # rounding in log space: at most half a step (2^(1/16) - 1) from the value, sign kept
    assert ((back - x).abs() <= x.abs() * (2 ** (0.5 / STEPS) - 1) * (1 + 1e-6)).all()
    assert torch.equal(back.sign(), x.sign())
    tiny = torch.zeros(BLOCK)
    tiny[0], tiny[1] = 1.0, 2.0 ** (-40)  # below the grid's range under its block's largest: zero
    assert dequantize(*quantize(tiny, dtype))[1] == 0


def test_tensors_under_the_threshold_step_exactly_as_torch_adamw():
    torch.manual_seed(0)
    small, ref = torch.nn.Linear(30, 20), None
    ref = copy.deepcopy(small)
    for decoupled, make in ((True, torch.optim.AdamW), (False, torch.optim.Adam)):
        a, b = copy.deepcopy(small), copy.deepcopy(small)
        opt_a = make(a.parameters(), lr=1e-2, weight_decay=0.1)
        opt_b = eight_bit(lambda p: make(p, lr=1e-2, weight_decay=0.1))(b.parameters())
        assert opt_b.param_groups[0]["decoupled"] is decoupled
        for _ in range(4):
            x = torch.randn(8, 30)
            for m, o in ((a, opt_a), (b, opt_b)):
                o.zero_grad()
                m(x).square().sum().backward()
                o.step()
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert ref.weight.numel() < MIN_SIZE


def test_it_learns_as_adamw_does_on_a_transformers_model():
    wl = load_workload("hf:llama")

    def losses(config):
        torch.manual_seed(0)
        step = TrainStep(wl, config)
        torch.manual_seed(1)
        batch = wl.batch(config.global_batch)  # learnt by heart: random tokens hold nothing else to learn
        return [float(step(batch)) for _ in range(12)], step

    plain, _ = losses(Config(micro_batch=4))
    quantized, step = losses(Config(micro_batch=4, optimizer_8bit=True))
    assert quantized[0] == plain[0]  # the first forward precedes any update
    assert all(b < a for a, b in zip(quantized, quantized[1:]))
    # each moment is rounded by at most 2.2% a step: the progress made is AdamW's to a few percent
    assert abs(quantized[-1] - plain[-1]) <= 0.05 * (plain[0] - plain[-1])
    big = [p for p in step.model.parameters() if p.numel() >= MIN_SIZE]
    assert big and all(step.optimizer.state[p]["exp_avg_sq"].dtype == torch.uint8 for p in big)


@pytest.mark.parametrize("name", ["gpt-tiny", "hf:llama"])
def test_state_bytes_follow_the_layout_and_the_estimate_equals_the_profiler(name):
    wl = load_workload(name)
    config = Config(micro_batch=4, optimizer_8bit=True)
    est = memfit.estimate(wl, config, device="cpu")
    with torch.device("meta"):
        sizes = [p.numel() for p in wl.model().parameters()]
    layout = sum(2 * n + 8 * math.ceil(n / BLOCK) if n >= MIN_SIZE else 8 * n for n in sizes)
    assert est.model_state_bytes["optimizer_state"] == layout
    assert est.peak_bytes == pytest.approx(real_step_peak(wl, config), rel=0.01)


def test_what_it_cannot_do_is_refused():
    wl = load_workload("gpt-tiny")
    sgd = memfit.Workload(model=wl.model, batch=wl.batch, loss=wl.loss,
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(memfit.MemfitError, match="Adam and AdamW; the workload's optimizer is SGD"):
        memfit.estimate(sgd, Config(optimizer_8bit=True))
    with pytest.raises(memfit.MemfitError, match="FSDP"):
        Config(optimizer_8bit=True, gpus=2, data_parallel="fsdp")
    with pytest.raises(memfit.MemfitError, match="cannot allow 4bit"):
        plan(wl, 8, allow=["4bit"])


def test_the_planner_uses_it_only_when_allowed():
    """gpt-tiny, global batch 8, 3.2 MiB: fp32 moments do not fit at any micro-batch; 8-bit ones do."""
    wl = load_workload("gpt-tiny")
    fixed = dict(budget="3.2MiB", device="cpu", precision="fp32", activation_checkpoint="all")
    with pytest.raises(PlanError, match="nothing fits"):
        plan(wl, 8, **fixed)
    p = plan(wl, 8, allow=["8bit-optim"], **fixed)
    assert p.config.optimizer_8bit and p.confirmed and p.peak_bytes <= p.usable_bytes
    assert "changes the math" in p.config.describe()
    assert any("8-bit optimizer states allowed" in n for n in p.notes)


def test_a_resumed_bf16_pure_run_ends_bit_identical(tmp_path):
    """bf16 parameters: torch's loader would cast the fp32 block scales to bf16; they come back as saved."""
    wl, config = load_workload("gpt-tiny"), Config(micro_batch=8, precision="bf16-pure", optimizer_8bit=True)
    whole, resumed = whole_and_resumed(tmp_path, wl, config)
    assert resumed.config.optimizer_8bit
    assert (whole.out / "model.safetensors").read_bytes() == (resumed.out / "model.safetensors").read_bytes()
