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
             tensorboard: Path = None, requirements: bool = False) -> Path:
    """The folder SageMaker mounts at ``/opt/ml`` for one job on one host: config files, data
    channels (copied), ``model/``, ``output/``; ``processes`` > 0 turns on ``torch_distributed``
    with that many processes on the host. The source dir holds the entry script and, with
    ``requirements``, the requirements.txt the toolkit installs (its lines are satisfied here:
    pip changes nothing; ~1-4 s, so one job in this module does it). Returns ``base``."""
    config = base / "input" / "config"
    config.mkdir(parents=True)
    source = base.parent / f"{base.name}_source"  # the job's source_dir: entry script + requirements.txt
    source.mkdir()
    shutil.copy(REPO / "scripts" / "sagemaker_entry.py", source / "sagemaker_entry.py")
    if requirements:
        shutil.copy(REPO / "scripts" / "sagemaker_requirements.txt", source / "requirements.txt")
    framework = {"sagemaker_program": "sagemaker_entry.py", "sagemaker_submit_directory": str(source),
                 "sagemaker_region": "us-west-2", "sagemaker_job_name": base.name}
    if processes:
        framework.update(sagemaker_torch_distributed_enabled=True,
                         sagemaker_mpi_num_of_processes_per_host=processes)  # the runners' per-host count
    (config / "hyperparameters.json").write_text(json.dumps(_encode({**framework, **hps})))
    host = "localhost"
    (config / "resourceconfig.json").write_text(json.dumps({
        "current_host": host, "hosts": [host], "current_group_name": "homogeneousCluster",
        "current_instance_type": "ml.c5.4xlarge", "network_interface_name": "eth0",
        "instance_groups": [{"instance_group_name": "homogeneousCluster", "instance_type": "ml.c5.4xlarge",
                             "hosts": [host]}]}))
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


def start_job(base: Path, job_name: str, prefix: tuple = (), **popen) -> subprocess.Popen:
    """``train`` as the PyTorch container starts it (after the ``prefix`` command), output in ``<base>.log``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(SAGEMAKER_BASE_DIR=str(base), SAGEMAKER_TRAINING_MODULE="sagemaker_pytorch_container.training:main",
               TRAINING_JOB_NAME=job_name, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               NO_ALBUMENTATIONS_UPDATE="1", PET_MASTER_PORT=str(free_port()),  # torchrun's --master_port
               PATH=f"{TRAIN.parent}{os.pathsep}{os.environ.get('PATH', '')}")  # the toolkit runs `torchrun` from PATH
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
