"""Finding a workload by name: the built-ins (`memfit estimate gpt-7b` needs no user code) and user files.

The table maps each name to a factory taking keyword options; `builtin` checks the options against
the factory's signature so a typo (`--opt sqe=4096`) is reported instead of silently ignored.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Callable

from memfit.errors import first_line
from memfit.workload import Workload, WorkloadError
from memfit.workloads import demo as _demo
from memfit.workloads import gpt as _gpt
from memfit.workloads import moe as _moe
from memfit.workloads import vision as _vision
from memfit.workloads.lora import lora  # the function: memfit.workloads.lora(workload, r=16, ...)

_FACTORIES: dict[str, Callable[..., Workload]] = {
    **{name: functools.partial(_gpt.gpt, name) for name in [*_gpt.ALIASES, *_gpt.PRESETS]},
    "resnet": functools.partial(_vision.resnet, "resnet"),
    "resnet-tiny": functools.partial(_vision.resnet, "resnet-tiny"),
    "mlp": functools.partial(_vision.mlp, "mlp"),
    "mlp-tiny": functools.partial(_vision.mlp, "mlp-tiny"),
    "sort": _demo.sort_task,
    **{name: functools.partial(_moe.moe, name) for name in _moe.PRESETS},
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
            raise WorkloadError("hf: needs a model type, a config.json path or a cached Hub id, e.g. hf:llama, "
                                "hf:path/to/config.json or hf:openai/clip-vit-base-patch32")
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


def _hf_signature(*, seq=None, name=None, task=None, target_seq=None, image_size=None):  # mirrors hf.from_config's options
    """Only here so option checking for `hf:` names need not import transformers."""


def load_workload(spec: str | Workload, **options) -> Workload:
    """Find a workload: a `Workload` as is, a built-in name (`gpt-7b`, `resnet`, `mlp`, `hf:<config>`),
    or `path/to/job.py:function` (the function returns a `Workload`). `options` go to a built-in as its
    options, and to a workload function as keyword arguments (`memfit ... -o width=64` calls
    ``function(width=64)``). A job file's folder goes on `sys.path`, as `python job.py` puts it, so that
    modules beside it import."""
    if isinstance(spec, Workload):
        return spec
    if not (":" in spec and spec.split(":", 1)[0].endswith(".py")) and not spec.endswith(".py"):
        return builtin(spec, **options)
    path_s, _, fn_name = spec.partition(":")
    fn_name = fn_name or "workload"
    path = Path(path_s)
    if not path.is_file():
        raise WorkloadError(f"no such workload file: {path}")
    _importable(path.resolve().parent)
    module_name = f"memfit_user_{path.stem}"
    spec_obj = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec_obj)
    sys.modules[module_name] = module
    try:
        spec_obj.loader.exec_module(module)
    except Exception as e:
        raise WorkloadError(f"{path} raised while importing: {first_line(e)}") from e
    fn = getattr(module, fn_name, None)
    if fn is None:
        raise WorkloadError(f"{path} has no function {fn_name!r}")
    if not callable(fn):
        raise WorkloadError(f"{path}:{fn_name} is not a function returning a memfit.Workload")
    _check_keywords(fn, f"{path}:{fn_name}", options)
    try:
        wl = fn(**options)
    except Exception as e:
        raise WorkloadError(f"{path}:{fn_name}() raised: {first_line(e)}") from e
    if not isinstance(wl, Workload):
        raise WorkloadError(f"{path}:{fn_name}() returned {type(wl).__name__}, not a memfit.Workload")
    if wl.name == "workload":
        wl.name = f"{path.name}:{fn_name}"
    return wl


def _importable(folder: Path) -> None:
    """Put a job file's folder first on `sys.path`, once: `from helpers import x` beside the file works at
    its import and later (a function importing inside, a spawned DataLoader worker). Nothing else is added:
    not the working directory, which the `memfit` script does not put there. Forked tracing children inherit
    it, and every rank of `memfit train --gpus N` loads the file through here as well."""
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


def _check_keywords(fn: Callable, name: str, options: dict) -> None:
    """A keyword the function does not take (or a required argument not given) is one line naming the
    keywords it does take, before it is called."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a callable Python cannot look into: its own call says what is wrong
        return
    try:
        signature.bind(**options)
    except TypeError as e:
        takes = [p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        said = f"its keyword arguments: {', '.join(takes)}" if takes else "it takes no keyword arguments"
        raise WorkloadError(f"{name}() {e}; {said} (-o KEY=VALUE and --seq pass them)") from None


__all__ = ["BUILTIN_NAMES", "builtin", "load_workload", "lora"]
