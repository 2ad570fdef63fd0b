"""Count live tensor bytes on one device, op by op: the ground truth memfit estimates from.

A `TorchDispatchMode` sees every tensor an aten op creates (below autograd, so the backward pass and the
optimizer are seen too). Bytes are counted per storage, so views and in-place results cost nothing, and a
storage is freed when its Python wrapper's finaliser runs (storages keep one wrapper for life). The same
counter runs on fake tensors (the estimate) and on real ones (the fallback and the CPU virtual budget).
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit.memory.fake import op_flops
from memfit.memory.kernels import fix_fake_outputs
from memfit.strategies.offload import on_host_side


@dataclasses.dataclass
class StorageInfo:
    nbytes: int
    op: str
    module: str
    shape: tuple
    dtype: str
    phase: str
    category: str | None = None  # forced label (inputs, host copies); otherwise decided after the step


class LiveBytes(TorchDispatchMode):
    """Records (id, +bytes) / (id, -bytes) events for storages on `device_type`.

    budget: if set, an allocation that takes the live total past it raises torch.OutOfMemoryError —
    the virtual device memory used to rehearse OOMs on a CPU.
    host_apart: allocations made under `host_side()` (offloading) are host memory, not device memory.
    True when a GPU step is traced on the CPU; on a CPU device host and device memory are one.
    """

    def __init__(self, device_type: str = "cpu", budget: int | None = None, host_apart: bool = False,
                 detail: bool = True):
        super().__init__()
        self.device_type = device_type
        self.budget = budget
        self.detail = detail  # False: live bytes and peak only (a run's budget, steps without end)
        self.host_apart = host_apart
        self.host_live: dict[int, int] = {}  # host-side storages when host_apart
        self.host_current = self.host_peak = 0
        self.infos: dict[int, StorageInfo] = {}
        self.live: dict[int, int] = {}
        self.events: list[tuple[int, int]] = []
        self.marks: list[tuple[int, str]] = []  # (event index, phase name)
        self.current = 0
        self.peak = 0
        self.peak_index = -1  # events[:peak_index + 1] replayed gives the live set at the peak
        self.module_stack: list[str] = []
        self.exclude: set[int] = set()  # storage addresses that live elsewhere (a host-side batch, for a GPU)
        self._uids: dict[int, int] = {}  # storage address -> id, live storages only
        self._next_uid = 0
        self.phase = "setup"
        self.flops_by_module: dict[str, int] = {}
        # one record per op for the step-time model: FLOPs, bytes read + written, largest new storage, kind
        self.op_flops: list[int] = []
        self.op_bytes: list[int] = []
        self.op_alloc: list[int] = []  # a CPU pays page faults on large fresh allocations
        # "f32" | "lp" (bf16/fp16) | "view" | "rng" (random numbers, their count as FLOPs: ~6 ns each on a CPU)
        # | "host" | "link" (host<->device copy)
        self.op_kind: list[str] = []
        self.op_phase: list[str] = []
        self.op_name: list[str] = []  # aten op, without overload: the step-time model prices some by name
        self.phase_peaks: dict[str, int] = {}  # the highest live total seen in each phase
        self.recompute_flops = 0  # forward ops run again during backward (activation checkpointing)
        self._active = True

    # -- what the step tells the tracker
    def mark(self, phase: str) -> None:
        self.phase = phase
        self.marks.append((len(self.events), phase))
        self.phase_peaks[phase] = max(self.phase_peaks.get(phase, 0), self.current)

    def track(self, tensors: Iterable[torch.Tensor], op: str = "preexisting", category: str | None = None,
              host: bool = False) -> None:
        for t in tensors:
            self._add(t, op, category, host)

    def tag(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        for t in tensors:
            info = self.infos.get(self.uid(t))
            if info is not None:
                info.category = category

    def uid(self, t: torch.Tensor) -> int | None:
        """The id of t's storage while it is live. Storage addresses are reused after a free, so events
        and labels use ids that are never reused."""
        return self._uids.get(t.untyped_storage()._cdata)

    def close(self) -> None:
        """Stop counting; finalisers of storages that die later are ignored."""
        self._active = False

    # -- bookkeeping
    def _add(self, t: torch.Tensor, op: str, category: str | None = None, host: bool = False) -> None:
        if t.device.type != self.device_type or t.is_sparse or t.is_nested:
            return
        st = t.untyped_storage()
        address = st._cdata
        if address in self._uids or address in self.exclude:
            return
        nbytes = st.nbytes()
        if category is None and on_host_side():  # offloaded copies: activations out, gradients in
            category = {"forward": "activations", "backward": "gradients"}.get(self.phase)
        if self.host_apart and (host or on_host_side()):
            self._uids[address] = key = self._next_uid
            self._next_uid += 1
            self.host_live[key] = nbytes
            self.host_current += nbytes
            self.host_peak = max(self.host_peak, self.host_current)
            weakref.finalize(st, self._free, address, key)
            return
        if self.budget is not None and self.current + nbytes > self.budget:
            raise torch.OutOfMemoryError(
                f"memfit virtual budget: allocating {nbytes} bytes with {self.current} live "
                f"exceeds {self.budget} bytes (op {op})"
            )
        key = self._next_uid
        self._next_uid += 1
        self._uids[address] = key
        self.live[key] = nbytes
        if self.detail:
            module = self.module_stack[-1] if self.module_stack else f"({self.phase})"
            self.infos[key] = StorageInfo(nbytes, op, module, tuple(t.shape), str(t.dtype).replace("torch.", ""),
                                          self.phase, category)
            self.events.append((key, nbytes))
        self.current += nbytes
        if self.current > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.current
        if self.current > self.peak:
            self.peak, self.peak_index = self.current, len(self.events) - 1
        weakref.finalize(st, self._free, address, key)

    def _free(self, address: int, key: int) -> None:
        if not self._active:
            return
        if key in self.host_live:
            del self._uids[address]
            self.host_current -= self.host_live.pop(key)
            return
        if key not in self.live:
            return
        del self._uids[address]
        nbytes = self.live.pop(key)
        if self.detail:
            self.events.append((key, -nbytes))
        self.current -= nbytes

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
        out = fix_fake_outputs(func, args, kwargs, func(*args, **kwargs))  # meta kernels that size outputs wrong
        if self._active and not self.detail:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._add(t, "")
        elif self._active:
            flops = op_flops(func, args, kwargs, out)
            if flops:
                module = self.module_stack[-1] if self.module_stack else f"({self.phase})"
                self.flops_by_module[module] = self.flops_by_module.get(module, 0) + flops
                if self.phase == "backward" and self.module_stack:
                    self.recompute_flops += flops
            self._record_op(func, args, kwargs, out, flops)
            name = func.__name__ if hasattr(func, "__name__") else str(func)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._add(t, name)
        return out


    def _record_op(self, func, args, kwargs, out, flops: int) -> None:
        """Called before the outputs are counted, so storages not yet known are the op's new allocations."""
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        alloc = 0
        if getattr(func, "is_view", False):
            kind, moved = "view", 0
        else:
            ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            moved = sum(t.numel() * t.element_size() for t in ins + outs)
            alloc = max((t.untyped_storage().nbytes() for t in outs
                         if t.untyped_storage()._cdata not in self._uids), default=0)
            low = any(t.dtype in (torch.bfloat16, torch.float16) for t in outs)
            if on_host_side():
                kind = "link" if func is torch.ops.aten.copy_.default else "host"
            elif not flops and torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()):
                # a random number costs the same whatever its dtype: the work recorded is how many are drawn
                # (attention is tagged too, for its dropout, but its work is its FLOPs)
                kind, flops = "rng", max((t.numel() for t in outs), default=0)
            else:
                kind = "lp" if low else "f32"
        self.op_flops.append(flops)
        self.op_bytes.append(moved)
        self.op_alloc.append(alloc)
        self.op_kind.append(kind)
        self.op_phase.append(self.phase)
        self.op_name.append(getattr(getattr(func, "_overloadpacket", func), "__name__", str(func)))


class ModuleScope:
    """Keeps `tracker.module_stack` equal to the stack of modules whose forward is running, so each
    allocation is attributed to the innermost module (recomputation in backward included)."""

    def __init__(self, model: torch.nn.Module, tracker: LiveBytes):
        stack = tracker.module_stack

        def enter(label):
            def hook(module, args):
                stack.append(label)
            return hook

        def leave(module, args, output):  # returns None: a forward hook's return value replaces the output
            if stack:
                stack.pop()

        self.handles = []
        for name, mod in model.named_modules():
            self.handles.append(mod.register_forward_pre_hook(enter(name or type(mod).__name__)))
            self.handles.append(mod.register_forward_hook(leave, always_call=True))

    def remove(self):
        for h in self.handles:
            h.remove()
