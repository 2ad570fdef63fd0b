"""A zoo of awkward models for tests and benchmarks (not itself a test module).

Each function returns a memfit `Workload` small enough that a real CPU training step takes well under a
second. Together they cover what trips memory estimators: in-place ops, tied and shared weights,
BatchNorm, recurrent kernels, custom autograd functions, sparse bags, and data-dependent shapes
(`moe`, `moe_item`) that fake tensors cannot follow. Every factory takes `optimizer=` (sgd, adam,
adamw, adagrad) so one model can be checked against each optimizer's state.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from memfit.workload import Workload
from memfit.workloads import builtin

OPTIMIZERS: dict[str, Callable] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.01, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-2),
}


def make_optimizer(name: str) -> Callable:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    return OPTIMIZERS[name]


def classify(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def next_token(model: nn.Module, batch) -> torch.Tensor:
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


# ---------------------------------------------------------------------------------------------- vit


class ViT(nn.Module):
    def __init__(self, image: int, patch: int, dim: int, depth: int, heads: int, classes: int):
        super().__init__()
        n_patches = (image // patch) ** 2
        self.patch = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n_patches + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim * 4, dropout=0.1, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


def vit(image: int = 32, patch: int = 4, dim: int = 64, depth: int = 2, heads: int = 4, classes: int = 10,
        optimizer: str = "adamw") -> Workload:
    """Patch-embedding conv + nn.TransformerEncoder (dropout, fused/native attention paths) + cls head.
    nn.TransformerEncoder deep-copies its layer, and in torch 2.13 a deep-copied FakeTensor lands in a new
    FakeTensorMode: built directly under FakeTensorMode, the forward fails with "Mixing fake modes"."""
    return Workload(model=lambda: ViT(image, patch, dim, depth, heads, classes),
                    batch=lambda n: (torch.randn(n, 3, image, image), torch.randint(0, classes, (n,))),
                    loss=classify, optimizer=make_optimizer(optimizer), name="vit")


# ---------------------------------------------------------------------------------------------- unet


def double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    """Two-level U-Net: the skip tensors stay alive across the whole forward, and torch.cat copies them."""

    def __init__(self, base: int, classes: int):
        super().__init__()
        self.down1 = double_conv(3, base)
        self.down2 = double_conv(base, base * 2)
        self.bottom = double_conv(base * 2, base * 4)
        self.pool = nn.MaxPool2d(2)
        self.up2 = nn.ConvTranspose2d(base * 4, base * 2, 2, stride=2)
        self.dec2 = double_conv(base * 4, base * 2)
        self.up1 = nn.ConvTranspose2d(base * 2, base, 2, stride=2)
        self.dec1 = double_conv(base * 2, base)
        self.out = nn.Conv2d(base, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s1 = self.down1(x)
        s2 = self.down2(self.pool(s1))
        x = self.bottom(self.pool(s2))
        x = self.dec2(torch.cat([self.up2(x), s2], dim=1))
        x = self.dec1(torch.cat([self.up1(x), s1], dim=1))
        return self.out(x)


def unet(image: int = 32, base: int = 8, classes: int = 4, optimizer: str = "adamw") -> Workload:
    """Segmentation: pixel-wise cross entropy over (n, classes, H, W) logits."""
    return Workload(model=lambda: UNet(base, classes),
                    batch=lambda n: (torch.randn(n, 3, image, image), torch.randint(0, classes, (n, image, image))),
                    loss=classify, optimizer=make_optimizer(optimizer), name="unet")


# ---------------------------------------------------------------------------------------------- convnext


class ConvNeXtBlock(nn.Module):
    """Depthwise 7x7 convolution, LayerNorm over channels, pointwise MLP as Linear layers on channels-last
    activations, residual: the ConvNeXt block (Liu et al., 2022), without layer scale and stochastic depth."""

    def __init__(self, dim: int):
        super().__init__()
        self.dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dw(x).permute(0, 2, 3, 1))
        return x + self.fc2(F.gelu(self.fc1(h))).permute(0, 3, 1, 2)


class ChannelNorm(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, dims: tuple, depths: tuple, classes: int):
        super().__init__()
        layers = [nn.Conv2d(3, dims[0], 4, stride=4), ChannelNorm(dims[0])]  # patchify stem
        for i, (dim, depth) in enumerate(zip(dims, depths)):
            if i:
                layers += [ChannelNorm(dims[i - 1]), nn.Conv2d(dims[i - 1], dim, 2, stride=2)]  # downsampling
            layers += [ConvNeXtBlock(dim) for _ in range(depth)]
        self.features = nn.Sequential(*layers)
        self.norm = nn.LayerNorm(dims[-1])
        self.head = nn.Linear(dims[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.features(x).mean((2, 3))))


def convnext(image: int = 64, dims: tuple = (16, 32), depths: tuple = (2, 2), classes: int = 10,
             optimizer: str = "adamw") -> Workload:
    """A two-stage ConvNeXt: patchify stem, depthwise 7x7 blocks, strided downsampling."""
    return Workload(model=lambda: ConvNeXt(dims, depths, classes),
                    batch=lambda n: (torch.randn(n, 3, image, image), torch.randint(0, classes, (n,))),
                    loss=classify, optimizer=make_optimizer(optimizer), name="convnext")


# ---------------------------------------------------------------------------------------------- lstm


class LSTMLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=layers, batch_first=True, dropout=0.1)
        self.decoder = nn.Linear(dim, vocab)
        self.decoder.weight = self.embed.weight  # tied: one tensor, two uses, one optimizer state

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(tokens))
        return self.decoder(out)


def lstm_lm(vocab: int = 500, dim: int = 64, layers: int = 2, seq: int = 32, optimizer: str = "adamw") -> Workload:
    """LSTM language model whose output layer shares the embedding's weight."""
    return Workload(model=lambda: LSTMLM(vocab, dim, layers),
                    batch=lambda n: {"tokens": torch.randint(0, vocab, (n, seq + 1))},
                    loss=next_token, optimizer=make_optimizer(optimizer), name="lstm_lm")


