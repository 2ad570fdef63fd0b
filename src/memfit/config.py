"""`Config`: every knob memfit turns for one training run, and nothing else."""
from __future__ import annotations

import dataclasses
import json

from memfit.errors import ConfigError

PRECISIONS = ("fp32", "bf16", "fp16", "bf16-pure")


@dataclasses.dataclass(frozen=True)
class Config:
    """How one optimizer step is executed.

    micro_batch  samples per forward/backward pass.
    grad_accum   micro-steps per optimizer step; the global batch is micro_batch * grad_accum.
    precision    fp32 | bf16 (bf16 autocast, fp32 params) | fp16 (fp16 autocast + dynamic loss
                 scaling) | bf16-pure (bf16 params, grads and optimizer state; no fp32 master copy).
    checkpoint   "none" | "all" | "selective" | k (every k-th repeated block) | [module names].
    offload_activations  saved activations live in host memory between forward and backward.
    offload_optimizer    optimizer state and optimizer step live on the host (ZeRO-Offload).
    """

    micro_batch: int = 1
    precision: str = "fp32"
    grad_accum: int = 1
    checkpoint: str | int | tuple[str, ...] = "none"
    offload_activations: bool = False
    offload_optimizer: bool = False

    def __post_init__(self):
        if not isinstance(self.micro_batch, int) or self.micro_batch < 1:
            raise ConfigError(f"micro_batch must be an integer >= 1, got {self.micro_batch!r}")
        if not isinstance(self.grad_accum, int) or self.grad_accum < 1:
            raise ConfigError(f"grad_accum must be an integer >= 1, got {self.grad_accum!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.offload_optimizer and self.precision == "fp16":
            raise ConfigError("fp16 loss scaling with offload_optimizer is not supported: use bf16 or bf16-pure")
        ck = self.checkpoint
        if isinstance(ck, list):
            object.__setattr__(self, "checkpoint", tuple(ck))
        elif isinstance(ck, bool) or not (
            ck in ("none", "all", "selective") or (isinstance(ck, int) and ck >= 1) or isinstance(ck, tuple)
        ):
            raise ConfigError(
                f"checkpoint must be 'none', 'all', 'selective', an integer k >= 1 or a list of module names, got {ck!r}"
            )

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if isinstance(d["checkpoint"], tuple):
            d["checkpoint"] = list(d["checkpoint"])
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ConfigError(f"unknown Config field(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    @classmethod
    def from_json(cls, text: str) -> "Config":
        return cls.from_dict(json.loads(text))
