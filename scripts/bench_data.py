#!/usr/bin/env python
"""Data-loading benchmark (issue 27): image and video folders against the same data packed into shards.

    OMP_NUM_THREADS=1 python scripts/bench_data.py --work /tmp/bench_data --out bench_data.json
    OMP_NUM_THREADS=1 python scripts/bench_data.py --work DIR --images 300 --clips 6 --batches 3 --reps 1  # smoke

1. Writes a synthetic data set into ``--work`` (kept and reused by later runs with the same sizes):
   ``--images`` 32x32 JPEGs in 10 class folders and ``--clips`` 16-24 frame 32x32 H.264 mp4 clips
   in 3 class folders (PIL and PyAV, in a process pool).
2. Packs each with ``vitp-pack`` (:func:`vitp.cli.pack.run`, 2 workers): pack time and bytes.
3. Measures each case (image folder, image shards, video folder, video shards, and the video
   folder again with the probe index its cold run just wrote) in a fresh subprocess, interleaved
   over ``--reps`` repetitions (folder, shards, folder, shards, ...):

   - ``startup_s``: ``build_datasets(cfg.data, seed)`` + vitp's real training loader
     (:func:`vitp.data.loader.train_loader` over a :class:`~vitp.data.loader.BatchSchedule` with the
     training set's ``groups`` and ``data.shuffle_window``, as the trainer builds it; ``FlowCollate``
     with the default objective and class labels) until the first batch arrives, worker start
     included. Imports and config composition are reported apart (``import_s``, ``config_s``);
   - ``samples_per_s``: ``--batches`` batches after the first with ``--workers`` DataLoader workers
     (videos: ``data.video_cache_mb=0`` by default, every clip read decodes; ``--video-cache-mb``);
   - ``peak_pss_mb`` / ``peak_rss_mb``: peak of the summed PSS / RSS of the process tree (main +
     DataLoader workers), polled every 50 ms from this process (``/proc/<pid>/smaps_rollup``; the
     tree from psutil, else ``/proc``). PSS shares each page among the processes mapping it: the
     tree's physical memory. RSS counts the pages the forked workers share with the main process
     (torch, the data set's lists) once per process, so it overstates; PSS also shares the pages of
     libraries other processes of the machine map (another torch job lowers it). The child reports
     its own ``VmHWM`` (``main_hwm_mb``) as a cross-check; ``ru_maxrss`` is not used (see
     :func:`_own_peaks`).

The video folder probes every file at start-up (decodes all frames; cached in a JSON index under
``data.cache_dir``): each ``video_folder`` run gets a fresh cache folder (cold: a data set's first
run), ``video_folder_warm`` reuses the one the cold run of the same repetition wrote. The image
folder decode-checks every image at start-up (``ImageFolderDataset._scan``) on every run.
Every repetition reads through the OS page cache, warm after the data were written: the numbers are
not cold-disk numbers.

Prints a table (median and min-max per metric, ratio shards / folder of the medians) and writes
all runs and the summary as JSON with ``--out``.

Start-up growth with the data set (issue 40)::

    OMP_NUM_THREADS=1 python scripts/bench_data.py --startup 10000,100000,1000000 --kind video --captions --out F

writes a synthetic pack of each size into ``--work`` (its metadata files with vitp-pack's own writer,
:func:`vitp.data.pack.write_metadata`; the shards are sparse files of the listed sizes: start-up
never opens them), then times ``build_datasets(cfg.data, seed)`` with ``data=shards`` (the training
and held-out datasets, one process) in a fresh subprocess per size, and writes
``{"startup": [{"samples", "build_s", "bytes_per_sample", ...}, ...]}``: ``bytes_per_sample`` is the
peak RSS growth of the build (``VmHWM`` after it, reset with ``/proc/self/clear_refs`` just before,
minus ``VmRSS`` before) over the samples, after one build of a 200-sample pack in the same process
(imports and one-off set-up are not growth). Videos: 16-48 frames at 24, 25, 29.97 or 30 fps, clips of 8
frames at stride 2, one file in ten held out; images: one in fifty held out. Half the samples are
32x48, half 48x32: ``--buckets 1`` builds one bucket (32x48) holding them all, ``--buckets 2`` two
buckets splitting them (the data set of each bucket, as a bucketed run builds them).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

IMAGE_CLASSES, CLIP_CLASSES, SIZE = 10, 3, 32
RESULT = "BENCH_DATA_RESULT "  # the child's result line
METRICS = ("startup_s", "samples_per_s", "peak_pss_mb", "peak_rss_mb", "build_s", "first_batch_s", "import_s")
PAIRS = {"images": ("image_folder", "image_shards"), "videos": ("video_folder", "video_shards")}


# ------------------------------------------------------------------------------------ data set
def _image(i: int) -> Any:
    """Image ``i``: a random 4x4 colour field upsampled to 32x32, a class tint and pixel noise
    (compresses like a small photo, unlike pure noise)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(i)
    low = Image.fromarray(rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)).resize((SIZE, SIZE), Image.BILINEAR)
    tint = np.array([(i % IMAGE_CLASSES) * 25, 128, 255 - (i % IMAGE_CLASSES) * 25], dtype=np.float32)
    px = 0.7 * np.asarray(low, dtype=np.float32) + 0.3 * tint + rng.normal(0, 8, (SIZE, SIZE, 3))
    return Image.fromarray(np.clip(px, 0, 255).astype(np.uint8))


