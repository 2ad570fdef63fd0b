"""Data parallelism: many ranks, each training on its share of the global batch, on PyTorch's own engine.

FSDP layouts apply FSDP2's `fully_shard` as torchtitan does: each repeated block is one unit (its
parameters are all-gathered together before its forward and backward, its gradients reduce-scattered
together after backward), then the root, which takes every parameter outside the blocks. A unit's
parameters are resharded after its forward (`fsdp`, ZeRO-3), except the last block's, which backward needs
first; `fsdp-no-reshard` keeps every unit gathered from its forward to its backward (ZeRO-2-like: sharded
gradients and optimizer state, whole parameters during the step). `hsdp` shards within a node and
replicates across nodes (a 2-D mesh, replicate x shard). Beside tensor parallelism the FSDP layouts shard
across the groups of tp ranks (a (shard, tp) mesh): each rank shards its own TP shard of every parameter.

`ddp` is PyTorch's DistributedDataParallel, applied in place (its composable `replicate`, so the model keeps
its class and names) with `gradient_as_bucket_view`: gradients live in DDP's flat buckets, each all-reduced
as soon as it is full during backward. memfit all-reduces after every micro-batch rather than accumulating
under `no_sync`: more traffic, but no second, unbucketed copy of the gradients during accumulation. `bf16`
is autocast, as on one GPU.

Under FSDP, `bf16` is FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`: the sharded
parameters (the master weights) stay fp32, each unit is gathered in bf16 for compute, gradients are
reduce-scattered in fp32. No autocast runs (strategies/precision.py). `bf16-pure` shards bf16 parameters.

The ranks form the default process group: a real one under torchrun (runtime), or a fake world in which
this process is rank 0 (memory/estimate.py), where every collective returns at once with outputs of the
right shapes, so a per-rank step is traced like a single-process one. DDP's C++ reducer cannot run on fake
tensors; there `TracedReducer` does to memory what it does (checked against real gloo ranks).
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from memfit.config import Config
from memfit.errors import ConfigError
from memfit.strategies.activation_checkpoint import find_blocks
from memfit.torch_internals import (ddp_bucket_assignment, mesh_concatenation_on_real_tensors, replicate,
                                    unset_fake_temporarily)

__all__ = ["apply_data_parallel", "data_parallel_buffers", "data_parallel_rank", "device_mesh", "mesh_axis"]

BUCKET_CAP_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb
_TRACED: "weakref.WeakKeyDictionary[torch.nn.Module, TracedReducer]" = weakref.WeakKeyDictionary()


_MESH: list = []  # the last mesh built: [(default group, dims, device type), mesh]


def device_mesh(config: Config, device: torch.device) -> DeviceMesh:
    """The mesh of the default process group, outermost first as torchtitan orders it: ("pp") x ("shard", or
    "replicate" x "shard" for hsdp) x ("tp"), each axis present when it has more than one rank. Built once per
    process group and shared by the strategies (a pipeline's stages, TP, FSDP2): each build makes new
    sub-groups, a collective on every rank, and FSDP2 joins its axis to a TP parameter's as axes of one mesh.
    Made on real tensors even inside a fake trace (it reads the ranks' numbers)."""
    _check_world(config)
    dims = [("pp", config.pp)] if config.pp > 1 else []
    if config.data_parallel == "hsdp":
        dims += [("replicate", config.gpus // config.gpus_per_node), ("shard", config.gpus_per_node)]
    elif config.gpus > 1:
        dims.append(("shard", config.gpus))
    dims += [("tp", config.tp)] if config.tp > 1 else []
    key = (dist.group.WORLD, tuple(dims), device.type)
    if _MESH and _MESH[0][0] is key[0] and _MESH[0][1:] == key[1:]:
        return _MESH[1]
    with unset_fake_temporarily():
        mesh = init_device_mesh(device.type, tuple(n for _, n in dims), mesh_dim_names=tuple(a for a, _ in dims))
    _MESH[:] = [key, mesh]  # holds the group alive: a later group cannot be this object
    return mesh


def mesh_axis(config: Config, device: torch.device, name: str) -> DeviceMesh:
    """One axis of `device_mesh` ("pp", "shard", "tp"), as the 1-D mesh its strategy runs on."""
    mesh = device_mesh(config, device)
    return mesh if mesh.ndim == 1 else mesh[name]


def _check_world(config: Config) -> None:
    if not dist.is_initialized() or dist.get_world_size() != config.world:
        have = dist.get_world_size() if dist.is_initialized() else "no"
        raise ConfigError(f"{config.describe()} needs a process group of {config.world} ranks ({have} here): launch "
                          f"with torchrun or `memfit train --gpus {config.world}`")


def data_parallel_rank(config: Config) -> int:
    """Which share of the global batch this rank trains on: its place among the data-parallel ranks (the
    mesh is pipeline x data parallel x tensor parallel, outermost first)."""
    return (dist.get_rank() // config.tp) % config.gpus


def apply_data_parallel(model: torch.nn.Module, config: Config, device: torch.device,
                        blocks: list[str] | None = None) -> torch.nn.Module:
    """Shard or replicate `model` in place for config's layout (after precision and checkpointing, as
    torchtitan orders them); a model unchanged for one GPU. `blocks`: the units, when the caller knows them
    (a pipeline stage's own blocks)."""
    if config.data_parallel == "none":
        return model
    if config.data_parallel == "ddp":
        _check_world(config)
        if dist.get_backend() == "fake":
            _TRACED[model] = TracedReducer(model, config.gpus)
        else:
            replicate(model, gradient_as_bucket_view=True, bucket_cap_mb=BUCKET_CAP_BYTES / 2**20)
        return model
    # a stage's ranks shard its part; TP's groups are sharded across (torchtitan's 2-D layout)
    mesh = mesh_axis(config, device, "shard") if config.pp > 1 or config.tp > 1 else device_mesh(config, device)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # imported when used: ~0.6 s

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if config.precision == "bf16" else MixedPrecisionPolicy())
    modules = dict(model.named_modules())
    blocks = find_blocks(model) if blocks is None else blocks
    keep = config.data_parallel == "fsdp-no-reshard"
    with mesh_concatenation_on_real_tensors():  # TP's DTensor parameters: FSDP2 joins the two axes
        for i, name in enumerate(blocks):
            fully_shard(modules[name], mesh=mesh, mp_policy=policy,
                        reshard_after_forward=not keep and i < len(blocks) - 1)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


def data_parallel_buffers(model: torch.nn.Module) -> list[torch.Tensor]:
    """What the layout keeps between steps besides parameters, gradients and optimizer state: DDP's gradient
    buckets in a traced (fake) world. A real DDP reducer's buckets are not reachable through public API;
    nothing memfit measures on a real rank needs them."""
    reducer = _TRACED.get(model)
    return reducer.tensors() if reducer is not None else []


class TracedReducer:
    """What DDP's C++ reducer does to memory, for a fake world (the reducer needs real storage).

    DDP keeps every gradient in flat buckets it owns (one dtype each; after its first iteration a first
    bucket of about 1 MiB, then 25 MiB each, in the order gradients become ready: here reverse parameter
    order). With `gradient_as_bucket_view` each parameter's `.grad` becomes a view into its bucket: when
    autograd has accumulated a gradient, the reducer writes it, divided by the world size, into the bucket
    and points `.grad` there (the tensor autograd made is freed); a gradient that already is the view is
    divided in place. A full bucket is all-reduced (SUM) in place. Gradients therefore cost one bucket-sized
    copy of themselves between steps, even when `zero_grad(set_to_none=True)` drops the views."""

    def __init__(self, model: torch.nn.Module, world: int):
        params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))[::-1]
        self.world, self.buckets, self.views = world, [], {}
        for members in ([params[i] for i in idx] for idx in ddp_bucket_assignment(params, BUCKET_CAP_BYTES)):
            bucket = _Bucket(torch.empty(sum(p.numel() for p in members), dtype=members[0].dtype,
                                         device=members[0].device), len(members))
            self.buckets.append(bucket)
            offset = 0
            for p in members:
                self.views[p] = (bucket.flat[offset:offset + p.numel()].view_as(p), bucket)
                offset += p.numel()
                p.register_post_accumulate_grad_hook(self._ready)

    def _ready(self, p: torch.Tensor) -> None:
        view, bucket = self.views[p]
        with torch.no_grad():
            if p.grad is view:
                view.div_(self.world)
            else:
                torch.mul(p.grad, 1.0 / self.world, out=view)
                p.grad = view
        bucket.ready += 1
        if bucket.ready == bucket.size:
            bucket.ready = 0
            dist.all_reduce(bucket.flat)

    def tensors(self) -> list[torch.Tensor]:
        return [b.flat for b in self.buckets]


@dataclasses.dataclass
class _Bucket:
    flat: torch.Tensor  # the gradients of its parameters, end to end
    size: int           # its parameters
    ready: int = 0      # of which have their gradient this backward
