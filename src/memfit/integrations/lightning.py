"""Lightning: `MemfitBatchSize`, a callback that sets the batch size and `accumulate_grad_batches` from an
estimate of the LightningModule's own `training_step` and `configure_optimizers` on fake tensors, before the
first step: no trial steps, the global batch kept, every rank computing the same plan without a collective.

What `Trainer.fit` holds otherwise than memfit's step: the micro-batch being trained (memfit's step holds
the global batch), and the next one too where the dataloader has no length (Lightning's data fetcher then
fetches one ahead to know when it ends), and under DDP
the reducer's gradient buckets, a copy of every gradient (Lightning's DDP leaves
`gradient_as_bucket_view` off): both are added to the plan's figures, each said in its notes.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch

from memfit.config import Config
from memfit.errors import ConfigError, WorkloadError
from memfit.integrations.loops import plan_runnable, rebuilt, target
from memfit.memory.estimate import Category, Estimate, estimate
from memfit.planner.search import Plan
from memfit.units import fmt_bytes
from memfit.workload import Workload, map_tensors, tensors_of

try:
    import lightning.pytorch as pl
except ImportError:
    raise WorkloadError("lightning is not installed: pip install 'memfit[lightning]'") from None

PRECISIONS = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}


def module_workload(pl_module, sample, max_grad_norm: float | None) -> Workload:
    """The LightningModule's automatic-optimization step as a memfit Workload: a copy of the module (fresh
    tensors, no trainer), its `training_step` as the loss, its `configure_optimizers`' one optimizer, and
    batches of n copies of the first sample of `sample` (a batch its own dataloader made)."""
    one = map_tensors(sample, lambda t: t[:1] if t.dim() else t)
    built = []

    def build() -> torch.nn.Module:
        built[:] = [rebuilt(pl_module)()]  # a LightningModule's copy leaves its trainer behind
        return built[0]

    def batch(n: int):
        return map_tensors(one, lambda t: t.expand(n, *t.shape[1:]).clone() if t.dim() else t)

    def loss(m, b) -> torch.Tensor:
        with warnings.catch_warnings():  # self.log without a trainer: a warning, and nothing logged
            warnings.simplefilter("ignore")
            out = m.training_step(b, 0)
        if isinstance(out, dict):
            out = out.get("loss")
        if not isinstance(out, torch.Tensor):
            raise WorkloadError(f"{type(m).__name__}.training_step returned no loss tensor: memfit plans automatic "
                                "optimization")
        return out

    def optimizer(params) -> torch.optim.Optimizer:
        made = built[0].configure_optimizers()
        if isinstance(made, dict):
            made = made["optimizer"]
        elif isinstance(made, (list, tuple)):
            made = made[0] if len(made) == 2 and isinstance(made[0], (list, tuple)) else made
            if len(made) != 1:
                raise WorkloadError(f"configure_optimizers returned {len(made)} optimizers: memfit plans one")
            made = made[0]
            made = made["optimizer"] if isinstance(made, dict) else made
        if not isinstance(made, torch.optim.Optimizer):
            raise WorkloadError(f"configure_optimizers returned {type(made).__name__}, not an optimizer")
        return made

    return Workload(model=build, batch=batch, loss=loss, optimizer=optimizer, name=type(pl_module).__name__,
                    max_grad_norm=max_grad_norm)


def _ddp_buckets(pl_module) -> int:
    """Bytes of DDP's gradient buckets: each trainable parameter's gradient once, in flat buckets of its dtype."""
    return sum(p.numel() * p.element_size() for p in pl_module.parameters() if p.requires_grad)


class MemfitBatchSize(pl.Callback):
    """Set the batch size (the attribute `batch_arg_name` of the LightningModule or its datamodule, as
    Lightning's `BatchSizeFinder` does) and `trainer.accumulate_grad_batches` so that the step fits `budget` on
    `device` and the global batch (batch size x accumulation x processes) stays what was given. Planned at
    `setup`, before the model is wrapped and the dataloaders are built. Works under `ddp` (every rank plans the
    same; nothing is exchanged); `.plan` holds the plan.

    Example::

        trainer = L.Trainer(accumulate_grad_batches=1, callbacks=[MemfitBatchSize(budget="20GiB", device="cuda")])
        trainer.fit(model, datamodule)   # model.batch_size (or the datamodule's) is the global batch's share
    """

    def __init__(self, budget=None, device: str | None = None, batch_arg_name: str = "batch_size"):
        self.budget, self.device, self.batch_arg_name = budget, device, batch_arg_name
        self.plan: Plan | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise ConfigError(f"MemfitBatchSize: {self.batch_arg_name!r} is not an attribute of the LightningModule, "
                              "its hparams or its datamodule (batch_arg_name names where the batch size lives)")
        precision = PRECISIONS.get(str(trainer.precision))
        if precision is None:
            raise ConfigError(f"MemfitBatchSize: precision {trainer.precision!r} is not modelled (modelled: "
                              f"{', '.join(PRECISIONS)})")
        world = trainer.world_size
        layout = type(trainer.strategy).__name__
        if world > 1 and layout != "DDPStrategy":
            raise ConfigError(f"MemfitBatchSize: {layout} across {world} processes is not modelled (DDP is)")
        clip = trainer.gradient_clip_val
        if clip and (trainer.gradient_clip_algorithm or "norm") != "norm":  # unset: by norm
            raise ConfigError("MemfitBatchSize: gradient clipping by value is not modelled (by norm is)")
        per_rank = lightning_getattr(pl_module, self.batch_arg_name) * trainer.accumulate_grad_batches
        source = trainer.datamodule if trainer.datamodule is not None else pl_module
        from lightning.fabric.utilities.data import has_len

        loader = source.train_dataloader()
        workload = module_workload(pl_module, next(iter(loader)), float(clip) if clip else None)
        dev, limit = target(self.device, self.budget)
        self.plan = fit_module(workload, per_rank, precision, dev, limit, held=1 if has_len(loader) else 2,
                               buckets=_ddp_buckets(pl_module) if world > 1 else 0)
        lightning_setattr(pl_module, self.batch_arg_name, self.plan.config.micro_batch)
        trainer.accumulate_grad_batches = self.plan.config.grad_accum


def fit_module(workload: Workload, per_rank: int, precision: str, dev, limit, held: int = 1,
               buckets: int = 0) -> Plan:
    """The plan for one rank's share of the global batch, confirmed by `fit_estimate` (what `Trainer.fit`
    holds: `held` micro-batches); `buckets`: DDP's gradient buckets, held whatever the configuration: planned
    in the budget left beside them, and added to the plan's figures."""
    from memfit.planner.search import MARGIN, resolve_budget

    budget = resolve_budget(limit, dev)
    if buckets >= budget:
        raise ConfigError(f"DDP's gradient buckets alone ({fmt_bytes(buckets)}) fill the budget")
    found = plan_runnable(workload, per_rank, _runs, stack="Lightning",
                          confirm=lambda config: fit_estimate(workload, config, dev, held),
                          budget=budget - buckets, device=dev, precision=precision, activation_checkpoint="none",
                          offload_activations=False, offload_optimizer=False)
    if not buckets:
        return found
    est = found.estimate
    breakdown = {**est.breakdown, Category.GRADIENTS: est.breakdown.get(Category.GRADIENTS, 0) + buckets}
    note = (f"DDP's gradient buckets: {fmt_bytes(buckets)}, a copy of every gradient (gradient_as_bucket_view off, "
            "Lightning's default)")
    fields = {k: getattr(est, k) + buckets for k in ("peak_bytes", "peak_allocated_bytes", "peak_reserved_bytes",
                                                     "device_peak_bytes") if getattr(est, k) is not None}
    est = dataclasses.replace(est, breakdown=breakdown, notes=[*est.notes, note], **fields)
    return dataclasses.replace(found, estimate=est, peak_bytes=found.peak_bytes + buckets, budget_bytes=budget,
                               usable_bytes=int(budget * (1 - MARGIN)), notes=[note, *found.notes])


