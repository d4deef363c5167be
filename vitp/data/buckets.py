"""Shape buckets: one run trains on several resolutions, aspect ratios and clip lengths.

As Open-Sora's ``bucket_config`` (hpcaitech/Open-Sora, ``opensora/datasets/bucket.py``: per
resolution and frame count a probability and a batch size) and the aspect-ratio buckets of SDXL /
NaViT-style mixed-shape training (Dehghani et al. 2023, "Patch n' Pack", arXiv 2307.06304, which
packs shapes into one sequence instead), but with one shape per **global step**, so every rank,
pipeline stage and micro-batch of a step holds tensors of one shape:

- each bucket ``b`` is a size ``(H_b, W_b)``, a frame count ``T_b``, a global batch ``B_b`` and a
  weight ``w_b`` (:class:`Bucket`, from ``data.buckets``);
- each item belongs to one bucket: the one nearest its aspect ratio (``|log(h/w) - log(H/W)|``)
  among the buckets of its frame count that it can fill without upscaling (``h >= H``, ``w >= W``;
  none: the nearest of all, upscaled), ties to the bucket that resizes it least (of those it
  fills, the larger; of those it does not, the smaller: :func:`assign`). Items without a native
  size (digits, synthetic: rendered at any size) belong to every bucket. A video clip is cut at the
  bucket's frame count, so every file long enough gives clips to each duration. Start-up says how
  many items each bucket holds, warns about a bucket without training items (never drawn) and
  counts the items upscaled (:func:`fill_report`);
- step ``s`` draws its bucket with probability ``w_b / sum(w)`` from a seed of ``(seed, s)``
  (:meth:`BucketSchedule.bucket`), over the buckets that hold items; its ``B_b`` positions
  ``g`` take the next items of that bucket's own epoch-wise permutation, and the noise of
  ``(seed, s, g)`` as without buckets. The bucket sequence is a function of the seed, so a resume
  at step ``s`` replays it (exact), and any split of ``B_b`` into micro-batches and data-parallel
  ranks trains on the same numbers.

Tokens per step stay roughly constant when ``B_b`` is chosen inversely to the bucket's tokens
``(T_b / pt) (H_b / p) (W_b / p)``.
"""
from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, replace
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from vitp.config import format_resolution, parse_resolution
from vitp.data.loader import epoch_order
from vitp.objectives.flow import sample_seed

log = logging.getLogger(__name__)

# stream tags (those of vitp.data.loader are 1-3)
_ORDER, _AUG, _NOISE, _BUCKET = 1, 2, 3, 4


@dataclass(frozen=True)
class Bucket:
    """One bucket: ``size`` (H, W) in pixels, ``frames`` T, global ``batch_size``, draw ``weight``."""

    size: Tuple[int, int]
    frames: int
    batch_size: int
    weight: float

    @property
    def name(self) -> str:
        """``"HxW"`` for images, ``"HxWxT"`` for video (file names, TensorBoard tags, eval keys)."""
        return format_resolution(self.size) + (f"x{self.frames}" if self.frames > 1 else "")


def buckets_of(data_cfg: Any) -> List[Bucket]:
    """The :class:`Bucket` list of a ``data`` config section (``frames`` null = ``data.num_frames``)."""
    return [Bucket(parse_resolution(b.resolution, f"data.buckets[{i}].resolution"),
                   int(data_cfg.num_frames if b.frames is None else b.frames), int(b.batch_size), float(b.weight))
            for i, b in enumerate(data_cfg.buckets)]


def assign(native: Optional[Tuple[int, int]], frames: int, buckets: Sequence[Bucket]) -> List[int]:
    """Buckets an item of native size ``native`` ``(h, w)`` (``None``: any size) cut at ``frames``
    frames belongs to: all buckets of that frame count when ``native`` is ``None``, else the one
    nearest its aspect ratio among those it fills, or when it fills none among all of them; ties
    to the one that resizes it least (see the module doc). A function of its arguments alone, so
    every rank assigns alike."""
    same = [i for i, b in enumerate(buckets) if b.frames == frames]
    if native is None:
        return same
    h, w = native
    fill = [i for i in same if fills(native, buckets[i])] or same

    def cost(i: int) -> tuple:  # rounded: equal aspects tie whatever the float noise
        H, W = buckets[i].size
        return (round(abs(math.log(h / w) - math.log(H / W)), 9), round(abs(math.log(max(H / h, W / w))), 9), i)

    return [min(fill, key=cost)] if fill else []


def fills(native: Tuple[int, int], bucket: Bucket) -> bool:
    """Whether an item of native size ``(h, w)`` covers ``bucket``'s size without upscaling."""
    return native[0] >= bucket.size[0] and native[1] >= bucket.size[1]


