"""Run-directory ownership, history checks, cleanup of interrupted attempts, default run dirs."""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import compose_cfg
from vitp.checkpoint import published_tags
from vitp.train.rundir import RunDirBusy, RunDirLock, check_history, config_differences, drop_failed_attempt


def _hold(run_dir, ready):
    lock = RunDirLock(run_dir)
    lock.acquire()
    ready.set()
    signal.pause()


def test_second_owner_is_refused_and_a_killed_owner_leaves_no_stale_lock(tmp_path):
    ready = mp.get_context("fork").Event()
    owner = mp.get_context("fork").Process(target=_hold, args=(tmp_path, ready), daemon=True)
    owner.start()
    try:
        assert ready.wait(30)
        with pytest.raises(RunDirBusy, match=rf"{tmp_path} is in use by another vitp-train \(.*\"pid\": {owner.pid}"):
            RunDirLock(tmp_path).acquire()
    finally:
        os.kill(owner.pid, signal.SIGKILL)  # a crash: the kernel drops the lock
        owner.join()
    lock = RunDirLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / ".vitp.lock").read_text())["pid"] == os.getpid()
    with pytest.raises(RunDirBusy):  # a second trainer in the same process is refused too
        RunDirLock(tmp_path).acquire()
    lock.release()
    RunDirLock(tmp_path).acquire()


def test_history_of_another_config_is_refused_naming_the_keys(tmp_path):
    from vitp.train import write_run_config

    before = compose_cfg(["experiment=smoke", "model.depth=2"])
    write_run_config(tmp_path, before, None)
    check_history(tmp_path, compose_cfg(["experiment=smoke", "model.depth=2", "trainer.max_steps=9",
                                         "trainer.exit_at_step=3", "data.num_workers=2"]))
    with pytest.raises(ValueError, match=r"holds another config's run \(model.depth: 2 before vs 3 now\); choose a new"):
        check_history(tmp_path, compose_cfg(["experiment=smoke", "model.depth=3"]))
    assert config_differences(before, compose_cfg(["experiment=smoke", "model.depth=2", "seed=4", "optim.lr=0.5"])) == [
        "optim.lr: 0.001 before vs 0.5 now", "seed: 0 before vs 4 now"]


def test_a_folder_with_files_and_no_run_is_refused(tmp_path):
    """A data folder or someone's notes as hydra.run.dir: a run would replace their metrics.jsonl,
    samples/ ... (a new user trained into a copy of the photo folder and lost files)."""
    cfg = compose_cfg(["experiment=smoke"])
    check_history(tmp_path / "new", cfg)  # a folder that does not exist yet
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / ".vitp.lock").touch()  # what a refused launch may leave
    check_history(tmp_path / "empty", cfg)
    data = tmp_path / "photos"
    for name in ("cat", "coffee", "samples"):
        (data / name).mkdir(parents=True)
    (data / "metrics.jsonl").write_text("my notes\n")
    with pytest.raises(ValueError, match=r"photos is not empty and holds no vitp run \(cat, coffee, metrics.jsonl, "
                                         r"samples\): a run would write its outputs among these files; choose a new"):
        check_history(data, cfg)
    assert (data / "metrics.jsonl").read_text() == "my notes\n"


