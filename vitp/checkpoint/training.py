"""Training checkpoints that survive faults: save, publish, find, verify, resume.

A checkpoint ``<run dir>/checkpoints/step_NNNNNNN/`` is one sharded DCP checkpoint
(:mod:`.sharded`: ``.metadata`` and a ``__<rank>_0.distcp`` file per rank holding that rank's
pieces of the weights, EMA and AdamW state, :mod:`.train_state`), ``rng_rank<R>.pt`` (every RNG
stream of rank R) and ``vitp_meta.json`` (step, layout, model and run config, EMA counter,
AdamW's step, LR schedule, file manifest with sizes, and ``parts``: which ranks load each file at
this layout). A tag is written under ``step_NNNNNNN.partial`` (in the background:
:mod:`.saver`); only after every rank has finished writing does rank 0 add ``vitp_meta.json``,
rename the folder and atomically replace the ``latest`` file, so a crash mid-save leaves the
previous checkpoint as the latest. A checkpoint resumes at any ``(tp, cp, pp, dp)`` (same model
and precision), each rank reading its own pieces; checkpoints of the earlier format (full tensors
written by rank 0 beside DeepSpeed's files) still resume (:mod:`.reshard`).

Node-local folders (each node its own run dir, :mod:`.storage`): every rank writes into its own
node's folder, the files a rank on another node loads are sent there, and each node's first rank
publishes the same record once every node holds its part; every rank resumes from the newest
checkpoint that every rank finds complete in its own folder.

Loading never unpickles arbitrary objects (:mod:`.sharded` reads DCP's metadata with an
allow-list; RNG files with ``weights_only=True``).
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
import warnings
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf

from vitp.config import Layout
from vitp.parallel import distributed as dist
from vitp.utils import atomic_write_text, default_mode

from .export import RESUME_KEYS, model_differences
from .results import ABANDONED, later_results
from .rng import set_rng_state
from .sharded import save_planner
from .storage import StorageGroups

META = "vitp_meta.json"
LATEST = "latest"
TAG_RE = re.compile(r"^step_(\d{7,})$")
log = logging.getLogger("vitp")
KILL_HOOK = "VITP_TEST_KILL_DURING_SAVE"  # "<rank>:<step>": that rank truncates a file and SIGKILLs itself


def tag_name(step: int) -> str:
    """Folder name of the checkpoint after ``step`` optimizer steps: ``step_NNNNNNN``."""
    return f"step_{step:07d}"


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


def write_checkpoint(ckpt_dir: Path, step: int, *, staged: Dict[str, torch.Tensor], rng: Dict[str, Any],
                     record: Dict[str, Any], storage: StorageGroups, group=None, keep: int = 0,
                     to_first: bool = False, compress: bool = False, abandon_after: Optional[int] = None) -> None:
    """Write, then publish, checkpoint ``step_<step>`` under ``ckpt_dir`` (collective over
    ``group``, a group of every rank; runs on the checkpoint thread when saving asynchronously).

    ``staged``: this rank's pieces (:func:`.train_state.stage`), written as one DCP checkpoint
    (:mod:`.sharded`; DCP writes each piece once however many ranks hold it); ``rng``: this
    rank's RNG streams (``rng_rank<R>.pt``); ``record``: the completion record's content, to
    which the step, file manifest and ``parts`` (which ranks load each file at this layout) are
    added. ``storage`` says which ranks share ``ckpt_dir`` (node-local folders): each file is
    copied to every other folder with a rank that loads it (:func:`_copy_parts`), and only then
    does each folder's leader write the completion record, rename the folder and write
    ``latest``. ``keep`` > 0 deletes all but the newest ``keep`` published checkpoints up to
    ``step`` (never the latest); checkpoints past ``step`` (the run's first checkpoint: past
    ``abandon_after``, the step it resumed from) move into ``abandoned/`` (:func:`_rotate`).
    ``to_first``: rank 0's folder receives every data file too (the final checkpoint of a run with
    node-local folders, from which rank 0 writes the run's weights shard by shard). ``compress``:
    each piece goes through DCP's ZStandard stream extension (``torch.distributed.checkpoint._extension``;
    its descriptor is in ``.metadata``, so reading needs no setting): a LoRA run's hundreds of
    small pieces shrink their ``torch.save`` framing (1.6 kB each) below the tensor bytes.
    """
    import torch.distributed.checkpoint as dcp

    world, rank = dist.world_size(), storage.rank
    tag = tag_name(step)
    partial = ckpt_dir / f"{tag}.partial"
    if storage.is_leader:
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir(parents=True)
    dist.barrier(group)
    rng_file = partial / f"rng_rank{rank:05d}.pt"
    torch.save(rng, rng_file)
    # node-local folders: one file per piece, so a node receives exactly the pieces its ranks load
    writer = dcp.FileSystemWriter(str(partial), single_file_per_rank=storage.shared, sync_files=True,
                                  _extensions=_compression() if compress else None)
    with warnings.catch_warnings():  # one process: DCP warns that it saves without a process group
        warnings.simplefilter("ignore", UserWarning)
        md = dcp.save(staged, storage_writer=writer, planner=save_planner(), process_group=group, no_dist=world == 1)
    _maybe_die(rank, step, partial)
    parts = _gather_parts(partial, md, staged, rank, group, to_first)
    _copy_parts(partial, parts, storage, group)
    dist.barrier(group)  # every rank's part is written into every folder that needs it
    record = {**record, "step": step, "world_size": world,
              "manifest": {n: parts[n]["size"] for n in sorted(parts)},
              "parts": {n: parts[n]["readers"] for n in sorted(parts)}}
    if storage.is_leader:
        _publish(partial, record, ckpt_dir, tag)
    dist.barrier(group)  # published on every node: only now may the previous checkpoints go
    if storage.is_leader:
        _rotate(ckpt_dir, step, keep, abandon_after)
    dist.barrier(group)


def _compression() -> list:
    """DCP's ZStandard stream extension (level 3), or ``ValueError`` naming the package."""
    from torch.distributed.checkpoint._extension import ZStandard

    if not ZStandard.is_available():
        raise ValueError("trainer.checkpoint_compress needs the zstandard package (pip install zstandard, a "
                         "dependency of vitp); or set trainer.checkpoint_compress=none")
    return [ZStandard()]


