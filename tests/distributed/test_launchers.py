"""Launchers and stop signals, through ``python -m vitp.train`` subprocesses: an MPI-style launch
(ranks named only by OpenMPI's variables) and SIGTERM/SIGINT to the whole process group while
DataLoader workers run."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import PERTURBED, run_ranks
from vitp.checkpoint.training import find_checkpoint, verify_checkpoint

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("OMPI_")}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", NO_ALBUMENTATIONS_UPDATE="1", **extra)
    return env


def _start(args, run: Path, log: Path, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vitp.train", *args, f"hydra.run.dir={run}"], env=env,
                            cwd=run.parent, stdout=open(log, "w"), stderr=subprocess.STDOUT, **kw)


def _rows(run: Path) -> list:
    f = run / "metrics.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.is_file() else []


def test_openmpi_launch_trains_as_data_parallel(tmp_path):
    """Two ranks that know their place only from OMPI_COMM_WORLD_* (as ``mpirun -np 2`` starts
    them) form one dp=2 group: the losses, grad norms and lr equal the 1-process run's. A warning
    every rank logs (a key without effect) is printed by rank 0 alone, and train.log has it once."""
    over = ["experiment=smoke", "trainer.max_steps=3", f"trainer.init_from={PERTURBED}",
            "parallel.sequence_parallel=true"]  # no effect at tp=1: warned by every rank
    job = str(os.getpid() * 1000 + int(time.time()) % 1000)  # mpirun's job id: the ranks derive one port from it
    single = _start(over, tmp_path / "single", tmp_path / "single.log", _env())
    ranks = [_start(over, tmp_path / "mpi", tmp_path / f"mpi{r}.log", _env(
        OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK=str(r),
        OMPI_COMM_WORLD_LOCAL_SIZE="2", OMPI_MCA_ess_base_jobid=job)) for r in range(2)]
    codes = [p.wait(timeout=300) for p in (single, *ranks)]
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in ("single", "mpi0", "mpi1")}
    assert codes == [0, 0, 0], {n: t[-2000:] for n, t in logs.items()}
    assert "layout tp=1 pp=1 dp=2" in logs["mpi0"] and "layout tp=1 pp=1 dp=1" in logs["single"]
    warning = "parallel.sequence_parallel=true has no effect with parallel.tp=1"
    assert [logs["mpi0"].count(warning), logs["mpi1"].count(warning)] == [1, 0], logs["mpi1"][-2000:]
    assert (tmp_path / "mpi" / "train.log").read_text().count(warning) == 1
    a, b = _rows(tmp_path / "single"), _rows(tmp_path / "mpi")
    assert [r["step"] for r in b] == [1, 2, 3]
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-5), key


def _stop_with(sig, args, run: Path, log: Path, while_training=None) -> int:
    """Start a run in its own process group, wait until it trains with its DataLoader workers,
    call ``while_training(pid)``, signal the whole group (as Ctrl-C, scancel or a container stop
    do); returns the exit status."""
    p = _start(args, run, log, _env(), start_new_session=True)
    seen = len(_rows(run))
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None and len(_rows(run)) < seen + 2:
        time.sleep(0.1)
    assert p.poll() is None, log.read_text()[-3000:]
    assert len(psutil.Process(p.pid).children()) >= 2  # the workers are there to receive the signal
    if while_training is not None:
        while_training(p.pid)
        assert p.poll() is None, log.read_text()[-3000:]
    os.killpg(p.pid, sig)
    return p.wait(timeout=300)


def _second_command_is_refused(run: Path, args: list, owner: int) -> None:
    """Another ``vitp-train`` (another seed) into the busy folder exits 2 naming the owner."""
    p = subprocess.run([sys.executable, "-m", "vitp.train", *args, "seed=1", f"hydra.run.dir={run}"], env=_env(),
                       cwd=run.parent, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 2 and f"run dir {run} is in use by another vitp-train" in out, out[-3000:]
    assert f'"pid": {owner}' in out


def test_signal_to_the_process_group_saves_and_exits_128_plus_the_signal(tmp_path):
    """SIGTERM, then (after resuming) SIGINT, to the group of a run with data.num_workers=2: each
    finishes its step, publishes a complete checkpoint and exits 143 / 130; the last resume finishes.
    While the first attempt trains, a second command into its folder is refused; the interrupted
    run samples from its latest checkpoint."""
    from vitp.cli.sample import run as sample

    run = tmp_path / "run"
    args = ["experiment=smoke", "data.num_workers=2", "trainer.checkpoint_every=0", "trainer.max_steps=100000"]
    stops = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        log = tmp_path / f"{sig.name}.log"
        busy = (lambda pid: _second_command_is_refused(run, args, pid)) if sig == signal.SIGTERM else None
        code = _stop_with(sig, args, run, log, busy)
        out = log.read_text()
        assert code == 128 + sig and f"stopped by {sig.name}" in out and "killed by signal" not in out, out[-3000:]
        assert f"To continue: vitp-train --resume {run}\n" in out
        tag = find_checkpoint("auto", run / "checkpoints")
        stops.append(verify_checkpoint(tag)["step"])
        assert tag.name == f"step_{stops[-1]:07d}" and _rows(run)[-1]["step"] == stops[-1]
        assert not (run / "model_ema.safetensors").exists()  # the run is not finished
    assert 2 <= stops[0] < stops[1] < 100000
    assert f"resumed from {run / 'checkpoints' / f'step_{stops[0]:07d}'}" in (tmp_path / "SIGINT.log").read_text()
    assert "seed: 0" in (run / ".hydra" / "config.yaml").read_text()  # the refused command wrote nothing
    sample([str(run), "--num", "1", "sampler.steps=1"])
    assert (run / "samples" / f"sample_step{stops[1]:07d}_c0..9_n1_heun1_cfg1.5_seed0.png").is_file()
    p = subprocess.run([sys.executable, "-m", "vitp.train", *args[:-1], f"trainer.max_steps={stops[1] + 2}",
                        f"hydra.run.dir={run}"], env=_env(), cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert [r["step"] for r in _rows(run)] == list(range(1, stops[1] + 3))
    assert (run / "model_ema.safetensors").is_file()


def _signal_during_final(rank, over, run_dir):
    """``(stopped_at, the warning after the last step, the last log line)`` of two runs: one gets
    SIGTERM during its final save, the other SIGINT during its final evaluation (after its grid)."""
    import logging

    from vitp.config import compose
    from vitp.train.trainer import Trainer

    out = []
    for phase in ("save", "eval"):
        trainer = Trainer(compose(over), Path(run_dir) / phase)
        save, heldout = trainer.save_checkpoint, trainer.heldout_eval

        def save_after_a_signal(step, final=False):
            if final and phase == "save":
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's stop arriving just after the last step
            return save(step, final)

        def heldout_after_a_signal(step, final=False):
            if final:
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C once the final grid is written
            return heldout(step, final)

        trainer.save_checkpoint, trainer.heldout_eval = save_after_a_signal, heldout_after_a_signal
        lines, handler = [], logging.Handler(logging.INFO)
        handler.emit = lambda record: lines.append(record.getMessage())
        logging.getLogger("vitp").addHandler(handler)
        logging.getLogger("vitp").setLevel(logging.INFO)
        stopped = trainer.fit()["stopped_at"]
        logging.getLogger("vitp").removeHandler(handler)
        out.append((stopped, [m for m in lines if "after the last step" in m or " received: " in m], lines[-1]))
    return out


def test_signal_after_the_last_step_still_saves(tmp_path):
    """SIGTERM during the final save: the save completes (final checkpoint and weights), the
    samples and evaluation are skipped, the run returns normally, and its last line names only
    what it wrote (no eval.json, no samples/). SIGINT during the final evaluation: the final grid
    written before it is named (a trial user's run said "samples ... skipped" and left samples/ out)."""
    from tests.helpers import run_ranks

    run = tmp_path / "run"
    over = ["experiment=smoke", "trainer.max_steps=2", "trainer.checkpoint_every=0", "eval.enabled=true"]
    (save, ev), = run_ranks(1, _signal_during_final, over, str(run), timeout=90)
    assert save == (None, ["SIGTERM received: finishing this step, then saving a checkpoint (a second signal, 2 s or "
                           "more later, aborts without one)",
                           f"SIGTERM after the last step: final checkpoint and weights saved, samples and evaluation "
                           f"skipped (run vitp-eval {run / 'save'})"],
                    f"done: {run / 'save'} holds model_ema.safetensors, metrics.jsonl, tb/")
    assert ev == (None, ["SIGINT received: stopping the final samples and evaluation after this forward (the final "
                         "checkpoint and weights are saved) (a second signal, 2 s or more later, stops at once)",
                         f"SIGINT after the last step: final checkpoint and weights saved, final sample grid saved, "
                         f"evaluation skipped (run vitp-eval {run / 'eval'})"],
                  f"done: {run / 'eval'} holds model_ema.safetensors, samples/, metrics.jsonl, tb/")
    assert (run / "eval" / "samples" / "step_0000002.png").is_file() and not (run / "eval" / "eval.json").exists()
    run = run / "save"
    assert verify_checkpoint(find_checkpoint("auto", run / "checkpoints"))["step"] == 2
    assert (run / "model_ema.safetensors").is_file() and not (run / "samples" / "step_0000002.png").exists()
    assert not (run / "eval.json").exists() and not (run / "samples").exists()


def _init_on_busy_port(rank):
    import socket

    import torch

    from vitp.parallel import distributed as dist

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()  # a port in use, as the previous job's store (or its TIME_WAIT) leaves 7777
    busy = s.getsockname()[1]
    os.environ["MASTER_PORT"] = str(busy)
    os.environ.pop("TORCHELASTIC_RUN_ID", None)
    dist.init_distributed(torch.device("cpu"))
    return busy, int(os.environ["MASTER_PORT"]), torch.distributed.get_world_size()


def test_one_process_run_does_not_use_a_busy_inherited_master_port():
    """SageMaker's PyTorch container sets ``MASTER_PORT=7777`` for every job, a one-process one and a
    restarted one too: a one-process run hosts its 1-rank store on a free port of its own, so an
    inherited port that is busy does not fail it (with the inherited port kept: EADDRINUSE)."""
    busy, used, world = run_ranks(1, _init_on_busy_port)[0]
    assert world == 1 and used != busy


def _signal_during_heldout_loss(rank, over, run_dir, signal_rank, signal_at):
    """Train with ``over``; rank ``signal_rank`` sends itself SIGINT after its held-out loss
    forward number ``signal_at`` (counted over the run). Returns ``(stopped_at, signal, forwards
    run, the rank's last log line)``."""
    import logging

    import vitp.eval.metrics as metrics
    from vitp.config import compose
    from vitp.train.trainer import Trainer

    forwards, v_loss = [0], metrics.v_loss

    def counted(*a, **k):
        forwards[0] += 1
        if rank == signal_rank and forwards[0] == signal_at:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, here on one rank alone
        return v_loss(*a, **k)

    metrics.v_loss = counted
    lines, handler = [], logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("vitp").addHandler(handler)
    logging.getLogger("vitp").setLevel(logging.INFO)
    res = Trainer(compose(over), run_dir).fit()
    return res["stopped_at"], res["signal"], forwards[0], lines[-1] if rank == 0 else None


def test_ctrl_c_during_the_heldout_loss_stops_within_one_forward(tmp_path):
    """A new user's report: Ctrl-C during the step-0 held-out loss (minutes on a large model) said
    "finishing this step, then saving a checkpoint" though no step runs, and the run went on until
    a second Ctrl-C. Now every rank stops after the same forward even when one rank alone got the
    signal (the request is agreed after each forward every replica runs): before step 1 nothing is
    saved; during the held-out loss after step 2 the checkpoint of step 2 is."""
    base = ["experiment=smoke", "trainer.checkpoint_every=0", "eval.t_grid=4", "trainer.micro_batch_size=8",
            "trainer.global_batch_size=16"]
    first = tmp_path / "first"
    got = run_ranks(2, _signal_during_heldout_loss, [*base, "trainer.max_steps=4", "trainer.eval_every=2"], str(first),
                    1, 2, timeout=120)
    assert [g[:3] for g in got] == [(0, "SIGINT", 2)] * 2, got  # 359 held-out items: 23 batches x 4 levels each
    assert got[0][3] == ("stopped by a signal on another rank before step 1: nothing trained in this launch, no "
                         "checkpoint written. To start again: this run's launcher (2 processes) with -m vitp.train "
                         f"--resume {first}")
    assert not (first / "checkpoints").exists() or not any((first / "checkpoints").iterdir())
    later = tmp_path / "later"
    got = run_ranks(2, _signal_during_heldout_loss, [*base, "trainer.max_steps=4", "trainer.eval_every=2"], str(later),
                    0, 23 * 4 + 5, timeout=120)
    assert [g[:3] for g in got] == [(2, "SIGINT", 23 * 4 + 5)] * 2, got  # step 0's 92 forwards, then 5 of step 2's
    assert verify_checkpoint(find_checkpoint("auto", later / "checkpoints"))["step"] == 2
    assert got[0][3].startswith("stopped by SIGINT after step 2; checkpoint")
