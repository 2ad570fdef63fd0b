"""`Trainer`: the training engine a run drives. One `step()` is one optimizer step over one global batch."""
from __future__ import annotations

import torch
from torch.utils.data import default_collate

from memfit.config import Config
from memfit.errors import ConfigError, WorkloadError
from memfit.runtime.noise import NoiseScale
from memfit.step import TrainStep
from memfit.strategies import ActivationOffload
from memfit.strategies.activation_checkpoint import apply_checkpointing, chosen_blocks
from memfit.strategies.data_parallel import data_parallel_rank
from memfit.workload import Batch, Workload, split_batch


def data_seed(seed: int, step: int) -> int:
    """The global batch of step `step` depends on (seed, step) only, so a resumed run sees the same data."""
    return (seed * 1_000_003 + step) % (2**63)


def dataset_batch(data, seed: int, step: int, global_batch: int) -> Batch:
    """Samples [step * G, (step + 1) * G) of an endless stream that visits the dataset in a new seeded order
    each epoch. The position is a function of the step, so resuming needs nothing but the step number."""
    n = len(data)
    if n == 0:
        raise WorkloadError("workload.data is empty")
    indices, orders, start = [], {}, step * global_batch
    for position in range(start, start + global_batch):
        epoch, offset = divmod(position, n)
        if epoch not in orders:
            orders[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(data_seed(seed, -1 - epoch)))
        indices.append(int(orders[epoch][offset]))
    return default_collate([data[i] for i in indices])


class Trainer:
    """Builds the model and optimizer for `config` on `device`, applies the strategies, and steps: the one
    public way to run the training math (`memfit.train` drives one; `TrainStep` underneath is internal).

    `step(batch=None)` draws the global batch (micro_batch * grad_accum samples) from `workload.batch`
    with torch's RNG seeded from (seed, step) — leaving the model's own RNG stream (dropout) untouched —
    and returns the mean loss as a float.

    Args:
        workload: the job (`Workload`).
        config: how a step is executed (`Config`); `reconfigure` changes the micro-batch and activation
            checkpointing between steps.
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        seed: seeds the initial weights and, with the step number, each step's data.
        global_batch: samples per optimizer step when it is not ``config.global_batch`` (a run whose
            micro-batch does not divide it).

    `noise` measures the gradient noise scale of the steps that accumulate, for batch-size advice
    (`runtime/noise.py`; it reads gradients and changes nothing); None across ranks.

    Example::

        trainer = Trainer(workload, Config(micro_batch=16, grad_accum=4, activation_checkpoint="all"))
        loss = trainer.step()   # one optimizer step over 64 samples
    """

    def __init__(self, workload: Workload, config: Config, device: str | torch.device = "cpu", seed: int = 0,
                 global_batch: int | None = None):
        self.workload, self.config, self.seed = workload, config, seed
        self.global_batch = global_batch or config.global_batch
        if config.gpus > 1 and self.global_batch % config.gpus:
            raise ConfigError(f"global batch {self.global_batch} does not split evenly over {config.gpus} GPUs")
        torch.manual_seed(seed)
        self.engine = TrainStep(workload, config, device)
        self.noise = NoiseScale(self.engine) if config.world == 1 else None
        self.step_count = 0

    def reconfigure(self, config: Config) -> None:
        """Change how steps are executed, keeping the model and optimizer state: the micro-batch (and so the
        accumulation) and checkpointing. What would change the math or the optimizer (precision, offload)
        is refused."""
        old = self.config
        if self.noise is not None:  # a step cut short by an OOM is redone from its first micro-batch
            self.noise.reset()
        if (config.precision, config.offload_optimizer) != (old.precision, old.offload_optimizer):
            raise ConfigError("a running trainer cannot change precision or optimizer offload")
        if config.activation_checkpoint != old.activation_checkpoint:
            stage = self.engine.pipeline
            names = chosen_blocks(self.engine.model, config.activation_checkpoint, stage.kept if stage else None)
            apply_checkpointing(self.engine.model, names, selective=config.activation_checkpoint)
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
        """Step `step`'s global batch, or across ranks this rank's share of it (every rank draws the same
        seeded global batch and keeps its own contiguous rows, so N ranks see what one process would)."""
        step = self.step_count if step is None else step
        if self.workload.data is not None:
            batch = dataset_batch(self.workload.data, self.seed, step, self.global_batch)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(data_seed(self.seed, step))
                batch = self.workload.batch(self.global_batch)
        if self.config.gpus == 1:
            return batch
        return split_batch(batch, self.global_batch // self.config.gpus)[data_parallel_rank(self.config)]

    def step(self, batch: Batch | None = None) -> float:
        batch = self.batch() if batch is None else batch
        loss = self.engine(batch)
        self.step_count += 1
        return float(loss)
