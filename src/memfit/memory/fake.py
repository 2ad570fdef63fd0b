"""Fake tensors and FLOP counting for the estimator, on top of the private names in memfit.torch_internals."""
from __future__ import annotations

import contextlib
import logging

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula

from memfit.torch_internals import FAKE_TENSOR_LOGGER, FakeTensor, FakeTensorMode

__all__ = ["FakeTensor", "FakeTensorMode", "FlopCounterMode", "SameModeDeepcopy", "new_fake_mode", "is_fake", "quiet_fake_errors",
           "op_flops"]


@contextlib.contextmanager
def quiet_fake_errors():
    """FakeTensorMode logs every failing meta kernel with a full traceback before raising; memfit reports
    the error itself (and falls back), so keep torch's copy off the user's terminal."""
    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def new_fake_mode() -> FakeTensorMode:
    """Fake tensors carry shapes, dtypes and devices but no data; ops run their meta kernels. Real tensors
    from outside (module-level constants in user code) are converted on use instead of refused."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one aten op by FlopCounterMode's formulas. Counting here instead of running
    FlopCounterMode alongside: its module tracker keeps checkpointed activations alive and moved the
    traced peak by 14% on a checkpointed GPT."""
    formula = flop_registry.get(getattr(func, "_overloadpacket", None))
    return int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0


class SameModeDeepcopy(TorchFunctionMode):
    """`copy.deepcopy` of a fake tensor lands in a *new* fake mode in torch 2.13, so a model that deep-copies
    a layer while being built (nn.TransformerEncoder does) later fails with "Mixing fake modes". While
    a model is built, copy fake tensors by cloning them in their own mode, keeping Parameter-ness."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__deepcopy__ and is_fake(args[0]):
            tensor, memo = args
            if id(tensor) not in memo:
                with torch.no_grad():
                    data = tensor.detach().clone()
                if isinstance(tensor, torch.nn.Parameter):
                    memo[id(tensor)] = torch.nn.Parameter(data, requires_grad=tensor.requires_grad)
                else:
                    memo[id(tensor)] = data.requires_grad_(tensor.requires_grad)
            return memo[id(tensor)]
        return func(*args, **(kwargs or {}))


# FlopCounterMode has formulas for the CUDA attention kernels but not for the CPU flash kernel that the
# fake CPU step dispatches to, so attention FLOPs would silently vanish. Two matmuls (QK^T, PV) forward;
# backward recomputes QK^T and does dV, dP, dQ, dK: five.
def _attention_flops(q_shape, k_shape, passes: int) -> int:
    b, h, lq, d = q_shape
    lk = k_shape[-2]
    return 2 * passes * b * h * lq * lk * d


@register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_flash_fwd(query_shape, key_shape, *args, **kwargs) -> int:  # formulas receive shapes
    return _attention_flops(query_shape, key_shape, 2)


@register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward)
def _cpu_flash_bwd(grad_out_shape, query_shape, key_shape, *args, **kwargs) -> int:
    return _attention_flops(query_shape, key_shape, 5)
