"""Undecodable samples of a pack are skipped, named and counted across DataLoader workers."""
import tarfile

import pytest

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader

from vitp.config import compose
from vitp.data import build_datasets
from vitp.data.base import StorageError, attach_skip_counter
from vitp.data.pack import pack


def _folder(root, n=8):
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (root / c).mkdir(parents=True)
        for i in range(n):
            Image.fromarray(rng.integers(0, 255, (12, 16, 3), dtype=np.uint8)).save(root / c / f"{i}.png")


def _garble(shard, member_suffix):
    """Overwrite the bytes of the first member ending in ``member_suffix`` with zeros (same size)."""
    with tarfile.open(shard) as t:
        m = next(m for m in t.getmembers() if m.name.endswith(member_suffix))
        offset, size = m.offset_data, m.size
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * size)
    return m.name.split(".")[0]


def test_corrupt_sample_is_skipped_named_and_counted_in_workers(tmp_path, caplog):
    _folder(tmp_path / "photos")
    over = ["data=image_folder", f"data.root={tmp_path / 'photos'}", "data.num_classes=2", "data.resolution=8",
            "data.channels=3", "data.holdout_fraction=0"]
    pack(compose(over).data, tmp_path / "pack", samples_per_shard=5, progress=False)
    key = _garble(tmp_path / "pack" / "shard-000000.tar", "000000002.png")
    cfg = compose(["data=shards", f"data.shards={tmp_path / 'pack'}", "data.num_classes=2", "data.resolution=8",
                   "data.channels=3"])
    alone, _ = build_datasets(cfg.data, 0)
    alone[(2, 7)]  # one process: a warning naming the sample, listed as skipped
    name = f"{tmp_path / 'pack' / 'shard-000000.tar'}#{key}"
    assert alone.base.skipped_files == [name] and any(name in r.getMessage() for r in caplog.records)

    train, _ = build_datasets(cfg.data, 0)
    counter = attach_skip_counter(train)
    keys = [(i, 7) for i in range(len(train))]
    loader = DataLoader(train, batch_size=4, num_workers=2, sampler=keys, collate_fn=lambda b: b)
    got = [x for batch in loader for x in batch]
    assert len(got) == len(train) == 16
    assert counter.value == 1  # the worker that read it counted it in the shared counter
    x2, y2 = got[2]
    x3, y3 = train[(3, 7)]  # its replacement: the next decodable sample, as for a folder
    assert y2 == y3 and torch.equal(x2, x3)
    caplog.clear()
    train[(2, 7)]  # met again in this process: listed, but neither warned nor counted twice
    assert train.base.skipped_files == [name] and counter.value == 1
    assert not any(name in r.getMessage() for r in caplog.records)
    assert torch.isfinite(torch.stack([x for x, _ in got])).all()


def test_damaged_tar_header_stops_naming_the_shard(tmp_path):
    """A damaged header breaks the index of the whole shard: the run stops naming it (a StorageError,
    reported in one line) instead of skipping every sample of the shard one warning at a time."""
    _folder(tmp_path / "photos", n=4)
    over = ["data=image_folder", f"data.root={tmp_path / 'photos'}", "data.num_classes=2", "data.resolution=8",
            "data.channels=3", "data.holdout_fraction=0"]
    pack(compose(over).data, tmp_path / "pack", samples_per_shard=4, progress=False)
    shard = tmp_path / "pack" / "shard-000001.tar"
    with tarfile.open(shard) as t:
        header = t.getmembers()[5].offset  # the header block of a member of the second sample
    with open(shard, "r+b") as f:
        f.seek(header)
        f.write(b"\xff" * 512)
    cfg = compose(["data=shards", f"data.shards={tmp_path / 'pack'}", "data.num_classes=2", "data.resolution=8",
                   "data.channels=3"])
    train, _ = build_datasets(cfg.data, 0)  # the size is unchanged: the start-up check passes
    assert train[(0, 1)][0].shape == (3, 1, 8, 8)  # the first shard reads
    with pytest.raises(StorageError, match=f"shard {shard} is damaged: its tar headers cannot be read"):
        train[(5, 1)]
