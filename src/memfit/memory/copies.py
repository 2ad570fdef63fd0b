"""Shallow copies of a deep model: the planner traces a few of its identical blocks and extends the figures
to the whole depth along the line through two copies (memory and work add up block by block)."""
from __future__ import annotations

import dataclasses

import torch

from memfit.strategies.activation_checkpoint import find_blocks
from memfit.workload import Workload

__all__ = ["depths", "shallow", "stack_depth"]


def depths(gpus: int) -> tuple[int, int]:
    """The blocks the two shallow copies keep. Across ranks 4 and 8: from 4 on, FSDP's gathered, prefetched and
    reducing units are as many as at any depth (copies of 2 and 4 blocks put a 70B's backward at 93 GiB where
    the whole model holds 32). One GPU's step has no such units: 2 and 4 blocks rank its families as 4 and 8
    do (the same plans for the 8B and 7B benchmarks) at half the tracing."""
    return (2, 4) if gpus == 1 else (4, 8)


def stack_depth(model: torch.nn.Module) -> int | None:
    """How many identical repeated blocks `model` has in one ModuleList (same class, parameter names, shapes
    and dtypes), when its repeated blocks are that list's children; None for any other arrangement (blocks
    that differ, as MoE models with dense first layers have, or in several containers)."""
    blocks = find_blocks(model)
    parents = {name.rpartition(".")[0] for name in blocks}
    if len(parents) != 1:
        return None
    container = model.get_submodule(parents.pop())
    if not isinstance(container, torch.nn.ModuleList) or len(container) != len(blocks):
        return None
    shapes = {tuple((n, tuple(p.shape), p.dtype) for n, p in b.named_parameters()) for b in container}
    return len(container) if len(shapes) == 1 and len({type(b) for b in container}) == 1 else None


def shallow(workload: Workload, keep: int) -> Workload:
    """`workload` with the first `keep` of its repeated blocks (stack_depth's); the planner's cheap copy. A
    factory that builds fewer blocks itself (`with_blocks`: transformers' configs) is asked first, and its
    model used where it has `keep` identical blocks; else the whole model is built and the rest cut."""
    build = workload.model
    fewer = getattr(build, "with_blocks", None)

    def model() -> torch.nn.Module:
        m = fewer(keep) if fewer is not None else None
        if m is not None and stack_depth(m) == keep:
            return m
        m = build()
        blocks = find_blocks(m)
        del m.get_submodule(blocks[0].rpartition(".")[0])[keep:]
        return m

    return dataclasses.replace(workload, model=model)
