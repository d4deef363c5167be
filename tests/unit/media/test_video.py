"""Video previews (GIF/MP4 round trips, atomic writes), grids, strips and the temporal statistic."""

import numpy as np
import pytest
import torch

from vitp.eval import temporal_consistency, temporal_metrics
from vitp.media import (frame_strip, read_video_frames, to_grid, to_uint8_frames, video_grid, write_gif, write_mp4,
                        write_video_samples)
from vitp.media import video as video_io
from vitp.media.video import gif_frame_ms

T, S, SQ = 6, 32, 4  # frames, frame size, square side


def moving_square(color=(1.0, 1.0, 1.0)) -> torch.Tensor:
    """(3, T, S, S) in [-1, 1]: a dark background with a bright square moving 1 px/frame right."""
    x = torch.full((3, T, S, S), -0.8)
    for t in range(T):
        for ch, v in enumerate(color):
            x[ch, t, 10:10 + SQ, 4 + t:4 + t + SQ] = v
    return x


def square_x(frame: np.ndarray, scale: int) -> float:
    """Column of the bright square's centre, in input pixels."""
    lum = frame.astype(np.float64).mean(-1)
    cols = np.nonzero(lum.max(0) > 128)[0]
    return (cols.min() + cols.max() + 1) / 2 / scale


def test_to_uint8_frames_clamps_and_replicates_grey():
    x = torch.tensor([-2.0, -1.0, 0.0, 1.0, 3.0]).view(1, 1, 1, 1, 5)
    u = to_uint8_frames(x)
    assert u.shape == (1, 1, 1, 5, 3) and u.dtype == np.uint8
    assert u[0, 0, 0, :, 0].tolist() == [0, 0, 128, 255, 255]
    assert (u[..., 0] == u[..., 1]).all() and (u[..., 0] == u[..., 2]).all()
    with pytest.raises(ValueError, match="C = 1 or 3"):
        to_uint8_frames(torch.zeros(1, 2, 1, 4, 4))


@pytest.mark.parametrize("color", [(1.0, 1.0, 1.0), (1.0, 0.6, -0.2)], ids=["grey", "rgb"])
def test_gif_round_trip_moves_and_is_upscaled(tmp_path, color):
    path = write_gif(tmp_path / "a.gif", moving_square(color), fps=10)
    got = read_video_frames(path)
    assert got.shape == (T, 128, 128, 3)  # 32 px upscaled x4 to the 128 px minimum side
    ref = to_uint8_frames(moving_square(color)[None])[0].repeat(4, 1).repeat(4, 2)
    assert np.abs(got.astype(int) - ref).max() <= 8  # palette quantisation (exact for these few colours)
    assert [square_x(f, 4) for f in got] == [4 + t + SQ / 2 for t in range(T)]
    from PIL import Image

    with Image.open(path) as im:
        assert im.info["loop"] == 0 and im.info["duration"] == gif_frame_ms(10) == 100
    assert not [p for p in tmp_path.iterdir() if p.name != "a.gif"]


def test_gif_explicit_scale_grey_uint8_and_bad_input(tmp_path):
    frames = (np.arange(3 * 5 * 7).reshape(3, 5, 7) * 2).astype(np.uint8)  # (T, H, W) grey, all frames differ
    frames[1] += 1
    frames[2] += 2
    got = read_video_frames(write_gif(tmp_path / "g.gif", frames, scale=2))
    assert got.shape == (3, 10, 14, 3)
    assert np.array_equal(got[..., 1], frames.repeat(2, 1).repeat(2, 2))  # exact grey palette
    assert gif_frame_ms(6) == 170 and gif_frame_ms(1000) == 20
    with pytest.raises(ValueError, match="uint8"):
        write_gif(tmp_path / "b.gif", frames.astype(np.float32))
    with pytest.raises(ValueError, match="fps"):
        write_gif(tmp_path / "b.gif", frames, fps=0)
    with pytest.raises(ValueError, match="scale"):
        write_gif(tmp_path / "b.gif", frames, scale=0)
    assert not (tmp_path / "b.gif").exists()


@pytest.mark.parametrize("codec", [None, "mpeg4"], ids=["default", "mpeg4-fallback"])
def test_mp4_round_trip_moves(tmp_path, codec):
    x = moving_square()
    path = write_mp4(tmp_path / "a.mp4", x, fps=8, codec=codec)
    got = read_video_frames(path)
    assert got.shape == (T, 128, 128, 3)
    ref = to_uint8_frames(x[None])[0].repeat(4, 1).repeat(4, 2).astype(int)
    assert np.abs(got.astype(int) - ref).mean() < 4  # lossy, but close
    assert [square_x(f, 4) for f in got] == pytest.approx([4 + t + SQ / 2 for t in range(T)], abs=0.25)
    import av

    with av.open(str(path)) as c:
        s = c.streams.video[0]
        assert s.codec_context.name == ("h264" if codec is None else "mpeg4") and s.average_rate == 8
        assert s.codec_context.pix_fmt == "yuv420p"


