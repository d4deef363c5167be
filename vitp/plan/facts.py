"""What the planner reads of a model, kept on disk so that planning it again needs no torch.

The planner's numbers come from the model itself (:mod:`vitp.plan.shapes`): each layer built on the
``meta`` device (parameter names and counts), its parallel plan described on those layers
(:func:`vitp.parallel.describe_plan`: which parameters a TP rank holds a slice of, and each stage's
collective-issuing modules with their sizes) and DeepSpeed's partition of the layers into pipeline
stages. Building them imports torch, timm and DeepSpeed, which is most of a plan's time (about 3 s
of the 5 s of ``vitp-plan --gpus 8`` on a 2-core machine). What they yield is plain data, kept here
as one JSON file per model config in ``$VITP_CACHE_DIR/plan`` (default ``~/.cache/vitp/plan``); a
later plan of the same model reads it and imports no torch (the styles whose collectives it
evaluates, :mod:`vitp.parallel.styles`, are torch-free to import). The files are keyed by a digest
of vitp's source and the torch, timm and DeepSpeed versions, so a changed model, plan or partition
is computed again, never read stale. A missing, unreadable or foreign file is computed again; an
unwritable folder only costs the speed.

``VITP_PLAN_CACHE=0`` turns the files off (every plan builds the model again).
"""
from __future__ import annotations

import atexit
import hashlib
import importlib
import json
import logging
import os
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

log = logging.getLogger("vitp")

FORMAT = 1  # bump when the stored layout changes


def enabled() -> bool:
    """Whether the files are read and written (``VITP_PLAN_CACHE`` unset or not ``0``)."""
    return os.environ.get("VITP_PLAN_CACHE", "1") != "0"


def cache_dir() -> Path:
    """``$VITP_CACHE_DIR/plan``, else ``~/.cache/vitp/plan``."""
    root = os.environ.get("VITP_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "vitp")
    return Path(root) / "plan"


_DIGEST: List[str] = []


def code_digest() -> str:
    """SHA-256 of every ``vitp/**/*.py`` file (path and bytes) and the torch, timm and DeepSpeed
    versions (their metadata, not their import): what the facts are computed from."""
    if not _DIGEST:
        from importlib.metadata import PackageNotFoundError, version

        h = hashlib.sha256(f"format {FORMAT}".encode())
        root = Path(__file__).resolve().parents[1]
        for p in sorted(root.rglob("*.py")):
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
        for dist in ("torch", "timm", "deepspeed"):
            try:
                h.update(f"{dist}={version(dist)}".encode())
            except PackageNotFoundError:
                h.update(f"{dist}=none".encode())
        _DIGEST.append(h.hexdigest())
    return _DIGEST[0]


# --- styles as data -------------------------------------------------------------------------------


def _plain(v: Any) -> bool:
    return isinstance(v, (str, int, float, bool, type(None))) or (
        isinstance(v, (list, tuple)) and all(_plain(x) for x in v))


def style_record(style: Any) -> Dict[str, Any]:
    """``{"cls": "module:qualname", "fields": {...}}`` of a parallel style (a frozen dataclass):
    its plain fields (callables, which only :meth:`vitp.parallel.styles.ParallelStyle.apply` uses, keep their defaults on rebuild)."""
    cls = type(style)
    kept = {f.name: getattr(style, f.name) for f in fields(style) if f.init and _plain(getattr(style, f.name))}
    return {"cls": f"{cls.__module__}:{cls.__qualname__}", "fields": kept}


def style_of(record: Dict[str, Any]) -> Any:
    """The style a :func:`style_record` describes (its module imported: torch only where that
    module needs it)."""
    module, qualname = record["cls"].split(":")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not is_dataclass(cls):
        raise TypeError(f"{record['cls']} is not a dataclass style")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in record["fields"].items()})


# --- one model's facts ----------------------------------------------------------------------------


