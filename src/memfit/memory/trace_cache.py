"""Traces kept on disk: a second plan of the same model (another budget, another batch) reads the probes and
estimates the first one traced instead of tracing them again.

A traced result is kept under a key made of everything it depends on: the function that traced it and its
arguments (the workload's code and what its closures hold, the configuration, the device's figures), the
source of memfit itself, the versions of torch, transformers and peft, and, for code of the user's own, the
.py files of its folder (a helper module beside a job file is part of the job). Anything the key cannot
describe for certain (an object of unknown kind in a closure, a dataset) makes the call uncacheable: it is
traced as before. Errors are not kept. MEMFIT_TRACE_CACHE=0 turns the cache off; it lives in
$MEMFIT_CACHE/traces (default ~/.cache/memfit/traces), entries unused for 30 days are removed.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import os
import pickle
import sys
import time
import types
from pathlib import Path
from typing import Callable

import torch

from memfit.memory.isolate import run_isolated_many

KEEP_SECONDS = 30 * 86400
_MEMFIT = Path(__file__).resolve().parents[1]


def enabled() -> bool:
    return os.environ.get("MEMFIT_TRACE_CACHE", "1") not in ("0", "off", "no", "false")


def folder() -> Path:
    return Path(os.environ.get("MEMFIT_CACHE", Path.home() / ".cache" / "memfit")) / "traces"


def run_cached_many(fns: list[Callable], workers: int | None = None,
                    on_done: Callable[[], None] | None = None) -> list[tuple[str, object]]:
    """`run_isolated_many`, with every call whose key can be made (a `functools.partial` of describable
    arguments) read from the cache when it is there and written to it when it succeeds."""
    keys = [key_of(fn) if enabled() else None for fn in fns]
    results: list = [_load(k) if k else None for k in keys]
    missing = [i for i, r in enumerate(results) if r is None]
    for _ in range(len(fns) - len(missing)):
        if on_done is not None:
            on_done()
    if missing:
        for i, result in zip(missing, run_isolated_many([fns[i] for i in missing], workers=workers,
                                                        on_done=on_done)):
            results[i] = result
            if keys[i] and result[0] == "ok":
                _store(keys[i], result)
    return results


def key_of(fn: Callable) -> str | None:
    """The cache key of a call, or None where something it depends on cannot be described."""
    if not isinstance(fn, functools.partial):
        return None
    described = _describe((fn.func, fn.args, fn.keywords), set())
    if described is None:
        return None
    return hashlib.sha256(repr((_environment(), described)).encode()).hexdigest()


def _load(key: str):
    path = folder() / f"{key}.pkl"
    try:
        with open(path, "rb") as f:
            result = pickle.load(f)
        os.utime(path)  # in use: kept
        return result
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError):
        return None  # absent, or written by another memfit: traced again


def _store(key: str, result) -> None:
    where = folder()
    try:
        where.mkdir(parents=True, exist_ok=True)
        part = where / f"{key}.{os.getpid()}.part"
        with open(part, "wb") as f:
            pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(part, where / f"{key}.pkl")  # whole or not at all, whoever reads it
        _prune(where)
    except (OSError, pickle.PicklingError, TypeError, AttributeError):
        return  # a full disk or an unpicklable result: the plan goes on without the cache


def _prune(where: Path) -> None:
    cutoff = time.time() - KEEP_SECONDS
    for path in where.glob("*.pkl"):
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
        except OSError:
            pass


@functools.cache
def _environment() -> tuple:
    """What every traced result depends on besides its arguments: memfit's own source, torch's version and
    those of the model libraries memfit traces through."""
    versions = [torch.__version__, sys.version_info[:2]]
    for name in ("transformers", "peft"):
        try:
            from importlib.metadata import version
            versions.append((name, version(name)))
        except Exception:  # noqa: BLE001 - not installed
            versions.append((name, None))
    return tuple(versions), _folder_hash(_MEMFIT, recursive=True)


@functools.cache
def _folder_hash(where: Path, recursive: bool = False) -> str:
    digest = hashlib.sha256()
    for path in sorted(where.rglob("*.py") if recursive else where.glob("*.py")):
        digest.update(str(path.relative_to(where)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _users_code(filename: str) -> bool:
    path = Path(filename).resolve()
    return path.is_file() and _MEMFIT not in path.parents and not any(
        part in ("site-packages", "dist-packages") for part in path.parts)


def _describe(obj, seen: set):
    """A plain, stable description of `obj` (None where it cannot be described for certain)."""
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, enum.Enum)):
        return repr(obj)
    if id(obj) in seen:  # a recursive closure: described once
        return "<seen>"
    seen = seen | {id(obj)}
    if isinstance(obj, (tuple, list)):
        parts = [_describe(x, seen) for x in obj]
        return None if None in parts else (type(obj).__name__, tuple(parts))
    if isinstance(obj, (dict, types.MappingProxyType)):
        parts = [(_describe(k, seen), _describe(v, seen)) for k, v in obj.items()]
        return None if any(None in p for p in parts) else ("dict", tuple(sorted(parts, key=repr)))
    if isinstance(obj, functools.partial):
        return _describe(("partial", obj.func, obj.args, obj.keywords), seen)
    if isinstance(obj, types.FunctionType):
        return _describe_function(obj, seen)
    if isinstance(obj, (type, types.BuiltinFunctionType, types.ModuleType)):
        return ("named", getattr(obj, "__module__", None), getattr(obj, "__qualname__", obj.__name__))
    if isinstance(obj, (torch.dtype, torch.device)):
        return repr(obj)
    if isinstance(obj, inspect.Parameter):  # a signature a workload keeps (which inputs a model takes)
        return _describe(("parameter", obj.name, str(obj.kind), obj.default, str(obj.annotation)), seen)
    if hasattr(obj, "to_json_string") and hasattr(obj, "model_type"):  # a transformers configuration
        return ("config", type(obj).__qualname__, obj.to_json_string(use_diff=False))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
        return _describe((type(obj).__module__, type(obj).__qualname__, fields), seen)
    return None


def _describe_function(fn: types.FunctionType, seen: set):
    code = fn.__code__
    cells = [_contents(c) for c in fn.__closure__ or ()]
    parts = [fn.__module__, fn.__qualname__, _describe_code(code), _describe(fn.__defaults__, seen),
             _describe(fn.__kwdefaults__, seen), _describe(tuple(cells), seen)]
    if _users_code(code.co_filename):  # the job file and the modules beside it
        parts.append(_folder_hash(Path(code.co_filename).resolve().parent))
    return None if None in parts else ("function", tuple(parts))


def _contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # a cell not yet filled
        return "<empty cell>"


def _describe_code(code: types.CodeType):
    consts = tuple(_describe_code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts)
    return (code.co_code.hex(), consts, code.co_names)