def _rotate(ckpt_dir: Path, step: int, keep: int, abandon_after: Optional[int] = None) -> None:
    """After ``step_<step>`` is published: move the checkpoints an earlier attempt left past the
    step this run resumed from (``abandon_after``, given with the run's first checkpoint; else past
    ``step``) into ``abandoned/<time>/`` (left in place, ``resume=auto`` would take the newest of
    them over ``latest``, and the rotation by step would delete ``latest`` itself or, once this run
    passed them, the good checkpoints before them; moved, not deleted, they stay loadable by path)
    and, ``keep`` > 0, delete all but the newest ``keep`` of the others (``step_<step>``,
    ``latest``, always stays). A tag folder past that step without its :data:`META` (incomplete:
    a resume passed over it) moves too: left beside the new history it would look like one of it."""
    tags = published_tags(ckpt_dir)
    after = step if abandon_after is None else abandon_after
    # an unpublished save is "<tag>.partial", so a tag folder without META is never one in flight
    broken = [t for t in _incomplete_tags(ckpt_dir) if _tag_step(t) > after and _tag_step(t) != step]
    stale = sorted([t for t in tags if _tag_step(t) > after and _tag_step(t) != step] + broken, key=_tag_step)
    ours = [t for t in tags if t not in stale]
    if stale:
        dest = _aside_folder(ckpt_dir)
        for tag in stale:
            os.replace(ckpt_dir / tag, dest / tag)
        names = [f"{t} (incomplete: no {META})" if t in broken else t for t in stale]
        log.warning("moved %s to %s: an earlier attempt wrote them after step %d, the older checkpoint this run "
                    "resumed from and continued (load one with trainer.resume=%s/<tag>; delete the folder to free "
                    "the space)", ", ".join(names), dest, after, dest)
    for old in ours[:-keep] if keep > 0 else []:
        shutil.rmtree(ckpt_dir / old, ignore_errors=True)