def bucket_datasets(cfg: Any, seed: int, build) -> List[Tuple[Any, Any]]:
    """``[(train, held_out)]`` per bucket: ``build(cfg_b, seed, keep=...)`` (e.g.
    :func:`vitp.data.build_datasets`) at the bucket's size and frames, keeping the items
    :func:`assign` gives that bucket (:func:`in_bucket`), so that the buckets' item lists together
    hold each item once."""
    from omegaconf import DictConfig, OmegaConf

    buckets, out = buckets_of(cfg), []
    for i, b in enumerate(buckets):
        over = {"resolution": list(b.size), "num_frames": b.frames, "buckets": []}
        cfg_b = OmegaConf.merge(cfg, over) if isinstance(cfg, DictConfig) else replace(cfg, **over)
        out.append(tuple(build(cfg_b, seed, keep=functools.partial(in_bucket, i=i, frames=b.frames,
                                                                     buckets=buckets))))
    info, warnings = fill_report(buckets, out)
    log.info(info)
    for line in warnings:
        log.warning(line)
    return out


def fill_report(buckets: Sequence[Bucket], pairs: Sequence[Tuple[Any, Any]]) -> Tuple[str, List[str]]:
    """What start-up says about the items of each bucket (``pairs``: :func:`bucket_datasets`'
    ``[(train, held_out)]``): one info line of training / held-out items per bucket, and warnings
    for each bucket without a training item (it is never drawn) and for the items that fill no
    bucket of their frame count (upscaled: how many into each bucket, by how much at most, the
    most upscaled item's size), each naming the fix. Items without a native size are never
    counted as upscaled. Returns ``(info line, warning lines)``."""
    counts = ", ".join(f"{b.name} {len(tr)} / {len(ho)}" for b, (tr, ho) in zip(buckets, pairs))
    warnings = []
    for i, (b, (tr, _)) in enumerate(zip(buckets, pairs)):
        if not len(tr):
            warnings.append(f"data.buckets[{i}] ({b.name}) holds no training item, so it is never drawn (its weight "
                            f"goes to the other buckets): each item trains in the bucket nearest its aspect ratio "
                            f"among those it fills without upscaling; drop that bucket, or change its size")
    upscaled = [(b, *_upscaled(b, pair)) for b, pair in zip(buckets, pairs)]
    total = sum(n for _, n, _, _ in upscaled)
    if total:
        items = sum(len(tr) + len(ho) for tr, ho in pairs)
        each = ", ".join(f"{n} into {b.name} (up to {factor:.2f}x, e.g. a {format_resolution(size)} item)"
                         for b, n, factor, size in upscaled if n)
        warnings.append(f"data.buckets: {total} of {items} training and held-out items fill no bucket of their "
                        f"frame count and are upscaled: {each}; add a bucket at or below their size, or leave "
                        f"such small items out of the data")
    return f"data.buckets: training / held-out items per bucket: {counts}", warnings


def _upscaled(bucket: Bucket, pair: Tuple[Any, Any]) -> Tuple[int, float, Tuple[int, int]]:
    """``(items upscaled, largest factor, size of the item upscaled most)`` of a bucket's
    ``(train, held_out)`` subsets: the items whose native size does not cover the bucket's (the
    cover resize's factor ``max(H / h, W / w)`` exceeds 1)."""
    (H, W), n, factor, worst = bucket.size, 0, 1.0, (0, 0)
    for subset in pair:
        for h, w in _native_hw(subset):
            f = np.maximum(H / h.astype(np.float64), W / w.astype(np.float64))
            n += int((f > 1).sum())
            if len(f) and f.max() > factor:
                k = int(np.argmax(f))
                factor, worst = float(f[k]), (int(h[k]), int(w[k]))
    return n, factor, worst


def _native_hw(subset: Any, chunk: int = 1 << 14):
    """The native ``(h, w)`` int arrays of a subset's items, in chunks: from the base's
    ``native_sizes`` (packed data) or ``native_size`` per item, as :func:`in_bucket` reads them;
    nothing for items without a native size (rendered at any size)."""
    base, idx = subset.base, subset.indices
    sizes = getattr(base, "native_sizes", None)
    if sizes is not None and len(idx) and sizes(np.asarray(idx[:1])) is not None:
        for a in range(0, len(idx), chunk):
            yield sizes(np.asarray(idx[a:a + chunk]))
        return
    native = getattr(base, "native_size", None)
    got = [] if native is None else [native(int(j)) for j in np.asarray(idx)]
    if got and got[0] is not None:
        yield tuple(np.asarray(v) for v in zip(*got))


