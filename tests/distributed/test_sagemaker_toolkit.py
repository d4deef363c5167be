"""SageMaker jobs run by SageMaker's own in-container toolkit on a directory tree built as SageMaker
builds it (``SAGEMAKER_BASE_DIR`` in a temp folder instead of ``/opt/ml``).

The PyTorch training containers start jobs as ``train`` (the ``sagemaker-training`` console
script) with ``SAGEMAKER_TRAINING_MODULE=sagemaker_pytorch_container.training:main``
(``sagemaker-pytorch-training``), which runs the entry script once, or under torchrun when
``sagemaker_torch_distributed_enabled`` is set. The tests run that command, unpatched. Hosts are
named ``localhost`` (the toolkit waits until every host in ``resourceconfig.json`` resolves).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import TELEMETRY_PREFIXES, PERTURBED, assert_rows_close, metrics, run_ranks, train_rank
from vitp.utils import free_port

pytest.importorskip("sagemaker_training")
pytest.importorskip("sagemaker_pytorch_container")

REPO = Path(__file__).resolve().parents[2]
TRAIN = Path(sys.executable).with_name("train")  # the toolkit's console script, next to this Python
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIME_KEYS = ("samples_per_s",)

# What a user passes as ModelTrainer / Estimator hyperparameters: Hydra group choices, nested
# objects, dotted keys, booleans and lists. The tiny smoke model on 8x8 gray digits, from the
# perturbed export (non-zero adaLN gates, so attention and MLP, hence tp and pp, matter).
HPS = {
    "experiment": "smoke", "data": "image_folder",
    "data.resolution": 8, "data.channels": 1, "data.num_classes": 10, "data.num_workers": 0, "data.hflip": False,
    "trainer": {"max_steps": 1000, "checkpoint_every": 0, "log_every": 1},
    "trainer.init_from": str(PERTURBED),
    "optim": {"schedule": "constant"},  # the lr does not depend on max_steps: runs of any length align
    "eval": {"enabled": True, "num_samples": 10},
    "sampler.cfg_interval": [0.0, 1.0],
}


def _digits(root: Path, per_class: slice) -> None:
    """Real handwritten digits (scikit-learn) as 8x8 PNGs, one folder per class."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for c in range(10):
        (root / str(c)).mkdir(parents=True, exist_ok=True)
        for i in np.flatnonzero(digits.target == c)[per_class]:
            img = (digits.images[i] * (255 / 16)).round().astype(np.uint8)
            Image.fromarray(img).save(root / str(c) / f"{i:04d}.png")


@pytest.fixture(scope="module")
def channels(tmp_path_factory) -> Path:
    """``train`` (30 digits per class) and ``validation`` (4 per class) channel contents."""
    root = tmp_path_factory.mktemp("channels")
    _digits(root / "train", slice(0, 30))
    _digits(root / "validation", slice(30, 34))
    return root


def _encode(hps: dict) -> dict:
    """``hyperparameters.json`` as the SageMaker SDKs write it: every value a JSON-encoded string."""
    return {k: json.dumps(v) for k, v in hps.items()}


