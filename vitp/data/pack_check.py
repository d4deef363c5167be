"""What is damaged in a pack folder that ``vitp-pack`` is run on again, and which config wrote it.

:func:`damage` lists the damaged files of a pack (``index.json`` unreadable or not a vitp
manifest; ``samples.safetensors``, ``captions.jsonl`` or ``captions.idx.npy`` missing or damaged;
shards missing or of another size than the manifest says): the files the reader
(:class:`vitp.data.shards.ShardIndex`) refuses, so that re-running the same ``vitp-pack`` command
repairs what training refused. :func:`recorded_digest` is the config digest the pack was written
with (the resume check's): from the progress record, the manifest or ``samples.safetensors``'s
metadata. :func:`drop_damaged_shards` removes the shards a repair writes again.
"""
from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from vitp.data.shards import _ARRAYS, CAPTION_OFFSETS, CAPTIONS, FORMAT, MANIFEST, SAMPLES, VERSION, shard_name

DIGEST_KEY = "config_sha256"  # the config digest: in the progress record, the manifest, samples.safetensors


def config_hash(cfg_data: dict, seed: int, per_shard: int) -> str:
    """The digest of a pack's config: its ``data`` section, seed and samples per shard."""
    text = json.dumps({"data": cfg_data, "seed": seed, "samples_per_shard": per_shard}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def read_manifest(out: Path) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """``(manifest, None)`` for a usable vitp manifest in ``out``, else ``(None, why)``."""
    try:
        spec = json.loads((out / MANIFEST).read_bytes())
    except ValueError as e:
        return None, f"is not JSON ({e})"
    meta = spec.get("vitp") if isinstance(spec, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        return None, f"is not a {FORMAT} v{VERSION} manifest"
    try:
        for s in spec["shardlist"]:
            int(s["nsamples"]), int(s["filesize"]), str(s["url"])
        list(meta["classes"]), str(meta["kind"])
    except (KeyError, TypeError, ValueError) as e:
        return None, f"has no usable {e} entry"
    return spec, None


def damage(out: Path) -> Tuple[Optional[Dict[str, Any]], List[str]]:
    """``(manifest, problems)`` of the pack in ``out``: its manifest (None when ``index.json`` is
    not a usable vitp manifest) and one phrase per damaged file (empty: the pack is intact).
    Captions are parsed whole: a line the reader would refuse when asked counts as damage."""
    manifest, why = read_manifest(out)
    problems = [] if why is None else [f"{MANIFEST} {why}"]
    n = None if manifest is None else sum(int(s["nsamples"]) for s in manifest["shardlist"])
    arrays, bad = _samples(out, n)
    problems += bad
    if n is None and arrays is not None and "label" in arrays:
        n = len(arrays["label"])
    if (manifest["vitp"].get("captions") if manifest else (out / CAPTIONS).exists()):
        problems += _captions(out, n)
    if manifest is not None:
        wrong = [s["url"] for s in manifest["shardlist"]
                 if not (out / s["url"]).is_file() or (out / s["url"]).stat().st_size != int(s["filesize"])]
        if wrong:
            problems.append(f"{', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''} ({len(wrong)} of the "
                            f"{len(manifest['shardlist'])} shards) missing or of another size than packed")
    return manifest, problems


def _samples(out: Path, n: Optional[int]) -> Tuple[Optional[Dict[str, np.ndarray]], List[str]]:
    """``samples.safetensors``'s arrays (None when unreadable) and its problems."""
    from vitp.data.shards import _load_samples

    if not (out / SAMPLES).is_file():
        return None, [f"{SAMPLES} is missing"]
    try:
        arrays = {k: np.array(v) for k, v in _load_samples(str(out / SAMPLES)).items()}  # copies: no map left open
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type for a damaged file
        return None, [f"{SAMPLES} is damaged ({type(e).__name__}: {e})"]
    missing = [k for k in _ARRAYS if k not in arrays]
    if missing:
        return arrays, [f"{SAMPLES} lacks {', '.join(missing)}"]
    lengths = {len(v) for v in arrays.values()}
    if len(lengths) > 1 or (n is not None and lengths != {n}):
        return arrays, [f"{SAMPLES} has arrays of {sorted(lengths)} entries"
                        + ("" if n is None else f" for {n} samples")]
    return arrays, []


def _captions(out: Path, n: Optional[int]) -> List[str]:
    """The problems of ``captions.jsonl`` and its line offsets (``n``: the samples, when known)."""
    from vitp.utils import line_offsets

    if not (out / CAPTIONS).is_file():
        return [f"{CAPTIONS} is missing"]
    raw = (out / CAPTIONS).read_bytes()
    if raw and not raw.endswith(b"\n"):
        return [f"{CAPTIONS} is cut short (no final newline)"]
    lines = raw.split(b"\n")[:-1]
    if n is not None and len(lines) != n:
        return [f"{CAPTIONS} has {len(lines)} lines for {n} samples"]
    try:
        values = json.loads(b"[" + b",".join(lines) + b"]")
    except ValueError as e:
        return [f"{CAPTIONS} does not parse ({e})"]
    if len(values) != len(lines) or not all(v is None or isinstance(v, str) for v in values):
        return [f"{CAPTIONS} holds lines that are not one caption each"]
    try:
        offsets = np.load(out / CAPTION_OFFSETS)
        ok = np.array_equal(offsets, line_offsets(np.frombuffer(raw, np.uint8)))
    except (OSError, ValueError, EOFError) as e:
        return [f"{CAPTION_OFFSETS} is missing or damaged ({type(e).__name__})"]
    return [] if ok else [f"{CAPTION_OFFSETS} does not fit {CAPTIONS}"]


def recorded_digest(out: Path, manifest: Optional[Dict[str, Any]], progress: Path) -> Optional[str]:
    """The config digest the pack in ``out`` was written with: the progress record's (``progress``:
    a pack or repair in progress), the manifest's, ``samples.safetensors``'s metadata, or (packs
    written before it was recorded; not latent packs) recomputed from the manifest's source config,
    seed and shard size. None when none can be read."""
    for read in (lambda: json.loads(progress.read_text())[DIGEST_KEY],
                 lambda: manifest["vitp"][DIGEST_KEY],
                 lambda: _safetensors_metadata(out / SAMPLES)[DIGEST_KEY]):
        try:
            return str(read())
        except Exception:  # noqa: BLE001 - absent or damaged: try the next record
            continue
    if manifest is not None and manifest["vitp"].get("kind") != "latent":
        meta = manifest["vitp"]
        try:
            return config_hash(meta["source"], int(meta["holdout"]["seed"]), int(meta["samples_per_shard"]))
        except (KeyError, TypeError, ValueError):
            return None
    return None


def _safetensors_metadata(path: Path) -> Dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        return f.metadata() or {}


def drop_damaged_shards(out: Path, jobs: list, manifest: Optional[Dict[str, Any]]) -> int:
    """Remove the shards of ``jobs`` (``(folder, k, [(key, ...)], ...)``) in ``out`` that a repair
    writes again: of another size than ``manifest`` lists, or, without a manifest, whose tar
    headers are not the job's keys (cut short, damaged, another pack's). Returns how many were kept."""
    sizes = {s["url"]: int(s["filesize"]) for s in manifest["shardlist"]} if manifest else None
    kept = 0
    for job in jobs:
        path = out / shard_name(job[1])
        if not path.exists():
            continue
        keys = [item[0] for item in job[2]]
        if (sizes.get(path.name) == path.stat().st_size) if sizes is not None else _holds(path, keys):
            kept += 1
        else:
            path.unlink()
    return kept


def _holds(path: Path, keys: List[str]) -> bool:
    """Whether the tar ``path`` is whole and holds the samples ``keys``, in order."""
    size, seen = path.stat().st_size, []
    try:
        with tarfile.open(path) as tar:
            for m in tar:
                if m.offset_data + m.size > size:
                    return False
                key = m.name.split(".", 1)[0]
                if not seen or seen[-1] != key:
                    seen.append(key)
    except (tarfile.TarError, OSError):
        return False
    return seen == keys
