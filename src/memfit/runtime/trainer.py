"""`Trainer`: the training engine a run drives. One `step()` is one optimizer step over one global batch."""
from __future__ import annotations

import torch

from memfit.config import Config
from memfit.step import TrainStep
from memfit.strategies import ActivationOffload
from memfit.strategies.checkpoint import apply_checkpointing, chosen_blocks
from memfit.workload import Batch, Workload


def data_seed(seed: int, step: int) -> int:
    """The global batch of step `step` depends on (seed, step) only, so a resumed run sees the same data."""
    return (seed * 1_000_003 + step) % (2**63)


class Trainer:
    """Builds the model and optimizer for `config` on `device`, applies the strategies, and steps.

    `step(batch=None)` draws the global batch (micro_batch * grad_accum samples) from `workload.batch`
    with torch's RNG seeded from (seed, step) — leaving the model's own RNG stream (dropout) untouched —
    and returns the mean loss as a float.
    """

    def __init__(self, workload: Workload, config: Config, device: str | torch.device = "cpu", seed: int = 0,
                 global_batch: int | None = None):
        self.workload, self.config, self.seed = workload, config, seed
        self.global_batch = global_batch or config.global_batch
        torch.manual_seed(seed)
        self.engine = TrainStep(workload, config, device)
        self.step_count = 0

    def reconfigure(self, config: Config) -> None:
        """Change how steps are executed, keeping the model and optimizer state: the micro-batch (and so the
        accumulation) and checkpointing. What would change the math or the optimizer (precision, offload)
        is refused."""
        old = self.config
        if (config.precision, config.offload_optimizer) != (old.precision, old.offload_optimizer):
            raise ValueError("a running trainer cannot change precision or optimizer offload")
        if config.checkpoint != old.checkpoint:
            names = chosen_blocks(self.engine.model, config.checkpoint)
            apply_checkpointing(self.engine.model, names, selective=config.checkpoint == "selective")
        if config.offload_activations != old.offload_activations:
            self.engine.activation_offload = (ActivationOffload(self.engine.model, self.engine.device)
                                              if config.offload_activations else None)
        self.config = self.engine.config = config

    @property
    def model(self) -> torch.nn.Module:
        return self.engine.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.engine.optimizer

    def batch(self, step: int | None = None) -> Batch:
        step = self.step_count if step is None else step
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(data_seed(self.seed, step))
            return self.workload.batch(self.global_batch)

    def step(self, batch: Batch | None = None) -> float:
        batch = self.batch() if batch is None else batch
        loss = self.engine(batch)
        self.step_count += 1
        return float(loss)
