"""Multi-node launches simulated on one machine: two launcher agents, each in its own working
directory, meet through a real rendezvous (torchrun's c10d store; the DeepSpeed launcher's
``--no_ssh`` path with a two-host hostfile, one launcher per node), 2 processes each, and train
as one job whose per-step loss and grad norm equal the recorded one-process run from perturbed
weights (5 significant digits). The run directory is shared (a cluster's shared file system)."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import PERTURBED, SMOKE4, assert_rows_close, metrics, recorded
from vitp.utils import free_port

BIN = Path(sys.executable).parent
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", NO_ALBUMENTATIONS_UPDATE="1")
    return env


def _torchrun(node: int, port: int) -> list:
    return [str(BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(node),
            "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "vitp-two-nodes",
            "-m", "vitp.train"]


def _deepspeed(node: int, port: int, hostfile: Path) -> list:
    return [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node),
            "--master_addr", "127.0.0.1", "--master_port", str(port), "--module", "vitp.train"]


def _two_nodes(tmp: Path, launcher: str, over: list, node1_extra=(), codes_expected=(0, 0)) -> Path:
    """Start one agent per node (each in ``tmp/node<i>``; node 1 also given ``node1_extra``), wait
    for both and check their exit codes; returns the run dir."""
    run, port = tmp / "shared" / "run", free_port()
    hostfile = tmp / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")  # names only: --no_ssh starts nothing remote
    procs, logs = [], []
    for node in range(2):
        cwd = tmp / f"node{node}"
        cwd.mkdir(parents=True)
        cmd = _torchrun(node, port) if launcher == "torchrun" else _deepspeed(node, port, hostfile)
        logs.append(cwd / "agent.log")
        extra = list(node1_extra) if node else []
        procs.append(subprocess.Popen([*cmd, *over, *extra, f"hydra.run.dir={run}"], cwd=cwd, env=_env(),
                                      stdout=open(logs[-1], "w"), stderr=subprocess.STDOUT))
        time.sleep(0.5)  # node 0 first, as a cluster's head node
    codes = [p.wait(timeout=600) for p in procs]
    ok = [c == 0 for c in codes] == [c == 0 for c in codes_expected]
    assert ok, "\n".join(f"--- node {i}\n{log.read_text()[-3000:]}" for i, log in enumerate(logs))
    return run


@pytest.mark.parametrize("launcher,layout", [
    ("torchrun", ["parallel.tp=2"]),  # tp=2 x dp=2: the tp pairs may span the nodes' ranks as rendezvous gives them
    ("torchrun", ["parallel.pp=2"]),  # pp=2 x dp=2
    ("deepspeed", ["parallel.tp=2"]),
])
def test_two_launcher_agents_train_as_one_process(tmp_path, launcher, layout):
    over = [*SMOKE4, f"trainer.init_from={PERTURBED}", *layout]
    run = _two_nodes(tmp_path, launcher, over)
    rows = metrics(run)
    assert_rows_close(rows, recorded("perturbed_tp1pp1"), rel=1e-5)
    log = (run / "train.log").read_text()
    assert f"layout tp={2 if 'parallel.tp=2' in layout else 1} pp={2 if 'parallel.pp=2' in layout else 1} dp=2" in log


def test_nodes_launched_with_different_overrides_are_refused(tmp_path):
    """Node 1's agent given another seed: every rank stops before training, naming the key (each
    node's launcher passes its own command line; silently, node 1's replica would draw other data)."""
    over = [*SMOKE4, "parallel.tp=2"]
    run = _two_nodes(tmp_path, "torchrun", over, node1_extra=["seed=1"], codes_expected=(1, 1))
    logs = [(tmp_path / f"node{n}" / "agent.log").read_text() for n in range(2)]
    for text in logs:
        assert "the ranks of this job were launched with different configs" in text
    assert "seed=1 (rank 0: 0)" in "".join(logs)
    assert not (run / "metrics.jsonl").exists()
