"""What the planner reads of a model, kept on disk so that planning it again needs no torch.

The planner's numbers come from the model itself (:mod:`vitp.plan.shapes`): each layer's
parameter names and counts, its parallel plan described on those layers
(:func:`vitp.parallel.describe_plan`: which parameters a TP rank holds a slice of, and each stage's
collective-issuing modules with their sizes) and DeepSpeed's partition of the layers into pipeline
stages. For vitp's generator they are computed by arithmetic (:mod:`vitp.plan.arith`); for another
model (Wan) they are read off its layers built on the ``meta`` device, which imports torch and timm
(about 4.5 s on a 2-core machine, most of such a plan's time). What they yield is plain data, kept here
as one JSON file per model config in ``$VITP_CACHE_DIR/plan/<digest>`` (default
``~/.cache/vitp/plan/<digest>``); a later plan of the same model reads it and imports no torch (the
styles whose collectives it evaluates, :mod:`vitp.parallel.styles`, are torch-free to import). The
digest covers vitp's source and the torch, timm and DeepSpeed versions, so a changed model, plan or
partition is computed again, never read stale; facts computed by a process whose source changed
while it ran are not written. A missing, unreadable, malformed or foreign file is computed again;
an unwritable folder only costs the speed. Processes sharing a file merge their entries.

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
from typing import Any, Callable, Dict, List, Tuple

log = logging.getLogger("vitp")

FORMAT = 1  # bump when the stored layout changes


def enabled() -> bool:
    """Whether the files are read and written (``VITP_PLAN_CACHE`` unset or not ``0``)."""
    return os.environ.get("VITP_PLAN_CACHE", "1") != "0"


def cache_dir() -> Path:
    """``$VITP_CACHE_DIR/plan``, else ``~/.cache/vitp/plan`` (absolute: resolved when asked)."""
    root = os.environ.get("VITP_CACHE_DIR") or os.path.join("~", ".cache", "vitp")
    return Path(root).expanduser().resolve() / "plan"


_DIGEST: List[str] = []


def code_digest(fresh: bool = False) -> str:
    """SHA-256 of every ``vitp/**/*.py`` file (path and bytes) and the torch, timm and DeepSpeed
    versions (their metadata, not their import): what the facts are computed from. Computed once
    per process, or again with ``fresh``."""
    if fresh or not _DIGEST:
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
        if not fresh:
            _DIGEST.append(h.hexdigest())
        return h.hexdigest()
    return _DIGEST[0]


# --- styles as data -------------------------------------------------------------------------------


def _plain(v: Any) -> bool:
    return type(v) in (str, int, float, bool, type(None)) or (
        type(v) in (list, tuple) and all(_plain(x) for x in v))


def style_record(style: Any) -> Dict[str, Any]:
    """``{"cls": "module:qualname", "fields": {...}}`` of a parallel style (a frozen dataclass), as
    JSON reads it back (tuples as lists). Fields marked ``metadata={"apply_only": True}`` (callables
    only :meth:`vitp.parallel.styles.ParallelStyle.apply` uses) keep their defaults on rebuild.

    Raises ``TypeError`` for another field that is not plain data (it could not be rebuilt)."""
    cls = type(style)
    kept = {}
    for f in fields(style):
        if not f.init or f.metadata.get("apply_only"):
            continue
        value = getattr(style, f.name)
        if not _plain(value):
            raise TypeError(f"{cls.__qualname__}.{f.name}={value!r}: the planner keeps a style's fields as data; "
                            "make it plain (str, int, float, bool, None, lists of them) or mark it "
                            "metadata={'apply_only': True} if only apply() reads it")
        kept[f.name] = value
    return json.loads(json.dumps({"cls": f"{cls.__module__}:{cls.__qualname__}", "fields": kept}))


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
        self.model = repr(frozen)
        self.on = enabled()
        self.digest = code_digest() if self.on else ""
        self.path = cache_dir() / self.digest[:24] / f"{hashlib.sha256(self.model.encode()).hexdigest()[:32]}.json"
        self.entries: Dict[str, Any] = _read(self.path, self.model, self.digest) if self.on else {}
        self.new: Dict[str, Any] = {}
        self._styles: Dict[str, Any] = {}

    def get(self, name: str, compute: Callable[[], Any], decode: Callable[[Any], Any] = lambda x: x) -> Any:
        """``decode(entry)`` of the entry ``name``; computed by ``compute()`` (JSON-able) and kept
        when absent, or when the stored entry does not decode (a hand-edited file)."""
        if name in self.entries:
            try:
                return decode(self.entries[name])
            except (KeyError, IndexError, TypeError, ValueError, AttributeError, ImportError):
                log.debug("plan facts %s: entry %s unreadable, computed again", self.path, name)
        value = json.loads(json.dumps(compute()))  # as it reads back
        self.entries[name] = self.new[name] = value
        _PENDING[id(self)] = self
        return decode(value)

    def style(self, record: Dict[str, Any]) -> Any:
        """The style of a :func:`style_record`, one object per record (reports group by identity)."""
        key = json.dumps(record, sort_keys=True)
        if key not in self._styles:
            self._styles[key] = style_of(record)
        return self._styles[key]

    def flush(self) -> None:
        """Write the new entries, merged with the file as it is now (other processes may have added
        theirs), atomically; nothing when vitp's source changed since they were computed."""
        if not (self.new and self.on):
            return
        from vitp.utils import atomic_write_text

        if code_digest(fresh=True) != self.digest:  # computed by code that is no longer there
            log.debug("plan facts %s not written: vitp's source changed while planning", self.path)
            self.new = {}
            return
        try:
            entries = {**_read(self.path, self.model, self.digest), **self.new}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps({"digest": self.digest, "model": self.model, "entries": entries,
                                                     "sha256": _checksum(entries)}, separators=(",", ":")))
            self.new = {}
        except OSError as e:  # a read-only home: planning still works, only slower next time
            log.debug("plan facts not written to %s: %s", self.path, e)


