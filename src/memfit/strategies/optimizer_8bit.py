"""8-bit optimizer state: Adam's two moments kept as one byte an element plus one fp32 scale per block of 256
elements, the block-wise layout of bitsandbytes' and torchao's 8-bit AdamW: 2.03 bytes a parameter for both
moments instead of 8.

A code is a step on a logarithmic grid below its block's largest magnitude (eighth-octave steps, so every
value is kept within 4.4%): small values keep their scale where a linear code would flush them to zero, and
the second moment spans many orders of magnitude in one block. Tensors under 4,096 elements keep fp32
moments, as bitsandbytes does (`min_8bit_size`); their update is torch's own AdamW formula. The update runs
CHUNK elements at a time, so each fp32 temporary stays within 64 MiB whatever the parameter's size.

This changes the math (each moment is rounded after every step): memfit uses it only when it is allowed
(`Config.optimizer_8bit`; the planner's ``allow=("8bit-optim",)``) and says so wherever it is used. It is
written in plain PyTorch, so it runs, and is traced, on any device; a GPU user of bitsandbytes holds the
same state bytes (its fused kernel has no temporaries, this one's are counted as they are).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from memfit.errors import ConfigError

BLOCK = 256         # elements sharing one fp32 scale
MIN_SIZE = 4096     # smaller tensors keep fp32 moments
CHUNK = 1 << 24     # elements updated at once (a multiple of BLOCK): 64 MiB per fp32 temporary
STEPS = 8           # codes per octave
TOP = {torch.uint8: 255, torch.int8: 127}  # the largest code: the block's largest magnitude


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D fp32 `x` -> (codes of `dtype`, one fp32 scale per BLOCK elements). uint8 for values >= 0, int8
    (sign times code) for signed ones; code 0 is zero."""
    top = TOP[dtype]
    pad = (-x.numel()) % BLOCK
    blocks = torch.nn.functional.pad(x, (0, pad)).view(-1, BLOCK) if pad else x.view(-1, BLOCK)
    scale = blocks.abs().amax(dim=1)
    rel = blocks.abs() / scale.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
    k = rel.log2_().mul_(STEPS).add_(top).round_().clamp_(0, top)  # log2(0) = -inf -> code 0
    if dtype == torch.int8:
        k.mul_(blocks.sign())
    return k.view(-1)[:x.numel()].to(dtype), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`quantize`'s inverse on the grid: fp32 values of the 1-D `codes`."""
    top = TOP[codes.dtype]
    k = codes.float()
    n = codes.numel()
    pad = (-n) % BLOCK
    k = torch.nn.functional.pad(k, (0, pad)) if pad else k
    mag = k.abs().sub_(top).div_(STEPS).exp2_().view(-1, BLOCK).mul_(scale[:, None]).view(-1)[:n]
    return mag.mul_(k[:n].sign())  # zero codes give zero; int8 codes carry the sign


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
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = 0
            if p.numel() < MIN_SIZE:
                state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            else:
                blocks = -(-p.numel() // BLOCK)
                state["exp_avg"] = torch.zeros(p.numel(), dtype=torch.int8, device=p.device)
                state["exp_avg_scale"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                state["exp_avg_sq"] = torch.zeros(p.numel(), dtype=torch.uint8, device=p.device)
                state["exp_avg_sq_scale"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        state["step"] += 1
        flat, grad = p.view(-1), p.grad.reshape(-1)
        if "exp_avg_scale" not in state:
            _adam(flat, grad, state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1), group, state["step"])
            return
        m, ms, v, vs = (state[k] for k in ("exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale"))
        for start in range(0, flat.numel(), CHUNK):
            end, b0, b1 = min(start + CHUNK, flat.numel()), start // BLOCK, -(-min(start + CHUNK, flat.numel()) // BLOCK)
            mean, square = dequantize(m[start:end], ms[b0:b1]), dequantize(v[start:end], vs[b0:b1])
            _adam(flat[start:end], grad[start:end], mean, square, group, state["step"])
            for codes, scales, values in ((m, ms, mean), (v, vs, square)):
                new_codes, new_scales = quantize(values, codes.dtype)
                codes[start:end], scales[b0:b1] = new_codes, new_scales
                del new_codes, new_scales
            del mean, square

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts floating state to each parameter's dtype (a bf16 parameter's fp32 scales to
        bf16); the saved tensors are put back as saved, so a resume is exact."""
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            for key, value in saved.items():
                if isinstance(value, torch.Tensor):
                    self.state[params[index]][key] = value.to(params[index].device, copy=True)


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
