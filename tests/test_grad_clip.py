"""Gradient clipping (`Workload.max_grad_norm`): torch's clip_grad_norm_ math in each path of the step, the
norm over every rank's shards under FSDP, its memory against measurements, what it rules out, and a run that
logs the norm and resumes bit for bit."""
import dataclasses
import json

import pytest
import torch

import memfit
from memfit import Config
from memfit.errors import ConfigError, WorkloadError
from memfit.step import TrainStep
from memfit.workloads import builtin
from runs import whole_and_resumed
from truth import allocator_step_peak

LIMIT = 0.05  # far under gpt-tiny's and the Net's gradient norms (~1-3) at the first steps: every step clips


def clipped(workload, limit=LIMIT):
    return dataclasses.replace(workload, max_grad_norm=limit)


@pytest.mark.parametrize("offload", [False, True])
def test_the_step_clips_as_torchs_clip_grad_norm(offload):
    """Bit for bit what a plain loop with torch.nn.utils.clip_grad_norm_ does, with the optimizer on the
    host too (there the fp32 masters' gradients are clipped: copies of fp32 gradients, the same numbers)."""
    wl = clipped(builtin("gpt-tiny"))
    step = TrainStep(wl, Config(micro_batch=8, offload_optimizer=offload))
    model = wl.model()
    model.load_state_dict(step.model.state_dict())
    opt = wl.optimizer(model.parameters())
    for i in range(3):
        torch.manual_seed(i)
        batch = wl.batch(8)
        loss = step(batch)
        opt.zero_grad()
        expected = wl.loss(model, batch)
        expected.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), LIMIT)
        opt.step()
        assert loss == expected.detach() and step.grad_norm == norm and norm > LIMIT
    for mine, theirs in zip(step.model.parameters(), model.parameters()):
        assert torch.equal(mine, theirs)


def test_fp16_clips_the_unscaled_gradients():
    """GradScaler's scale (65,536 at the start) is taken out before the norm: the norm is the fp32 step's
    to fp16 rounding (11-bit mantissa: a few 1e-4 relative, summed over squares), not 65,536 times it."""
    wl = clipped(builtin("gpt-tiny"))
    torch.manual_seed(0)
    batch = wl.batch(4)
    norms = {}
    for precision in ("fp32", "fp16"):
        torch.manual_seed(1)
        step = TrainStep(wl, Config(micro_batch=4, precision=precision))
        step(batch)
        norms[precision] = float(step.grad_norm)
    assert step.skipped_steps == 0
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=1e-2)


def test_the_estimate_counts_the_clip_to_the_byte():
    """The allocator's running total of a real step (truth.allocator_step_peak): the norms, and the last
    step's norm kept between steps (the run logs it). The clip reads fp32 gradients in every precision but
    bf16-pure, so one is enough."""
    wl = clipped(builtin("gpt-tiny"))
    config = Config(micro_batch=4, grad_accum=2)
    assert memfit.estimate(wl, config).peak_bytes == allocator_step_peak(wl, config)


def test_on_fsdp_ranks_the_norm_is_every_shards_and_training_equals_one_process():
    """Each FSDP2 rank holds a shard of each gradient: the norm is reduced across ranks before any scaling,
    so two ranks train as one process does (fp32; 1e-5: only the order of the sums differs) and report the
    same norm. Scaling by a rank's own shards' norm fails this (mutation checked). The per-rank estimate
    equals the lowest real rank's peak (1%, as test_data_parallel's: gloo's worker thread frees buffers late
    at random)."""
    from test_data_parallel import WORKLOAD, _lowest_rank_peak

    from memfit.runtime.trainer import Trainer
    from truth import on_gloo_ranks

    wl = clipped(WORKLOAD)
    one = Trainer(wl, Config(micro_batch=4, grad_accum=4), seed=0, global_batch=16)
    one_losses = [one.step() for _ in range(3)]
    one_weights = {n: p.detach() for n, p in one.model.named_parameters()}
    config = Config(micro_batch=4, grad_accum=2, gpus=2, data_parallel="fsdp")

    def on_rank(rank):
        trainer = Trainer(wl, config, seed=0, global_batch=16)
        losses = [trainer.step() for _ in range(3)]
        weights = {n: p.full_tensor().detach().numpy().copy() for n, p in trainer.model.named_parameters()}
        return losses, weights, float(trainer.engine.grad_norm)

    for losses, weights, norm in on_gloo_ranks(2, on_rank):
        assert norm == pytest.approx(float(one.engine.grad_norm), rel=1e-5) and norm > LIMIT
        assert losses == pytest.approx(one_losses, rel=1e-5)
        for name, w in one_weights.items():
            torch.testing.assert_close(torch.from_numpy(weights[name]), w, rtol=1e-5, atol=1e-5, msg=name)
    fsdp = config.replace(micro_batch=8, grad_accum=1)
    est = memfit.estimate(wl, fsdp).peak_bytes
    assert est == pytest.approx(_lowest_rank_peak(wl, fsdp, est), rel=0.01)


def test_what_clipping_rules_out_is_refused_and_the_planner_says_why():
    """The optimizer step in backward updates each parameter before the total norm exists."""
    from memfit.planner.search import MARGIN, plan

    with pytest.raises(WorkloadError, match="max_grad_norm must be a positive number"):
        clipped(builtin("gpt-tiny"), 0.0)
    wl = clipped(builtin("gpt-tiny"))
    with pytest.raises(ConfigError, match="needs all of them first"):
        memfit.estimate(wl, Config(micro_batch=4, optimizer_in_backward=True))
    fixed = dict(precision="fp32", activation_checkpoint="none")
    budget = int(memfit.estimate(wl, Config(micro_batch=4, grad_accum=2, **fixed)).peak_bytes / (1 - MARGIN)) + 1
    p = plan(wl, 8, budget=budget, **fixed)
    assert not p.config.optimizer_in_backward and p.config.grad_accum > 1
    assert dict(p.families)["fp32, activation checkpointing none, optimizer in backward"] == (
        "cannot apply: clipping by the total gradient norm (max_grad_norm) needs every gradient before any update")


def test_a_clipped_run_logs_the_norm_and_resumes_bit_identical(tmp_path):
    wl = clipped(builtin("mlp-tiny"))
    whole, resumed = whole_and_resumed(tmp_path, wl, Config(micro_batch=4))
    assert (whole.out / "model.safetensors").read_bytes() == (resumed.out / "model.safetensors").read_bytes()
    norms = [json.loads(line).get("grad_norm") for line in (whole.out / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert len(norms) == 4 and all(n > LIMIT for n in norms)