def _aside_folder(ckpt_dir: Path) -> Path:
    """A new ``ckpt_dir/abandoned/<time>-<id>/`` for checkpoints a run leaves behind."""
    (ckpt_dir / ABANDONED).mkdir(exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=time.strftime("%Y%m%d-%H%M%S-"), dir=ckpt_dir / ABANDONED))
    default_mode(folder)  # mkdtemp's 0700: others reading the run read what it set aside too
    return folder


def _tag_step(tag: str) -> int:
    return int(TAG_RE.match(tag).group(1))


ALL = "all"  # the readers of a file every rank loads


def _gather_parts(partial: Path, md: Any, staged: Dict[str, torch.Tensor], rank: int, group,
                  to_first: bool = False) -> Dict[str, Dict[str, Any]]:
    """``{file name: {"size", "writer", "readers"}}`` of the whole checkpoint, the same on every
    rank (collective): each rank's DCP data file and RNG file are its own; a data file's readers
    at this layout are the ranks whose pieces it holds (DCP's de-duplication may have put a
    replica's piece into another rank's file); ``.metadata`` (rank 0's) every rank loads."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from .sharded import METADATA

    mine = {p.name: p.stat().st_size for p in partial.iterdir()
            if p.is_file() and (p.name == f"rng_rank{rank:05d}.pt" or p.name.startswith(f"__{rank}_"))}
    if rank == 0 and (partial / METADATA).is_file():
        mine[METADATA] = (partial / METADATA).stat().st_size
    needed = set()
    for fqn, t in staged.items():
        for off in getattr(t, "global_offsets", ((0,) * t.dim(),)):
            needed.add(md.storage_data[MetadataIndex(fqn, torch.Size(off))].relative_path)
    gathered = dist.gather_objects((mine, sorted(needed)), group)
    readers: Dict[str, List[int]] = {}
    for r, (_, files) in enumerate(gathered):
        for name in files:
            readers.setdefault(name, []).append(r)
    parts: Dict[str, Dict[str, Any]] = {}
    for r, (files, _) in enumerate(gathered):
        for name, size in files.items():
            who = ALL if name == METADATA else [r] if name.startswith("rng_rank") else readers.get(name, [r])
            if to_first and who != ALL and 0 not in who and not name.startswith("rng_rank"):
                who = [0, *who]
            parts[name] = {"size": size, "writer": r, "readers": who}
    return parts


def _copy_parts(partial: Path, parts: Dict[str, Dict[str, Any]], storage: StorageGroups, group=None) -> None:
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
                dist.send_file(partial / name, dst[g], part["size"], group=group)
            elif rank == dst[g]:
                dist.recv_file(partial / name, part["writer"], part["size"], group=group)


def _publish(partial: Path, record: Dict[str, Any], ckpt_dir: Path, tag: str) -> None:
    """Write the completion record, rename ``<tag>.partial`` to ``<tag>`` and point ``latest`` at it."""
    atomic_write_text(partial / META, json.dumps(record, indent=1) + "\n", fsync=True)
    final = ckpt_dir / tag
    if final.exists():  # an earlier attempt's (maybe damaged) checkpoint of this step: kept, not deleted
        dest = _aside_folder(ckpt_dir)
        os.replace(final, dest / tag)
        log.warning("moved %s to %s: an earlier attempt wrote it; this run wrote its own %s (load the earlier one "
                    "with trainer.resume=%s; delete the folder to free the space)", tag, dest, tag, dest / tag)
    os.replace(partial, final)
    atomic_write_text(ckpt_dir / LATEST, tag, fsync=True)


def _incomplete_tags(ckpt_dir: Path) -> List[str]:
    """Tag folders in ``ckpt_dir`` without their completion record :data:`META`, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted((p.name for p in ckpt_dir.iterdir() if p.is_dir() and TAG_RE.match(p.name)
                   and not (p / META).is_file()), key=_tag_step)


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
                f"{', '.join(others)}){_aside_note(tag_dir.parent, _tag_step(others[-1]))}")
    return "; no other complete checkpoint is in that folder: start a new run dir (or trainer.init_from=<export>)"


