"""Training checkpoints that survive faults: save, publish, find, verify, resume.

A checkpoint ``<run dir>/checkpoints/step_NNNNNNN/`` holds DeepSpeed's own files (per-layer
weights, ZeRO optimizer shards, LR scheduler, step counters), ``model_ema.safetensors`` /
``model.safetensors`` (full weights in the export layout, :mod:`vitp.checkpoint.export`),
``optimizer.safetensors`` (the full AdamW state, :mod:`vitp.checkpoint.reshard`),
``rng_rank<R>.pt`` (every RNG stream of rank R) and ``vitp_meta.json`` (step, layout, model
config, EMA counter, file manifest with sizes, and ``parts``: which ranks load each file). A tag
is written under ``step_NNNNNNN.partial``; only after every rank has finished writing does rank 0
add ``vitp_meta.json``, rename the folder and atomically replace the ``latest`` file (same format
as DeepSpeed's), so a crash mid-save leaves the previous checkpoint as the latest. A checkpoint
resumes exactly at the same ``(tp, cp, pp, dp)`` through DeepSpeed's files, and at any other
layout (same model and precision) from its full tensors (:mod:`.reshard`).

Node-local folders (each node its own run dir, :mod:`.storage`): every rank writes into its own
node's folder, the files a rank on another node loads are sent there, and each node's first rank
publishes the same record once every node holds its part; every rank resumes from the newest
checkpoint that every rank finds complete in its own folder.

Loading never unpickles arbitrary objects (:mod:`vitp.checkpoint.safe_load`).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
from omegaconf import DictConfig

import vitp.deepspeed_adapter as ds
from vitp.config import Layout
from vitp.parallel import distributed as dist
from vitp.utils import atomic_write_text

from .export import RESUME_KEYS, model_differences, save_export
from .rng import rng_state, set_rng_state
from .safe_load import install_safe_loading
from .storage import StorageGroups

META = "vitp_meta.json"
LATEST = "latest"
ABANDONED = "abandoned"  # checkpoints of an attempt a resume from an older tag left behind
TAG_RE = re.compile(r"^step_(\d{7,})$")
log = logging.getLogger("vitp")
KILL_HOOK = "VITP_TEST_KILL_DURING_SAVE"  # "<rank>:<step>": that rank truncates a file and SIGKILLs itself


def tag_name(step: int) -> str:
    """Folder name of the checkpoint after ``step`` optimizer steps: ``step_NNNNNNN``."""
    return f"step_{step:07d}"


def _barrier() -> None:
    dist.barrier()


def _maybe_die(rank: int, step: int, folder: Path) -> None:
    """Fault-injection hook for tests: truncate this rank's largest file and SIGKILL the process."""
    hook = os.environ.get(KILL_HOOK)
    if not hook or hook != f"{rank}:{step}":
        return
    files = sorted((p for p in folder.iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    if files:
        with open(files[-1], "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
    os.kill(os.getpid(), signal.SIGKILL)


def save_training_checkpoint(engine: Any, ckpt_dir: Path, step: int, *, rank: int, main: bool, meta: Dict[str, Any],
                             full_states: Callable[[], Tuple[dict, dict]], cfg: DictConfig, keep: int,
                             write_state: Optional[Callable[[Path], None]] = None,
                             storage: Optional[StorageGroups] = None) -> Optional[Tuple[dict, dict]]:
    """Save, then publish, checkpoint ``step_<step>`` under ``ckpt_dir`` (collective: every rank calls it).

    ``full_states()`` is the collective that gathers ``(ema, raw)`` Generator-keyed full weights on
    rank 0; ``write_state(folder)``, collective too, writes the layout-independent optimizer state
    (:mod:`.reshard`). Returns the weights on rank 0 (``None`` elsewhere). ``keep`` > 0 deletes all
    but the newest ``keep`` published checkpoints up to ``step`` (never the latest); checkpoints
    past ``step`` (left by an attempt before a resume from an older tag) are moved into
    ``abandoned/`` (:func:`_rotate`).

    ``storage`` (default: one folder for every rank) says which ranks share ``ckpt_dir``
    (node-local folders, :mod:`.storage`): every rank writes into its own folder, the files a rank
    of another group loads are copied there (:func:`_copy_parts`), and only once every rank's part
    is in every folder that needs it does each group's leader write the same completion record,
    rename the folder and write ``latest``; old checkpoints go only after every node published.
    """
    world = dist.world_size()
    storage = storage or StorageGroups.single(world, rank)
    tag = tag_name(step)
    partial = ckpt_dir / f"{tag}.partial"
    if storage.is_leader:
        if partial.exists():
            shutil.rmtree(partial)
        ckpt_dir.mkdir(parents=True, exist_ok=True)
    _barrier()
    with ds.record_checkpoint_writes(engine) as written:
        engine.save_checkpoint(str(ckpt_dir), tag=partial.name, save_latest=False)
    torch.save(rng_state(), partial / f"rng_rank{rank:05d}.pt")
    written.append(str(partial / f"rng_rank{rank:05d}.pt"))
    ema, raw = full_states()
    if main:
        save_export(partial / "model_ema.safetensors", ema, cfg, step=step, weights="ema")
        save_export(partial / "model.safetensors", raw, cfg, step=step, weights="raw")
    if write_state is not None:
        write_state(partial)
    _maybe_die(rank, step, partial)
    _barrier()  # every rank has finished writing into its own folder
    parts = _gather_parts(partial, written, main, getattr(engine, "stage_id", 0))
    _copy_parts(partial, parts, storage)
    _barrier()  # every rank's part is written into every folder that needs it
    record = {**dist.broadcast_object(meta), "step": step, "world_size": world,
              "manifest": {n: parts[n]["size"] for n in sorted(parts)},
              "parts": {n: parts[n]["readers"] for n in sorted(parts)}}
    if storage.is_leader:
        _publish(partial, record, ckpt_dir, tag)
    _barrier()  # published on every node: only now may the previous checkpoints go
    if storage.is_leader:
        _rotate(ckpt_dir, step, keep)
    _barrier()
    return (ema, raw) if main else None


def _rotate(ckpt_dir: Path, step: int, keep: int) -> None:
    """After ``step_<step>`` is published: move the checkpoints past ``step`` into
    ``abandoned/<time>/`` (an earlier attempt wrote them before this one resumed from an older tag;
    left in place, ``resume=auto`` would take the newest of them over ``latest`` and the rotation by
    step would delete ``latest`` itself; moved, not deleted, they stay loadable by path) and,
    ``keep`` > 0, delete all but the newest ``keep`` up to ``step`` (``step_<step>``, ``latest``,
    always stays)."""
    tags = published_tags(ckpt_dir)
    stale = [t for t in tags if _tag_step(t) > step]
    ours = [t for t in tags if _tag_step(t) <= step]
    if stale:
        (ckpt_dir / ABANDONED).mkdir(exist_ok=True)
        dest = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=ckpt_dir / ABANDONED))
        for tag in stale:
            os.replace(ckpt_dir / tag, dest / tag)
        log.warning("moved %s to %s: an earlier attempt wrote them after step %d, the older checkpoint this run "
                    "resumed from and continued (load one with trainer.resume=%s/<tag>; delete the folder to free "
                    "the space)", ", ".join(stale), dest, step, dest)
    for old in ours[:-keep] if keep > 0 else []:
        shutil.rmtree(ckpt_dir / old, ignore_errors=True)


def _tag_step(tag: str) -> int:
    return int(TAG_RE.match(tag).group(1))


ALL = "all"  # the readers of a file every rank loads
_LAYER_FILE = re.compile(r"^layer_\d+-.*model_states\.pt$")  # DeepSpeed's per-layer weights of one stage
_OWN_FILE = re.compile(r"^(rng_rank\d+\.pt|.*zero_pp_rank_\d+_mp_rank_\d+_?optim_states\.pt)$")  # its writer's alone


def _readers(name: str, writer: int, stages: List[int]) -> Any:
    """The ranks that load ``name`` at the same layout: a layer file every rank of its writer's
    pipeline stage (DeepSpeed globs every tp rank's file of the layer); the RNG file and a ZeRO
    optimizer shard their writer; anything else (DeepSpeed's ``mp_rank_*`` files, which every rank
    globs; rank 0's weights and other files) every rank (:data:`ALL`)."""
    if _LAYER_FILE.match(name):
        return [r for r, s in enumerate(stages) if s == stages[writer]]
    if _OWN_FILE.match(name):
        return [writer]
    return ALL


def _gather_parts(partial: Path, written: List[str], main: bool, stage: int) -> Dict[str, Dict[str, Any]]:
    """``{file name: {"size", "writer", "readers"}}`` of the whole checkpoint, the same on every
    rank (collective). A rank's files are those it recorded writing; the files in rank 0's folder
    that no rank recorded are rank 0's own (its weights files, whatever else it writes there),
    loaded by every rank."""
    mine = {Path(p).name: os.path.getsize(p) for p in written}
    gathered = dist.gather_objects((mine, stage))
    stages = [s for _, s in gathered]
    parts: Dict[str, Dict[str, Any]] = {}
    for r, (files, _) in enumerate(gathered):
        for name, size in files.items():
            parts.setdefault(name, {"size": size, "writer": r, "readers": _readers(name, r, stages)})
    extra = {p.name: p.stat().st_size for p in sorted(partial.iterdir())
             if p.is_file() and p.name not in parts} if main else None
    for name, size in dist.broadcast_object(extra).items():
        parts[name] = {"size": size, "writer": 0, "readers": ALL}
    return parts


def _copy_parts(partial: Path, parts: Dict[str, Dict[str, Any]], storage: StorageGroups) -> None:
    """Copy every file to each storage group with a rank that loads it and no copy of it, from its
    writer to the lowest such rank, by point-to-point messages (collective). Every rank walks the
    same list in the same order, so blocking sends and receives cannot deadlock."""
    if storage.shared:
        return
    rank = storage.rank
    for name in sorted(parts):
        part = parts[name]
        readers = range(dist.world_size()) if part["readers"] == ALL else part["readers"]
        dst: Dict[int, int] = {}
        for r in readers:
            dst.setdefault(storage.index(r), r)
        dst.pop(storage.index(part["writer"]), None)
        for g in sorted(dst):
            if rank == part["writer"]:
                dist.send_file(partial / name, dst[g], part["size"])
            elif rank == dst[g]:
                dist.recv_file(partial / name, part["writer"], part["size"])


def _publish(partial: Path, record: Dict[str, Any], ckpt_dir: Path, tag: str) -> None:
    """Write the completion record, rename ``<tag>.partial`` to ``<tag>`` and point ``latest`` at it."""
    atomic_write_text(partial / META, json.dumps(record, indent=1) + "\n", fsync=True)
    final = ckpt_dir / tag
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)
    atomic_write_text(ckpt_dir / LATEST, tag, fsync=True)


