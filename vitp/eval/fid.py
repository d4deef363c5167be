"""FID from a local Inception-V3 file, split over the data-parallel replicas, and FID-50K in the
ADM protocol.

FID (Heusel et al. 2017, arXiv:1706.08500) is the Frechet distance between Gaussians fitted to the
2048-d pool features of Inception-V3 on real and generated images. The network and the distance
are torchmetrics' (``FrechetInceptionDistance``: torch-fidelity's port of the TF Inception graph
that guided-diffusion's ``evaluations/evaluator.py`` runs, loaded from ``eval.fid.weights``, never
downloaded): torchmetrics keeps exactly the statistics a split needs (count, feature sum, sum of
outer products, float64), so each replica (:class:`vitp.eval.inference.Share`) extracts the
features of its own images and only those sums are added over the replicas
(:class:`FeatureSums`); the distance of the summed statistics equals one process's.
Images are resized to 299 as torch-fidelity and the ADM evaluator do (TF1 bilinear,
``antialias=False``), not with torchmetrics' default antialiased resize.

``eval.fid.num`` samples (class-balanced, or the held-out captions cycled; sample ``i`` from the
noise of ``(eval.fid.seed, i)``, :func:`vitp.eval.sampling.sample_noise`) are written in blocks of
``eval.fid.block`` (``<out>.parts/``, resumable) and then as one ``.npz`` (``arr_0``: uint8 NHWC,
``arr_1``: labels) that guided-diffusion's evaluator reads; the FID is computed from that file.
The real side's sums are cached (:func:`real_statistics`).
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import io
import json
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np
import torch

from .inference import Share
from .progress import phase

log = logging.getLogger("vitp")

FID_DIM = 2048  # Inception-V3 pool features
WEIGHTS_HELP = ("the Inception-V3 file torch-fidelity and torchmetrics load (pt_inception-2015-12-05-6726825d.pth from "
                "torch-fidelity's GitHub releases; docs/evaluation.md), or a random-weight one from "
                "scripts/make_random_eval_weights.py OUT")


@dataclass
class FeatureSums:
    """Sufficient statistics of a feature set, float64: ``n`` items, ``s`` (D,) their sum, ``ss``
    (D, D) the sum of their outer products (torchmetrics' ``*_features_sum`` / ``*_cov_sum``)."""

    n: float
    s: torch.Tensor
    ss: torch.Tensor

    @classmethod
    def zeros(cls, dim: int = FID_DIM) -> "FeatureSums":
        return cls(0.0, torch.zeros(dim, dtype=torch.float64), torch.zeros(dim, dim, dtype=torch.float64))

    def add(self, f: torch.Tensor) -> None:
        """Count the features ``f`` (B, D)."""
        f = f.double().cpu()
        self.n, self.s, self.ss = self.n + len(f), self.s + f.sum(0), self.ss + f.T @ f

    def summed(self, share: Share) -> "FeatureSums":
        """The sums over the replicas (collective over ``share``; every rank gets them)."""
        d = len(self.s)
        flat = share.sum(torch.cat([torch.tensor([self.n], dtype=torch.float64), self.s, self.ss.reshape(-1)]))
        return FeatureSums(float(flat[0]), flat[1:1 + d].clone(), flat[1 + d:].reshape(d, d).clone())

    def mean_cov(self):
        """``(mean (D,), covariance (D, D))``, unbiased, as torchmetrics computes them."""
        if self.n < 2:
            raise ValueError(f"FID needs at least 2 images on each side, got {int(self.n)}; raise eval.fid.num / "
                             f"eval.fid.real_num")
        mean = self.s / self.n
        return mean, (self.ss - self.n * torch.outer(mean, mean)) / (self.n - 1)


def frechet(real: FeatureSums, fake: FeatureSums) -> float:
    """The Frechet distance ``|mu_r - mu_f|^2 + Tr(S_r + S_f - 2 (S_r S_f)^(1/2))`` of the two sums'
    Gaussians, by torchmetrics' own function (the trace of the root from the eigenvalues of
    ``S_r S_f``, float64)."""
    from torchmetrics.image.fid import _compute_fid

    (mr, cr), (mf, cf) = real.mean_cov(), fake.mean_cov()
    return float(_compute_fid(mr, cr, mf, cf))


def read_weights_file(path: Optional[str], key: str, help_text: str):
    """``(path, state dict)`` of a local feature-network file given as ``<key>.weights`` (loaded with
    ``weights_only``: no pickled code runs). Raises ``ValueError`` when none is given or the file is
    not a PyTorch state dict, ``FileNotFoundError`` when it is missing; each names the key and
    ``help_text`` (where to get the file)."""
    if not path:
        raise ValueError(f"{key}.num > 0 needs {key}.weights=FILE: {help_text}")
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"{key}.weights={path}: {'a folder, not a file' if p.is_dir() else 'no such file'}; "
                                f"give {help_text}")
    try:
        return p, torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file gets the same advice
        raise ValueError(f"{key}.weights={path} is not a PyTorch state dict ({type(e).__name__}); give "
                         f"{help_text}") from None


