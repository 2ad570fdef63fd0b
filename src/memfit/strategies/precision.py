"""Precision: fp32, bf16 autocast (fp32 weights), fp16 autocast with dynamic loss scaling, pure bf16.

bf16-pure casts the weights to bf16 and keeps no fp32 master copy: gradients and optimizer state are bf16
too (2 + 2 + 4 bytes/param with AdamW instead of 16). That is cheaper and numerically weaker; say so.
"""
from __future__ import annotations

import contextlib

import torch

from memfit.config import Config, ConfigError
from memfit.strategies import cuda_autocast
from memfit.workload import map_tensors


def cast_model(model: torch.nn.Module, config: Config) -> torch.nn.Module:
    """Cast floating parameters and buffers to bf16 in place. (`Module.to` cannot swap fake parameters in
    torch 2.13; assigning `.data` keeps the Parameter objects, so tied weights stay tied.)"""
    if config.precision != "bf16-pure":
        return model
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(torch.bfloat16)
    for mod in model.modules():
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf.is_floating_point():
                setattr(mod, name, buf.to(torch.bfloat16))  # Module.__setattr__ replaces a registered buffer
    return model


def cast_inputs(batch, config: Config):
    """bf16-pure weights need bf16 inputs; integer tensors (token ids, labels) stay as they are."""
    if config.precision != "bf16-pure":
        return batch
    return map_tensors(batch, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)


AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(config: Config, device: torch.device, cuda_target: bool = False):
    """The forward's autocast. `cuda_target`: a CPU trace of a GPU step, cast as CUDA autocast casts."""
    dtype = AUTOCAST_DTYPES.get(config.precision)
    if dtype is None or config.fsdp:  # FSDP2 casts the parameters itself (strategies/data_parallel.py)
        return contextlib.nullcontext()
    return cuda_autocast.autocast(dtype) if cuda_target else torch.autocast(device.type, dtype=dtype)


def op_policy(config: Config, cuda_target: bool):
    """CUDA autocast's op policy for a whole CPU-traced step of a GPU target: activation checkpointing
    re-runs forward ops under autocast inside backward, so the policy spans more than the forward."""
    if cuda_target and config.precision in AUTOCAST_DTYPES and not config.fsdp:
        return cuda_autocast.policy()
    return contextlib.nullcontext()


def make_grad_scaler(config: Config, device: torch.device):
    """fp16 gradients underflow without loss scaling; GradScaler finds the largest safe scale and skips
    steps whose gradients overflowed. Its code is the same for every device type: a "cpu" scaler keeps
    what a "cuda" one keeps on the GPU (an fp32 scale, an int32 growth tracker, and while a step unscales,
    an fp32 found-inf flag and inverse scale per device), so a CPU trace holds a GPU's scaler bytes."""
    if config.precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def check_precision(config: Config, device_name: str, has_bf16: bool) -> None:
    if config.precision in ("bf16", "bf16-pure") and not has_bf16:
        raise ConfigError(f"{device_name} has no native bf16 support: use fp16 or fp32")