@pytest.mark.parametrize("start,kept", [(0, []), (2, [1, 2])])
def test_failed_attempt_outputs_are_dropped(tmp_path, start, kept):
    for name in ("metrics.jsonl", "eval.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)) + '{"step": 4, "lo')
    samples = tmp_path / "samples"
    for s in (1, 2, 3):
        (samples / f"step_{s:07d}").mkdir(parents=True)
        (samples / f"step_{s:07d}.png").write_bytes(b"png")
    (samples / "sample_step0000004_c3+7_n4_heun3_cfg2_seed0.png").write_bytes(b"png")  # vitp-sample's output is not the run's history
    drop_failed_attempt(tmp_path, start)
    for name in ("metrics.jsonl", "eval.jsonl"):
        assert [json.loads(x)["step"] for x in (tmp_path / name).read_text().splitlines()] == kept
    assert sorted(p.name for p in samples.iterdir()) == sorted(
        ["sample_step0000004_c3+7_n4_heun3_cfg2_seed0.png"] + [f"step_{s:07d}{e}" for s in kept for e in ("", ".png")])


@pytest.mark.parametrize("env,job", [
    ({"SLURM_JOB_ID": "4242"}, "slurm-4242"),
    ({"SLURM_JOB_ID": "4243", "SLURM_ARRAY_JOB_ID": "4200", "SLURM_ARRAY_TASK_ID": "3"}, "slurm-4200_3"),
    ({"TORCHELASTIC_RUN_ID": "exp/7"}, "torchrun-exp_7"),
    ({"TORCHELASTIC_RUN_ID": "none"}, None),
    ({"TORCHELASTIC_RUN_ID": "5f0e6f0c-2b7a-4a39-9d0e-2f1f6f8b9c11"}, None),  # torchrun --standalone
    ({"TRAINING_JOB_NAME": "dit-256"}, "sagemaker-dit-256"),
    ({}, None),
])
def test_launcher_job_id_names_the_default_run_dir(env, job, monkeypatch):
    from vitp.cli.train import launcher_job_id, prepare_argv

    assert launcher_job_id(env) == job
    for k in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "TORCHELASTIC_RUN_ID", "TRAINING_JOB_NAME"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    argv = prepare_argv(["vitp-train", "paths.output_root=/data/runs"])
    if job is None:
        assert not any(a.startswith("hydra.run.dir=") for a in argv)
    else:
        assert f"hydra.run.dir=${{paths.output_root}}/{job}" in argv
        assert prepare_argv(["vitp-train", "hydra.run.dir=/mine"]).count("hydra.run.dir=/mine") == 1


def _file_logger(path):
    import logging

    handler = logging.FileHandler(path, delay=True)  # as vitp-train configures Hydra's train.log
    handler.setFormatter(logging.Formatter("%(created)f %(message)s"))
    logging.getLogger().addHandler(handler)
    return handler


def test_held_log_lines_are_dropped_for_a_refused_launch_and_written_with_their_time_once_checks_pass(tmp_path):
    import logging

    from vitp.train.rundir import hold_log_files, release_log_files

    log, root = logging.getLogger("vitp.test_rundir"), logging.getLogger()
    level, root.level = root.level, logging.INFO
    run, elsewhere = tmp_path / "run", tmp_path / "other.log"
    inside, outside = _file_logger(run / "train.log"), _file_logger(elsewhere)
    try:
        hold_log_files(run)
        hold_log_files(run)  # idempotent
        log.info("refused")
        release_log_files(write=False)
        assert not run.exists() and inside not in root.handlers  # not even created
        assert elsewhere.read_text().endswith("refused\n")  # files outside the run dir are not held

        run.mkdir()  # (Hydra makes it)
        root.addHandler(inside)
        hold_log_files(run)
        t0 = time.time()
        log.info("checked")
        time.sleep(0.05)
        t1 = time.time()
        release_log_files(write=True)
        log.info("training")
        release_log_files(write=False)  # after the release: nothing held, nothing dropped
        lines = [x.split(" ", 1) for x in (run / "train.log").read_text().splitlines()]
        assert [m for _, m in lines] == ["checked", "training"]
        assert t0 <= float(lines[0][0]) < t1 <= float(lines[1][0])  # each line keeps the time it was logged
    finally:
        for h in (inside, outside):
            root.removeHandler(h)
            h.close()
        root.level = level


def test_resume_command_names_the_folder_and_the_launcher(tmp_path):
    """What a stopped run prints to continue: one process, one node of torchrun, another launcher."""
    from vitp.train.rundir import resume_command

    run = tmp_path / "a b"
    assert resume_command(run, {}) == f"vitp-train --resume '{run}'"
    assert resume_command(run, {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}) == \
        f"torchrun --nproc_per_node 2 -m vitp.train --resume '{run}'"
    assert "-m vitp.train --resume" in resume_command(run, {"WORLD_SIZE": "4", "OMPI_COMM_WORLD_SIZE": "4"})


def test_resume_config_is_the_recorded_one_with_the_overrides(tmp_path):
    """``vitp-train --resume RUN_DIR [key=value ...]``: the run's recorded config, resume=auto, the
    overrides set; what it cannot do is refused in one line."""
    from omegaconf import OmegaConf

    from vitp.cli.train import resume_config, split_resume

    assert split_resume(["a=1", "--resume", "R", "b=2"]) == ("R", ["a=1", "b=2"])
    assert split_resume(["--resume=R"]) == ("R", [])
    with pytest.raises(ValueError, match="--resume needs the run directory"):
        split_resume(["--resume", "trainer.max_steps=3"])
    with pytest.raises(FileNotFoundError, match="not a folder vitp-train wrote"):
        resume_config(tmp_path, [])
    # a mistyped folder is said not to exist (vitp-sample and vitp-export said so; these named a missing config)
    from vitp.cli.eval import load_run_config
    from vitp.eval.compare import run_config

    gone = tmp_path / "2026-11-30" / "12-00-00"
    with pytest.raises(FileNotFoundError, match=f"^--resume {gone}: no such folder; give the run dir"):
        resume_config(gone, [])
    for read in (lambda: load_run_config(gone, []), lambda: run_config(gone)):
        with pytest.raises(FileNotFoundError, match=f"^{gone} does not exist; give the run directory a training wrote"):
            read()
    (tmp_path / ".hydra").mkdir()
    recorded = compose_cfg(["experiment=smoke", "model.depth=3", "trainer.resume=never"])
    OmegaConf.save(recorded, tmp_path / ".hydra" / "config.yaml")
    cfg = resume_config(tmp_path, ["trainer.max_steps=9"])
    assert cfg.model.depth == 3 and cfg.trainer.max_steps == 9 and cfg.trainer.resume == "auto"
    earlier = tmp_path / "checkpoints" / "step_0000002"  # the latest is broken: continue from an earlier one
    assert resume_config(tmp_path, [f"trainer.resume={earlier}"]).trainer.resume == str(earlier)
    for bad, message in (("experiment=smoke", "experiment= picks a config file"),
                         ("trainer.resume=never", "continues that folder from its latest checkpoint"),
                         (f"trainer.resume={tmp_path.parent / 'other' / 'checkpoints'}", "drop trainer.resume"),
                         ("trainer.max_step=3", "did you mean trainer.max_steps?")):
        with pytest.raises(ValueError, match=message):
            resume_config(tmp_path, [bad])

    # a stop at trainer.exit_at_step is the run's last launch's: --resume continues past it
    (tmp_path / "checkpoints" / "step_0000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_0000002" / "vitp_meta.json").write_text('{"step": 2}')
    (tmp_path / "checkpoints" / "latest").write_text("step_0000002")
    for stop, kept in ((2, None), (1, None), (5, 5)):  # one still ahead (a signal stopped the run earlier) stays
        OmegaConf.save(compose_cfg(["experiment=smoke", f"trainer.exit_at_step={stop}"]),
                       tmp_path / ".hydra" / "config.yaml")
        assert resume_config(tmp_path, []).trainer.exit_at_step == kept
    assert resume_config(tmp_path, ["trainer.exit_at_step=3"]).trainer.exit_at_step == 3


def test_resume_refuses_parallel_auto_naming_the_key_that_re_plans(tmp_path):
    """``vitp-train --resume RUN parallel=auto`` said only that a group choice picks a config file;
    the key that group option sets (``parallel.auto=true``, which re-plans at the new world size)
    works there, so the refusal names it, and other group choices keep the general message."""
    from vitp.cli.overrides import GROUP_CHOICE_KEYS
    from vitp.cli.train import resume_config

    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(compose_cfg(["experiment=smoke", "parallel.tp=2"]), tmp_path / ".hydra" / "config.yaml")
    with pytest.raises(ValueError) as e:
        resume_config(tmp_path, ["parallel=auto"])
    assert str(e.value) == ("parallel=auto: vitp-train --resume sets keys of the run's config, not config files; "
                            "write parallel.auto=true instead (what parallel=auto sets when vitp-train composes a run)")
    cfg = resume_config(tmp_path, ["parallel.auto=true"])  # the fix the message names is accepted
    assert cfg.parallel.auto is True and cfg.parallel.tp == 2
    with pytest.raises(ValueError, match=r"^parallel= picks a config file when vitp-train composes a run; vitp-train "
                                         r"--resume sets keys of the run's config, e.g. trainer.max_steps=2000$"):
        resume_config(tmp_path, ["parallel=single"])
    # the option's file sets exactly that key
    assert GROUP_CHOICE_KEYS == {("parallel", "auto"): "parallel.auto=true"}
    auto = Path(__file__).resolve().parents[2] / "conf" / "parallel" / "auto.yaml"
    assert OmegaConf.to_container(OmegaConf.load(auto)) == {"auto": True}


def test_other_ranks_print_errors_and_their_own_records_only():
    """The console filter of ranks other than 0: what every rank logs alike is dropped (rank 0 prints
    it); errors and records marked rank-local (a file this rank's batches failed to decode) pass."""
    import logging

    from vitp.train.logger import OwnRecordsOnly
    from vitp.utils import RANK_LOCAL

    log, seen = logging.getLogger("vitp.test_console"), []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    handler.addFilter(OwnRecordsOnly())
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        log.warning("a key without effect")
        log.info("run dir ...")
        log.warning("skipping image x.png: truncated", extra=RANK_LOCAL)
        log.error("vitp-train: error: this rank's data folder is missing")
    finally:
        log.removeHandler(handler)
    assert seen == ["skipping image x.png: truncated", "vitp-train: error: this rank's data folder is missing"]


def test_a_finished_run_keeps_its_results_on_resume_and_vitp_eval(tmp_path, caplog, capsys):
    """``vitp-train --resume RUN`` of a finished run re-exported the weights, rewrote eval.json and
    appended a second final row to eval.jsonl; ``vitp-eval RUN sampler.steps=1`` replaced the
    training's eval.json without naming a file; later it still wrote a TensorBoard events file, the
    config and the lock's record. Now the resume says "already finished" and leaves every file of
    the run as it was (bytes and time stamps); vitp-eval writes eval_sampler.steps=1.json and names it."""
    import logging

    from vitp.cli import eval as eval_cli
    from vitp.cli.train import resume_config
    from vitp.train import train

    run = tmp_path / "run"
    over = ["experiment=smoke", "trainer.max_steps=2", "eval.enabled=true", "eval.classifier_epochs=1",
            "eval.num_samples=8", "sampler.samples_per_class=1"]
    train(compose_cfg(over), run, over)
    def files():  # every file of the run: its bytes, and its time stamp but for the lock's (rewritten)
        return {p.relative_to(run).as_posix(): (p.read_bytes(), None if p.name == ".vitp.lock" else p.stat().st_mtime_ns)
                for p in sorted(run.rglob("*")) if p.is_file()}

    kept = files()
    assert {"eval.json", "eval.jsonl", "model_ema.safetensors", "metrics.jsonl", ".hydra/config.yaml", ".vitp.lock"} <= set(kept)
    assert any(n.startswith("tb/events.") for n in kept)
    with caplog.at_level(logging.WARNING, logger="vitp"):
        res = train(resume_config(run, []), run, ["experiment=smoke"])
    assert res["losses"] == [] and res["eval"] == {}
    now = files()  # no TensorBoard events file, config, overrides or lock record of the no-op launch
    assert set(now) == set(kept) and all(now[n] == kept[n] for n in kept), sorted(n for n in now if now[n] != kept.get(n))
    kept = {n: kept[n] for n in ("eval.json",)}
    assert any(r.getMessage().startswith("already finished: this run trained its trainer.max_steps=2 steps")
               for r in caplog.records), caplog.text
    capsys.readouterr()
    eval_cli.run([str(run), "sampler.steps=1"])
    out = run / "eval_sampler.steps=1.json"
    assert json.loads(out.read_text())["sampler"]["steps"] == 1 and (run / "eval.json").read_bytes() == kept["eval.json"][0]
    assert f"vitp-eval: wrote {out} (the training's eval.json is kept)" in capsys.readouterr().err
    assert f"to evaluate other settings: vitp-eval {run} key=value" in caplog.text
    written = out.read_bytes()
    with pytest.raises(ValueError, match=r"eval_sampler.steps=1.json exists \(an earlier vitp-eval with these "
                                         r"overrides\); pass --force to replace it"):  # it replaced it silently
        eval_cli.run([str(run), "sampler.steps=1"])
    assert out.read_bytes() == written
    eval_cli.run([str(run), "sampler.steps=1", "--force"])
    assert json.loads(out.read_text())["sampler"]["steps"] == 1
    (run / "eval.json").rename(tmp_path / "eval.json")  # as a run stopped during its final evaluation leaves it
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitp"):
        train(resume_config(run, []), run, ["experiment=smoke"])
    assert f"its final evaluation was skipped (the run was stopped before it): run it with vitp-eval {run}" in caplog.text


def test_a_finished_run_resumed_from_an_earlier_checkpoint_moves_its_results_aside(tmp_path, caplog):
    """A new user's report: the refusal of a truncated last checkpoint suggested
    ``trainer.resume=RUN/checkpoints/step_N``; following it (``vitp-train --resume RUN
    trainer.resume=... trainer.max_steps=M``) replaced the intact final weights and eval.json with
    those of step M, saying nothing. Now the refusal says the later results will be moved, and the
    resume moves them (bytes unchanged) into checkpoints/abandoned/ with one warning naming them."""
    import hashlib
    import logging

    from vitp.cli.train import resume_config
    from vitp.train import train

    run = tmp_path / "run"
    over = ["experiment=smoke", "trainer.max_steps=4", "trainer.checkpoint_every=2", "eval.enabled=true",
            "eval.classifier_epochs=1", "eval.num_samples=8", "sampler.samples_per_class=1"]
    train(compose_cfg(over), run, over)
    names = ("model_ema.safetensors", "model.safetensors", "eval.json", "samples/step_0000004.png")
    before = {n: hashlib.sha256((run / n).read_bytes()).hexdigest() for n in names}
    with open(run / "checkpoints" / "step_0000004" / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    earlier = f"trainer.resume={run / 'checkpoints' / 'step_0000002'}"
    with pytest.raises(ValueError, match=rf"is truncated or was rewritten .*{earlier}.*that moves the run's results of "
                                         r"a later step \(eval.json, .*model.safetensors, model_ema.json, "
                                         r"model_ema.safetensors, later sample grids\) and its later checkpoints into "
                                         rf"{run / 'checkpoints' / 'abandoned'}/, deleting nothing"):
        train(resume_config(run, []), run)
    assert {n: hashlib.sha256((run / n).read_bytes()).hexdigest() for n in names} == before  # refused: untouched
    with caplog.at_level(logging.WARNING, logger="vitp"):
        train(resume_config(run, [earlier, "trainer.max_steps=3"]), run)
    (aside,) = (run / "checkpoints" / "abandoned").glob("*-results-step_0000004-*")
    assert {n: hashlib.sha256((aside / n).read_bytes()).hexdigest() for n in names} == before
    assert (f"moved eval.json, model.json, model.safetensors, model_ema.json, model_ema.safetensors, "
            f"samples/step_0000004.png to {aside}: results of step 4, later than step 2") in caplog.text
    assert [json.loads(x)["step"] for x in (aside / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert [json.loads(x)["step"] for x in (run / "eval.jsonl").read_text().splitlines()] == [3]
    assert json.loads((run / "eval.json").read_text())["step"] == 3  # the run's new results
    assert json.loads((run / "model_ema.json").read_text())["step"] == 3 and (run / "model.safetensors").is_file()
    assert (run / "samples" / "step_0000003.png").is_file() and not (run / "samples" / "step_0000004.png").exists()


def test_resuming_before_a_damaged_checkpoint_moves_it_aside_once_this_run_passed_its_step(tmp_path, caplog):
    """A new user's report: resumed from step 2 past a damaged step 4 with ``keep_checkpoints=2`` and
    only a final checkpoint (step 6), the rotation kept the damaged step 4 as one of "the newest two"
    and deleted the good step 2: the earlier attempt's checkpoints were moved aside only when past
    the new checkpoint's step. Now everything the earlier attempt wrote past the resumed step moves
    into checkpoints/abandoned/ (bytes unchanged) with the first new checkpoint, and the warning
    names the step the run resumed from. A tag folder without its vitp_meta.json (incomplete: a resume
    passes over it) past that step stayed in checkpoints/ beside the new history; it moves too."""
    import hashlib
    import logging
    import shutil

    from vitp.cli.train import resume_config
    from vitp.train import train

    run = tmp_path / "run"
    over = ["experiment=smoke", "trainer.max_steps=4", "trainer.checkpoint_every=2"]
    train(compose_cfg(over), run, over)
    damaged = run / "checkpoints" / "step_0000004"
    incomplete = shutil.copytree(damaged, run / "checkpoints" / "step_0000005")  # as if the record were lost
    (incomplete / "vitp_meta.json").unlink()
    with open(damaged / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in damaged.iterdir()}
    with caplog.at_level(logging.WARNING, logger="vitp"):
        train(resume_config(run, [f"trainer.resume={run / 'checkpoints' / 'step_0000002'}", "trainer.max_steps=6",
                                  "trainer.checkpoint_every=0", "trainer.keep_checkpoints=2"]), run, resumed=True)
    assert published_tags(run / "checkpoints") == ["step_0000002", "step_0000006"]  # the good one kept
    (aside,) = (run / "checkpoints" / "abandoned").glob("*/step_0000004")
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in aside.iterdir()} == before
    assert not incomplete.exists() and (aside.parent / "step_0000005" / "__0_0.distcp").is_file()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["abandoned", "latest", "step_0000002",
                                                                       "step_0000006"]
    assert (f"moved step_0000004, step_0000005 (incomplete: no vitp_meta.json) to {aside.parent}: an earlier attempt "
            "wrote them after step 2, the older checkpoint this run resumed from") in caplog.text


def test_resuming_before_a_damaged_last_checkpoint_moves_it_aside_and_writes_that_step_again(tmp_path, caplog):
    """A new user's report: with the last checkpoint damaged (``.metadata`` lost), resuming from the
    earlier one the refusal names reused the damaged ``step_<max_steps>`` as the final checkpoint (the
    run then failed reading it), and a save of that step would have deleted it in place. Now the run
    trains the step again, writes its own checkpoint, and the damaged one moves whole (bytes
    unchanged) into checkpoints/abandoned/, as docs/checkpoints.md says: nothing is deleted."""
    import hashlib
    import logging

    from vitp.checkpoint import verify_checkpoint
    from vitp.cli.train import resume_config
    from vitp.train import train

    run = tmp_path / "run"
    over = ["experiment=smoke", "trainer.max_steps=2", "trainer.checkpoint_every=1"]
    train(compose_cfg(over), run, over)
    damaged = run / "checkpoints" / "step_0000002"
    (damaged / ".metadata").unlink()
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in damaged.iterdir()}
    with caplog.at_level(logging.WARNING, logger="vitp"):
        res = train(resume_config(run, [f"trainer.resume={run / 'checkpoints' / 'step_0000001'}"]), run)
    assert len(res["losses"]) == 1 and res["stopped_at"] is None
    (aside,) = (run / "checkpoints" / "abandoned").glob("*/step_0000002")
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in aside.iterdir()} == before
    assert f"moved step_0000002 to {aside.parent}: an earlier attempt wrote it" in caplog.text
    assert verify_checkpoint(damaged)["step"] == 2 and (damaged / ".metadata").is_file()
    assert (run / "checkpoints" / "latest").read_text() == "step_0000002" and (run / "model_ema.safetensors").is_file()


def test_a_refused_launch_into_a_new_folder_leaves_no_run_dir(tmp_path):
    """A new user's report: refusals after the lock was taken (a missing trainer.init_from file, a
    resume of another config) left a run folder holding only ``.vitp.lock``. Now a refused launch into
    a folder that was empty removes it; a folder that held anything (a model folder given as
    hydra.run.dir) keeps its files and no lock file, or an earlier run's lock file as it was."""
    from vitp.train import train

    run = tmp_path / "new" / "run"
    over = ["experiment=smoke", "trainer.max_steps=1", f"trainer.init_from={tmp_path / 'missing.safetensors'}"]
    with pytest.raises(FileNotFoundError, match="missing.safetensors does not exist"):
        train(compose_cfg(over), run, over)
    assert not run.exists() and not any((tmp_path / "new").iterdir())
    lock = RunDirLock(tmp_path / "kept")
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "notes.txt").write_text("mine")
    lock.acquire()
    lock.release(refused=True)
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == ["notes.txt"]
    (tmp_path / "kept" / ".vitp.lock").write_text('{"pid": 1}')  # an earlier run's
    lock = RunDirLock(tmp_path / "kept")
    lock.acquire()
    lock.release(refused=True)
    assert sorted(p.name for p in (tmp_path / "kept").iterdir()) == [".vitp.lock", "notes.txt"]
    assert (tmp_path / "kept" / ".vitp.lock").read_text() == '{"pid": 1}'


