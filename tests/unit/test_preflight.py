"""The start-up check (vitp.train.preflight): a run the planner predicts to need more memory than
the device has is refused before anything is written; a predicted step over a minute is warned
about once, naming the keys that fix it; the documented commands pass."""
from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import compose_cfg
from vitp.train import preflight as pf

CPU = torch.device("cpu")
# the command: 256 px at the default model's patch 2 (16,384 tokens per sample, batch 64)
OWN_256 = ["data=image_folder", "data.root=DIR", "data.num_classes=2"]
KEYS = ("model.patch_size", "data.resolution", "trainer.micro_batch_size", "trainer.global_batch_size", "parallel.")


@pytest.fixture(autouse=True)
def assumed_cpu(monkeypatch, tmp_path):
    """No cached CPU profile: the assumed one (fixed numbers, whatever this machine measured)."""
    monkeypatch.setenv("VITP_CACHE_DIR", str(tmp_path / "cache"))


def test_a_run_bigger_than_the_memory_is_refused_naming_the_keys():
    with pytest.raises(ValueError) as e:
        pf.check_predictions(compose_cfg([*OWN_256, "parallel.auto_memory_gib=16"]), CPU, 1)
    msg = str(e.value)
    assert msg.startswith("predicted peak memory 71.9 GiB per rank (16384 tokens per sample (model.patch_size=2), "
                          "micro-batch 64 x 1, layout tp=1 pp=1 dp=1) exceeds the 16.0 GiB a rank of 1 x cpu")
    assert all(k in msg for k in KEYS) and "\n" not in msg and "data.resolution (smaller)" in msg
    assert "e.g. model.patch_size=8 fits" in msg and "parallel.auto_memory_gib" in msg
    with pytest.raises(ValueError, match=r"exceeds the 8\.00 GiB a rank"):  # a CPU's RAM is shared by the ranks
        pf.check_predictions(compose_cfg([*OWN_256, "parallel.auto_memory_gib=16", "trainer.micro_batch_size=32"]),
                             CPU, 2)


def test_a_slow_step_is_warned_about_once_with_the_time_and_the_keys(caplog):
    cfg = compose_cfg([*OWN_256, "parallel.auto_memory_gib=100"])  # fits: only the step time is left
    with caplog.at_level(logging.WARNING, logger="vitp"):
        warning = pf.preflight(cfg, CPU)
    assert warning is not None and warning.startswith("predicted ") and " s per step (16384 tokens" in warning
    step_s = float(warning.split()[1])
    assert step_s > pf.STEP_WARN_S and all(k in warning for k in KEYS)
    assert [r.getMessage() for r in caplog.records] == [warning]


def test_the_phase_times_are_logged_for_the_held_out_items_the_run_has(caplog):
    """The start-up line of sampling and evaluation times counts the run's held-out items (the
    planner assumed 1000 before the data was read: a user's 12 video clips were "45 s", then 0.7 s),
    and leaves the held-out loss out when there are none."""
    def line(items):
        pf.preflight(compose_cfg([]), CPU)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vitp"):
            pf.log_phase_times(items)
        (msg,) = [r.getMessage() for r in caplog.records]
        pf.log_phase_times(items)  # once per preflight
        assert len(caplog.records) == 1
        return msg

    def seconds(msg, phase):
        return float(msg.split(phase, 1)[1].split()[0])

    few, many = line(12), line(1000)
    assert few.startswith("sampling and evaluation per rank (planner): sample grid ")
    assert seconds(few, "held-out loss (12 items) ") * 10 < seconds(many, "held-out loss (1000 items) ")
    assert seconds(few, "sample grid ") == seconds(many, "sample grid ")
    assert "held-out loss" not in line(0) and "sample grid " in line(0)


@pytest.mark.parametrize("over", [
    [],  # the digits demo
    ["experiment=video_demo"],
    ["experiment=photo_buckets"],
    ["data=image_folder", "data.root=photos", "data.num_classes=2", "data.resolution=32", "model.patch_size=4"],
])
def test_the_cpu_demos_and_the_documented_cpu_command_pass_silently(over, caplog):
    with caplog.at_level(logging.WARNING, logger="vitp"):
        assert pf.preflight(compose_cfg(over), CPU) is None
    assert not caplog.records