def _aside_note(ckpt_dir: Path, step: int) -> str:
    """What continuing the run of ``ckpt_dir`` from ``step`` moves aside: its later results
    (:func:`.results.set_aside_results`) and checkpoints, for :func:`_fix_hint`."""
    results = later_results(ckpt_dir.parent, step)
    if not results:
        return ""
    return (f"; that moves the run's results of a later step ({', '.join(results)}, later sample grids) and its "
            f"later checkpoints into {ckpt_dir / ABANDONED}/, deleting nothing")


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
        # another layout reads pieces of any rank's data file (sharded), or the full tensors (earlier format)
        sharded = "format" in meta
        wanted = {n for n in wanted if (not n.startswith("rng_rank")) if sharded or parts.get(n, ALL) == ALL}
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


def find_checkpoint(resume: str, ckpt_dir: Path, reader: bool = False) -> Optional[Path]:
    """The checkpoint tag folder to resume from, or ``None`` to start at step 0.

    ``resume``: ``auto`` (the ``latest`` in ``ckpt_dir`` if any), ``never``, or a path to a
    checkpoints folder (its ``latest``) or to one tag folder. Raises ``FileNotFoundError`` /
    ``ValueError`` naming the path when it does not hold a complete checkpoint, with the fix of a
    training resume, or with ``reader`` (vitp-sample / vitp-eval / vitp-export, which take no
    ``trainer.resume``) the fix of a read: the complete checkpoint's folder as the source.
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
        newest = folder / tags[-1] if tags else None
        fix = ("no complete checkpoint is in that folder" if newest is None else
               f"write the newest complete tag ({tags[-1]}) into it, or read that checkpoint itself: pass {newest} "
               f"as the source (vitp-eval RUN --weights {newest})" if reader else
               f"write the newest complete tag ({tags[-1]}) into it, or pass trainer.resume={newest}")
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


def restart_advice(tag_dir: Path, cfg: DictConfig, lora: bool) -> str:
    """How to start a new run from the weights of checkpoint ``tag_dir`` (``cfg``: the run's config,
    ``lora``: it trained adapters): a Wan run starts from a diffusers folder (the base with a LoRA
    run's adapters merged), the generator from a vitp export file."""
    if str(OmegaConf.select(cfg, "model.family", default="vit")) == "wan":
        merge = " --merge" if lora else ""
        return (f"export the weights (vitp-export {tag_dir} --format diffusers{merge} --weights raw -o OUT) and start "
                "a new run dir with trainer.init_from=OUT (weights only: optimizer and LR schedule restart)")
    return (f"export the weights (vitp-export {tag_dir} --weights raw) and start a new run dir with "
            f"trainer.init_from=<export>.safetensors (weights only: optimizer and LR schedule restart)")


def check_resumable(meta: Dict[str, Any], tag_dir: Path, cfg: DictConfig, layout: Layout) -> bool:
    """Whether the checkpoint resumes by resharding (:mod:`.reshard`: its ``tp``/``cp``/``pp``/``dp``
    differ from this run's) rather than through DeepSpeed's own files (the same layout).

    Raises ``ValueError`` explaining the fix when precision, model or partial-sync settings differ
    (no layout change carries those), or the layout differs and the checkpoint predates the
    layout-independent optimizer state."""
    fix = restart_advice(tag_dir, cfg, bool(meta.get("lora")))
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


def run_of_checkpoint(path: Path) -> Optional[Path]:
    """The run directory (it holds ``.hydra/config.yaml``) whose ``checkpoints/`` folder or
    checkpoint tag folder (``checkpoints/step_N``) ``path`` is, else None."""
    path = Path(path)
    run = path.parent if path.name == "checkpoints" else path.parent.parent if path.parent.name == "checkpoints" \
        else None
    return run if run is not None and (run / ".hydra" / "config.yaml").is_file() else None


def resolve_weights(source: Path, weights: str = "ema") -> Tuple[Path, Optional[int], Path]:
    """``(weights path, step, run dir)`` of ``source``: a finished run dir (its final
    ``model_ema.safetensors`` / ``model.safetensors`` by ``weights``, a single file or sharded:
    ``<name>.index.json``), a run dir without final weights or a checkpoints folder (the latest
    checkpoint), a checkpoint tag folder, or a file (also ``X.safetensors`` of a sharded export or
``<tag>/<name>`` of a DCP checkpoint: returned as given). The path is what
    :func:`vitp.checkpoint.export.read_export` reads; for a checkpoint holding a torch distributed
    checkpoint (``.metadata``, no weights file) it is ``<tag>/<name>``, which does not exist as a file.

    Raises ``FileNotFoundError`` / ``ValueError`` naming the path when it holds no complete checkpoint
    (a tag folder without its :data:`META` too: its weights are taken only when the file is passed).
    """
    name = "model_ema.safetensors" if weights == "ema" else "model.safetensors"
    if source.is_file() or source.suffix == ".safetensors" and (  # a file; a sharded export's, a DCP tag's
            Path(f"{source}.index.json").is_file() or (source.parent / ".metadata").is_file()):
        return source, None, source.parent

    def has_weights(folder: Path) -> bool:  # a single file, or a sharded export's index
        return (folder / name).is_file() or (folder / f"{name}.index.json").is_file()

    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist (expected a run directory, a checkpoint folder, a "
                                f".safetensors file or, for a Wan model, a diffusers folder)")
    if has_weights(source) and (source / "metrics.jsonl").is_file():  # a finished run: its final weights
        return source / name, None, source
    if (source / META).is_file() or source.name.endswith(".partial"):
        tag = source
    elif (source / LATEST).is_file():
        tag = find_checkpoint(str(source), source, reader=True)
    elif (source / "checkpoints" / LATEST).is_file():
        tag = find_checkpoint("auto", source / "checkpoints", reader=True)
    elif (source / ".metadata").is_file() and not (source / name).is_file():  # a DCP checkpoint, no record
        verify_checkpoint(source)  # raises: its META is missing
    elif TAG_RE.match(source.name) or any(source.glob("rng_rank*.pt")):  # a checkpoint, not a weights folder
        _refuse_without_meta(source, name)
    elif has_weights(source):
        return source / name, None, source
    elif (source / ".hydra" / "config.yaml").is_file():  # a run that has not written its first checkpoint
        raise FileNotFoundError(f"{source} is a run with no checkpoint yet (no {source / 'checkpoints' / LATEST}): let "
                                f"it train to its first checkpoint (trainer.checkpoint_every) or its end, or resume it "
                                f"with vitp-train --resume {source}")
    else:
        raise FileNotFoundError(f"{source} holds no vitp checkpoint (expected a run directory, its checkpoints/ "
                                f"folder, a checkpoints/step_NNNNNNN folder, or a .safetensors file)")
    try:
        if _in_dcp(tag, name):  # weights inside the torch distributed checkpoint
            meta = verify_checkpoint(tag, hint=False)
        else:
            meta = verify_checkpoint(tag, names=[name], hint=False)  # a node-local folder holds rank 0's weights too
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"{e}{_read_hint(tag)}") from e
    return tag / name, meta["step"], tag.parent.parent


def _in_dcp(tag: Path, name: str) -> bool:
    """Whether checkpoint ``tag`` keeps its weights in a torch distributed checkpoint (its record
    names the sharded format, or ``.metadata`` is there) rather than in the file ``name``."""
    if (tag / name).is_file():
        return False
    try:
        return "format" in json.loads((tag / META).read_text()) or (tag / ".metadata").is_file()
    except (OSError, ValueError):
        return (tag / ".metadata").is_file()


def _read_hint(tag: Path) -> str:
    """What to read instead of the broken checkpoint ``tag`` (vitp-export, vitp-sample, vitp-eval):
    the newest complete one beside it, by its path."""
    others = [t for t in published_tags(tag.parent) if t != tag.name and _holds_part(tag.parent / t, 0, None)]
    if not others:
        return "; no other complete checkpoint is in that folder"
    return (f"; read an earlier complete checkpoint instead: pass {tag.parent / others[-1]} as the source "
            f"(complete: {', '.join(others)})")
