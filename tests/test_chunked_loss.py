"""The loss in chunks of tokens (issue 14): the plain step's math on a transformers model and on memfit's GPT,
the estimate equal to the profiler with the logits no longer held whole, refusals, the planner's choice and a
bit-identical resume."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

import memfit
from memfit import Config, Workload
from memfit.errors import LossChunkError
from memfit.losses import chunked_cross_entropy, loss_chunks
from memfit.planner.search import LOSS_CHUNKS, plan
from memfit.step import TrainStep
from memfit.workloads import load_workload
from numerics import gpt_gradient_terms, gradient_terms, sum_tolerance
from runs import whole_and_resumed
from truth import real_step_peak


SGD_LR = 0.1
EPS32 = torch.finfo(torch.float32).eps


def _sgd_step(workload, config, batch) -> tuple[float, torch.nn.Module]:
    """One SGD step: its loss and the stepped model, gradients kept. SGD moves each weight by lr x its
    gradient, so two runs differ by lr x their gradients' rounding; AdamW's first step would move a 1e-9
    gradient's entry by about lr whatever its rounding (tests/test_strategies.py says more)."""
    torch.manual_seed(0)
    step = TrainStep(dataclasses.replace(workload, optimizer=lambda ps: torch.optim.SGD(ps, lr=SGD_LR)), config)
    return float(step(batch)), step.model


def _terms(name, wl, batch) -> int:
    """The additions behind one gradient entry (tests/numerics.py): the chunks reorder the sums over tokens."""
    if name == "gpt-tiny":
        cfg = wl.model().cfg
        return gpt_gradient_terms(cfg, batch["tokens"][:, 1:].numel())
    with torch.device("meta"):
        cfg = wl.model().config
    ids = batch["input_ids"]
    return gradient_terms(ids.numel(), cfg.num_hidden_layers, ids.shape[1], cfg.hidden_size,
                          cfg.intermediate_size, cfg.vocab_size)


@pytest.mark.parametrize("name", ["hf:llama", "gpt-tiny"])
def test_same_math_as_the_whole_loss(name):
    wl = load_workload(name)
    torch.manual_seed(1)
    batch = wl.batch(8)
    plain_loss, plain = _sgd_step(wl, Config(micro_batch=4), batch)
    loss, chunked = _sgd_step(wl, Config(micro_batch=4, loss_chunks=5), batch)  # chunks of unequal size
    terms = _terms(name, wl, batch)
    assert loss == pytest.approx(plain_loss, rel=sum_tolerance(torch.float32, terms, 1.0))
    for (pname, p), q in zip(plain.named_parameters(), chunked.parameters()):
        tol = sum_tolerance(torch.float32, terms, p.grad.abs().max().item())
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=tol, msg=lambda m, n=pname: f"grad {n}: {m}")
        atol = SGD_LR * tol + EPS32 * p.detach().abs().max().item()  # plus one rounding of p - lr*g
        torch.testing.assert_close(q.detach(), p.detach(), rtol=0, atol=atol, msg=lambda m, n=pname: f"{n}: {m}")


def test_the_estimate_equals_the_profiler_and_the_logits_are_not_held_whole():
    wl = load_workload("hf:llama")
    with torch.device("meta"):
        vocab = wl.model().config.vocab_size
    tokens = 4 * wl.batch(1)["input_ids"].shape[1]
    plain = memfit.estimate(wl, Config(micro_batch=4))
    chunked = memfit.estimate(wl, Config(micro_batch=4, loss_chunks=4))
    assert chunked.peak_bytes == pytest.approx(real_step_peak(wl, Config(micro_batch=4, loss_chunks=4)), rel=0.01)
    # the whole loss holds the fp32 logits' log-softmax for backward; in 4 chunks a quarter of it at a time
    assert plain.peak_bytes - chunked.peak_bytes >= 0.75 * tokens * vocab * 4


def _scaled_logits() -> Workload:
    """A model that changes its logits after the head: its loss cannot be chunked without changing the math."""
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50)

        def forward(self, ids):
            return self.head(self.embed(ids)) * 0.5

    def loss(model, batch):
        if loss_chunks() > 1:
            return chunked_cross_entropy(lambda: model(batch[:, :-1]), model.head, batch[:, 1:])
        return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())

    return Workload(model=Scaled, batch=lambda n: torch.randint(0, 50, (n, 9)), loss=loss, name="scaled")


def test_what_cannot_be_chunked_is_refused():
    with pytest.raises(LossChunkError, match="changes them after it"):
        memfit.estimate(_scaled_logits(), Config(micro_batch=2, loss_chunks=2))
    with pytest.raises(LossChunkError, match="does not compute its cross-entropy with"):
        memfit.estimate(load_workload("mlp"), Config(micro_batch=2, loss_chunks=2))
    assert memfit.estimate(_scaled_logits(), Config(micro_batch=2)).peak_bytes > 0  # whole, it traces


def test_the_planner_chunks_the_loss_when_that_lets_a_larger_micro_batch_fit():
    """gpt-small with 2 blocks at seq 1024 on 2.4 GiB of an H100 (2.28 GiB usable): the whole loss fits one
    sample a micro-batch (1.98 GiB; 2.59 GiB at two); chunked, all four samples fit in one micro-batch (1.86
    GiB), which is faster."""
    p = plan(load_workload("gpt-small", seq=1024, layers=2), 4, device="h100", budget="2.4GiB", precision="bf16",
             activation_checkpoint="all", offload_activations=False, offload_optimizer=False)
    assert p.config.loss_chunks == LOSS_CHUNKS and p.config.micro_batch == 4 and p.confirmed
    verdicts = dict(p.families)
    assert verdicts[f"bf16, activation checkpointing all, loss in {LOSS_CHUNKS} chunks"] == "chosen at micro-batch 4"
    unchunked = verdicts["bf16, activation checkpointing all"]
    assert unchunked.startswith("fits") and unchunked.endswith("(best at micro-batch 1)")
    assert not any("loss not chunked" in n for n in p.notes)


def test_a_resumed_run_ends_bit_identical(tmp_path):
    wl, config = load_workload("gpt-tiny"), Config(micro_batch=8, loss_chunks=4, optimizer_in_backward=True)
    whole, resumed = whole_and_resumed(tmp_path, wl, config)
    assert resumed.config.loss_chunks == 4
    assert (whole.out / "model.safetensors").read_bytes() == (resumed.out / "model.safetensors").read_bytes()
