"""Every torch.optim optimizer that fits memfit's step (all but LBFGS, which needs a closure, and SparseAdam,
which needs sparse gradients) is estimated on fake tensors, with the optimizer state a real step keeps and
the peak the profiler measures."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit import Config
from memfit.step import TrainStep
from memfit.torch_internals import storage_key
from truth import real_step_peak

O = torch.optim
OPTIMIZERS = {
    "Adam": lambda p: O.Adam(p), "Adam-amsgrad": lambda p: O.Adam(p, amsgrad=True), "AdamW": lambda p: O.AdamW(p),
    "SGD-momentum": lambda p: O.SGD(p, lr=0.1, momentum=0.9), "Adagrad": lambda p: O.Adagrad(p),
    "Adadelta": lambda p: O.Adadelta(p), "Adamax": lambda p: O.Adamax(p), "NAdam": lambda p: O.NAdam(p),
    "RAdam": lambda p: O.RAdam(p), "RMSprop-centered": lambda p: O.RMSprop(p, momentum=0.9, centered=True),
    "Rprop": lambda p: O.Rprop(p), "ASGD": lambda p: O.ASGD(p), "Adafactor": lambda p: O.Adafactor(p),
}


def mlp(optimizer, name="mlp") -> memfit.Workload:
    return memfit.Workload(
        model=lambda: nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)),
        batch=lambda n: {"x": torch.randn(n, 64), "y": torch.randint(0, 10, (n,))},
        loss=lambda m, b: F.cross_entropy(m(b["x"]), b["y"]), optimizer=optimizer, name=name)


def real_state_bytes(wl: memfit.Workload, cfg: Config) -> int:
    """The optimizer state a real step leaves, each storage once."""
    torch.manual_seed(0)
    step = TrainStep(wl, cfg, "cpu")
    step(wl.batch(cfg.global_batch))
    tensors = [t for s in step.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return sum({storage_key(t): t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_is_traced_with_the_state_of_a_real_step(name):
    wl, cfg = mlp(OPTIMIZERS[name], name), Config(micro_batch=8)
    est = memfit.estimate(wl, cfg)
    assert est.method == "fake", est.notes
    assert est.model_state_bytes["optimizer_state"] == real_state_bytes(wl, cfg)


@pytest.mark.parametrize("name", ["Adafactor", "ASGD"])
def test_optimizers_traced_with_stand_in_values_have_the_peak_the_profiler_measures(name):
    """The two that read tensor values (.item()) in their step: the stand-in keeps every op of the real step."""
    wl, cfg = mlp(OPTIMIZERS[name], name), Config(micro_batch=8)
    assert memfit.estimate(wl, cfg).peak_bytes == pytest.approx(real_step_peak(wl, cfg), rel=0.01)


def test_adafactor_state_by_hand_and_the_stand_in_is_said():
    """Adafactor factors a matrix's second moment into a row and a column vector; a vector keeps a full one.
    It reads parameter norms with .item(), which the trace answers with a stand-in and says so."""
    est = memfit.estimate(mlp(lambda p: O.Adafactor(p)), Config(micro_batch=8))
    rows_cols = (256 + 64) + (10 + 256)  # fp32 row_var (out) + col_var (in) of each weight
    vectors = 256 + 10  # the biases' variances
    assert est.model_state_bytes["optimizer_state"] == 4 * (rows_cols + vectors) + 4 * 4  # + a step per parameter
    assert any(".item()" in n for n in est.notes)


def test_cuda_targets_trace_the_foreach_kernels_of_the_optimizers_that_read_values():
    for make in (OPTIMIZERS["Adafactor"], OPTIMIZERS["ASGD"]):
        est = memfit.estimate(mlp(make), Config(micro_batch=8, precision="fp32"), device="h100")
        assert est.method == "fake" and any("foreach" in n for n in est.notes)


def test_bitsandbytes_8bit_adamw_state_is_one_byte_per_element_plus_block_scales():
    """Where bitsandbytes imports (its CPU kernels, its fake-tensor registrations), the 8-bit state is traced:
    uint8 moments, one fp32 absmax per 256-element block and a 256-entry fp32 code map per moment, for
    tensors of at least min_8bit_size (4096) elements; smaller ones keep fp32 moments."""
    bnb = pytest.importorskip("bitsandbytes")
    wl, cfg = mlp(lambda p: bnb.optim.AdamW8bit(p)), Config(micro_batch=8)
    est = memfit.estimate(wl, cfg)
    assert est.method == "fake"
    eight_bit = 2 * (64 * 256) + 2 * 4 * (64 * 256 // 256) + 2 * 4 * 256  # first weight: moments, absmax, maps
    fp32 = 2 * 4 * (256 + 256 * 10 + 10)  # the rest is under 4096 elements
    assert est.model_state_bytes["optimizer_state"] == eight_bit + fp32 == real_state_bytes(wl, cfg)
