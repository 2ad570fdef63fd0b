"""The one place memfit touches PyTorch names that are not public API.

Each name below has a pin in tests/test_torch_pins.py: a torch upgrade that moves or changes one fails
there, loudly, before an estimate silently goes wrong. Nothing else in memfit (or its tests and
benchmarks) imports a private torch module or reads a private attribute.
"""
from __future__ import annotations

import contextlib
import functools
import io
import pickle
import weakref
from typing import Callable

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, _DispatchCacheKey, unset_fake_temporarily)
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from memfit.errors import EstimateError

__all__ = ["ACCUMULATE_GRAD", "answer_device_query", "autocast_disabled", "autocast_kernel_ops",
           "autograd_node_name", "compiled_modules", "current_autograd_node", "FILLED_IN_PLACE",
           "DATA_DEPENDENT_ERRORS", "DataDependentOutputException", "ddp_bucket_assignment", "DEVICE_QUERY",
           "detach_sharing_version", "fake_constant", "fake_constants_up_to", "fake_process_group",
           "FAKE_TENSOR_LOGGER", "FakeTensor", "FakeTensorMode", "fast_cache_keys", "fast_cache_entries",
           "fast_cache_size", "add_fast_cache_entries", "function_modes", "function_modes_again",
           "grad_scaler_tensors", "held_by", "import_dynamo", "keep_tensors_on_unchanged_conversion",
           "make_op_outputs_swappable", "mesh_concatenation_on_real_tensors", "memory_history", "memory_snapshot",
           "memory_viz", "p2p_works_hold_tensors", "profiler_allocations", "static_pipeline_metadata",
           "profiler_call_allocations", "profiler_memory_timeline", "profiler_surviving_allocations", "replicate",
           "stand_ins_for_rng_state_copies", "storage_key", "storage_uses", "tensor_version", "TorchDispatchMode",
           "tree_leaves", "trunc_normal_skipped", "unset_fake_temporarily", "WAIT_TENSOR"]

# FakeTensorMode logs every failing meta kernel under this logger (its module's name)
FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"

# What fake tensors raise for an op whose output shape (nonzero, bincount) or value (`.item()`) needs data;
# `unset_fake_temporarily()` runs real ops on real tensors inside a fake trace (memory/routing.py).
DATA_DEPENDENT_ERRORS = (DynamicOutputShapeException, DataDependentOutputException)

# A fake tensor answers `.device` through the dispatcher, as this op (a real one does not): autograd asks it
# of every gradient, so a traced step issues more of them than real ops (13,000 beside 5,500 in two Mamba
# layers at seq 64). It reads and allocates nothing: memfit's dispatch modes answer it (`answer_device_query`).
DEVICE_QUERY = torch.ops.prim.device.default

# A functional collective's wait, by name (the op exists once torch.distributed is imported): DTensor's
# redistributions end in one, and it returns the very tensor it waited on, where its meta kernel makes a new one.
WAIT_TENSOR = "_c10d_functional.wait_tensor.default"


def answer_device_query(args: tuple, kwargs: dict) -> torch.device:
    """DEVICE_QUERY's answer. A fake tensor's is its `.device`, which is what FakeTensorMode answers (meta
    inside a kernel, else the fake device) and a Python property that dispatches nothing: the query skips
    every mode below the one asking (~8% of a trace's time). Any other tensor's comes from the modes below."""
    t = args[0]
    return t.device if isinstance(t, FakeTensor) else DEVICE_QUERY(*args, **kwargs)


def import_dynamo() -> None:
    """Import torch._dynamo, which fake tracing imports on first use (~1 s): done once in a parent, every
    forked tracing child inherits it."""
    import torch._dynamo  # noqa: F401


