"""CUDA's dropout and attention kernels on a CPU trace.

A GPU target is traced on fake CPU tensors, and two ops keep more there than CUDA's kernels do:

* `aten::dropout` on CPU draws a noise tensor in the input's dtype and multiplies by it, so backward keeps
  2-4 bytes per element. On CUDA (and XPU, lazy, PrivateUse1) ATen's `dropout` takes the fused
  `native_dropout` when training with 0 < p < 1 and a non-empty input (`is_fused_kernel_acceptable`,
  aten/src/ATen/native/Dropout.cpp), which keeps a 1-byte bool mask. While `kernels()` is active, memfit's
  kernel for dropout's CompositeImplicitAutograd key does the same. `dropout_`, `feature_dropout` and the
  alpha dropouts take the noise path on CUDA too, and are left alone.
* `scaled_dot_product_attention` with dropout_p > 0 (transformers models in training) runs the math path on
  CPU, whose fused kernel refuses dropout: the attention matrix, its softmax and a dropout mask are kept.
  CUDA's flash and memory-efficient kernels apply dropout inside and keep only the output and an fp32
  logsumexp (their RNG seed and offset are host scalars on NVIDIA GPUs: no device bytes). Where CUDA would
  run one of them (`fused_on_cuda`), the call is traced without dropout, so the CPU takes its flash kernel,
  which keeps the same tensors.

Why two mechanisms: dropout is redirected in the dispatcher, so calls from C++ (the math attention path
included) are routed too. SDPA has to run PyTorch's own composite (mask conversion, backend choice) with one
argument changed; a kernel that replaces that composite cannot call it, so SDPA is intercepted one level
up, by a TorchFunctionMode, as Python code (transformers, nn.MultiheadAttention, memfit's GPT) calls it.

Assumed of the GPU: sm80 or newer's alignment rules (V100/T4 accept a few more fp32 head sizes); CUDA's
default backend order (flash, then memory-efficient); the memory-efficient kernel's logsumexp padding to a
multiple of 32 query positions, flash's padding of a head size that is not a multiple of 8, and cuDNN
attention (first on some H100/B200 builds, same saved tensors) are not modelled.

The dropout kernel is registered process-wide while active: a GPU-target trace runs alone in its process.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import re
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_library: torch.library.Library | None = None  # while kernels() is active
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@contextlib.contextmanager
def kernels(active: bool = True):
    """CUDA's dropout and attention-with-dropout kernels for a CPU trace while `active`; the CPU's own
    after. Inside an active region a nested one changes nothing."""
    global _library
    if not active or _library is not None:
        yield
        return
    _library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore")
            _library.impl("dropout", _dropout, "CompositeImplicitAutograd")
        with _Attention():
            yield
    finally:
        _library, library = None, _library
        del library  # the last reference: its finaliser removes the kernel


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """ATen's `dropout` as it runs on a CUDA tensor (p was range-checked by F.dropout, or by a C++ caller)."""
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout(input, p, train)[0]
    if p == 0 or not train or input.numel() == 0:
        return input
    return input * torch.zeros((), dtype=input.dtype, device=input.device)  # p == 1


class _Attention(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            call = dict(zip(_SDPA_ARGS, args), **kwargs)
            if call.get("dropout_p", 0.0) > 0 and fused_on_cuda(**call):
                call["dropout_p"] = 0.0  # the kernel keeps what CUDA's keeps; the dropout is inside it there
                return func(**call)
        return func(*args, **kwargs)


def fused_on_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False) -> bool:
    """Whether CUDA's SDPA would run flash or memory-efficient attention on these inputs (sm80+), by the
    checks of aten/src/ATen/native/transformers/cuda/sdp_utils.cpp that the trace can see. Under autocast
    the inputs are cast to the autocast dtype first (SDPA is on CUDA autocast's lower-precision list)."""
    q, k, v = query, key, value
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.stride(-1) == 1 for t in (q, k, v)):
        return False
    dtype = q.dtype
    if torch.is_autocast_enabled("cpu") and dtype in (torch.float32, torch.float16, torch.bfloat16):
        dtype = torch.get_autocast_dtype("cpu")
    if q.size(-2) == 0 or k.size(-2) == 0 or not q.size(0) == k.size(0) == v.size(0) or k.size(1) != v.size(1):
        return False
    if q.size(1) != k.size(1) and not (enable_gqa and q.size(1) % k.size(1) == 0):
        return False
    d_q, d_k, d_v = q.size(-1), k.size(-1), v.size(-1)
    flash = (attn_mask is None and dtype in (torch.float16, torch.bfloat16) and d_q == d_k == d_v <= 256
             and not (is_causal and q.size(-2) != k.size(-2)))
    align = 8 if dtype in (torch.float16, torch.bfloat16) else 4
    aligned = dtype != q.dtype or all(t.storage_offset() % align == 0 for t in (q, k, v))  # a cast copy starts at 0
    efficient = (dtype in (torch.float16, torch.bfloat16, torch.float32) and d_q == d_k and d_q % align == 0
                 and d_v % align == 0 and aligned)
    return flash or efficient


# transformers declares, beside a model's reference PyTorch code, the fused kernel package that replaces it on a
# GPU where that package is installed (mamba_ssm's selective scan, causal_conv1d, fla's linear attention), or
# loads a hub kernel by name on a GPU where the `kernels` package is installed (RWKV's WKV, YOSO's, MRA's)
_FALLBACK = re.compile(r'use_kernel_func_from_hub_with_fallback\(\s*"(\w+)"\s*,\s*"(\w+)"')
_HUB_KERNEL = re.compile(r'get_kernel\(\s*"([\w.-]+/[\w.-]+)"')


def fused_elsewhere(model: torch.nn.Module) -> list[str]:
    """"package (function, ...)" for each fused GPU kernel package that the code of `model`'s modules
    declares as replacing its reference PyTorch path, and "org/name (hub kernel)" for each kernel it loads
    from the hub by name. A trace runs that reference path (as a GPU without the package does); the fused
    kernels keep other tensors, which memfit does not model."""
    found: dict[str, list[str]] = {}
    for name in sorted({type(m).__module__ for m in model.modules()}):
        fallbacks, hub = _declared_kernels(name)
        for func, package in fallbacks:
            found.setdefault(package, []).append(func)
        for kernel in hub:
            found.setdefault(kernel, ["hub kernel"])
    return [f"{package} ({', '.join(funcs)})" for package, funcs in sorted(found.items())]


@functools.cache
def _declared_kernels(module_name: str) -> tuple[tuple, tuple]:
    module = sys.modules.get(module_name)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):  # no source (built-in, compiled): nothing declared that we can read
        source = ""
    return tuple(_FALLBACK.findall(source)), tuple(_HUB_KERNEL.findall(source))