# ---------------------------------------------------------------------------------------------- gpt


def gpt_sdpa(optimizer: str = "adamw", **options) -> Workload:
    """The built-in gpt-tiny (RoPE + scaled_dot_product_attention), with the chosen optimizer."""
    wl = builtin("gpt-tiny", **options)
    wl.optimizer = make_optimizer(optimizer)
    wl.name = "gpt_sdpa"
    return wl


# ---------------------------------------------------------------------------------------------- moe


class Expert(nn.Sequential):
    def __init__(self, dim: int, hidden: int):
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


class Top2MoE(nn.Module):
    """Each token goes to its two best experts. How many tokens an expert receives is known only from
    the router's values, so the shapes inside depend on data."""

    def __init__(self, dim: int, hidden: int, experts: int):
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, assign = self.router(x).softmax(-1).topk(2, dim=-1)  # (tokens, 2)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (assign == e).nonzero()  # (k, 2): token, slot; k may be 0, which Linear accepts
            token, slot = idx[:, 0], idx[:, 1]
            y = expert(x.index_select(0, token)) * weights[token, slot].unsqueeze(-1)
            out.index_add_(0, token, y)
        return out.reshape(shape)


class MoENet(nn.Module):
    def __init__(self, features: int, dim: int, hidden: int, experts: int, classes: int, layer_cls=Top2MoE):
        super().__init__()
        self.inp = nn.Linear(features, dim)
        self.norm = nn.LayerNorm(dim)
        self.moe = layer_cls(dim, hidden, experts)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.moe(self.norm(h))
        return self.head(h.mean(1))


def moe(features: int = 32, seq: int = 16, dim: int = 64, hidden: int = 128, experts: int = 4, classes: int = 10,
        optimizer: str = "adamw") -> Workload:
    """Top-2 mixture of experts with nonzero / index_select / index_add: data-dependent shapes."""
    return Workload(model=lambda: MoENet(features, dim, hidden, experts, classes),
                    batch=lambda n: (torch.randn(n, seq, features), torch.randint(0, classes, (n,))),
                    loss=classify, optimizer=make_optimizer(optimizer), name="moe")


class TokenDrop(nn.Module):
    """Keeps only the tokens its gate scores above zero, counted with `.item()`: a Python int taken from
    tensor values decides how big the next tensors are."""

    def __init__(self, dim: int, hidden: int, experts: int):
        super().__init__()
        self.gate = nn.Linear(dim, 1)
        self.mlp = Expert(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        score = self.gate(x).squeeze(-1)
        keep = max(1, int((score > 0).sum().item()))
        idx = score.topk(keep).indices
        y = self.mlp(x[idx]) * torch.sigmoid(score[idx]).unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, idx, y).reshape(shape)


def moe_item(features: int = 32, seq: int = 16, dim: int = 64, hidden: int = 128, classes: int = 10,
             optimizer: str = "adamw") -> Workload:
    """A dynamic number of kept tokens, read with .item() in forward."""
    return Workload(model=lambda: MoENet(features, dim, hidden, 1, classes, layer_cls=TokenDrop),
                    batch=lambda n: (torch.randn(n, seq, features), torch.randint(0, classes, (n,))),
                    loss=classify, optimizer=make_optimizer(optimizer), name="moe_item")


# ---------------------------------------------------------------------------------------------- recommender


