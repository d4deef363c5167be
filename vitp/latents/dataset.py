"""The items of a latent pack (:mod:`vitp.latents.pack`) as training and evaluation read them."""
from __future__ import annotations

import io
from typing import Any, Optional, Tuple

import numpy as np
import torch

from vitp.data.base import KeyedDataset, parse_key


class ShardLatents(KeyedDataset):
    """Sample ``i`` of the latent pack ``index`` (a :class:`vitp.data.shards.ShardIndex` of kind
    ``latent``): ``x`` float32 ``(C', T', h, w)``, the normalised latent.

    With a training key ``(i, aug_seed)`` the latent is drawn from the stored posterior,
    ``mean + std * eps`` with ``eps`` from a generator seeded by ``aug_seed`` alone (the same item
    and seed give the same latent in any process and layout, as an augmentation does); ``aug_seed
    = None`` (held-out items) gives the mean. This is the reparameterised sample of latent
    diffusion's training (Rombach et al. 2022, arXiv 2112.10752; diffusers' ``latent_dist.sample``).

    Raises ``ValueError`` when a stored latent's shape differs from the manifest's (a damaged pack)."""

    kind = "latent"

    def __init__(self, index: Any, cache_dir: Optional[str] = None, lru: int = 16):
        from vitp.data.shards import _SampleNames

        self.index, self.cache_dir, self.lru = index, cache_dir, lru
        self.labels, self.classes = index.label, index.classes
        self.files = _SampleNames(index)
        self.item_group = index.shard_of  # item i is sample i
        self.shape = tuple(int(v) for v in index.meta["latent"]["shape"])
        self._reader = None

    def _file_of(self, index: int) -> int:
        return index

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _reader=None)  # each DataLoader worker opens its own shards

    def _posterior(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        from vitp.data.shards import ShardReader

        if self._reader is None:
            self._reader = ShardReader(self.index, self.cache_dir, self.lru)
        sample = self._reader[i]
        mean, std = (np.load(io.BytesIO(sample[k])) for k in ("mean.npy", "std.npy"))
        if mean.shape != self.shape or std.shape != self.shape:
            raise ValueError(f"{self.files[i]}: latent of shape {mean.shape}, the manifest says {self.shape}: the pack "
                             f"is damaged; re-run vitp-pack")
        return mean, std

    def __getitem__(self, key: Any) -> Tuple[torch.Tensor, int]:
        """``(x, label)``; see the class docstring and :meth:`KeyedDataset.__getitem__`."""
        i, aug_seed = parse_key(key, len(self))
        mean, std = self._posterior(i)
        x = torch.from_numpy(mean)
        if aug_seed is not None:
            eps = torch.randn(self.shape, generator=torch.Generator().manual_seed(int(aug_seed)))
            x = x + torch.from_numpy(std) * eps
        return x, int(self.labels[i])
