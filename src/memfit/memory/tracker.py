"""Two dispatch modes that watch a training step op by op, each with one job, stackable like PyTorch's
`MemTracker` and `RuntimeEstimator`:

- `LiveBytes` counts live tensor bytes on one device: the ground truth memfit estimates from (and, with a
  budget, the virtual device memory a CPU run rehearses OOMs in).
- `OpRecorder` records every op's work for the step-time model (FLOPs, bytes moved, fresh allocation, kind,
  phase) and FLOPs per module.

When both run, `LiveBytes.recording(recorder)` does what stacking them does (`with counter, recorder:`) in
one mode: each of the modes stacked costs every op a round trip through the dispatcher (~5% of a fake trace).
`PlainPaths`, a function mode beside them, marks where PyTorch computes out of place only because a dispatch
mode (or a fake tensor) is active (autograd's gradient sums, SDPA's mask add): `LiveBytes` counts those results
as a step without one makes them, in place.

A `TorchDispatchMode` sees every tensor an aten op creates (below autograd, so the backward pass and the
optimizer are seen too). Bytes are counted per storage, so views and in-place results cost nothing, and a
storage is freed when its Python wrapper's finaliser runs (storages keep one wrapper for life). The same
modes run on fake tensors (the estimate) and on real ones (the fallback, a run's budget, calibration).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import functools
import os
import sys
import sysconfig
import weakref
from typing import Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode

from memfit.errors import short_path
from memfit.memory.fake import op_flops
from memfit.memory.kernels import fix_fake_outputs
from memfit.strategies.offload import on_host_side
from memfit.torch_internals import ACCUMULATE_GRAD, DEVICE_QUERY, FILLED_IN_PLACE, FakeTensor, TorchDispatchMode, \
    answer_device_query, autograd_node_name, current_autograd_node, detach_sharing_version, held_by, storage_key, \
    storage_uses, tree_leaves


class _Word(str, enum.Enum):
    """A vocabulary word: equal to, hashed, printed and written to JSON as its plain string."""
    __hash__ = str.__hash__
    __format__ = str.__format__

    def __str__(self) -> str:
        return self.value


class Category(_Word):
    """What a byte of device memory is for; every storage the step touches gets exactly one."""
    PARAMETERS = "parameters"
    GRADIENTS = "gradients"
    OPTIMIZER_STATE = "optimizer_state"
    INPUTS = "inputs"
    ACTIVATIONS = "activations"   # saved for backward
    TEMPORARIES = "temporaries"   # everything else the step creates


class Phase(_Word):
    """Where the step is (TrainStep tells the tracers as it enters each)."""
    SETUP = "setup"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


CATEGORIES = tuple(Category)
MODEL_STATE = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)


def _tensors(tree) -> list[torch.Tensor]:
    """The plain tensors in `tree`; a DTensor counts as the shard this rank holds."""
    if isinstance(tree, torch.Tensor):  # most ops' output: no tree to walk
        return held_by(tree)
    return [x for t in tree_leaves(tree) if isinstance(t, torch.Tensor) for x in held_by(t)]


@dataclasses.dataclass
class StorageInfo:
    nbytes: int
    op: str
    module: str
    shape: tuple
    dtype: str
    phase: Phase
    category: Category | None = None  # forced label (inputs, host copies); otherwise decided after the step
    source: str = ""  # "file:line in function": the model's code that made it ("" for autograd's and optimizers' own)


# Frames that are the machinery, not the model: torch, Python's own library, and memfit outside its workloads.
_MEMFIT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "")
_TORCH = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "")
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")
_STEP = os.path.join(_MEMFIT, "step.py")  # where a search for the model's line ends


_WORKLOADS = os.path.join(_MEMFIT, "workloads", "")


@functools.cache  # asked for every frame of every allocation's stack
def machinery(filename: str) -> bool:
    """Whether code in `filename` is the machinery (torch, the standard library, memfit's engine), not the
    workload's (its model, loss, batch; memfit's built-in workloads included). Packages installed inside the
    standard library's folder, where conda, pyenv and the python images keep site-packages, are not the
    standard library: transformers' modeling files and the user's own packages are the model's code."""
    if filename.startswith(("<", _TORCH)):
        return True
    if filename.startswith(_MEMFIT):
        return not filename.startswith(_WORKLOADS)
    return filename.startswith(_STDLIB) and filename[len(_STDLIB):].split(os.sep)[0] not in ("site-packages",
                                                                                            "dist-packages")