def test_a_relaunch_with_another_config_into_a_run_with_checkpoints_is_refused(tmp_path, capsys, monkeypatch):
    """A user's trial: relaunching into a run dir that holds a checkpoint with ``optim.lr=0.5`` (or
    another ``trainer.init_from``) said only ``resumed from ...``, trained on with it and rewrote the
    run's recorded config. Now it is refused as a folder without checkpoint is, naming the keys and
    the deliberate way (``vitp-train --resume RUN key=value``); the same command, or one changing
    only the layout, still resumes; a finished run resumed with new settings says they were not applied."""
    from tests.helpers import PERTURBED
    from vitp.cli.train import main

    run = tmp_path / "run"
    over = ["experiment=smoke", "trainer.max_steps=4", f"hydra.run.dir={run}"]

    def launch(*args):
        monkeypatch.setattr("sys.argv", ["vitp-train", *args])
        main()

    launch(*over, "trainer.exit_at_step=2")
    record = (run / ".hydra" / "config.yaml").read_bytes()
    files = sorted(p for p in run.rglob("*") if p.name != ".vitp.lock")
    capsys.readouterr()
    for extra, message in (("optim.lr=0.5", "optim.lr: 0.001 before vs 0.5 now"),
                           (f"trainer.init_from={PERTURBED}", f"trainer.init_from: None before vs '{PERTURBED}' now")):
        with pytest.raises(SystemExit) as e:
            launch(*over, extra)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err == (
            f"vitp-train: error: {run} holds another config's run, with checkpoints up to step_0000002 ({message}): "
            f"these settings were not applied and nothing was written; to continue that run with them on purpose: "
            f"vitp-train --resume {run} {extra}; to start a new run with them, choose another hydra.run.dir\n"), err
        assert (run / ".hydra" / "config.yaml").read_bytes() == record
        assert sorted(p for p in run.rglob("*") if p.name != ".vitp.lock") == files
    launch(*over, "trainer.exit_at_step=3", "trainer.micro_batch_size=8")  # a relaunch at another layout resumes
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    launch("--resume", str(run), "optim.lr=0.5")  # on purpose: resumes and records it
    assert OmegaConf.load(run / ".hydra" / "config.yaml").optim.lr == 0.5
    capsys.readouterr()
    launch("--resume", str(run), "optim.lr=0.25")
    out = capsys.readouterr()
    assert "nothing was rewritten; optim.lr=0.25 not applied (nothing is left to train). To train longer: " \
           f"vitp-train --resume {run} trainer.max_steps=N (N > 4) optim.lr=0.25;" in out.out + out.err