def compiled_modules(model: torch.nn.Module) -> list[str]:
    """Names of the modules of `model` that torch.compile runs: those `torch.compile(module)` wrapped (an
    OptimizedModule) and those compiled in place (`module.compile()`)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return [name for name, m in model.named_modules()
            if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None]


# Backward formulas that make zeros and scatter a gradient into them in place, and out of place where a tensor
# is "subclass-like" (every tensor, under a dispatch mode): the out-of-place op they then call, and the names
# of the autograd nodes that run them (tests/test_torch_pins.py checks each pair both ways). AccumulateGrad is
# the node that stores a leaf's gradient.
FILLED_IN_PLACE = {
    torch.ops.aten.scatter_add.default: frozenset({"GatherBackward0", "CummaxBackward0", "CumminBackward0"}),
    torch.ops.aten.index_add.default: frozenset({"IndexSelectBackward0"}),
    torch.ops.aten.index_put.default: frozenset({"IndexBackward0"}),  # x[idx], x[mask]
    torch.ops.aten.masked_scatter.default: frozenset({"MaskedSelectBackward0"}),
    torch.ops.aten.put.default: frozenset({"TakeBackward0"}),
    torch.ops.aten.scatter.src: frozenset({  # values picked along a dim: max / min / topk / sort / ...
        "MaxBackward0", "MinBackward0", "TopkBackward0", "SortBackward0", "KthvalueBackward0", "MedianBackward1",
        "NanmedianBackward1", "ModeBackward0"}),
}
ACCUMULATE_GRAD = "AccumulateGrad"


def autograd_node_name() -> str | None:
    """The class name of the autograd node the engine is running on this thread (`FILLED_IN_PLACE`'s names),
    or None outside a backward."""
    node = torch._C._current_autograd_node()
    return None if node is None else type(node).__name__


def current_autograd_node():
    """The autograd node the engine is running on this thread (its Python wrapper, the one `next_functions`
    gave while that is held), or None outside a backward. The engine sums a node's gradients into the
    next nodes' inputs after its post-hooks, with it still current."""
    return torch._C._current_autograd_node()


def storage_uses(t: torch.Tensor) -> int:
    """References to t's storage: one per tensor (view) over it, and one for its Python wrapper if made."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def storage_key(t: torch.Tensor | torch.UntypedStorage) -> int:
    """An identity for a tensor's storage (or a storage) while it lives, for real and fake tensors alike.
    `data_ptr()` will not do: a fake storage has none, and a real one's is shared by every empty storage.
    A wrapper subclass (DTensor) is identified by the tensor that holds its bytes (its local shard)."""
    if type(t) in _PLAIN and t.layout is torch.strided:  # the tracers' every op: skip the subclass test
        return t.untyped_storage()._cdata
    storage = held_by(t)[-1].untyped_storage() if isinstance(t, torch.Tensor) else t  # a sparse one: its values'
    return storage._cdata


# tensor types that are never wrapper subclasses (a fake Parameter is a FakeTensor)
_PLAIN = frozenset({torch.Tensor, FakeTensor, torch.nn.Parameter})


def held_by(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding a tensor's bytes: itself; a sparse tensor's indices and values (its own
    dense tensors, with storages; it has none); for a wrapper subclass the tensors it wraps (a DTensor's
    local shard), as `__tensor_flatten__` lists them."""
    if t.layout is not torch.strided:
        return _sparse_parts(t)
    if type(t) in _PLAIN or not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()  # may name non-tensors too (a DTensor's device mesh)
    return [x for name in names if isinstance(getattr(t, name), torch.Tensor) for x in held_by(getattr(t, name))]


# a compressed sparse layout's index tensors, as its accessors name them (its values are `.values()`)
_COMPRESSED_INDICES = {**dict.fromkeys((torch.sparse_csr, torch.sparse_bsr), ("crow_indices", "col_indices")),
                       **dict.fromkeys((torch.sparse_csc, torch.sparse_bsc), ("ccol_indices", "row_indices"))}


def _sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """A sparse tensor's indices and values, values last; any other layout (a nested tensor's) as itself.
    COO's are `_indices()` / `_values()`: the public `indices()` refuses an uncoalesced tensor (a sparse
    embedding's gradient)."""
    if t.layout is torch.sparse_coo:
        return [t._indices(), t._values()]
    names = _COMPRESSED_INDICES.get(t.layout)
    return [t] if names is None else [getattr(t, name)() for name in names] + [t.values()]


@contextlib.contextmanager
def mesh_concatenation_on_real_tensors():
    """FSDP2 joins its data-parallel mesh to a TP parameter's mesh with the private `DeviceMesh._concatenate`,
    which finds this rank's coordinates with `nonzero` on a new mesh tensor: inside a fake trace that tensor
    is fake and `nonzero` has no static shape. The ranks' numbers are real, so the join runs outside it."""
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__["_concatenate"]

    def concatenate(meshes):
        with unset_fake_temporarily():
            return original.__func__(meshes)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = original


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """This process as rank `rank` of a `world_size`-rank default process group whose collectives return
    at once with outputs of the right shapes (torch's testing backend "fake"): FSDP2 and DeviceMesh run
    as on a real world, on fake tensors, with no other process. On leaving it, DTensor's process-wide
    sharding caches (Python's and the C++ fast path's) are emptied: their entries hold the fake world's mesh,
    which compares equal to a later real mesh of the same shape, so a real world in this process, or in a
    process forked from it, got the fake mesh back on ops of the same shapes, with rank 0's coordinates on
    every rank (each rank then took rank 0's rows as its own; DCP refused the checkpoint)."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise EstimateError("a process group is already initialised in this process: estimate across ranks "
                            "before init_process_group (the estimate makes a fake one)")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_sharding_prop_cache()


def static_pipeline_metadata(schedule) -> None:
    """Skip a pipeline schedule's start-up vote on whether every stage was given its inputs' and outputs'
    shapes: in a fake world nothing is received, so the vote reads zeros (and `.item()` of a fake tensor),
    and the engine would ask its neighbours for the shapes. memfit gives every stage its shapes, which is
    what the vote finds on a real world."""
    from torch.distributed.pipelining._utils import InferenceMode

    def warm_up(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    schedule._warmup_p2p = warm_up


class _HeldWork:
    """Works that keep their tensors alive until dropped, as gloo's and NCCL's do."""

    def __init__(self, works: list, tensors: list):
        self.works, self.tensors = works, tensors

    def wait(self, *args, **kwargs):
        for w in self.works:
            w.wait(*args, **kwargs)
        return True


@contextlib.contextmanager
def p2p_works_hold_tensors():
    """A fake world's point-to-point works are done at once and hold nothing; a real backend's hold their
    tensors until the work object is dropped, and torch's 1F1B schedule keeps the works of its last
    warm-up send through the whole steady phase (one micro-batch's activations past its backward, measured
    on gloo ranks), and the multi-stage runtime (interleaved 1F1B, zero bubble) keeps every send's works until
    the step ends. Inside this, the pipeline schedules' sends and receives hold their tensors so."""
    from torch.distributed.pipelining import schedules

    batch = schedules._batch_p2p

    def holding(ops, desc=None):
        works = batch(ops, desc)
        return [_HeldWork(works, [op.tensor for op in ops])] if works else works

    schedules._batch_p2p = holding
    try:
        yield
    finally:
        schedules._batch_p2p = batch


def replicate(module: torch.nn.Module, **ddp_options) -> torch.nn.Module:
    """DistributedDataParallel applied to `module` in place (torch's composable `replicate`, DDP's own
    reducer run from forward hooks): the module keeps its class, parameter names and attributes, so a
    workload's loss, checkpoints and FSDP2 layouts see the same model."""
    from torch.distributed._composable import replicate as composable_replicate

    return composable_replicate(module, **ddp_options)


def ddp_bucket_assignment(params: list[torch.Tensor], bucket_cap_bytes: int) -> list[list[int]]:
    """DDP's gradient buckets from its second iteration on (the reducer rebuilds them then, in the order
    the gradients became ready): DDP's own assignment, a first bucket of at most DDP's first-bucket cap,
    then `bucket_cap_bytes` each, one dtype per bucket. `params` in gradient-ready order."""
    import torch.distributed as dist

    return dist._compute_bucket_assignment_by_size(params, [dist._DEFAULT_FIRST_BUCKET_BYTES, bucket_cap_bytes])[0]


def keep_tensors_on_unchanged_conversion(model: torch.nn.Module) -> None:
    """torch's `Module._apply` (behind `.to()`, `.float()`) swaps every fake parameter for a new one
    (`swap_tensors`), even when the conversion hands it back unchanged; a real one takes `.data =`, which
    changes nothing then. A parameter the autograd graph already uses cannot be swapped ("Couldn't swap"),
    or its gradient accumulator is poisoned and backward raises: a model that converts a submodule in its
    forward (switch_transformers' router: `self.classifier.to(dtype)`) could not be checkpointed on fake
    tensors. Where torch would swap (fake parameters, wrapper subclasses such as DTensor), each module of
    `model` gets an `_apply` that returns at once when the conversion changes none of its tensors."""
    if not any(isinstance(p, FakeTensor) or is_traceable_wrapper_subclass(p) for p in model.parameters()):
        return
    for module in model.modules():
        module._apply = functools.partial(_apply_unless_unchanged, module)


def _apply_unless_unchanged(module: torch.nn.Module, fn, recurse: bool = True):
    memo: dict[int, tuple] = {}

    def once(t):  # each tensor converted once: what the check made is what torch's _apply then swaps in
        done = memo.get(id(t))
        if done is None or done[0] is not t:
            done = memo[id(t)] = (t, fn(t))
        return done[1]

    with torch.no_grad():
        tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
        tensors += [p.grad for p in module.parameters(recurse=recurse) if p.grad is not None]
        if all(once(t) is t for t in tensors):
            return module
    return type(module)._apply(module, once, recurse)


def make_op_outputs_swappable(mode: FakeTensorMode) -> None:
    """Let `Module.to()` / `_apply` move fake parameters. It swaps them with `torch.utils.swap_tensors`,
    which refuses a tensor that has a weak reference, and `mode` keeps one to every tensor an op makes on
    its slow path (first call of an op on new shapes), in a weak-value memo keyed by the fresh meta tensor
    the output wraps: "_apply(): Couldn't swap Linear.weight" when PEFT moves an adapter layer. That memo
    is never looked up again for an op output (its key is dropped with the op), and the fast path (the
    dispatch cache) already makes outputs without it; make every output that way."""
    def from_meta_and_device(fake_mode, t, device, pytype=None, dispatch_keys=None):
        return FakeTensor(fake_mode, t, device, pytype=pytype, dispatch_keys=dispatch_keys)

    mode.fake_tensor_converter.from_meta_and_device = from_meta_and_device


def fast_cache_keys(mode: FakeTensorMode) -> None:
    """Make `mode`'s dispatch-cache keys in a fifth of the time torch takes. Nearly every op of a trace is
    answered from FakeTensorMode's cache, and building the key was a third of that answer: torch flattens
    each tensor through a dataclass of its metadata, field by field (~50 us an op). The common arguments
    (fake tensors of `mode` without constants, plain scalars, dtypes, devices, lists and tuples of them) are
    keyed here straight from the tensor: dtype, shape, strides, device, storage offset and size,
    requires_grad, conjugate and negative bits, inference (torch's key besides memory format, which
    follows from shape and strides) and each scalar with its type (1 and 1.0 make different dtypes).
    Anything else goes to torch's key, which also decides every bypass. A marker keeps these keys apart
    from torch's in the process-wide cache. Traces ~20% faster (gpt-small, bf16 on an H100: 0.90 -> 0.70 s)."""
    cls = type(mode)

    def flatten(parts: list, args) -> bool:
        """Append `args`' key to `parts`; False where one is not a common argument."""
        parts.append(len(args))
        for a in args:
            kind = type(a)
            if kind is FakeTensor:
                if a.fake_mode is not mode or a.constant is not None or a.layout is not torch.strided:
                    return False
                parts.append((a.dtype, a.shape, a.stride(), a.device, a.storage_offset(),
                              a.untyped_storage().nbytes(), a.requires_grad, a.is_conj(), a.is_neg(),
                              a.is_inference()))
            elif kind in _KEYED_AS_THEY_ARE:
                parts += (kind, a)
            elif kind is list or kind is tuple or kind is torch.Size:
                parts.append(kind)
                if not flatten(parts, a):
                    return False
            else:
                return False
        return True

    def cache_key(state, func, args, kwargs):
        if mode.shape_env is None and get_proxy_mode() is None:
            parts = [_FAST_KEY, func, torch.get_default_dtype(), torch._C._get_default_device(),
                     torch.is_inference_mode_enabled()]
            if flatten(parts, (tuple(args), tuple(kwargs), tuple(kwargs.values()))):  # kwargs: names, values
                return _DispatchCacheKey(tuple(parts))
        return cls._cache_key(mode, state, func, args, kwargs)

    mode._cache_key = cache_key


class _FastKey:
    """The marker opening memfit's keys: one object per process, and pickled as that process's own."""

    def __reduce__(self):
        return _fast_key, ()


def _fast_key() -> _FastKey:
    return _FAST_KEY


_FAST_KEY = _FastKey()


def fast_cache_size() -> int:
    """How many entries FakeTensorMode's process-wide dispatch cache holds (entries are added in order)."""
    return len(FakeTensorMode.cache)


def fast_cache_entries(since: int) -> bytes:
    """The dispatch-cache entries under memfit's keys added after the cache held `since` entries, pickled:
    a tracing child sends them to its parent (`add_fast_cache_entries`), so the next child forks with them
    instead of running the same ops' meta kernels again (a third of a small model's probe was cache misses).
    Only PyTorch's own ops: one a workload registers may not exist in the parent. An entry that does not
    pickle is left out."""
    entries = [(key.key, entry) for key, entry in list(FakeTensorMode.cache.items())[since:]
               if key.key[0] is _FAST_KEY and getattr(key.key[1], "namespace", None) in ("aten", "prims")]
    try:
        return _pickled(entries)
    except Exception:  # noqa: BLE001 - rare: keep the entries that do pickle
        return _pickled([e for e in entries if _pickles(e)])


def add_fast_cache_entries(blob: bytes) -> None:
    """Add the entries `fast_cache_entries` pickled to this process's dispatch cache (those it lacks)."""
    try:
        entries = pickle.loads(blob)
    except Exception:  # noqa: BLE001 - only a speed-up: the ops are dispatched afresh instead
        return
    for parts, entry in entries:
        FakeTensorMode.cache.setdefault(_DispatchCacheKey(parts), entry)


class _OpPickler(pickle.Pickler):
    """Pickles an OpOverload (not picklable itself) as its namespace, name and overload."""

    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            namespace, name = obj._schema.name.split("::")
            return _op, (namespace, name, obj._overloadname)
        return NotImplemented


def _op(namespace: str, name: str, overload: str):
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _pickled(obj) -> bytes:
    out = io.BytesIO()
    _OpPickler(out).dump(obj)
    return out.getvalue()


def _pickles(obj) -> bool:
    try:
        _pickled(obj)
        return True
    except Exception:  # noqa: BLE001
        return False
_KEYED_AS_THEY_ARE = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                                torch.memory_format})