def source_line() -> str:
    """The innermost frame of the running Python code that is not torch, the standard library or memfit's
    engine: the line of the model (or loss) that asked for the tensor. The search ends at the training step
    itself: autograd's backward and the optimizer have no line of the model's own."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename == _STEP:
            return ""
        if not machinery(filename):
            return f"{short_path(filename)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return ""


class _Scoped(TorchDispatchMode):
    """What both modes share: the phase the step is in and the stack of running modules (`ModuleScope`)."""

    quiet = 0  # > 0 while memfit's own bookkeeping issues ops (`seeing_saved`): they pass through unseen

    def __init__(self):
        super().__init__()
        self.phase = Phase.SETUP
        self.module_stack: list[str] = []

    def mark(self, phase: str) -> None:
        self.phase = Phase(phase)

    @property
    def module(self) -> str:
        """The innermost running module, or "(phase)" outside any module (backward, optimizer)."""
        return self.module_stack[-1] if self.module_stack else f"({self.phase})"


class LiveBytes(_Scoped):
    """Records (id, +bytes) / (id, -bytes) events for storages on `device_type`.

    budget: if set, an allocation that takes the live total past it raises torch.OutOfMemoryError —
    the virtual device memory used to rehearse OOMs on a CPU.
    host_apart: allocations made under `host_side()` (offloading) are host memory, not device memory.
    True when a GPU step is traced on the CPU; on a CPU device host and device memory are one.
    detail: False keeps live bytes and peak only (a run's budget, steps without end).
    workspace: `(func, args, kwargs, out) -> bytes` a kernel holds only while it runs (kernels.CpuWorkspaces,
    kernels.CudnnWorkspaces): counted at that op, after its outputs, and freed at once.
    """

    def __init__(self, device_type: str = "cpu", budget: int | None = None, host_apart: bool = False,
                 detail: bool = True, workspace=None):
        super().__init__()
        self.device_type = device_type
        self.budget = budget
        self.detail = detail
        self.workspace = workspace
        self.host_apart = host_apart
        self.host_live: dict[int, int] = {}  # host-side storages when host_apart
        self.host_current = self.host_peak = 0
        self.infos: dict[int, StorageInfo] = {}
        self.live: dict[int, int] = {}
        self.events: list[tuple[int, int]] = []
        self.marks: list[tuple[int, Phase]] = []  # (event index, phase)
        self.current = 0
        self.peak = 0
        self.peak_index = -1  # events[:peak_index + 1] replayed gives the live set at the peak
        self.phase_peaks: dict[Phase, int] = {}  # the highest live total seen in each phase
        self.exclude: set[int] = set()  # storage keys that live elsewhere (a host-side batch, for a GPU)
        self._uids: dict[int, int] = {}  # storage key -> id, live storages only
        self._next_uid = 0
        self._active = True
        self.failed_at: tuple[str, Phase, str] | None = None  # (module, phase, op) of the first op that raised
        self.recorder: OpRecorder | None = None  # shown every op counted (`recording`)
        self.plain: PlainPaths | None = None  # counts results made in place without dispatch modes as made so
        self._born_uses: dict[int, int] = {}  # with `plain`: a storage's references when it was made, by id
        self.sparse_seen = False  # an op made a sparse tensor (counted as its indices and values)

    # -- what the step tells the tracker
    def mark(self, phase: str) -> None:
        super().mark(phase)
        self.marks.append((len(self.events), self.phase))
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), self.current)

    def track(self, tensors: Iterable[torch.Tensor], op: str = "preexisting", category: Category | None = None,
              host: bool = False) -> None:
        for t in _tensors(list(tensors)):
            self._add(t, op, category, host)

    def tag(self, tensors: Iterable[torch.Tensor], category: Category) -> None:
        for t in tensors:
            info = self.infos.get(self.uid(t))
            if info is not None:
                info.category = category

    def uid(self, t: torch.Tensor) -> int | None:
        """The id of t's storage while it is live. Storage keys are reused after a free, so events
        and labels use ids that are never reused."""
        return self._uids.get(storage_key(t))

    def close(self) -> None:
        """Stop counting; finalisers of storages that die later are ignored."""
        self._active = False

    def __enter__(self):
        """Also follow storages resized in place (`UntypedStorage.resize_`, which no dispatch mode sees):
        FSDP2 frees a unit's gathered parameters by resizing their storages to 0 after use and back before
        the next all-gather."""
        resize, tracker = torch.UntypedStorage.resize_, self

        def resize_(storage, nbytes):
            out = resize(storage, nbytes)
            tracker._resized(storage)
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    @contextlib.contextmanager
    def recording(self, recorder: OpRecorder):
        """This counter active, with `recorder` shown each op it counts, after counting it: what entering
        the recorder above it does, without a second mode."""
        self.recorder = recorder
        try:
            with self:
                yield
        finally:
            self.recorder = None

    # -- bookkeeping
    def _add(self, t: torch.Tensor, op: str, category: Category | None = None, host: bool = False) -> None:
        if t.device.type != self.device_type or t.is_nested:
            return
        st = t.untyped_storage()
        address = storage_key(st)
        if address in self._uids or address in self.exclude:
            return
        nbytes = st.nbytes()
        if category is None and on_host_side():  # offloaded copies: activations out, gradients in
            category = {Phase.FORWARD: Category.ACTIVATIONS, Phase.BACKWARD: Category.GRADIENTS}.get(self.phase)
        if self.host_apart and (host or on_host_side()):
            self._uids[address] = key = self._next_uid
            self._next_uid += 1
            self.host_live[key] = nbytes
            self.host_current += nbytes
            self.host_peak = max(self.host_peak, self.host_current)
            weakref.finalize(st, self._free, address, key)
            return
        key = self._allocate(nbytes, op, tuple(t.shape), str(t.dtype).replace("torch.", ""), category)
        self._uids[address] = key
        self.live[key] = nbytes
        if self.plain is not None:
            self._born_uses[key] = storage_uses(t)
        weakref.finalize(st, self._free, address, key)

    def _allocate(self, nbytes: int, op: str, shape: tuple, dtype: str, category: Category | None) -> int:
        """Count `nbytes` more live (raising past a budget) and return the allocation's id."""
        if self.budget is not None and self.current + nbytes > self.budget:
            raise torch.OutOfMemoryError(
                f"memfit virtual budget: allocating {nbytes} bytes with {self.current} live "
                f"exceeds {self.budget} bytes (op {op})"
            )
        key = self._next_uid
        self._next_uid += 1
        if self.detail:
            source = source_line() if op != "preexisting" else ""  # what exists before the step has no line in it
            self.infos[key] = StorageInfo(nbytes, op, self.module, shape, dtype, self.phase, category, source)
            self.events.append((key, nbytes))
        self._count(nbytes)
        return key

    def _count(self, nbytes: int) -> None:
        self.current += nbytes
        if self.current > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.current
        if self.current > self.peak:
            self.peak, self.peak_index = self.current, len(self.events) - 1

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """A tracked storage now holds storage.nbytes(): its allocation is freed and made again under the
        same id (so labels and the live set at the peak follow it)."""
        key = self._uids.get(storage_key(storage))
        if not self._active or key is None or key not in self.live:
            return
        old, new = self.live[key], storage.nbytes()
        if old == new:
            return
        self.current -= old
        if self.detail and old:
            self.events.append((key, -old))
        if self.budget is not None and self.current + new > self.budget:
            self.live[key] = 0
            raise torch.OutOfMemoryError(f"memfit virtual budget: resizing a storage to {new} bytes with "
                                         f"{self.current} live exceeds {self.budget} bytes")
        self.live[key] = new
        if new:
            if self.detail:
                self.infos[key].nbytes = new
                self.events.append((key, new))
            self._count(new)

    def _transient(self, nbytes: int, op: str) -> None:
        """A kernel's workspace: live for the op that takes it, freed when the op returns."""
        key = self._allocate(nbytes, f"{op} (kernel workspace)", (nbytes,), "uint8", Category.TEMPORARIES)
        self.current -= nbytes
        if self.detail:
            self.events.append((key, -nbytes))

    def _free(self, address: int, key: int) -> None:
        if not self._active or self._uids.get(address) != key:  # (a buffer whose gradient sum took it over)
            return
        if key in self.host_live:
            del self._uids[address]
            self.host_current -= self.host_live.pop(key)
            return
        if key not in self.live:
            return
        del self._uids[address]
        nbytes = self.live.pop(key)
        self._born_uses.pop(key, None)
        if self.detail and nbytes:
            self.events.append((key, -nbytes))
        self.current -= nbytes

    def _sums_in_place(self, args, kwargs) -> bool:
        """Whether a step without dispatch modes adds these two gradients of one tensor into the first
        (autograd's InputBuffer::accumulate): plain tensors of one shape and dtype, grad mode off, the first
        fresh. Another reference to the first tensor itself (one gradient passed to two inputs of a node) is
        not seen (rare)."""
        if kwargs or len(args) != 2:
            return False
        old, new = args
        return (self._fresh(old) and type(new) in _PLAIN and old is not new and old.shape == new.shape
                and old.dtype == new.dtype and not torch.is_grad_enabled())

    def _adds_in_place(self, args, kwargs) -> bool:
        """Whether a step without dispatch modes makes this add in place (SDPA's math path: `attn.add_(mask)`;
        a Linear over an input it cannot fold to 2-D: `out.add_(bias)`): a plain second operand and a fresh
        first (the check that the sum keeps the first's shape and dtype, as an in-place add must, comes after
        the op)."""
        return not kwargs and len(args) == 2 and self._fresh(args[0]) and type(args[1]) in _PLAIN \
            and args[0] is not args[1]

    def _fills_in_place(self, func, args) -> bool:
        """Whether a step without dispatch modes makes this op in place: a backward formula of
        `FILLED_IN_PLACE` filling the zeros it just made (`grad.new_zeros(...).scatter_add_(dim, index, grad)`
        in gather's), which under a mode it fills out of place."""
        return autograd_node_name() in FILLED_IN_PLACE[func] and not torch.is_grad_enabled() and self._fresh(args[0])

    def _fresh(self, t) -> bool:
        """A plain tensor, dense, with no other tensor over its storage than when it was made."""
        key = self.uid(t) if type(t) in _PLAIN else None
        return key is not None and _dense(t) and storage_uses(t) <= self._born_uses.get(key, 0)

    def _take_over(self, old: torch.Tensor, out: torch.Tensor) -> None:
        """`out` is the sum a real step makes in `old`'s storage: it takes old's allocation over (no new
        bytes), and old's storage, which the engine lets go at once, frees nothing. The values are untouched."""
        key = self._uids.pop(storage_key(old))
        st = out.untyped_storage()
        self._uids[storage_key(st)] = key
        weakref.finalize(st, self._free, storage_key(st), key)

    def live_at_peak(self) -> dict[int, int]:
        live: dict[int, int] = {}
        for key, delta in self.events[: self.peak_index + 1]:
            if delta >= 0:
                live[key] = delta
            else:
                live.pop(key, None)
        return live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is DEVICE_QUERY:
            return answer_device_query(args, kwargs)
        if _Scoped.quiet:
            return func(*args, **kwargs)
        in_place = False
        if func is _ADD and self.plain is not None:
            if self.plain.adding:  # the first add inside SDPA is its mask's, inside a Linear its bias's
                self.plain.adding = False
                in_place = self._adds_in_place(args, kwargs)
            elif self.plain.summing:
                in_place = self._sums_in_place(args, kwargs)
        elif func in FILLED_IN_PLACE and self.plain is not None:
            in_place = self._fills_in_place(func, args)
        try:
            # meta kernels that size outputs wrong; a GPU target (its host apart) runs CUDA's kernels
            out = fix_fake_outputs(func, args, kwargs, func(*args, **kwargs), cpu=not self.host_apart)
        except Exception:
            if self.failed_at is None:  # the module stack unwinds as the error leaves: note where it was
                self.failed_at = (self.module, self.phase, getattr(func, "__name__", str(func)))
            raise
        if in_place and self._active and out.shape == args[0].shape and out.dtype == args[0].dtype:
            self._take_over(args[0], out)  # a real step adds into the tensor this op's caller alone holds
        elif func is _CLONE and self._active and _keeps_sparse_gradient(args[0]):
            for old, new in zip(held_by(args[0]), held_by(out)):  # its indices and values: no new bytes
                if self.uid(old) is not None and self.uid(new) is None:
                    self._take_over(old, new)
        if self._active:
            name = "" if not self.detail else func.__name__ if hasattr(func, "__name__") else str(func)
            if isinstance(out, torch.Tensor) and out.layout is not torch.strided and not out.is_nested:
                self.sparse_seen = True
            for t in _tensors(out):
                self._add(t, name)
            extra = self.workspace(func, args, kwargs, out) if self.workspace is not None else 0
            if extra:
                self._transient(extra, name)
        if self.recorder is not None:
            self.recorder.saw(func, args, kwargs, out)
        return out


_ADD = torch.ops.aten.add.Tensor
_CLONE = torch.ops.aten.clone.default
_PLAIN = (FakeTensor, torch.Tensor)  # not a subclass: PyTorch never adds into one in place


def _keeps_sparse_gradient(t: torch.Tensor) -> bool:
    """Whether this clone is autograd's copy of a new sparse gradient, which a step without dispatch modes
    does not make: AccumulateGrad keeps a sparse gradient that only the engine holds as it is (a shallow
    copy over the same indices and values), and copies it where more references hold it, as a dispatch
    mode's own do every time (tests/test_torch_pins.py)."""
    return t.layout is torch.sparse_coo and not torch.is_grad_enabled() \
        and autograd_node_name() == ACCUMULATE_GRAD and all(x.is_contiguous() for x in held_by(t))


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its strides, sorted, are a contiguous tensor's (any order of dimensions)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


class PlainPaths(TorchFunctionMode):
    """Marks where PyTorch computes out of place only because a dispatch mode is active, for LiveBytes to
    count what a step without one does: the result made in the first operand's storage.

    Autograd's engine and ATen's composite ops test whether a tensor is "subclass-like" before working in
    place, and with a dispatch mode active (memfit's counter, fake tensors) every tensor is:
    - gradient sums: when a tensor gets a gradient from two uses (two slices of it, a residual), the engine
      adds the second into the first's buffer if it alone holds it (`old.add_(new)`); under a mode it makes
      a new tensor (`old + new`), which a real step does not hold (pegasus_x's sliced attention
      probabilities: +20%). The engine sums after a node's backward and its post-hooks, still under it as
      its current node: each node with an edge into an input that gets two or more gradients gets a
      post-hook, and an add is a sum (`summing`) while the node whose hook ran last is the current one. A
      hook on every node, and a pre-hook to end each sum, held ~1.5 KB a node through the backward
      (0.5 GiB more RSS for Zamba's 76 layers).
    - SDPA's math path (the CPU kernel where its flash kernel does not apply) adds the mask into the scores
      in place (`attn.add_(mask)`), under a mode out of place: one more scores-sized tensor at the
      attention's peak (doge's dynamic masks: +2.8%).
    - A Linear whose input it cannot fold into one matmul with its bias (a non-contiguous 3-D input, 4-D and
      more) adds the bias into the matmul's output in place (`output.add_(bias)`), under a mode out of
      place: one more output-sized tensor (nn.MultiheadAttention's packed projection of a batch-first
      input: +3.3%).
    - Backward formulas that scatter a gradient into zeros they just made (gather, indexing, index_select,
      topk and the other value-picking reductions: `FILLED_IN_PLACE`) fill them in place, under a mode out
      of place (ViT-MAE's masking gather with checkpointing: +0.85%); LiveBytes tells those by the autograd
      node running, without this mode.
    `adding` is set for an SDPA or Linear call, until its first add.
    The values are untouched."""

    _CALLS = (torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad)
    _FIRST_ADD_IN_PLACE = (torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.linear)

    def __init__(self):
        super().__init__()
        self.adding = False
        self._summed_by: int | None = None  # id of the node whose post-hook ran last

    @property
    def summing(self) -> bool:
        return self._summed_by is not None and id(current_autograd_node()) == self._summed_by

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._FIRST_ADD_IN_PLACE:
            self.adding = True
            try:
                return func(*args, **kwargs)
            finally:
                self.adding = False
        if func not in self._CALLS:
            return func(*args, **kwargs)
        roots = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
        roots = [roots] if isinstance(roots, torch.Tensor) else list(roots or ())
        seen, into = set(), collections.Counter()  # the graph's nodes (their ids stay theirs while held here)
        todo = [t.grad_fn for t in roots if isinstance(t, torch.Tensor)]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            for edge in node.next_functions:
                if edge[0] is not None:
                    into[edge] += 1
                    todo.append(edge[0])
        handles = [node.register_hook(functools.partial(self._ends, id(node))) for node in seen
                   if any(into[edge] > 1 for edge in node.next_functions if edge[0] is not None)]
        try:
            return func(*args, **kwargs)
        finally:
            self._summed_by = None
            for handle in handles:
                handle.remove()

    def _ends(self, node: int, grad_inputs, grad_outputs):
        self._summed_by = node


@dataclasses.dataclass
class OpTrace:
    """A step's aten ops, one entry per op in order: the step-time model's input (planner.costmodel).
    Two traces of the same step at different micro-batches line up entry by entry."""
    flops: list = dataclasses.field(default_factory=list)   # FLOPs (random-number ops: numbers drawn)
    bytes: list = dataclasses.field(default_factory=list)   # bytes read + written
    alloc: list = dataclasses.field(default_factory=list)   # largest fresh storage (a CPU pays page faults)
    # "f32" | "lp" (bf16/fp16) | "view" | "rng" (random numbers: ~6 ns each on a CPU) | "host" | "link"
    # (host<->device copy) | "comm" (a collective across ranks; bytes: the whole tensor gathered or reduced)
    kind: list = dataclasses.field(default_factory=list)
    phase: list = dataclasses.field(default_factory=list)
    name: list = dataclasses.field(default_factory=list)    # aten op without overload: some are priced by name
    moved_bytes: int = 0                                    # host <-> device bytes of offloading, in one step
    # each micro-step's first op and the bytes moved before it; the optimizer step's (None: not marked)
    micro_steps: list = dataclasses.field(default_factory=list)
    optimizer_at: tuple | None = None
    # one rank's add_ of each gradient into the one kept, which every micro-step after the first makes (bytes
    # read + written, kind): what a trace of one micro-step lacks for pricing an accumulation
    accumulate: list = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.kind)