def test_zero_buckets_count_on_a_gpu_but_only_their_touched_pages_on_a_cpu():
    """ZeRO-1's buckets are allocated at DeepSpeed's bucket size (3.73 GiB in fp32) whatever the
    model; on CPU only the pages gradients are written to are resident, so 8 ranks of the smoke model
    (the 8-process layout tests) fit a 24 GiB machine, while a GPU holds the whole allocation. The
    planner's prediction itself counts them so (the check reads its total)."""
    from dataclasses import replace

    from vitp.plan import layout_of, stage_memory
    from vitp.plan.memory import zero_bucket_bytes

    cfg = compose_cfg(["experiment=smoke", "parallel.tp=2", "parallel.pp=2", "trainer.micro_batch_size=4",
                       "parallel.auto_memory_gib=23.5"])
    assert pf.check_predictions(cfg, CPU, 8) is None  # 23.5 / 8 = 2.94 GiB per rank, 3.73 GiB of buckets
    lay = layout_of(cfg, 8, "cpu")
    (_, _, pred), = pf.shape_predictions(cfg, lay, pf.startup_profile(cfg, CPU, 8))
    assert zero_bucket_bytes(lay) == 2 * 500_000_000 * 4 > 3.7 * 2**30
    assert pred.peak.zero_buckets == pred.peak.grads > 0 and pred.peak.total < 2**30
    gpu = replace(lay, device="cuda")
    assert [m.zero_buckets for m in stage_memory(cfg.model, gpu)] == [4e9, 4e9]


def test_buckets_are_checked_at_their_own_size_and_batch():
    cfg = compose_cfg(["experiment=photo_buckets"])
    from vitp.plan import layout_of

    preds = pf.shape_predictions(cfg, layout_of(cfg, 1, "cpu"), pf.startup_profile(cfg, CPU, 1))
    assert [(label, p.layout.micro) for label, _, p in preds] == [
        ("bucket 16x24", 24), ("bucket 24x24", 16), ("bucket 24x16", 24)]
    big = compose_cfg(["experiment=photo_buckets", "data.buckets.1.resolution=256x256", "model.patch_size=2",
                       "parallel.auto_memory_gib=4"])
    with pytest.raises(ValueError, match=r"\(bucket 256x256: 16384 tokens per sample"):
        pf.check_predictions(big, CPU, 1)


def test_a_bucket_too_big_is_named_with_the_keys_that_shrink_it():
    """A new user's trial: a bucket that did not fit was told to lower data.resolution, which a
    bucketed run does not train at. The refusal names the bucket, its place in data.buckets, its
    batch and micro-batch keys; each fix it names passes the check. The slow-step warning names the
    bucket's resolution and batch (more micro-batches per step do not shorten a step)."""
    over = ["experiment=photo_buckets", "data.buckets.1.resolution=256x256", "model.patch_size=2"]
    with pytest.raises(ValueError) as e:
        pf.check_predictions(compose_cfg([*over, "parallel.auto_memory_gib=4"]), CPU, 1)
    parallel = ("model.patch_size (larger: fewer tokens per sample), or parallel.* (parallel.tp / parallel.cp / "
                "parallel.pp over more devices, parallel.activation_checkpoint_interval=1)")
    assert str(e.value).split("; ")[-2] == (  # its own "; " splits the message: the fix is the last but one
        "shrink the run: bucket 256x256 (data.buckets.1: drop it from data.buckets, or a smaller "
        "data.buckets.1.resolution), its micro-batch (a smaller data.buckets.1.batch_size=16, or more micro-batches "
        f"per step: a smaller trainer.micro_batch_size=16 against trainer.global_batch_size=16), {parallel}")
    assert "data.resolution" not in str(e.value)
    for fix in ("data.buckets.1.resolution=128x128", "data.buckets.1.batch_size=4", "trainer.micro_batch_size=2",
                "data.buckets=[{resolution: 16x24, batch_size: 24, weight: 1.0}]"):
        pf.check_predictions(compose_cfg([*over, "parallel.auto_memory_gib=4", fix]), CPU, 1)  # fits (maybe slow)
    slow = pf.check_predictions(compose_cfg([*over, "parallel.auto_memory_gib=100"]), CPU, 1)
    assert slow.split("; ")[-1] == ("to train faster change bucket 256x256 (data.buckets.1: drop it from data.buckets, "
                                    f"or a smaller data.buckets.1.resolution or data.buckets.1.batch_size=16), {parallel}")


def test_the_documented_gpu_command_fits_one_h100():
    cfg = compose_cfg(["experiment=img256", "data.root=/data/my_photos", "data.num_classes=10",
                       "parallel.auto_device=h100"])
    assert pf.check_predictions(cfg, torch.device("cuda"), 1) is None
    assert pf.startup_profile(cfg, torch.device("cuda"), 1).name == "h100"


