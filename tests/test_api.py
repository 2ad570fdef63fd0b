"""memfit's public surface: a few names, and one base class for every error memfit raises on purpose."""
from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import torch

import memfit
from memfit.strategies.pipeline_parallel import _Handoff

SRC = Path(__file__).resolve().parents[1] / "src" / "memfit"
# raised on purpose though not a MemfitError: Ctrl-C stays Ctrl-C, and the virtual budget's OOM is the one
# that OOM recovery and users' code already catch
# (and a module's __getattr__ must raise AttributeError for a name it lacks: Python's protocol)
ALLOWED = {KeyboardInterrupt: None, torch.OutOfMemoryError: "memfit.memory.tracker",
           AttributeError: "memfit.integrations.transformers",
           _Handoff: "memfit.strategies.pipeline_parallel"}  # control flow inside a stage's forward, caught there


def test_the_public_surface_is_small_and_importable():
    assert len(memfit.__all__) <= 14  # 12, and the serving and batch-size entry points with their result
    assert len(set(memfit.__all__)) == len(memfit.__all__)
    for name in memfit.__all__:
        assert getattr(memfit, name) is not None, name
    assert "TrainStep" not in memfit.__all__  # Trainer is the one public way to step


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.expr, namespace: dict):
    """The object a raise's `Name` or `a.b.C` names in the module's namespace; None for anything else (a
    local variable, e.g. an exception caught and raised again)."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    obj = namespace.get(node.id, getattr(builtins, node.id, None))
    if obj is None:
        return None
    for attr in reversed(chain):
        obj = getattr(obj, attr)
    return obj


def _raised_classes(path: Path) -> list[tuple[str, int, object]]:
    """(module, line, class) for every `raise SomeClass(...)` / `raise SomeClass` in the file; a call or name
    that is not a class at module level is reported as the expression's text, so it fails the check."""
    module = _module_name(path)
    namespace = vars(importlib.import_module(module))
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Raise) or node.exc is None:  # a bare `raise` re-raises
            continue
        exc = node.exc
        if isinstance(exc, ast.Call):
            cls = _resolve(exc.func, namespace)
            out.append((module, node.lineno, cls if isinstance(cls, type) else ast.unparse(exc.func)))
        else:
            cls = _resolve(exc, namespace)
            if isinstance(cls, type):
                out.append((module, node.lineno, cls))
            # else: a variable holding an exception instance, caught or built above: raised again as it is
    return out


def _not_memfit_errors(paths) -> list[str]:
    bad = []
    for path in paths:
        for module, line, cls in _raised_classes(path):
            if isinstance(cls, type) and issubclass(cls, memfit.MemfitError):
                continue
            if isinstance(cls, type) and cls in ALLOWED and ALLOWED[cls] in (None, module):
                continue
            bad.append(f"{module}:{line} raises {getattr(cls, '__name__', cls)}, not a MemfitError")
    return bad


def test_every_error_memfit_raises_is_a_memfit_error():
    bad = _not_memfit_errors(sorted(SRC.rglob("*.py")))
    assert not bad, "\n".join(bad)


def test_the_raise_check_sees_a_plain_value_error(tmp_path, monkeypatch):
    """Plant a `raise ValueError` in a copy of a module: the check must report it (and not a re-raise)."""
    planted = SRC / "units.py"
    copy = tmp_path / "memfit" / "units.py"
    copy.parent.mkdir()
    copy.write_text(planted.read_text() + "\n\ndef _f(e):\n    raise e\n\n\ndef _g():\n    raise ValueError('x')\n")
    monkeypatch.setitem(globals(), "SRC", tmp_path / "memfit")
    bad = _not_memfit_errors([copy])
    assert len(bad) == 1 and "raises ValueError" in bad[0]