class OpRecorder(_Scoped):
    """Records every op of a step into `trace` (an OpTrace) and counts FLOPs per innermost module
    (FlopCounterMode's formulas); FLOPs of modules running during backward are activation checkpointing's
    recomputation. With a LiveBytes, let the counter carry it (`LiveBytes.recording`)."""

    def __init__(self):
        super().__init__()
        self.trace = OpTrace()
        self.flops_by_module: dict[str, int] = {}
        self.recompute_flops = 0  # forward ops run again during backward (activation checkpointing)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is DEVICE_QUERY:
            return answer_device_query(args, kwargs)
        if _Scoped.quiet:
            return func(*args, **kwargs)
        out = fix_fake_outputs(func, args, kwargs, func(*args, **kwargs))
        self.saw(func, args, kwargs, out)
        return out

    def saw(self, func, args, kwargs, out) -> None:
        """Record one op that ran (`out`: its outputs)."""
        flops = op_flops(func, args, kwargs, out)
        self._count(flops)
        self._record(func, args, kwargs, out, flops)

    def _count(self, flops: int) -> None:
        """FLOPs of the running module; in backward inside a module, recomputation's."""
        if flops:
            self.flops_by_module[self.module] = self.flops_by_module.get(self.module, 0) + flops
            if self.phase == Phase.BACKWARD and self.module_stack:
                self.recompute_flops += flops

    def _record(self, func, args, kwargs, out, flops: int) -> None:
        known = _OP_FACTS.get(func)
        if known is None:
            known = _OP_FACTS[func] = _op_facts(func)
        what, name = known
        outs = _tensors(out)
        alloc = 0
        if what == "view":
            kind, moved = "view", 0
        elif what == "comm":  # a collective: its bytes are the whole (unsharded) size
            kind = "comm"
            if func.namespace == "_c10d_functional":  # DTensor's (input, ..., group size, group name)
                moved = args[0].numel() * args[0].element_size() * (args[1] if name == "all_gather_into_tensor" else 1)
            else:
                gathered = args[0] if "allgather" in func.__name__ else args[1] if "reduce_scatter" in func.__name__ \
                    else args[0]
                moved = sum(t.numel() * t.element_size() for t in _tensors(gathered))
        else:
            ins = _tensors((args, kwargs))
            moved = sum(t.numel() * t.element_size() for t in ins + outs)
            # fresh storages: an output whose storage no input has (in-place and out= results reuse one)
            given = {storage_key(t) for t in ins}
            alloc = max((t.untyped_storage().nbytes() for t in outs if storage_key(t) not in given), default=0)
            low = any(t.dtype in (torch.bfloat16, torch.float16) for t in outs)
            if on_host_side():
                kind = "link" if func is torch.ops.aten.copy_.default else "host"
            elif not flops and what == "seeded":
                # a random number costs the same whatever its dtype: the work recorded is how many are drawn
                # (attention is tagged too, for its dropout, but its work is its FLOPs)
                kind, flops = "rng", max((t.numel() for t in outs), default=0)
            else:
                kind = "lp" if low else "f32"
        tr = self.trace
        tr.flops.append(flops)
        tr.bytes.append(moved)
        tr.alloc.append(alloc)
        tr.kind.append(kind)
        tr.phase.append(self.phase)
        tr.name.append(name)

    def ops_recorded(self) -> int:
        return len(self.trace)

    def repeat_ops(self, since: int, times: int, until: int | None = None) -> None:
        """Record the ops recorded from position `since` (up to `until`) `times` more times, as if they had run
        again (work traced once: strategies/optimizer_8bit.chunks_traced_once)."""
        tr = self.trace
        self._count(sum(tr.flops[since:until]) * times)
        for column in (tr.flops, tr.bytes, tr.alloc, tr.kind, tr.phase, tr.name):
            column.extend(column[since:until] * times)


