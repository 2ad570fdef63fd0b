"""CUDA autocast's op policy on a CPU trace.

A GPU target is traced on fake CPU tensors (a CUDA kernel path aborts a CPU-only build), but CPU autocast
casts different ops than CUDA autocast: CUDA runs softmax, log_softmax, layer_norm, exp, pow, sum, norms and
losses in fp32 and keeps their fp32 results for backward, where CPU leaves many of them in half precision.
While `policy()` is active, memfit's own kernels sit on the AutocastCPU dispatch key and cast as CUDA's
kernels do (PyTorch's "Autocast Op Reference" for CUDA, aten/src/ATen/autocast_mode.{h,cpp}):

* lower precision: floating arguments (not fp64) cast to the autocast dtype;
* fp32: floating arguments cast to fp32;
* fp32, output dtype: the op's optional `dtype` set to fp32 when its first argument is eligible;
* fp32, appended dtype: `norm` redispatched to its overload that takes a dtype;
* promote: every floating argument cast to the widest floating argument (fp64 ignored);
* banned: binary_cross_entropy raises, as it does on a GPU.

Every kernel then runs the op with autocast excluded, as CUDA's do. Ops CPU autocast casts and CUDA's
does not (cat, stack, cross_entropy_loss, padding convolutions, linear algebra, ...) fall through, so
the ops they decompose into meet the CUDA policy. In-place and `out=` variants are autocast on neither.

Lower-precision ops whose CPU kernel casts exactly as CUDA's does (`SAME_ON_CPU`: the same PyTorch
template, weight-cast cache included) keep it. The others (einsum, mv, the RNN cells, ...) cache a
parameter's cast here, as PyTorch caches it, for memfit's forward; inside a checkpoint's recomputation
they cast without a cache (PyTorch would keep such a cast until the recomputation ends).

The registration is process-wide: a GPU-target trace runs alone in its process (a forked child).
"""
from __future__ import annotations

import contextlib
import warnings
import weakref

import torch

from memfit.errors import WorkloadError
from memfit.torch_internals import autocast_disabled, autocast_kernel_ops

# CUDA autocast's lists (torch 2.13); tests/test_cuda_autocast.py checks them against the AutocastCUDA
# kernels of the installed torch, both ways.
LOWER_PRECISION = frozenset("""
    _convolution _convolution.deprecated conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input
    conv_transpose3d.input convolution cudnn_convolution cudnn_convolution_transpose prelu addmm addmv addr
    matmul einsum mm mv linalg_vecdot linear addbmm baddbmm bmm chain_matmul linalg_multi_dot
    _thnn_fused_lstm_cell _thnn_fused_gru_cell lstm_cell gru_cell rnn_tanh_cell rnn_relu_cell
    _scaled_dot_product_flash_attention scaled_dot_product_attention""".split())
FP32 = frozenset("""
    acos asin cosh erfinv exp expm1 log log10 log2 log1p reciprocal rsqrt sinh tan pow.Tensor_Scalar
    pow.Tensor_Tensor pow.Scalar softplus layer_norm native_layer_norm rms_norm group_norm frobenius_norm.dim
    nuclear_norm nuclear_norm.dim cosine_similarity poisson_nll_loss cosine_embedding_loss nll_loss nll_loss2d
    hinge_embedding_loss kl_div l1_loss smooth_l1_loss huber_loss mse_loss margin_ranking_loss
    multilabel_margin_loss soft_margin_loss triplet_margin_loss multi_margin_loss binary_cross_entropy_with_logits
    dist pdist cdist renorm logsumexp upsample_nearest1d _upsample_nearest_exact1d upsample_nearest2d
    _upsample_nearest_exact2d upsample_nearest3d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d
    _upsample_bilinear2d_aa upsample_trilinear3d upsample_bicubic2d _upsample_bicubic2d_aa""".split())
# op -> position of its optional `dtype` argument; None: keyword-only
FP32_OUTPUT_DTYPE = {"prod": None, "prod.dim_int": None, "softmax.int": 2, "log_softmax.int": 2, "cumprod": None,
                     "cumsum": None, "linalg_vector_norm": None, "linalg_matrix_norm": None,
                     "linalg_matrix_norm.str_ord": None, "sum": None, "sum.dim_IntList": None}
# op -> the overload it is redispatched to, with a dtype appended
FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
PROMOTE = frozenset("addcdiv addcmul atan2 bilinear cross dot vdot grid_sampler index_put tensordot scatter_add"
                    .split())
BANNED = frozenset({"binary_cross_entropy"})
# lower-precision ops whose AutocastCPU kernel is the same cast as CUDA's: left in place
SAME_ON_CPU = frozenset("""
    conv1d conv2d conv3d conv_tbc conv_transpose1d conv_transpose2d.input conv_transpose3d.input
    _convolution.deprecated prelu addmm addbmm baddbmm bmm mm matmul linear linalg_vecdot
    scaled_dot_product_attention""".split())

