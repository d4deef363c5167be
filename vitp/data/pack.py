"""Pack the data set a ``data`` config describes into WebDataset tar shards (``vitp-pack``).

The layout is in :mod:`vitp.data.shards`. Packing reads the data as training would (the digits,
an image folder, a video folder, with their classes, captions and held-out split: the folder
datasets' scan skips unreadable files and says why), then writes shard ``k`` with webdataset's
``TarWriter`` into ``shard-k.tar.part`` and renames it when complete, in worker processes. An
interrupted pack run again with the same config and output folder keeps the complete shards and
writes the rest; the manifest ``index.json`` is written last, so its presence means complete. A
damaged pack (:mod:`vitp.data.pack_check`) run again with the same config is repaired: its intact
shards are kept, the rest is written again, the manifest last.

Sources stay as they were: image and video files are stored byte for byte (a packed data set
trains on the same pixels as its folder), the digits' 8x8 pixels as ``.npy``.
"""
from __future__ import annotations

import io
import json
import logging
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from vitp.data.pack_check import DIGEST_KEY, config_hash, damage, drop_damaged_shards, recorded_digest
from vitp.data.shards import CAPTIONS, FORMAT, MANIFEST, SAMPLES, TEXT_STORE, VERSION, shard_name, write_caption_offsets
from vitp.utils import atomic_write_text, save_safetensors

log = logging.getLogger(__name__)

PROGRESS = ".vitp-pack.json"  # the config of a pack in progress (resume check)


@dataclass
class Sample:
    """One sample to pack: its media (a source file, or the digits' pixels), label, class name,
    caption, held-out flag and the manifest's shape fields (pixels as displayed; video: frames, fps,
    orientation)."""

    source: Any  # Path of the file, or a uint8 (8, 8) array (digits)
    ext: str
    label: int
    cls: str
    caption: Optional[str]
    heldout: bool
    height: int = 0
    width: int = 0
    frames: int = 1
    fps: float = 0.0
    orientation: Optional[str] = None
    heldout_from: int = 0  # video: first held-out frame (0: the whole file, frames: none)

    def files(self, key: str) -> Dict[str, Any]:
        """The sample as webdataset's ``TarWriter`` writes it (every value bytes or str)."""
        if isinstance(self.source, np.ndarray):
            buf = io.BytesIO()
            np.save(buf, self.source)
            media, name = buf.getvalue(), "sklearn.datasets.load_digits"
        else:
            media, name = Path(self.source).read_bytes(), str(self.source)
        out = {"__key__": key, self.ext: media, "cls": str(self.label),
               "json": json.dumps({"source": name, "class": self.cls})}
        if self.caption is not None:
            out["txt"] = self.caption
        return out


def _digits(cfg: Any, seed: int) -> Tuple[str, List[str], List[Sample], Dict[str, str]]:
    from vitp.data.build import build_datasets
    from vitp.data.images import load_digits

    train, held = build_datasets(cfg, seed)  # the folder version's split and captions
    heldout = np.zeros(len(train.base), dtype=bool)
    heldout[held.indices] = True
    captions = getattr(train.base, "captions", None)
    pixels = load_digits()[0].astype(np.uint8)  # 0..16
    samples = [Sample(pixels[i], "npy", int(train.base.labels[i]), train.base.classes[int(train.base.labels[i])],
                      None if captions is None else captions[i], bool(heldout[i]), 8, 8)
               for i in range(len(train.base))]
    return "digits", list(train.base.classes), samples, {}


def _images(cfg: Any, seed: int) -> Tuple[str, List[str], List[Sample], Dict[str, str]]:
    from vitp.data.build import build_datasets

    train, held = build_datasets(cfg, seed)  # the folder version's split, captions and skips
    split = held.base is train.base
    samples, skipped = [], {}
    for base, all_held in [(train.base, False)] + ([] if split else [(held.base, True)]):
        captions = getattr(base, "captions", None)
        skipped.update(base.skip_reasons)
        for i in range(len(base)):
            h, w = base.native_size(i)
            samples.append(Sample(base.files[i], base.files[i].suffix.lower().lstrip("."), int(base.labels[i]),
                                  base.classes[int(base.labels[i])], None if captions is None else captions[i],
                                  all_held, h, w))
    if split:
        for i in held.indices:
            samples[int(i)].heldout = True
    return "image", list(train.base.classes), samples, skipped


