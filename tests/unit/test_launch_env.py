"""Launcher environments -> torch's ``env://`` variables (pure), and the stop-signal handling."""
import signal
import time
import zlib

import pytest

from vitp.parallel.distributed import DEFAULT_PORT, launcher_env

# what `mpirun -np 2` (OpenMPI 4.1.4) gives rank 1 on one host, as printed by `mpirun ... env`
OMPI_RANK1 = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
              "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "1218772993",
              "PMIX_NAMESPACE": "1218772993"}
OMPI_PORT = str(DEFAULT_PORT + zlib.crc32(b"1218772993") % 1000)


def test_openmpi_single_host():
    assert OMPI_PORT == "30116"
    assert launcher_env(OMPI_RANK1) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "30116"}
    rank0 = {**OMPI_RANK1, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert launcher_env(rank0)["MASTER_PORT"] == "30116"  # both ranks agree without talking


def test_openmpi_issue_input_without_local_size():
    """The issue's three variables alone: rank and world size are found, but whether rank 0 is on
    this host is not, so the launch asks for MASTER_ADDR instead of guessing 127.0.0.1."""
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    with pytest.raises(ValueError, match=r"OpenMPI with 2 ranks, an unknown number of them on this host, but "
                                         r"MASTER_ADDR is not set.*mpirun -x MASTER_ADDR=<first host>"):
        launcher_env(env)
    assert launcher_env({**env, "MASTER_ADDR": "10.0.0.5"}) == {
        "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}


def test_openmpi_across_hosts():
    env = {**OMPI_RANK1, "OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}  # 2 hosts x 2 ranks
    with pytest.raises(ValueError, match="4 ranks, 2 of them on this host, but MASTER_ADDR is not set"):
        launcher_env(env)
    got = launcher_env({**env, "MASTER_ADDR": "node0", "MASTER_PORT": "23456"})
    assert got == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "node0", "MASTER_PORT": "23456"}


def test_sagemaker_mpi_uses_the_first_host():
    env = {"OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "8", "SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-1"}
    assert launcher_env(env) == {"RANK": "9", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8",
                                 "MASTER_ADDR": "algo-1", "MASTER_PORT": "29500"}
    assert launcher_env({**env, "SM_MASTER_ADDR": "algo-2"})["MASTER_ADDR"] == "algo-2"  # SDK v3 drivers set it
    with pytest.raises(ValueError, match="SM_HOSTS='algo-1' is not a JSON list"):
        launcher_env({**env, "SM_HOSTS": "algo-1"})


def test_mpich_pmi():
    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "h0"}
    assert launcher_env(env) == {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                                 "MASTER_ADDR": "h0", "MASTER_PORT": "29500"}


def test_slurm_srun():
    env = {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_NODES": "1",
           "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"}
    assert launcher_env(env) == {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                                 "MASTER_ADDR": "127.0.0.1",
                                 "MASTER_PORT": str(DEFAULT_PORT + zlib.crc32(b"77.0") % 1000)}
    two_nodes = {**env, "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
    with pytest.raises(ValueError, match="8 ranks, 4 of them on this host.*scontrol show hostnames"):
        launcher_env(two_nodes)
    # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE without MPI_LOCALRANKID: srun's variables answer
    assert launcher_env({**env, "PMI_RANK": "1", "PMI_SIZE": "2"})["LOCAL_RANK"] == "1"


@pytest.mark.parametrize("env", [
    {},  # no launcher: one process
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "5"},  # an sbatch script
    {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", **OMPI_RANK1},  # torchrun/deepspeed set it: theirs wins
])
def test_nothing_to_adopt(env):
    assert launcher_env(env) == {}


def test_mpirun_np_1_needs_no_port():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    assert launcher_env(env) == {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}


@pytest.mark.parametrize("change,match", [
    ({"OMPI_COMM_WORLD_RANK": "x"}, "OMPI_COMM_WORLD_RANK='x' is not an integer"),
    ({"OMPI_COMM_WORLD_RANK": "2"}, "rank 2 .* of 2 ranks .*out of range"),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": None}, "OMPI_COMM_WORLD_LOCAL_RANK is not set: export LOCAL_RANK"),
])
def test_bad_launcher_values(change, match):
    env = {k: v for k, v in {**OMPI_RANK1, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        launcher_env(env)


def test_bad_values_end_vitp_train_with_one_line(monkeypatch, capsys):
    """vitp-train reports launcher errors as bad input (exit 2), before Hydra starts."""
    from vitp.cli.train import main

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {**OMPI_RANK1, "OMPI_COMM_WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("sys.argv", ["vitp-train", "experiment=smoke"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("vitp-train: error: launched by OpenMPI with 4 ranks")


def test_stop_signal_repeat_and_second_signal():
    """One request delivered twice (process group + launcher) stops once; a later one aborts."""
    import torch

    from vitp.train.stop import StopSignal

    stopper = StopSignal(torch.device("cpu"))
    try:
        stopper._handle(signal.SIGINT, None)
        stopper._handle(signal.SIGTERM, None)  # the launcher's forwarded copy, milliseconds later
        assert stopper.flag == "SIGINT" and stopper.requested()
        stopper.t_flag = time.monotonic() - StopSignal.REPEAT_S
        with pytest.raises(KeyboardInterrupt, match="second signal"):
            stopper._handle(signal.SIGTERM, None)
    finally:
        stopper.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def _dispositions(_):
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}


def test_dataloader_workers_ignore_stop_signals():
    from torch.utils.data import DataLoader

    from vitp.data.loader import ignore_stop_signals

    loader = DataLoader(range(2), batch_size=None, num_workers=1, collate_fn=_dispositions,
                        worker_init_fn=ignore_stop_signals)
    for seen in loader:
        assert seen == {signal.SIGINT: signal.SIG_IGN, signal.SIGTERM: signal.SIG_IGN}


def test_vitp_train_exits_with_its_objects_frozen():
    """vitp-train freezes the garbage collector's objects at exit: the interpreter's collections at
    shutdown walked every object torch and DeepSpeed left, 2.2-2.9 s per process on a 2-core CPU
    (0.4 s frozen), which a launcher waits for at the end of every job (8.6-11.0 s from rank 0's
    last line to the SageMaker toolkit's exit for two simulated hosts of 2 ranks, 2.2-2.9 s frozen)."""
    import subprocess
    import sys

    code = ("import atexit, gc, sys\n"
            "atexit.register(lambda: print('frozen', gc.get_freeze_count()))\n"  # runs last: after main's hooks
            "import vitp.cli.train as t\n"
            "t._hydra_entry = lambda: None\n"
            "sys.argv = ['vitp-train']\n"
            "t.main()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert int(p.stdout.split("frozen ")[1]) > 100_000, p.stdout  # the imported modules' objects


@pytest.mark.parametrize("sig,status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_run_stopped_by_a_signal_exits_128_plus_the_signal_after_its_checkpoint(sig, status, tmp_path,
                                                                                  monkeypatch):
    """``vitp-train && vitp-sample RUN`` must not go on with an unfinished run: Ctrl-C (SIGINT) or
    SIGTERM after step 1 saves the checkpoint, then vitp-train exits 130 / 143 (one process, in
    this process); vitp-sagemaker's call exits 0 (SageMaker's stop contract)."""
    import os

    from vitp.cli import train as cli
    from vitp.train.trainer import Trainer

    step = Trainer.train_step

    def step_then_signal(self, n):
        out = step(self, n)
        if n == 1:
            os.kill(os.getpid(), sig)  # as Ctrl-C / a scheduler's stop during step 1
        return out

    monkeypatch.setattr(Trainer, "train_step", step_then_signal)
    import logging

    for name in ("", "vitp"):  # Hydra's job logging (handlers, levels) is undone after the test
        lg = logging.getLogger(name)
        monkeypatch.setattr(lg, "handlers", list(lg.handlers))
        monkeypatch.setattr(lg, "level", lg.level)
        monkeypatch.setattr(lg, "propagate", lg.propagate)
    for signal_exit, code in ((True, status), (False, None)):
        run = tmp_path / f"run{signal_exit}"
        monkeypatch.setattr("sys.argv", ["vitp-train", "experiment=smoke", "trainer.max_steps=3",
                                         f"hydra.run.dir={run}"])
        if code is None:
            cli.main(signal_exit=False)
        else:
            with pytest.raises(SystemExit) as e:
                cli.main()
            assert e.value.code == code
        assert (run / "checkpoints" / "step_0000001").is_dir() and not (run / "model_ema.safetensors").exists()


def test_ctrl_c_during_start_up_stops_in_one_line_even_when_a_library_swallows_it(tmp_path):
    """A Ctrl-C in vitp-train's first seconds was ignored (a bare ``except:`` in start-up code
    caught its KeyboardInterrupt) and the run trained on; another time it ended in a traceback.
    Here start-up swallows the SIGINT as such code does: the command still stops before step 1,
    exit 130, one line on stderr, nothing trained."""
    import subprocess
    import sys

    run = tmp_path / "run"
    code = ("import os, signal, sys, time\n"
            "import vitp.train.trainer as tr\n"
            "init = tr.Trainer.__init__\n"
            "def swallowing_init(self, *a, **k):\n"
            "    try:\n"
            "        os.kill(os.getpid(), signal.SIGINT); time.sleep(1)\n"
            "    except BaseException:\n"  # what a library's bare except does
            "        pass\n"
            "    init(self, *a, **k)\n"
            "tr.Trainer.__init__ = swallowing_init\n"
            f"sys.argv = ['vitp-train', 'experiment=smoke', 'trainer.max_steps=3', 'hydra.run.dir={run}']\n"
            "from vitp.cli.entry import train\n"
            "train()\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 130, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == ("vitp-train: stopped by SIGINT during start-up, before the first "
                                                 "step: nothing was trained; run the command again"), p.stderr[-3000:]
    assert "Traceback" not in p.stderr and not (run / "checkpoints" / "step_0000001").exists()


def test_the_bar_shows_every_steps_loss_not_only_logged_steps(tmp_path, monkeypatch):
    """With trainer.log_every=10 a 4-step run's bar showed step 1's loss until the last step: the
    bar's loss and grad norm are each step's own."""
    from tests.helpers import compose_cfg
    from vitp.train.trainer import Trainer

    shown, step = [], Trainer.train_step

    def step_and_look(self, n):
        out = step(self, n)
        shown.append(self.bar.postfix)
        return out

    monkeypatch.setattr(Trainer, "train_step", step_and_look)
    over = ["experiment=smoke", "trainer.max_steps=3", "trainer.log_every=10", "trainer.progress=true"]
    res = Trainer(compose_cfg(over), tmp_path / "run").fit()
    assert [s.split("loss=")[1] for s in shown] == [f"{x:.4f}" for x in res["losses"]], (shown, res["losses"])


def test_libraries_are_quiet_before_the_process_group_starts(monkeypatch):
    """Under torchrun, DeepSpeed's op probe (its gcc ... -laio commands, logger compilers.C.base) ran
    when the process group started, before the Trainer quieted it, and torch's deprecation of the
    all_gather_into_tensor DeepSpeed's ZeRO calls reached the console: both are quiet by then."""
    import logging
    import warnings

    from tests.helpers import compose_cfg
    from vitp.cli import train as cli

    class Started(Exception):
        pass

    def start(device, timeout):
        logging.getLogger("compilers.C.base").info("gcc /tmp/test.o -laio -o /tmp/a.out")
        logging.getLogger("matplotlib.font_manager").info("generated new fontManager")  # a trial's text run
        warnings.warn("`torch.distributed.all_gather_into_tensor` is deprecated. Please use "
                      "`torch.distributed.all_gather_single` instead.", FutureWarning)
        raise Started

    for name in ("compilers", "DeepSpeed", "matplotlib"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    monkeypatch.setattr(cli.dist, "world_size", lambda: 2)
    monkeypatch.setattr(cli, "_resume_dir", None)
    monkeypatch.setattr(cli, "check_config", lambda cfg, run_dir=None: None)
    monkeypatch.setattr(cli.dist, "init_distributed", start)
    records = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logging.getLogger().addHandler(handler)
    root_level = logging.getLogger().level
    logging.getLogger().setLevel(logging.DEBUG)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with pytest.raises(Started):
                cli._train(compose_cfg(["experiment=smoke"]), "RUN", [])
    finally:
        logging.getLogger().removeHandler(handler)
        logging.getLogger().setLevel(root_level)
    assert not [r for r in records if r.name.startswith(("compilers", "matplotlib"))] and not seen, (records, seen)
