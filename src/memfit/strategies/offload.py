"""Offload: keep memory in the host instead of the device.

Activations: `saved_tensors_hooks` copy every tensor saved for backward (weights excepted: they stay on the
device anyway) to host memory during the forward pass and back when backward needs it.

Optimizer (ZeRO-Offload's idea, for any torch.optim optimizer): an fp32 master copy of the parameters
and the optimizer state live on the host, the optimizer step runs on the host CPU. Each gradient is
streamed to the host as soon as backward has accumulated it and freed on the device; after the step the
updated master weights are copied back into the device parameters.

Copies are made with explicit `empty` + `copy_` on both sides, so that host and device memory behave the
same whether the device is a GPU or (for rehearsal and tests) the CPU itself. `host_side()` marks code
whose allocations are host memory, so a trace of a GPU step can book them apart.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterable

import torch

from memfit.torch_internals import storage_key

_state = threading.local()


@contextlib.contextmanager
def host_side():
    previous = getattr(_state, "host", False)
    _state.host = True
    try:
        yield
    finally:
        _state.host = previous


def on_host_side() -> bool:
    return getattr(_state, "host", False)


def _host_copy(t: torch.Tensor, pin: bool, dtype: torch.dtype | None = None) -> torch.Tensor:
    with host_side():
        host = torch.empty(t.shape, dtype=dtype or t.dtype, device="cpu", pin_memory=pin)
        host.copy_(t, non_blocking=pin)
    return host


class ActivationOffload:
    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.device = device
        self.pin = device.type == "cuda"
        self.keep = {storage_key(p) for p in model.parameters()}
        self.moved_bytes = 0

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        if storage_key(t) in self.keep:
            return t
        self.moved_bytes += t.numel() * t.element_size()
        return t.device, _host_copy(t, self.pin)

    def _unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        self.moved_bytes += host.numel() * host.element_size()
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        return out.copy_(host, non_blocking=self.pin)


class OptimizerOffload:
    def __init__(self, model: torch.nn.Module, make_optimizer: Callable[[Iterable], torch.optim.Optimizer],
                 device: torch.device):
        self.pin = device.type == "cuda"
        self.params = list({id(p): p for p in model.parameters() if p.requires_grad}.values())
        self.master = [_host_copy(p.detach(), self.pin, torch.float32).requires_grad_(True) for p in self.params]
        with host_side():
            self.optimizer = make_optimizer(self.master)
        self.moved_bytes = 0
        for p, m in zip(self.params, self.master):
            p.register_post_accumulate_grad_hook(self._stream_grad(m))

    def _stream_grad(self, master: torch.Tensor):
        def hook(p: torch.Tensor) -> None:
            self.moved_bytes += p.grad.numel() * p.grad.element_size()
            grad = _host_copy(p.grad, self.pin, torch.float32)
            p.grad = None  # the device copy is no longer needed
            with host_side():
                if master.grad is None:
                    master.grad = grad
                else:
                    master.grad += grad
        return hook

    def step(self, before: Callable[[], None] = lambda: None) -> None:
        """The host optimizer's step; `before` runs first, on the host, where the gradients now are (clipping)."""
        with host_side():
            before()
            self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m, non_blocking=self.pin)
                self.moved_bytes += p.numel() * p.element_size()

    def host_tensors(self) -> list[torch.Tensor]:
        """Everything this strategy keeps in host memory (master weights, their grads, optimizer state)."""
        out = list(self.master) + [m.grad for m in self.master if m.grad is not None]
        for state in self.optimizer.state.values():
            out += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return out
