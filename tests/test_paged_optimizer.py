"""Paged 8-bit optimizer states: the 8-bit math, the states on the host, one parameter's on the device."""
import math

import pytest
import torch

import memfit
from memfit import Config
from memfit.errors import ConfigError
from memfit.step import TrainStep
from memfit.strategies.optimizer_8bit import BLOCK, MIN_SIZE
from memfit.workloads import load_workload
from runs import whole_and_resumed
from truth import real_step_peak

EIGHT = Config(micro_batch=4, optimizer_8bit=True)
PAGED = EIGHT.replace(paged_optimizer=True)


def _state_bytes(shape) -> int:
    """One parameter's two moments in the 8-bit layout (strategies/optimizer_8bit.py)."""
    n = math.prod(shape)
    if len(shape) < 2 or n < MIN_SIZE:
        return 8 * n
    return 2 * n + 8 * shape[0] * math.ceil(n // shape[0] / BLOCK)


def test_paging_moves_bytes_not_values():
    """Three steps paged and unpaged: the same weights bit for bit; the states stay in the host tensors the
    optimizer holds between steps, and each step pages every state in and out once."""
    wl = load_workload("gpt-tiny")
    weights, steps = [], []
    for config in (EIGHT, PAGED):
        torch.manual_seed(0)
        step = TrainStep(wl, config)
        torch.manual_seed(1)
        batch = wl.batch(4)
        for _ in range(3):
            step(batch)
        weights.append([p.detach().clone() for p in step.model.parameters()])
        steps.append(step)
    assert all(torch.equal(a, b) for a, b in zip(*weights))
    paged = steps[1]
    state = [t for s in paged.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert {id(t) for t in paged.host_tensors()} == {id(t) for t in state}
    assert paged.moved_bytes == 2 * sum(t.numel() * t.element_size() for t in state)


def test_on_a_gpu_the_device_holds_one_parameters_state_and_the_host_all_of_them():
    """The same step for an A100: no optimizer state on the device at the peak, all of it on the host; the
    device's peak falls by the state less what one update pages in (at most the largest parameter's)."""
    wl = load_workload("gpt-tiny")
    with torch.device("meta"):
        shapes = [p.shape for p in wl.model().parameters()]
    states = sum(map(_state_bytes, shapes))
    eight = memfit.estimate(wl, EIGHT, device="a100-80gb")
    paged = memfit.estimate(wl, PAGED, device="a100-80gb")
    assert eight.model_state_bytes["optimizer_state"] == states
    assert paged.breakdown["optimizer_state"] == 0 and paged.host_peak_bytes == states
    saved = eight.peak_bytes - paged.peak_bytes
    assert states - max(map(_state_bytes, shapes)) <= saved <= states


@pytest.mark.parametrize("config", [PAGED, PAGED.replace(precision="bf16-pure", optimizer_in_backward=True,
                                                         activation_checkpoint="all")],
                         ids=["paged", "torchtune-recipe"])
def test_the_estimate_equals_the_profiler(config):
    wl = load_workload("gpt-tiny")
    assert memfit.estimate(wl, config).peak_bytes == pytest.approx(real_step_peak(wl, config), rel=0.01)


def test_a_resumed_run_ends_bit_identical(tmp_path):
    wl = load_workload("gpt-tiny")
    whole, resumed = whole_and_resumed(tmp_path, wl, PAGED.replace(micro_batch=8))
    assert resumed.config.paged_optimizer
    assert (whole.out / "model.safetensors").read_bytes() == (resumed.out / "model.safetensors").read_bytes()


def test_what_it_cannot_do_is_refused():
    for bad, why in ((dict(optimizer_8bit=False), "set optimizer_8bit too"),
                     (dict(offload_optimizer=True, precision="bf16"), "already keeps the states on the host"),
                     (dict(gpus=2, data_parallel="fsdp", precision="bf16"), "not built across ranks")):
        with pytest.raises(ConfigError, match=why):
            PAGED.replace(**bad)