class Recommender(nn.Module):
    """DLRM-like: dense features through a bottom MLP, sparse id bags through EmbeddingBags, a top MLP."""

    def __init__(self, dense: int, tables: int, rows: int, dim: int):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(dense, 64), nn.ReLU(), nn.Linear(64, dim), nn.ReLU())
        # Row 0 pads: bags are fixed-size (n, bag) so the batch splits along dim 0, padding makes them ragged.
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="sum", padding_idx=0) for _ in range(tables))
        self.top = nn.Sequential(nn.Linear(dim * (tables + 1), 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        n, tables, bag = ids.shape
        offsets = torch.arange(0, n * bag, bag, device=ids.device)
        feats = [self.bottom(dense)]
        for t, table in enumerate(self.bags):
            feats.append(table(ids[:, t].reshape(-1), offsets))
        return self.top(torch.cat(feats, dim=1)).squeeze(-1)


def embedding_bag(dense: int = 13, tables: int = 3, rows: int = 1000, dim: int = 16, bag: int = 8,
                  optimizer: str = "adamw") -> Workload:
    """Click-through prediction: EmbeddingBag with flat ids + offsets, BCE-with-logits loss."""

    def batch(n: int):
        return {"dense": torch.randn(n, dense), "ids": torch.randint(0, rows, (n, tables, bag)),
                "label": torch.randint(0, 2, (n,)).float()}

    def loss(model: nn.Module, b) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(model(b["dense"], b["ids"]), b["label"])

    return Workload(model=lambda: Recommender(dense, tables, rows, dim), batch=batch, loss=loss,
                    optimizer=make_optimizer(optimizer), name="embedding_bag")


# ---------------------------------------------------------------------------------------------- custom Function


class ScaledSwish(torch.autograd.Function):
    """x * sigmoid(x) * scale with a hand-written backward: autograd sees only what ctx saves."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, scale)
        return x * torch.sigmoid(x) * scale

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, scale = ctx.saved_tensors
        s = torch.sigmoid(x)
        swish = x * s
        grad_x = grad * scale * (s + swish * (1 - s))
        grad_scale = (grad * swish).sum_to_size(scale.shape)
        return grad_x, grad_scale


class CustomNet(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int):
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(ScaledSwish.apply(self.fc1(x), self.scale))


def custom_function(features: int = 32, hidden: int = 64, classes: int = 10, optimizer: str = "adamw") -> Workload:
    """A custom torch.autograd.Function that saves its inputs with ctx.save_for_backward."""
    return Workload(model=lambda: CustomNet(features, hidden, classes),
                    batch=lambda n: (torch.randn(n, features), torch.randint(0, classes, (n,))),
                    loss=classify, optimizer=make_optimizer(optimizer), name="custom_function")


# ---------------------------------------------------------------------------------------------- in-place / shared


class InplaceTied(nn.Module):
    """In-place activations and adds (no new storage), and one weight used by two Linear layers."""

    def __init__(self, features: int, dim: int, classes: int):
        super().__init__()
        self.inp = nn.Linear(features, dim)
        self.a = nn.Linear(dim, dim)
        self.b = nn.Linear(dim, dim)
        self.b.weight = self.a.weight  # shared: counted once, its gradient accumulates from both uses
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).relu_()
        y = self.a(h)
        y.add_(h)
        y = torch.relu_(y)
        z = self.b(y)
        z.mul_(0.5).add_(y)
        return self.head(F.relu(z, inplace=True))


def inplace_tied(features: int = 32, dim: int = 64, classes: int = 10, optimizer: str = "adamw") -> Workload:
    return Workload(model=lambda: InplaceTied(features, dim, classes),
                    batch=lambda n: (torch.randn(n, features), torch.randint(0, classes, (n,))),
                    loss=classify, optimizer=make_optimizer(optimizer), name="inplace_tied")


# ---------------------------------------------------------------------------------------------- gru


class GRUClassifier(nn.Module):
    def __init__(self, features: int, hidden: int, layers: int, classes: int):
        super().__init__()
        self.gru = nn.GRU(features, hidden, num_layers=layers, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, h = self.gru(x)  # (layers * 2, n, hidden): the last layer's final state in each direction
        return self.head(torch.cat([h[-2], h[-1]], dim=1))


def rnn_gru(features: int = 16, hidden: int = 64, layers: int = 2, seq: int = 32, classes: int = 10,
            optimizer: str = "adamw") -> Workload:
    """Bidirectional 2-layer GRU sequence classifier (cuDNN/fused RNN kernels keep opaque workspaces)."""
    return Workload(model=lambda: GRUClassifier(features, hidden, layers, classes),
                    batch=lambda n: (torch.randn(n, seq, features), torch.randint(0, classes, (n,))),
                    loss=classify, optimizer=make_optimizer(optimizer), name="rnn_gru")


# ---------------------------------------------------------------------------------------------- CTC (speech)


class CTCHead(nn.Module):
    """Frames -> per-frame log-probabilities over the labels, (frames, batch, labels) as F.ctc_loss takes them."""

    def __init__(self, features: int, labels: int):
        super().__init__()
        self.proj = nn.Linear(features, labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).log_softmax(-1).transpose(0, 1)


def ctc_head(frames: int = 400, features: int = 16, labels: int = 50, target: int = 300,
             optimizer: str = "adamw") -> Workload:
    """F.ctc_loss over a small head, its tables (batch x frames x (2 x longest target + 1)) the step's largest
    tensors. Target lengths are fixed per sample (the first is shorter), so every batch has the same longest."""

    def batch(n: int) -> dict:
        lengths = torch.full((n,), target)
        lengths[0] = target - 7
        return {"x": torch.randn(n, frames, features), "targets": torch.randint(1, labels, (n, target)),
                "lengths": lengths}

    def loss(model: nn.Module, b: dict) -> torch.Tensor:
        log_probs = model(b["x"])
        return F.ctc_loss(log_probs, b["targets"], torch.full((log_probs.shape[1],), frames), b["lengths"])

    return Workload(model=lambda: CTCHead(features, labels), batch=batch, loss=loss,
                    optimizer=make_optimizer(optimizer), name="ctc_head")


def wav2vec2_ctc(samples: int = 4000, optimizer: str = "adamw") -> Workload:
    """transformers' Wav2Vec2ForCTC, shrunk: a convolutional feature encoder over raw audio, a transformer,
    and a CTC loss over labels padded with -100 (the model selects the real ones with masked_select)."""
    import transformers

    config = transformers.Wav2Vec2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, conv_dim=(32, 32, 32),
        conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
        vocab_size=32, ctc_loss_reduction="mean")

    def batch(n: int) -> dict:
        labels = torch.randint(1, 32, (n, 20))
        for row in range(n - 1):  # every row's end padded but the last one's
            labels[row, 15 + row % 5:] = -100
        return {"input_values": torch.randn(n, samples), "labels": labels}

    return Workload(model=lambda: transformers.Wav2Vec2ForCTC(config), batch=batch,
                    loss=lambda model, b: model(**b).loss, optimizer=make_optimizer(optimizer), name="wav2vec2_ctc")


ALL: dict[str, Callable[..., Workload]] = {
    "vit": vit,
    "unet": unet,
    "lstm_lm": lstm_lm,
    "gpt_sdpa": gpt_sdpa,
    "moe": moe,
    "moe_item": moe_item,
    "embedding_bag": embedding_bag,
    "custom_function": custom_function,
    "inplace_tied": inplace_tied,
    "rnn_gru": rnn_gru,
    "ctc_head": ctc_head,
    "wav2vec2_ctc": wav2vec2_ctc,
}
# The ones whose forward reads tensor values to decide shapes: fake tensors cannot trace them.
DATA_DEPENDENT = frozenset({"moe", "moe_item"})


def linear_regression(d: int, sigma: float, w_star: torch.Tensor, lr: float = 0.0) -> Workload:
    """y = w*·x + ε, x ~ N(0, I_d), ε ~ N(0, σ²), fitted by a bias-free Linear from w = 0 under MSE: a
    gradient noise known in closed form (tests/test_noise_scale.py; lr 0 holds w where it is measured)."""
    def model():
        m = nn.Linear(d, 1, bias=False)
        nn.init.zeros_(m.weight)
        return m

    def batch(n):
        x = torch.randn(n, d)
        return {"x": x, "y": x @ w_star + sigma * torch.randn(n)}

    return Workload(model=model, batch=batch, loss=lambda m, b: F.mse_loss(m(b["x"]).squeeze(-1), b["y"]),
                    optimizer=lambda p: torch.optim.SGD(p, lr=lr), name="linear-regression")


class FourierMixer(nn.Module):
    """FNet's token mixing in one layer: FFTs have no bf16 kernel (CUDA's neither), so its bf16 step raises."""

    def __init__(self, features: int = 16, classes: int = 4):
        super().__init__()
        self.inp, self.out = nn.Linear(features, features), nn.Linear(features, classes)

    def forward(self, x):
        return self.out(torch.fft.fft(self.inp(x)).real)


def fourier(features: int = 16, classes: int = 4) -> Workload:
    return Workload(model=lambda: FourierMixer(features, classes),
                    batch=lambda n: (torch.randn(n, features), torch.randint(0, classes, (n,))),
                    loss=classify, name="fourier")
