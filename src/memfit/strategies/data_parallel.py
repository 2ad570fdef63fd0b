"""Data parallelism: many ranks, each training on its share of the global batch, on PyTorch's own engine.

FSDP layouts apply FSDP2's `fully_shard` as torchtitan does: each repeated block is one unit (its
parameters are all-gathered together before its forward and backward, its gradients reduce-scattered
together after backward), then the root, which takes every parameter outside the blocks. A unit's
parameters are resharded after its forward (`fsdp`, ZeRO-3), except the last block's, which backward needs
first; `fsdp-no-reshard` keeps every unit gathered from its forward to its backward (ZeRO-2-like: sharded
gradients and optimizer state, whole parameters during the step). `hsdp` shards within a node and
replicates across nodes (a 2-D mesh, replicate x shard).

Under FSDP, `bf16` is FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: the sharded
parameters (the master weights) stay fp32, each unit is gathered in bf16 for compute, gradients are
reduce-scattered in fp32. No autocast runs (strategies/precision.py). `bf16-pure` shards bf16 parameters.

The ranks form the default process group: a real one under torchrun (runtime), or a fake world in which
this process is rank 0 (memory/estimate.py), where every collective returns at once with outputs of the
right shapes, so a per-rank step is traced like a single-process one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from memfit.config import Config
from memfit.errors import ConfigError
from memfit.strategies.activation_checkpoint import find_blocks
from memfit.torch_internals import unset_fake_temporarily

__all__ = ["apply_data_parallel", "device_mesh"]


def device_mesh(config: Config, device: torch.device) -> DeviceMesh:
    """The mesh of the default process group: 1-D for fsdp, (nodes, GPUs per node) for hsdp. Made on real
    tensors even inside a fake trace (it reads the ranks' numbers)."""
    if not dist.is_initialized() or dist.get_world_size() != config.gpus:
        have = dist.get_world_size() if dist.is_initialized() else "no"
        raise ConfigError(f"data_parallel={config.data_parallel!r} over {config.gpus} GPUs needs a process group "
                          f"of {config.gpus} ranks ({have} here): launch with torchrun or `memfit train --gpus`")
    shape = ((config.gpus // config.gpus_per_node, config.gpus_per_node) if config.data_parallel == "hsdp"
             else (config.gpus,))
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    with unset_fake_temporarily():
        return init_device_mesh(device.type, shape, mesh_dim_names=names)


def apply_data_parallel(model: torch.nn.Module, config: Config, device: torch.device) -> torch.nn.Module:
    """Shard `model` in place for config's layout (after precision and checkpointing, as torchtitan orders
    them); a model unchanged for one GPU."""
    if config.data_parallel == "none":
        return model
    if config.data_parallel == "ddp":
        raise ConfigError("data_parallel='ddp' is not built yet: use fsdp, fsdp-no-reshard or hsdp")
    mesh = device_mesh(config, device)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if config.precision == "bf16" else MixedPrecisionPolicy())
    modules = dict(model.named_modules())
    blocks = find_blocks(model)
    keep = config.data_parallel == "fsdp-no-reshard"
    for i, name in enumerate(blocks):
        fully_shard(modules[name], mesh=mesh, mp_policy=policy,
                    reshard_after_forward=not keep and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model
