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

from tests.helpers import _free_port

pytest.importorskip("sagemaker_training")
pytest.importorskip("sagemaker_pytorch_container")

REPO = Path(__file__).resolve().parents[2]
TRAIN = Path(sys.executable).with_name("train")  # the toolkit's console script, next to this Python
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
TIME_KEYS = ("samples_per_s",)

# What a user passes as ModelTrainer / Estimator hyperparameters: Hydra group choices, nested
# objects, dotted keys, booleans and lists. The tiny smoke model on 8x8 gray digits.
HPS = {
    "experiment": "smoke", "data": "image_folder",
    "data.resolution": 8, "data.channels": 1, "data.num_classes": 10, "data.num_workers": 0, "data.hflip": False,
    "trainer": {"max_steps": 6, "checkpoint_every": 2, "log_every": 1},
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
             tensorboard: Path = None) -> Path:
    """The folder SageMaker mounts at ``/opt/ml`` for one job on one host: config files, data
    channels (copied), ``model/``, ``output/``; ``processes`` > 0 turns on ``torch_distributed``
    with that many processes on the host. Returns ``base``."""
    config = base / "input" / "config"
    config.mkdir(parents=True)
    source = base.parent / f"{base.name}_source"  # the job's source_dir: entry script + requirements.txt
    source.mkdir()
    shutil.copy(REPO / "scripts" / "sagemaker_entry.py", source / "sagemaker_entry.py")
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


def start_job(base: Path, job_name: str, **popen) -> subprocess.Popen:
    """``train`` as the PyTorch container starts it, output in ``<base>.log``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(SAGEMAKER_BASE_DIR=str(base), SAGEMAKER_TRAINING_MODULE="sagemaker_pytorch_container.training:main",
               TRAINING_JOB_NAME=job_name, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
               NO_ALBUMENTATIONS_UPDATE="1", PET_MASTER_PORT=str(_free_port()),  # torchrun's --master_port
               PATH=f"{TRAIN.parent}{os.pathsep}{os.environ.get('PATH', '')}")  # the toolkit runs `torchrun` from PATH
    log = open(f"{base}.log", "w")
    return subprocess.Popen([str(TRAIN)], env=env, cwd=base.parent, stdout=log, stderr=subprocess.STDOUT, **popen)


def run_job(base: Path, job_name: str, timeout: float = 300) -> int:
    return start_job(base, job_name).wait(timeout=timeout)


def rows(run: Path) -> list:
    f = run / "metrics.jsonl"
    lines = f.read_text().splitlines() if f.is_file() else []
    return [{k: v for k, v in json.loads(x).items() if k not in TIME_KEYS} for x in lines]