def check_weights(path: Optional[str]) -> Path:
    """``path`` as a checked Inception-V3 weights file. Raises ``ValueError`` when none is given or
    it is not an Inception-V3 state dict, ``FileNotFoundError`` when it is missing; each names the
    file and how to get the right one."""
    p, sd = read_weights_file(path, "eval.fid", WEIGHTS_HELP)
    shape = tuple(sd["fc.weight"].shape) if isinstance(sd, dict) and "fc.weight" in sd else None
    if shape != (1008, FID_DIM) or "Mixed_7c.branch_pool.conv.weight" not in sd:
        raise ValueError(f"eval.fid.weights={path} is not torch-fidelity's Inception-V3 (fc.weight {shape}, expected "
                         f"(1008, 2048)); give {WEIGHTS_HELP}")
    return p


def inception(path: Optional[str], device: Any = "cpu") -> torch.nn.Module:
    """torchmetrics' ``NoTrainInceptionV3`` (2048-d pool features, TF1 bilinear resize) from the
    checked file ``path`` (:func:`check_weights`), on ``device``: uint8 ``(B, 3, H, W)`` -> ``(B, 2048)``."""
    from torchmetrics.image.fid import NoTrainInceptionV3

    return NoTrainInceptionV3("inception-v3-compat", [str(FID_DIM)], str(check_weights(path)),
                              antialias=False).to(device)


def to_uint8(x: torch.Tensor) -> torch.Tensor:
    """Samples ``(B, C, T, H, W)`` in [-1, 1] as images ``(B, H, W, 3)`` uint8 (first frame; one
    channel repeated), as guided-diffusion's ``image_sample.py`` makes them: ``((x + 1) * 127.5)``
    clamped to [0, 255] and truncated. Raises ``ValueError`` for channels other than 1 or 3."""
    if x.shape[1] not in (1, 3):
        raise ValueError(f"FID needs 1- or 3-channel images, got {x.shape[1]} channels (a latent run's samples are "
                         f"decoded through data.vae first)")
    img = ((x[:, :, 0].float() + 1) * 127.5).clamp(0, 255).to(torch.uint8)
    return img.expand(-1, 3, -1, -1).permute(0, 2, 3, 1).contiguous()


