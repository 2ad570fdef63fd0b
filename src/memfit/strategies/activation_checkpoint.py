"""Activation checkpointing: drop a block's activations after its forward and recompute them in backward.

Blocks are found, not declared: the repeated modules inside `nn.ModuleList` / `nn.Sequential` containers
(a transformer's layers, a ResNet's bottlenecks). Each chosen block's `forward` is wrapped in
`torch.utils.checkpoint.checkpoint(use_reentrant=False)`; module names and state_dict keys do not change.
"selective" checkpoints every block but keeps the outputs of matmuls and attention (expensive to redo)
and recomputes only the cheap pointwise ops around them.
"""
from __future__ import annotations

import functools
from collections import defaultdict

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from memfit.config import ConfigError

# Ops whose outputs selective checkpointing keeps: recomputing them costs real FLOPs.
_SAVE = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default, torch.ops.aten.linear.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def find_blocks(model: torch.nn.Module) -> list[str]:
    """Names of the repeated blocks: the children of ModuleList/Sequential containers whose class occurs
    at least twice, taking the class with the most parameters in total (ties: the most instances)."""
    by_class: dict[type, list[str]] = defaultdict(list)
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.ModuleList, torch.nn.Sequential)):
            for child_name, child in mod.named_children():
                if not isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):  # a Sequential can be a block
                    by_class[type(child)].append(f"{name}.{child_name}" if name else child_name)
    modules = dict(model.named_modules())

    def weight(cls):
        names = by_class[cls]
        return sum(p.numel() for n in names for p in modules[n].parameters()), len(names)

    candidates = [cls for cls, names in by_class.items() if len(names) >= 2]
    if not candidates:
        return []
    names = by_class[max(candidates, key=weight)]
    # a block nested inside another chosen block is covered by the outer one
    return [n for n in names if not any(n.startswith(o + ".") for o in names if o != n)]


def chosen_blocks(model: torch.nn.Module, spec) -> list[str]:
    """Resolve Config.activation_checkpoint to module names, or raise ConfigError naming what is wrong."""
    if spec == "none":
        return []
    if isinstance(spec, tuple):
        modules = dict(model.named_modules())
        missing = [n for n in spec if n not in modules or n == ""]
        if missing:
            hint = ", ".join(find_blocks(model)[:6]) or "none found"
            raise ConfigError(f"activation checkpointing: no module named {', '.join(map(repr, missing))} (repeated blocks: {hint})")
        return list(spec)
    blocks = find_blocks(model)
    if not blocks:
        raise ConfigError("activation checkpointing: found no repeated blocks in this model; name modules explicitly")
    if spec in ("all", "selective"):
        return blocks
    return blocks[::spec]  # every k-th block, starting with the first


def _selective_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward, selective: bool, *args, **kwargs):
    if selective:
        context_fn = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_checkpointing(model: torch.nn.Module, names: list[str], selective: bool) -> torch.nn.Module:
    """Wrap the named blocks' forwards; wrappers from an earlier call are removed first, so a run can
    change its checkpointing (OOM recovery) without nesting them."""
    for mod in model.modules():
        fwd = vars(mod).get("forward")
        if isinstance(fwd, functools.partial) and fwd.func is _checkpointed:
            del mod.forward
    modules = dict(model.named_modules())
    for name in names:
        mod = modules[name]
        mod.forward = functools.partial(_checkpointed, mod.forward, selective)
    return model
