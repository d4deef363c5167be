"""A restarted run shows one history; another config is refused (the busy-folder refusal is also
in test_launchers.py, against a live run); a refused launch writes nothing into the run dir."""
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import PERTURBED, free_port, metrics, run_ranks
from vitp.config import compose


def _tb_steps(run, tag="loss"):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def _crash_before_first_checkpoint(run):
    """What a run killed before its first checkpoint leaves: its logs, samples, events and config."""
    shutil.rmtree(run / "checkpoints")
    for p in run.glob("model*"):
        p.unlink()


def test_restart_before_the_first_checkpoint_shows_one_history(tmp_path):
    run_ranks(1, _restart_before_the_first_checkpoint, tmp_path / "run")  # keeps the process group out of pytest's


def _restart_before_the_first_checkpoint(rank, run):
    from vitp.train import train

    over = ["experiment=smoke", "model.depth=2", "trainer.sample_every=1", "trainer.eval_every=2",
            "trainer.log_every=1", "trainer.checkpoint_every=0", "eval.t_grid=2"]
    train(compose([*over, "trainer.max_steps=3"]), run)
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert _tb_steps(run, "eval/heldout_loss") == [0, 2]
    _crash_before_first_checkpoint(run)

    train(compose([*over, "trainer.max_steps=2"]), run)  # the same run, relaunched
    assert [r["step"] for r in metrics(run)] == [1, 2]
    assert [json.loads(x)["step"] for x in (run / "eval.jsonl").read_text().splitlines()] == [0]  # 2 is the last
    assert sorted(p.name for p in (run / "samples").iterdir()) == ["step_0000001.png", "step_0000002.png"]
    assert _tb_steps(run) == [1, 2]
    assert _tb_steps(run, "eval/heldout_loss") == [0]

    _crash_before_first_checkpoint(run)
    before = (run / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=r"holds another config's run \(model.depth: 2 before vs 3 now\)"):
        train(compose([*over, "model.depth=3", "trainer.max_steps=2"]), run)
    assert (run / "metrics.jsonl").read_text() == before
    assert "depth: 2" in (run / ".hydra" / "config.yaml").read_text()


def test_exit_at_step_at_or_before_the_resumed_step(tmp_path):
    run_ranks(1, _exit_at_step_at_or_before_the_resumed_step, tmp_path / "run")


def _exit_at_step_at_or_before_the_resumed_step(rank, run):
    """The same command again after a stop at ``trainer.exit_at_step`` (a requeued or restarted
    job) stops again at once, training nothing; a stop step before the resumed one is refused
    before anything is written, naming the option, the step and the fix."""
    from vitp.train import train

    over = ["experiment=smoke", "trainer.max_steps=4"]
    assert train(compose([*over, "trainer.exit_at_step=2"]), run)["stopped_at"] == 2
    again = train(compose([*over, "trainer.exit_at_step=2"]), run)
    assert again["stopped_at"] == 2 and again["losses"] == []
    assert [r["step"] for r in metrics(run)] == [1, 2]
    assert (run / "checkpoints" / "latest").read_text() == "step_0000002"
    with pytest.raises(ValueError, match=r"trainer.exit_at_step=1 is before step 2, where this run resumes .*drop "
                                         r"trainer.exit_at_step .* or set it above 2"):
        train(compose([*over, "trainer.exit_at_step=1"]), run)
    assert [r["step"] for r in metrics(run)] == [1, 2]
    assert len(train(compose(over), run)["losses"]) == 2 and [r["step"] for r in metrics(run)] == [1, 2, 3, 4]


def test_a_relaunch_continues_past_the_checkpoint_it_started_from(tmp_path):
    run_ranks(1, _relaunch_continues_past_the_checkpoint_it_started_from, tmp_path)


def _relaunch_continues_past_the_checkpoint_it_started_from(rank, tmp):
    """A run started from another run's checkpoint (``trainer.resume=PATH``, recorded in its
    config) and relaunched with the same PATH (the same command, a requeued job) continues from
    its own latest checkpoint; a PATH the record does not name is used as given."""
    from omegaconf import OmegaConf

    from vitp.train import train

    over, a, b = ["experiment=smoke", "trainer.checkpoint_every=2"], tmp / "a", tmp / "b"
    train(compose([*over, "trainer.max_steps=4"]), a)
    start = f"trainer.resume={a / 'checkpoints' / 'step_0000002'}"
    assert len(train(compose([*over, start, "trainer.max_steps=3"]), b)["losses"]) == 1  # step 3, saved
    assert len(train(compose([*over, start, "trainer.max_steps=5"]), b)["losses"]) == 2  # 4, 5 (not 3 again)
    assert [r["step"] for r in metrics(b)] == [3, 4, 5]
    assert OmegaConf.load(b / ".hydra" / "config.yaml").trainer.resume == str(a / "checkpoints" / "step_0000002")
    pin = f"trainer.resume={a / 'checkpoints' / 'step_0000004'}"  # another checkpoint: the user's pin
    assert len(train(compose([*over, pin, "trainer.max_steps=6"]), b)["losses"]) == 2  # 5, 6 from a's step 4
    assert [r["step"] for r in metrics(b)] == [3, 4, 5, 6]
    assert OmegaConf.load(b / ".hydra" / "config.yaml").trainer.resume == str(a / "checkpoints" / "step_0000004")


