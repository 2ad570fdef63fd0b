"""8-bit optimizer state: Adam's two moments kept as one byte an element plus one fp32 scale per block of 256
elements, the block-wise layout of bitsandbytes' and torchao's 8-bit AdamW: 2.03 bytes a parameter for both
moments instead of 8.

A code is a step on a logarithmic grid below its block's largest magnitude (eighth-octave steps, so every
value is kept within 4.4%): small values keep their scale where a linear code would flush them to zero, and
the second moment spans many orders of magnitude in one block. Blocks run along each row of dim 0 (a row of
any other width ends in a shorter block): FSDP shards parameters by rows, so every rank holds whole blocks,
and the moments, their rounding and the checkpoint (codes and scales sharded as the parameter is, resharded
by DCP) are the same for any number of ranks. Where rows are multiples of 256 elements (a transformer's
matrices) this is bitsandbytes' flat layout exactly. Tensors under 4,096 elements, and one-dimensional ones
(norms, biases: their blocks could not follow a shard's edge), keep fp32 moments, as bitsandbytes keeps those
under its `min_8bit_size`; their update is torch's own AdamW formula. The update runs about CHUNK elements
(whole rows) at a time, so each fp32 temporary stays near 64 MiB whatever the parameter's size.

This changes the math (each moment is rounded after every step): memfit uses it only when it is allowed
(`Config.optimizer_8bit`; the planner's ``allow=("8bit-optim",)``) and says so wherever it is used. It is
written in plain PyTorch, so it runs, and is traced, on any device; a GPU user of bitsandbytes holds the
same state bytes (its fused kernel has no temporaries, this one's are counted as they are).
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import sys
from typing import Callable, Iterable

import torch

from memfit.errors import ConfigError

BLOCK = 256         # elements sharing one fp32 scale
MIN_SIZE = 4096     # smaller tensors keep fp32 moments
CHUNK = 1 << 24     # elements updated at once (whole rows; one row where a row is longer): 64 MiB per fp32 temporary
STEPS = 8           # codes per octave
TOP = {torch.uint8: 255, torch.int8: 127}  # the largest code: the block's largest magnitude


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `x` -> (codes of `dtype` shaped as `x`, fp32 scales: one per BLOCK elements of each row of the last
    dim, the last block of a row shorter). uint8 for values >= 0, int8 (sign times code) for signed ones;
    code 0 is zero."""
    top, width = TOP[dtype], x.shape[-1]
    pad = (-width) % BLOCK
    blocks = (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(*x.shape[:-1], -1, BLOCK)
    scale = blocks.abs().amax(dim=-1)
    rel = blocks.abs() / scale.clamp(min=torch.finfo(torch.float32).tiny)[..., None]
    k = rel.log2_().mul_(STEPS).add_(top).round_().clamp_(0, top)  # log2(0) = -inf -> code 0
    if dtype == torch.int8:
        k.mul_(blocks.sign())
    return k.view(*x.shape[:-1], -1)[..., :width].to(dtype), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`quantize`'s inverse on the grid: fp32 values shaped as `codes`."""
    top, width = TOP[codes.dtype], codes.shape[-1]
    k = codes.float()
    pad = (-width) % BLOCK
    k = torch.nn.functional.pad(k, (0, pad)) if pad else k
    mag = k.abs().sub_(top).div_(STEPS).exp2_().view(*scale.shape, BLOCK).mul_(scale[..., None])
    mag = mag.view(*codes.shape[:-1], -1)[..., :width]
    return mag.mul_(k[..., :width].sign())  # zero codes give zero; int8 codes carry the sign


# A fake-tensor trace of a large model spent most of its time on work repeated exactly: the identical chunks
# of a 4-bit weight (a 405B: ~575,000 of them a step) and the 8-bit update of parameters shaped alike (an 8B's
# 32 blocks, ~40,000 ops a step). Each chunk and each steady update frees all it takes, so the first one
# traced has every later one's memory; the tracer records its ops as many times as it stands for, for the
# step time.
TRACER: contextvars.ContextVar = contextvars.ContextVar("memfit_repeats_tracer", default=None)


@contextlib.contextmanager
def chunks_traced_once(tracer):
    """While a step runs on fake tensors: trace the first of a 4-bit weight's identical chunks, and the first
    of the optimizer-phase 8-bit updates of parameters shaped alike, only; `tracer` (`ops_recorded()` -> a
    position, `repeat_ops(position, times, until)`, `phase`) repeats their ops for the rest. Never on real
    tensors: the skipped values would not be made."""
    token = TRACER.set(tracer)
    try:
        yield
    finally:
        TRACER.reset(token)


_PRIMING: contextvars.ContextVar = contextvars.ContextVar("memfit_8bit_priming", default=False)


@contextlib.contextmanager
def state_made_only():
    """While a step primes its optimizer on fake tensors: an 8-bit step makes each parameter's state and
    leaves the update out, whose values are not made anyway (an 8B's update is ~40,000 ops to trace)."""
    token = _PRIMING.set(True)
    try:
        yield
    finally:
        _PRIMING.reset(token)


def _is_dtensor(t: torch.Tensor) -> bool:
    """A DTensor (FSDP's sharded parameters, their gradients and state). One exists only once
    torch.distributed.tensor is loaded, which memfit does not load for this: importing it costs every
    `import memfit` half a second."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a DTensor; a plain tensor is its own."""
    return t.to_local() if _is_dtensor(t) else t


def _state_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local`, the rank's rows of a 2-D state tensor, as a DTensor sharded as `p` is (so DCP saves and
    reshards it), for a sharded `p`; else as it is."""
    if not _is_dtensor(p):
        return local
    from torch.distributed.tensor import DTensor

    rows, width = p.shape[0], local.shape[1]
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=(rows, width),
                              stride=(width, 1))


class Adam8bit(torch.optim.Optimizer):
    """Adam (``decoupled=False``) or AdamW with 8-bit moments; hyperparameters as torch.optim.AdamW's.
    Build it from the workload's own optimizer with `eight_bit`."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 decoupled: bool = True):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      decoupled=decoupled))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        tracer, priming = TRACER.get(), _PRIMING.get()
        traced: dict[tuple, tuple[int, int, int]] = {}  # alike -> (first op, op after its last, paged bytes)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                # an update in the optimizer phase with its state made frees all it takes (in backward the
                # bytes around it differ from one parameter to the next)
                alike = (id(group), _local(p).shape, p.dtype, _local(p.grad).shape, p.grad.dtype, p.device) \
                    if tracer is not None and self.state[p] and tracer.phase == "optimizer" else None
                if alike in traced:
                    first, after, paged = traced[alike]
                    tracer.repeat_ops(first, 1, until=after)
                    self.state[p]["step"] += 1
                    if paged:
                        self.moved_bytes += paged
                    continue
                first, moved = (tracer.ops_recorded() if tracer else 0), getattr(self, "moved_bytes", 0)
                self._update(p, group, update=not priming)
                if alike is not None:
                    traced[alike] = (first, tracer.ops_recorded(), getattr(self, "moved_bytes", 0) - moved)
        return loss

    def _update(self, p: torch.Tensor, group: dict, update: bool = True) -> None:
        """`p`'s update, its state made first where it has none (only that without `update`)."""
        state, local, grad = self.state[p], _local(p), _local(p.grad)
        if p.dim() < 2 or p.numel() < MIN_SIZE:  # fp32 moments
            if not state:
                state.update(step=0, exp_avg=torch.zeros_like(p, dtype=torch.float32),
                             exp_avg_sq=torch.zeros_like(p, dtype=torch.float32))
            state["step"] += 1
            if update:
                _adam(local.view(-1), grad.reshape(-1), _local(state["exp_avg"]).view(-1),
                      _local(state["exp_avg_sq"]).view(-1), group, state["step"])
            return
        rows, width = local.shape[0], math.prod(p.shape[1:])  # this rank's rows
        if not state:
            state["step"] = 0
            blocks = -(-width // BLOCK)
            for key, dtype, n in (("exp_avg", torch.int8, width), ("exp_avg_scale", torch.float32, blocks),
                                  ("exp_avg_sq", torch.uint8, width), ("exp_avg_sq_scale", torch.float32, blocks)):
                state[key] = _state_like(p, torch.zeros(rows, n, dtype=dtype, device=local.device))
        state["step"] += 1
        if not update:
            return
        weights, grad = local.view(rows, width), grad.reshape(rows, width)
        m, ms, v, vs = (_local(state[k]) for k in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"))
        chunk = max(1, CHUNK // width)  # rows at a time
        starts, tracer = list(range(0, rows, chunk)), TRACER.get()
        once = tracer is not None and len(starts) > 2  # traced: the first full chunk stands for all but the last
        for r0 in [starts[0], starts[-1]] if once else starts:
            r1 = min(r0 + chunk, rows)
            if once and r0 == 0:
                mark = tracer.ops_recorded()
            elif once:  # the chunks between, each as the first
                tracer.repeat_ops(mark, len(starts) - 2, until=tracer.ops_recorded())
            mean, square = dequantize(m[r0:r1], ms[r0:r1]), dequantize(v[r0:r1], vs[r0:r1])
            _adam(weights[r0:r1], grad[r0:r1], mean, square, group, state["step"])
            for codes, scales, values in ((m, ms, mean), (v, vs, square)):
                new_codes, new_scales = quantize(values, codes.dtype)
                codes[r0:r1], scales[r0:r1] = new_codes, new_scales
                del new_codes, new_scales
            del mean, square, values  # the loop variable holds the last of them: 64 MiB kept into the next chunk

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts floating state to each parameter's dtype (a bf16 parameter's fp32 scales to
        bf16); the saved tensors are put back as saved, so a resume is exact. Saved parameters are named by
        their index, or by their name in a distributed checkpoint: matched in order, as torch matches them."""
        super().load_state_dict(state_dict)
        saved = [key for group in state_dict["param_groups"] for key in group["params"]]
        params = dict(zip(saved, (p for group in self.param_groups for p in group["params"])))
        for key, values in state_dict["state"].items():
            for name, value in values.items():
                if isinstance(value, torch.Tensor):
                    self.state[params[key]][name] = value.to(params[key].device, copy=True)


def _adam(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, group: dict,
          step: int) -> None:
    """One Adam(W) update of `p` with fp32 moments, in place; torch.optim.AdamW's single-tensor formula."""
    lr, (beta1, beta2), eps, wd = float(group["lr"]), group["betas"], group["eps"], group["weight_decay"]
    grad = grad.float()
    if wd and not group["decoupled"]:
        grad = grad.add(p.float(), alpha=wd)
    elif wd:
        p.mul_(1 - lr * wd)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1 ** step))


def eight_bit(make_optimizer: Callable[[Iterable], torch.optim.Optimizer]) -> Callable[[Iterable], Adam8bit]:
    """The workload's optimizer factory with its Adam or AdamW rebuilt with 8-bit moments: the same parameter
    groups and hyperparameters. Anything else is refused: the layout is defined for Adam's two moments."""
    def make(params) -> Adam8bit:
        opt = make_optimizer(params)
        if not isinstance(opt, torch.optim.Adam) and not isinstance(opt, torch.optim.AdamW):
            raise ConfigError(f"8-bit optimizer states are built for Adam and AdamW; the workload's optimizer is "
                              f"{type(opt).__name__}")
        for flag in ("amsgrad", "maximize"):
            if any(g.get(flag) for g in opt.param_groups):
                raise ConfigError(f"8-bit optimizer states do not support Adam's {flag}=True")
        decoupled = isinstance(opt, torch.optim.AdamW) or bool(opt.defaults.get("decoupled_weight_decay"))
        groups = [{k: g[k] for k in ("params", "lr", "betas", "eps", "weight_decay")} for g in opt.param_groups]
        return Adam8bit(groups, decoupled=decoupled)
    return make
