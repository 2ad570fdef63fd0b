"""Optimizer step in backward: each parameter is updated, and its gradient freed, as soon as backward has
accumulated it (`register_post_accumulate_grad_hook`), so a step never holds the whole model's gradients at
once (for an 8B model in bf16, 15 GiB).

The update is the optimizer's own `step()`: it updates the parameters that have a gradient, and inside the
hook only this one has (the others' were freed after their own update, or are not computed yet). For an
optimizer whose update of a parameter depends on that parameter alone (SGD, Adam, AdamW, Adagrad, RMSprop,
Adafactor, ...) that is exactly the step after backward, and it stays one optimizer object: its state dict,
LR schedulers and checkpoints are unchanged. It needs one micro-batch per step (accumulation needs the
gradients kept) and no loss scaling (fp16 checks every gradient for overflow before any update); Config
refuses both.
"""
from __future__ import annotations

import torch


class OptimizerInBackward:
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.updated = 0  # parameters updated in this step: after the first, an OOM cannot be retried
        params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
        self.handles = [p.register_post_accumulate_grad_hook(self._update) for p in params]

    def _update(self, p: torch.Tensor) -> None:
        self.optimizer.step()
        p.grad = None
        self.updated += 1