def _write_images(job) -> int:
    root, lo, hi = job
    for i in range(lo, hi):
        _image(i).save(Path(root) / f"c{i % IMAGE_CLASSES}" / f"{i:07d}.jpg", quality=90)
    return hi - lo


def _write_clips(job) -> int:
    """Clips ``lo..hi-1``: 16-24 frames of a bright square moving over a gradient, H.264 at 24 fps."""
    import av
    import numpy as np

    root, lo, hi = job
    for i in range(lo, hi):
        rng = np.random.default_rng(i)
        frames, (dy, dx) = 16 + i % 9, rng.integers(-2, 3, 2)
        base = np.linspace(0, 200, SIZE * SIZE * 3).reshape(SIZE, SIZE, 3).astype(np.uint8)
        base[..., i % 3] = 40 * (i % CLIP_CLASSES)
        with av.open(str(Path(root) / f"c{i % CLIP_CLASSES}" / f"{i:06d}.mp4"), "w") as out:
            stream = out.add_stream("libx264", rate=24)
            stream.width, stream.height, stream.pix_fmt = SIZE, SIZE, "yuv420p"
            y, x = rng.integers(0, SIZE - 8, 2)
            for k in range(frames):
                px = base.copy()
                yy, xx = (y + k * dy) % (SIZE - 8), (x + k * dx) % (SIZE - 8)
                px[yy:yy + 8, xx:xx + 8] = 255
                for packet in stream.encode(av.VideoFrame.from_ndarray(px, format="rgb24")):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
    return hi - lo


