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
    # rows are blocked on their own (each ends in its own short block): a row's codes are the same alone
    rows = torch.stack([x, x.flip(0) * 3])
    codes, scales = quantize(rows, dtype)
    assert codes.shape == rows.shape and scales.shape == (2, 4)
    for row, c, sc in zip(rows, codes, scales):
        assert all(torch.equal(a, b) for a, b in zip((c, sc), quantize(row, dtype)))
    assert torch.equal(dequantize(codes, scales)[1], dequantize(codes[1], scales[1]))


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
    big = [p for p in step.model.parameters() if p.numel() >= MIN_SIZE and p.dim() > 1]
    assert big and all(step.optimizer.state[p]["exp_avg_sq"].dtype == torch.uint8 for p in big)


@pytest.mark.parametrize("name", ["gpt-tiny", "hf:llama"])
def test_state_bytes_follow_the_layout_and_the_estimate_equals_the_profiler(name):
    wl = load_workload(name)
    config = Config(micro_batch=4, optimizer_8bit=True)
    est = memfit.estimate(wl, config, device="cpu")
    with torch.device("meta"):
        shapes = [p.shape for p in wl.model().parameters()]
    # codes for each element, a scale per block of each row; fp32 moments for small or one-dimensional tensors
    layout = sum(2 * math.prod(s) + 8 * s[0] * math.ceil(math.prod(s[1:]) / BLOCK)
                 if len(s) > 1 and math.prod(s) >= MIN_SIZE else 8 * math.prod(s) for s in shapes)
    assert est.model_state_bytes["optimizer_state"] == layout
    assert est.peak_bytes == pytest.approx(real_step_peak(wl, config), rel=0.01)


def test_what_it_cannot_do_is_refused():
    wl = load_workload("gpt-tiny")
    sgd = memfit.Workload(model=wl.model, batch=wl.batch, loss=wl.loss,
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    with pytest.raises(memfit.MemfitError, match="Adam and AdamW; the workload's optimizer is SGD"):
        memfit.estimate(sgd, Config(optimizer_8bit=True))
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


def test_on_fsdp_ranks_the_state_is_sharded_with_the_rows_and_trains_and_resumes_as_one_process(tmp_path):
    """Blocks follow rows, so two FSDP ranks hold whole blocks of their rows: the same moments as one process
    (the Net's 100-row and 48-wide matrices: flat blocks would straddle the shard's edge), codes and scales
    sharded as the parameter (DTensors), and a checkpoint the ranks write with DCP resumes in one process
    exactly. A gradient reduced in another order can put a moment on the other side of a grid step: that
    weight then differs by a fraction of its updates (at most lr a step), all others by float sums alone."""
    from torch.distributed.tensor import DTensor

    from memfit.runtime import checkpoints as ckpt
    from memfit.runtime.trainer import Trainer
    from test_data_parallel import WORKLOAD, _lowest_rank_peak
    from truth import on_gloo_ranks

    steps, lr = 2, 1e-3  # WORKLOAD's AdamW
    one = Trainer(WORKLOAD, Config(micro_batch=4, grad_accum=4, optimizer_8bit=True), seed=0, global_batch=16)
    one_losses = [one.step() for _ in range(steps)]
    one_weights = {n: p.detach().clone() for n, p in one.model.named_parameters()}
    one_losses.append(one.step())
    cfg = Config(micro_batch=4, grad_accum=2, gpus=2, data_parallel="fsdp", optimizer_8bit=True)

    def on_rank(rank):
        trainer = Trainer(WORKLOAD, cfg, seed=0, global_batch=16)
        losses = [trainer.step() for _ in range(steps)]
        sharded = {k: isinstance(v, DTensor) and v.placements == p.placements
                   for p, s in trainer.optimizer.state.items() for k, v in s.items() if isinstance(v, torch.Tensor)}
        path = ckpt.save_sharded(tmp_path, steps, model=trainer.model, optimizer=trainer.optimizer, config=cfg)
        weights = {n: p.full_tensor().detach().numpy().copy() for n, p in trainer.model.named_parameters()}
        return str(path), losses + [trainer.step()], weights, sharded

    for path, losses, weights, sharded in on_gloo_ranks(2, on_rank):
        assert "exp_avg_scale" in sharded and all(sharded.values())
        assert losses == pytest.approx(one_losses, rel=1e-5)
    state = ckpt.load_checkpoint(path)
    diffs = torch.cat([(torch.from_numpy(weights[n]) - w).abs().flatten() for n, w in one_weights.items()])
    assert (diffs > 1e-5).float().mean() <= 1e-3 and diffs.max() <= steps * lr
    resumed = Trainer(WORKLOAD, Config(micro_batch=4, grad_accum=4, optimizer_8bit=True), seed=0, global_batch=16)
    ckpt.restore(state, model=resumed.model, optimizer=resumed.optimizer, path=path)
    resumed.step_count = steps
    assert resumed.step() == pytest.approx(losses[-1], rel=1e-5)
    fsdp = cfg.replace(micro_batch=8, grad_accum=1)
    est = memfit.estimate(WORKLOAD, fsdp)
    assert est.peak_bytes == pytest.approx(_lowest_rank_peak(WORKLOAD, fsdp, est.peak_bytes), rel=0.01)


@pytest.mark.parametrize("paged", [False, True])
def test_a_fake_trace_updates_parameters_shaped_alike_from_one(monkeypatch, paged):
    """On fake tensors the prime makes the 8-bit state without updating, and in the measured step the first
    optimizer-phase update of parameters shaped alike is traced for all of them, and the first of a parameter's
    full chunks for all but its last: every figure, every recorded op and the paged bytes as when each is
    traced (an 8B's update is ~40,000 ops)."""
    import contextlib

    import memfit.memory.estimate as estimate_module
    from memfit.strategies import optimizer_8bit

    monkeypatch.setattr(optimizer_8bit, "CHUNK", 20 * BLOCK)  # 80 rows: (256, 64) in 4 chunks, the last partial
    updates = []
    real_update = optimizer_8bit.Adam8bit._update
    monkeypatch.setattr(optimizer_8bit.Adam8bit, "_update",
                        lambda self, p, group, update=True: (updates.append(update), real_update(self, p, group, update)))
    wl = load_workload("gpt-tiny")  # blocks of identical parameters
    config = Config(micro_batch=2, precision="fp32", optimizer_8bit=True, paged_optimizer=paged)
    once = estimate_module.probe(wl, config, device="h100", isolate=False)
    traced = updates.count(True)
    updates.clear()
    monkeypatch.setattr(estimate_module, "chunks_traced_once", lambda tracer: contextlib.nullcontext())
    monkeypatch.setattr(estimate_module, "state_made_only", contextlib.nullcontext)
    each = estimate_module.probe(wl, config, device="h100", isolate=False)
    assert traced * 3 < updates.count(True)  # the prime's updates and the repeated ones were left out
    assert once.ops == each.ops
    for field in ("peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes", "host_peak_bytes", "phase_peaks",
                  "flops", "breakdown", "moved_bytes", "model_state_bytes"):
        assert getattr(once.estimate, field) == getattr(each.estimate, field), field
