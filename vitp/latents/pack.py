"""Encode a data set into latent shards once (``vitp-pack OUT data.vae=FOLDER <data overrides>``).

Every item of the data set (an image, or a video's clip window) is read as training's held-out
split reads it (center crop, no flip, at ``data.resolution`` and ``data.num_frames``), coded by the
VAE of ``data.vae`` (:class:`vitp.latents.vae.LocalVAE`) and stored as its posterior: sample ``i``
of the pack is the files ``{i:09d}.mean.npy`` and ``{i:09d}.std.npy`` (float32 ``(C', T', h, w)``,
normalised), with ``cls``, ``json`` and ``txt`` (the caption) as in a pixel pack. Training draws
``mean + std * eps`` with the item's own key (:class:`vitp.data.shards.ShardLatents`), so it
needs no VAE; the manifest records the VAE (folder, class, config hash, geometry) and the pixel
shape, which the trainer adopts (:func:`vitp.latents.config.adopt_latent_data`).

Shards are encoded by ``workers`` processes (on the GPUs in turn, or the CPU), each in fixed batches of ``batch_size`` items of its
shard, so the latents do not depend on the number of processes; as for pixel packs, a shard is
written to ``.part`` and renamed when complete, so an interrupted encode run again keeps the
finished shards (Open-Sora and Wan pre-extract latents the same way: hpcaitech/Open-Sora
``scripts/vae/``, Wan-Video/DiffSynth-Studio).
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

_CACHE: Dict[str, Any] = {}  # per worker process: the pixel data sets and the VAE


def _pixel_sets(cfg_data: dict, seed: int) -> Tuple[Any, Any]:
    """The folder data sets of ``cfg_data`` (built once per process)."""
    key = json.dumps([cfg_data, seed], sort_keys=True, default=str)
    if _CACHE.get("sets_key") != key:
        from omegaconf import OmegaConf

        from vitp.data.build import build_datasets

        _CACHE["sets"] = build_datasets(OmegaConf.create(cfg_data), seed)
        _CACHE["sets_key"] = key
    return _CACHE["sets"]


def _vae(folder: str, device: str) -> Any:
    if _CACHE.get("vae_key") != (folder, device):
        from vitp.latents.vae import LocalVAE

        _CACHE.pop("vae", None)
        _CACHE["vae"], _CACHE["vae_key"] = LocalVAE(folder, device), (folder, device)
    return _CACHE["vae"]


def items_of(train: Any, held: Any) -> List[Tuple[int, int, bool]]:
    """``[(base, index, held_out)]`` of every item to encode, in the order of the pack: ``base`` 0
    is ``train.base``, 1 ``held.base`` when the held-out items come from their own folder."""
    own = held.base is not train.base
    out = [(0, int(i), False) for i in np.asarray(train.indices)]
    out += [(1 if own else 0, int(i), True) for i in np.asarray(held.indices)]
    return sorted(out)


def encode_shard(job: Tuple[str, int, List[Tuple[str, int, int, bool]], dict, int, int, str]) -> Tuple[int, int]:
    """Encode and write one shard (``job``: folder, shard number, ``[(key, base, index, held)]``,
    the data config, seed, batch size, device) through a ``.part`` file; returns ``(shard, bytes)``."""
    import webdataset as wds

    from vitp.data.shards import shard_name

    out, k, items, cfg_data, seed, batch, device = job
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)))
    sets = _pixel_sets(cfg_data, seed)
    bases = (sets[0].base, sets[1].base)
    vae = _vae(cfg_data["vae"], device)
    final = Path(out) / shard_name(k)
    part = final.with_name(final.name + ".part")
    with wds.TarWriter(str(part), mtime=0) as sink:
        for a in range(0, len(items), batch):
            chunk = items[a:a + batch]
            got = [bases[b][idx] for _, b, idx, _ in chunk]
            mean, std = vae.encode(torch.stack([x for x, _ in got]))
            for (key, b, idx, _), (_, label), mu, sd in zip(chunk, got, mean, std):
                sink.write(_files(key, bases[b], idx, label, mu.numpy(), sd.numpy()))
    with open(part, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(part, final)
    return k, final.stat().st_size


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(a, dtype=np.float32))
    return buf.getvalue()


def _files(key: str, base: Any, idx: int, label: int, mean: np.ndarray, std: np.ndarray) -> Dict[str, Any]:
    files = getattr(base, "files", None)
    source = str(files[base._file_of(idx)]) if files is not None and hasattr(base, "_file_of") else "digits"
    out = {"__key__": key, "mean.npy": _npy(mean), "std.npy": _npy(std), "cls": str(int(label)),
           "json": json.dumps({"source": source, "item": int(idx), "class": base.classes[int(label)]})}
    captions = getattr(base, "captions", None)
    if captions is not None and captions[idx] is not None:
        out["txt"] = captions[idx]
    return out


def latent_meta(cfg_data: dict) -> Dict[str, Any]:
    """The manifest's ``latent`` entry for the data config ``cfg_data`` (its ``vae`` folder read):
    the VAE's folder and :class:`~vitp.latents.vae.LatentGeometry`, the pixel shape coded and the
    latent shape ``[C', T', h, w]``. Raises ``ValueError`` for a size the VAE cannot code."""
    from vitp.config import parse_resolution
    from vitp.latents.vae import check_vae_folder

    g = check_vae_folder(cfg_data["vae"], int(cfg_data["channels"]))  # before any folder or shard is made
    hw = parse_resolution(cfg_data["resolution"])
    frames = int(cfg_data["num_frames"])
    if frames > 1 and not g.video:
        raise ValueError(f"data.vae={cfg_data['vae']} is an image VAE ({g.cls}) but data.num_frames={frames}: use a "
                         f"video VAE (AutoencoderKLWan, ...) for clips, or data.num_frames=1")
    h, w = g.latent_size(hw)
    return {"vae": str(Path(cfg_data["vae"]).expanduser().resolve()), "geometry": g.to_dict(),
            "pixels": {"resolution": list(hw), "num_frames": frames, "channels": int(cfg_data["channels"])},
            "shape": [g.channels, g.latent_frames(frames), h, w]}


def collect_latents(cfg: Any, seed: int) -> Tuple[List[str], List[Any], List[Tuple[int, int, bool]], Dict[str, str]]:
    """``(classes, records, items, skipped)`` of the latent pack of ``cfg`` (a ``data`` section):
    per sample the fields of :class:`vitp.data.pack.Sample` (label, class, caption, held-out flag,
    pixel shape) for the manifest, and ``items`` (:func:`items_of`) for the encoders."""
    from omegaconf import OmegaConf

    from vitp.config import parse_resolution

    cfg_data = OmegaConf.to_container(cfg, resolve=True)
    if cfg_data["name"] not in ("digits", "image_folder", "video_folder"):
        raise ValueError(f"vitp-pack data.vae=... encodes data.name=digits, image_folder or video_folder, not "
                         f"{cfg_data['name']}")
    train, held = _pixel_sets(cfg_data, seed)
    items = items_of(train, held)
    bases = (train.base, held.base)
    skipped: Dict[str, str] = {}
    for b in {id(x): x for x in bases}.values():
        skipped.update(getattr(b, "skip_reasons", {}) or {})
    h, w = parse_resolution(cfg_data["resolution"])
    samples = []
    for b, idx, is_held in items:
        base = bases[b]
        label = int(base.labels[idx])
        captions = getattr(base, "captions", None)
        samples.append(dict(label=label, cls=base.classes[label], caption=None if captions is None else captions[idx],
                            heldout=is_held, height=h, width=w, frames=int(cfg_data["num_frames"])))
    return list(train.base.classes), samples, items, skipped
