"""Every strategy leaves the training math unchanged (numerics against the plain step), and bad
configurations fail with one clear message before anything is applied."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit import Config, Trainer
from memfit.errors import ConfigError
from memfit.step import TrainStep
from memfit.strategies.activation_checkpoint import chosen_blocks, find_blocks
from memfit.workloads import builtin

from numerics import gpt_gradient_terms, sum_tolerance

EPS32 = torch.finfo(torch.float32).eps
SGD_LR = 0.1


def _params(step) -> list[torch.Tensor]:
    return [p.detach().clone() for p in step.model.parameters()]


def _run(workload, config, batch, steps=1):
    torch.manual_seed(0)
    step = TrainStep(workload, config, "cpu")
    for _ in range(steps):
        step(batch)
    return step


@pytest.fixture(scope="module")
def gpt():
    return builtin("gpt-tiny")


@pytest.fixture(scope="module")
def gpt_batch(gpt):
    torch.manual_seed(1)
    return gpt.batch(8)


def _sgd(workload, optimizer=torch.optim.SGD):
    """Plain SGD moves each parameter by lr x its gradient, so two runs' parameters differ by lr times their
    gradients' rounding difference. AdamW would not do for a numerical comparison: it divides each gradient
    by its own root mean square, so on a first step every entry moves by about lr whatever its size, and the
    rounding noise of a 1e-9 gradient becomes a parameter difference of order lr."""
    return dataclasses.replace(workload, optimizer=lambda params: optimizer(params, lr=SGD_LR))


def _assert_same_step(reference, other, tokens):
    """Gradients and SGD-stepped parameters of `other` equal `reference`'s up to the rounding of the sums
    that differ between them (tests/numerics.py derives the bound from fp32's eps and the sums' sizes)."""
    terms = gpt_gradient_terms(reference.model.cfg, tokens)
    for (name, p), q in zip(reference.model.named_parameters(), other.model.parameters()):
        tol = sum_tolerance(torch.float32, terms, p.grad.abs().max().item())
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=tol, msg=lambda m, name=name: f"grad {name}: {m}")
        # lr x the gradients' difference, plus one rounding of p - lr*g
        atol = SGD_LR * tol + EPS32 * p.detach().abs().max().item()
        torch.testing.assert_close(q.detach(), p.detach(), rtol=0, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


def _tokens(batch) -> int:
    return batch["tokens"][:, 1:].numel()  # next-token loss: every position but the first is a target


@pytest.mark.parametrize("micro,accum", [(2, 4), (4, 2), (3, 3)])
def test_accumulation_matches_one_big_batch(gpt, gpt_batch, micro, accum):
    """(3, 3) splits 8 samples as 3 + 3 + 2: the uneven last micro-batch must be weighted by its size."""
    wl = _sgd(gpt)
    big = _run(wl, Config(micro_batch=8), gpt_batch)
    acc = _run(wl, Config(micro_batch=micro, grad_accum=accum), gpt_batch)
    _assert_same_step(big, acc, _tokens(gpt_batch))


class _RoundingNoiseSGD(torch.optim.SGD):
    """SGD that first moves every gradient entry by ±4 eps of its tensor's largest entry: what another
    processor's kernels, blocking the same sums differently, may produce."""

    def step(self, closure=None):
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    signs = torch.arange(p.numel()).view_as(p).remainder(2) * 2.0 - 1.0
                    p.grad += signs * 4 * EPS32 * p.grad.abs().max()
        return super().step(closure)


def test_the_comparison_tolerates_rounding_noise_and_catches_a_weighting_error(gpt, gpt_batch):
    """The accumulation check above must pass on any machine and still fail for the bug it exists for."""
    wl = _sgd(gpt)
    big = _run(wl, Config(micro_batch=8), gpt_batch)
    noisy = _run(_sgd(gpt, _RoundingNoiseSGD), Config(micro_batch=3, grad_accum=3), gpt_batch)
    _assert_same_step(big, noisy, _tokens(gpt_batch))

    def loss(model, batch):  # weights the last micro-batch (2 samples of 8) by 1/3 instead of 2/8
        scale = (1 / 3) / (2 / 8) if batch["tokens"].shape[0] == 2 else 1.0
        return gpt.loss(model, batch) * scale

    wrong = _run(dataclasses.replace(wl, loss=loss), Config(micro_batch=3, grad_accum=3), gpt_batch)
    with pytest.raises(AssertionError):
        _assert_same_step(big, wrong, _tokens(gpt_batch))


def test_accumulated_loss_is_the_global_mean(gpt, gpt_batch):
    torch.manual_seed(0)
    model = TrainStep(gpt, Config(micro_batch=8), "cpu").model
    expected = gpt.loss(model, gpt_batch).item()
    torch.manual_seed(0)
    got = TrainStep(gpt, Config(micro_batch=3, grad_accum=3), "cpu")(gpt_batch).item()
    rel = sum_tolerance(torch.float32, gpt_gradient_terms(model.cfg, _tokens(gpt_batch)), 1.0)
    assert got == pytest.approx(expected, rel=rel)


