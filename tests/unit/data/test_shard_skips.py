"""Undecodable samples of a pack are skipped, named and counted across DataLoader workers."""
import logging
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


def _garble_all(shard, suffix):
    """Overwrite the media bytes of every sample of ``shard`` with zeros (same size: the pack's
    start-up check of shard sizes passes)."""
    with tarfile.open(shard) as t:
        members = [(m.offset_data, m.size) for m in t.getmembers() if m.name.endswith(suffix)]
    with open(shard, "r+b") as f:
        for offset, size in members:
            f.seek(offset)
            f.write(b"\0" * size)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_pack_without_a_readable_sample_is_one_error_naming_its_shards(tmp_path, caplog):
    """A new user's pack whose every sample was damaged ended in a RuntimeError traceback from the
    DataLoader, and the skip warnings said ``<_io.BytesIO object at ...>``. Now the warnings name
    the shard and the sample's member, and start-up (or a worker) raises one line naming the shards
    and the fix."""
    from vitp.data.base import UnreadableData, check_readable
    from vitp.data.loader import LoaderBatches

    _folder(tmp_path / "photos", n=2)
    over = ["data=image_folder", f"data.root={tmp_path / 'photos'}", "data.num_classes=2", "data.resolution=8",
            "data.channels=3", "data.holdout_fraction=0"]
    pack(compose(over).data, tmp_path / "pack", samples_per_shard=2, progress=False)
    shards = [tmp_path / "pack" / f"shard-00000{k}.tar" for k in (0, 1)]
    for shard in shards:
        _garble_all(shard, ".png")
    cfg = compose(["data=shards", f"data.shards={tmp_path / 'pack'}", "data.num_classes=2", "data.resolution=8",
                   "data.channels=3"])
    train, _ = build_datasets(cfg.data, 0)
    first = f"{shards[0]}#000000000"
    message = (f"none of the 4 samples of the pack data.shards={tmp_path / 'pack'} could be decoded (e.g. {first}"
               "{why}): the damaged samples are in " + f"{shards[0]}, {shards[1]}; delete those shards and re-run the "
               "same vitp-pack command (it writes missing shards again), or pack the source data again")
    why = f": UnidentifiedImageError: cannot identify image file {first}.png"
    with pytest.raises(UnreadableData) as e:
        check_readable(train)  # at start-up, before a run writes anything
    assert str(e.value) == message.format(why=why)
    assert not _warnings(caplog)  # the check warns about nothing: training does
    with pytest.raises(UnreadableData) as e:
        train[(1, 7)]
    assert str(e.value) == message.format(why="")
    said = _warnings(caplog)
    second = f"{shards[0]}#000000001"  # read from item 1 on
    assert said[0] == f"skipping undecodable sample {second}: UnidentifiedImageError: cannot identify image " \
                      f"file {second}.png" and len(said) == 4
    assert not any("BytesIO" in m for m in said)
    loader = DataLoader(train, batch_size=2, num_workers=1, sampler=[(0, 1), (1, 1)], collate_fn=lambda b: b)
    with pytest.raises(UnreadableData) as e:  # raised in the worker: the same one line, not torch's traceback
        next(LoaderBatches(loader))
    assert str(e.value) == message.format(why="")


def test_a_damaged_packed_video_is_named_by_its_shard_and_key(tmp_path, caplog):
    """PyAV named a packed video ``'<none>'`` in its error: the warning now names the tar member."""
    from tests.unit.data.test_video import _frames, _write
    from vitp.data.base import UnreadableData

    for c in ("a", "b"):
        _write(tmp_path / "videos" / c / f"{c}.mkv", _frames(8, 12, 16))
    over = ["data=video_folder", f"data.root={tmp_path / 'videos'}", "data.num_classes=2", "data.resolution=8",
            "data.num_frames=4", "data.frame_stride=1", "data.holdout_fraction=0", f"data.cache_dir={tmp_path / 'c'}"]
    pack(compose(over).data, tmp_path / "pack", samples_per_shard=2, progress=False)
    _garble_all(tmp_path / "pack" / "shard-000000.tar", ".mkv")
    cfg = compose(["data=shards", f"data.shards={tmp_path / 'pack'}", "data.num_classes=2", "data.resolution=8",
                   "data.num_frames=4"])
    train, _ = build_datasets(cfg.data, 0)
    with pytest.raises(UnreadableData, match="none of the 2 samples of the pack"):
        train[(0, 3)]
    member = f"{tmp_path / 'pack' / 'shard-000000.tar'}#000000000"
    assert _warnings(caplog)[0] == (f"skipping video {member}: decode failed: InvalidDataError: [Errno "
                                    f"1094995529] Invalid data found when processing input: '{member}.mkv'")
