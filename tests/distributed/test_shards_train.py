"""Training on packed data sets (data=shards): the packed digits train as the digits folder, and a run
killed by SIGKILL and resumed equals the uninterrupted run, at 1 process with DataLoader workers and
at tp=2 x dp=2 with shape buckets and the shard-local order.

That the batches of a step do not depend on dp is tested at the schedule level
(tests/unit/data/test_shards.py); resuming the whole state at another dp in
tests/distributed/test_reshard.py."""
import json
import multiprocessing as mp
import os
import time

import pytest

from tests.helpers import run_ranks, run_ranks_until_killed, train_rank
from vitp import checkpoint as ckpt
from vitp.cli import pack as pack_cli
from vitp.data.photos import make_photo_folder
from vitp.train.rundir import LOCK_FILE

# 6 steps, a checkpoint every 2, the held-out loss at steps 0 and 3, dropout (the RNG state resumes too)
SMOKE = ["experiment=smoke", "trainer.max_steps=6", "trainer.checkpoint_every=2", "trainer.eval_every=3",
         "model.proj_drop=0.1", "eval.t_grid=2"]
BUCKETS = "data.buckets=[{resolution:16x24,batch_size:8,weight:1.0},{resolution:24x16,batch_size:4,weight:1.0}]"


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """The digits packed 500 per shard (4 shards), and 2 classes x 12 photo crops packed 3 per shard
    (8 shards; portrait / square / landscape crops, 32 px on the longer side)."""
    base = tmp_path_factory.mktemp("packs")
    pack_cli.run([str(base / "digits"), "--quiet", "--samples-per-shard", "500"])
    root = make_photo_folder(base / "photos", ("astronaut", "cat"), 12, 32)
    photos = pack_cli.run([str(base / "photo_pack"), "--quiet", "--samples-per-shard", "3", "data=image_folder",
                           f"data.root={root}", "data.num_classes=2", "data.holdout_fraction=0.25"])
    assert len(photos["shardlist"]) == 8
    return base / "digits", base / "photo_pack"


def _rows(run, name="metrics.jsonl"):
    return [json.loads(x) for x in (run / name).read_text().splitlines()]


def _same_steps(a, b, steps):
    """Per-step loss, grad norm and lr bit-identical."""
    assert [x["step"] for x in a] == [x["step"] for x in b] == list(steps)
    for x, y in zip(a, b):
        assert (x["loss"], x["grad_norm"], x["lr"]) == (y["loss"], y["grad_norm"], y["lr"]), (x, y)


def _as_launched():
    """DataLoader workers forked by the trainer, as under vitp-train / torchrun (a rank of
    run_ranks would start them from its own forkserver, which outlives a killed rank: orphans)."""
    mp.set_start_method("fork", force=True)


def _train_and_die(rank, args, run, hook):
    _as_launched()
    os.environ[ckpt.KILL_HOOK] = hook
    return train_rank(rank, args, run)


def _kill_and_resume(world, args, run, kill_rank):
    """Run ``args`` at ``world`` ranks (forked as :func:`tests.helpers.run_ranks` does); rank
    ``kill_rank`` truncates a file and dies by SIGKILL while saving step 4 (the others are killed
    too, as a crashed job); then the same overrides again in the same run dir (trainer.resume=auto):
    they resume from step 2 and run steps 3 to 6."""
    run_ranks_until_killed(world, _train_and_die, args, str(run), f"{kill_rank}:4", kill_rank=kill_rank)
    assert ckpt.published_tags(run / "checkpoints") == ["step_0000002"]
    assert (run / "checkpoints" / "step_0000004.partial").is_dir()
    _assert_unlocked(run)
    resumed = run_ranks(world, train_rank, args, str(run))
    assert [len(r["losses"]) for r in resumed] == [4] * world
    assert ckpt.published_tags(run / "checkpoints")[-1] == "step_0000006"


def _assert_unlocked(run):
    """The run dir is free right after the kill: the killed trainer's DataLoader workers (still
    alive until torch's parent watchdog ends them) dropped their inherited copy of its flock
    (vitp/train/rundir.py), so the restart is not refused as RunDirBusy."""
    import fcntl

    fd = os.open(run / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError: still held
    finally:
        os.close(fd)


def _digit_runs(rank, digits, tmp):
    folder = train_rank(rank, SMOKE, f"{tmp}/folder")
    shards = train_rank(rank, [*SMOKE, "data=shards", f"data.shards={digits}", "data.num_workers=2"], f"{tmp}/shards")
    return folder, shards


def test_packed_digits_train_as_the_folder_and_resume_after_sigkill(packs, tmp_path):
    """data=shards on the packed digits == the digits folder (per-step loss and grad norm, held-out
    loss); killed at step 4's save and resumed (DataLoader workers decode) == uninterrupted."""
    digits, _ = packs
    t0 = time.perf_counter()
    folder, shards = run_ranks(1, _digit_runs, str(digits), str(tmp_path))[0]
    assert shards["losses"] == folder["losses"] and shards["grad_norms"] == folder["grad_norms"]
    _same_steps(_rows(tmp_path / "shards"), _rows(tmp_path / "folder"), range(1, 7))
    held = [r["heldout_loss"] for r in _rows(tmp_path / "folder", "eval.jsonl")]
    assert len(held) == 2 and held == [r["heldout_loss"] for r in _rows(tmp_path / "shards", "eval.jsonl")]
    t1 = time.perf_counter()
    run = tmp_path / "killed" / "run"
    _kill_and_resume(1, [*SMOKE, "data=shards", f"data.shards={digits}", "data.num_workers=2"], run, 0)
    _same_steps(_rows(run), _rows(tmp_path / "shards"), range(1, 7))
    assert _rows(run, "eval.jsonl") == _rows(tmp_path / "shards", "eval.jsonl")
    print(f"timing: parity {t1 - t0:.1f} s, kill + resume {time.perf_counter() - t1:.1f} s")


def test_bucketed_shards_at_tp2_dp2_resume_after_sigkill(packs, tmp_path):
    """tp=2 x dp=2 on the packed photos, two aspect buckets, shard-local order (one shard at a
    time): rank 3 dies by SIGKILL saving step 4; the restart resumes from step 2 and equals the
    uninterrupted run."""
    _, photos = packs
    args = [*SMOKE, "data=shards", f"data.shards={photos}", "data.num_classes=2", "data.resolution=24",
            "data.channels=3", "model.patch_size=4", "data.shuffle_window=1", BUCKETS, "parallel.tp=2"]
    t0 = time.perf_counter()
    ref = run_ranks(4, train_rank, args, str(tmp_path / "ref"))
    assert [len(r["losses"]) for r in ref] == [6] * 4
    t1 = time.perf_counter()
    run = tmp_path / "killed" / "run"
    _kill_and_resume(4, args, run, 3)
    rows, ref_rows = _rows(run), _rows(tmp_path / "ref")
    _same_steps(rows, ref_rows, range(1, 7))
    assert [r["bucket"] for r in rows] == [r["bucket"] for r in ref_rows] and {r["bucket"] for r in rows} == {0, 1}
    assert _rows(run, "eval.jsonl") == _rows(tmp_path / "ref", "eval.jsonl")  # held-out loss per bucket, steps 0, 3
    print(f"timing: reference {t1 - t0:.1f} s, kill + resume {time.perf_counter() - t1:.1f} s")
