"""`sort`: the built-in default run. A small GPT learns to sort digits, generated on the fly.

Each sample is `d1 .. dn | s1 .. sn`: n random digits, a separator, the same digits sorted. The loss is
the next-token cross-entropy on the sorted half only (the random half cannot be predicted), so it starts
near ln(10) = 2.30 and falls as the model learns; `show` prints what the model writes for a few inputs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memfit.workload import Workload
from memfit.workloads.gpt import GPT, GPTConfig

SEP = 10  # token after the ten digits


def sort_batch(n: int, digits: int) -> dict[str, torch.Tensor]:
    x = torch.randint(0, 10, (n, digits))
    sep = torch.full((n, 1), SEP)
    return {"tokens": torch.cat([x, sep, x.sort(dim=1).values], dim=1)}


def sort_loss(model: nn.Module, batch, digits: int) -> torch.Tensor:
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])[:, digits:]  # positions that predict the sorted half
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, digits + 1:].reshape(-1))


def sort_task(*, digits: int = 12, layers: int = 2, d_model: int = 128, heads: int = 4) -> Workload:
    cfg = GPTConfig(layers=layers, d_model=d_model, heads=heads, ffn=4 * d_model, vocab=SEP + 1,
                    seq=2 * digits + 1).validate()
    return Workload(model=lambda: GPT(cfg), batch=lambda n: sort_batch(n, digits),
                    loss=lambda m, b: sort_loss(m, b, digits),
                    optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01), name="sort")


@torch.no_grad()
def show(model: nn.Module, digits: int = 12, samples: int = 3, seed: int = 1234) -> list[tuple[str, str, str]]:
    """(input, model's greedy answer, truth) for a few fresh inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 10, (samples, digits), generator=gen)
    device = next(model.parameters()).device
    tokens = torch.cat([x, torch.full((samples, 1), SEP)], dim=1).to(device)
    for _ in range(digits):
        nxt = model(tokens)[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
    text = lambda row: "".join(str(int(v)) for v in row)  # noqa: E731
    return [(text(x[i]), text(tokens[i, digits + 1:]), text(x[i].sort().values)) for i in range(samples)]
