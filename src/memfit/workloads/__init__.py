"""Built-in workloads, found by name: `memfit estimate gpt-7b` needs no user code.

The table maps each name to a factory taking keyword options; `builtin` checks the options against
the factory's signature so a typo (`--opt sqe=4096`) is reported instead of silently ignored.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

from memfit.workload import Workload, WorkloadError
from memfit.workloads import demo as _demo
from memfit.workloads import gpt as _gpt
from memfit.workloads import vision as _vision

_FACTORIES: dict[str, Callable[..., Workload]] = {
    **{name: functools.partial(_gpt.gpt, name) for name in [*_gpt.ALIASES, *_gpt.PRESETS]},
    "resnet": functools.partial(_vision.resnet, "resnet"),
    "resnet-tiny": functools.partial(_vision.resnet, "resnet-tiny"),
    "mlp": functools.partial(_vision.mlp, "mlp"),
    "mlp-tiny": functools.partial(_vision.mlp, "mlp-tiny"),
    "sort": _demo.sort_task,
}

BUILTIN_NAMES: tuple[str, ...] = (*_FACTORIES, "hf:<model_type|config.json>")


def _hf(spec: str, **options) -> Workload:
    from memfit.workloads import hf

    return hf.from_config(spec, **options)


def builtin(name: str, **options) -> Workload:
    """The built-in workload called `name`, shaped by `options` (e.g. seq=4096, layers=4)."""
    key = name.strip()
    if key.lower().startswith("hf:"):
        spec = key[3:]
        if not spec:
            raise WorkloadError("hf: needs a model type or a config.json path, e.g. hf:llama or hf:path/to/config.json")
        factory: Callable[..., Workload] = functools.partial(_hf, spec)
        factory_sig = inspect.signature(_hf_signature)
    else:
        key = key.lower()
        if key not in _FACTORIES:
            raise WorkloadError(f"unknown workload {name!r}; built-in: {', '.join(BUILTIN_NAMES)} "
                                "(a file workload is written path/to/job.py:function)")
        factory = _FACTORIES[key]
        factory_sig = inspect.signature(factory)
    accepted = [p.name for p in factory_sig.parameters.values() if p.kind == p.KEYWORD_ONLY
                or (p.kind == p.POSITIONAL_OR_KEYWORD and p.name not in ("name", "config"))]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise WorkloadError(f"{name} does not take option(s) {', '.join(unknown)}; it takes: "
                            f"{', '.join(accepted) or 'none'}")
    wl = factory(**options)
    if wl.name == "workload":
        wl.name = key
    return wl


def _hf_signature(*, seq=128, name=None, task=None, target_seq=None):  # mirrors hf.from_config's options
    """Only here so option checking for `hf:` names need not import transformers."""


__all__ = ["BUILTIN_NAMES", "builtin"]