def test_mp4_pads_odd_sizes(tmp_path):
    frames = np.zeros((2, 5, 7, 3), np.uint8)
    frames[1] = 200
    got = read_video_frames(write_mp4(tmp_path / "odd.mp4", frames, scale=1))
    assert got.shape == (2, 6, 8, 3)
    assert got[0].mean() < 10 and got[1].mean() > 190


@pytest.mark.parametrize("fmt", ["gif", "mp4"])
def test_failed_write_leaves_nothing_and_keeps_the_old_file(tmp_path, monkeypatch, fmt):
    target = tmp_path / f"v.{fmt}"
    target.write_bytes(b"old")
    if fmt == "gif":
        from PIL import GifImagePlugin

        def broken(im, fp, palette):
            fp.write(b"GIF89a partial")
            raise RuntimeError("encoder died")

        monkeypatch.setattr(GifImagePlugin, "_write_multiple_frames", broken)
        writer = write_gif
    else:
        import av

        real, calls = av.VideoFrame.from_ndarray, []

        def broken(*a, **k):
            calls.append(1)
            if len(calls) == 3:
                raise RuntimeError("encoder died")
            return real(*a, **k)

        monkeypatch.setattr(av.VideoFrame, "from_ndarray", broken)
        writer = write_mp4
    with pytest.raises(RuntimeError, match="encoder died"):
        writer(target, moving_square())
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


def test_read_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_video_frames(tmp_path / "none.mp4")
    for name in ("junk.gif", "junk.mp4"):
        (tmp_path / name).write_bytes(b"not a video at all")
        with pytest.raises(ValueError, match=f"{name}"):
            read_video_frames(tmp_path / name)


def test_temporal_consistency():
    static = torch.rand(2, 3, 1, 4, 4).expand(-1, -1, 5, -1, -1) * 2 - 1
    assert temporal_consistency(static) == 0.0
    ramp = (-0.9 + 0.3 * torch.arange(5.0)).view(1, 1, 5, 1, 1).expand(2, 3, 5, 4, 4)  # x_t = -0.9 + 0.3 t
    assert temporal_consistency(ramp) == pytest.approx(0.3, rel=1e-6)
    assert temporal_consistency(-ramp) == pytest.approx(0.3, rel=1e-6)
    flicker = torch.tensor([-1.0, 1.0, -1.0]).view(1, 1, 3, 1, 1)
    assert temporal_consistency(flicker) == 2.0  # the maximum
    assert temporal_consistency(3 * flicker) == 2.0 and temporal_consistency(3 * flicker, clamp=False) == 6.0
    m = temporal_metrics(ramp * 0.5, ramp)
    assert m["temporal_diff"] == pytest.approx(0.15) and m["temporal_diff_real"] == pytest.approx(0.3)
    assert m["temporal_diff_ratio"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="at least 2 frames"):
        temporal_consistency(torch.zeros(2, 3, 1, 4, 4))
    with pytest.raises(ValueError, match=r"\(B, C, T, H, W\)"):
        temporal_consistency(torch.zeros(3, 5, 4, 4))


def test_video_grid_layout_matches_to_grid():
    x = torch.rand(5, 1, 3, 8, 8) * 2 - 1
    g = video_grid(x, nrow=3)
    assert g.shape == (3, 3, 2 * 64 + 3 * 2, 3 * 64 + 4 * 2)
    for t in range(3):
        assert torch.equal(g[t], to_grid(x[:, :, t:t + 1], nrow=3))
    # sample 4 (row 1, col 1) at time 2, upscaled x8, grey replicated
    tile = g[2, :, 2 + 66:2 + 66 + 64, 2 + 66:2 + 66 + 64]
    assert torch.equal(tile, ((x[4, :, 2] + 1) / 2).repeat_interleave(8, -2).repeat_interleave(8, -1).expand(3, -1, -1))
    assert (g[:, :, :, -2:] == 1).all()  # padding
    assert video_grid(x, nrow=10, min_tile=0, padding=0).shape == (3, 3, 8, 40)


def test_frame_strip_places_frames_side_by_side():
    x = torch.rand(3, 4, 5, 6) * 2 - 1  # (C, T, H, W)
    s = frame_strip(x)
    assert s.shape == (3, 5, 4 * 6)
    for t in range(4):
        assert torch.allclose(s[:, :, t * 6:(t + 1) * 6], (x[:, t] + 1) / 2)
    b = frame_strip(torch.zeros(2, 1, 3, 4, 4), padding=1, pad_value=0.0)  # batch, grey -> (B, 3, H, T*W + gaps)
    assert b.shape == (2, 3, 4, 3 * 4 + 2)
    assert (b[..., 4] == 0).all() and (b[..., :4] == 0.5).all()


