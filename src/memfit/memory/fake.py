"""The one place memfit touches PyTorch's private fake-tensor and FLOP-counting internals.

tests/test_torch_pins.py pins every name used here, so a torch upgrade that moves them fails loudly.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # private: pinned in tests
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

__all__ = ["FakeTensor", "FakeTensorMode", "FlopCounterMode", "new_fake_mode", "is_fake"]


def new_fake_mode() -> FakeTensorMode:
    """Fake tensors carry shapes, dtypes and devices but no data; ops run their meta kernels. Real tensors
    from outside (module-level constants in user code) are converted on use instead of refused."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)


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