def published_tags(ckpt_dir: Path) -> List[str]:
    """Complete checkpoint tags in ``ckpt_dir``, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    tags = [p.name for p in ckpt_dir.iterdir() if p.is_dir() and TAG_RE.match(p.name) and (p / META).is_file()]
    return sorted(tags, key=_tag_step)


def _fix_hint(tag_dir: Path, rank: Optional[int] = None, layout: Optional[Layout] = None) -> str:
    """The earlier checkpoints to resume from instead: those with a record and, for ``rank``, the
    files it loads (a node-local folder may hold another node's records but not its files)."""
    others = [t for t in published_tags(tag_dir.parent) if t != tag_dir.name
              and (rank is None or _holds_part(tag_dir.parent / t, rank, layout))]
    if others:
        return (f"; resume from an earlier complete checkpoint with trainer.resume={tag_dir.parent / others[-1]} "
                f"(after vitp-train --resume {tag_dir.parent.parent}, or in the run's own command; complete: "
                f"{', '.join(others)})")
    return "; no other complete checkpoint is in that folder: start a new run dir (or trainer.init_from=<export>)"


def _holds_part(tag_dir: Path, rank: int, layout: Optional[Layout]) -> bool:
    try:
        verify_checkpoint(tag_dir, rank, layout=layout, hint=False)
    except (FileNotFoundError, ValueError):
        return False
    return True


def verify_checkpoint(tag_dir: Path, rank: Optional[int] = None, names: Optional[Iterable[str]] = None,
                      layout: Optional[Layout] = None, hint: bool = True) -> Dict[str, Any]:
    """The checkpoint's metadata after checking that the files it lists are present with the size
    they were written with (content errors surface when the file is loaded, naming it): every
    file, or (node-local folders) those rank ``rank`` loads (its ``parts``; when the checkpoint's
    layout differs from ``layout``, the files every rank loads, which resharding reads), or the
    files ``names``.

    Raises ``FileNotFoundError`` (missing tag or file) / ``ValueError`` (wrong size, corrupt
    metadata) naming the file and the fix.
    """
    meta_path = tag_dir / META

    def fix() -> str:
        return _fix_hint(tag_dir, rank, layout) if hint else ""

    if not tag_dir.is_dir():
        raise FileNotFoundError(f"checkpoint {tag_dir} does not exist" + fix())
    if not meta_path.is_file():
        raise FileNotFoundError(f"checkpoint {tag_dir} is incomplete ({META} missing): its save never finished"
                                + fix())
    try:
        meta = json.loads(meta_path.read_text())
        manifest = meta["manifest"]
        parts = meta.get("parts", {})  # absent: written before node-local folders, every rank loads every file
    except (ValueError, KeyError) as e:
        why = f"no key {e}" if isinstance(e, KeyError) else e
        raise ValueError(f"checkpoint metadata {meta_path} is corrupt: {why}" + fix()) from e
    wanted = set(manifest) if names is None else set(names)
    if rank is not None and layout is not None and _layout_of(meta) != _layout_of(vars(layout)):
        wanted = {n for n in wanted if parts.get(n, ALL) == ALL}
    elif rank is not None:
        wanted = {n for n in wanted if parts.get(n, ALL) == ALL or rank in parts[n]}
    for name in sorted(wanted):
        f = tag_dir / name
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint file {f} is missing" + fix())
        if name in manifest and f.stat().st_size != manifest[name]:
            raise ValueError(f"checkpoint file {f} is truncated or was rewritten ({f.stat().st_size} bytes, "
                             f"{manifest[name]} when written)" + fix())
    return meta


def _layout_of(d: Dict[str, Any]) -> Tuple[int, int, int, int]:
    return d.get("tp"), d.get("cp", 1), d.get("pp"), d.get("dp")


def tag_problem(tag_dir: Path, rank: int, layout: Optional[Layout] = None) -> Optional[Tuple[str, str]]:
    """``None`` when ``tag_dir`` holds every file rank ``rank`` loads (at ``layout``), else
    ``(exception class name, message)`` of :func:`verify_checkpoint` (a :data:`.storage.View` entry)."""
    try:
        verify_checkpoint(tag_dir, rank, layout=layout)
    except (FileNotFoundError, ValueError) as e:
        return type(e).__name__, str(e)
    return None


def find_checkpoint(resume: str, ckpt_dir: Path) -> Optional[Path]:
    """The checkpoint tag folder to resume from, or ``None`` to start at step 0.

    ``resume``: ``auto`` (the ``latest`` in ``ckpt_dir`` if any), ``never``, or a path to a
    checkpoints folder (its ``latest``) or to one tag folder. Raises ``FileNotFoundError`` /
    ``ValueError`` naming the path when it does not hold a complete checkpoint.
    """
    if resume == "never":
        return None
    if resume == "auto":
        latest = ckpt_dir / LATEST
        if not latest.is_file():
            return None
        folder = ckpt_dir
    else:
        folder = Path(resume)
        if not folder.exists():
            raise FileNotFoundError(f"trainer.resume={resume}: no such checkpoint folder; use auto, never, or the "
                                    f"path of a checkpoints/ folder or of one checkpoints/step_NNNNNNN/ folder")
        if (folder / META).is_file() or folder.name.endswith(".partial"):
            return folder
        latest = folder / LATEST
        if not latest.is_file() and (folder / ".hydra" / "config.yaml").is_file():
            raise FileNotFoundError(f"trainer.resume={resume} is a run directory: continue it in that folder with "
                                    f"vitp-train --resume {resume}, or start a new run dir from its latest "
                                    f"checkpoint with trainer.resume={folder / 'checkpoints'}")
        if not latest.is_file():
            raise FileNotFoundError(f"trainer.resume={resume}: neither a checkpoint tag folder ({META}) nor a "
                                    f"checkpoints folder with a '{LATEST}' file")
    tag = latest.read_text().strip()
    if not TAG_RE.match(tag):
        tags = published_tags(folder)
        fix = (f"write the newest complete tag ({tags[-1]}) into it, or pass trainer.resume={folder / tags[-1]}"
               if tags else "no complete checkpoint is in that folder")
        raise ValueError(f"{latest} names {tag!r}, not a vitp checkpoint tag (step_NNNNNNN): {fix}")
    return folder / tag


def latest_meta(ckpt_dir: Path) -> Optional[Dict[str, Any]]:
    """The metadata of ``ckpt_dir``'s latest checkpoint, or ``None`` when there is none or it cannot
    be read (callers only describe it; :func:`verify_checkpoint` judges it)."""
    try:
        tag = find_checkpoint("auto", Path(ckpt_dir))
        return json.loads((tag / META).read_text()) if tag is not None else None
    except (OSError, ValueError):
        return None


def layout_text(meta: Dict[str, Any]) -> str:
    """``tp=2 pp=2 dp=2 (8 ranks)`` of a checkpoint's metadata."""
    cp = f" cp={meta['cp']}" if meta.get("cp", 1) > 1 else ""
    world = meta["tp"] * meta.get("cp", 1) * meta["pp"] * meta["dp"]
    return f"tp={meta['tp']}{cp} pp={meta['pp']} dp={meta['dp']} ({world} rank{'' if world == 1 else 's'})"


def check_resumable(meta: Dict[str, Any], tag_dir: Path, cfg: DictConfig, layout: Layout) -> bool:
    """Whether the checkpoint resumes by resharding (:mod:`.reshard`: its ``tp``/``cp``/``pp``/``dp``
    differ from this run's) rather than through DeepSpeed's own files (the same layout).

    Raises ``ValueError`` explaining the fix when precision, model or partial-sync settings differ
    (no layout change carries those), or the layout differs and the checkpoint predates the
    layout-independent optimizer state."""
    fix = (f"export the weights (vitp-export {tag_dir} --weights raw) and start a new run dir with "
           f"trainer.init_from=<export>.safetensors (weights only: optimizer and LR schedule restart)")
    meta = {"cp": 1, **meta}  # written before context parallelism existed
    mine = {"tp": layout.tp, "cp": layout.cp, "pp": layout.pp, "dp": layout.dp}
    moved = [f"{k}: {meta.get(k)!r} in the checkpoint vs {v!r} now" for k, v in mine.items() if meta.get(k) != v]
    diffs = [] if meta.get("precision") == layout.precision else [
        f"precision: {meta.get('precision')!r} in the checkpoint vs {layout.precision!r} now"]
    p_file, p_now = float(meta.get("partial_sync", 1.0)), float(cfg.parallel.partial_sync)  # absent: exact TP
    if p_file != p_now:
        diffs.append(f"parallel.partial_sync: {p_file} in the checkpoint vs {p_now} now")
    elif p_file < 1 and meta.get("tp") != layout.tp:
        diffs.append(f"parallel.partial_sync={p_file}: every TP rank carries its own channels, so it runs only at "
                     f"tp={meta.get('tp')}")
    elif p_now < 1 and meta.get("partial_sync_scale") != cfg.parallel.partial_sync_scale:
        diffs.append(f"parallel.partial_sync_scale: {meta.get('partial_sync_scale')!r} in the checkpoint vs "
                     f"{cfg.parallel.partial_sync_scale!r} now")
    if meta.get("zero_stage") != cfg.parallel.zero_stage:
        diffs.append(f"parallel.zero_stage: {meta.get('zero_stage')!r} in the checkpoint vs {cfg.parallel.zero_stage!r} now")
    # checkpoints written before vitp chose the engine's stage ran parallel.zero_stage itself
    ran, runs = meta.get("engine_zero_stage", meta.get("zero_stage")), layout.engine_zero_stage(cfg.parallel.zero_stage)
    if not diffs and not moved and ran != runs:
        diffs.append(f"the engine ran ZeRO stage {ran!r} when the checkpoint was written and runs {runs} now "
                     f"(fp32 at dp=1 runs stage 0 since vitp clips exactly itself)")
    diffs += model_differences(meta.get("model", {}), cfg.model, RESUME_KEYS)
    if diffs:
        raise ValueError(f"checkpoint {tag_dir} does not match this run ({'; '.join(diffs + moved)}); a training "
                         f"checkpoint resumes at another tp/cp/pp/dp, but only with the same precision, ZeRO "
                         f"setting, partial sync and model; to change those, {fix}")
    if moved and "engine" not in meta:
        raise ValueError(f"checkpoint {tag_dir} was written at another layout ({'; '.join(moved)}) by a vitp that did "
                         f"not yet keep the optimizer in a layout-independent form: resume it at its own layout, "
                         f"or {fix}")
    return bool(moved)


def load_training_checkpoint(engine: Any, tag_dir: Path, rank: int) -> None:
    """Load DeepSpeed state (weights, optimizer, LR schedule) and this rank's RNG streams."""
    install_safe_loading(engine)
    path, _ = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name, load_optimizer_states=True,
                                     load_lr_scheduler_states=True)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed found no checkpoint in {tag_dir}")
    load_rng(tag_dir, rank)