@contextlib.contextmanager
def stand_ins_for_rng_state_copies(stand_in: Callable[[int], torch.Tensor]):
    """torch.utils.checkpoint (a copy per checkpointed block, kept until its backward) and torch.random.fork_rng
    (one more while a block is recomputed) copy the CPU generator's state with `torch.get_rng_state()`, looked
    up at call time, which makes its tensor outside the dispatcher: a dispatch-level trace does not see it.
    While active, each copy also gets `stand_in(nbytes)`, a tensor the trace counts, released with the copy."""
    original = torch.get_rng_state

    def get_rng_state() -> torch.Tensor:
        state = original()
        weakref.finalize(state, _release, stand_in(state.numel() * state.element_size()))
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = original


def _release(stand_in: torch.Tensor) -> None:
    """weakref.finalize held the stand-in until now; dropping it is the release."""


def function_modes() -> list:
    """The TorchFunctionModes active here, innermost last."""
    from torch.overrides import _get_current_function_mode_stack

    return _get_current_function_mode_stack()


@contextlib.contextmanager
def function_modes_again(modes: list):
    """Push `modes` (from `function_modes`) back onto the stack for a while, without their own __enter__ hooks.
    torch.utils.checkpoint recomputes a block from backward, where the autograd engine has dropped every
    TorchFunctionMode (dispatch modes stay): memfit's (the MoE router's value formatting, LayerDrop draws,
    CUDA attention) must see the recomputation as they saw the forward."""
    from torch.overrides import TorchFunctionMode

    pushed = []
    try:
        for mode in modes:
            TorchFunctionMode.__enter__(mode)
            pushed.append(mode)
        yield
    finally:
        for mode in reversed(pushed):
            TorchFunctionMode.__exit__(mode, None, None, None)