def _videos(cfg: Any, seed: int) -> Tuple[str, List[str], List[Sample], Dict[str, str]]:
    from vitp.data.build import _base_dataset
    from vitp.data.text import item_captions

    if cfg.class_per_shot or cfg.scene_cut_threshold is not None:
        raise ValueError("data.scene_cut_threshold / data.class_per_shot cut videos at shots, but a packed video is one "
                         "sample whose clips may span any frames: unset them to pack (cut the scenes into files first), "
                         "or train from the video folder")
    out, skipped, classes = [], {}, None
    roots = [(cfg, False)] + ([(_heldout_cfg(cfg), True)] if cfg.heldout_root else [])
    for c, is_held in roots:
        base = _base_dataset(c, seed)
        classes = classes or list(base.classes)
        skipped.update(base.skip_reasons)
        captions = item_captions(base, c)
        first = {int(f): i for i, f in reversed(list(enumerate(base.item_file)))}  # first window of each file
        labels = np.asarray([int(base.labels[first[f]]) for f in range(len(base.files))], dtype=np.int64)
        held_from = _video_split(base, is_held, cfg, seed)
        for f, path in enumerate(base.files):
            times = base._times[f]
            fps = (len(times) - 1) / times[-1] if times[-1] > 0 else 25.0
            w, h = base._sizes[f]
            out.append(Sample(path, path.suffix.lower().lstrip("."), int(labels[f]), base.classes[labels[f]],
                              None if captions is None else captions[first[f]], bool(held_from[f] == 0), h, w,
                              len(times), float(fps), base._orientation[f], int(held_from[f])))
    return "video", classes, out, skipped


def _video_split(base: Any, all_held: bool, cfg: Any, seed: int) -> np.ndarray:
    """Per file of the video folder dataset ``base``, the first held-out frame: 0 (the whole file
    held out), its frame count (none), or in between (its tail): the start of the first window
    the folder dataset holds out (:meth:`vitp.data.video.VideoFolderDataset.heldout_items`, at the
    pack's clip settings), so that the pack trained at those settings holds out the folder's clips."""
    n = np.asarray([len(t) for t in base._times], dtype=np.int64)
    if all_held:
        return np.zeros(len(n), dtype=np.int64)
    out = n.copy()
    if cfg.heldout_root or cfg.holdout_fraction <= 0:
        return out
    for i in base.heldout_items(cfg.holdout_fraction, seed):  # a file's held-out windows are its tail
        f, (start, _) = base.item_frames(int(i))
        out[f] = min(out[f], start)
    return out


def _heldout_cfg(cfg: Any) -> Any:
    from vitp.data.build import _with_root

    return _with_root(cfg, cfg.heldout_root)


def collect(cfg: Any, seed: int) -> Tuple[str, List[str], List[Sample], Dict[str, str]]:
    """``(kind, classes, samples, skipped files -> reason)`` of the data set ``cfg`` (a ``data``
    section) in item order; the held-out split is the folder version's for images and digits
    (:func:`vitp.data.build.build_datasets` with ``seed``), for videos too, recorded per file as
    its first held-out frame (:func:`_video_split`; ``data.heldout_root``'s files are held out whole).

    Raises ``ValueError`` for data without anything to pack (synthetic, already shards) and what
    building the data set raises."""
    if cfg.name == "digits":
        return _digits(cfg, seed)
    if cfg.name == "image_folder":
        return _images(cfg, seed)
    if cfg.name == "video_folder":
        return _videos(cfg, seed)
    raise ValueError(f"vitp-pack packs data.name=digits, image_folder or video_folder, not {cfg.name}"
                     + (" (synthetic data is generated, there are no files)" if cfg.name == "synthetic" else ""))


