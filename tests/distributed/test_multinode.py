"""Multi-node launches simulated on one machine: two launcher agents, each in its own working
directory, meet through a real rendezvous (torchrun's c10d store; the DeepSpeed launcher's
``--no_ssh`` path with a two-host hostfile, one launcher per node), 2 processes each, and train
as one job whose per-step loss and grad norm equal the recorded one-process run from perturbed
weights (5 significant digits), in a shared run directory (a cluster's shared file system).
Node-local checkpoint folders (each node its own run dir: SageMaker's per-host checkpoint folder, a
node's NVMe), with the two nodes' ranks forked in one process group: a node killed mid-save, the
resume on both nodes, the nodes' folders merged."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (PERTURBED, SMOKE4, assert_rows_close, metrics, recorded, run_ranks,
                           run_ranks_until_killed, train_rank)
from vitp import checkpoint as ckpt
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
    for both and check their exit codes; returns the shared run dir ``tmp/shared/run``."""
    port = free_port()
    hostfile = tmp / "hostfile"
    hostfile.write_text("node-a slots=2\nnode-b slots=2\n")  # names only: --no_ssh starts nothing remote
    procs, logs = [], []
    run = tmp / "shared" / "run"
    for node in range(2):
        cwd = tmp / f"node{node}"
        cwd.mkdir(parents=True, exist_ok=True)
        cmd = _torchrun(node, port) if launcher == "torchrun" else _deepspeed(node, port, hostfile)
        logs.append(cwd / "agent.log")
        extra = list(node1_extra) if node else []
        procs.append(subprocess.Popen([*cmd, *over, *extra, f"hydra.run.dir={run}"], cwd=cwd, env=_env(),
                                      stdout=open(logs[-1], "w"), stderr=subprocess.STDOUT, start_new_session=True))
        time.sleep(0.5)  # node 0 first, as a cluster's head node (c10d ranks its agents by host, then pid)
    codes = [p.wait(timeout=600) for p in procs] if codes_expected == (0, 0) else _fail_together(procs)
    ok = [c == 0 for c in codes] == [c == 0 for c in codes_expected]
    assert ok, "\n".join(f"--- node {i}\n{log.read_text()[-3000:]}" for i, log in enumerate(logs))
    return run


def _fail_together(procs: list, grace: float = 20) -> list:
    """Exit codes of agents expected to fail: once one has exited, the others get ``grace``
    seconds, then their process groups are killed, as a scheduler ends a job when a node fails
    (survivors of a dead node may wait in a collective until the process group's timeout)."""
    while all(p.poll() is None for p in procs):
        time.sleep(0.2)
    deadline = time.time() + grace
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return [p.wait(timeout=60) for p in procs]


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


# --- node-local run dirs --------------------------------------------------------------------------
# tp=2 x dp=2: node 0 holds dp replica 0 (ranks 0, 1), node 1 replica 1 (ranks 2, 3); the weights are
# written once over the replicas (DCP's de-duplication spreads them), so each node needs some of the
# other node's data files, and the coordinator's .metadata.
# The launches above test the agents; here the subject is the checkpoint folders, so the four ranks
# are forked from a preloaded server (tests.helpers.run_ranks: seconds instead of two agents' start),
# each node's ranks with the environment its agent gives them and their own run dir.
LOCAL = [*SMOKE4, f"trainer.init_from={PERTURBED}", "parallel.tp=2", "trainer.checkpoint_every=2"]
NODE_RANKS = ((0, 1), (2, 3))


def _node_rank(rank: int, over: list, tmp: str, hook: str = "") -> list:
    """Rank ``rank`` of a job on two simulated nodes: node ``rank // 2``'s ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` (as its torchrun agent sets them), training in that node's own run dir
    ``tmp/node<i>/run``; ``hook`` sets :data:`vitp.checkpoint.KILL_HOOK`. Returns the ``vitp`` log lines."""
    import logging

    from vitp.config import compose
    from vitp.train import train

    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", **({ckpt.KILL_HOOK: hook} if hook else {}))
    lines: list = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("vitp").addHandler(handler)
    logging.getLogger("vitp").setLevel(logging.INFO)
    train(compose(over), f"{tmp}/node{rank // 2}/run")
    return lines


@pytest.fixture(scope="module")
def killed_mid_save(tmp_path_factory):
    """Two nodes, each with its own run dir: node 1's rank 2 truncates a file and SIGKILLs itself
    while saving step 4 (the job's other ranks are then killed). Returns the folder of the two nodes
    and a copy of both run dirs as the failed attempt left them (``after_kill/node<i>``)."""
    tmp = tmp_path_factory.mktemp("nodelocal")
    run_ranks_until_killed(4, _node_rank, LOCAL, str(tmp), "2:4", kill_rank=2)
    for node in range(2):
        shutil.copytree(tmp / f"node{node}" / "run", tmp / "after_kill" / f"node{node}", symlinks=True)
    return tmp