def detach_sharing_version(t: torch.Tensor) -> torch.Tensor:
    """`t.detach()` called inside a TorchDispatchMode, sharing `t`'s version counter as a detach above
    the mode would: there the autograd keys are excluded, and a detach made without ADInplaceOrView gets a
    counter of its own, so an in-place change of `t` would go unseen (torch.utils.checkpoint's selective
    cache re-includes the key the same way)."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


def tensor_version(t: torch.Tensor) -> int:
    """How many times `t`'s data was modified in place (shared by its views and version-sharing detaches)."""
    return t._version


def grad_scaler_tensors(scaler: torch.amp.GradScaler) -> list[torch.Tensor]:
    """The loss scale and growth tracker a GradScaler keeps on the device once it has scaled a loss
    (no public accessor returns the tensors themselves; `get_scale()` syncs and returns a float)."""
    return [t for t in (scaler._scale, scaler._growth_tracker) if t is not None]


def autocast_kernel_ops(dispatch_key: str) -> set[str]:
    """Every aten op ("name" or "name.overload") with a kernel of its own for `dispatch_key` (e.g.
    "AutocastCUDA": the ops CUDA autocast casts, registered even in a CPU-only build)."""
    out = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(qualified, dispatch_key):
            out.add(qualified[len("aten::"):])
    return out


