"""A Llama-shaped mixture-of-experts language model (`moe-tiny`, `moe`): each block's feed-forward is E
SwiGLU experts, and a router sends every token to its top-k of them (Mixtral's layout, top-2 of 8).

The experts are dispatched the "dropless" way DeepSeek's and MegaBlocks-style code does it: token choices
sorted by expert, counted with `bincount`, the counts read to the host (`.tolist()`) and the sorted tokens
`split` into one slice per expert. How big each slice is depends on the router's values, so fake tensors
alone cannot follow this model: it is the built-in test of memory/routing.py.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from memfit.workload import Workload, WorkloadError
from memfit.workloads.gpt import Attention, GPTConfig, RMSNorm, SwiGLU, next_token_loss


@dataclasses.dataclass(frozen=True)
class MoEConfig(GPTConfig):
    """GPTConfig's shape with `experts` SwiGLU experts of width `ffn` per block, `top_k` of them per token."""

    experts: int = 8
    top_k: int = 2

    def validate(self) -> MoEConfig:
        super().validate()
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise WorkloadError(f"moe: need 1 <= top_k <= experts, got top_k {self.top_k} of {self.experts} experts")
        return self


PRESETS: dict[str, MoEConfig] = {
    "moe-tiny": MoEConfig(layers=2, d_model=64, heads=4, ffn=128, vocab=256, seq=64),
    "moe": MoEConfig(layers=8, d_model=512, heads=8, ffn=1536, vocab=32000, seq=1024),
}


class SparseMoE(nn.Module):
    """Top-k routing over `experts` SwiGLU experts; the router's weights of the chosen k are renormalised
    to sum to 1 (Mixtral)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg) for _ in range(cfg.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, choice = self.router(x).float().softmax(-1).topk(self.top_k, dim=-1)  # (tokens, k)
        weights = weights / weights.sum(-1, keepdim=True)
        flat = choice.reshape(-1)
        order = flat.argsort(stable=True)  # token choices grouped by expert, tokens in order within each
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token = order // self.top_k
        routed = x.index_select(0, token).split(counts)
        y = torch.cat([expert(part) for expert, part in zip(self.experts, routed)])
        y = y.to(x.dtype) * weights.reshape(-1, 1).index_select(0, order).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y).reshape(shape)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.attn = Attention(cfg)
        self.moe_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.moe = SparseMoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class MoEGPT(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.d_model, cfg.eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def moe(name: str = "moe", *, seq=None, layers=None, d_model=None, heads=None, ffn=None, experts=None, top_k=None,
        vocab=None) -> Workload:
    """A named MoE preset; options override its shape (`-o experts=16 -o top_k=4`)."""
    changes = {k: v for k, v in dict(seq=seq, layers=layers, d_model=d_model, heads=heads, ffn=ffn, experts=experts,
                                     top_k=top_k, vocab=vocab).items() if v is not None}
    try:
        cfg = dataclasses.replace(PRESETS[name], **{k: int(v) for k, v in changes.items()}).validate()
    except (TypeError, ValueError) as e:
        raise WorkloadError(f"moe: options must be whole numbers ({e})") from e

    def batch(n: int):
        return {"tokens": torch.randint(0, cfg.vocab, (n, cfg.seq + 1))}

    def optimizer(params):
        return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1)

    return Workload(model=lambda: MoEGPT(cfg), batch=batch, loss=next_token_loss, optimizer=optimizer, name=name)
