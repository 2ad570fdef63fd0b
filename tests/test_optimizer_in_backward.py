"""The optimizer step in backward (issue 14): the same math as the step after backward on a transformers
model, no gradients held at the peak, the estimate equal to the profiler, refusals, and a bit-identical
resume."""
import pytest
import torch

import memfit
from memfit import Config
from memfit.runtime.run import recovery_ladder
from memfit.step import TrainStep
from memfit.workloads import load_workload
from runs import whole_and_resumed
from truth import real_step_peak


def _train(workload, config, steps=3):
    torch.manual_seed(0)
    step = TrainStep(workload, config)
    torch.manual_seed(1)
    losses = [float(step(workload.batch(config.global_batch))) for _ in range(steps)]
    return losses, [p.detach().clone() for p in step.model.parameters()], step


def test_same_math_as_the_step_after_backward_on_a_transformers_model():
    wl = load_workload("hf:llama")
    plain_losses, plain, _ = _train(wl, Config(micro_batch=4))
    losses, weights, step = _train(wl, Config(micro_batch=4, optimizer_in_backward=True))
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    for a, b in zip(weights, plain):  # each parameter's update is the optimizer's own, one parameter at a time
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(p.grad is None for p in step.model.parameters())  # freed as each was applied
    assert step.optimizer.state_dict()["state"].keys() == _train(wl, Config(micro_batch=4), 1)[2].optimizer.state_dict()["state"].keys()


def test_no_gradients_at_the_peak_of_a_gpu_target():
    """gpt-small at seq 128 on an H100: the plain step peaks in the optimizer with every gradient (512 MiB) and
    the foreach update's temporaries; updated in backward, no gradient is held and the peak falls by more."""
    wl = load_workload("gpt-small", seq=128)
    base = Config(micro_batch=1, precision="bf16", activation_checkpoint="all")
    plain = memfit.estimate(wl, base, device="h100")
    in_bw = memfit.estimate(wl, base.replace(optimizer_in_backward=True), device="h100")
    assert plain.breakdown["gradients"] > 0 and in_bw.breakdown["gradients"] == 0
    assert plain.peak_bytes - in_bw.peak_bytes >= plain.breakdown["gradients"]
    assert in_bw.peak_reserved_bytes < plain.peak_reserved_bytes


@pytest.mark.parametrize("name", ["gpt-tiny", "hf:llama"])
def test_the_estimate_equals_the_profiler(name):
    wl = load_workload(name)
    config = Config(micro_batch=4, optimizer_in_backward=True)
    # as tests/test_estimate.py holds every strategy (hf:llama's plain step is 64 B over the profiler too)
    assert memfit.estimate(wl, config, device="cpu").peak_bytes == pytest.approx(real_step_peak(wl, config), rel=0.01)


@pytest.mark.parametrize("changes, says", [
    (dict(grad_accum=2), "use grad_accum 1"), (dict(precision="fp16"), "fp16 loss scaling"),
    (dict(offload_optimizer=True, precision="bf16"), "already streams"),
    (dict(gpus=2, data_parallel="fsdp"), "across ranks")])
def test_what_it_cannot_do_is_refused(changes, says):
    with pytest.raises(memfit.MemfitError, match=says):
        Config(optimizer_in_backward=True, **changes)


def test_oom_recovery_keeps_one_micro_batch():
    ladder = recovery_ladder(Config(micro_batch=8, optimizer_in_backward=True), 8)
    assert [c.activation_checkpoint for c in ladder] == ["selective", "all"]
    assert all(c.micro_batch == 8 and c.grad_accum == 1 and c.optimizer_in_backward for c in ladder)


def test_a_resumed_run_ends_bit_identical(tmp_path):
    wl, config = load_workload("gpt-tiny"), Config(micro_batch=8, optimizer_in_backward=True)
    whole, resumed = whole_and_resumed(tmp_path, wl, config)
    assert (whole.out / "model.safetensors").read_bytes() == (resumed.out / "model.safetensors").read_bytes()
    assert [m["loss"] for m in whole.metrics if "loss" in m] == [m["loss"] for m in resumed.metrics if "loss" in m]


def test_the_planner_steps_in_backward_when_the_rank_batch_does_not_fit_in_one_micro_batch():
    """gpt-small with 4 blocks at seq 64, global batch 8, on an H100 with 2.08 GiB: the plain step does not fit
    even at micro-batch 1 (its gradients and the optimizer's temporaries: 2.06 GiB), the step in backward fits all
    8 at once (1.94 GiB)."""
    from memfit.planner.search import plan

    p = plan(load_workload("gpt-small", seq=64, layers=4), 8, device="h100", budget="2.08GiB",
             activation_checkpoint="all", offload_activations=False, offload_optimizer=False, precision="bf16")
    assert p.config == Config(micro_batch=8, precision="bf16", activation_checkpoint="all", optimizer_in_backward=True)
    verdicts = dict(p.families)
    assert verdicts["bf16, activation checkpointing all, optimizer in backward"] == "chosen at micro-batch 8"
    assert verdicts["bf16, activation checkpointing all"].startswith("does not fit")
    assert p.confirmed and p.estimate.breakdown["gradients"] == 0


def test_in_backward_is_not_traced_where_the_forward_pass_alone_is_over_the_budget():
    """The step in backward runs the same forward pass as its family: where that pass alone is over the budget
    at the whole rank batch, the family is said not to fit without a trace, and a full estimate agrees."""
    from memfit.planner.search import MARGIN, plan

    wl = load_workload("gpt-tiny")
    fixed = dict(precision="fp32", activation_checkpoint="none")
    budget = int(memfit.estimate(wl, Config(micro_batch=2, grad_accum=8, **fixed)).peak_bytes / (1 - MARGIN)) + 1
    p = plan(wl, 16, budget=budget, **fixed)
    assert p.config.micro_batch <= 2
    verdict = dict(p.families)["fp32, activation checkpointing none, optimizer in backward"]
    assert verdict.startswith("does not fit: its forward pass alone needs") and verdict.endswith("(not traced)")
    in_backward = memfit.estimate(wl, Config(micro_batch=16, optimizer_in_backward=True, **fixed))
    assert in_backward.peak_bytes > p.usable_bytes