def test_results_set_aside_keep_their_fid_samples_and_leave_earlier_steps_in_place(tmp_path):
    """A new user's trial: a resume from step 2 of a run whose results are of step 4 moved a
    ``vitp-eval`` result of step 2 along with them (listed as results of step 4), and moved a FID
    result's ``.npz.json`` but left its ``.npz`` behind. Now each file goes by its own step, and a
    FID sample file goes with its evaluation."""
    from vitp.checkpoint.results import later_results, set_aside_results

    run = tmp_path / "run"
    run.mkdir()
    files = {"model_ema.safetensors": b"w", "model_ema.json": {"step": 4}, "eval.json": {"step": 4},
             "eval.npz": b"s", "eval.npz.json": {"settings": 1}, "eval_fid.json": {"step": 4}, "eval_fid.npz": b"s",
             "eval_fid.npz.json": {"settings": 2}, "eval_sampler.steps=5.json": {"step": 2}}
    for name, body in files.items():
        (run / name).write_bytes(body if isinstance(body, bytes) else json.dumps(body).encode())
    later = sorted(set(files) - {"eval_sampler.steps=5.json"})
    assert sorted(later_results(run, 2)) == later and later_results(run, 4) == []
    dest = set_aside_results(run, 2)
    assert sorted(p.name for p in dest.iterdir()) == later
    assert sorted(p.name for p in run.iterdir() if p.is_file()) == ["eval_sampler.steps=5.json"]


