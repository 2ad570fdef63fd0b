"""Selective activation checkpointing on models memfit did not write: transformers' Llama, Qwen2 and GPT-2 as a
user builds them (library defaults: a KV cache on, SDPA or eager attention), and small modules whose
recomputation runs an op a different number of times than their forward did. Each must train to the same
bits as without checkpointing, and its estimate must match the profiler. The OOM-recovery ladder must not
move a run to a checkpointing whose fake probe fails."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit import Config
from memfit.errors import RunError
from truth import real_step_peak

transformers = pytest.importorskip("transformers")

# Small enough for a profiled step in seconds; activations are most of the peak at seq 64 x micro-batch 4.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)
TINY_GPT2 = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128, bos_token_id=0, eos_token_id=0)


def _user_built(model_type: str, attn: str = "sdpa", seq: int = 64) -> memfit.Workload:
    """A causal LM as its user builds it: transformers' defaults (use_cache=True), not memfit's hf adapter."""
    cfg = transformers.AutoConfig.for_model(model_type, **(TINY_GPT2 if model_type == "gpt2" else TINY))

    def batch(n):
        ids = torch.randint(0, cfg.vocab_size, (n, seq))
        return {"input_ids": ids, "labels": ids}

    return memfit.Workload(model=lambda: transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn),
                           batch=batch, loss=lambda m, b: m(**b).loss,
                           optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2), name=f"{model_type}-{attn}")


def _trained(wl: memfit.Workload, config: Config, steps: int = 2) -> tuple[list[float], list[torch.Tensor]]:
    trainer = memfit.Trainer(wl, config, seed=3)
    losses = [trainer.step() for _ in range(steps)]
    return losses, [p.detach().clone() for p in trainer.model.parameters()]


def _assert_same_training(wl: memfit.Workload, precision: str, micro_batch: int = 2) -> None:
    """Recomputation runs the same kernels on the same values, and a reused output is the one the forward
    made: nothing is summed in another order, so losses and weights must agree bit for bit."""
    plain = _trained(wl, Config(micro_batch=micro_batch, precision=precision))
    selective = _trained(wl, Config(micro_batch=micro_batch, precision=precision, activation_checkpoint="selective"))
    assert plain[0] == selective[0]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], selective[1]))


@pytest.mark.parametrize("model_type,attn,precision", [
    ("llama", "sdpa", "fp32"), ("llama", "sdpa", "bf16"), ("llama", "eager", "fp32"),
    ("qwen2", "sdpa", "bf16"), ("gpt2", "sdpa", "fp32"), ("gpt2", "eager", "bf16"),
])
def test_selective_checkpointing_trains_transformers_models_exactly(model_type, attn, precision):
    """torch's selective checkpointing raised 'aten.slice.Tensor invocation index 4 ... not found' here (the
    layer's KV-cache write makes the recomputation slice the keys once more), and with eager attention the
    recomputation attended over the cache twice (a shape error, under plain checkpointing too)."""
    _assert_same_training(_user_built(model_type, attn), precision)


@pytest.mark.parametrize("model_type,precision", [("llama", "fp32"), ("qwen2", "bf16"), ("gpt2", "bf16")])
def test_selective_estimate_matches_the_profiler_on_transformers_models(model_type, precision):
    """Within 1% (the issue's bound); measured within 48 bytes since the copy of the CPU RNG state that
    torch.utils.checkpoint keeps per block is counted. (GPT-2 in bf16 was 3.6% low until oneDNN's bf16
    matmul workspaces were counted: memory/kernels.py.)"""
    wl = _user_built(model_type)
    cfg = Config(micro_batch=4, precision=precision, activation_checkpoint="selective")
    est = memfit.estimate(wl, cfg)
    assert est.method == "fake"
    assert est.peak_bytes < memfit.estimate(wl, cfg.replace(activation_checkpoint="none")).peak_bytes
    real = real_step_peak(wl, cfg, repeats=1)
    assert abs(est.peak_bytes - real) <= 0.01 * real, (est.peak_bytes, real)


class _FillsOnce(nn.Module):
    """Fills a table on its first call only, as rotary and mask caches do: its forward runs two matmuls, its
    recomputation one, of the same shapes. Matching calls by count gave the recomputation the table's
    matmul output in place of its own: wrong gradients, silently."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.table = None

    def forward(self, x):
        if self.table is None:
            base = torch.arange(16.0)
            self.table = (base[:, None] @ base[None, :])[:, :16] / 256
        return torch.relu(self.lin(x) @ self.table)


class _ChangesItsMatmul(nn.Module):
    """Modifies a matmul output in place: a kept output that changed since must be recomputed, not reused."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x):
        h = x @ self.weight
        h.mul_(0.5)
        return torch.tanh(h)


@pytest.mark.parametrize("block", [_FillsOnce, _ChangesItsMatmul])
def test_selective_checkpointing_does_not_match_calls_by_count(block):
    wl = memfit.Workload(model=lambda: nn.Sequential(block(), block(), nn.Linear(16, 1)),
                         batch=lambda n: torch.randn(n, 16), loss=lambda m, b: m(b).square().mean(),
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5), name=block.__name__)
    _assert_same_training(wl, "fp32", micro_batch=16)


class _Recounts(nn.Module):
    """Computes something else each call: no checkpointing can recompute it, and its fake probe says so."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = self.lin(x)
        return (h[:, :8] if self.calls % 2 == 0 else h).relu().sum(-1, keepdim=True).expand(-1, 16)


def test_oom_recovery_never_moves_to_a_checkpointing_whose_probe_fails(tmp_path):
    wl = memfit.Workload(model=lambda: nn.Sequential(_Recounts(), _Recounts()), batch=lambda n: torch.randn(n, 16),
                         loss=lambda m, b: m(b).square().mean(), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                         name="recounts")
    need = memfit.estimate(wl, Config(micro_batch=1)).peak_bytes
    with pytest.raises(RunError) as err:
        memfit.train(wl, 1, 1, budget=need - 1, config=Config(micro_batch=1), progress=False, out=tmp_path / "run")
    message = str(err.value)
    assert "nothing smaller is left to try" in message
    for ck in ("selective", "all"):
        assert f"activation checkpointing {ck} not tried: tracing it raised CheckpointError" in message
