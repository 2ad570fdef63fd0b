"""Fake tensors and FLOP counting for the estimator, on top of the private names in memfit.torch_internals."""
from __future__ import annotations

import contextlib
import functools
import logging
import math

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry, register_flop_formula

from memfit.torch_internals import (DEVICE_QUERY, FAKE_TENSOR_LOGGER, DataDependentOutputException, FakeTensor,
                                    FakeTensorMode, TorchDispatchMode, answer_device_query, fake_constant,
                                    fake_constants_up_to, fast_cache_keys, make_op_outputs_swappable,
                                    trunc_normal_skipped, unset_fake_temporarily)

__all__ = ["FakeTensor", "FakeTensorMode", "FlopCounterMode", "OptimizerScalars", "FakeBuild", "LayerDropDraws",
           "new_fake_mode", "is_fake", "quiet_fake_errors", "op_flops", "trace_optimizer"]


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
    from outside (module-level constants in user code) are converted on use instead of refused. Modules
    may move or cast their fake parameters (PEFT's adapters do), as on real tensors. Its op cache takes
    memfit's keys, built in a fifth of the time (`fast_cache_keys`)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    make_op_outputs_swappable(mode)
    fast_cache_keys(mode)
    return mode


def is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)


def op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one aten op by FlopCounterMode's formulas. Counting here instead of running
    FlopCounterMode alongside: its module tracker keeps checkpointed activations alive and moved the
    traced peak by 14% on a checkpointed GPT."""
    formula = flop_registry.get(getattr(func, "_overloadpacket", None))
    if formula is None:
        return 0
    if isinstance(func, torch._ops.OpOverload) and func._overloadname.startswith("dtype"):
        # mm / addmm / bmm / baddbmm.dtype(_out) take an output dtype after the operands (CUDA's half-precision
        # operands into an fp32 result), which torch's formulas would read as the output's shape
        args = tuple(a for a in args if not isinstance(a, torch.dtype))
    return int(formula(*args, **kwargs, out_val=out))


class FakeBuild(TorchFunctionMode):
    """Building a model on the fake tensors of `mode`, where a real build does three things fake tensors
    cannot follow as they are:

    - `copy.deepcopy` of a fake tensor lands in a *new* fake mode in torch 2.13, so a model that
      deep-copies a layer while being built (nn.TransformerEncoder does) later fails with "Mixing fake
      modes": fake tensors are copied by cloning them in their own mode, keeping Parameter-ness.
    - Constructors compute Python numbers from tensors of constants: drop-path rates as
      `torch.linspace(0, rate, depth).tolist()` (ViT-likes, ConvNeXt, Swin), relative-position tables from
      `arange`. `linspace`, `logspace` and `arange` results of up to CONSTANT_NUMEL elements are computed
      for real and carried as FakeTensorMode constants, whose values ops on them keep (up to as many
      elements) and `.item()` reads: the same numbers as a real build, no guess.
    - `nn.init.trunc_normal_` resamples until no value falls outside its bounds, a loop on values that do
      not exist here; it is skipped for fake tensors, as torch skips it for meta ones. Initial values
      never change memory.
    """

    CONSTANT_NUMEL = 4096  # schedules and index tables, never a weight or an activation
    CONSTANT_FACTORIES = frozenset({torch.linspace, torch.logspace, torch.arange})

    def __init__(self, mode: FakeTensorMode):
        super().__init__()
        self.mode = mode
        self._patches = contextlib.ExitStack()

    def __enter__(self):
        self._patches.enter_context(fake_constants_up_to(self.CONSTANT_NUMEL))
        self._patches.enter_context(trunc_normal_skipped(is_fake))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patches.close()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
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
        out = func(*args, **kwargs)
        if (func in self.CONSTANT_FACTORIES and is_fake(out) and out.numel() <= self.CONSTANT_NUMEL
                and out.device.type == "cpu" and not any(is_fake(a) for a in (*args, *kwargs.values()))):
            with unset_fake_temporarily():
                real = func(*args, **kwargs)
            out = fake_constant(self.mode, real).requires_grad_(out.requires_grad)
        return out


class LayerDropDraws(TorchFunctionMode):
    """LayerDrop skips a layer when a fresh random number is below `layerdrop` (`if torch.rand([]) <
    layerdrop`, in every transformers model that has it): a branch on a value fake tensors do not have.
    Each draw of one number by `torch.rand` is answered with the largest value below 1, under which no
    layer is skipped: the step's largest memory, the one a plan must fit (a real step skips each layer
    with probability `layerdrop` and holds less). `answered` counts them, for the estimate's note."""

    def __init__(self):
        super().__init__()
        self.answered = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shape = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
        if (func is torch.rand and all(isinstance(d, int) for d in shape) and math.prod(shape) == 1
                and not {"generator", "out", "names"} & set(kwargs)):
            self.answered += 1
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            below_one = 1 - torch.finfo(dtype).eps / 2
            value = torch.tensor(below_one, dtype=dtype, device=kwargs.get("device"))  # a fake constant
            return value.reshape(shape).requires_grad_(kwargs.get("requires_grad", False))
        return func(*args, **kwargs)


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


# ------------------------------------------------------------------------------ optimizers on fake tensors

class OptimizerScalars(TorchDispatchMode):
    """Fake tensors have no values, so an optimizer that reads one (`.item()`) stops the trace. In torch.optim
    the reads that fake tensors cannot answer (step counts are constants they can) only scale the update:
    Adafactor's RMS of a parameter and of its update, each taken under `max(eps, .)`, and ASGD's averaging
    weight `mu`, which is exactly 1 until step `t0` (10^6 by default) and picks the plain copy there. Answering
    1 keeps every op and tensor the real step makes at those steps; only the scalars differ. `answered`
    counts the stand-ins, so the estimate can say it used them."""

    def __init__(self):
        super().__init__()
        self.answered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is DEVICE_QUERY:
            return answer_device_query(args, kwargs or {})
        try:
            return func(*args, **(kwargs or {}))
        except DataDependentOutputException:
            if func is not torch.ops.aten._local_scalar_dense.default:
                raise
            self.answered += 1
            dtype = args[0].dtype
            return True if dtype is torch.bool else 1 if not dtype.is_floating_point else 1.0


def trace_optimizer(optimizer: torch.optim.Optimizer) -> OptimizerScalars:
    """Run every `optimizer.step()` under one `OptimizerScalars` (returned, to read `answered`)."""
    scalars = OptimizerScalars()
    step = optimizer.step

    @functools.wraps(step)
    def traced_step(*args, **kwargs):
        with scalars:
            return step(*args, **kwargs)

    optimizer.step = traced_step
    return scalars