def in_bucket(base: Any, items: np.ndarray, i: int, frames: int, buckets: Sequence[Bucket],
              chunk: int = 1 << 14) -> np.ndarray:
    """bool ``(len(items),)``: which ``items`` of the data set ``base`` :func:`assign` gives bucket
    ``i``. Items share few sizes: each distinct size is assigned once; a base with
    ``native_sizes`` (packed data sets) gives them as arrays, in chunks, so no Python object is
    made per item and the temporaries stay a constant."""
    memo: dict = {}

    def fits(size: Optional[Tuple[int, int]]) -> bool:
        if size not in memo:
            memo[size] = i in assign(size, frames, buckets)
        return memo[size]

    keep = np.zeros(len(items), dtype=bool)
    sizes = getattr(base, "native_sizes", None)
    if sizes is not None and sizes(items[:1]) is not None:
        for a in range(0, len(keep), chunk):  # one int64 key per (h, w): np.unique of rows is slower
            h, w = sizes(items[a:a + chunk])
            distinct, which = np.unique(h.astype(np.int64) << 32 | w.astype(np.int64), return_inverse=True)
            ok = np.asarray([fits((int(k >> 32), int(k & 0xFFFFFFFF))) for k in distinct], dtype=bool)
            keep[a:a + chunk] = ok[which.reshape(-1)]
        return keep
    native = getattr(base, "native_size", lambda _i: None)
    for k, j in enumerate(items):
        keep[k] = fits(native(int(j)))
    return keep


class BucketSchedule:
    """Which bucket step ``s`` trains on, and which samples form its micro-batch ``m`` on
    data-parallel rank ``r`` (the bucketed :class:`vitp.data.loader.BatchSchedule`).

    Parameters
    ----------
    pool_sizes : items in each bucket (0: the bucket is never drawn)
    buckets : the :class:`Bucket` list (batch sizes and weights)
    accumulation, dp : micro-batches per step and data-parallel degree; bucket ``b``'s micro-batch
        holds ``batch_size / (accumulation * dp)`` samples
    seed : run seed
    groups, window : per bucket, the shard-local order of :func:`vitp.data.loader.epoch_order`
        (None: uniform permutations)

    Raises ``ValueError`` if no bucket holds an item or a batch does not split.
    """

    def __init__(self, pool_sizes: Sequence[int], buckets: Sequence[Bucket], accumulation: int, dp: int, seed: int,
                 groups: Optional[Sequence[Optional[Sequence[int]]]] = None, window: int = 0):
        live = [i for i, n in enumerate(pool_sizes) if n > 0]
        if not live:
            raise ValueError("no data.buckets entry holds an item: check the bucket sizes against the data")
        for b in buckets:
            if b.batch_size % (accumulation * dp):
                raise ValueError(f"bucket {b.name}: batch_size={b.batch_size} does not split into {accumulation} "
                                 f"micro-batches x dp={dp}")
        self.sizes, self.buckets, self.live = list(pool_sizes), list(buckets), live
        self.accumulation, self.dp, self.seed = accumulation, dp, seed
        w = np.array([buckets[i].weight for i in live], dtype=np.float64)
        self._cum = np.cumsum(w / w.sum())
        self._offsets: List[np.ndarray] = [np.zeros(len(buckets), dtype=np.int64)]  # items used before step s
        self._perms: dict = {}
        self.groups, self.window = groups or [None] * len(buckets), window

    def bucket(self, step: int) -> int:
        """The bucket of step ``step`` (0-based), drawn with probability ``weight / sum(weights)``."""
        u = (sample_seed(self.seed, _BUCKET, step) >> 10) / 2.0 ** 53  # uniform in [0, 1)
        return self.live[min(int(np.searchsorted(self._cum, u, side="right")), len(self.live) - 1)]

    def micro_batch_size(self, step: int) -> int:
        """Samples per micro-batch per data-parallel rank at step ``step``."""
        return self.buckets[self.bucket(step)].batch_size // (self.accumulation * self.dp)

    def _offset(self, step: int) -> np.ndarray:
        while len(self._offsets) <= step:  # replayed from step 0 once, then extended: resume is exact
            s = len(self._offsets) - 1
            nxt = self._offsets[-1].copy()
            b = self.bucket(s)
            nxt[b] += self.buckets[b].batch_size
            self._offsets.append(nxt)
        return self._offsets[step]

    def _item(self, b: int, pos: int) -> int:
        epoch, k = divmod(pos, self.sizes[b])
        if (b, epoch) not in self._perms:
            self._perms = {key: v for key, v in self._perms.items() if key[0] != b}  # one epoch per bucket
            self._perms[(b, epoch)] = epoch_order(self.sizes[b], [self.seed, _ORDER, b, epoch], self.groups[b],
                                                  self.window)
        return int(self._perms[(b, epoch)][k])

    def micro_batch_keys(self, step: int, micro: int, dp_rank: int) -> List[Tuple[int, int, int, int]]:
        """``[(bucket, item index in the bucket, aug seed, noise seed)]`` of one micro-batch."""
        b = self.bucket(step)
        mb, start = self.micro_batch_size(step), int(self._offset(step)[b])
        keys = []
        for i in range(mb):
            g = (micro * self.dp + dp_rank) * mb + i
            keys.append((b, self._item(b, start + g), sample_seed(self.seed, _AUG, step, g),
                         sample_seed(self.seed, _NOISE, step, g)))
        return keys

    def iter_keys(self, start_step: int, stop_step: int, dp_rank: int):
        """Micro-batch keys in training order for steps ``[start_step, stop_step)``."""
        for step in range(start_step, stop_step):
            for m in range(self.accumulation):
                yield self.micro_batch_keys(step, m, dp_rank)
