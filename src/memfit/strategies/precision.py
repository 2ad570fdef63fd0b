"""Precision: fp32, bf16 autocast (fp32 weights), fp16 autocast with dynamic loss scaling, pure bf16.

bf16-pure casts the weights to bf16 and keeps no fp32 master copy: gradients and optimizer state are bf16
too (2 + 2 + 4 bytes/param with AdamW instead of 16). That is cheaper and numerically weaker; say so.
"""
from __future__ import annotations

import contextlib

import torch

from memfit.config import Config, ConfigError
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


def autocast_context(config: Config, device: torch.device):
    if config.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if config.precision == "fp16":
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


def make_grad_scaler(config: Config, device: torch.device):
    """fp16 gradients underflow without loss scaling; GradScaler finds the largest safe scale and skips
    steps whose gradients overflowed."""
    if config.precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


def check_precision(config: Config, device_name: str, has_bf16: bool) -> None:
    if config.precision in ("bf16", "bf16-pure") and not has_bf16:
        raise ConfigError(f"{device_name} has no native bf16 support: use fp16 or fp32")