def test_vitp_train_refuses_in_one_line_before_writing(tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", VITP_CACHE_DIR=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, "-m", "vitp.train", "experiment=smoke", "parallel.auto_memory_gib=0.0001",
                        f"hydra.run.dir={run}"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    last = p.stderr.strip().splitlines()[-1]  # refused after Hydra started: still on stderr, not stdout
    assert "vitp-train: error: predicted peak memory" in last and "model.patch_size" in last
    assert "error" not in p.stdout.lower(), p.stdout
    assert not run.exists() or not any(run.iterdir())


def test_sampling_that_would_not_fit_is_refused_naming_sampler_batch_size():
    """The sample grid's ODE state of sampler.batch_size clips is counted per rank: a video run that
    trains within 80 GiB but would integrate 256 clips at once is refused before step 1."""
    over = ["experiment=video_long", "data.root=/data/clips", "data.num_classes=8", "parallel.auto_device=h100",
            "parallel.auto_memory_gib=80"]
    assert pf.check_predictions(compose_cfg(over), torch.device("cuda"), 8) is None  # the recipe: batch_size 1
    with pytest.raises(ValueError) as e:
        pf.check_predictions(compose_cfg([*over, "sampler.batch_size=256"]), torch.device("cuda"), 8)
    msg = str(e.value)
    assert msg.startswith("sample grid: predicted peak memory") and "sampler.batch_size=256" in msg, msg


@pytest.mark.parametrize("exp,gpus,extra", [("video_long", 8, []), ("img256", 8, []), ("img1024", 8, []),
                                            ("latent_img1024", 8, []), ("latent_video_wan", 8, []),
                                            ("video512", 8, [])])
def test_recipes_fit_every_phase_on_their_gpus(exp, gpus, extra):
    """vitp-plan's first row of each GPU recipe fits the training step and every phase around it
    (sample grid, held-out loss, final samples) in an 80 GiB H100, each phase's forwards split
    over the ranks."""
    from vitp.plan import get_profile, phase_costs_of, plan
    from vitp.utils import to_dict

    cfg = compose_cfg([f"experiment={exp}", "data.num_classes=10", *extra])
    prof = get_profile("h100", 80)
    best = plan(cfg, gpus, prof)[0]
    assert best.fits
    costs = phase_costs_of(cfg, best, to_dict(cfg.model), prof)
    assert [c.name for c in costs] == ["sample grid", "held-out loss", "final samples"]
    state = max(m.weights + m.grads + m.optimizer + m.ema for m in best.memory)
    for c in costs:
        assert state < c.memory_bytes <= best.limit_bytes, (exp, c)
        assert c.forwards > 0 and c.seconds > 0
    one = phase_costs_of(cfg, replace_dp(best, 1), to_dict(cfg.model), prof)[0]
    assert one.samples >= costs[0].samples * best.layout.dp - best.layout.dp  # dp replicas split the grid


def replace_dp(pred, dp):
    """``pred`` with its layout at ``dp`` replicas (the samples' split is all that changes)."""
    from dataclasses import replace

    return replace(pred, layout=replace(pred.layout, dp=dp))


@pytest.mark.parametrize("root,num_classes,message", [
    ("/missing", ["data.num_classes=2"], "data.root=/missing does not exist; set data.root=<folder with one subfolder"),
    ("/missing", [], "data.root=/missing does not exist"),
    ("FILE", ["data.num_classes=2"], "is a file, not a folder; set data.root=<folder"),
])
def test_a_missing_data_folder_is_named_before_the_memory_check(root, num_classes, message, tmp_path, capsys):
    """The issue's command at 256 px would not fit (71.9 GiB predicted): the missing folder (or a
    file as data.root) is what vitp-train names, in one line on stderr, before Hydra starts."""
    from vitp.cli import run_cli
    from vitp.cli.train import prepare_argv
    from vitp.train import check_config

    if root == "FILE":
        root = str(tmp_path / "a_file")
        (tmp_path / "a_file").write_text("")
    over = ["data=image_folder", f"data.root={root}", *num_classes]
    with pytest.raises(FileNotFoundError if root == "/missing" else NotADirectoryError, match="data.root="):
        check_config(compose_cfg(over))  # the Trainer's first check, before preflight
    with pytest.raises(SystemExit) as e:
        run_cli("vitp-train", prepare_argv, ["vitp-train", *over, f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("vitp-train: error: data.root="), err
    assert message in err and "predicted peak memory" not in err


def test_a_held_out_folder_that_is_the_training_folder_is_refused(tmp_path, capsys):
    """``data.heldout_root`` naming ``data.root`` again (here through a trailing slash and ``..``)
    would score the training images as held-out ones: one line naming both fixes, before Hydra."""
    from vitp.cli import run_cli
    from vitp.cli.train import prepare_argv
    from vitp.train import check_config

    (tmp_path / "photos" / "a").mkdir(parents=True)
    (tmp_path / "other" / "a").mkdir(parents=True)
    root = str(tmp_path / "photos")
    same = ["data=image_folder", f"data.root={root}", f"data.heldout_root={tmp_path}/other/../photos/", "data.num_classes=1"]
    with pytest.raises(ValueError, match="is data.root: the held-out loss and FID would score the items the run trains on"):
        check_config(compose_cfg(same))
    with pytest.raises(SystemExit) as e:
        run_cli("vitp-train", prepare_argv, ["vitp-train", *same, f"hydra.run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "data.heldout_root=null to hold out" in err, err
    assert not (tmp_path / "run").exists()
    check_config(compose_cfg([*same[:2], f"data.heldout_root={tmp_path / 'other'}", "data.num_classes=1"]))


def test_the_fid_phase_is_planned_per_replica_with_inception_on_top_of_sampling():
    """``eval.fid.num``: a ``FID`` phase after the final samples (none without it). On each replica:
    ``num / dp`` samples at the final samples' forwards per sample, their time plus one Inception-V3
    forward (11.4 GFLOP) per sample at the device's fp32 efficiency, and the final samples' memory
    plus Inception's weights, a batch's largest activations and the feature sums."""
    from vitp.plan import get_profile, phase_costs_of, plan
    from vitp.plan.phases import FID_SUMS_BYTES, INCEPTION_ACT_BYTES, INCEPTION_BYTES, INCEPTION_FLOPS
    from vitp.utils import to_dict

    prof = get_profile("h100", 80)
    base = compose_cfg(["experiment=img256", "eval.num_samples=1000"])
    cfg = compose_cfg(["experiment=img256", "eval.num_samples=1000", "eval.fid.num=50000", "eval.fid.batch_size=25"])
    best = plan(base, 8, prof)[0]
    plain = phase_costs_of(base, best, to_dict(base.model), prof)
    costs = phase_costs_of(cfg, best, to_dict(cfg.model), prof)
    assert [c.name for c in plain] == ["sample grid", "held-out loss", "final samples"]
    assert [c.name for c in costs] == [c.name for c in plain] + ["FID"]
    final, fid, dp = costs[2], costs[3], best.layout.dp
    assert fid.samples == -(-50000 // dp) and final.samples == -(-1000 // dp)
    assert fid.forwards == pytest.approx(final.forwards * fid.samples / final.samples, rel=0.01)
    inception_s = fid.samples * INCEPTION_FLOPS / (prof.peak_flops["fp32"] * prof.efficiency)
    assert fid.seconds - inception_s == pytest.approx(final.seconds * fid.samples / final.samples, rel=0.01)
    assert fid.memory_bytes - final.memory_bytes == INCEPTION_BYTES + 25 * INCEPTION_ACT_BYTES + FID_SUMS_BYTES
    assert fid.memory_bytes <= best.limit_bytes


def test_the_fvd_phase_and_clip_score_are_planned():
    """``eval.fvd.num`` on a video run: an ``FVD`` phase with one I3D forward per clip (its frames
    repeated up to 9, as the evaluation repeats them) on top of drawing the clips; none on an image
    run. ``eval.clip.model`` adds one CLIP forward per FID sample, and its weights to the phase's
    memory when larger than Inception's."""
    from vitp.plan import get_profile, phase_costs_of, plan
    from vitp.plan.phases import CLIP_BYTES, CLIP_FLOPS, I3D_BYTES, I3D_FLOPS_PER_FRAME
    from vitp.utils import to_dict

    prof = get_profile("h100", 80)
    flops = prof.peak_flops["fp32"] * prof.efficiency
    video = compose_cfg(["experiment=video512", "eval.fvd.num=2048", "eval.fvd.batch_size=1"])
    best = plan(video, 8, prof)[0]
    final, fvd = phase_costs_of(video, best, to_dict(video.model), prof)[2:]
    frames = max(int(video.model.num_frames), 9)
    assert fvd.name == "FVD" and fvd.samples == -(-2048 // best.layout.dp)
    assert fvd.seconds - fvd.samples * frames * I3D_FLOPS_PER_FRAME / flops == pytest.approx(
        final.seconds * fvd.samples / final.samples, rel=0.01)
    assert fvd.memory_bytes - final.memory_bytes == pytest.approx(
        I3D_BYTES + 2 * 64 * -(-frames // 2) * 112 * 112 * 4, rel=1e-9)
    image = compose_cfg(["experiment=img256", "eval.fvd.num=2048"])
    assert [c.name for c in phase_costs_of(image, plan(image, 8, prof)[0], to_dict(image.model), prof)][-1] != "FVD"
    fid_cfg = ["experiment=img256", "eval.fid.num=1000"]
    plain, clip = (compose_cfg(fid_cfg + extra) for extra in ([], ["eval.clip.model=/models/clip"]))
    best = plan(plain, 8, prof)[0]
    a, b = (phase_costs_of(c, best, to_dict(c.model), prof)[-1] for c in (plain, clip))
    assert b.seconds - a.seconds == pytest.approx(a.samples * CLIP_FLOPS / flops, rel=1e-9)
    assert b.memory_bytes >= a.memory_bytes and b.memory_bytes - a.memory_bytes <= CLIP_BYTES
