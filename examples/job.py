"""An example workload: `memfit estimate examples/job.py:workload` (and plan, train) runs it as written.

A small residual convolutional network classifies 32×32 images into 10 classes. The images are synthetic,
so the example needs nothing downloaded: each class is noise around its own brightness, which a network
learns in a few dozen steps (the loss falls from about 2.3). For your own job, return your model, a batch of
n real samples, your loss and your optimizer the same way.
"""
import torch
import torch.nn.functional as F
from torch import nn

import memfit

CLASSES = 10


class Block(nn.Module):
    """conv -> ReLU -> conv, added to its input: the repeated unit that activation checkpointing wraps."""

    def __init__(self, width: int):
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1)

    def forward(self, x):
        return F.relu(x + self.conv2(F.relu(self.conv1(x))))


class Net(nn.Module):
    def __init__(self, width: int = 32, blocks: int = 4):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x):
        x = F.relu(self.stem(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def batch(n: int) -> dict:
    """n samples: class y's images are standard noise shifted by a brightness between -1 and 1."""
    y = torch.randint(0, CLASSES, (n,))
    brightness = torch.linspace(-1, 1, CLASSES)[y]
    return {"x": torch.randn(n, 3, 32, 32) + brightness.view(n, 1, 1, 1), "y": y}


def workload() -> memfit.Workload:
    return memfit.Workload(
        model=Net,  # built by memfit, on the (possibly fake) device it chooses
        batch=batch,
        loss=lambda model, b: F.cross_entropy(model(b["x"]), b["y"]),
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
    )
