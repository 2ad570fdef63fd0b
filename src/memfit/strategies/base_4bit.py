"""4-bit base weights (QLoRA): every frozen Linear layer's weight stored as 4-bit NormalFloat codes.

The layout is bitsandbytes' ``nf4`` with double quantization, QLoRA's setting: two 4-bit codes a byte; one
absmax per block of 64 weights, itself stored in 8 bits (its mean subtracted, one fp32 scale per 256
absmaxes): 0.516 bytes a weight instead of 2 in bf16. The codes index the 16 NF4 levels, the quantiles of a
normal distribution (QLoRA, Dettmers et al. 2023, appendix E), computed here from their definition.

A layer's forward makes its weight in the compute dtype (bf16 under bf16 or bf16-pure, else the input's),
multiplies, and lets the weight go; backward makes it again for the input's gradient and keeps nothing else:
bitsandbytes' ``Linear4bit`` and ``MatMul4Bit`` do the same, and cast the output back to the input's dtype
as here. The weight is made CHUNK weights at a time, so the temporaries beyond the weight itself stay under
about 30 MiB. The output head (``get_output_embeddings``) is left as it is, as transformers' quantized
loading leaves it.

This changes the math (each base weight is rounded to one of 16 levels of its block's scale): memfit uses
it only when asked (`Config.base_4bit`; the planner's ``allow=("qlora",)``) and says so wherever it is
used. It is plain PyTorch, so it runs, and is traced, on any device; bitsandbytes' CUDA kernel holds the
same bytes (its dequantization needs no temporaries beyond the weight).
"""
from __future__ import annotations

import torch

from memfit.errors import ConfigError
from memfit.strategies import optimizer_8bit

BLOCK = 64              # weights sharing one absmax
ABSMAX_BLOCK = optimizer_8bit.BLOCK   # absmaxes sharing one fp32 scale (256): the 8-bit states' quantizer
CHUNK = 1 << 21         # weights made at once (a multiple of BLOCK)
NF4_OFFSET = 0.9677083  # QLoRA's: the outermost quantile, so that the levels reach exactly -1 and 1