def autocast_disabled():
    """The guard an autocast kernel holds while it runs its op: every Autocast dispatch key excluded, so
    the op and the ops it calls are not cast again (PyTorch's own kernels hold the same guard in C++)."""
    return torch._C._DisableAutocast()


def profiler_memory_timeline(prof) -> list[tuple]:
    """(time, action, (key, version), bytes) events of the PyTorch profiler's memory timeline: the ground
    truth memfit's estimates are checked against (`profile(profile_memory=True, record_shapes=True,
    with_stack=True)`)."""
    return prof._memory_profile().timeline


def profiler_surviving_allocations(prof, op_name: str) -> list[list[int]]:
    """For each call of the aten op `op_name` (e.g. "aten::mkldnn_rnn_layer") in a profile taken with
    `profile_memory=True`: the sizes of the allocations made inside the call that it had not freed when it
    returned (a kernel's workspace, which no dispatch-level hook sees)."""
    from torch._C._profiler import _EventType

    calls, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.typed[0] == _EventType.TorchOp and event.name == op_name:
            live, inner = {}, list(event.children)
            while inner:
                child = inner.pop()
                if child.typed[0] == _EventType.Allocation:
                    alloc = child.typed[1]
                    if alloc.alloc_size > 0:
                        live[alloc.ptr] = alloc.alloc_size
                    else:
                        live.pop(alloc.ptr, None)
                inner.extend(child.children)
            calls.append(list(live.values()))
        else:
            stack.extend(event.children)
    return calls