def load_rng(tag_dir: Path, rank: int, required: bool = True) -> bool:
    """Set every RNG stream of this process to those rank ``rank`` saved in ``tag_dir``; returns
    whether it did (``required=False``: a file this node's folder lacks is skipped)."""
    rng_file = tag_dir / f"rng_rank{rank:05d}.pt"
    if not required and not rng_file.is_file():
        return False
    try:
        s = torch.load(str(rng_file), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"checkpoint file {rng_file} could not be loaded: {e}") from e
    set_rng_state(s)
    return True


def truncate_log(path: Path, step: int) -> int:
    """Drop lines of a JSONL log whose ``step`` is beyond ``step`` (atomically); returns how many."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()

    def kept(line: str) -> bool:
        try:
            return json.loads(line).get("step", 0) <= step
        except ValueError:  # a line cut off by a crash
            return False

    keep = [x for x in lines if x.strip() and kept(x)]
    if len(keep) != len(lines):
        atomic_write_text(path, "".join(x + "\n" for x in keep), fsync=True)
    return len(lines) - len(keep)


def _refuse_without_meta(tag: Path, name: str) -> None:
    """Raise ``FileNotFoundError`` for checkpoint folder ``tag`` lacking its :data:`META`, naming
    the newest complete checkpoint beside it and the weights file to pass to take it as it is."""
    others = published_tags(tag.parent)
    fix = (f"pass a complete checkpoint instead ({tag.parent / others[-1]}), or, to take this one's weights as they "
           f"are, the weights file itself ({tag / name})" if others else
           f"to take this one's weights as they are, pass the weights file itself ({tag / name})")
    raise FileNotFoundError(f"{tag} is a checkpoint folder without its {META} (written last by a save: the save "
                            f"never finished, or the file was removed); {fix}")


def resolve_weights(source: Path, weights: str = "ema") -> Tuple[Path, Optional[int], Path]:
    """``(weights file, step, run dir)`` of ``source``: a finished run dir (its final
    ``model_ema.safetensors`` / ``model.safetensors`` by ``weights``), a run dir without final
    weights or a checkpoints folder (the latest checkpoint), a checkpoint tag folder, or a file.

    Raises ``FileNotFoundError`` / ``ValueError`` naming the path when it holds no complete checkpoint
    (a tag folder without its :data:`META` too: its weights are taken only when the file is passed).
    """
    name = "model_ema.safetensors" if weights == "ema" else "model.safetensors"
    if source.is_file():
        return source, None, source.parent
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist (expected a run directory, a checkpoint folder or a "
                                f".safetensors file)")
    if (source / name).is_file() and (source / "metrics.jsonl").is_file():  # a finished run: its final weights
        return source / name, None, source
    if (source / META).is_file() or source.name.endswith(".partial"):
        tag = source
    elif (source / LATEST).is_file():
        tag = find_checkpoint(str(source), source)
    elif (source / "checkpoints" / LATEST).is_file():
        tag = find_checkpoint("auto", source / "checkpoints")
    elif TAG_RE.match(source.name) or any(source.glob("rng_rank*.pt")):  # a checkpoint, not a weights folder
        _refuse_without_meta(source, name)
    elif (source / name).is_file():
        return source / name, None, source
    else:
        raise FileNotFoundError(f"{source} holds no vitp checkpoint (expected a run directory, its checkpoints/ "
                                f"folder, a checkpoints/step_NNNNNNN folder, or a .safetensors file)")
    meta = verify_checkpoint(tag, names=[name])  # a node-local folder holds rank 0's weights too
    return tag / name, meta["step"], tag.parent.parent
