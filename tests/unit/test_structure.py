"""The package's layering: one-way imports, no cycles, short functions."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "vitp"
MAX_LINES = 80


def _modules():
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = (path, ast.parse(path.read_text()), parts[-1] == "__init__")
    return out


def _imports(name, tree, is_pkg):
    """Absolute names of the vitp modules imported anywhere in ``tree`` (also inside functions)."""
    found = set()
    package = name if is_pkg else name.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}
    return {m for m in found if m == "vitp" or m.startswith("vitp.")}


MODULES = _modules()
GRAPH = {n: {m for m in _imports(n, t, p) if m in MODULES and m != n} for n, (_, t, p) in MODULES.items()}


def test_parallel_knows_no_model_data_or_trainer():
    bad = {n: sorted(m for m in deps if m.split(".")[1] in ("models", "data", "train", "pipeline", "checkpoint",
                                                            "eval", "cli", "objectives"))
           for n, deps in GRAPH.items() if n.startswith("vitp.parallel")}
    assert not {n: d for n, d in bad.items() if d}


def test_no_import_cycle_between_modules():
    # a package __init__ re-exporting its own modules is not a cycle; edges into a package's own
    # __init__ from inside it are dropped
    def deps(n):
        return {m for m in GRAPH[n] if not (n.startswith(m + ".") and MODULES[m][2])}

    state, cycles = {}, []

    def visit(n, stack):
        state[n] = 1
        for m in deps(n):
            if state.get(m) == 1:
                cycles.append(stack[stack.index(m):] + [m])
            elif m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in GRAPH:
        if n not in state:
            visit(n, [n])
    assert not cycles


@pytest.mark.parametrize("name", sorted(MODULES))
def test_functions_are_short(name):
    path, tree, _ = MODULES[name]
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > MAX_LINES]
    assert not long, f"{path}: {long}"