def make_folder(root: Path, n: int, classes: int, writer, workers: int) -> Dict[str, Any]:
    """``n`` files in ``classes`` class folders under ``root``, written into ``root.part`` and
    renamed, so a present ``root`` is complete and reused (with the time recorded in
    ``root.gen.json``); returns seconds, files, bytes and whether it was reused."""
    record = root.with_name(root.name + ".gen.json")
    if root.is_dir() and record.is_file():
        return {**json.loads(record.read_text()), "reused": True}
    start = time.perf_counter()
    part = root.with_name(root.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    for c in range(classes):
        (part / f"c{c}").mkdir(parents=True)
    chunk = max(1, min(1000, n // (4 * workers)))
    jobs = [(str(part), lo, min(n, lo + chunk)) for lo in range(0, n, chunk)]
    with get_context("fork").Pool(workers) as pool:
        assert sum(pool.imap_unordered(writer, jobs)) == n
    part.rename(root)
    files = [p for p in root.rglob("*") if p.is_file()]
    rec = {"files": len(files), "bytes": sum(p.stat().st_size for p in files),
           "seconds": round(time.perf_counter() - start, 3)}
    record.write_text(json.dumps(rec))
    return {**rec, "reused": False}


def pack_folder(out: Path, overrides: List[str], per_shard: int) -> Dict[str, Any]:
    """``vitp-pack out`` of the data ``overrides`` name (2 workers); a complete pack is reused with
    its recorded time (``out.pack.json``). Returns seconds, bytes, shards, samples."""
    from vitp.cli.pack import run

    record = out.with_name(out.name + ".pack.json")
    if (out / "index.json").is_file() and record.is_file():
        return {**json.loads(record.read_text()), "reused": True}
    start = time.perf_counter()
    manifest = run([str(out), "--workers", "2", "--quiet", "--samples-per-shard", str(per_shard), *overrides])
    m = manifest["vitp"]
    rec = {"seconds": round(time.perf_counter() - start, 3), "bytes": int(m["bytes"]),
           "shards": len(manifest["shardlist"]), "samples": int(m["num_samples"])}
    record.write_text(json.dumps(rec))
    return {**rec, "reused": False}


def data_overrides(a: argparse.Namespace, work: Path) -> Dict[str, List[str]]:
    """The ``data`` overrides of the image and the video data set (shared by packing and the cases)."""
    return {
        "images": ["data=image_folder", f"data.root={work / f'images-{a.images}'}",
                   f"data.num_classes={IMAGE_CLASSES}", f"data.resolution={SIZE}", "data.channels=3"],
        "videos": ["data=video_folder", f"data.root={work / f'clips-{a.clips}'}", f"data.num_classes={CLIP_CLASSES}",
                   f"data.resolution={SIZE}", "data.channels=3", "data.num_frames=8", "data.frame_stride=2",
                   f"data.video_cache_mb={a.video_cache_mb}"],
    }


def prepare(a: argparse.Namespace, work: Path) -> Dict[str, Any]:
    """Write (or reuse) both folders and their packs; returns their sizes and times."""
    ov = data_overrides(a, work)
    cache = work / "cache" / "pack"
    info = {"images": make_folder(work / f"images-{a.images}", a.images, IMAGE_CLASSES, _write_images, a.gen_workers),
            "clips": make_folder(work / f"clips-{a.clips}", a.clips, CLIP_CLASSES, _write_clips, a.gen_workers)}
    info["pack_images"] = pack_folder(work / f"images-{a.images}-shards", ov["images"], a.image_shard_size)
    info["pack_videos"] = pack_folder(work / f"clips-{a.clips}-shards", ov["videos"] + [f"data.cache_dir={cache}"],
                                      a.clip_shard_size)
    return info


# ------------------------------------------------------------------------ one case, in a child
def measure(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One case in this (fresh) process: ``spec`` holds ``overrides``, ``batch``, ``batches``,
    ``workers``, ``seed``. Returns the times (s), samples/s, rusage maxrss (MB) and the batch shape."""
    t0 = time.perf_counter()
    import torch  # noqa: F401 - imported here so that import_s holds it

    from vitp.cli.overrides import compose_checked
    from vitp.data import build_datasets
    from vitp.data.loader import BatchSchedule, LoaderBatches, train_loader

    t1 = time.perf_counter()
    cfg = compose_checked(spec["overrides"])
    t2 = time.perf_counter()
    train, _ = build_datasets(cfg.data, spec["seed"])
    t3 = time.perf_counter()
    b, n = spec["batch"], spec["batches"]
    schedule = BatchSchedule(len(train), b, b, 1, spec["seed"], getattr(train, "groups", None),
                             cfg.data.shuffle_window)  # as vitp.train.trainer builds it
    batches = LoaderBatches(train_loader(train, schedule, cfg.objective, cfg.data.num_classes, start_step=0,
                                         stop_step=n + 1, dp_rank=0, num_workers=spec["workers"]))
    _, targets = next(batches)
    t4 = time.perf_counter()
    for _ in range(n):
        next(batches)
    t5 = time.perf_counter()
    batches.close()
    return {"import_s": t1 - t0, "config_s": t2 - t1, "build_s": t3 - t2, "first_batch_s": t4 - t3,
            "startup_s": t4 - t2, "samples_per_s": n * b / (t5 - t4), "train_items": len(train),
            "groups": None if getattr(train, "groups", None) is None else len(train.groups),
            "x_shape": list(targets[0].shape), **_own_peaks()}


def _own_peaks() -> Dict[str, float]:
    """``main_hwm_mb``: this process's peak RSS as the kernel keeps it (``VmHWM``), a cross-check of
    the polled figures. A lower bound: the kernel updates it lazily (read at the end it was 627 MB
    where polling saw 730 MB). Not ``ru_maxrss``: Linux carries it over fork + exec (a child reports
    its launcher's RSS when that was larger; a DataLoader worker, its parent's at the fork), and
    ``RUSAGE_CHILDREN`` holds the 430 MB of a helper process that ``import torch`` forks."""
    try:
        status = Path("/proc/self/status").read_text()
        return {"main_hwm_mb": int(next(x for x in status.splitlines() if x.startswith("VmHWM:")).split()[1]) / 1024}
    except (OSError, StopIteration, ValueError):  # no /proc
        return {"main_hwm_mb": float("nan")}


def _tree_pids(pid: int) -> List[int]:
    """``pid`` and its descendants (psutil, else ``/proc/<pid>/task/*/children``)."""
    try:
        import psutil

        p = psutil.Process(pid)
        return [pid] + [c.pid for c in p.children(recursive=True)]
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess: gone
        return []
    out, todo = [], [pid]
    while todo:
        q = todo.pop()
        out.append(q)
        try:
            for task in Path(f"/proc/{q}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            pass
    return out


def _tree_memory(pid: int) -> Tuple[int, int]:
    """``(RSS, PSS)`` in bytes summed over ``pid`` and its descendants (``/proc/<pid>/smaps_rollup``,
    Linux >= 4.14; PSS splits each shared page between the processes mapping it, so the sum is the
    tree's physical memory; RSS counts a page the forked workers share with the main process once
    per process). Without smaps_rollup: ``VmRSS`` for both. 0 for processes that are gone."""
    rss = pss = 0
    for q in _tree_pids(pid):
        try:
            text = Path(f"/proc/{q}/smaps_rollup").read_text()
            fields = dict(x.split(":", 1) for x in text.splitlines()[1:] if ":" in x)
            r, s = (int(fields[k].split()[0]) * 1024 for k in ("Rss", "Pss"))
        except (OSError, KeyError, ValueError):
            try:
                status = Path(f"/proc/{q}/status").read_text()
                r = s = int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1]) * 1024
            except (OSError, StopIteration, ValueError):
                continue
        rss, pss = rss + r, pss + s
    return rss, pss


def run_case(spec: Dict[str, Any], timeout: float) -> Dict[str, Any]:
    """``measure(spec)`` in a fresh interpreter, its process tree's RSS and PSS polled every 50 ms
    from here."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "NO_ALBUMENTATIONS_UPDATE": "1"}
    start = time.perf_counter()
    p = subprocess.Popen([sys.executable, __file__, "--child", json.dumps(spec)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    peak = (0, 0)
    while p.poll() is None:
        peak = tuple(max(x, y) for x, y in zip(peak, _tree_memory(p.pid)))
        if time.perf_counter() - start > timeout:
            p.kill()
            raise SystemExit(f"case {spec['case']} ran past {timeout:.0f} s; lower --batches or raise --timeout")
        time.sleep(0.05)
    out, err = p.communicate()
    lines = [x for x in out.splitlines() if x.startswith(RESULT)]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"case {spec['case']} failed (exit {p.returncode}):\n{err[-3000:]}")
    res = json.loads(lines[-1][len(RESULT):])
    return {"case": spec["case"], "rep": spec["rep"], **res, "peak_rss_mb": peak[0] / 2 ** 20,
            "peak_pss_mb": peak[1] / 2 ** 20, "process_wall_s": time.perf_counter() - start}


# ------------------------------------------------------------------------------------- driver
def case_specs(a: argparse.Namespace, work: Path, rep: int) -> List[Dict[str, Any]]:
    """The cases of repetition ``rep`` in run order (folder, shards, ...); the video folder gets a
    fresh probe cache folder (cold), ``video_folder_warm`` the one its cold run wrote."""
    ov = data_overrides(a, work)
    cache = work / "cache" / f"rep{rep}"
    shutil.rmtree(cache, ignore_errors=True)
    shards = {"images": work / f"images-{a.images}-shards", "videos": work / f"clips-{a.clips}-shards"}

    def shard_ov(kind: str) -> List[str]:  # same resolution, classes and clip settings, data from the pack
        return ["data=shards", f"data.shards={shards[kind]}"] + [o for o in ov[kind][2:]] + (
            ["data.num_frames=1"] if kind == "images" else [])

    common = {"workers": a.workers, "batches": a.batches, "seed": 0, "rep": rep}
    cases = [("image_folder", ov["images"], a.batch), ("image_shards", shard_ov("images"), a.batch),
             ("video_folder", ov["videos"] + [f"data.cache_dir={cache}"], a.clip_batch),
             ("video_shards", shard_ov("videos"), a.clip_batch)]
    if not a.no_warm:
        cases.append(("video_folder_warm", ov["videos"] + [f"data.cache_dir={cache}"], a.clip_batch))
    return [{**common, "case": name, "overrides": o, "batch": b} for name, o, b in cases]


def summarize(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per case and metric: median, min, max over the repetitions; per data kind: shards / folder
    of the medians."""
    summary: Dict[str, Dict[str, Any]] = {}
    for case in dict.fromkeys(r["case"] for r in runs):
        rows = [r for r in runs if r["case"] == case]
        summary[case] = {m: {"median": statistics.median(r[m] for r in rows), "min": min(r[m] for r in rows),
                             "max": max(r[m] for r in rows)} for m in METRICS}
    ratios = {kind: {m: summary[s][m]["median"] / summary[f][m]["median"] for m in METRICS}
              for kind, (f, s) in PAIRS.items() if f in summary and s in summary}
    return {"summary": summary, "ratios_shards_over_folder": ratios}


def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.2f}" if abs(x) >= 1 else f"{x:.3f}"


def table(res: Dict[str, Any]) -> str:
    """The summary as a fixed-width table: median [min-max] per metric, then the ratios."""
    cols = ("startup_s", "samples_per_s", "peak_pss_mb", "peak_rss_mb", "build_s", "first_batch_s")
    lines = [f"{'case':<21}" + "".join(f"{c:>22}" for c in cols)]
    for case, row in res["summary"].items():
        lines.append(f"{case:<21}" + "".join(
            f"{_num(row[c]['median'])} [{_num(row[c]['min'])}-{_num(row[c]['max'])}]".rjust(22) for c in cols))
    for kind, r in res["ratios_shards_over_folder"].items():
        lines.append(f"{kind + ' shards/folder':<21}" + "".join(f"{r[c]:>22.3f}" for c in cols))
    return "\n".join(lines)


STARTUP_SHARD = 1000  # samples per synthetic shard
BUCKETS = {0: [], 1: ["data.buckets=[{resolution:32x48,batch_size:8}]"],  # --buckets: data.buckets of the build
           2: ["data.buckets=[{resolution:32x48,batch_size:8},{resolution:48x32,batch_size:8}]"]}
STARTUP_RATES = (24.0, 25.0, 29.97, 30.0)


def synthetic_pack(out: Path, n: int, kind: str, captions: bool) -> List[str]:
    """Write a pack of ``n`` synthetic samples (``kind`` "image" or "video", 10 classes) into ``out``:
    metadata with :func:`vitp.data.pack.write_metadata`, sparse shard files of the listed sizes.
    Returns the overrides that train on it."""
    import numpy as np

    from vitp.data.pack import shard_name, write_metadata

    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(n)
    video = kind == "video"
    label = rng.integers(0, IMAGE_CLASSES, n).astype(np.int64)
    frames = rng.integers(16, 49, n).astype(np.int32) if video else np.ones(n, np.int32)
    held = (np.arange(n) % (10 if video else 50)) == 0
    wide = np.arange(n) % 2 == 0  # two aspect ratios: --buckets 2 splits the items between them
    arrays = {"label": label, "heldout": held.astype(np.uint8), "height": np.where(wide, 32, 48).astype(np.int32),
              "width": np.where(wide, 48, 32).astype(np.int32), "frames": frames,
              "fps": (np.asarray(STARTUP_RATES, np.float32)[np.arange(n) % 4] if video else np.zeros(n, np.float32)),
              "heldout_from": np.where(held, 0, frames).astype(np.int32), "orientation": np.zeros(n, np.int8)}
    shardlist = []
    for k, a in enumerate(range(0, n, STARTUP_SHARD)):
        size = 2048 * (min(n, a + STARTUP_SHARD) - a)  # what start-up stats: the pixels are never read
        with open(out / shard_name(k), "wb") as f:
            f.truncate(size)  # sparse
        shardlist.append({"url": shard_name(k), "nsamples": min(n, a + STARTUP_SHARD) - a, "filesize": size})
    caps = [f"a {'clip' if video else 'photo'} of class {c}, number {i}" if i % 97 else None
            for i, c in enumerate(label.tolist())] if captions else None
    classes = [f"class{c}" for c in range(IMAGE_CLASSES)]
    write_metadata(out, arrays, caps, shardlist, cfg_data={"name": "synthetic"}, seed=0, per_shard=STARTUP_SHARD,
                   kind=kind, classes=classes, skipped={}, orientations=[], text_store=None)
    return _startup_overrides(out, kind)


def _proc_kb(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def measure_startup(spec: Dict[str, Any]) -> Dict[str, Any]:
    """In this (fresh) process: ``build_datasets`` of the pack ``spec["overrides"]`` name; seconds and
    the peak RSS growth it caused (bytes; ``VmHWM`` reset just before where the kernel allows)."""
    from vitp.cli.overrides import compose_checked
    from vitp.data import build_datasets

    from vitp.data.buckets import bucket_datasets

    cfg = compose_checked(spec["overrides"] + BUCKETS[spec.get("buckets", 0)])
    build_datasets(compose_checked(spec["warmup"]).data, spec["seed"])  # imports and one-off set-up: not growth
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
    except OSError:
        pass
    before = _proc_kb("VmRSS")
    t0 = time.perf_counter()
    pairs = (bucket_datasets(cfg.data, spec["seed"], build_datasets) if cfg.data.buckets else
             [build_datasets(cfg.data, spec["seed"])])
    build_s = time.perf_counter() - t0
    growth = max(0, _proc_kb("VmHWM") - before) * 1024
    return {"samples": spec["samples"], "buckets": spec.get("buckets", 0), "build_s": build_s,
            "bytes_per_sample": growth / spec["samples"], "peak_growth_mb": growth / 2**20,
            "train_items": sum(len(t) for t, _ in pairs), "heldout_items": sum(len(h) for _, h in pairs),
            "train_items_per_bucket": [len(t) for t, _ in pairs]}


def run_startup(a: argparse.Namespace, work: Path) -> Dict[str, Any]:
    """``--startup``: a synthetic pack per size, each built in a fresh subprocess."""
    rows, warm = [], work / f"startup_{a.kind}_warmup{'_captions' if a.captions else ''}"
    if not (warm / "index.json").is_file():
        synthetic_pack(warm, 200, a.kind, a.captions)
    for n in a.startup:
        out = work / f"startup_{a.kind}_{n}{'_captions' if a.captions else ''}"
        if not (out / "index.json").is_file():
            t0 = time.perf_counter()
            synthetic_pack(out, n, a.kind, a.captions)
            print(f"wrote a synthetic {a.kind} pack of {n} samples in {time.perf_counter() - t0:.1f} s", flush=True)
        spec = {"overrides": _startup_overrides(out, a.kind), "warmup": _startup_overrides(warm, a.kind), "seed": 0,
                "buckets": a.buckets,
                "samples": n}
        p = subprocess.run([sys.executable, __file__, "--startup-child", json.dumps(spec)], capture_output=True,
                           text=True, timeout=a.timeout)
        lines = [x for x in p.stdout.splitlines() if x.startswith(RESULT)]
        if p.returncode or not lines:
            raise RuntimeError(f"the start-up run of {n} samples failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
        rows.append(json.loads(lines[-1][len(RESULT):]))
        r = rows[-1]
        print(f"{n:>9} samples: build {r['build_s']:.2f} s, {r['bytes_per_sample']:.1f} bytes/sample "
              f"({r['train_items']} training / {r['heldout_items']} held-out items)", flush=True)
    return {"startup": rows, "kind": a.kind, "captions": a.captions, "buckets": a.buckets,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpu_count": os.cpu_count()}


def _startup_overrides(out: Path, kind: str) -> List[str]:
    """The overrides that build the synthetic pack at ``out``."""
    over = ["data=shards", f"data.shards={out}", f"data.num_classes={IMAGE_CLASSES}", "data.resolution=32",
            "data.channels=3"]
    return over + (["data.num_frames=8", "data.frame_stride=2"] if kind == "video" else ["data.num_frames=1"])


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "vitp-bench-data",
                   help="folder of the data sets, reused by later runs (default: in the system's temp folder, not here)")
    p.add_argument("--out", type=Path, default=None, help="write the runs and the summary here as JSON")
    p.add_argument("--images", type=int, default=100_000, help="32x32 JPEG images (10 classes)")
    p.add_argument("--clips", type=int, default=1000, help="16-24 frame 32x32 mp4 clips (3 classes)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every case, interleaved")
    p.add_argument("--batches", type=int, default=50, help="batches timed after the first")
    p.add_argument("--batch", type=int, default=64, help="images per batch")
    p.add_argument("--clip-batch", type=int, default=8, help="clips (8 frames, stride 2) per batch")
    p.add_argument("--video-cache-mb", type=float, default=0.0,
                   help="data.video_cache_mb of the video cases (default 0: every read decodes, as for a data set "
                        "too large to keep decoded; 256, vitp's default, decodes each clip once per worker)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--gen-workers", type=int, default=2, help="processes writing the synthetic files")
    p.add_argument("--image-shard-size", type=int, default=1000, help="images per shard")
    p.add_argument("--clip-shard-size", type=int, default=100, help="clips per shard")
    p.add_argument("--no-warm", action="store_true", help="skip video_folder_warm (probe index cached)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds one case may run")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--startup", default=None, help="start-up mode: comma-separated pack sizes, e.g. 10000,100000")
    p.add_argument("--kind", choices=("image", "video"), default="video", help="--startup: samples' kind")
    p.add_argument("--captions", action="store_true", help="--startup: the packs have captions")
    p.add_argument("--buckets", type=int, choices=(0, 1, 2), default=0,
                   help="--startup: shape buckets of the build (0: none; 1: 32x48; 2: 32x48 and 48x32, which split "
                        "the synthetic samples' two aspect ratios)")
    p.add_argument("--startup-child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.startup is not None:
        try:
            a.startup = [int(x) for x in a.startup.split(",")]
        except ValueError:
            p.error(f"--startup {a.startup}: use comma-separated sample counts, e.g. 10000,100000")
        if min(a.startup) < 100:
            p.error(f"--startup {a.startup}: use sizes of at least 100 samples")
    for k in ("images", "clips", "reps", "batches", "batch", "clip_batch", "gen_workers"):
        if getattr(a, k) < 1:
            p.error(f"--{k.replace('_', '-')} {getattr(a, k)}: use a positive number")
    if a.images < 2 * IMAGE_CLASSES or a.clips < 2 * CLIP_CLASSES:
        p.error(f"use --images >= {2 * IMAGE_CLASSES} and --clips >= {2 * CLIP_CLASSES} (two per class: one is "
                f"held out)")
    return a


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    a = parse_args(argv)
    if a.child is not None:
        print(RESULT + json.dumps(measure(json.loads(a.child))), flush=True)
        return {}
    if a.startup_child is not None:
        print(RESULT + json.dumps(measure_startup(json.loads(a.startup_child))), flush=True)
        return {}
    work = a.work.expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    if a.startup is not None:
        res = run_startup(a, work)
        if a.out is not None:
            a.out.write_text(json.dumps(res, indent=1))
        return res
    data = prepare(a, work)
    runs = []
    for rep in range(a.reps):
        for spec in case_specs(a, work, rep):
            runs.append(run_case(spec, a.timeout))
            r = runs[-1]
            print(f"rep {rep} {r['case']:<18} startup {r['startup_s']:.2f} s, {r['samples_per_s']:.0f} samples/s, "
                  f"peak PSS {r['peak_pss_mb']:.0f} MB", flush=True)
    args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items() if k != "child"}
    res = {"args": args, "data": data, **summarize(runs), "runs": runs,
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpu_count": os.cpu_count(),
           "notes": ["startup_s = build_datasets + DataLoader (vitp train_loader) until the first batch, "
                     "imports and config composition excluded (import_s, config_s)",
                     "video_folder: fresh probe cache (cold); video_folder_warm: the probe index cached",
                     "OS page cache warm in every repetition (data just written / read)",
                     "peak_pss_mb / peak_rss_mb: summed PSS / RSS of main + workers polled every 50 ms (RSS "
                     "counts shared pages once per process)"]}
    print(table(res))
    if a.out is not None:
        a.out.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
