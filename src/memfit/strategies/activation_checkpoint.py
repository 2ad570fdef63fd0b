"""Activation checkpointing: drop a block's activations after its forward and recompute them in backward.

Blocks are found, not declared: the repeated modules inside `nn.ModuleList` / `nn.Sequential` containers
(a transformer's layers, a ResNet's bottlenecks). Each chosen block's `forward` is wrapped in
`torch.utils.checkpoint.checkpoint(use_reentrant=False)`; module names and state_dict keys do not change.
"selective" checkpoints every block but keeps the outputs of matmuls and attention (expensive to redo)
and recomputes only the cheap pointwise ops around them; "selective-op" is torchtitan's op-level selective
checkpointing, which keeps attention and every second `aten.mm` of each block (`_TorchtitanOpPolicy`). Both
are policies of torch.utils.checkpoint's selective-checkpoint API run by one mechanism: a kept output goes to
the recomputed call that computes the same op on the same values (`_Names`), so a block may run its ops a
different number of times when recomputed. checkpoint() also keeps a copy of the CPU RNG state (5,056 bytes)
per checkpointed block call until the recomputation, made outside the dispatcher where no dispatch mode sees
it; a fake trace holds a stand-in of that size for as long (`_Replay`, which also serves a model's own
checkpointing: transformers' gradient_checkpointing_enable()).
"""
from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import weakref
from collections import defaultdict

import torch
from torch.utils.checkpoint import CheckpointPolicy, SelectiveCheckpointContext, checkpoint

from memfit.config import ConfigError
from memfit.torch_internals import (DEVICE_QUERY, TorchDispatchMode, answer_device_query,
                                    detach_sharing_version, function_modes, function_modes_again, storage_key,
                                    tensor_version, tree_leaves)

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


def chosen_blocks(model: torch.nn.Module, spec, blocks: list[str] | None = None) -> list[str]:
    """Resolve Config.activation_checkpoint to module names, or raise ConfigError naming what is wrong.
    `blocks`: the repeated blocks when the caller knows them (a pipeline stage may hold only one)."""
    if spec == "none":
        return []
    if isinstance(spec, tuple):
        modules = dict(model.named_modules())
        missing = [n for n in spec if n not in modules or n == ""]
        if missing:
            hint = ", ".join(find_blocks(model)[:6]) or "none found"
            raise ConfigError(f"activation checkpointing: no module named {', '.join(map(repr, missing))} (repeated blocks: {hint})")
        return list(spec)
    blocks = find_blocks(model) if blocks is None else blocks
    if not blocks:
        raise ConfigError("activation checkpointing: found no repeated blocks in this model; name modules explicitly")
    if spec == "all" or spec in SELECTIVE:
        return blocks
    return blocks[::spec]  # every k-th block, starting with the first