def _write_shard(job: Tuple[str, int, List[Tuple[str, Sample]]]) -> Tuple[int, int]:
    """Write one shard (``job``: folder, shard number, ``[(key, sample)]``) through a ``.part``
    file; returns ``(shard number, bytes)``."""
    import webdataset as wds

    out, k, items = job
    final = Path(out) / shard_name(k)
    part = final.with_name(final.name + ".part")
    with wds.TarWriter(str(part), mtime=0) as sink:  # fixed mtime: the same data packs to the same bytes
        for key, sample in items:
            sink.write(sample.files(key))
    with open(part, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(part, final)
    return k, final.stat().st_size


def _prepare(out: Path, digest: str) -> Optional[Dict[str, Any]]:
    """Check that ``out`` is new, empty, a pack of the same config in progress, or a damaged pack
    of the same config (to repair: says so in one line); returns None, or for a repair
    ``{"manifest": its manifest or None}``.

    Raises ``FileExistsError`` for a complete intact pack, another pack in progress, a damaged pack
    of another (or unknown) config, or a folder of other files; ``NotADirectoryError`` when ``out``
    is a file."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is a file: vitp-pack writes a folder; give a new or empty folder's path")
    progress = out / PROGRESS
    if (out / MANIFEST).exists():
        manifest, problems = damage(out)
        if not problems:
            raise FileExistsError(f"{out} already holds a packed data set ({MANIFEST}); train on it with "
                                  f"data=shards data.shards={out}, or choose another output folder")
        what, recorded = "; ".join(problems), recorded_digest(out, manifest, progress)
        if recorded is None:
            raise FileExistsError(f"{out} holds a damaged pack ({what}) and no readable record of the config it was "
                                  f"packed with; delete the folder or pack into another one")
        if recorded != digest:
            raise FileExistsError(f"{out} holds a damaged pack ({what}) of another data config or shard size; run "
                                  f"the command that packed it to repair it, or delete the folder or pack into "
                                  f"another one")
        log.warning(f"{out} is damaged ({what}): repairing it (same config; intact shards are kept)")
        return {"manifest": manifest}
    if progress.exists():
        if json.loads(progress.read_text()).get(DIGEST_KEY) != digest:
            raise FileExistsError(f"{out} holds an interrupted pack of another data config or shard size; delete the "
                                  f"folder or pack into another one")
        return None
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty and holds no pack in progress; choose a new or empty folder")
    return None


def _start(out: Path, digest: str, repair: Optional[Dict[str, Any]]) -> None:
    """Make ``out`` and record the config (after the data set was read, so that bad data settings
    leave no folder behind that a corrected command would be refused); a repair also removes the
    manifest, so that the folder is a pack in progress until the repaired one is written."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / PROGRESS, json.dumps({DIGEST_KEY: digest}) + "\n")
    if repair is not None:
        (out / MANIFEST).unlink()


def pack(cfg: Any, out: Any, *, seed: int = 0, samples_per_shard: int = 1000, workers: int = 1,
         progress: bool = True, text_store: Optional[str] = None, encode_batch: int = 8,
         device: str = "cpu") -> Dict[str, Any]:
    """Pack the data set of ``cfg`` (a ``data`` config section) into ``out``; returns the manifest.

    Parameters
    ----------
    samples_per_shard : samples per shard (the last shard holds the rest)
    workers : processes writing shards (1: this process)
    text_store : a caption store (:mod:`vitp.text.store`) to copy into ``out/text-embeddings``
    encode_batch : with ``cfg.vae`` (a latent pack, :mod:`vitp.latents.pack`): items per VAE call
    device : with ``cfg.vae``: ``cpu``, ``cuda`` (shard ``k`` on GPU ``k`` mod the GPU count) or
        ``auto`` (``cuda`` when there is a GPU)

    Raises
    ------
    FileExistsError
        ``out`` holds a complete intact pack, another pack in progress, a damaged pack of another
        (or unknown) config, or other files. A damaged pack of the same config is repaired: its
        intact shards are kept, the rest is written again.
    ValueError
        ``samples_per_shard`` or ``workers`` below 1, data without anything to pack, and what
        building the data set raises (:func:`collect`).
    """
    from omegaconf import OmegaConf

    if samples_per_shard < 1 or workers < 1:
        raise ValueError(f"samples per shard ({samples_per_shard}) and workers ({workers}) must be >= 1")
    out = Path(out).expanduser()
    cfg_data = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else dict(vars(cfg))
    # a latent shard's bytes depend on the batches it was encoded in: resume only with the same
    digest = config_hash({**cfg_data, "encode_batch": encode_batch} if cfg_data.get("vae") else cfg_data, seed,
                          samples_per_shard)
    repair = _prepare(out, digest)
    extra, writer = None, _write_shard
    if cfg_data.get("vae"):  # latents: encoded by the workers (vitp.latents.pack)
        from vitp.latents.pack import collect_latents, encode_shard, latent_meta

        extra, writer = {"latent": latent_meta(cfg_data)}, encode_shard
        classes, records, items, skipped = collect_latents(cfg, seed)
        samples = [Sample(None, "npy", **r) for r in records]
        kind, work = "latent", [(f"{i:09d}", *it) for i, it in enumerate(items)]
    else:
        kind, classes, samples, skipped = collect(cfg, seed)
        work = [(f"{i:09d}", s) for i, s in enumerate(samples)]
    if not samples:
        raise ValueError("the data set holds no sample to pack")
    _start(out, digest, repair)
    devices = _encode_devices(device) if extra else []
    jobs = [(str(out), k, work[a:a + samples_per_shard])
            + ((cfg_data, seed, encode_batch, devices[k % len(devices)]) if extra else ())
            for k, a in enumerate(range(0, len(work), samples_per_shard))]
    if repair is not None:
        drop_damaged_shards(out, jobs, repair["manifest"])
    sizes = _run_jobs(out, jobs, writer, workers, progress, len(samples))
    return _finish(out, cfg_data, seed, samples_per_shard, kind, classes, samples, skipped, jobs, sizes, text_store,
                   extra, digest)


def _encode_devices(device: str) -> List[str]:
    """The devices latent shards are encoded on, in turn: ``["cpu"]`` or every GPU's ``cuda:i``.
    Raises ``ValueError`` for ``cuda`` without a GPU."""
    import torch

    n = torch.cuda.device_count() if device in ("auto", "cuda") else 0
    if device == "cuda" and not n:
        raise ValueError("--device cuda: no GPU is visible here; use --device cpu (or auto)")
    return [f"cuda:{i}" for i in range(n)] or ["cpu"]


def _run_jobs(out: Path, jobs: list, writer: Any, workers: int, progress: bool, total: int) -> Dict[int, int]:
    """Run ``writer`` on the jobs whose shard is not written yet (in ``workers`` processes), with a
    progress bar of samples; returns ``{shard: bytes}`` of all shards."""
    from vitp.progress import progress_bar

    sizes: Dict[int, int] = {}
    todo = []
    for job in jobs:
        done = out / shard_name(job[1])
        if done.exists():
            sizes[job[1]] = done.stat().st_size  # written by an interrupted run (renamed only when complete)
        else:
            todo.append(job)
    if sizes:
        log.info(f"resuming: {len(sizes)} of {len(jobs)} shards already written")
    bar = progress_bar(total, "vitp-pack", "sample", initial=sum(len(jobs[k][2]) for k in sizes), disable=not progress)
    if workers == 1:
        results = map(writer, todo)
    else:
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"))
        results = pool.map(writer, todo)
    try:
        for k, size in results:
            sizes[k] = size
            bar.update(len(jobs[k][2]))
    finally:
        bar.close()
        if workers > 1:
            pool.shutdown(cancel_futures=True)
    return sizes


def _finish(out: Path, cfg_data: dict, seed: int, per_shard: int, kind: str, classes: List[str],
            samples: List[Sample], skipped: Dict[str, str], jobs: list, sizes: Dict[int, int],
            text_store: Optional[str], extra: Optional[Dict[str, Any]] = None,
            digest: Optional[str] = None) -> Dict[str, Any]:
    """The per-sample arrays and captions of ``samples``, written by :func:`write_metadata`."""
    orientations = sorted({s.orientation for s in samples if s.orientation})
    arrays = {
        "label": np.asarray([s.label for s in samples], dtype=np.int64),
        "heldout": np.asarray([s.heldout for s in samples], dtype=np.uint8),
        "height": np.asarray([s.height for s in samples], dtype=np.int32),
        "width": np.asarray([s.width for s in samples], dtype=np.int32),
        "frames": np.asarray([s.frames for s in samples], dtype=np.int32),
        "fps": np.asarray([s.fps for s in samples], dtype=np.float32),
        "heldout_from": np.asarray([s.heldout_from for s in samples], dtype=np.int32),
        "orientation": np.asarray([orientations.index(s.orientation) + 1 if s.orientation else 0 for s in samples],
                                  dtype=np.int8),
    }
    captions = [s.caption for s in samples] if any(s.caption is not None for s in samples) else None
    shardlist = [{"url": shard_name(job[1]), "nsamples": len(job[2]), "filesize": sizes[job[1]]} for job in jobs]
    return write_metadata(out, arrays, captions, shardlist, cfg_data=cfg_data, seed=seed, per_shard=per_shard,
                          kind=kind, classes=classes, skipped=skipped, orientations=orientations,
                          text_store=text_store, extra=extra, config_sha256=digest)


_COMPACT = ("label", "frames", "heldout_from", "height", "width")  # read whole at start-up: stored small


def _compact(a: np.ndarray) -> np.ndarray:
    """The int array ``a`` in int16 when its values fit, else int32 when they fit (start-up
    memory-maps these arrays: bytes per sample on every rank)."""
    lo, hi = (int(a.min()), int(a.max())) if a.size else (0, 0)
    for t in (np.int16, np.int32):
        if np.iinfo(t).min <= lo and hi <= np.iinfo(t).max:
            return a.astype(t)
    return a


def write_metadata(out: Path, arrays: Dict[str, np.ndarray], captions: Optional[Sequence[Optional[str]]],
                   shardlist: List[Dict[str, Any]], *, cfg_data: dict, seed: int, per_shard: int, kind: str,
                   classes: List[str], skipped: Dict[str, str], orientations: List[str],
                   text_store: Optional[str], extra: Optional[Dict[str, Any]] = None,
                   config_sha256: Optional[str] = None) -> Dict[str, Any]:
    """Write a pack's files other than its shards into ``out``: ``samples.safetensors`` (``arrays``,
    one entry per sample: the layout in :mod:`vitp.data.shards`; ``captioned`` is added when there
    are captions), ``captions.jsonl`` and its line offsets (``captions``: str or None per sample;
    None: no captions), the caption store (copied from ``text_store``) and, last, the manifest
    (``shardlist``: ``{"url", "nsamples", "filesize"}`` per shard). ``config_sha256``: the digest
    of the config packed (the resume check's), recorded in the manifest and in ``samples.safetensors``'s
    metadata, so that a damaged pack is repaired only by the same config. Returns the manifest."""
    arrays = {k: _compact(np.asarray(v)) if k in _COMPACT else v for k, v in arrays.items()}
    if captions is not None:  # which samples have one: read at start-up instead of the captions file
        arrays = dict(arrays, captioned=np.asarray([c is not None for c in captions], dtype=np.uint8))
    save_safetensors(arrays, out / SAMPLES, metadata=None if config_sha256 is None else {DIGEST_KEY: config_sha256})
    if captions is not None:
        atomic_write_text(out / CAPTIONS, "".join(json.dumps(c) + "\n" for c in captions))
        write_caption_offsets(out / CAPTIONS)  # each line read on its own when training
    if text_store is not None:
        if (out / TEXT_STORE).exists():
            shutil.rmtree(out / TEXT_STORE)
        shutil.copytree(text_store, out / TEXT_STORE)
    manifest = {
        "__kind__": "wids-shard-index-v1", "wids_version": 1, "name": out.name, "shardlist": shardlist,
        "vitp": _summary(cfg_data, seed, per_shard, kind, classes, range(len(arrays["label"])), skipped, arrays,
                         orientations, captions is not None, text_store is not None),
    }
    manifest["vitp"].update(extra or {})  # a latent pack: its VAE and shapes (vitp.latents.pack.latent_meta)
    manifest["vitp"]["bytes"] = sum(s["filesize"] for s in shardlist)
    if config_sha256 is not None:
        manifest["vitp"][DIGEST_KEY] = config_sha256
    atomic_write_text(out / MANIFEST, json.dumps(manifest, indent=1) + "\n")
    (out / PROGRESS).unlink(missing_ok=True)
    return manifest


def _summary(cfg_data: dict, seed: int, per_shard: int, kind: str, classes: List[str], samples: Sequence[Any],
             skipped: Dict[str, str], arrays: Dict[str, np.ndarray], orientations: List[str], captioned: bool,
             text: bool) -> Dict[str, Any]:
    """The manifest's ``vitp`` section: what was packed, counts, shapes, skips, the split."""
    held = arrays["heldout"].astype(bool)
    shapes: Dict[str, int] = {}
    for h, w in zip(arrays["height"].tolist(), arrays["width"].tolist()):
        shapes[f"{h}x{w}"] = shapes.get(f"{h}x{w}", 0) + 1
    top = dict(sorted(shapes.items(), key=lambda kv: -kv[1])[:20])
    meta = {
        "format": FORMAT, "version": VERSION, "kind": kind, "classes": classes,
        "num_samples": len(samples), "num_train": int((~held).sum()), "num_heldout": int(held.sum()),
        "samples_per_class": {c: int((arrays["label"] == i).sum()) for i, c in enumerate(classes)},
        "samples_per_shard": per_shard, "bytes": None,
        "shapes": {"distinct": len(shapes), "most_common": top},
        "skipped": [{"file": f, "reason": r} for f, r in skipped.items()],
        "holdout": {"fraction": cfg_data.get("holdout_fraction"), "heldout_root": cfg_data.get("heldout_root"),
                    "seed": seed, "unit": "file" if kind == "video" else "sample"},
        "captions": captioned, "text_embeddings": TEXT_STORE if text else None,
        "orientations": orientations, "source": cfg_data,
    }
    if kind == "video":
        f = arrays["frames"]
        meta["heldout_tails"] = int(((arrays["heldout_from"] > 0) & (arrays["heldout_from"] < f)).sum())
        meta["frames"] = {"min": int(f.min()), "max": int(f.max()), "mean": float(f.mean()),
                          "seconds": float((f / np.maximum(arrays["fps"], 1e-6)).sum())}
    return meta