def test_vitp_eval_of_an_unfinished_run_writes_a_file_its_resumed_end_keeps(tmp_path):
    """A new user's trial: ``vitp-eval RUN sampler.steps=2`` of a run stopped at step 2 wrote
    ``eval.json``, which the resumed run's final evaluation replaced. An unfinished run's
    evaluation now goes to ``eval_<overrides>.json`` (``eval_again.json``); a finished run without
    an ``eval.json`` still gets it."""
    from vitp.cli.eval import eval_output

    run = tmp_path / "run"
    run.mkdir()
    assert eval_output(run, ["sampler.steps=2"], "model_ema.safetensors") == run / "eval_sampler.steps=2.json"
    assert eval_output(run, [], "model_ema.safetensors") == run / "eval_again.json"
    (run / "model_ema.safetensors").write_bytes(b"w")
    assert eval_output(run, ["sampler.steps=2"], "model_ema.safetensors") == run / "eval.json"


def test_a_run_that_diverged_before_its_first_checkpoint_resumes_with_the_fix(tmp_path, caplog):
    """A new user's trial: ``optim.lr=1e6`` diverged at step 3 (the refusal says: lower optim.lr),
    and ``vitp-train --resume RUN optim.lr=1e-3`` was refused as "another config's run" though the
    run had no checkpoint to protect. Now it starts over from step 0 with the settings given,
    saying so; a plain relaunch with other settings is still refused."""
    import logging

    from vitp.cli.train import resume_config
    from vitp.train import train

    run = tmp_path / "run"
    over = ["experiment=smoke", "optim.lr=1e6", "trainer.max_steps=20"]
    with pytest.raises(FloatingPointError, match="lower optim.lr"):
        train(compose_cfg(over), run, over)
    assert not (run / "checkpoints").exists()
    with pytest.raises(ValueError, match=r"holds another config's run \(optim.lr: 1000000.0 before vs 0.001 now\)"):
        train(compose_cfg([*over, "optim.lr=1e-3"]), run, [*over, "optim.lr=1e-3"])
    with caplog.at_level(logging.WARNING, logger="vitp"):
        res = train(resume_config(run, ["optim.lr=1e-3"]), run, resumed=True)
    assert len(res["losses"]) == 20 and all(x == x for x in res["losses"])
    assert (f"{run} has no checkpoint to continue: --resume starts it over from step 0 with the settings given "
            "(optim.lr: 1000000.0 before vs 0.001 now)") in caplog.text
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, 21))
    # diverging again after a resume, before a checkpoint of its own: the resumed checkpoint is named
    with pytest.raises(FloatingPointError) as e:
        train(resume_config(run, ["optim.lr=1e6", "trainer.max_steps=40"]), run, resumed=True)
    assert (f"no checkpoint since this run resumed from {run / 'checkpoints' / 'step_0000020'}: if that one is "
            f"damaged, no earlier checkpoint is in {run / 'checkpoints'}") in str(e.value), e.value
    assert "lower optim.lr" in str(e.value)