class ModelFacts:
    """The stored facts of one model config (``frozen``: :func:`vitp.plan.shapes._frozen`), read
    from its file and extended in memory as the planner asks; written back at exit (:func:`flush`)."""

    def __init__(self, frozen: Tuple) -> None:
        self.key = hashlib.sha256(repr(frozen).encode()).hexdigest()[:32]
        self.path = cache_dir() / f"{self.key}.json"
        self.data: Dict[str, Any] = {}
        self.dirty = False
        self._styles: Dict[int, Any] = {}
        if enabled():
            self.data = _read(self.path, repr(frozen))
        self.data.setdefault("model", repr(frozen))
        self.data.setdefault("entries", {})

    def get(self, name: str, compute: Callable[[], Any]) -> Any:
        """The entry ``name``, computed by ``compute()`` (JSON-able) and kept when absent."""
        entries = self.data["entries"]
        if name not in entries:
            entries[name] = compute()
            self.dirty = True
            _PENDING[self.key] = self
        return entries[name]

    def style(self, index: int) -> Any:
        """Style ``index`` of this file's table, one object per index (the planner groups by identity)."""
        if index not in self._styles:
            self._styles[index] = style_of(self.data["styles"][index])
        return self._styles[index]

    def style_index(self, style: Any) -> int:
        """The index of ``style`` in this file's table (appended when new)."""
        table = self.data.setdefault("styles", [])
        rec = style_record(style)
        if rec not in table:
            table.append(rec)
            self.dirty = True
            _PENDING[self.key] = self
        return table.index(rec)

    def flush(self) -> None:
        """Write the file if anything was added (atomically: a reader sees the old or the new file)."""
        if not (self.dirty and enabled()):
            return
        from vitp.utils import atomic_write_text

        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps({"digest": code_digest(), **self.data}, separators=(",", ":")))
            self.dirty = False
        except OSError as e:  # a read-only home: planning still works, only slower next time
            log.debug("plan facts not written to %s: %s", self.path, e)


def _read(path: Path, model: str) -> Dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("digest") != code_digest() or data.get("model") != model:
        return {}  # another vitp / torch / timm / DeepSpeed, or a hash collision: computed again
    data.pop("digest")
    return data


_FACTS: Dict[Tuple, ModelFacts] = {}
_PENDING: Dict[str, ModelFacts] = {}


def facts_of(frozen: Tuple) -> ModelFacts:
    """The :class:`ModelFacts` of a model config (one object per config and process)."""
    out = _FACTS.get(frozen)
    if out is None:
        out = _FACTS[frozen] = ModelFacts(frozen)
    return out


def flush() -> None:
    """Write every file with new entries (also run at interpreter exit)."""
    for f in list(_PENDING.values()):
        f.flush()
    _PENDING.clear()


atexit.register(flush)


def reset() -> None:
    """Forget the facts held in memory (tests: the next read goes to the files)."""
    flush()
    _FACTS.clear()


# --- report encoding ------------------------------------------------------------------------------


def encode_report(facts: ModelFacts, report: Any, with_params: bool) -> Dict[str, Any]:
    """A :class:`vitp.parallel.PlanReport` as data: plan, mode, axes, partial-gradient elements,
    its ``(style, sizes, n)`` groups (styles by index into ``facts``' table) and, with
    ``with_params``, its parameter roles."""
    out = {"plan": report.plan, "mode": report.mode, "axes": list(report.axes),
           "partial_grad_elements": report.partial_grad_elements,
           "groups": [[facts.style_index(style), list(sizes.items()), n] for style, sizes, n in report._groups()]}
    if with_params:
        out["params"] = report.params
    return out


def decode_report(facts: ModelFacts, rec: Dict[str, Any]) -> Any:
    """The :class:`vitp.parallel.report.PlanReport` of :func:`encode_report`'s record (no rows:
    the planner reads its collectives and roles, ``vitp-plan --show-plan`` the full report)."""
    from vitp.parallel.report import PlanReport

    sizes: List[Tuple[Any, Dict[str, Any]]] = []
    for index, items, n in rec["groups"]:
        entry = (facts.style(index), {k: v for k, v in items})
        sizes += [entry] * n
    return PlanReport(rec["plan"], rec["mode"], params=dict(rec.get("params", {})),
                      partial_grad_elements=rec["partial_grad_elements"], axes=tuple(rec["axes"]), _sizes=sizes)


# --- stage partitions (one file for all models: they depend on depth and pp only) -------------------

_RANGES: Optional[ModelFacts] = None


def stage_ranges(depth: int, pp: int, compute: Callable[[], List[Tuple[int, int]]]) -> List[Tuple[int, int]]:
    """``compute()`` (DeepSpeed's partition of ``depth`` blocks into ``pp`` stages), kept on disk."""
    global _RANGES
    if _RANGES is None:
        _RANGES = facts_of(("stage_ranges",))
    return [tuple(r) for r in _RANGES.get(f"{depth}/{pp}", lambda: [list(r) for r in compute()])]