@pytest.mark.parametrize("changes", [
    dict(activation_checkpoint="all"), dict(activation_checkpoint=2), dict(activation_checkpoint=("layers.1",)), dict(activation_checkpoint="selective"),
    dict(offload_activations=True), dict(activation_checkpoint=2, offload_activations=True),
])
def test_recompute_and_activation_offload_are_bitwise_identical(gpt, gpt_batch, changes):
    plain = _run(gpt, Config(micro_batch=8), gpt_batch, steps=2)
    other = _run(gpt, Config(micro_batch=8, **changes), gpt_batch, steps=2)
    for a, b in zip(_params(plain), _params(other)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_optimizer_offload_matches_the_plain_step(gpt, gpt_batch, optimizer):
    make = {"sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2)}[optimizer]
    wl = dataclasses.replace(gpt, optimizer=make)
    plain = _run(wl, Config(micro_batch=4, grad_accum=2), gpt_batch, steps=3)
    off = _run(wl, Config(micro_batch=4, grad_accum=2, offload_optimizer=True), gpt_batch, steps=3)
    assert off.optimizer_offload is not None
    # On a CPU the offloaded optimizer runs the same elementwise kernels on copies of the same gradients (no
    # sum is reordered), so anything but bit-identical parameters would be a change in the math.
    for a, b in zip(_params(plain), _params(off)):
        assert torch.equal(a, b)
    assert all(p.grad is None for p in off.model.parameters())  # gradients were streamed off the device


def test_checkpointing_recomputes_instead_of_saving(gpt):
    none = memfit.estimate(gpt, Config(micro_batch=4))
    ck = memfit.estimate(gpt, Config(micro_batch=4, activation_checkpoint="all"))
    assert none.recompute_flops == 0
    assert ck.recompute_flops > 0 and ck.flops == none.flops + ck.recompute_flops
    assert ck.breakdown["activations"] < none.breakdown["activations"] / 4


def test_fp16_loss_scaling_skips_an_overflowing_step_and_recovers():
    poison = {"on": False}

    def loss(model, batch):
        out = F.mse_loss(model(batch["x"]), batch["y"])
        return out * float("inf") if poison["on"] else out

    wl = memfit.Workload(model=lambda: nn.Linear(8, 1), batch=lambda n: {"x": torch.randn(n, 8), "y": torch.randn(n, 1)},
                         loss=loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    trainer = Trainer(wl, Config(micro_batch=4, precision="fp16"))
    trainer.step()
    scale = trainer.engine.scaler.get_scale()
    before = _params(trainer.engine)
    poison["on"] = True
    trainer.step()
    assert trainer.engine.skipped_steps == 1
    assert trainer.engine.scaler.get_scale() == scale / 2
    assert all(torch.equal(a, b) for a, b in zip(before, _params(trainer.engine)))  # the optimizer never saw it
    poison["on"] = False
    trainer.step()
    assert trainer.engine.skipped_steps == 1
    assert not all(torch.equal(a, b) for a, b in zip(before, _params(trainer.engine)))


def test_blocks_are_found_in_models_not_written_for_memfit():
    pytest.importorskip("transformers")
    with torch.device("meta"):
        assert find_blocks(builtin("hf:gpt2").model()) == ["transformer.h.0", "transformer.h.1"]
        assert find_blocks(builtin("resnet-tiny").model()) == ["layer1.0", "layer2.0", "layer3.0", "layer4.0"]
        model = builtin("gpt-tiny", layers=6).model()
    assert chosen_blocks(model, 2) == ["layers.0", "layers.2", "layers.4"]
    assert chosen_blocks(model, "all") == [f"layers.{i}" for i in range(6)]


def test_bad_configurations_fail_before_anything_is_applied(gpt):
    with pytest.raises(ConfigError, match="no module named 'layers.7'"):
        TrainStep(gpt, Config(activation_checkpoint=("layers.0", "layers.7")), "cpu")
    with pytest.raises(ValueError, match="grad_accum must be"):
        Config(grad_accum=0)
    with pytest.raises(ValueError, match="checkpoint must be"):
        Config(activation_checkpoint="some")
    with pytest.raises(ConfigError, match="no native bf16"):
        memfit.estimate(gpt, Config(precision="bf16"), device="v100-32gb")
    with pytest.raises(ValueError, match="fp16 loss scaling with offload_optimizer"):
        Config(precision="fp16", offload_optimizer=True)
    # a failed checkpoint name leaves the user's model untouched: nothing half-applied
    model = gpt.model()
    with pytest.raises(ConfigError):
        from memfit.strategies import apply_model_strategies
        apply_model_strategies(model, Config(precision="bf16-pure", activation_checkpoint=("nope",)), torch.device("cpu"))
    assert "forward" not in vars(model.layers[0])
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_config_round_trips_through_json():
    cfg = Config(micro_batch=3, grad_accum=2, precision="bf16", activation_checkpoint=("a", "b"), offload_activations=True)
    assert Config.from_json(cfg.to_json()) == cfg
    assert Config.from_json(Config(activation_checkpoint=2).to_json()).activation_checkpoint == 2
    with pytest.raises(ValueError, match="unknown Config field"):
        Config.from_dict({"micro_batch": 1, "zero_stage": 3})