def fit_estimate(workload: Workload, config: Config, device, held: int = 1) -> Estimate:
    """memfit's estimate of the step, with the `held` micro-batches `Trainer.fit` holds instead of memfit's
    global batch (module doc)."""
    est = estimate(workload, config, device)
    with torch.device("meta"):
        micro = sum(t.numel() * t.element_size() for t in tensors_of(workload.batch(config.micro_batch)))
    # on a CPU memfit's step holds the whole global batch; on a GPU both hold the micro-batch being trained
    # there (one fetched ahead waits on the host)
    if est.device_peak_bytes is not None:
        return est
    inputs = (held - config.grad_accum) * micro
    breakdown = {**est.breakdown, Category.INPUTS: est.breakdown.get(Category.INPUTS, 0) + inputs}
    what = "the micro-batch trained" if held == 1 else "the micro-batch trained and the next"
    notes = [*est.notes, f"Lightning holds {what} ({fmt_bytes(held * micro)}), not the global batch"]
    return dataclasses.replace(est, breakdown=breakdown, notes=notes, peak_bytes=est.peak_bytes + inputs)


def _runs(config: Config) -> str | None:
    """Lightning's automatic optimization accumulates and clips, in the precision it was built with."""
    if config.optimizer_in_backward:
        return "the optimizer step in backward"
    if config.loss_chunks > 1:
        return "a loss in chunks"
    return None