def test_write_video_samples_names_and_grid(tmp_path):
    x = torch.stack([moving_square((v, v, v)) for v in (1.0, 0.5, 0.0)] * 2)  # 6 grey levels of the moving square
    labels = torch.tensor([3, 3, 7, 7, 0, 3])
    paths = write_video_samples(x, labels, tmp_path / "samples", step=500, fps=8)
    names = [p.name for p in paths]
    assert names == ["class3_seed0.gif", "class3_seed1.gif", "class7_seed0.gif", "class7_seed1.gif",
                     "class0_seed0.gif", "class3_seed2.gif", "grid.gif"]
    assert all(p.parent == tmp_path / "samples" / "step_0000500" and p.is_file() for p in paths)
    assert sorted(p.name for p in paths[0].parent.iterdir()) == sorted(names)  # no temp files left
    assert read_video_frames(paths[0]).shape == (T, 128, 128, 3)
    grid = read_video_frames(paths[-1])
    assert grid.shape == (T, 3 * 66 + 2, 3 * 66 + 2, 3)  # rows = classes 3, 7, 0; 3 columns (class 3 has 3)
    assert (grid[:, 2 + 66 + 10:2 + 66 + 50, 2 + 2 * 66 + 10:2 + 2 * 66 + 50] == 255).all()  # blank tile: class 7
    mp4 = write_video_samples(x[:2], [1, 2], tmp_path, name="final", fmt="mp4", class_names=["a", "b c/d", "e"])
    assert [p.relative_to(tmp_path).as_posix() for p in mp4] == [
        "final/class1_b-c-d_seed0.mp4", "final/class2_e_seed0.mp4", "final/grid.mp4"]
    with pytest.raises(ValueError, match="2 labels for 6 samples"):
        write_video_samples(x, [0, 1], tmp_path)
    with pytest.raises(ValueError, match="fmt"):
        write_video_samples(x, labels, tmp_path, fmt="avi")
    with pytest.raises(ValueError, match="not both"):
        write_video_samples(x, labels, tmp_path, step=1, name="x")
    _vitp_sample_names_prompt_rows_for_prompts(x, tmp_path / "cli")


def _vitp_sample_names_prompt_rows_for_prompts(x, out):
    """vitp-sample --prompt on a text video run wrote class1_seed0.gif, ...: the files are named for
    the prompts, numbered from 1 as in its prompts.txt; a class run keeps class<c>_seed<k>."""
    from omegaconf import OmegaConf

    from vitp.cli.sample import _VIDEO_FILE, _write_samples

    cfg = OmegaConf.create({"sampler": {"samples_per_class": 2, "method": "heun", "steps": 2, "cfg_scale": 1.5,
                                        "fps": 8}, "model": {"num_frames": T}})
    _write_samples(x[:4], torch.tensor([1, 1, 2, 2]), cfg, out / "text", False, "gif", ["a dog", "a cat"])
    names = sorted(p.name for p in (out / "text").iterdir())
    assert names == ["grid.gif", "prompt1_seed0.gif", "prompt1_seed1.gif", "prompt2_seed0.gif", "prompt2_seed1.gif",
                     "prompts.txt"]
    assert (out / "text" / "prompts.txt").read_text() == "1 a dog\n2 a cat\n"
    assert [n for n in names if _VIDEO_FILE.match(n)] == names[:-1]  # --force replaces them
    _write_samples(x[:2], torch.tensor([3, 3]), cfg, out / "class", False, "gif", [])
    assert sorted(p.name for p in (out / "class").iterdir()) == ["class3_seed0.gif", "class3_seed1.gif", "grid.gif"]


def test_module_exports():
    assert set(video_io.__all__) <= set(dir(video_io))


def test_codec_falls_back_to_mpeg4_without_libx264(tmp_path, monkeypatch):
    import av

    real = av.codec.Codec

    def no_x264(name, mode="r"):
        if name == "libx264":
            raise av.error.FFmpegError(-1, "unknown encoder")  # as in an FFmpeg build without libx264
        return real(name, mode)

    monkeypatch.setattr(av.codec, "Codec", no_x264)
    assert video_io._pick_codec(None) == "mpeg4"
    with av.open(str(write_mp4(tmp_path / "f.mp4", moving_square()))) as c:
        assert c.streams.video[0].codec_context.name == "mpeg4"
    with pytest.raises(ValueError, match="no usable video encoder"):
        video_io._pick_codec("libx264")


def test_grid_layout():
    x = torch.zeros(6, 1, 1, 8, 8)
    grid = to_grid(x, nrow=3)
    assert grid.shape == (3, 2 * 64 + 3 * 2, 3 * 64 + 4 * 2)