def nf4_levels() -> torch.Tensor:
    """The 16 NF4 levels in fp32, ascending: 8 quantiles of N(0, 1) for positive values, 7 for negative ones,
    and an exact zero, scaled to [-1, 1]."""
    ndtri = torch.special.ndtri
    positive = ndtri(torch.linspace(NF4_OFFSET, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -ndtri(torch.linspace(NF4_OFFSET, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([negative, torch.zeros(1, dtype=torch.float64), positive]).sort().values
    return (levels / levels.max()).float()


LEVELS = nf4_levels()
# a byte's two codes (high nibble first) -> their two levels: one lookup a byte. Numbers, not a tensor: a
# tensor made at import would be memory that no step's state holds.
PAIRS = torch.stack([LEVELS.repeat_interleave(16), LEVELS.repeat(16)], dim=1).tolist()


def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """A weight -> its stored form: ``codes`` (uint8, two a byte), ``absmax`` (int8 codes of the absmaxes
    less their mean), ``absmax_scale`` and ``absmax_mean`` (fp32, kept as their int32 bits so that a cast of
    the model to bf16 leaves them exact)."""
    flat = weight.detach().reshape(-1).float()
    pad = (-flat.numel()) % BLOCK
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, BLOCK)
    absmax = blocks.abs().amax(dim=1)
    normed = blocks / absmax.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
    codes = torch.bucketize(normed, (LEVELS[1:] + LEVELS[:-1]).to(normed.device) / 2).to(torch.uint8).view(-1, 2)
    packed = codes[:, 0].mul(16).add_(codes[:, 1])
    mean = absmax.mean()
    absmax_codes, scale = optimizer_8bit.quantize(absmax - mean, torch.int8)
    return dict(codes=packed, absmax=absmax_codes, absmax_scale=scale.view(torch.int32),
                absmax_mean=mean.reshape(1).view(torch.int32))


class _Matmul(torch.autograd.Function):
    """x @ W.T + b with W made from its codes in forward and again in backward: nothing saved for W."""

    @staticmethod
    def forward(ctx, x, layer):
        ctx.layer = layer
        weight = layer.dequantize(x.dtype)
        bias = None if layer.bias is None else layer.bias.to(x.dtype)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        return grad @ ctx.layer.dequantize(grad.dtype), None


class Linear4bit(torch.nn.Module):
    """A frozen Linear layer whose weight is stored in NF4 (see the module's docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = compute_dtype
        # frozen parameters, not buffers: FSDP2 shards a module's parameters only (as it shards torchao's NF4
        # weights in torchtune's QLoRA), and gathers these in bytes beside the unit's other dtypes
        for name, value in quantize(weight).items():
            setattr(self, name, torch.nn.Parameter(value, requires_grad=False))
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype`, (out_features, in_features)."""
        n = self.out_features * self.in_features
        absmax = optimizer_8bit.dequantize(self.absmax, self.absmax_scale.view(torch.float32))
        absmax += self.absmax_mean.view(torch.float32)
        pairs = torch.tensor(PAIRS, device=self.codes.device)
        out = torch.empty(n, dtype=dtype, device=self.codes.device)
        tracer, whole = optimizer_8bit.TRACER.get(), n // CHUNK  # the first `whole` chunks are alike: CHUNK weights each
        once = tracer is not None and whole > 1  # traced: the first of them stands for all
        first = tracer.ops_recorded() if once else None
        for start in [0, *range(whole * CHUNK, n, CHUNK)] if once else range(0, n, CHUNK):
            end = min(start + CHUNK, 2 * self.codes.numel())  # whole blocks: the last one padded
            values = pairs[self.codes[start // 2:end // 2].int()].view(-1, BLOCK)
            values.mul_(absmax[start // BLOCK:end // BLOCK, None])
            out[start:min(end, n)] = values.view(-1)[:min(end, n) - start]
            del values
            if once and start == 0:
                tracer.repeat_ops(first, whole - 1)
        return out.view(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Matmul.apply(x.to(self.compute_dtype or x.dtype), self).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nf4"


STORED = ("codes", "absmax", "absmax_scale", "absmax_mean")

def weight_count(model: torch.nn.Module) -> int:
    """The weights `model` stands for: its parameters, a 4-bit layer's counted as its out x in weights rather
    than as the bytes that store them."""
    layers = [m for m in model.modules() if isinstance(m, Linear4bit)]
    stored = {id(getattr(m, name)) for m in layers for name in STORED}
    params = {id(p): p for p in model.parameters() if id(p) not in stored}
    return sum(p.numel() for p in params.values()) + sum(m.out_features * m.in_features for m in layers)


def _weight_of(module: torch.nn.Module) -> torch.Tensor | None:
    """The (out, in) weight of a Linear layer, or of transformers' Conv1D (GPT-2's, stored transposed)."""
    if isinstance(module, torch.nn.Linear):
        return module.weight
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
        return module.weight.t()
    return None


def frozen_linears(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """(parent, attribute, layer) of every Linear layer with no trainable parameter, the output head excepted."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is not head and _weight_of(child) is not None and \
                    not any(p.requires_grad for p in child.parameters()):
                found.append((parent, name, child))
    return found


def check_base_4bit(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str, torch.nn.Module]]:
    """The layers `apply_base_4bit` will quantize; a model with none is refused before anything changes."""
    found = frozen_linears(model)
    if not found:
        raise ConfigError("4-bit base weights quantize the frozen Linear layers of a LoRA model, and "
                          f"{type(model).__name__} has none: add --lora")
    return found


COMPUTE = {"bf16": torch.bfloat16, "bf16-pure": torch.bfloat16, "fp16": torch.float16}


def apply_base_4bit(model: torch.nn.Module, layers: list[tuple[torch.nn.Module, str, torch.nn.Module]],
                    precision: str, device: torch.device) -> None:
    """Replace each of `layers` (from `check_base_4bit`) by its Linear4bit on `device`, freeing its weight, then
    move the rest of `model` there. A GPU model is built on the host (TrainStep), so that only one layer's
    weight at a time is on the GPU unquantized, as transformers loads a 4-bit model."""
    while layers:  # each original layer let go as soon as it is replaced
        parent, name, child = layers.pop()
        bias = None if child.bias is None else child.bias.to(device)
        setattr(parent, name, Linear4bit(_weight_of(child).to(device), bias, COMPUTE.get(precision)))
    if device.type != "cpu":
        model.to(device)


__all__ = ["Linear4bit", "apply_base_4bit", "check_base_4bit", "nf4_levels", "weight_count"]