def _checksum(entries: Dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _read(path: Path, model: str, digest: str) -> Dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if (not isinstance(data, dict) or data.get("digest") != digest or data.get("model") != model
            or not isinstance(data.get("entries"), dict) or data.get("sha256") != _checksum(data["entries"])):
        return {}  # another vitp / torch / timm / DeepSpeed, a hash collision, edited: computed again
    return data["entries"]


_FACTS: Dict[Tuple, ModelFacts] = {}
_PENDING: Dict[int, ModelFacts] = {}


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
    """Write what is new and forget the facts held in memory (tests: the next read goes to the
    files, with the cache folder and ``VITP_PLAN_CACHE`` as they are then)."""
    flush()
    _FACTS.clear()


# --- report encoding ------------------------------------------------------------------------------


def encode_report(report: Any, with_params: bool) -> Dict[str, Any]:
    """A :class:`vitp.parallel.report.PlanReport` as data: plan, mode, axes, partial-gradient
    elements, its ``(style, sizes, n)`` groups (styles as :func:`style_record`) and, with
    ``with_params``, its parameter roles."""
    out = {"plan": report.plan, "mode": report.mode, "axes": list(report.axes),
           "partial_grad_elements": report.partial_grad_elements,
           "groups": [[style_record(style), list(sizes.items()), n] for style, sizes, n in report._groups()]}
    if with_params:
        out["params"] = report.params
    return out


def decode_report(facts: ModelFacts, rec: Dict[str, Any]) -> Any:
    """The :class:`vitp.parallel.report.PlanReport` of :func:`encode_report`'s record (no rows:
    the planner reads its collectives and roles, ``vitp-plan --show-plan`` the full report)."""
    from vitp.parallel.report import PlanReport

    sizes: List[Tuple[Any, Dict[str, Any]]] = []
    for record, items, n in rec["groups"]:
        entry = (facts.style(record), {k: v for k, v in items})
        sizes += [entry] * int(n)
    return PlanReport(rec["plan"], rec["mode"], params=dict(rec.get("params", {})),
                      partial_grad_elements=int(rec["partial_grad_elements"]), axes=tuple(rec["axes"]), _sizes=sizes)


# --- stage partitions (one file for all models: they depend on depth and pp only) -------------------


def stage_ranges(depth: int, pp: int, compute: Callable[[], List[Tuple[int, int]]]) -> List[Tuple[int, int]]:
    """``compute()`` (DeepSpeed's partition of ``depth`` blocks into ``pp`` stages), kept on disk."""
    return facts_of(("stage_ranges",)).get(f"{depth}/{pp}", compute,
                                           lambda rs: [(int(a), int(b)) for a, b in rs])