TINY = ["experiment=smoke", "trainer.max_steps=1"]


def _vitp_train(args, run, **env):
    """``python -m vitp.train`` (what ``vitp-train`` runs) into ``run``; its exit status and output."""
    keep = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-m", "vitp.train", *args, f"hydra.run.dir={run}"], cwd=run.parent,
                       env={**keep, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **env},
                       capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout + p.stderr


def test_list_resolution_trains_and_a_refused_launch_writes_nothing(tmp_path):
    """``data.resolution=[H, W]`` (the list form) trains; a launch refused for its config leaves
    the run dir empty (no .hydra/, train.log, metrics.jsonl, tb/), so the corrected relaunch is
    not taken for another config's run."""
    from omegaconf import OmegaConf

    run = tmp_path / "run"
    code, out = _vitp_train([*TINY, "data.resolution=[47,32]"], run)
    assert code == 2 and "resolution 47x32 (data.resolution) is not divisible by model.patch_size=2" in out, out
    assert not run.exists()  # refused before Hydra makes the folder
    code, out = _vitp_train([*TINY, "data.resolution=[48,32]"], run)
    assert code == 0, out[-3000:]
    assert OmegaConf.load(run / ".hydra" / "config.yaml").model.image_size == [48, 32]
    assert [r["step"] for r in metrics(run)] == [1]
    assert "384 tokens per sample" in (run / "train.log").read_text()  # 24 x 16 patches


def test_a_launch_into_a_busy_run_dir_writes_nothing_there(tmp_path):
    """The refusal goes to the console, not into the owner's train.log; nothing else is written."""
    from vitp.train.rundir import RunDirLock

    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("the owner's line\n")
    owner = RunDirLock(run)
    owner.acquire()
    try:
        code, out = _vitp_train(TINY, run)
    finally:
        owner.release()
    assert code == 2 and f"run dir {run} is in use by another vitp-train" in out, out[-3000:]
    assert (run / "train.log").read_text() == "the owner's line\n"
    assert sorted(p.name for p in run.iterdir()) == [".vitp.lock", "train.log"]


def test_a_bad_layout_is_refused_before_any_process_group(tmp_path):
    """Rank 1 of 2 started alone: a process group would wait for rank 0; the layout check (tp=3
    does not divide the world of 2, from WORLD_SIZE) refuses first."""
    run = tmp_path / "run"
    code, out = _vitp_train([*TINY, "parallel.tp=3"], run, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    assert code == 2 and "parallel.tp=3 x parallel.pp=1 does not divide world_size=2" in out, out[-3000:]


def _command(argv, cwd):
    """``argv`` as a user types it (``vitp-train ...``: the console script next to this Python), in
    ``cwd`` without a launcher's variables (so the default run dir is ``outputs/<date>/<time>``)."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_JOB_ID",
            "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "TORCHELASTIC_RUN_ID", "TRAINING_JOB_NAME")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    p = subprocess.run([str(Path(sys.executable).parent / argv[0]), *argv[1:]], cwd=cwd, capture_output=True,
                       text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    return p.returncode, p.stdout + p.stderr


def test_a_stopped_default_dir_run_resumes_with_the_command_it_prints(tmp_path):
    """The default run dir is new at every launch, so "the same command" started over; the stop
    line ends with the command that continues the stopped folder, and that command does."""
    code, out = _command(["vitp-train", "experiment=smoke", "trainer.max_steps=3", "trainer.exit_at_step=2"], tmp_path)
    assert code == 0, out[-3000:]
    (run,) = (tmp_path / "outputs").glob("*/*")
    last = (run / "train.log").read_text().splitlines()[-1]
    assert "stopped by trainer.exit_at_step after step 2;" in last and last.split("] - ", 1)[-1] in out
    command = shlex.split(last.split("To continue: ", 1)[1])
    assert command == ["vitp-train", "--resume", str(run)]
    code, out = _command(command, tmp_path)
    assert code == 0, out[-3000:]
    assert list((tmp_path / "outputs").glob("*/*")) == [run]  # no new folder
    assert f"resumed from {run}/checkpoints/step_0000002 (step 2 of 3)" in out
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    assert (run / "checkpoints" / "latest").read_text() == "step_0000003"


def test_nodes_in_other_folders_relaunch_a_run_with_relative_paths(tmp_path):
    """Launch agents may start in folders of their own (docs/launching.md) with a shared run dir:
    each resolves a relative ``trainer.init_from`` against its own folder (the config as given is
    the same on every rank), and rank 0 records its absolute path. A relaunch then compares the
    record on the rank that wrote it only: another node's own absolute path is no other config."""
    for node in ("a", "b"):
        (tmp_path / node).mkdir()
        shutil.copy(PERTURBED, tmp_path / node / "init.safetensors")
    run_ranks(2, _relaunch_from_own_folder, tmp_path)
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1, 2]


def _relaunch_from_own_folder(rank, tmp):
    from vitp.train import train

    os.chdir(tmp / ("a" if rank == 0 else "b"))
    over = ["experiment=smoke", "trainer.max_steps=2", "trainer.init_from=init.safetensors"]
    assert train(compose([*over, "trainer.exit_at_step=1"]), tmp / "run")["stopped_at"] == 1
    assert len(train(compose(over), tmp / "run")["losses"]) == 1
