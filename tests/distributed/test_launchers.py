"""Launchers, through ``python -m vitp.train`` subprocesses: an MPI-style launch (ranks named only
by OpenMPI's variables)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import PERTURBED

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
    them) form one dp=2 group: the losses, grad norms and lr equal the 1-process run's."""
    over = ["experiment=smoke", "trainer.max_steps=3", f"trainer.init_from={PERTURBED}"]
    job = str(os.getpid() * 1000 + int(time.time()) % 1000)  # mpirun's job id: the ranks derive one port from it
    single = _start(over, tmp_path / "single", tmp_path / "single.log", _env())
    ranks = [_start(over, tmp_path / "mpi", tmp_path / f"mpi{r}.log", _env(
        OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2", OMPI_COMM_WORLD_LOCAL_RANK=str(r),
        OMPI_COMM_WORLD_LOCAL_SIZE="2", OMPI_MCA_ess_base_jobid=job)) for r in range(2)]
    codes = [p.wait(timeout=300) for p in (single, *ranks)]
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in ("single", "mpi0", "mpi1")}
    assert codes == [0, 0, 0], {n: t[-2000:] for n, t in logs.items()}
    assert "layout tp=1 pp=1 dp=2" in logs["mpi0"] and "layout tp=1 pp=1 dp=1" in logs["single"]
    a, b = _rows(tmp_path / "single"), _rows(tmp_path / "mpi")
    assert [r["step"] for r in b] == [1, 2, 3]
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=1e-5), key
