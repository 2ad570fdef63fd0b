"""A GPU target's dropout and attention-with-dropout keep what CUDA's kernels keep (strategies/cuda_kernels.py):
dropout a 1-byte mask (the fused native_dropout), SDPA with dropout only its output and an fp32 logsumexp
(flash / memory-efficient attention apply dropout inside); the CPU's own kernels are back after the trace."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit import Config
from memfit.strategies import cuda_kernels
from memfit.torch_internals import TorchDispatchMode

B, T, D, H = 2, 32, 32, 2
WIDE = 4 * D


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _workload(model, name):
    return memfit.Workload(model=model, batch=lambda n: {"x": torch.randn(n, T, D)},
                           loss=lambda m, b: m(b["x"]).float().mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                           name=name)


class DropoutMLP(nn.Module):
    """Linear -> Dropout -> Linear, then six Linears whose saved inputs outweigh anything backward adds."""

    def __init__(self):
        super().__init__()
        self.up, self.drop, self.down = nn.Linear(D, WIDE), nn.Dropout(0.1), nn.Linear(WIDE, D)
        self.tail = nn.Sequential(*[nn.Linear(D, D) for _ in range(6)])

    def forward(self, x):
        return self.tail(self.down(self.drop(self.up(x))))


@pytest.mark.parametrize("precision, element", [("fp32", 4), ("bf16", 2)])
def test_gpu_target_dropout_keeps_a_one_byte_mask(precision, element, without_cpu_workspaces):
    cpu, gpu = (memfit.estimate(_workload(DropoutMLP, "dropout-mlp"), Config(micro_batch=B, precision=precision),
                                device=d, isolate=False) for d in ("cpu", "h100"))
    # CPU keeps dropout's noise in its input's dtype (the Linear's output: fp32, or bf16 under autocast);
    # CUDA's fused dropout a bool mask. Nothing else differs, at the peak or in its breakdown.
    per_element = element - 1
    assert cpu.peak_bytes - gpu.peak_bytes == B * T * WIDE * per_element
    assert {c: cpu.breakdown[c] - gpu.breakdown[c] for c in cpu.breakdown} == {
        "parameters": 0, "gradients": 0, "optimizer_state": 0, "inputs": 0,
        "activations": B * T * WIDE * per_element, "temporaries": 0}
    mask = [t for t in gpu.top_tensors if t["op"] == "native_dropout.default" and t["dtype"] == "bool"]
    assert [(t["shape"], t["bytes"]) for t in mask] == [([B, T, WIDE], B * T * WIDE)]
    assert not any(t["op"].startswith("native_dropout") for t in cpu.top_tensors)
    assert any("dropout keeps a 1-byte mask" in n for n in gpu.notes)


def test_only_dropout_takes_the_fused_kernel_as_on_cuda():
    """ATen fuses `dropout` alone, and only when training with 0 < p < 1 on a non-empty tensor; the in-place,
    feature and alpha dropouts keep their noise tensor on CUDA too."""
    x = torch.rand(4, 6, 3, requires_grad=True)
    with cuda_kernels.kernels():
        with OpLog() as log:
            y = F.dropout(x, 0.5)
        assert log.ops == ["aten.native_dropout.default"] and y.shape == x.shape
        assert F.dropout(x, 0.5, training=False) is x and F.dropout(x, 0.0) is x
        assert torch.equal(F.dropout(x, 1.0), torch.zeros_like(x))
        assert F.dropout(torch.rand(0, 3), 0.5).shape == (0, 3)
        for other in (lambda t: F.dropout(t.detach(), 0.5, inplace=True), lambda t: F.dropout1d(t, 0.5),
                      lambda t: F.alpha_dropout(t, 0.5, True), lambda t: F.feature_alpha_dropout(t, 0.5, True)):
            with OpLog() as log:
                other(x)
            assert "aten.bernoulli_.float" in log.ops and "aten.native_dropout.default" not in log.ops


class Attention(nn.Module):
    """qkv Linear -> SDPA with dropout -> out Linear -> six Linears (the peak at the end of the forward)."""

    def __init__(self, dropout_p=0.1, head_dim=D // H, mask=False):
        super().__init__()
        self.p, self.d, self.mask = dropout_p, head_dim, mask
        self.qkv, self.out = nn.Linear(D, 3 * H * head_dim), nn.Linear(H * head_dim, D)
        self.tail = nn.Sequential(*[nn.Linear(D, D) for _ in range(6)])

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, T, 3, H, self.d).permute(2, 0, 3, 1, 4)
        mask = torch.ones(T, T, dtype=torch.bool).tril() if self.mask else None
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.p if self.training else 0.0)
        return self.tail(self.out(o.transpose(1, 2).reshape(B, T, H * self.d)))


def test_gpu_target_attention_with_dropout_keeps_output_and_logsumexp():
    est = {(p, d): memfit.estimate(_workload(lambda: Attention(p), "attention"), Config(micro_batch=B), device=d,
                                   isolate=False) for p in (0.0, 0.1) for d in ("cpu", "h100")}
    gpu = est[0.1, "h100"]
    # by hand, fp32, at the peak (the start of backward: every saved tensor is live): the qkv output (q, k
    # and v are views of it, kept by the kernel), the kernel's output and fp32 logsumexp, the six tail Linears'
    # inputs. The out Linear's input is a view of the kernel's output (CPU flash, like CUDA's kernels, writes
    # it in (B, T, H, d) order). Nothing of T x T.
    qkv, out, lse, tail_inputs = B * T * 3 * D * 4, B * H * T * (D // H) * 4, B * H * T * 4, 6 * B * T * D * 4
    assert gpu.breakdown["activations"] == qkv + out + lse + tail_inputs == 82_432
    assert not any(t["shape"][1:] == [H, T, T] for t in gpu.top_tensors)
    # dropout inside the kernel: the same bytes as without dropout (the kernel keeps its RNG seed and offset
    # on the host); the CPU target runs the math path and keeps T x T matrices
    assert gpu.peak_bytes == est[0.0, "h100"].peak_bytes and gpu.breakdown == est[0.0, "h100"].breakdown
    assert est[0.1, "cpu"].peak_bytes > gpu.peak_bytes
    assert any(t["shape"] == [B, H, T, T] and t["dtype"] == "float32" for t in est[0.1, "cpu"].top_tensors)
    # the attention FLOPs are still counted: two B x H x T x T x d matmuls forward (the attention runs in
    # the model's own forward, outside its Linears), and the step's as without dropout
    assert gpu.module_flops["Attention"] == 2 * 2 * B * H * T * T * (D // H)
    assert gpu.flops == est[0.0, "h100"].flops


@pytest.mark.parametrize("checkpoint", ["all", "selective", "transformers"])
def test_a_recomputed_block_traces_cudas_attention_as_its_forward_did(checkpoint):
    """torch.utils.checkpoint recomputes a block from backward, where the autograd engine has dropped every
    TorchFunctionMode, the one that traces CUDA's attention kernels with them: BERT's attention with dropout
    was recomputed on the CPU's math path, whose saved tensors differ from the forward's, and checkpoint()
    refused the step (CheckpointError), fake and measured alike. The recompute now runs under the forward's
    function modes, with memfit's checkpointing and with transformers' own (gradient_checkpointing_enable(),
    which checkpoints the same layers: the same estimate as memfit's "all")."""
    pytest.importorskip("transformers")
    import dataclasses

    from memfit.workloads import builtin

    wl = builtin("hf:bert")
    plain = memfit.estimate(wl, Config(micro_batch=2, precision="bf16"), device="h100")
    if checkpoint == "transformers":
        def model():
            m = wl.model()
            m.gradient_checkpointing_enable()
            return m

        est = memfit.estimate(dataclasses.replace(wl, model=model), Config(micro_batch=2, precision="bf16"),
                              device="h100")
        memfits = memfit.estimate(wl, Config(micro_batch=2, precision="bf16", activation_checkpoint="all"),
                                  device="h100")
        assert est.peak_bytes == memfits.peak_bytes and est.breakdown == memfits.breakdown
    else:
        est = memfit.estimate(wl, Config(micro_batch=2, precision="bf16", activation_checkpoint=checkpoint),
                              device="h100")
    assert est.method == plain.method == "fake"
    assert est.breakdown["activations"] < plain.breakdown["activations"]


@pytest.mark.parametrize("case, fused", [
    (dict(dtype=torch.float16, head_dim=12), True),                # flash: any head size up to 256
    (dict(dtype=torch.float32, head_dim=12), True),                # memory-efficient: fp32, 12 % 4 == 0
    (dict(dtype=torch.float32, head_dim=6), False),                # neither: math
    (dict(dtype=torch.float32, head_dim=8, mask=True), True),      # a mask: memory-efficient takes it
    (dict(dtype=torch.float16, head_dim=300), False),              # flash stops at 256, efficient needs % 8
    (dict(dtype=torch.float16, head_dim=304, mask=True), True),    # efficient has no upper bound
    (dict(dtype=torch.float64, head_dim=8), False),                # no fused kernel for fp64
])
def test_cuda_backend_choice(case, fused):
    q = torch.rand(B, H, T, case["head_dim"], dtype=case["dtype"])
    mask = torch.ones(T, T, dtype=torch.bool) if case.get("mask") else None
    assert cuda_kernels.fused_on_cuda(q, q, q, mask, 0.1) is fused
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts fp32 to bf16 first: efficient's % 8
        assert cuda_kernels.fused_on_cuda(torch.rand(B, H, T, 12), torch.rand(B, H, T, 12), torch.rand(B, H, T, 12),
                                          torch.ones(T, T, dtype=torch.bool), 0.1) is False


def test_attention_cuda_runs_in_math_keeps_cudas_dropout_mask():
    """fp32, head size 6 (not a multiple of 4), a mask: no fused kernel on CUDA either. The math path's
    dropout is then CUDA's fused one: a bool mask where the CPU keeps an fp32 noise tensor."""
    wl = _workload(lambda: Attention(0.1, head_dim=6, mask=True), "attention-math")
    cpu, gpu = (memfit.estimate(wl, Config(micro_batch=B), device=d, isolate=False) for d in ("cpu", "h100"))
    assert cpu.breakdown["activations"] - gpu.breakdown["activations"] == B * H * T * T * (4 - 1)


def test_cpu_kernels_are_back_after_a_gpu_target_trace():
    """A GPU-target trace in this process leaves CPU dropout and SDPA as they were: the same ops, the same
    random numbers, the same CPU-target estimate and the same real training step."""
    x = torch.rand(4, 8, 16, requires_grad=True)

    def cpu_ops():
        torch.manual_seed(0)
        with OpLog() as log:
            y = F.dropout(x, 0.5)
            a = F.scaled_dot_product_attention(x[None], x[None], x[None], dropout_p=0.5)
        return log.ops, y, a

    def train_loss():
        torch.manual_seed(0)
        return memfit.Trainer(_workload(DropoutMLP, "dropout-mlp"), Config(micro_batch=B)).step()

    wl = _workload(lambda: Attention(0.1), "attention")
    ops, y, a = cpu_ops()
    loss, cpu_est = train_loss(), memfit.estimate(wl, Config(micro_batch=B), device="cpu", isolate=False)
    memfit.estimate(wl, Config(micro_batch=B, precision="bf16"), device="h100", isolate=False)
    ops_after, y_after, a_after = cpu_ops()
    assert ops_after == ops and "aten.bernoulli_.float" in ops and "aten.native_dropout.default" not in ops
    assert torch.equal(y_after, y) and torch.equal(a_after, a)
    assert train_loss() == loss
    again = memfit.estimate(wl, Config(micro_batch=B), device="cpu", isolate=False)
    assert (again.peak_bytes, again.breakdown, again.flops) == (cpu_est.peak_bytes, cpu_est.breakdown, cpu_est.flops)
    with cuda_kernels.kernels():
        with cuda_kernels.kernels():  # nested: the inner exit keeps the outer's kernels
            pass
        with OpLog() as log:
            F.dropout(x, 0.5)
        assert log.ops == ["aten.native_dropout.default"]
