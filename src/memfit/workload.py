"""The workload contract: how a user hands memfit a training job, and the batch helpers every layer uses."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterable

import torch

from memfit.errors import WorkloadError

Batch = Any  # a tensor, or a tuple / list / dict of tensors (nested), samples along dim 0


@dataclasses.dataclass
class Workload:
    """One training job, as four factories. memfit calls them itself, on the (possibly fake) device it
    chooses, so that the same description can be estimated, planned and run.

    Args:
        model: ``() -> nn.Module``, called under the target device context (fake, meta or real). It may
            carry ``model.with_blocks(keep) -> nn.Module | None``, the same model built with only its first
            `keep` repeated blocks: the planner's shallow copies of a deep model then skip building the rest
            (transformers' configs and LoRA on them have it; without it the whole model is built and cut).
        batch: ``n -> batch`` of n samples: a tensor, or a tuple / list / dict of tensors (nested), samples
            along dim 0. A run seeds torch's RNG per step before calling it, so a resumed run sees the same data.
        loss: ``(model, batch) -> scalar tensor``, mean-reduced over the samples of the batch: memfit weights
            each micro-batch's loss by its share of the global batch, so accumulation keeps the math. A
            language model's loss written with `memfit.losses.chunked_cross_entropy` can also be computed in
            chunks of tokens (``Config.loss_chunks``).
        optimizer: ``params -> torch.optim.Optimizer`` (default: AdamW, lr 1e-3).
        name: what tables, run folders and checkpoints call the job; a resume checks it.
        data: optional map-style ``torch.utils.data.Dataset``: a run then draws its global batches from it
            (a seeded shuffle per epoch, items collated with torch's ``default_collate``) instead of
            ``batch``; ``batch`` still gives a batch's shape to the estimator.
        max_grad_norm: clip the gradients before each optimizer step so that their L2 norm, taken over all
            of them (every rank's shards together), is at most this (``torch.nn.utils.clip_grad_norm_``'s
            math, after fp16 loss scaling is undone). None: no clipping. Part of the job's math, like the
            optimizer: the planner keeps it and a resume must keep it.

    Example::

        wl = Workload(model=lambda: nn.Linear(32, 10),
                      batch=lambda n: (torch.randn(n, 32), torch.randint(0, 10, (n,))),
                      loss=lambda model, b: F.cross_entropy(model(b[0]), b[1]))
        memfit.estimate(wl, Config(micro_batch=64)).peak_bytes
    """

    model: Callable[[], torch.nn.Module]
    batch: Callable[[int], Batch]
    loss: Callable[[torch.nn.Module, Batch], torch.Tensor]
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] = (
        lambda params: torch.optim.AdamW(params, lr=1e-3)
    )
    name: str = "workload"
    data: Any = None
    max_grad_norm: float | None = None

    def __post_init__(self):
        limit = self.max_grad_norm
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float))
                                  or not 0 < limit < math.inf):
            raise WorkloadError(f"max_grad_norm must be a positive number or None, got {limit!r}")


# ---------------------------------------------------------------------------------------------- batches

def map_tensors(batch: Batch, fn: Callable[[torch.Tensor], Any]) -> Batch:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def tensors_of(batch: Batch) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    map_tensors(batch, out.append)
    return out


def batch_size(batch: Batch) -> int:
    sizes = {t.shape[0] for t in tensors_of(batch) if t.dim() > 0}
    if len(sizes) != 1:
        raise WorkloadError(f"the batch's tensors must share one size along dim 0, found {sorted(sizes) or 'none'}")
    return sizes.pop()


def split_batch(batch: Batch, micro_batch: int) -> list[Batch]:
    """Split along dim 0 into chunks of `micro_batch` samples (the last may be smaller)."""
    n = batch_size(batch)
    chunks = math.ceil(n / micro_batch)
    return [map_tensors(batch, lambda t, i=i: t[i * micro_batch:(i + 1) * micro_batch] if t.dim() else t)
            for i in range(chunks)]


def move_batch(batch: Batch, device: torch.device | str) -> Batch:
    device = torch.device(device)
    non_blocking = device.type == "cuda"
    return map_tensors(batch, lambda t: t.to(device, non_blocking=non_blocking))
