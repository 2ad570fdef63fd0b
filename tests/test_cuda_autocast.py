"""A GPU target's step is traced on the CPU with CUDA autocast's op policy (strategies/cuda_autocast.py):
the lists against the installed torch's AutocastCUDA kernels, every op's output dtype, the estimate of a
LayerNorm + eager-attention model against bytes counted by hand, and CPU autocast left as it was."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfit
from memfit import Config
from memfit.errors import WorkloadError
from memfit.memory.fake import new_fake_mode
from memfit.strategies import cuda_autocast as ca
from memfit.torch_internals import TorchDispatchMode, autocast_kernel_ops, tree_leaves

aten = torch.ops.aten
LOW = (torch.float16, torch.bfloat16)


def test_the_lists_are_exactly_the_installed_cuda_autocast_kernels():
    """A torch upgrade that adds an op to CUDA autocast (or drops one) fails here, not in an estimate."""
    installed = autocast_kernel_ops("AutocastCUDA")
    assert set(ca.POLICY) - installed == set(), "listed, but CUDA autocast has no kernel for it"
    assert installed - set(ca.POLICY) == set(), "CUDA autocast casts it, memfit's lists miss it"
    assert len(ca.POLICY) == len(ca.LOWER_PRECISION) + len(ca.FP32) + len(ca.FP32_OUTPUT_DTYPE) + len(
        ca.FP32_APPEND_DTYPE) + len(ca.PROMOTE) + len(ca.BANNED)  # no op in two lists
    assert ca.SAME_ON_CPU <= ca.LOWER_PRECISION and ca.SAME_ON_CPU <= autocast_kernel_ops("AutocastCPU")


# One call per op with small inputs: `f` gets a maker of floating tensors in the dtype the check needs.
def _calls():
    x = {}
    idx = lambda *shape: torch.zeros(shape, dtype=torch.long)  # noqa: E731
    conv = dict(stride=[1, 1], padding=[0, 0], dilation=[1, 1])
    x.update({
        "_convolution": lambda t: aten._convolution(t(1, 2, 5, 5), t(3, 2, 3, 3), None, conv["stride"], conv["padding"],
                                                    conv["dilation"], False, [0, 0], 1, False, False, True, True),
        "_convolution.deprecated": lambda t: aten._convolution.deprecated(
            t(1, 2, 5, 5), t(3, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, False, False, True),
        "conv1d": lambda t: F.conv1d(t(1, 2, 5), t(3, 2, 3)),
        "conv2d": lambda t: F.conv2d(t(1, 2, 5, 5), t(3, 2, 3, 3)),
        "conv3d": lambda t: F.conv3d(t(1, 2, 4, 4, 4), t(3, 2, 3, 3, 3)),
        "conv_tbc": lambda t: aten.conv_tbc(t(5, 1, 2), t(3, 2, 4), t(4)),
        "conv_transpose1d": lambda t: F.conv_transpose1d(t(1, 2, 5), t(2, 3, 3)),
        "conv_transpose2d.input": lambda t: F.conv_transpose2d(t(1, 2, 5, 5), t(2, 3, 3, 3)),
        "conv_transpose3d.input": lambda t: F.conv_transpose3d(t(1, 2, 4, 4, 4), t(2, 3, 3, 3, 3)),
        "convolution": lambda t: aten.convolution(t(1, 2, 5, 5), t(3, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], False,
                                                  [0, 0], 1),
        "cudnn_convolution": lambda t: aten.cudnn_convolution(t(1, 2, 5, 5), t(3, 2, 3, 3), [0, 0], [1, 1], [1, 1], 1,
                                                              False, False, True),
        "cudnn_convolution_transpose": lambda t: aten.cudnn_convolution_transpose(
            t(1, 2, 5, 5), t(2, 3, 3, 3), [0, 0], [0, 0], [1, 1], [1, 1], 1, False, False, True),
        "prelu": lambda t: F.prelu(t(2, 3), t(1)),
        "addmm": lambda t: torch.addmm(t(4, 4), t(4, 4), t(4, 4)),
        "addmv": lambda t: torch.addmv(t(4), t(4, 4), t(4)),
        "addr": lambda t: torch.addr(t(4, 4), t(4), t(4)),
        "matmul": lambda t: t(4, 4) @ t(4, 4),
        "einsum": lambda t: torch.einsum("ij,jk->ik", t(4, 4), t(4, 4)),
        "mm": lambda t: torch.mm(t(4, 4), t(4, 4)),
        "mv": lambda t: torch.mv(t(4, 4), t(4)),
        "linalg_vecdot": lambda t: torch.linalg.vecdot(t(4), t(4)),
        "linear": lambda t: F.linear(t(2, 4), t(3, 4), t(3)),
        "addbmm": lambda t: torch.addbmm(t(4, 4), t(2, 4, 4), t(2, 4, 4)),
        "baddbmm": lambda t: torch.baddbmm(t(2, 4, 4), t(2, 4, 4), t(2, 4, 4)),
        "bmm": lambda t: torch.bmm(t(2, 4, 4), t(2, 4, 4)),
        "chain_matmul": lambda t: aten.chain_matmul([t(4, 4), t(4, 4), t(4, 4)]),
        "linalg_multi_dot": lambda t: torch.linalg.multi_dot([t(4, 4), t(4, 4), t(4, 4)]),
        "_thnn_fused_lstm_cell": lambda t: aten._thnn_fused_lstm_cell(t(2, 12), t(2, 12), t(2, 3), t(12), t(12))[0],
        "_thnn_fused_gru_cell": lambda t: aten._thnn_fused_gru_cell(t(2, 9), t(2, 9), t(2, 3), t(9), t(9))[0],
        "lstm_cell": lambda t: aten.lstm_cell(t(2, 4), [t(2, 3), t(2, 3)], t(12, 4), t(12, 3), t(12), t(12))[0],
        "gru_cell": lambda t: aten.gru_cell(t(2, 4), t(2, 3), t(9, 4), t(9, 3), t(9), t(9)),
        "rnn_tanh_cell": lambda t: aten.rnn_tanh_cell(t(2, 4), t(2, 3), t(3, 4), t(3, 3), t(3), t(3)),
        "rnn_relu_cell": lambda t: aten.rnn_relu_cell(t(2, 4), t(2, 3), t(3, 4), t(3, 3), t(3), t(3)),
        "_scaled_dot_product_flash_attention": lambda t: aten._scaled_dot_product_flash_attention(
            t(1, 2, 8, 16), t(1, 2, 8, 16), t(1, 2, 8, 16))[0],
        "scaled_dot_product_attention": lambda t: F.scaled_dot_product_attention(t(1, 2, 8, 16), t(1, 2, 8, 16),
                                                                                 t(1, 2, 8, 16)),
    })
    for name in "acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan softplus".split():
        x[name] = lambda t, op=getattr(aten, name): op(t(4, 4))
    x.update({
        "pow.Tensor_Scalar": lambda t: aten.pow.Tensor_Scalar(t(4), 2),
        "pow.Tensor_Tensor": lambda t: aten.pow.Tensor_Tensor(t(4), t(4)),
        "pow.Scalar": lambda t: aten.pow.Scalar(2, t(4)),
        "layer_norm": lambda t: F.layer_norm(t(2, 4), (4,), t(4), t(4)),
        "native_layer_norm": lambda t: aten.native_layer_norm(t(2, 4), [4], t(4), t(4), 1e-5)[0],
        "rms_norm": lambda t: F.rms_norm(t(2, 4), (4,), t(4)),
        "group_norm": lambda t: F.group_norm(t(2, 4, 3), 2, t(4), t(4)),
        "frobenius_norm.dim": lambda t: aten.frobenius_norm.dim(t(4, 4), [1]),
        "nuclear_norm": lambda t: aten.nuclear_norm(t(4, 4)),
        "nuclear_norm.dim": lambda t: aten.nuclear_norm.dim(t(4, 4), [0, 1]),
        "cosine_similarity": lambda t: F.cosine_similarity(t(2, 4), t(2, 4)),
        "poisson_nll_loss": lambda t: F.poisson_nll_loss(t(4), t(4)),
        "cosine_embedding_loss": lambda t: F.cosine_embedding_loss(t(2, 4), t(2, 4), t(2)),
        "nll_loss": lambda t: aten.nll_loss(t(2, 4), idx(2)),
        "nll_loss2d": lambda t: aten.nll_loss2d(t(1, 4, 3, 3), idx(1, 3, 3)),
        "hinge_embedding_loss": lambda t: F.hinge_embedding_loss(t(4), t(4)),
        "kl_div": lambda t: F.kl_div(t(4), t(4), reduction="sum"),
        "l1_loss": lambda t: F.l1_loss(t(4), t(4)),
        "smooth_l1_loss": lambda t: F.smooth_l1_loss(t(4), t(4)),
        "huber_loss": lambda t: F.huber_loss(t(4), t(4)),
        "mse_loss": lambda t: F.mse_loss(t(4), t(4)),
        "margin_ranking_loss": lambda t: F.margin_ranking_loss(t(4), t(4), t(4)),
        "multilabel_margin_loss": lambda t: F.multilabel_margin_loss(t(2, 4), idx(2, 4)),
        "soft_margin_loss": lambda t: F.soft_margin_loss(t(4), t(4)),
        "triplet_margin_loss": lambda t: F.triplet_margin_loss(t(2, 4), t(2, 4), t(2, 4)),
        "multi_margin_loss": lambda t: F.multi_margin_loss(t(2, 4), idx(2)),
        "binary_cross_entropy_with_logits": lambda t: F.binary_cross_entropy_with_logits(t(4), t(4)),
        "dist": lambda t: torch.dist(t(4), t(4)),
        "pdist": lambda t: F.pdist(t(3, 4)),
        "cdist": lambda t: torch.cdist(t(3, 4), t(2, 4)),
        "renorm": lambda t: torch.renorm(t(4, 4), 2, 0, 1.0),
        "logsumexp": lambda t: torch.logsumexp(t(4, 4), 1),
        "upsample_nearest1d": lambda t: aten.upsample_nearest1d(t(1, 2, 4), [8]),
        "_upsample_nearest_exact1d": lambda t: aten._upsample_nearest_exact1d(t(1, 2, 4), [8]),
        "upsample_nearest2d": lambda t: aten.upsample_nearest2d(t(1, 2, 4, 4), [8, 8]),
        "_upsample_nearest_exact2d": lambda t: aten._upsample_nearest_exact2d(t(1, 2, 4, 4), [8, 8]),
        "upsample_nearest3d": lambda t: aten.upsample_nearest3d(t(1, 2, 4, 4, 4), [8, 8, 8]),
        "_upsample_nearest_exact3d": lambda t: aten._upsample_nearest_exact3d(t(1, 2, 4, 4, 4), [8, 8, 8]),
        "upsample_linear1d": lambda t: aten.upsample_linear1d(t(1, 2, 4), [8], False),
        "upsample_bilinear2d": lambda t: aten.upsample_bilinear2d(t(1, 2, 4, 4), [8, 8], False),
        "_upsample_bilinear2d_aa": lambda t: aten._upsample_bilinear2d_aa(t(1, 2, 4, 4), [8, 8], False),
        "upsample_trilinear3d": lambda t: aten.upsample_trilinear3d(t(1, 2, 4, 4, 4), [8, 8, 8], False),
        "upsample_bicubic2d": lambda t: aten.upsample_bicubic2d(t(1, 2, 4, 4), [8, 8], False),
        "_upsample_bicubic2d_aa": lambda t: aten._upsample_bicubic2d_aa(t(1, 2, 4, 4), [8, 8], False),
        # fp32 by an output dtype (set only when the caller gave none) and norm's appended dtype
        "prod": lambda t: aten.prod(t(4)),
        "prod.dim_int": lambda t: aten.prod.dim_int(t(4, 4), 0),
        "softmax.int": lambda t: aten.softmax.int(t(4, 4), 1),
        "log_softmax.int": lambda t: aten.log_softmax.int(t(4, 4), 1),
        "cumprod": lambda t: aten.cumprod(t(4), 0),
        "cumsum": lambda t: aten.cumsum(t(4), 0),
        "linalg_vector_norm": lambda t: torch.linalg.vector_norm(t(4, 4)),
        "linalg_matrix_norm": lambda t: aten.linalg_matrix_norm(t(4, 4), 1),
        "linalg_matrix_norm.str_ord": lambda t: aten.linalg_matrix_norm.str_ord(t(4, 4)),
        "sum": lambda t: aten.sum(t(4)),
        "sum.dim_IntList": lambda t: aten.sum.dim_IntList(t(4, 4), [0]),
        "norm.Scalar": lambda t: aten.norm.Scalar(t(4)),
        "norm.ScalarOpt_dim": lambda t: aten.norm.ScalarOpt_dim(t(4, 4), 2, [1]),
    })
    return x


def _promote_calls(a, b):
    """Each promote op with one argument made by `a` and another by `b` (the rest integer or fixed)."""
    idx = torch.zeros(2, dtype=torch.long)
    return {
        "addcdiv": lambda: torch.addcdiv(a(4), a(4), b(4)),
        "addcmul": lambda: torch.addcmul(a(4), a(4), b(4)),
        "atan2": lambda: torch.atan2(a(4), b(4)),
        "bilinear": lambda: F.bilinear(a(2, 3), b(2, 4), b(5, 3, 4)),
        "cross": lambda: aten.cross(a(2, 3), b(2, 3), 1),
        "dot": lambda: torch.dot(a(4), b(4)),
        "vdot": lambda: torch.vdot(a(4), b(4)),
        "grid_sampler": lambda: torch.grid_sampler(a(1, 2, 4, 4), b(1, 3, 3, 2), 0, 0, False),
        "index_put": lambda: torch.index_put(a(4), (idx,), b(2)),
        "tensordot": lambda: torch.tensordot(a(4, 4), b(4, 4), dims=1),
        "scatter_add": lambda: torch.scatter_add(a(4), 0, idx, b(2)),
    }


def _maker(dtype):
    return lambda *shape: torch.rand(*shape).to(dtype) + 0.5  # in (0.5, 1.5): inside every op's domain


# CUDA-only kernels without a CPU or meta kernel: a CPU trace never reaches them, and calling one fails
# below autocast; what autocast handed down is checked instead.
NO_CPU_KERNEL = {"cudnn_convolution", "cudnn_convolution_transpose", "_thnn_fused_gru_cell"}


class OpLog(TorchDispatchMode):
    """The ops below autocast, with the dtypes of their floating tensor arguments."""

    def __init__(self):
        super().__init__()
        self.ops, self.dtypes = [], {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        self.dtypes[str(func)] = {t.dtype for t in tree_leaves((args, kwargs))
                                  if isinstance(t, torch.Tensor) and t.is_floating_point()}
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("low", LOW)
def test_every_listed_op_leaves_with_cuda_autocasts_dtype(low):
    calls, promote = _calls(), _promote_calls(_maker(low), _maker(torch.float32))
    assert set(calls) | set(promote) | ca.BANNED == set(ca.POLICY), "every listed op is called here"
    wrong = {}
    with new_fake_mode(), ca.autocast(low):
        for name, call in calls.items():
            if name in NO_CPU_KERNEL:
                with OpLog() as log, pytest.raises(NotImplementedError):
                    call(_maker(torch.float32))
                got, want = log.dtypes[f"aten.{name}.default"], {low}
            elif name in ca.LOWER_PRECISION:  # fp32 arguments in, the autocast dtype out
                got, want = call(_maker(torch.float32)).dtype, low
            else:                             # half arguments in, fp32 out
                got, want = call(_maker(low)).dtype, torch.float32
            if got != want:
                wrong[name] = (got, want)
        for name, call in promote.items():  # the widest: fp32 with an fp32 argument, else the autocast dtype
            if call().dtype != torch.float32:
                wrong[name] = (call().dtype, torch.float32)
        for name, call in _promote_calls(_maker(low), _maker(low)).items():
            if call().dtype != low:
                wrong[name + " (all low)"] = (call().dtype, low)
    assert wrong == {}


def test_fp64_and_integers_are_left_alone_and_an_explicit_dtype_wins():
    """As CUDA's kernels: fp64 is not eligible (not cast, ignored by promote), integers neither, and the
    fp32 output dtype is only a default."""
    with new_fake_mode(), ca.autocast(torch.float16):
        d, h = torch.rand(4, 4, dtype=torch.float64), torch.rand(4, 4).half()
        assert (d @ d).dtype == torch.float64 and d.softmax(1).dtype == torch.float64 and d.exp().dtype == torch.float64
        assert torch.addcmul(h, h, d).dtype == torch.float64  # promote ignores fp64; the op's own promotion decides
        assert torch.arange(4).cumsum(0).dtype == torch.int64 and torch.arange(4).sum().dtype == torch.int64
        assert aten.softmax.int(h, 1, torch.float16).dtype == torch.float16
        assert h.sum(dtype=torch.float16).dtype == torch.float16 and h.softmax(1).dtype == torch.float32
        a = torch.rand(4, 4)
        assert torch.mm(a, a, out=torch.empty(4, 4)).dtype == torch.float32  # out= variants: not autocast
        assert torch.exp(h, out=torch.empty(4, 4, dtype=torch.float16)).dtype == torch.float16


def test_banned_and_mismatched_ops_fail_as_on_a_gpu():
    with new_fake_mode(), ca.autocast(torch.float16):
        p = torch.rand(4)
        with pytest.raises(WorkloadError, match="binary_cross_entropy_with_logits"):
            F.binary_cross_entropy(p, p)
        with pytest.raises(WorkloadError, match="addcmul"):
            torch.addcmul(p.half(), p.half(), p.bfloat16())


def test_ops_cpu_autocast_casts_and_cuda_does_not_fall_through_to_what_they_call():
    """cross_entropy: CPU autocast casts the logits to fp32 and runs log_softmax on them; CUDA autocast has
    no kernel for it, so its log_softmax gets the logits' own dtype, which PyTorch passes explicitly (the
    half log-probabilities are what backward keeps), and nll_loss casts them to fp32. cat: no cast."""
    with new_fake_mode():
        logits, y = torch.rand(8, 5).half(), torch.zeros(8, dtype=torch.long)
        seen = {}
        for policy in ("cpu", "cuda"):
            region = ca.autocast(torch.float16) if policy == "cuda" else torch.autocast("cpu", dtype=torch.float16)
            with region, OpLog() as log:
                assert F.cross_entropy(logits, y).dtype == torch.float32
                assert torch.cat([logits, logits]).dtype == torch.float16
            seen[policy] = [(op, log.dtypes[op]) for op in log.ops if not op.startswith("prim.")]
    half, single = {torch.float16}, {torch.float32}
    assert seen["cpu"] == [("aten._to_copy.default", half), ("aten._log_softmax.default", single),
                           ("aten.nll_loss_forward.default", single), ("aten.cat.default", half)]
    assert seen["cuda"] == [("aten._log_softmax.default", half), ("aten._to_copy.default", half),
                            ("aten.nll_loss_forward.default", single), ("aten.cat.default", half)]


def _cpu_dtypes(low=torch.float16):
    """What plain CPU autocast gives for the listed ops (fp32 arguments for the lower list, half otherwise)."""
    out = {}
    with new_fake_mode(), torch.autocast("cpu", dtype=low):
        for name, call in _calls().items():
            try:
                out[name] = call(_maker(torch.float32 if name in ca.LOWER_PRECISION else low)).dtype
            except (RuntimeError, NotImplementedError) as e:  # half unsupported on CPU, CUDA-only kernels
                out[name] = type(e).__name__
    return out


def test_cpu_autocast_is_its_own_again_after_a_gpu_target_trace():
    before, kernels = _cpu_dtypes(), autocast_kernel_ops("AutocastCPU")
    with ca.policy():
        with ca.policy():  # re-entrant: the inner exit keeps the outer's kernels
            pass
        assert torch.rand(2, 2).half().softmax(1).dtype == torch.float16  # no autocast region: nothing cast
        with torch.autocast("cpu", dtype=torch.float16):
            assert torch.rand(2, 2).half().softmax(1).dtype == torch.float32
    assert _cpu_dtypes() == before and autocast_kernel_ops("AutocastCPU") == kernels
    assert before["softmax.int"] == before["layer_norm"] == before["exp"] == torch.float16  # CPU's own policy


def test_a_parameter_is_cast_once_per_forward_as_pytorchs_cache_does():
    """einsum is cast by memfit (CPU autocast does not list it): a weight used twice in one autocast region
    is cast once (the input, not a parameter, every time), and cast again in the next region."""
    w, x = nn.Parameter(torch.rand(4, 4)), torch.rand(2, 4)
    with OpLog() as log:
        for _ in range(2):
            with ca.autocast(torch.float16):
                assert torch.einsum("ij,jk->ik", x, w).dtype == torch.einsum("ij,jk->ik", x, w).dtype == torch.float16
    assert log.ops.count("aten._to_copy.default") == 2 * (1 + 2)


B, T, D, H = 2, 32, 32, 2


class LayerNormAttention(nn.Module):
    """Linear -> LayerNorm -> eager attention (explicit softmax) -> six Linears, whose saved inputs put the
    peak at the end of the forward on both targets, where it is the saved activations and nothing else."""

    def __init__(self):
        super().__init__()
        self.inp, self.ln, self.qkv, self.out = nn.Linear(D, D), nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.tail = nn.Sequential(*[nn.Linear(D, D) for _ in range(6)])

    def forward(self, x):
        q, k, v = self.qkv(self.ln(self.inp(x))).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        p = (q @ k.transpose(-1, -2)).softmax(-1)
        del q, k
        o = p @ v
        del p, v
        return self.tail(self.out(o.transpose(1, 2).reshape(B, T, D)))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_gpu_target_keeps_what_cuda_autocast_keeps_in_fp32(precision, without_cpu_workspaces):
    wl = memfit.Workload(model=LayerNormAttention, batch=lambda n: {"x": torch.randn(n, T, D)},
                         loss=lambda m, b: m(b["x"]).float().mean(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                         name="ln-attention")
    kernels = autocast_kernel_ops("AutocastCPU")
    cpu, gpu = (memfit.estimate(wl, Config(micro_batch=B, precision=precision), device=d, isolate=False)
                for d in ("cpu", "h100"))
    # by hand, what CUDA autocast keeps for backward in fp32 where CPU autocast keeps half (2 bytes): layer
    # norm's input (cast to fp32; its mean and rstd are fp32 on both, the CPU kernel's for a half input with
    # fp32 weights), and softmax's fp32 output, besides the half copy p @ v keeps (CPU keeps one, shared)
    layer_norm = B * T * D * (4 - 2)
    softmax = B * H * T * T * 4
    assert cpu.peak_phase == gpu.peak_phase == "forward"
    assert gpu.peak_bytes - cpu.peak_bytes == layer_norm + softmax == 20_480
    assert {c: gpu.breakdown[c] - cpu.breakdown[c] for c in cpu.breakdown} == {
        "parameters": 0, "gradients": 0, "optimizer_state": 0, "inputs": 0, "activations": layer_norm + softmax,
        "temporaries": 0}
    # fp16's loss scaler: an fp32 scale and an int32 growth tracker, on the device as on CUDA
    assert gpu.model_state_bytes["optimizer_state"] == cpu.model_state_bytes["optimizer_state"] == (
        8 if precision == "fp16" else 0)
    assert "mixed precision traced with CUDA autocast's op policy" in gpu.notes
    assert not any("CUDA autocast" in n for n in cpu.notes)
    # the trace ran in this process; CPU autocast is CPU's again
    assert autocast_kernel_ops("AutocastCPU") == kernels
    with torch.autocast("cpu", dtype=torch.float16):
        h = torch.rand(2, 4).half()
        assert F.layer_norm(h, (4,)).dtype == h.softmax(1).dtype == torch.float16