def _resumes_past_latest(run, named: str, newest: int, caplog) -> None:
    """``vitp-train --resume`` of ``run`` whose ``latest`` names ``named``: one step from the
    newest complete checkpoint (``newest``), saying so, and ``latest`` rewritten."""
    import logging

    from vitp.cli.train import resume_config
    from vitp.train import train

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vitp"):
        res = train(resume_config(run, [f"trainer.max_steps={newest + 1}"]), run, resumed=True)
    assert len(res["losses"]) == 1  # the one step after the newest
    assert (f"{run / 'checkpoints' / 'latest'} names '{named}', which is no complete checkpoint there: resuming "
            f"from step_{newest:07d}, the newest one") in caplog.text
    assert (run / "checkpoints" / "latest").read_text() == f"step_{newest + 1:07d}"


def test_a_latest_naming_a_missing_tag_resumes_from_the_newest_saying_so(tmp_path, caplog):
    """A new user's trial: ``checkpoints/latest`` edited to name ``step_0000099`` resumed quietly from
    the newest complete checkpoint (docs/checkpoints.md said it stops the run). It still resumes
    from the newest, and a warning names the file."""
    from vitp.train import train

    run = tmp_path / "run"
    over = ["experiment=smoke", "trainer.max_steps=2", "trainer.checkpoint_every=1"]
    train(compose_cfg(over), run, over)
    (run / "checkpoints" / "latest").write_text("step_0000099")
    _resumes_past_latest(run, "step_0000099", 2, caplog)
    # an empty latest (no tag name): the training passes over it the same way; readers of the
    # checkpoints folder (vitp-sample / vitp-export / vitp-eval, trainer.resume=RUN/checkpoints) refuse it
    from vitp.checkpoint import resolve_weights

    (run / "checkpoints" / "latest").write_text("")
    newest = run / "checkpoints" / "step_0000003"
    with pytest.raises(ValueError) as e:
        resolve_weights(run / "checkpoints")
    # the fix a reader can follow (a trial user passed the trainer.resume= it named and got the same error)
    assert str(e.value).endswith("latest names '', not a vitp checkpoint tag (step_NNNNNNN): write the newest complete "
                                 f"tag (step_0000003) into it, or read that checkpoint itself: pass {newest} as the "
                                 f"source (vitp-eval RUN --weights {newest})"), e.value
    assert resolve_weights(newest)[1] == 3  # following it reads step 3
    _resumes_past_latest(run, "", 3, caplog)