def _needed_here(tag: Path, ranks) -> set:
    """The files of checkpoint ``tag`` that one of ``ranks`` loads (its completion record's parts)."""
    parts = json.loads((tag / ckpt.META).read_text())["parts"]
    return {n for n, readers in parts.items() if readers == "all" or set(readers) & set(ranks)}


def test_node_killed_mid_save_resumes_from_the_previous_checkpoint_on_both_nodes(killed_mid_save):
    """Each node's folder alone holds its ranks' part of step 2 (the data files holding pieces its
    ranks load, the metadata, nothing more), the same completion record on both; step 4, whose save
    node 1 died in, is published nowhere. The relaunch of both nodes' ranks resumes from step 2 on both
    nodes and equals the uninterrupted one-process run."""
    tmp = killed_mid_save
    runs = [tmp / "after_kill" / f"node{n}" for n in range(2)]
    for run, ranks in zip(runs, NODE_RANKS):
        assert ckpt.published_tags(run / "checkpoints") == ["step_0000002"]
        tag = run / "checkpoints" / "step_0000002"
        files = {p.name for p in tag.iterdir()} - {ckpt.META}
        assert files == _needed_here(tag, ranks)
        for r in ranks:
            ckpt.verify_checkpoint(tag, r)
    assert (runs[1] / "checkpoints" / "step_0000004.partial").is_dir()
    record = [(run / "checkpoints" / "step_0000002" / ckpt.META).read_bytes() for run in runs]
    assert record[0] == record[1]
    node1 = {p.name for p in (runs[1] / "checkpoints" / "step_0000002").iterdir()}
    assert {".metadata", "rng_rank00002.pt"} <= node1 and any(n.startswith("__2_") for n in node1)
    assert "rng_rank00000.pt" not in node1
    node0 = {p.name for p in (runs[0] / "checkpoints" / "step_0000002").iterdir()}
    assert node0 | node1 == set(json.loads(record[0])["manifest"]) | {ckpt.META}  # together: the whole checkpoint
    assert sorted(p.name for p in runs[1].iterdir()) == [".hydra", "checkpoints"]  # no logs on node 1
    # the EMA is sharded over the replicas: node 1's folder alone cannot be exported
    with pytest.raises(FileNotFoundError, match=r"checkpoint file .*__[01]_\d+.distcp is missing"):
        ckpt.resolve_weights(runs[1])

    out = "\n".join(line for lines in run_ranks(4, _node_rank, LOCAL, str(tmp)) for line in lines)
    assert_rows_close(metrics(tmp / "node0" / "run"), recorded("perturbed_tp1pp1"), rel=1e-5)
    assert "resumed from" in out and "step_0000002 (step 2 of 4)" in out
    runs = [tmp / f"node{n}" / "run" for n in range(2)]
    for run in runs:
        assert ckpt.published_tags(run / "checkpoints") == ["step_0000002", "step_0000004"]
        assert not list((run / "checkpoints").glob("*.partial"))  # removed by each node's first rank
    assert not (runs[1] / "metrics.jsonl").exists()


def test_merged_node_folders_resume_in_one_launch(killed_mid_save, tmp_path):
    """What a restarted SageMaker job gets from S3: the union of both nodes' folders (their common
    files identical). Four ranks in one process group, all on that one folder, resume it from step 2
    (removing node 1's half-written step 4) and equal the uninterrupted run."""
    nodes = [killed_mid_save / "after_kill" / f"node{n}" for n in range(2)]
    merged = tmp_path / "run"
    shutil.copytree(nodes[0], merged, symlinks=True)
    for src in (nodes[1] / "checkpoints").rglob("*"):
        dst = merged / "checkpoints" / src.relative_to(nodes[1] / "checkpoints")
        if src.is_file() and dst.exists():
            assert dst.read_bytes() == src.read_bytes(), dst
    shutil.copytree(nodes[1] / "checkpoints", merged / "checkpoints", dirs_exist_ok=True)
    res = run_ranks(4, train_rank, LOCAL, str(merged))  # one folder for the 4 ranks
    assert [len(r["losses"]) for r in res] == [2, 2, 2, 2]  # steps 3 and 4: resumed from step 2
    assert not (merged / "checkpoints" / "step_0000004.partial").exists()
    assert_rows_close(metrics(merged), recorded("perturbed_tp1pp1"), rel=1e-5)
