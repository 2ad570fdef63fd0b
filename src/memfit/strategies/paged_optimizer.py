"""Paged optimizer states: the 8-bit moments live in host memory and visit the device one parameter at a
time, for that parameter's update only.

bitsandbytes' paged optimizers (PagedAdamW8bit, the optimizer of torchtune's single-GPU Llama recipes) keep
their states in CUDA unified memory: the driver evicts pages to the host when the device runs short and
brings them back when the update kernel touches them. Under pressure, which is when paging matters, what
the device must hold at any moment is the state of the parameter being updated; the rest waits on the host.
memfit does that explicitly, so it is the same on every device and can be traced: each update copies its
parameter's codes and scales to the device, runs the 8-bit update there (strategies/optimizer_8bit.py), and
copies them back. A device with memory to spare would keep more pages resident under bitsandbytes (nvidia-smi
then shows them, torch's allocator never does); memfit's figure is what the step needs, not what the driver
leaves behind.

The math is the 8-bit optimizer's (paging moves bytes, not values): allowed with it (`Config.paged_optimizer`
needs `optimizer_8bit`; the planner's ``allow=("paged-optim",)``). One process only: the states are a
rank's whole optimizer state on its host, and FSDP's sharded states are not built for it.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from memfit.strategies.offload import host_side
from memfit.strategies.optimizer_8bit import Adam8bit, eight_bit


class PagedAdam8bit(Adam8bit):
    """`Adam8bit` whose state tensors stay on the host between updates (pinned when the parameters are on a
    GPU, so the copies run at the link's full speed)."""

    moved_bytes = 0  # host <-> device bytes paged during the last step (TrainStep resets it)

    def _update(self, p: torch.Tensor, group: dict, update: bool = True) -> None:
        held = self.state[p]
        self.state[p] = {k: self._page_in(v, p.device) for k, v in held.items()}
        super()._update(p, group, update)  # a first update makes the state on the device; it goes to the host below
        pin = p.device.type == "cuda"
        self.state[p] = {k: self._page_out(v, held.get(k), pin) for k, v in self.state[p].items()}

    def _page_in(self, value, device: torch.device):
        if not isinstance(value, torch.Tensor):
            return value
        out = torch.empty(value.shape, dtype=value.dtype, device=device)
        with host_side():  # booked as a copy over the host link
            out.copy_(value, non_blocking=device.type == "cuda")  # from pinned pages
        self.moved_bytes += value.numel() * value.element_size()
        return out

    def _page_out(self, value, held, pin: bool):
        if not isinstance(value, torch.Tensor):
            return value
        self.moved_bytes += value.numel() * value.element_size()
        with host_side():
            if held is None:
                held = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=pin)
            held.copy_(value)  # synchronous: a checkpoint may read the host copy next
        return held

    def load_state_dict(self, state_dict: dict) -> None:
        """Adam8bit's exact loader, then every state tensor back to host memory."""
        super().load_state_dict(state_dict)
        for p, state in self.state.items():
            pin = p.device.type == "cuda"
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device.type != "cpu":
                    state[key] = self._page_out(value, None, pin)
        self.moved_bytes = 0

    def host_tensors(self) -> list[torch.Tensor]:
        """The states: host memory between updates, whatever the device."""
        return [v for state in self.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def paged(make_optimizer: Callable[[Iterable], torch.optim.Optimizer]) -> Callable[[Iterable], PagedAdam8bit]:
    """The workload's Adam or AdamW rebuilt with paged 8-bit moments (the same groups and hyperparameters;
    `eight_bit` says what it refuses)."""
    def make(params) -> PagedAdam8bit:
        built = eight_bit(make_optimizer)(params)
        return PagedAdam8bit(built.param_groups, decoupled=built.defaults["decoupled"])
    return make
