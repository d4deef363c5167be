"""The package's layering: one-way imports, no cycles, short functions; docstrings name only what exists."""
import ast
import builtins
import io
import re
import tokenize
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


# ------------------------------------------------------------------ names cited in docstrings
REPO = ROOT.parent
_ROLE = re.compile(r":(?:mod|func|class|meth|data|attr|obj|exc):`~?([^`]+)`")
_DOTTED = re.compile(r"(?<![\w/.])(vitp(?:\.[A-Za-z_]\w*)+)(?![\w/])")
_REPO_FILE = re.compile(r"(?<![\w.-])((?:vitp|tests|scripts|conf|docs)/[\w./-]*\.(?:py|md|yaml|json))\b")
_MD = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")
# cited by a file of the lead's TP-plan rewrite, which drops the citation: delete the entry then
def _strings(tree):
    """``(docstrings, other string literals)`` of ``tree``, in one walk."""
    docs, other = {}, []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs[id(first.value)] = first.value.value
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            other.append(node)
    return [d for d in docs.values() if isinstance(d, str)], {n.value for n in other if id(n) not in docs}


def _comments(path):
    return [t.string for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
            if t.type == tokenize.COMMENT]


_TOP = {}


def _top_names(tree):
    if id(tree) in _TOP:
        return _TOP[id(tree)]
    out = _TOP[id(tree)] = {}
    for node in tree.body:
        for n in ast.walk(node) if isinstance(node, (ast.If, ast.Try)) else [node]:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out[n.name] = n
            elif isinstance(n, (ast.Assign, ast.AnnAssign)):
                for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    out.update({x.id: None for x in ast.walk(t) if isinstance(x, ast.Name)})
                if (isinstance(n, ast.Assign) and [getattr(t, "id", None) for t in n.targets] == ["_EXPORTS"]
                        and isinstance(n.value, ast.Dict)):  # a package's lazy names (PEP 562): name -> ".module"
                    for k, v in zip(n.value.keys, n.value.values):
                        mod = v.value
                        imp = ast.ImportFrom(module=mod.lstrip("."), names=[ast.alias(name=k.value)],
                                             level=len(mod) - len(mod.lstrip(".")))
                        out[k.value] = (imp, imp.names[0])
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                out.update({(a.asname or a.name).split(".")[0]: (n, a) for a in n.names})
    return out


def _class_attrs(cls):
    out = set()
    for n in ast.walk(cls):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            out.add(n.attr)
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.add(n.target.id)
        elif isinstance(n, ast.Assign):
            out.update(t.id for t in n.targets if isinstance(t, ast.Name))
    return out


def _exists(dotted, hops=0):
    """``vitp.a.b.C.d``: a module, a name bound at its top level (imports followed), an attribute of a class."""
    parts = dotted.split(".")
    if parts[:2] == ["vitp", "conf"]:  # conf/ is installed as the vitp.conf package (pyproject.toml)
        return True
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name not in MODULES:
            continue
        rest = parts[i:]
        if not rest:
            return True
        _, tree, is_pkg = MODULES[name]
        node = _top_names(tree).get(rest[0], False)
        if isinstance(node, tuple) and isinstance(node[0], ast.ImportFrom) and hops < 5:
            imp, alias = node
            base = imp.module or ""
            if imp.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - imp.level + 1] + ([base] if base else []))
            return not base.startswith("vitp") or _exists(".".join([base, alias.name, *rest[1:]]), hops + 1)
        if isinstance(node, ast.ClassDef) and len(rest) > 1:
            return rest[1] in _class_attrs(node)
        return node is not False
    return False


def _role_exists(name, module, is_pkg, tree):
    name = name.split("<")[-1].rstrip(">").strip().rstrip("()")  # "title <target>" or "target"
    if name.startswith("vitp."):
        return _exists(name)
    if name.startswith("."):
        pkg = module.split(".") if is_pkg else module.split(".")[:-1]
        level = len(name) - len(name.lstrip("."))
        return _exists(".".join(pkg[: len(pkg) - level + 1] + [name.lstrip(".")]))
    first = name.split(".")[0]
    if hasattr(builtins, first) or (module.startswith("vitp") and _exists(f"{module}.{name}")):
        return True
    return first in _top_names(tree) or any(  # a method of a class here, or a name imported anywhere
        (isinstance(n, ast.ClassDef) and first in _class_attrs(n))
        or (isinstance(n, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name).split(".")[0] == first
                                                                 for a in n.names))
        for n in ast.walk(tree))


def test_docstrings_and_comments_name_only_what_exists():
    """Every ``vitp.x.y``, Sphinx role (``:func:`...``` etc.), repository path and ``*.md`` name in the
    comments and docstrings of ``vitp/`` and ``scripts/`` names a module, function, class, attribute
    or file that exists (a ``.md`` name may also be a file the code writes)."""
    files = [(p, *_module_of(p)) for p in sorted(ROOT.rglob("*.py")) + sorted((REPO / "scripts").rglob("*.py"))]
    trees = {p: MODULES[m][1] if m in MODULES else ast.parse(p.read_text()) for p, m, _ in files}
    strings = {p: _strings(t) for p, t in trees.items()}
    literals = set().union(*(lit for _, lit in strings.values()))  # file names the code writes, among others
    bad = []
    for path, module, is_pkg in files:
        where = path.relative_to(REPO).as_posix()
        for text in _comments(path) + strings[path][0]:
            bad += [f"{where}: {m}" for m in _ROLE.findall(text) if not _role_exists(m, module, is_pkg, trees[path])]
            bad += [f"{where}: {m}" for m in _DOTTED.findall(text) if not _exists(m)]
            bad += [f"{where}: {f}" for f in _REPO_FILE.findall(text) if not list(REPO.glob(f))]
            bad += [f"{where}: {f}" for f in _MD.findall(text)
                    if not (REPO / f).exists() and not any(f in s for s in literals)]
    assert sorted(set(bad)) == []


def _module_of(path):
    parts = path.relative_to(REPO).with_suffix("").parts
    is_pkg = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_pkg else parts), is_pkg


def test_safetensors_files_are_written_through_one_helper():
    """safetensors' ``save_file`` creates owner-only (0600) files that others on a shared file
    system cannot read; :func:`vitp.utils.save_safetensors` gives them the usual mode, so no other
    module calls ``save_file`` itself."""
    direct = sorted(n for n, (_, tree, _) in MODULES.items() if n != "vitp.utils" for node in ast.walk(tree)
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("safetensors")
                    and any(a.name == "save_file" for a in node.names))
    assert not direct, f"call vitp.utils.save_safetensors instead of safetensors' save_file in {direct}"
