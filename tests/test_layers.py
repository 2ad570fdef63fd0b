"""memfit's layers only look down, and no module reaches into another's private names.

The contract (docs/how-it-works.md, "The layers"): the user's contract at the bottom, then the techniques, the step,
the memory model, the planner, the reports, the runtime, the command. A module may import memfit modules of
its own layer or below; a cycle between modules is refused even inside one layer. Imports inside functions
count too: deferring an import hides a dependency, it does not remove it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "memfit"

# lowest first; a module's layer is the longest prefix listed here
LAYERS = [
    ("memfit.torch_internals", "memfit.errors", "memfit.units"),
    ("memfit.config", "memfit.workload", "memfit.losses"),
    ("memfit.workloads",),
    ("memfit.strategies",),
    ("memfit.step",),
    ("memfit.memory",),
    ("memfit.planner", "memfit.inference"),
    ("memfit.report",),
    ("memfit.runtime",),
    ("memfit.integrations",),  # other stacks' loops on top of the planner: nothing below imports them
    ("memfit.cli",),
]
EXEMPT = {"memfit", "memfit.__main__"}  # the package root re-exports the public API from every layer


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> int:
    if module == "memfit":  # the root re-exports every layer: importing it imports the top
        return len(LAYERS) - 1
    best, layer = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    if layer is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return layer


def _imports(source: str, module: str, is_package: bool = False) -> list[tuple[str, list[str], int]]:
    """(imported memfit module, names taken from it, line) for every import statement in `source`."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "memfit"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "memfit":
                continue
            names = [a.name for a in node.names]
            # `from memfit.x import y` where y is a submodule imports memfit.x.y
            subs = [n for n in names if (SRC.parent / (base + "." + n).replace(".", "/")).with_suffix(".py").exists()
                    or (SRC.parent / (base + "." + n).replace(".", "/") / "__init__.py").exists()]
            out += [(f"{base}.{n}", [], node.lineno) for n in subs]
            rest = [n for n in names if n not in subs]
            if rest:
                out.append((base, rest, node.lineno))
    return out


def _graph() -> dict[str, list[tuple[str, list[str], int]]]:
    return {_module_name(p): _imports(p.read_text(), _module_name(p), p.name == "__init__.py")
            for p in sorted(SRC.rglob("*.py"))}


def test_every_import_looks_down():
    bad = []
    for module, imports in _graph().items():
        if module in EXEMPT:
            continue
        for target, _, line in imports:
            if _layer(target) > _layer(module):
                bad.append(f"{module}:{line} imports {target} (a higher layer)")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = {m: {t for t, _, _ in imps if t != m} for m, imps in _graph().items() if m not in EXEMPT}
    # a package's __init__ importing its own submodules is how packages are built, not a cycle
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in graph.items()}
    state: dict[str, int] = {}
    cycles = []

    def visit(m, stack):
        state[m] = 1
        for t in edges.get(m, ()):
            if state.get(t) == 1:
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t in edges and state.get(t) is None:
                visit(t, stack + [t])
        state[m] = 2

    for m in edges:
        if state.get(m) is None:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_no_module_takes_another_modules_private_names():
    bad = [f"{module}:{line} takes {n} from {target}"
           for module, imports in _graph().items()
           for target, names, line in imports if target != module
           for n in names if n.startswith("_") and not n.startswith("__")]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_back_up_import():
    """The contract is only worth something if a violation is caught: plant one (in memory) and look."""
    module = "memfit.planner.search"
    imports = _imports("from memfit.runtime import run\nfrom ..memory.estimate import _traces\n", module)
    assert [t for t, _, _ in imports] == ["memfit.runtime.run", "memfit.memory.estimate"]
    assert _layer("memfit.runtime.run") > _layer(module)
    assert imports[1][1] == ["_traces"]