def _selective_policy(ctx, func, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if func in _SAVE else CheckpointPolicy.PREFER_RECOMPUTE


# torchtitan's `_save_list` as of commit 9dec370 (2024-12-26), the version its published Llama 3.1 8B FSDP
# benchmark names (benchmarks/llama3_h100_202412_torchtitan.md). Later versions dropped `aten.abs`, added
# FlexAttention, cuDNN attention and `aten.linear` (counted as an mm); the every-second-mm rule is in all.
_TORCHTITAN_SAVE = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.abs.default,  # float8 scaling's max(abs(x)); no op of a bf16 Llama block
    torch.ops.aten.max.default,
    # Not torchtitan's: the CPU's flash kernel, which a GPU-target trace runs in CUDA flash attention's place
    # (strategies/cuda_kernels.py) and which a CPU run takes too; without it the estimate would recompute
    # attention where the GPU run keeps it.
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


class _TorchtitanOpPolicy:
    """torchtitan's op-level selective checkpointing (`apply_ac` with selective_ac_option "op"): keep the
    outputs of `_TORCHTITAN_SAVE`, except every second `aten.mm` of a block call (the 2nd, 4th, ...), which is
    recomputed: between keeping every matmul's output (memfit's "selective") and recomputing them all. A fresh
    instance per checkpointed call, as torchtitan makes one per call, so the count starts at zero in every
    block; forward and recomputation count apart, as torchtitan's do (memfit's `_Reuse` finds kept outputs
    by name and does not ask the policy again)."""

    def __init__(self):
        self.mm_count = {False: 0, True: 0}  # is_recompute -> mm calls so far

    def __call__(self, ctx, func, *args, **kwargs):
        if func == torch.ops.aten.mm.default:
            self.mm_count[ctx.is_recompute] += 1
            if self.mm_count[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in _TORCHTITAN_SAVE else CheckpointPolicy.PREFER_RECOMPUTE


# Config.activation_checkpoint values that checkpoint every block under a selective policy.
SELECTIVE = ("selective", "selective-op")


def _policy(selective):
    """The policy for one checkpointed call: memfit's (read here, at call time, so a benchmark may swap
    it), torchtitan's (fresh counts), or None for plain checkpointing."""
    if selective == "selective-op":
        return _TorchtitanOpPolicy()
    if selective is True or selective == "selective":
        return _selective_policy
    return None


# Values that name themselves in a call's name; anything else an op is given is named by its type.
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class _Names:
    """A name for every tensor a checkpointed region computes, given by how it was computed: an op's
    outputs are named by the op and the names of its arguments; a tensor from outside the region (a weight,
    the block's input) by its storage, layout and version, which are the same when the region is
    recomputed. Names are hashes; equal names mean the same op on the same values, whatever else the
    region did before (a cache filled on the first call only, ops under no_grad, a mask built twice)."""

    def __init__(self):
        self.made: dict[int, tuple] = {}  # id(tensor) -> (weak reference, name)

    def of(self, a):
        if not isinstance(a, torch.Tensor):
            return a if isinstance(a, _PLAIN) else type(a)
        made = self.made.get(id(a))
        if made is not None and made[0]() is a:
            return made[1]
        return hash((storage_key(a), tuple(a.shape), a.stride(), a.storage_offset(), a.dtype, tensor_version(a)))

    def call(self, func, args, kwargs) -> int:
        return hash((func, *(self.of(a) for a in tree_leaves((args, kwargs)))))

    def name_outputs(self, out, call: int) -> None:
        for i, t in enumerate(tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                self.made[id(t)] = (weakref.ref(t), hash((call, i)))


def _detached(out):
    """An op's output (a tensor, or a tuple or list of them) detached, on the same version counter."""
    if isinstance(out, torch.Tensor):
        return detach_sharing_version(out)
    if isinstance(out, (tuple, list)):
        return type(out)(_detached(o) for o in out)
    return out


def _versions(out) -> list[int]:
    return [tensor_version(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]


class _Keep(TorchDispatchMode):
    """The checkpointed forward: runs every op, names its outputs, and keeps the outputs the policy
    saves under the name of the call, oldest first."""

    def __init__(self, kept: dict, policy):
        super().__init__()
        self.kept, self.policy, self.names = kept, policy, _Names()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is DEVICE_QUERY:
            return answer_device_query(args, kwargs)
        call = self.names.call(func, args, kwargs)
        out = func(*args, **kwargs)
        self.names.name_outputs(out, call)
        policy = self.policy(SelectiveCheckpointContext(is_recompute=False, op_output=out), func, *args, **kwargs)
        if policy in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
            # detached: a kept output must not hold the graph that holds this mode (the reference cycle would
            # keep every block's outputs until the garbage collector runs)
            kept = _detached(out)
            self.kept.setdefault(call, collections.deque()).append((kept, _versions(kept)))
        return out


class _Reuse(TorchDispatchMode):
    """The recomputation: a call with the name of a kept one gets its output (once), unless that output
    was modified in place since; every other call runs. torch's own selective checkpointing matches calls
    by how many times each op has run, and raises, or hands one call's output to another, when the
    recomputation runs an op more or fewer times than the forward did (transformers' Llama with its
    default KV cache: "aten.slice.Tensor invocation index 4 ... not found")."""

    def __init__(self, kept: dict):
        super().__init__()
        self.kept, self.names = kept, _Names()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is DEVICE_QUERY:
            return answer_device_query(args, kwargs)
        call = self.names.call(func, args, kwargs)
        queue = self.kept.get(call)
        out = None
        if queue:
            kept, versions = queue.popleft()
            if versions == _versions(kept):
                out = kept
        if out is None:
            out = func(*args, **kwargs)
        self.names.name_outputs(out, call)
        return out


# Arguments through which transformers' decoder layers read and write a key-value cache.
_CACHE_ARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _without_cache(forward, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A checkpointed layer given a key-value cache writes its keys and values into it in the forward and
    again when recomputed, and the recomputation then attends over both (other shapes, other ops).
    Training never reads the cache back, so, as transformers' own gradient checkpointing does, a
    checkpointed layer gets none (by keyword or by position: GPT-2 passes it second). Only transformers'
    layers carry the flag read here (False for layers that write a cache); other modules are left alone."""
    module = getattr(forward, "__self__", None)
    if getattr(module, "_can_checkpoint_with_cache", True) or not torch.is_grad_enabled():
        return args, kwargs
    bound = inspect.signature(forward).bind_partial(*args, **kwargs)
    for name in _CACHE_ARGS:
        if bound.arguments.get(name) is not None:
            bound.arguments[name] = None
    if bound.arguments.get("use_cache"):
        bound.arguments["use_cache"] = False
    return bound.args, bound.kwargs


def _contexts(selective):
    """checkpoint()'s context_fn: selective checkpointing's pair of dispatch modes, or none."""
    policy = _policy(selective)
    if policy is not None:
        kept: dict = {}
        return _Keep(kept, policy), _Reuse(kept)
    return contextlib.nullcontext(), contextlib.nullcontext()


class _Replay:
    """A checkpointed function whose recomputation runs as its forward did. The autograd engine runs the
    recomputation without the forward's TorchFunctionModes (dispatch modes stay), so they are pushed again:
    memfit's MoE router formatting, LayerDrop draws and CUDA attention must see the same block twice. (The
    RNG-state copies checkpoint() keeps are counted wherever it runs: torch_internals.
    stand_ins_for_rng_state_copies.)"""

    def __init__(self, function):
        self.function, self.modes, self.calls = function, function_modes(), 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:  # the forward
            return self.function(*args, **kwargs)
        with function_modes_again(self.modes):
            return self.function(*args, **kwargs)


def _checkpointed(forward, selective, *args, **kwargs):
    args, kwargs = _without_cache(forward, args, kwargs)
    return checkpoint(_Replay(forward), *args, use_reentrant=False,
                      context_fn=functools.partial(_contexts, selective), **kwargs)


def _their_checkpoint(checkpoint_fn, function, *args, **kwargs):
    """A model's own checkpoint function (transformers' `_gradient_checkpointing_func`: torch's checkpoint
    with the model's keywords, reentrant or not), given a `_Replay` of the function it checkpoints."""
    return checkpoint_fn(_Replay(function), *args, **kwargs)


def replay_model_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' gradient_checkpointing_enable() gives each layer a checkpoint function of its own: wrap
    each (once) so that its recomputation replays the forward as memfit's checkpointing does (`_Replay`).
    Without it a GPU-target trace recomputed attention with dropout on the CPU's math path and raised."""
    for mod in model.modules():
        fn = vars(mod).get("_gradient_checkpointing_func")
        if callable(fn) and not (isinstance(fn, functools.partial) and fn.func is _their_checkpoint):
            mod._gradient_checkpointing_func = functools.partial(_their_checkpoint, fn)
    return model


def apply_checkpointing(model: torch.nn.Module, names: list[str], selective) -> torch.nn.Module:
    """Wrap the named blocks' forwards; wrappers from an earlier call are removed first, so a run can
    change its checkpointing (OOM recovery) without nesting them. `selective`: the Config's
    activation_checkpoint ("selective", "selective-op"; anything else checkpoints in full), or a bool
    (True: memfit's selective policy)."""
    for mod in model.modules():
        fwd = vars(mod).get("forward")
        if isinstance(fwd, functools.partial) and fwd.func is _checkpointed:
            del mod.forward
    modules = dict(model.named_modules())
    for name in names:
        mod = modules[name]
        mod.forward = functools.partial(_checkpointed, mod.forward, selective)
    return model