def profiler_call_allocations(prof, op_name: str) -> list[list[int]]:
    """For each call of the aten op `op_name` in a profile taken with `profile_memory=True`: every
    allocation (+bytes) and free (-bytes) made inside the call, in the order they happened."""
    from torch._C._profiler import _EventType

    calls, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        if event.typed[0] == _EventType.TorchOp and event.name == op_name:
            found, inner = [], list(event.children)
            while inner:
                child = inner.pop()
                if child.typed[0] == _EventType.Allocation:
                    found.append((child.start_time_ns, child.typed[1].alloc_size))
                inner.extend(child.children)
            calls.append([size for _, size in sorted(found, key=lambda f: f[0])])
        else:
            stack.extend(event.children)
    return calls


def profiler_allocations(prof, prefix: str) -> tuple[list[tuple[int, int]], list[tuple[int, int, int, str, int]]]:
    """From a profile taken with `profile_memory=True`: the (start, end) times of the ranges recorded with a
    name starting with `prefix` (`record_function`), in order, and every CPU allocation event as (time,
    bytes: + allocated, - freed, the allocator's total after it, the outermost op it happened in or "", the
    block's address), in order. The total counts every block allocated under any profile in this process that is still live, so
    only its changes mean something."""
    from torch._C._profiler import _EventType

    windows, events = [], []
    stack = [(e, "") for e in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        event, op = stack.pop()
        if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu":
            alloc = event.typed[1]
            events.append((event.start_time_ns, alloc.alloc_size, alloc.total_allocated, op, alloc.ptr))
        elif event.typed[0] == _EventType.TorchOp:
            if event.name.startswith(prefix):
                windows.append((event.start_time_ns, event.end_time_ns))
            elif not op:
                op = event.name
        stack.extend((child, op) for child in event.children)
    return sorted(windows), sorted(events)


def fake_constant(mode: FakeTensorMode, real: torch.Tensor) -> FakeTensor:
    """A fake tensor of `mode` that also carries `real`'s values: FakeTensorMode's "constant", the kind
    `torch.tensor(3.0)` makes, on which it computes ops for real and answers `.item()`."""
    return mode.fake_tensor_converter.from_real_tensor(mode, real, make_constant=True)


@contextlib.contextmanager
def fake_constants_up_to(numel: int):
    """FakeTensorMode keeps the values of an op's result computed from constants only if it has at most
    one element (its module constant CONSTANT_NUMEL_LIMIT); raise that limit for a while."""
    from torch._subclasses import fake_tensor

    old = fake_tensor.CONSTANT_NUMEL_LIMIT
    fake_tensor.CONSTANT_NUMEL_LIMIT = numel
    try:
        yield
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = old


@contextlib.contextmanager
def trunc_normal_skipped(skip):
    """`nn.init.trunc_normal_` resamples until no value falls outside its bounds, a loop on values, and
    returns at once for meta tensors, which have none. Return at once for tensors where `skip(t)` is
    true too: the sampler is the private `_no_grad_trunc_normal_`, looked up on each call, so callers
    holding the public function (transformers keeps its own reference) are covered as well."""
    from torch.nn import init

    original = init._no_grad_trunc_normal_

    def sampler(tensor, *args, **kwargs):
        return tensor if skip(tensor) else original(tensor, *args, **kwargs)

    init._no_grad_trunc_normal_ = sampler
    try:
        yield
    finally:
        init._no_grad_trunc_normal_ = original


def memory_history(max_entries: int) -> None:
    """Record the CUDA caching allocator's events with Python stacks (what a snapshot's frames and trace
    hold), keeping the last `max_entries`; 0 stops recording."""
    if max_entries:
        torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def memory_snapshot() -> dict:
    """The caching allocator's state as `torch.cuda.memory._dump_snapshot` pickles it: segments, blocks and
    the recorded trace, plain data."""
    return torch.cuda.memory._snapshot()


def memory_viz():
    """PyTorch's own snapshot viewer module (segment summaries, trace replay, HTML plots)."""
    from torch.cuda import _memory_viz

    return _memory_viz