def inception_features(net: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The pool features ``(B, 2048)`` of uint8 images ``(B, H, W, 3)`` on the network's device."""
    return net(images.permute(0, 3, 1, 2).to(next(net.parameters()).device))


@dataclass(frozen=True)
class Metric:
    """What the steps FID shares with FVD (:mod:`.fvd`) need to know of the metric: the real
    statistics (:func:`real_statistics`), the sample blocks (:func:`write_fid_samples`), the sums
    (:func:`image_sums`)."""

    name: str  # "FID", in messages and progress lines
    section: str  # its config, cfg.eval.<section> (num, real, real_num, real_stats, block, batch_size, seed)
    network: str  # the weights named in a refusal
    dim: int  # feature size
    unit: str  # progress unit of one item
    to_uint8: Callable[[torch.Tensor], torch.Tensor]  # samples (B, C, T, H, W) in [-1, 1] -> uint8 items
    features: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]  # (net, uint8 items) -> (B, dim)
    item_dims: int = 4  # dims of the .npz's arr_0: (N, H, W, 3)
    protocol: str = ""  # the feature extraction, kept with the cached real statistics (FID: none)


FID = Metric("FID", "fid", "Inception weights (eval.fid.weights)", FID_DIM, "img", to_uint8, inception_features)


def image_sums(net: torch.nn.Module, images: Any, rows: range, batch: int, bar: Any = None,
               metric: Metric = FID) -> FeatureSums:
    """:class:`FeatureSums` of the ``metric``'s features (default Inception's) of ``images[rows]``
    (uint8 ``(N, H, W, 3)`` images, FVD's ``(N, T, H, W, 3)`` clips; a tensor or an array such as
    a memory map), ``batch`` items per forward."""
    sums = FeatureSums.zeros(metric.dim)
    for i in range(rows.start, rows.stop, batch):
        x = torch.from_numpy(np.ascontiguousarray(images[i:min(rows.stop, i + batch)]).copy())  # the map is read-only
        with torch.no_grad():
            sums.add(metric.features(net, x))
        if bar is not None:
            bar.update(len(x))
    return sums


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def data_key(cfg: Any, split: str, count: int) -> Dict[str, Any]:
    """What the real side's statistics depend on besides the weights: the data config, the seed
    (the held-out split), the split and item count, and for local folders / packs each file's
    name, size and modification time (so a changed data set is noticed without reading an item)."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(cfg.data, resolve=True)
    files = []
    for key in ("root", "heldout_root", "shards"):
        root = data.get(key)
        if root and Path(str(root)).is_dir():
            files += [(str(p.relative_to(root)), p.stat().st_size, int(p.stat().st_mtime))
                      for p in sorted(Path(str(root)).rglob("*")) if p.is_file()]
    digest = hashlib.sha256(json.dumps(files).encode()).hexdigest()
    return {"data": data, "seed": int(cfg.seed), "split": split, "items": int(count), "files": digest}


Decode = Callable[[torch.Tensor], torch.Tensor]  # data items (B, C, T, H, W) -> pixels (B, 3, F, H', W') in [-1, 1]


def _real_images(cfg: Any, dataset: Any, idx: range, device: Any, convert: Callable = to_uint8,
                 decode: Optional[Decode] = None) -> torch.Tensor:
    from .sampling import to_pixels

    x = torch.stack([dataset[(i, None)][0] for i in idx])
    if decode is not None:
        return convert(decode(x).cpu())
    return convert(to_pixels(cfg, x, device).cpu())  # latents: decoded as the samples are


def real_statistics(net: torch.nn.Module, cfg: Any, dataset: Any, count: int, share: Share, cache: Path,
                    weights_digest: str, metric: Metric = FID, decode: Optional[Decode] = None,
                    decoder: str = "") -> FeatureSums:
    """The :class:`FeatureSums` of the ``metric``'s features (default FID's) of the first ``count``
    items of ``dataset`` (decoded through ``data.vae`` for a latent run, or by ``decode``, whose
    weights ``decoder`` identifies, e.g. a Wan pipeline's VAE digest), each replica extracting
    its range; cached in ``cache`` (safetensors, written by rank 0) with the weights' digest and
    :func:`data_key` of the data (and the metric's protocol and ``decoder``), so a second evaluation
    reads no item. Raises ``ValueError`` naming ``cache`` when it holds another weights file's, data
    set's or decoder's statistics. Collective over ``share``."""
    from safetensors import safe_open

    from vitp.utils import atomic_write, save_safetensors

    m, sect = metric, cfg.eval[metric.section]
    key = {"weights_sha256": weights_digest, "data": data_key(cfg, sect.real, count)}
    if m.protocol:
        key["features"] = m.protocol
    if decoder:
        key["decoder"] = decoder
    if cache.is_file():
        with safe_open(str(cache), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(f"vitp_{m.section}_real", "{}"))
            for part, what in (("weights_sha256", m.network), ("features", "feature extraction"),
                               ("data", "data or split"), ("decoder", "VAE weights")):
                if meta.get(part) != key.get(part):
                    raise ValueError(f"{cache} holds the {m.name} real statistics of other {what} than this "
                                     f"evaluation's; delete it to recompute them, or give "
                                     f"eval.{m.section}.real_stats=ANOTHER_FILE")
            return FeatureSums(float(f.get_tensor("n")[0]), f.get_tensor("s"), f.get_tensor("ss"))
    if count < 2:  # an empty cache would be kept and read as statistics
        raise ValueError(f"{m.name} needs at least 2 real items, and eval.{m.section}.real={sect.real} has {count}: "
                         f"score against eval.{m.section}.real=train, or hold out a split with "
                         f"data.holdout_fraction > 0 or data.heldout_root=DIR")
    mine, batch, sums = share.indices(count), sect.batch_size, FeatureSums.zeros(m.dim)
    device = next(net.parameters()).device
    with phase(f"{m.name} real statistics of {count} {sect.real} items", len(mine), f"{m.name} real", m.unit,
               share.main) as bar:
        for i in range(mine.start, mine.stop, batch):
            idx = range(i, min(mine.stop, i + batch))
            with torch.no_grad():
                sums.add(m.features(net, _real_images(cfg, dataset, idx, device, m.to_uint8, decode)))
            bar.update(len(idx))
    sums = sums.summed(share)
    if share.main:
        with atomic_write(cache) as tmp:
            save_safetensors({"n": torch.tensor([sums.n], dtype=torch.float64), "s": sums.s, "ss": sums.ss}, str(tmp),
                      metadata={f"vitp_{m.section}_real": json.dumps(key)})
    return sums


def real_side(cfg: Any, metric: Metric, train_ds: Any, heldout_ds: Any, run_dir: Path, share: Share
              ) -> Tuple[Any, int, Path]:
    """``(data set, item count, cache file)`` of the ``metric``'s real side: ``eval.<section>.real``'s
    set, its first ``real_num`` items (all of them with 0, or when it has fewer: said once), cached
    in ``real_stats`` or ``run_dir/<section>_real_<real><count | all>.safetensors``."""
    f = cfg.eval[metric.section]
    real_ds = train_ds if f.real == "train" else heldout_ds
    count = min(len(real_ds), f.real_num or len(real_ds))
    if f.real_num > count and share.main:
        log.warning("eval.%s.real_num=%d but the %s set has %d items: the %s real side uses %d (recorded as "
                    "%s_real_items)", metric.section, f.real_num, f.real, count, metric.name, count, metric.section)
    name = f"{metric.section}_real_{f.real}{count if f.real_num else 'all'}.safetensors"
    return real_ds, count, Path(str(f.real_stats)) if f.real_stats else Path(run_dir) / name


def check_real_cache(cfg: Any, section: str = "fid") -> None:
    """Before any sample is drawn: a cache file given as ``eval.<section>.real_stats`` (FID's or
    FVD's) that exists must hold that metric's real statistics of the same weights file. Raises
    ``ValueError`` naming the file and the fix (what :func:`real_statistics` would raise at the end
    of a run otherwise); the data are checked there."""
    from safetensors import safe_open

    sect = cfg.eval[section]
    if not sect.real_stats or not Path(str(sect.real_stats)).is_file():
        return
    path, name = Path(str(sect.real_stats)), section.upper()
    fix = f"delete it to recompute them, or give eval.{section}.real_stats=ANOTHER_FILE"
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:  # noqa: BLE001 - any unreadable file gets the same advice
        raise ValueError(f"eval.{section}.real_stats={path} is not a safetensors file of real statistics; "
                         f"{fix}") from None
    key = meta.get(f"vitp_{section}_real")
    if key is None:
        other = [k[5:-5].upper() for k in meta if k.startswith("vitp_") and k.endswith("_real")]
        what = f"the {other[0]} real statistics" if other else "no real statistics"
        raise ValueError(f"eval.{section}.real_stats={path} holds {what}, not {name}'s; {fix}")
    if json.loads(key).get("weights_sha256") != file_digest(Path(str(sect.weights)).expanduser()):
        raise ValueError(f"eval.{section}.real_stats={path} holds the {name} real statistics of other weights than "
                         f"eval.{section}.weights={sect.weights}; {fix}")


def write_npz(path: Path, shape: Sequence[int], blocks: Sequence[Path], labels: np.ndarray) -> None:
    """Write ``path``, an uncompressed ``.npz`` as guided-diffusion's ``image_sample.py`` writes it:
    ``arr_0`` uint8 ``shape`` (N, H, W, 3; FVD's (N, T, H, W, 3)) from the ``.npy`` ``blocks`` in
    order (one block in memory at a time) and ``arr_1`` the labels. Byte-identical for the same arrays (fixed zip
    timestamps, unlike ``np.savez``)."""
    from vitp.utils import atomic_write

    fmt = np.lib.format
    with atomic_write(path) as tmp, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        with zf.open(zipfile.ZipInfo("arr_0.npy", date_time=(1980, 1, 1, 0, 0, 0)), "w", force_zip64=True) as f:
            fmt.write_array_header_1_0(f, {"descr": fmt.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False,
                                           "shape": tuple(int(v) for v in shape)})
            for b in blocks:
                f.write(np.ascontiguousarray(np.load(b, mmap_mode="r")).tobytes())
        buf = io.BytesIO()
        fmt.write_array(buf, np.ascontiguousarray(labels), allow_pickle=False)
        zf.writestr(zipfile.ZipInfo("arr_1.npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue())


def npz_images(path: Path, dims: int = 4) -> np.ndarray:
    """``arr_0`` of an ``.npz`` (N, H, W, 3) uint8 (``dims=5``: FVD's clips, (N, T, H, W, 3)): a
    read-only memory map when it is stored uncompressed (each replica then reads only its rows),
    else loaded. Raises ``ValueError`` for another layout (for images: other than guided-diffusion's
    evaluator reads)."""
    import struct

    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("arr_0.npy")
        stored = info.compress_type == zipfile.ZIP_STORED
    if stored:
        with open(path, "rb") as f:
            f.seek(info.header_offset)
            name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
            f.seek(info.header_offset + 30 + name_len + extra_len)
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            images = np.memmap(path, dtype, "r", f.tell(), shape) if not fortran else None
    if not stored or images is None:
        images = np.load(path)["arr_0"]
    if images.dtype != np.uint8 or images.ndim != dims or images.shape[-1] != 3:
        wanted = "FID reads uint8 (N, H, W, 3) images" if dims == 4 else "FVD reads uint8 (N, T, H, W, 3) clips"
        raise ValueError(f"{path}: arr_0 is {images.dtype} {images.shape}; {wanted}")
    return images


def fid_labels(cfg: Any, conditioning: Any, heldout_ids: torch.Tensor, n: Optional[int] = None) -> torch.Tensor:
    """``(n,)`` conditioning ids (default ``eval.fid.num``): sample ``i`` of a class-conditional run gets
    class ``i mod num_classes`` (class-balanced, as ADM's 50K); a caption run the held-out captions cycled."""
    n = cfg.eval.fid.num if n is None else n
    if getattr(conditioning, "text", False):
        return heldout_ids.repeat(n // max(1, len(heldout_ids)) + 1)[:n]
    return torch.arange(n) % max(1, int(cfg.model.num_classes))


def _barrier(share: Share) -> None:
    """Every rank of a distributed evaluation (``share.group`` set: also a tp / pp layout of one
    replica, whose other ranks read what rank 0 writes) waits here; a one-process one does not."""
    if share.group is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


Draw = Callable[[torch.Tensor, int, int, str], torch.Tensor]  # (labels, first index, seed, purpose) -> samples

# What the samples are drawn from (weights, training step), kept with the parts and the finished .npz, and
# whether stale ones are replaced (training) or refused (vitp-eval): set by sample_source
_SOURCE: contextvars.ContextVar = contextvars.ContextVar("vitp_sample_source", default=("", False))


@contextlib.contextmanager
def sample_source(source: str, replace_stale: bool = False) -> Iterator[None]:
    """Within the block, :func:`write_fid_samples` records ``source`` (what the samples are drawn
    from: :func:`weights_identity` of the weights file or folder, or a training step and its run
    config) with the sample blocks and the finished ``.npz``; a finished ``.npz`` or stopped blocks
    of another source are never reused: with ``replace_stale`` (training's own files) they are
    replaced, else (``vitp-eval``) stopped blocks are refused and a finished ``.npz`` drawn again."""
    token = _SOURCE.set((str(source), bool(replace_stale)))
    try:
        yield
    finally:
        _SOURCE.reset(token)


def weights_identity(*paths: Any) -> str:
    """sha256 over the weight files at ``paths`` (a file: it and, for a sharded export, the files
    beside its index; a folder: every file under it, links followed) of their names, sizes and
    modification times: another training step or a file copied over gives another identity."""
    rows = []
    for path in paths:
        p = Path(path)
        files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
        if p.is_file() and (p.name.endswith(".index.json") or p.with_name(p.name + ".index.json").is_file()):
            files = sorted(p.parent.glob("*.safetensors")) + [q for q in p.parent.glob("*.index.json")]
        rows += [(str(q.relative_to(p) if p.is_dir() else q.name), q.stat().st_size, q.stat().st_mtime_ns)
                 for q in files if q.exists()]
    return hashlib.sha256(json.dumps([str(Path(p).resolve()) for p in paths] + rows).encode()).hexdigest()


def samples_meta(cfg: Any, labels: torch.Tensor, metric: Metric = FID) -> str:
    """What makes the ``metric``'s samples of ``labels`` (its section's count, block and seed, the
    labels' digest, ``cfg.sampler`` and the :func:`sample_source`), as JSON kept beside the parts
    and the finished ``.npz``: a finished file is reused only when it says the same."""
    from omegaconf import OmegaConf

    f = cfg.eval[metric.section]
    return json.dumps({"num": len(labels), "block": f.block, "seed": f.seed,
                       "labels": hashlib.sha256(labels.numpy().tobytes()).hexdigest(),
                       "sampler": OmegaConf.to_container(cfg.sampler, resolve=True), "source": _SOURCE.get()[0]},
                      sort_keys=True)


def first_frames_are_fid_samples(cfg: Any) -> bool:
    """Whether FID's samples are exactly the first frames of FVD's clips (a video run with both
    on): the same count and seed give each index the same label and noise, and blocks that cut
    the samples alike give the same sampling batches (so the same floating-point sums)."""
    fid, fvd = cfg.eval.fid, cfg.eval.fvd
    n = int(fid.num)
    return (int(cfg.model.num_frames) > 1 and n > 0 and n == int(fvd.num) and int(fid.seed) == int(fvd.seed)
            and min(int(fid.block), n) == min(int(fvd.block), n))


def fid_samples_from_clips(cfg: Any, clips: Path, npz: Path, labels: torch.Tensor, share: Share) -> None:
    """Write FID's samples ``npz`` (and what made them, as :func:`write_fid_samples` would) from the
    first frames of FVD's finished ``clips`` ``.npz`` (uint8 ``(N, T, H, W, 3)``), ``eval.fid.block``
    at a time, instead of sampling them again; only when :func:`first_frames_are_fid_samples`.
    Collective (rank 0 writes, every rank waits)."""
    from vitp.utils import atomic_write_text

    if share.main:
        frames, block = npz_images(clips, 5), int(cfg.eval.fid.block)
        parts = npz.with_name(npz.name + ".first_frames")
        parts.mkdir(parents=True, exist_ok=True)
        blocks = []
        for k in range(0, len(frames), block):
            blocks.append(parts / f"block_{k // block:06d}.npy")
            np.save(blocks[-1], np.ascontiguousarray(frames[k:k + block, 0]))
        write_npz(npz, (len(frames), *frames.shape[2:]), blocks, labels.numpy().astype(np.int64))
        atomic_write_text(npz.with_name(npz.name + ".json"), samples_meta(cfg, labels, FID))
        for b in blocks:
            b.unlink()
        parts.rmdir()
    _barrier(share)


def write_fid_samples(gen: Any, cfg: Any, labels: torch.Tensor, share: Share, npz: Path,
                      conditioning: Any = None, metric: Metric = FID, draw: Optional[Draw] = None) -> None:
    """Sample ``labels`` (sample ``i`` from the noise of ``(eval.fid.seed, i)``; another ``metric``:
    its section's seed and block) into ``npz`` (:func:`write_npz`), ``eval.fid.block`` at a time:
    each block is split over the replicas (:func:`vitp.eval.sampling.generate`, or ``draw(labels of
    the block, index of its first sample, seed, purpose)`` giving this replica's share of the block
    as ``(b, 3, F, H, W)`` pixels in [-1, 1], e.g. a Wan run's decoded samples), gathered as uint8
    (``metric.to_uint8``) on rank 0 and saved in
    ``<npz>.parts/`` (atomically), so a stopped evaluation resumes at the first missing block. The
    parts are removed once ``npz`` is written, and what made it (the settings and the
    :func:`sample_source`) is kept in ``<npz>.json``: an existing ``npz`` is reused only when that
    file says the same. Raises ``ValueError`` when the parts folder was written with other settings
    or weights (unless :func:`sample_source` replaces them). Collective."""
    from vitp.utils import atomic_write, atomic_write_text
    from .sampling import generate

    f, n, m = cfg.eval[metric.section], len(labels), metric
    replace_stale = _SOURCE.get()[1]
    meta = samples_meta(cfg, labels, metric)
    made = npz.with_name(npz.name + ".json")  # what made the finished npz
    if npz.is_file() and made.is_file() and made.read_text() == meta and len(npz_images(npz, m.item_dims)) == n:
        return
    parts = npz.with_name(npz.name + ".parts")
    if (parts / "meta.json").is_file() and (parts / "meta.json").read_text() != meta:
        if not replace_stale:
            raise ValueError(f"{parts} holds {m.name} samples of other settings (eval.{m.section}.num/block/seed, "
                             f"sampler) or other weights; delete it to sample again")
        _barrier(share)  # every rank has read the old meta before rank 0 removes it
        if share.main:
            for p in parts.glob("block_*.npy"):
                p.unlink()
        _barrier(share)
    if share.main:
        atomic_write_text(parts / "meta.json", meta)
    blocks = [parts / f"block_{k:06d}.npy" for k in range(-(-n // f.block))]
    for k, path in enumerate(blocks):
        lo, hi = k * f.block, min(n, (k + 1) * f.block)
        if path.is_file():  # written by an earlier, stopped evaluation
            continue
        what = f"{m.name} (block {k + 1} of {len(blocks)})"
        x = (draw(labels[lo:hi], lo, int(f.seed), what) if draw is not None else
             generate(gen, cfg, labels[lo:hi], f.seed, conditioning, share, gather=False, first=lo, purpose=what))
        images = share.gather(m.to_uint8(x), hi - lo)
        if share.main:
            with atomic_write(path) as tmp:
                np.save(tmp, images.numpy())
    _barrier(share)
    if share.main:
        write_npz(npz, (n, *np.load(blocks[0], mmap_mode="r").shape[1:]), blocks, labels.numpy().astype(np.int64))
        atomic_write_text(made, meta)
        for p in blocks + [parts / "meta.json"]:
            p.unlink()
        parts.rmdir()
    _barrier(share)


PUBLISHED = {"FID": "50,000 samples (FID-50K)", "FVD": "2,048 clips"}  # the counts the field reports at


def warn_small_counts(metric: Metric, real: int, generated: int) -> Optional[str]:
    """The warning (logged, and returned; ``None`` when there is none) for a Frechet distance from
    fewer items on either side than the ``metric``'s feature dimension: its covariances are then
    singular and the number, biased upwards at small counts, compares only with numbers of the same
    counts, not with published ones."""
    if min(real, generated) >= metric.dim:
        return None
    items = {"img": "images", "clip": "clips"}.get(metric.unit, "items")
    line = (f"{metric.name} from {real} real and {generated} generated {items}, fewer than its {metric.dim} "
            f"features: this {metric.name} is not comparable with published {metric.name}s (made at "
            f"{PUBLISHED.get(metric.name, 'thousands of items')}); compare it only with {metric.name}s of the same "
            f"counts")
    log.warning(line)
    return line


def fid_metrics(gen: Any, cfg: Any, train_ds: Any, heldout_ds: Any, run_dir: Path, npz: Path,
                conditioning: Any = None, share: Optional[Share] = None,
                heldout_ids: Optional[torch.Tensor] = None, draw: Optional[Draw] = None,
                decode: Optional[Decode] = None, decoder: str = "") -> Dict[str, Any]:
    """FID of ``eval.fid.num`` samples against the real ``eval.fid.real`` items (the first
    ``eval.fid.real_num``; their statistics cached, :func:`real_statistics`), the samples (a caption
    run: the held-out items' caption ids ``heldout_ids``, :func:`fid_labels`) written
    to ``npz`` (:func:`write_fid_samples`) and their features read back from it. Returns ``fid``,
    ``fid_num_samples``, ``fid_real_items`` and ``fid_npz`` on rank 0 (``{}`` elsewhere). ``draw``,
    ``decode``, ``decoder``: another model's sampling and decoding (:func:`write_fid_samples`,
    :func:`real_statistics`; a Wan run's, :func:`vitp.eval.wan_eval.wan_quality_metrics`). Raises ``ValueError`` /
    ``FileNotFoundError`` for a missing or wrong weights file before any sample is drawn. Collective."""
    from .sampling import _device

    share, f = share or Share(), cfg.eval.fid
    net = inception(f.weights, _device(gen))  # the file checked (check_weights) before any sample
    real_ds, count, cache = real_side(cfg, FID, train_ds, heldout_ds, run_dir, share)
    real = real_statistics(net, cfg, real_ds, count, share, cache, file_digest(Path(str(f.weights)).expanduser()), FID,
                           decode, decoder)
    labels = fid_labels(cfg, conditioning, heldout_ids if heldout_ids is not None else torch.zeros(1, dtype=torch.long))
    write_fid_samples(gen, cfg, labels, share, npz, conditioning, FID, draw)
    images = npz_images(npz)
    mine = share.indices(len(images))
    with phase(f"FID features of the {len(images)} samples in {npz.name}", len(mine), "FID", "img", share.main) as bar:
        fake = image_sums(net, images, mine, f.batch_size, bar).summed(share)
    if not share.main:  # the distance (an eigen-decomposition of 2048 x 2048) on rank 0 alone
        return {}
    warn_small_counts(FID, count, len(images))
    return {"fid": frechet(real, fake), "fid_num_samples": len(images), "fid_real_items": count, "fid_npz": str(npz)}
