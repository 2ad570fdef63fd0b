"""A Llama-shaped decoder-only language model, sized by name (`gpt-tiny` ... `gpt-13b`).

Written out in plain torch (no transformers) so the built-in workloads need nothing beyond torch, and so
the shapes are exactly those of the published models: the parameter counts match Llama-2 / TinyLlama.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

from memfit.losses import chunked_cross_entropy, loss_chunks
from memfit.workload import Workload, WorkloadError

# ---------------------------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """The few numbers that decide a Llama-style model's memory."""

    layers: int
    d_model: int
    heads: int
    ffn: int
    vocab: int = 32000
    seq: int = 2048
    kv_heads: int | None = None  # None: as many as `heads` (no grouped-query attention)
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    def validate(self) -> GPTConfig:
        for field in ("layers", "d_model", "heads", "ffn", "vocab", "seq", "n_kv_heads"):
            if getattr(self, field) < 1:
                raise WorkloadError(f"gpt: {field} must be at least 1, got {getattr(self, field)}")
        if self.d_model % self.heads:
            raise WorkloadError(f"gpt: d_model {self.d_model} is not divisible by heads {self.heads}")
        if self.head_dim % 2:
            raise WorkloadError(f"gpt: the head size d_model/heads = {self.head_dim} must be even for rotary embedding")
        if self.heads % self.n_kv_heads:
            raise WorkloadError(f"gpt: heads {self.heads} is not a multiple of kv_heads {self.n_kv_heads}")
        return self


PRESETS: dict[str, GPTConfig] = {
    "gpt-tiny": GPTConfig(layers=2, d_model=64, heads=4, ffn=256, vocab=256, seq=64),
    "gpt-small": GPTConfig(layers=12, d_model=768, heads=12, ffn=2048, vocab=32000, seq=1024),
    # TinyLlama-1.1B: grouped-query attention with 4 key/value heads.
    "gpt-1b": GPTConfig(layers=22, d_model=2048, heads=32, kv_heads=4, ffn=5632, vocab=32000, seq=2048),
    # Llama-2-7B / 13B.
    "gpt-7b": GPTConfig(layers=32, d_model=4096, heads=32, ffn=11008, vocab=32000, seq=4096),
    "gpt-13b": GPTConfig(layers=40, d_model=5120, heads=40, ffn=13824, vocab=32000, seq=4096),
}
ALIASES = {"gpt": "gpt-small"}


def llama_ffn(d_model: int, multiple_of: int = 256) -> int:
    """Llama's SwiGLU width: 2/3 of 4*d, rounded up to a multiple of 256 (4096 -> 11008)."""
    hidden = int(2 * 4 * d_model / 3)
    return multiple_of * math.ceil(hidden / multiple_of)


# ---------------------------------------------------------------------------------------------- modules


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back, as Llama does (so bf16 runs stay stable)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary(seq: int, head_dim: int, theta: float, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq, head_dim), made on the fly from positions so that no large buffer
    sits in the model's state (they cost seq*head_dim per layer, tiny next to the activations)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=like.device, dtype=torch.float32) / head_dim))
    pos = torch.arange(seq, device=like.device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(like.dtype), emb.sin().to(like.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    """Causal self-attention with rotary positions and optional grouped-query key/value heads."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.n_kv_heads, cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(cfg.d_model, cfg.heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rotary(t, self.head_dim, self.rope_theta, q)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.kv_heads == self.heads:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn, bias=False)
        self.down_proj = nn.Linear(cfg.ffn, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder block. Takes and returns one tensor so wrappers (checkpointing, offload,
    pipelining) can treat every block alike."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab). The LM head is not tied to the embedding."""

    def __init__(self, cfg: GPTConfig):
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

    def get_output_embeddings(self) -> nn.Linear:
        """The LM head, found as on a transformers model (peft's wrappers pass the call through)."""
        return self.head


# ---------------------------------------------------------------------------------------------- workload


def next_token_loss(model: nn.Module, batch) -> torch.Tensor:
    """Mean cross entropy of predicting each next token; takes {"tokens"} or {"input", "target"}."""
    if "tokens" in batch:
        tokens = batch["tokens"]
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
    else:
        inputs, targets = batch["input"], batch["target"]
    if loss_chunks() > 1:
        return chunked_cross_entropy(lambda: model(inputs), model.get_output_embeddings(), targets)
    logits = model(inputs)
    # Upcast as Llama trainers do: with bf16 logits the softmax would lose the small probabilities.
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def config_for(name: str, *, seq=None, layers=None, d_model=None, heads=None, kv_heads=None, ffn=None,
               vocab=None) -> GPTConfig:
    """The preset's shape with any overrides. A new d_model keeps the preset's head size (so heads follow)
    and Llama's ffn rule, unless those are given too."""
    name = ALIASES.get(name, name)
    if name not in PRESETS:
        raise WorkloadError(f"unknown gpt size {name!r}; known: {', '.join([*PRESETS, *ALIASES])}")
    base = PRESETS[name]
    changes: dict = {}
    try:
        if d_model is not None:
            changes["d_model"] = int(d_model)
            if heads is None:
                if changes["d_model"] % base.head_dim:
                    raise WorkloadError(f"gpt: d_model {d_model} is not a multiple of the head size {base.head_dim}; "
                                        "give heads= too")
                changes["heads"] = changes["d_model"] // base.head_dim
            if ffn is None:
                changes["ffn"] = llama_ffn(changes["d_model"])
        if heads is not None:
            changes["heads"] = int(heads)
        if kv_heads is not None:
            changes["kv_heads"] = int(kv_heads)
        elif "heads" in changes and base.kv_heads is not None:
            # Keep the preset's grouping ratio where it still divides evenly.
            group = base.heads // base.n_kv_heads
            changes["kv_heads"] = changes["heads"] // group if changes["heads"] % group == 0 else None
        for key, value in (("seq", seq), ("layers", layers), ("ffn", ffn), ("vocab", vocab)):
            if value is not None:
                changes[key] = int(value)
    except (TypeError, ValueError) as e:
        raise WorkloadError(f"gpt: options must be whole numbers ({e})") from e
    return dataclasses.replace(base, **changes).validate()


def workload_from_config(cfg: GPTConfig, name: str) -> Workload:
    def model() -> nn.Module:
        return GPT(cfg)

    def batch(n: int):
        return {"tokens": torch.randint(0, cfg.vocab, (n, cfg.seq + 1))}

    def optimizer(params):
        return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1)

    return Workload(model=model, batch=batch, loss=next_token_loss, optimizer=optimizer, name=name)


def gpt(name: str = "gpt-small", *, seq=None, layers=None, d_model=None, heads=None, kv_heads=None, ffn=None,
        vocab=None) -> Workload:
    """A named Llama-shaped model; options override the preset's shape."""
    cfg = config_for(name, seq=seq, layers=layers, d_model=d_model, heads=heads, kv_heads=kv_heads, ffn=ffn,
                     vocab=vocab)
    return workload_from_config(cfg, ALIASES.get(name, name))