def _op_facts(func) -> tuple[str, str]:
    """What `_record` needs to know of an op that does not change between calls: "view", "comm" (a
    collective), "seeded" (draws random numbers) or "", and its name without the overload."""
    name = getattr(getattr(func, "_overloadpacket", func), "__name__", str(func))
    namespace = getattr(func, "namespace", "")
    what = ("view" if getattr(func, "is_view", False) else
            "comm" if namespace == "c10d" or namespace == "_c10d_functional" and name in FUNCTIONAL_COLLECTIVES
            else "seeded" if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()) else "")
    return what, name


# DTensor's collectives (tensor parallelism's), by name: their wait is not one
FUNCTIONAL_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


_OP_FACTS: dict = {}


@contextlib.contextmanager
def seeing_saved(on_saved: Callable[[torch.Tensor], None]):
    """Saved-tensor hooks that show `on_saved` every tensor autograd saves for backward, and keep a detached
    alias of it. Keeping the tensor itself would keep its grad_fn: an op's saved output would hold the node
    that holds it, a cycle through C++ that no garbage collector sees, and the graph of an output backward
    never reaches (a pooling head the loss does not read) would outlive the step, which a step without these
    hooks frees at once. The alias allocates nothing and is made unseen by memfit's modes (the step itself
    issues no such op)."""
    def pack(t: torch.Tensor) -> torch.Tensor:
        on_saved(t)
        _Scoped.quiet += 1
        try:
            return detach_sharing_version(t)
        finally:
            _Scoped.quiet -= 1

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


class ModuleScope:
    """Keeps each mode's `module_stack` equal to the stack of modules whose forward is running, so each
    allocation and FLOP is attributed to the innermost module (recomputation in backward included)."""

    def __init__(self, model: torch.nn.Module, *modes: _Scoped):
        stacks = [m.module_stack for m in modes]

        def enter(label):
            def hook(module, args):
                for stack in stacks:
                    stack.append(label)
            return hook

        def leave(module, args, output):  # returns None: a forward hook's return value replaces the output
            for stack in stacks:
                if stack:
                    stack.pop()

        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(enter(name or type(mod).__name__)))
            self.handles.append(mod.register_forward_hook(leave, always_call=True))

    def remove(self):
        for h in self.handles:
            h.remove()