def job_tree(base: Path, hps: dict, channels: Path, *, processes: int = 0, checkpoints: Path = None,
             tensorboard: Path = None, requirements: bool = False, hosts: tuple = ("localhost",), host: int = 0,
             seen_as: Path = None) -> Path:
    """The folder SageMaker mounts at ``/opt/ml`` for one job on one host: config files, data
    channels (copied), ``model/``, ``output/``; ``processes`` > 0 turns on ``torch_distributed``
    with that many processes on the host. The source dir holds the entry script and, with
    ``requirements``, the requirements.txt the toolkit installs (its lines are satisfied here:
    pip changes nothing; ~1-4 s, so one job in this module does it). ``hosts[host]`` is this
    tree's host in ``resourceconfig.json``; ``seen_as`` is the path the job sees the tree at (the
    simulated hosts' mount point, :func:`run_two_hosts`; default ``base``): the job's name and its
    source dir (one for all hosts, as SageMaker's ``code`` channel) derive from it. Returns ``base``."""
    seen_as = seen_as or base
    config = base / "input" / "config"
    config.mkdir(parents=True)
    source = seen_as.parent / f"{seen_as.name}_source"  # the job's source_dir: entry script + requirements.txt
    source.mkdir(exist_ok=True)
    shutil.copy(REPO / "scripts" / "sagemaker_entry.py", source / "sagemaker_entry.py")
    if requirements:
        shutil.copy(REPO / "scripts" / "sagemaker_requirements.txt", source / "requirements.txt")
    framework = {"sagemaker_program": "sagemaker_entry.py", "sagemaker_submit_directory": str(source),
                 "sagemaker_region": "us-west-2", "sagemaker_job_name": seen_as.name}
    if processes:
        framework.update(sagemaker_torch_distributed_enabled=True,
                         sagemaker_mpi_num_of_processes_per_host=processes)  # the runners' per-host count
    (config / "hyperparameters.json").write_text(json.dumps(_encode({**framework, **hps})))
    (config / "resourceconfig.json").write_text(json.dumps({
        "current_host": hosts[host], "hosts": list(hosts), "current_group_name": "homogeneousCluster",
        "current_instance_type": "ml.c5.4xlarge", "network_interface_name": "eth0",
        "instance_groups": [{"instance_group_name": "homogeneousCluster", "instance_type": "ml.c5.4xlarge",
                             "hosts": list(hosts)}]}))
    file_mode = {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated", "RecordWrapperType": "None"}
    (config / "inputdataconfig.json").write_text(json.dumps({"train": file_mode, "validation": file_mode}))
    for name in ("train", "validation"):
        shutil.copytree(channels / name, base / "input" / "data" / name)
    for name, path in (("checkpointconfig.json", checkpoints), ("tensorboardoutputconfig.json", tensorboard)):
        if path is not None:
            (config / name).write_text(json.dumps({"LocalPath": str(path), "S3Uri": "s3://bucket/prefix"}))
    for d in ("model", "output/data", "checkpoints"):
        (base / d).mkdir(parents=True, exist_ok=True)
    return base


def job_env(base: Path, job_name: str) -> dict:
    """The environment a PyTorch container gives ``train``, with this machine's settings."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(SAGEMAKER_BASE_DIR=str(base), SAGEMAKER_TRAINING_MODULE="sagemaker_pytorch_container.training:main",
               TRAINING_JOB_NAME=job_name, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               NO_ALBUMENTATIONS_UPDATE="1", PET_MASTER_PORT=str(free_port()),  # torchrun's --master_port
               PATH=f"{TRAIN.parent}{os.pathsep}{os.environ.get('PATH', '')}")  # the toolkit runs `torchrun` from PATH
    return env


def start_job(base: Path, job_name: str, prefix: tuple = (), **popen) -> subprocess.Popen:
    """``train`` as the PyTorch container starts it (after the ``prefix`` command), output in ``<base>.log``."""
    env = job_env(base, job_name)
    log = open(f"{base}.log", "w")
    return subprocess.Popen([*prefix, str(TRAIN)], env=env, cwd=base.parent, stdout=log, stderr=subprocess.STDOUT,
                            **popen)


def run_job(base: Path, job_name: str, timeout: float = 300) -> int:
    return start_job(base, job_name).wait(timeout=timeout)


def rows(run: Path) -> list:
    f = run / "metrics.jsonl"
    lines = f.read_text().splitlines() if f.is_file() else []
    return [{k: v for k, v in json.loads(x).items() if k not in TIME_KEYS and not k.startswith(TELEMETRY_PREFIXES)}
            for x in lines]


def _with_steps(hps: dict, steps: int, **extra) -> dict:
    return {**hps, "trainer": {**hps["trainer"], "max_steps": steps}, **extra}


def _files(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _tb_steps(folder: Path, tag: str = "loss") -> list:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


# The container's init for a stop test: a child subreaper (prctl PR_SET_CHILD_SUBREAPER = 36), so
# the processes the toolkit leaves behind when it dies are re-parented here and their exit statuses
# can be read (written as JSON to argv[1]). It outlives the SIGTERM sent to the group through a
# handler (exec resets handlers, so the job keeps the default action; SIG_IGN would be inherited).
REAPER = """
import ctypes, json, os, signal, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)
signal.signal(signal.SIGTERM, lambda *_: None)
subprocess.Popen(sys.argv[2:])
codes = {}
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    codes[pid] = os.waitstatus_to_exitcode(status)
json.dump(codes, open(sys.argv[1], "w"))
"""


def _stop_with_sigterm(base: Path, job_name: str, run: Path) -> dict:
    """Start the job in its own process group; once it trains, SIGTERM the whole group, as a
    container stop does when the container's init passes signals to the process group (e.g.
    ``tini -g``); wait until every process of the job has exited. Returns the exit status of the
    toolkit (``toolkit``) and of the entry script it started (``entry``)."""
    import psutil

    codes_file = Path(f"{base}.exit.json")
    p = start_job(base, job_name, prefix=(sys.executable, "-c", REAPER, str(codes_file)), start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None and len(rows(run)) < 2:
        time.sleep(0.05)
    assert p.poll() is None, Path(f"{base}.log").read_text()[-3000:]
    toolkit = psutil.Process(p.pid).children()[0]
    entry = next(c for c in toolkit.children() if "sagemaker_entry.py" in " ".join(c.cmdline()))
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(timeout=180) == 0
    codes = {int(k): v for k, v in json.loads(codes_file.read_text()).items()}
    return {"toolkit": codes[toolkit.pid], "entry": codes[entry.pid]}


@pytest.fixture(scope="module")
def restarted_job(tmp_path_factory, channels):
    """Job 1 stopped by SIGTERM to its process group mid-run after step K; job 2 (another job
    name, a fresh tree, the same checkpoint path, as a restarted spot job or a new job on the same
    checkpoint_s3_uri finds it) runs to step K + 2. Returns ``(job 1 base, job 2 base, checkpoint
    path, K, job 1's exit statuses)``."""
    tmp = tmp_path_factory.mktemp("restart")
    ckpt, tb = tmp / "synced-checkpoints", tmp / "synced-tensorboard"  # LocalPaths outside the base dir
    job1 = job_tree(tmp / "job1", HPS, channels, checkpoints=ckpt, tensorboard=tb, requirements=True)
    codes = _stop_with_sigterm(job1, "vitp-job-1", ckpt / "run")
    stop = len(rows(ckpt / "run"))
    job2 = job_tree(tmp / "job2", _with_steps(HPS, stop + 2), channels, checkpoints=ckpt, tensorboard=tb)
    assert run_job(job2, "vitp-job-2") == 0, Path(f"{job2}.log").read_text()[-3000:]
    return job1, job2, ckpt, stop, codes


@pytest.fixture(scope="module")
def reference(restarted_job, tmp_path_factory) -> list:
    """The uninterrupted 1-process run of job 2's overrides (from its .hydra/overrides.yaml),
    trained in-process: its metrics rows."""
    from omegaconf import OmegaConf

    ckpt = restarted_job[2]
    over = [o for o in OmegaConf.load(ckpt / "run" / ".hydra" / "overrides.yaml")
            if o.split("=")[0] not in ("trainer.tensorboard_dir", "trainer.export_dir", "trainer.output_data_dir")]
    run = tmp_path_factory.mktemp("reference") / "run"
    run_ranks(1, train_rank, over, str(run))
    return metrics(run)


def test_job_trains_and_a_restarted_job_resumes_exactly(restarted_job, reference):
    """Through the toolkit: training on the train channel with the validation channel held out;
    SIGTERM saves a checkpoint; the next job (another name) resumes it in the same run dir under the
    checkpoint path and its metrics continue exactly as an uninterrupted run's; TensorBoard events
    in the configured path, weights and eval.json in the model dir, samples and logs in output/data."""
    job1, job2, ckpt, stop, codes = restarted_job
    # The toolkit installs no SIGTERM handler and forwards nothing: it dies of the signal; the
    # entry script, which got the signal as a member of the group, saved and exited 0.
    assert codes == {"toolkit": -signal.SIGTERM, "entry": 0}, codes
    run = ckpt / "run"
    log1 = (run / "train.log").read_text()
    assert "300 train / 40 held-out" in log1 and f"stopped by SIGTERM after step {stop};" in log1
    assert "Requirement already satisfied: vitp==" in Path(f"{job1}.log").read_text()  # requirements.txt ran
    assert f"resumed from {run / 'checkpoints' / f'step_{stop:07d}'}" in Path(f"{job2}.log").read_text()
    assert 2 <= stop and [r["step"] for r in rows(run)] == list(range(1, stop + 3))
    assert rows(run) == reference  # bit-identical: losses, grad norms, lr, binned losses
    assert _tb_steps(ckpt.parent / "synced-tensorboard") == list(range(1, stop + 3))
    for name in ("model_ema.safetensors", "model.safetensors", "model_ema.json", "eval.json"):
        assert (job2 / "model" / name).is_file(), name
    assert json.loads((job2 / "model" / "eval.json").read_text())["step"] == stop + 2
    out = job2 / "output" / "data"
    assert (out / "metrics.jsonl").read_text() == (run / "metrics.jsonl").read_text()
    assert (out / "eval.json").is_file() and (out / "samples" / f"step_{stop + 2:07d}.png").is_file()
    assert (job2 / "output" / "success").is_file()
    assert not (job1 / "output" / "failure").exists() and not (job2 / "output" / "failure").exists()


@pytest.mark.parametrize("layout", [{"parallel.tp": 2}, {"parallel.pp": 2}], ids=["tp2", "pp2"])
def test_torch_distributed_two_processes_match_one(restarted_job, reference, channels, tmp_path, layout):
    """The PyTorch toolkit's torch_distributed path (torchrun, 2 processes on one CPU host, gloo)
    at tp=2 and at pp=2 trains like the 1-process run: every logged value to 5 significant digits."""
    ckpt, stop = restarted_job[2:4]
    job = job_tree(tmp_path / "job", _with_steps(HPS, stop + 2, **layout), channels, processes=2)
    assert run_job(job, "vitp-job-2proc") == 0, Path(f"{job}.log").read_text()[-3000:]
    log = Path(f"{job}.log").read_text()
    assert "torchrun --nnodes 1 --nproc_per_node 2 sagemaker_entry.py" in log
    tp, pp = layout.get("parallel.tp", 1), layout.get("parallel.pp", 1)
    assert f"layout tp={tp} pp={pp} dp=1" in log
    assert_rows_close(rows(job / "checkpoints" / "run"), reference, rel=1e-5)
    heldout = [json.loads((d / "eval.json").read_text())["heldout_loss"] for d in (job / "model", ckpt / "run")]
    assert heldout[0] == pytest.approx(heldout[1], rel=1e-5)


def test_bad_hyperparameter_fails_the_job_with_a_readable_reason(restarted_job, channels, tmp_path):
    """A misspelt key, through torch_distributed with 2 ranks that both fail: the job fails, the
    failure file (SageMaker's FailureReason) starts with our one-line reason naming the fix (not
    the toolkit's summary), and the checkpoint path holding a finished run is left untouched."""
    ckpt = restarted_job[2]
    before = _files(ckpt)
    hps = {**HPS, "trainer": {"max_step": 5}}
    job = job_tree(tmp_path / "job", hps, channels, processes=2, checkpoints=ckpt)
    assert run_job(job, "vitp-job-bad") == 1
    reason = (job / "output" / "failure").read_text()
    assert reason.splitlines()[0].startswith("vitp-sagemaker: error: unknown config key trainer.max_step (did you "
                                             "mean trainer.max_steps?); valid keys of trainer: ")
    assert reason.count("vitp-sagemaker: error") == 1 and "ExecuteUserScriptError" not in reason
    assert _files(ckpt) == before and not (job / "output" / "success").exists()


# ---------------------------------------------------------------- two instances
# On SageMaker every instance of a job sees the same paths (/opt/ml/...), each on its own disk,
# and reaches the others as algo-1, algo-2, ... Simulated here: each host's `train` runs in its own
# mount namespace where one path (the job's SAGEMAKER_BASE_DIR) is that host's tree, with its own
# host name (a UTS namespace, as a container has), and both hosts share a private network
# namespace (loopback only, so the toolkit's fixed --master_port 7777 cannot collide with anything
# else on the machine) whose /etc/hosts, bound over the machine's for these processes only, maps
# algo-1 and algo-2 to 127.0.0.1. Needs `unshare` (util-linux), `ip` and user namespaces (or root).
SIM_HOSTS = ("algo-1", "algo-2")
PAIR = r"""
sim=$1 base=$2 train=$3 names=("$4" "$5")
ip link set lo up && mount --bind "$sim/hosts" /etc/hosts || exit 90
pids=()
for i in 0 1; do
    unshare --mount --uts bash -c 'hostname "$4" && mount --bind "$1" "$2" && exec "$3"' host "$sim/host$i" \
        "$base" "$train" "${names[i]}" > "$sim/host$i.log" 2>&1 &
    pids+=($!)
done
codes=()
for p in "${pids[@]}"; do wait "$p"; codes+=($?); done
echo "${codes[*]}" > "$sim/codes"
"""


def _namespaces_work(folder: Path) -> bool:
    """Whether this machine lets a process make the namespaces :data:`PAIR` uses."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    r = subprocess.run(["unshare", "--user", "--map-root-user", "--net", "--mount", "--uts", "sh", "-c",
                        'ip link set lo up && mount --bind "$0" "$0" && hostname algo-1', str(folder)],
                       capture_output=True)
    return r.returncode == 0


def run_two_hosts(sim: Path, hps: dict, channels: Path, job_name: str, merged: Path = None,
                  timeout: float = 300) -> list:
    """One job on two simulated instances (``SIM_HOSTS``, 2 processes each, ``torch_distributed``):
    trees ``sim/host0`` and ``sim/host1``, each mounted at ``sim/opt_ml`` for its host, with its own
    checkpoint folder (``checkpointconfig.json`` LocalPath ``sim/opt_ml/checkpoints``, as SageMaker's
    ``/opt/ml/checkpoints``), first filled with a copy of ``merged`` (what a restarted job downloads
    from the checkpoint S3 URI). Waits for both; returns ``[(tree, exit status), ...]``."""
    base = sim / "opt_ml"  # the path both hosts see; each host's own tree is mounted on it
    base.mkdir(parents=True)
    if not _namespaces_work(sim):
        pytest.skip("needs unshare with user, mount, network and UTS namespaces (util-linux, iproute2)")
    trees = [job_tree(sim / f"host{i}", hps, channels, processes=2, checkpoints=base / "checkpoints",
                      hosts=SIM_HOSTS, host=i, seen_as=base) for i in range(2)]
    for tree in trees if merged else ():
        shutil.copytree(merged, tree / "checkpoints", dirs_exist_ok=True)
    (sim / "hosts").write_text(Path("/etc/hosts").read_text() + "\n127.0.0.1 " + " ".join(SIM_HOSTS) + "\n")
    env = {**job_env(base, job_name), "GLOO_SOCKET_IFNAME": "lo"}  # the namespace's only interface
    p = subprocess.Popen(["unshare", "--user", "--map-root-user", "--net", "--mount", "bash", "-c", PAIR, "pair",
                          str(sim), str(base), str(TRAIN), *SIM_HOSTS], env=env, cwd=sim, start_new_session=True,
                         stdout=open(sim / "pair.log", "w"), stderr=subprocess.STDOUT)
    try:
        p.wait(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    codes = (sim / "codes").read_text().split() if (sim / "codes").is_file() else []
    assert len(codes) == 2, (sim / "pair.log").read_text()[-2000:]
    return [(tree, int(c)) for tree, c in zip(trees, codes)]


def _host_logs(hosts: list) -> str:
    return "\n".join(f"--- {t.name} (exit {c})\n{Path(f'{t}.log').read_text()[-3000:]}" for t, c in hosts)


def _tp2_hps(steps: int, every: int) -> dict:
    """``steps`` steps with a checkpoint every ``every``; 4 processes: tp=2 x dp=2, the dp pairs span the hosts."""
    return {**HPS, "trainer": {**HPS["trainer"], "max_steps": steps, "checkpoint_every": every}, "parallel.tp": 2}


@pytest.fixture(scope="module")
def two_hosts(restarted_job, channels, tmp_path_factory):
    """The reference's K + 2 steps (K: the restarted job's stop) on two instances at tp=2 x dp=2,
    uninterrupted, with a checkpoint after step K. Returns ``([(tree, exit status)] per host, K)``."""
    stop = restarted_job[3]
    hosts = run_two_hosts(tmp_path_factory.mktemp("two-hosts"), _tp2_hps(stop + 2, stop), channels, "vitp-two-hosts")
    return hosts, stop


@pytest.fixture(scope="module")
def two_hosts_restarted(two_hosts, channels, tmp_path_factory):
    """The uninterrupted two-instance job as if it had stopped after uploading step K's checkpoint,
    restarted: a second job (the same hyperparameters) whose hosts each start with the union of the
    first job's two checkpoint folders (SageMaker syncs every host's folder to the one checkpoint S3
    prefix and a restarted job downloads all of it to every host; a file both hosts wrote is
    whichever upload came last: here host 1's), the checkpoints after step K removed and ``latest``
    naming step K. Returns ``(files both first hosts wrote with different bytes, second job's hosts)``."""
    (first, stop), tmp = two_hosts, tmp_path_factory.mktemp("two-hosts-restart")
    assert [c for _, c in first] == [0, 0], _host_logs(first)
    merged = tmp / "s3-prefix"
    for tree, _ in first:
        shutil.copytree(tree / "checkpoints", merged, dirs_exist_ok=True)
    folders = [{str(p.relative_to(t / "checkpoints")): p.read_bytes() for p in (t / "checkpoints").rglob("*")
                if p.is_file()} for t, _ in first]
    differ = sorted(k for k in set(folders[0]) & set(folders[1]) if folders[0][k] != folders[1][k])
    ckpts, tag = merged / "run" / "checkpoints", f"step_{stop:07d}"
    assert (ckpts / tag).is_dir(), sorted(p.name for p in ckpts.iterdir())
    for later in (t for t in ckpts.glob("step_*") if t.name > tag):
        shutil.rmtree(later)
    (ckpts / "latest").write_text(tag)
    second = run_two_hosts(tmp / "second", _tp2_hps(stop + 2, stop), channels, "vitp-two-hosts-2", merged=merged)
    return differ, second


def test_two_instances_train_as_one_process(two_hosts, reference):
    """Two instances (algo-1, algo-2) x 2 processes through the PyTorch toolkit's torch_distributed:
    torchrun spans both hosts (node rank = the host's place in the host list, rendezvous on
    algo-1:7777) and trains at tp=2 x dp=2 like the 1-process run, every logged value to 5
    significant digits. Rank 0 is on algo-1: the run's logs and metrics, the model dir's weights and
    the held-out evaluation are there; algo-2's model dir stays empty."""
    hosts, stop = two_hosts
    assert [c for _, c in hosts] == [0, 0], _host_logs(hosts)
    for i, (tree, _) in enumerate(hosts):
        assert (f"torchrun --nnodes 2 --nproc_per_node 2 --master_addr algo-1 --master_port 7777 --node_rank {i} "
                f"sagemaker_entry.py") in Path(f"{tree}.log").read_text()
    algo1, algo2 = (tree for tree, _ in hosts)
    run = algo1 / "checkpoints" / "run"
    assert "layout tp=2 pp=1 dp=2" in (run / "train.log").read_text()
    assert [r["step"] for r in rows(run)] == list(range(1, stop + 3))
    assert_rows_close(rows(run), reference, rel=1e-5)
    assert not (algo2 / "checkpoints" / "run" / "metrics.jsonl").exists()
    assert (algo1 / "model" / "model_ema.safetensors").is_file() and not any((algo2 / "model").iterdir())
    assert (algo1 / "output" / "success").is_file() and (algo2 / "output" / "success").is_file()


def test_each_instance_keeps_its_ranks_checkpoint_part(two_hosts):
    """Each host's /opt/ml/checkpoints (node-local, synced to the job's one S3 prefix) ends the run
    with the final checkpoint published: algo-2's folder holds its ranks' (2, 3) part in the step
    folder, and neither folder keeps a half-written ``.partial``."""
    hosts, stop = two_hosts
    tag = f"step_{stop + 2:07d}"
    for tree, _ in hosts:
        ckpts = tree / "checkpoints" / "run" / "checkpoints"
        assert not list(ckpts.glob("*.partial")), sorted(p.name for p in ckpts.iterdir())
        assert (ckpts / tag).is_dir() and any((ckpts / tag).iterdir()), tree.name
    algo2 = hosts[1][0] / "checkpoints" / "run" / "checkpoints" / tag
    held = {p.name for p in algo2.iterdir()} - {"vitp_meta.json"}
    assert {"rng_rank00002.pt", "rng_rank00003.pt", ".metadata"} <= held
    # it received only the pieces its ranks load (each a file of its own on node-local folders)
    parts = json.loads((algo2 / "vitp_meta.json").read_text())["parts"]
    assert all(parts[n] == "all" or {2, 3} & set(parts[n]) for n in held), held
    assert set(parts) - held, "algo-2 holds every piece: nothing was kept apart"


def test_restarted_job_on_the_merged_folders_resumes_exactly(two_hosts, two_hosts_restarted):
    """A restarted two-instance job, every host given the union of both hosts' checkpoint folders,
    resumes from step K and continues exactly as the uninterrupted two-instance run: per-step rows
    equal (not only close); a file both hosts wrote is the same on both (so the union does not
    depend on which upload came last)."""
    hosts, stop = two_hosts
    differ, second = two_hosts_restarted
    assert differ == []
    assert [c for _, c in second] == [0, 0], _host_logs(second)
    run, seen = second[0][0] / "checkpoints" / "run", second[0][0].parent / "opt_ml" / "checkpoints" / "run"
    assert f"resumed from {seen / 'checkpoints' / f'step_{stop:07d}'}" in Path(f"{second[0][0]}.log").read_text()
    assert rows(run) == rows(hosts[0][0] / "checkpoints" / "run")