def test_a_launch_refused_for_its_data_leaves_no_run_folder(tmp_path, capsys, monkeypatch):
    """A new user's vitp-train of an empty data folder (and of a pack whose every sample is damaged)
    was refused and left the empty ``outputs/<date>/<time>`` Hydra made. Now a refused launch
    removes the folders it made; a folder that was there before (empty or not) stays as it was."""
    from tests.unit.data.test_shard_skips import _folder, _garble_all
    from vitp.cli.train import main
    from vitp.data.pack import pack

    (tmp_path / "empty" / "a").mkdir(parents=True)
    _folder(tmp_path / "photos", n=2)
    photos = ["data=image_folder", "data.num_classes=2", "data.resolution=8", "data.channels=3"]
    pack(compose_cfg([*photos, f"data.root={tmp_path / 'photos'}", "data.holdout_fraction=0"]).data,
         tmp_path / "pack", samples_per_shard=2, progress=False)
    for k in range(2):
        _garble_all(tmp_path / "pack" / f"shard-00000{k}.tar", ".png")
    empty = ["experiment=smoke", *photos, f"data.root={tmp_path / 'empty'}", "data.num_classes=1"]
    damaged = ["experiment=smoke", "data=shards", f"data.shards={tmp_path / 'pack'}", *photos[1:]]
    outputs = tmp_path / "outputs"

    def refused(data, *args):
        monkeypatch.setattr("sys.argv", ["vitp-train", *data, *args])
        with pytest.raises(SystemExit) as e:
            main()
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        return err

    err = refused(empty, f"paths.output_root={outputs}")
    assert err.startswith(f"vitp-train: error: no readable image under '{tmp_path / 'empty'}'")
    assert not outputs.exists()  # outputs/<date>/<time>, all three made by the launch
    err = refused(damaged, f"paths.output_root={outputs}")
    assert err.startswith(f"vitp-train: error: none of the 4 samples of the pack data.shards={tmp_path / 'pack'} "
                          "could be decoded (e.g. ") and err.endswith(
        f"the damaged samples are in {tmp_path / 'pack' / 'shard-000000.tar'}, {tmp_path / 'pack' / 'shard-000001.tar'}; "
        "delete those shards and re-run the same vitp-pack command (it writes missing shards again), or pack the "
        "source data again\n")
    assert not outputs.exists()
    outputs.mkdir()
    refused(empty, f"paths.output_root={outputs}")
    assert outputs.is_dir() and not any(outputs.iterdir())  # there before: kept; its new <date>/<time>: removed
    mine = tmp_path / "mine"
    mine.mkdir()
    refused(empty, f"hydra.run.dir={mine}")
    assert mine.is_dir() and not any(mine.iterdir())  # an empty folder the user made stays
    (mine / "notes.txt").write_text("mine")
    refused(damaged, f"hydra.run.dir={mine}")
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]


def test_vitp_eval_scores_the_held_out_split_the_run_recorded(tmp_path, caplog):
    """A folder that grew after training: the split rule alone would hold out images the run
    trained on; vitp-eval (as a resume) keeps the held-out items of the run's heldout_split.json."""
    import shutil

    from tests.unit.data.test_shard_skips import _folder
    from vitp.cli.eval import load_for_eval
    from vitp.train import train

    root, run = tmp_path / "photos", tmp_path / "run"
    _folder(root, n=4)
    over = ["experiment=smoke", "trainer.max_steps=1", "data=image_folder", f"data.root={root}", "data.num_classes=2",
            "data.resolution=8", "data.channels=3", "data.holdout_fraction=0.25", "trainer.eval_every=0",
            "trainer.sample_every=0", "eval.enabled=false"]
    train(compose_cfg(over), run, over)

    def held(ds):
        return sorted(Path(ds.base.files[ds.base._file_of(int(i))]).relative_to(root).as_posix() for i in ds.indices)

    recorded = held(load_for_eval(run, "model_ema.safetensors", [])[3])
    assert recorded == sorted(json.loads((run / "heldout_split.json").read_text())["held_out"]["1"]) and len(recorded) == 2
    for c in "ab":  # four more images per class: the rule now holds out others
        for i in range(4):
            shutil.copy(root / c / f"{i}.png", root / c / f"{i + 4}.png")
    from vitp.data import build_datasets

    rule = held(build_datasets(compose_cfg(over).data, 0)[1])
    assert set(rule) - set(recorded) & {f"{c}/{i}.png" for c in "ab" for i in range(4)}  # a trained image
    caplog.set_level(logging.WARNING)
    got = held(load_for_eval(run, "model_ema.safetensors", [])[3])
    assert set(recorded) <= set(got) and not set(got) & {f"{c}/{i}.png" for c in "ab" for i in range(4)} - set(recorded)
    assert "the held-out split recorded in heldout_split.json is kept" in caplog.text, caplog.text


