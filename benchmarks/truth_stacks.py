"""Ground truth for memfit's integrations: the peak of the CPU allocator over a whole run of another stack's
own training loop (Hugging Face Trainer, TRL, Lightning), by the PyTorch profiler's allocation events. The
model is built inside the profile, so every byte the run holds was allocated under it; the peak is the
highest running total, setup, first step and the later steady ones included. Shares no counting code with
memfit."""
from __future__ import annotations

import gc

import torch
from torch.profiler import ProfilerActivity, profile

from memfit.torch_internals import profiler_allocations


def run_peak(fn) -> tuple[int, object]:
    """(the CPU allocator's peak while fn() runs, above what was live when it began; fn's result)."""
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    _, events = profiler_allocations(prof, "memfit.truth")
    base = events[0][2] - events[0][1]
    return max(total for _, _, total, _, _ in events) - base, result


class TokenRows(torch.utils.data.Dataset):
    """Rows of `seq` random tokens, made when read (the dataset itself holds no tensors), with their labels:
    the copy of the ids a causal LM shifts itself, or for a masked LM 15% of them (the rest -100)."""

    def __init__(self, vocab: int, seq: int, masked: bool = False, rows: int = 10_000):
        self.vocab, self.seq, self.masked, self.rows = vocab, seq, masked, rows

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(0, self.vocab, (self.seq,), generator=g)
        if not self.masked:
            return {"input_ids": ids, "labels": ids.clone()}
        chosen = torch.rand(self.seq, generator=g) < 0.15
        chosen[0] = True
        return {"input_ids": ids, "labels": torch.where(chosen, ids, torch.full_like(ids, -100))}


class FeatureRows(torch.utils.data.Dataset):
    """Rows of `features` random numbers and a class label, made when read (the dataset holds no tensors)."""

    def __init__(self, features: int, classes: int, rows: int = 4096):
        self.features, self.classes, self.rows = features, classes, rows

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.features, generator=g), torch.randint(0, self.classes, (), generator=g)


def trainer_peak(make_model, args, dataset, trainer_class=None, **trainer_kwargs) -> tuple[int, object]:
    """The peak of building `make_model()` and a Trainer (or `trainer_class`) on it and `args`, and
    `.train()`; with the trainer, for its state (global step, the batch sizes it ran)."""
    import transformers

    def run():
        torch.manual_seed(0)
        trainer = (trainer_class or transformers.Trainer)(model=make_model(), args=args, train_dataset=dataset,
                                                         **trainer_kwargs)
        trainer.train()
        return trainer

    return run_peak(run)
