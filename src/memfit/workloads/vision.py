"""Built-in non-language workloads: a ResNet (convolutions, BatchNorm, in-place ReLU) and a plain MLP.

They exercise what the transformer does not: BatchNorm running stats, in-place activations, 4-d
activations whose size falls with depth, and SGD with momentum.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memfit.workload import Workload, WorkloadError

RESNET_DEPTHS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


def _ints(where: str, **values) -> dict[str, int]:
    """Options may come from a command line as strings; accept "224" as 224 and reject the rest."""
    out = {}
    for key, value in values.items():
        try:
            out[key] = int(value)
        except (TypeError, ValueError):
            raise WorkloadError(f"{where}: option {key} must be a whole number, got {value!r}") from None
        if out[key] < 1:
            raise WorkloadError(f"{where}: option {key} must be at least 1, got {value!r}")
    return out


# ---------------------------------------------------------------------------------------------- resnet


class Bottleneck(nn.Module):
    """1x1 reduce -> 3x3 (carries the stride) -> 1x1 expand, plus the shortcut; torchvision's layout."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int = 1):
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, blocks: tuple[int, ...] = (3, 4, 6, 3), width: int = 64, classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        in_ch = width
        for i, n in enumerate(blocks):
            stage_width = width * 2 ** i
            stage = []
            for j in range(n):
                stage.append(Bottleneck(in_ch, stage_width, stride=2 if (i > 0 and j == 0) else 1))
                in_ch = stage_width * Bottleneck.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*stage))
        self.stages = len(blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def classification_loss(model: nn.Module, batch) -> torch.Tensor:
    inputs, labels = batch
    return F.cross_entropy(model(inputs), labels)


def resnet(name: str = "resnet", *, image=None, classes=None, depth=None, width=None) -> Workload:
    """ResNet-50 by default (`depth` 101 / 152 for the deeper ones); `resnet-tiny` is a 32-pixel,
    one-block-per-stage, width-8 version that trains in milliseconds for tests."""
    tiny = name == "resnet-tiny"
    opts = _ints(name, image=image if image is not None else (32 if tiny else 224),
                 classes=classes if classes is not None else (10 if tiny else 1000),
                 depth=depth if depth is not None else 50,
                 width=width if width is not None else (8 if tiny else 64))
    if opts["depth"] not in RESNET_DEPTHS:
        raise WorkloadError(f"{name}: depth must be one of 50, 101, 152 (bottleneck ResNets), got {depth!r}")
    blocks = (1, 1, 1, 1) if tiny and depth is None else RESNET_DEPTHS[opts["depth"]]
    image_size, n_classes, base = opts["image"], opts["classes"], opts["width"]

    def model() -> nn.Module:
        return ResNet(blocks, width=base, classes=n_classes)

    def batch(n: int):
        return torch.randn(n, 3, image_size, image_size), torch.randint(0, n_classes, (n,))

    def optimizer(params):
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-4)

    return Workload(model=model, batch=batch, loss=classification_loss, optimizer=optimizer, name=name)


# ---------------------------------------------------------------------------------------------- mlp


class MLP(nn.Module):
    def __init__(self, features: int, width: int, depth: int, classes: int):
        super().__init__()
        dims = [features] + [width] * depth
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.GELU()) for a, b in zip(dims, dims[1:]))
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def mlp(name: str = "mlp", *, width=None, depth=None, features=None, classes=None) -> Workload:
    """A stack of Linear+GELU layers: the simplest case, where weights and optimizer state dominate."""
    tiny = name == "mlp-tiny"
    opts = _ints(name, width=width if width is not None else (64 if tiny else 4096),
                 depth=depth if depth is not None else (2 if tiny else 4),
                 features=features if features is not None else (32 if tiny else 1024),
                 classes=classes if classes is not None else 10)

    def model() -> nn.Module:
        return MLP(opts["features"], opts["width"], opts["depth"], opts["classes"])

    def batch(n: int):
        return torch.randn(n, opts["features"]), torch.randint(0, opts["classes"], (n,))

    def optimizer(params):
        return torch.optim.AdamW(params, lr=1e-3)

    return Workload(model=model, batch=batch, loss=classification_loss, optimizer=optimizer, name=name)
