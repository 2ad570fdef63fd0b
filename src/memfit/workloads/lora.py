"""LoRA on any workload: the base model frozen, low-rank adapters trained, optimizer state for the adapters only.

The adapters are peft's (`LoraConfig` + `get_peft_model`), so what is estimated is what a peft user trains.
peft is an optional extra, imported only when LoRA is asked for: `import memfit` works without it.
The options are spelled the same everywhere: `--lora r=16,alpha=32,targets=q_proj,v_proj` on the command line,
`lora(workload, r=16, alpha=32, targets=["q_proj", "v_proj"])` in Python.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Iterable

import torch

from memfit.workload import Workload, WorkloadError

MISSING = "LoRA needs peft, which is not installed: pip install 'memfit[hf]'"
ALL_LINEAR = "all-linear"  # peft's target for every Linear layer (a transformers model's output head excepted)
KEYS = ("r", "alpha", "targets", "dropout")


def parse_lora(text: str) -> dict:
    """`r=16,alpha=32,targets=q_proj,v_proj,dropout=0.05` -> keyword arguments of `lora`. A bare name after
    `targets=` is one more target; values are checked by `lora` itself."""
    options: dict = {}
    key = None
    for item in (part.strip() for part in text.split(",")):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep:
            if key != "targets" or not item:
                raise WorkloadError(f"--lora {text!r}: expected key=value items ({', '.join(KEYS)}), got {item!r}")
            options["targets"].append(item)
            continue
        if name not in KEYS:
            raise WorkloadError(f"--lora: unknown key {name!r}; keys: {', '.join(KEYS)}")
        if name in options:
            raise WorkloadError(f"--lora: {name} given twice")
        key = name
        options[name] = [value.strip()] if name == "targets" else value.strip()
    return options


def _number(name: str, value, kind: type, low: float, low_open: bool, high: float | None = None):
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise WorkloadError(f"lora: {name} must be a {'whole ' if kind is int else ''}number, got {value!r}") from None
    if kind is int and isinstance(value, float) and value != number:
        raise WorkloadError(f"lora: {name} must be a whole number, got {value!r}")
    if number < low or (low_open and number == low) or (high is not None and number >= high):
        bounds = f"{'>' if low_open else '>='} {low:g}" + (f" and < {high:g}" if high is not None else "")
        raise WorkloadError(f"lora: {name} must be {bounds}, got {value!r}")
    return number


@dataclasses.dataclass(frozen=True)
class LoraOptions:
    """What was asked for; None leaves peft's default (alpha 8; targets by architecture)."""
    r: int = 8
    alpha: float | None = None
    targets: tuple[str, ...] | None = None
    dropout: float = 0.0

    def describe(self) -> str:
        """The options in `--lora` syntax, for the workload's name (a resume checks it)."""
        parts = [f"r={self.r}"]
        if self.alpha is not None:
            parts.append(f"alpha={self.alpha:g}")
        if self.targets is not None:
            parts.append("targets=" + ",".join(self.targets))
        if self.dropout:
            parts.append(f"dropout={self.dropout:g}")
        return ",".join(parts)


def lora(workload: Workload, r: int = 8, alpha: float | None = None, targets: Iterable[str] | str | None = None,
         dropout: float = 0.0) -> Workload:
    """`workload` fine-tuned with LoRA: every weight of its model frozen, rank-`r` adapters (scaled by
    `alpha / r`) on the modules named in `targets`, which are the only parameters with gradients and
    optimizer state.

    Args:
        workload: any workload whose model is an nn.Module (a built-in, `hf:...`, a user's).
        r: the adapters' rank.
        alpha: LoRA's alpha (default: peft's, 8).
        targets: module names (the last part, e.g. ``["q_proj", "v_proj"]``) to adapt, or a comma-separated
            string; ``"all-linear"``: every Linear layer (peft's; a transformers model's output head
            excepted). Default: peft's choice for the transformers architecture (q_proj and v_proj for Llama,
            c_attn for GPT-2); a model that is not a transformers one must name them.
        dropout: dropout on the adapters' input (default 0: peft then adds no dropout at all).

    Example::

        wl = lora(builtin("hf:llama"), r=16, alpha=32, targets=["q_proj", "v_proj"])
        memfit.estimate(wl, Config(micro_batch=4)).model_state_bytes["optimizer_state"]
    """
    if isinstance(targets, str):
        targets = [t for t in (t.strip() for t in targets.split(",")) if t]
    if targets is not None:
        targets = tuple(str(t).strip() for t in targets)
        if not targets or not all(targets):
            raise WorkloadError("lora: targets must name at least one module, e.g. targets=q_proj,v_proj")
    options = LoraOptions(r=_number("r", r, int, 0, True),
                          alpha=None if alpha is None else _number("alpha", alpha, float, 0, True),
                          targets=targets, dropout=_number("dropout", dropout, float, 0, False, 1))
    _peft()  # the missing extra is said before anything is built
    base_model = workload.model

    def model() -> torch.nn.Module:
        return _wrap(base_model(), options)

    fewer = getattr(base_model, "with_blocks", None)

    def with_blocks(keep: int) -> torch.nn.Module | None:
        """The base's shallow copy (the planner's, built with fewer layers), adapted."""
        base = fewer(keep)
        return None if base is None else _wrap(base, options)

    if fewer is not None:
        model.with_blocks = with_blocks

    def optimizer(params):
        return workload.optimizer([p for p in params if p.requires_grad])

    return dataclasses.replace(workload, model=model, optimizer=optimizer,
                               name=f"{workload.name}+lora:{options.describe()}")


def _peft():
    try:
        import peft
    except ImportError:
        raise WorkloadError(MISSING) from None
    return peft


def _wrap(model: torch.nn.Module, options: LoraOptions) -> torch.nn.Module:
    """peft's LoRA model around `model`, every failure to match the options said in one line."""
    if not isinstance(model, torch.nn.Module):
        raise WorkloadError(f"lora: workload.model() returned {type(model).__name__}, not an nn.Module")
    peft = _peft()
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    listing = f"its Linear layers: {', '.join(linear) or 'none'}"
    if options.targets is not None and options.targets != (ALL_LINEAR,):
        names = [name for name, _ in model.named_modules()]  # peft matches a whole name or its dotted tail
        unknown = [t for t in options.targets if not any(n == t or n.endswith("." + t) for n in names)]
        if unknown:
            raise WorkloadError(f"lora: no module called {', '.join(unknown)} in {type(model).__name__}; {listing}")
    kwargs = {"r": options.r, "lora_dropout": options.dropout}
    if options.alpha is not None:
        kwargs["lora_alpha"] = options.alpha
    if options.targets is not None:
        kwargs["target_modules"] = ALL_LINEAR if options.targets == (ALL_LINEAR,) else list(options.targets)
    try:
        with warnings.catch_warnings():  # peft's notes to itself, not the user's: GPT-2's Conv1D is transposed,
            warnings.filterwarnings("ignore", message=".*fan_in_fan_out")  # and a transformers deprecation
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return peft.get_peft_model(model, peft.LoraConfig(**kwargs))
    except ValueError as e:
        if options.targets is None:
            raise WorkloadError(f"lora: peft has no default targets for {type(model).__name__}; name them "
                                f"(targets=a,b); {listing}") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise WorkloadError(f"lora: peft cannot adapt {type(model).__name__} as asked: {first}") from None


__all__ = ["KEYS", "LoraOptions", "lora", "parse_lora"]