def test_a_bucketed_video_run_resumes_with_every_frame_counts_held_out_split(tmp_path, caplog):
    """A user's trial: video buckets at two frame counts; heldout_split.json recorded the windows
    at data.num_frames only, and a resume applied those keys (file#window) to the other count's
    windows, which are other clips: the 2-frame bucket's 4 held-out clips went into training and 2 of
    its trained clips were held out (with a self-contradicting "folder changed (0 new file(s), 0 gone)"
    warning), and the resumed losses differed. Now every frame
    count's split is recorded and kept: stop + resume trains the uninterrupted run's losses, and a
    version-1 record (data.num_frames' keys alone) still gives the first launch's split, the rule's
    at the counts it lacks, which vitp-train then adds to it."""
    import functools
    import shutil

    from tests.unit.data.test_video import _frames, _write
    from vitp.cli.train import resume_config
    from vitp.data import build_datasets
    from vitp.data.buckets import bucket_datasets
    from vitp.train import train

    root = tmp_path / "v"
    _write(root / "a" / "a0.mkv", _frames(12))  # one file per class: each holds out its last windows
    _write(root / "b" / "b0.mkv", _frames(12, 24, 20))
    over = ["experiment=smoke", "data=video_folder", f"data.root={root}", "data.num_classes=2", "data.resolution=8",
            "data.num_frames=4", "data.frame_stride=1", "data.holdout_fraction=0.25", f"data.cache_dir={tmp_path}/c",
            "data.buckets=[{resolution:8,frames:4,batch_size:4},{resolution:8,frames:2,batch_size:4}]",
            "trainer.max_steps=4", "trainer.global_batch_size=4"]
    full, run = tmp_path / "full", tmp_path / "run"
    caplog.set_level(logging.INFO)

    def launch(cfg, where, *args, **kw):
        caplog.clear()
        train(cfg, where, *args, **kw)
        counts = [r.getMessage() for r in caplog.records if "held-out items per bucket" in r.getMessage()]
        return counts, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]

    def losses(where):
        return [(r["step"], r["bucket"], r["loss"]) for r in map(json.loads, (where / "metrics.jsonl").open())]

    want = ["data.buckets: training / held-out items per bucket: 8x8x4 4 / 2, 8x8x2 8 / 4"]  # 3 and 6 windows a file
    assert launch(compose_cfg(over), full, over)[0] == want
    said = caplog.text  # the start-up summary and the planner count what trains and what the held-out loss scores
    assert "| 12 train / 6 held-out in 2 buckets (4 train / 2 held-out at data.resolution x data.num_frames" in said
    assert "; held-out loss (6 items) " in said, said
    stop = [*over, "trainer.exit_at_step=2"]
    assert launch(compose_cfg(stop), run, stop)[0] == want
    legacy = tmp_path / "legacy"
    shutil.copytree(run, legacy)
    counts, warned = launch(resume_config(run, []), run, resumed=True)
    assert counts == want and not [w for w in warned if "heldout_split.json" in w], warned
    assert [b for _, b, _ in losses(full)[2:]] == [1, 1] and losses(run) == losses(full)  # 2 frames after the stop
    recorded = json.loads((run / "heldout_split.json").read_text())
    assert recorded == {"version": 2, "files": ["a/a0.mkv", "b/b0.mkv"],
                        "held_out": {"2": ["a/a0.mkv#4", "a/a0.mkv#5", "b/b0.mkv#4", "b/b0.mkv#5"],
                                     "4": ["a/a0.mkv#2", "b/b0.mkv#2"]}}
    assert json.loads((full / "heldout_split.json").read_text()) == recorded
    from vitp.cli.eval import load_for_eval
    from vitp.data.heldout_record import item_keys, read_record, record_split

    per_bucket = load_for_eval(run, "model_ema.safetensors", [])[4]  # vitp-eval RUN scores the same clips
    assert {k: sorted(item_keys(ho.base, ho.indices)) for k, ho in per_bucket.items()} == \
        {"8x8x4": recorded["held_out"]["4"], "8x8x2": recorded["held_out"]["2"]}

    # a version-1 record (vitp before this): data.num_frames' keys; the 2-frame split is the rule's, then recorded
    (legacy / "heldout_split.json").write_text(json.dumps({"version": 1, "files": recorded["files"],
                                                           "held_out": recorded["held_out"]["4"]}))
    rec = read_record(legacy / "heldout_split.json", 4)
    caplog.clear()
    pairs = bucket_datasets(compose_cfg(over).data, 0, functools.partial(build_datasets, split=rec))
    assert caplog.records[-1].getMessage() == want[0]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    record_split(legacy / "heldout_split.json", {2: (pairs[1][1].base, pairs[1][1].split_items)}, 4)
    assert json.loads((legacy / "heldout_split.json").read_text()) == recorded
    # another rule (a holdout_fraction given at a resume) with no file new or gone: the warning claims no change
    caplog.clear()
    rec = read_record(legacy / "heldout_split.json", 4)
    build_datasets(compose_cfg([*over, "data.holdout_fraction=0.5"]).data, 0, split=rec)
    assert "though no file is new or gone (data.holdout_fraction, data.seed or a clip setting differs from the " \
           "first launch's): the held-out split recorded in heldout_split.json is kept; 2 item(s) the run trained " \
           "on stay in training, where a new split would hold them out (e.g. a/a0.mkv#1, b/b0.mkv#1)" in caplog.text
    assert "changed since" not in caplog.text