POLICY: dict[str, str] = {
    **dict.fromkeys(LOWER_PRECISION, "lower_precision"), **dict.fromkeys(FP32, "fp32"),
    **dict.fromkeys(FP32_OUTPUT_DTYPE, "fp32_output_dtype"), **dict.fromkeys(FP32_APPEND_DTYPE, "fp32_append_dtype"),
    **dict.fromkeys(PROMOTE, "promote"), **dict.fromkeys(BANNED, "banned")}

_active = 0                       # nesting depth of policy()
_library: torch.library.Library | None = None
_cache: dict | None = None        # id(parameter) -> (weakref, cast) inside memfit's forward, else None


@contextlib.contextmanager
def policy():
    """CUDA's autocast policy for CPU autocast while active (re-entrant); CPU's own policy after."""
    global _active, _library
    if _active == 0:
        _library = _register()
    _active += 1
    try:
        yield
    finally:
        _active -= 1
        if _active == 0:
            _library, library = None, _library
            del library  # the last reference: its finaliser removes every kernel it registered


@contextlib.contextmanager
def autocast(dtype: torch.dtype):
    """`torch.autocast("cpu", dtype)` under CUDA's policy, with a cast cache for the ops cast here that
    lives as long as the region, as PyTorch's own does."""
    global _cache
    with policy():
        outer = _cache is None
        if outer:
            _cache = {}
        try:
            with torch.autocast("cpu", dtype=dtype):
                yield
        finally:
            if outer:
                _cache = None


def _register() -> torch.library.Library:
    cpu_ops = autocast_kernel_ops("AutocastCPU")
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        for name, kind in POLICY.items():
            if name in SAME_ON_CPU and name in cpu_ops:
                continue
            library.impl(name, _kernel(name, kind), "AutocastCPU")
        for name in cpu_ops - POLICY.keys():
            library.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
    return library


def _op(name: str):
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _eligible(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_floating_point() and t.dtype != torch.float64


def _map(fn, value):
    if isinstance(value, (list, tuple)):
        return type(value)(_map(fn, v) for v in value)
    return fn(value)


def _cast(t, dtype: torch.dtype):
    """PyTorch's cached_cast: eligible tensors of another dtype are cast; an fp32 leaf that requires grad
    (a parameter) cast to the autocast dtype is cast once per region. (PyTorch also skips a leaf that is a
    view, which only a view made to require grad by hand is: not modelled.)"""
    if not _eligible(t) or t.dtype == dtype:
        return t
    cacheable = (_cache is not None and dtype == torch.get_autocast_dtype("cpu") and t.dtype == torch.float32
                 and t.requires_grad and t.is_leaf and torch.is_autocast_cache_enabled())
    if not cacheable:
        return t.to(dtype)
    hit = _cache.get(id(t))
    if hit is not None and hit[0]() is t:
        return hit[1]
    cast = t.to(dtype)
    _cache[id(t)] = (weakref.ref(t), cast)
    return cast


def _widest(name: str, args, kwargs) -> torch.dtype:
    low = torch.get_autocast_dtype("cpu")
    widest = low
    for t in _tensors((args, kwargs)):
        if not _eligible(t):
            continue
        if torch.float32 in (widest, t.dtype):
            widest = torch.float32
        elif t.dtype != low:
            raise WorkloadError(f"{name} under CUDA autocast to {low} gets a {t.dtype} argument, which fails on "
                                "a GPU (autocast's promote accepts only fp32 and the autocast dtype)")
    return widest


def _tensors(value):
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, torch.Tensor):
        yield value


def _kernel(name: str, kind: str):
    op = _op(name)

    def cast_all(dtype, args, kwargs):
        return _map(lambda a: _cast(a, dtype), args), {k: _map(lambda a: _cast(a, dtype), v) for k, v in kwargs.items()}

    if kind == "banned":
        def kernel(*args, **kwargs):
            raise WorkloadError("binary_cross_entropy (BCELoss) under autocast fails on a GPU: PyTorch refuses it "
                                "as unsafe to autocast; use binary_cross_entropy_with_logits (BCEWithLogitsLoss)")
    elif kind == "fp32_output_dtype":
        position = FP32_OUTPUT_DTYPE[name]

        def kernel(*args, **kwargs):
            if _eligible(args[0]):
                if position is not None and len(args) > position:
                    if args[position] is None:
                        args = args[:position] + (torch.float32,) + args[position + 1:]
                elif kwargs.get("dtype") is None:
                    kwargs["dtype"] = torch.float32
            with autocast_disabled():
                return op(*args, **kwargs)
    elif kind == "fp32_append_dtype":
        target = _op(FP32_APPEND_DTYPE[name])

        def kernel(self, p=2, dim=None, keepdim=False):
            dtype = torch.float32 if _eligible(self) else self.dtype
            with autocast_disabled():
                if dim is None:  # norm.Scalar
                    return target(self, p, dtype=dtype)
                return target(self, p, dim, keepdim, dtype=dtype)
    else:
        def kernel(*args, **kwargs):
            if kind == "lower_precision":
                dtype = torch.get_autocast_dtype("cpu")
            elif kind == "fp32":
                dtype = torch.float32
            else:
                dtype = _widest(name, args, kwargs)
            args, kwargs = cast_all(dtype, args, kwargs)
            with autocast_disabled():
                return op(*args, **kwargs)
    return kernel
