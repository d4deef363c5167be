"""``vitp-sagemaker-job``: submit a vitp training job to SageMaker with the Python SDK v3 ``ModelTrainer``.

The job runs ``sagemaker_entry.py`` (from ``scripts/``) under torchrun on every instance
(``Torchrun`` distribution: one process per GPU unless ``--processes-per-host``), from a staged
source folder that also holds ``requirements.txt`` and a vitp wheel built from this checkout (see
:func:`stage_source`). Positional ``KEY=VALUE`` arguments are Hydra overrides, checked by the schema
before the job starts; they travel as the job's hyperparameters (:func:`parse_overrides`). A packed
data set on S3 (``data=shards data.shards=s3://...``) becomes a ``shards`` channel in FastFile or
File mode, read in the job as a local folder (:func:`shard_channel`, ``--shards-mode``). ``--dry-run`` prints the CreateTrainingJob request the SDK builds,
captured from the SDK itself while it runs against moto's mocked AWS (no credentials, no network).

The SDK is an optional extra: ``pip install -e ".[sagemaker]"`` (imported only when needed).

Sources (SDK v3 = ``sagemaker`` 3.27: ``sagemaker-train`` 1.27, ``sagemaker-core`` 2.27):

- SDK v3 training guide (``ModelTrainer`` replaces the v2 estimators):
  https://sagemaker.readthedocs.io/en/stable/training/index.html
- ``sagemaker/train/model_trainer.py`` (``ModelTrainer``, ``train``, ``with_tensorboard_output_config``;
  source code and SDK drivers are uploaded as the ``code`` and ``sm_drivers`` channels),
  ``sagemaker/train/distributed.py`` (``Torchrun``),
  ``sagemaker/train/container_drivers/distributed_drivers/torchrun_driver.py`` (the in-job torchrun
  command and the NCCL/EFA variables it sets), ``sagemaker/core/training/configs.py``
  (``SourceCode``, ``Compute``, ``CheckpointConfig``, ``TensorBoardOutputConfig``, ``InputData``),
  ``sagemaker/core/image_uri_config/pytorch-amzn2023.json`` (PyTorch training DLC versions).
- Checkpoints with ``ModelTrainer``: https://docs.aws.amazon.com/sagemaker/latest/dg/model-checkpoints-enable.html ;
  the local path is synced to S3 during the job and what is under the S3 URI is written to the container when
  a job starts: https://docs.aws.amazon.com/sagemaker/latest/dg/model-checkpoints.html
- Several instances: the SDK's ``sagemaker.train.container_drivers.scripts.environment`` (hosts ``algo-1..N``
  sorted, ``SM_MASTER_ADDR`` = ``algo-1``, ``SM_MASTER_PORT`` = 7777, ``SM_CURRENT_HOST_RANK``) and
  ``torchrun_driver.create_commands``; every host's ``/opt/ml/model`` goes into one ``model.tar.gz``:
  https://docs.aws.amazon.com/sagemaker/latest/dg/your-algorithms-training-algo-output.html
- Managed spot training: https://docs.aws.amazon.com/sagemaker/latest/dg/model-managed-spot-training.html
  and ``StoppingCondition`` (MaxWaitTimeInSeconds >= MaxRuntimeInSeconds):
  https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_StoppingCondition.html
- TensorBoard output: https://docs.aws.amazon.com/sagemaker/latest/APIReference/API_TensorBoardOutputConfig.html
- Input modes (File, FastFile) and the channel path ``/opt/ml/input/data/<channel>``:
  https://docs.aws.amazon.com/sagemaker/latest/dg/model-access-training-data.html ; a channel's
  ``InputMode`` overrides the job's ``TrainingInputMode``: ``Channel`` in botocore's service model.
- Limits (hyperparameters, environment, channel and job names): botocore's ``sagemaker`` service model,
  ``CreateTrainingJob`` input shape.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, Iterable, List, Optional
from unittest import mock

from vitp.cli import run_cli

PROG = "vitp-sagemaker-job"
INSTALL_HINT = 'pip install -e ".[sagemaker]"'

# The staged source folder: file name in the job -> where it comes from in the checkout.
ENTRY_SCRIPT = "sagemaker_entry.py"
REQUIREMENTS = "requirements.txt"
STAGED_FROM = {ENTRY_SCRIPT: "scripts/sagemaker_entry.py", REQUIREMENTS: "scripts/sagemaker_requirements.txt"}

# PyTorch training DLC family in the SDK's image-uri config whose versions reach the pinned torch
# (2.11-2.14, tag "2.14-cu133-amzn2023-sagemaker"); the classic "pytorch-training" repository stops at 2.10.
DLC_FRAMEWORK = "pytorch-amzn2023"
DLC_VERSION = "2.14"

CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"  # the in-job side keeps its run directory here
SHARDS_CHANNEL = "shards"  # data.shards=s3://... becomes this channel, mounted at SHARDS_LOCAL_PATH in the job
SHARDS_LOCAL_PATH = f"/opt/ml/input/data/{SHARDS_CHANNEL}"
SHARDS_MODES = ("FastFile", "File", "download")  # --shards-mode: the channel's InputMode, or no channel
TENSORBOARD_LOCAL_PATH = "/opt/ml/output/tensorboard"
SDK_CHANNELS = ("code", "sm_drivers")  # channels the SDK adds itself
DRY_RUN_ROLE = "arn:aws:iam::123456789012:role/vitp-dry-run-placeholder"  # moto's account id

# CreateTrainingJob limits (botocore service model) and the instance-type shape of its enum.
MAX_HYPERPARAMETERS, MAX_HP_KEY, MAX_HP_VALUE = 100, 256, 2500
MAX_ENV, MAX_ENV_VALUE = 100, 512
ENV_KEY = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
CHANNEL_NAME = re.compile(r"[A-Za-z0-9.\-_]{1,64}")
JOB_NAME_BASE = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9])*")
MAX_JOB_NAME_BASE = 48  # the SDK appends "-YYYYmmddHHMMSS" and cuts the name at 63 characters
INSTANCE_TYPE = re.compile(r"ml\.[a-z][a-z0-9-]*\.(?:\d*xlarge|large|medium|small)")
S3_URI = re.compile(r"s3://[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9](/.*)?")
DURATION = re.compile(r"(\d+)([smhd]?)")


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """Everything the job request is built from, validated (see :func:`spec_from_args`)."""

    instance_type: str
    instance_count: int
    volume_size_gb: int
    processes_per_host: Optional[int]
    image_uri: Optional[str]
    framework_version: str
    region: Optional[str]
    role: Optional[str]
    base_job_name: str
    bucket: Optional[str]
    input_mode: str
    channels: Dict[str, str]
    shards: Optional[Dict[str, str]]  # {"uri": s3://..., "mode": FastFile | File}: the shards channel
    hyperparameters: Dict[str, str]
    environment: Dict[str, str]
    checkpoint_s3: Optional[str]
    tensorboard_s3: Optional[str]
    tensorboard_local_path: str
    output_s3: Optional[str]
    spot: bool
    max_run_s: int
    max_wait_s: Optional[int]
    wait: bool
    dry_run: bool


# ---------------------------------------------------------------- argument parsing (no SDK needed)

def parse_duration(text: str, what: str) -> int:
    """Seconds from ``3600``, ``90m``, ``24h`` or ``2d``."""
    m = DURATION.fullmatch(text.strip())
    if not m or int(m.group(1)) == 0:
        raise ValueError(f"{what} {text!r}: use a positive number of seconds or a number with s/m/h/d (e.g. 24h)")
    return int(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def _pairs(items: Iterable[str], what: str, example: str) -> Dict[str, str]:
    """``KEY=VALUE`` strings -> dict (split at the first ``=``); a key given twice is an error."""
    out: Dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{what} {item!r} is not KEY=VALUE (e.g. {example})")
        if key in out:
            raise ValueError(f"{what} {key!r} is given twice ({out[key]!r} and {value!r})")
        out[key] = value
    return out


def _toolkit_reads(text: str):
    """A hyperparameter as the in-job toolkit decodes it (``environment.read_hyperparameters`` in
    sagemaker-training: ``json.loads``, else the string itself; the SDK sends strings as they are)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_overrides(overrides: Iterable[str]) -> Dict[str, str]:
    """Hydra overrides -> hyperparameters: ``trainer.max_steps=1000`` -> ``{"trainer.max_steps": "1000"}``.

    Keys keep their dots (the in-job side turns each entry back into ``key=value``). A value travels
    as the string typed where the toolkit decodes it to what Hydra reads (numbers, ``true``,
    ``[0.1,1]``, ``smoke``); else (Hydra's quoted strings ``'a b'``, lists of bare strings
    ``[a.mp4,b.mp4]``) as the JSON of Hydra's reading, so the job sees what ``vitp-train`` would.
    The overrides are composed and checked by the schema here (:func:`vitp.cli.overrides.compose_checked`),
    so a typo or a bad value fails before a job starts. Raises ``ValueError`` (one line).
    """
    from vitp.cli.overrides import compose_checked, same_value
    from vitp.cli.overrides import parse_overrides as parse

    overrides = list(overrides)
    hps = _pairs(overrides, "override", "trainer.max_steps=1000")
    for key, o in zip(list(hps), parse(overrides)):
        if o.is_sweep_override():
            raise ValueError(f"override {o.input_line!r}: a training job takes one value per key")
        if not same_value(_toolkit_reads(hps[key]), o.value()):
            hps[key] = json.dumps(o.value())
    compose_checked(overrides)
    if len(hps) > MAX_HYPERPARAMETERS:
        raise ValueError(f"{len(hps)} overrides: a training job takes at most {MAX_HYPERPARAMETERS}")
    for k, v in hps.items():
        if len(k) > MAX_HP_KEY or len(v) > MAX_HP_VALUE:
            raise ValueError(f"override {k!r}: keys are limited to {MAX_HP_KEY} and values to {MAX_HP_VALUE} "
                             "characters")
    return hps


def parse_channels(items: Iterable[str]) -> Dict[str, str]:
    """``--channel train=s3://bucket/prefix`` -> ``{"train": "s3://bucket/prefix"}``."""
    channels = _pairs(items, "--channel", "train=s3://my-bucket/imagenet/train")
    for name, uri in channels.items():
        if not CHANNEL_NAME.fullmatch(name):
            raise ValueError(f"--channel {name}: a channel name is 1-64 of A-Z a-z 0-9 . - _")
        if name in SDK_CHANNELS:
            raise ValueError(f"--channel {name}: {' and '.join(SDK_CHANNELS)} are channels the SDK adds itself; "
                             "rename it")
        check_s3(uri, f"--channel {name}")
    return channels


def parse_env(items: Iterable[str]) -> Dict[str, str]:
    """``--env NCCL_DEBUG=INFO`` -> the job's environment variables."""
    env = _pairs(items, "--env", "NCCL_DEBUG=INFO")
    if len(env) > MAX_ENV:
        raise ValueError(f"{len(env)} --env variables: a training job takes at most {MAX_ENV}")
    for k, v in env.items():
        if not ENV_KEY.fullmatch(k) or len(k) > 512:
            raise ValueError(f"--env {k}: a variable name is a letter or _ followed by letters, digits or _")
        if len(v) > MAX_ENV_VALUE:
            raise ValueError(f"--env {k}: values are limited to {MAX_ENV_VALUE} characters")
    return env


def check_s3(uri: str, what: str) -> str:
    """``uri`` if it is ``s3://bucket[/key]``, else a ``ValueError`` naming ``what``."""
    if not S3_URI.fullmatch(uri):
        raise ValueError(f"{what}: {uri!r} is not an S3 URI like s3://my-bucket/prefix")
    return uri


def check_instance_type(name: str) -> str:
    """``name`` if it has the shape of a SageMaker instance type (``ml.<family>.<size>``)."""
    if not INSTANCE_TYPE.fullmatch(name):
        raise ValueError(f"--instance-type {name!r} is not a SageMaker instance type of the form ml.<family>.<size> "
                         "(e.g. ml.p4d.24xlarge, ml.p5.48xlarge, ml.g5.12xlarge)")
    return name


def build_parser() -> argparse.ArgumentParser:
    """The command line (``--help`` lists what each option becomes in the job)."""
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Submit a vitp training job to SageMaker (SDK v3 ModelTrainer, torchrun on every instance).",
        epilog="NCCL/EFA: the SDK's torchrun driver itself sets FI_PROVIDER=efa on its EFA instance list "
               "(p4d/p4de/p5/p5e, g5.48xlarge, ...), FI_EFA_USE_DEVICE_RDMA=1 on p4d/p5-class, and always "
               "NCCL_SOCKET_IFNAME and NCCL_PROTO=simple (these two override --env). Add what it does not set "
               "with --env, e.g. --env FI_PROVIDER=efa on newer EFA types it does not list (p5en, p6), "
               "--env NCCL_DEBUG=INFO to log the transport NCCL picked.")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="Hydra overrides for the job, e.g. experiment=img256 trainer.max_steps=1000")
    g = p.add_argument_group("compute")
    g.add_argument("--instance-type", default="ml.p4d.24xlarge", help="(default: %(default)s)")
    g.add_argument("--instance-count", type=int, default=1, help="instances; torchrun spans all of them")
    g.add_argument("--processes-per-host", type=int, default=None,
                   help="torchrun processes per instance (default: the SDK's choice, one per GPU)")
    g.add_argument("--volume-size-gb", type=int, default=100,
                   help="EBS volume per instance; File mode copies the channels onto it (default: %(default)s)")
    g.add_argument("--image-uri", default=None,
                   help="training image (default: the SDK's PyTorch DLC, see --framework-version)")
    g.add_argument("--framework-version", default=DLC_VERSION,
                   help=f"{DLC_FRAMEWORK} DLC version known to the installed SDK (default: %(default)s, torch 2.14.x)")
    g = p.add_argument_group("data and outputs")
    g.add_argument("--channel", action="append", default=[], metavar="NAME=S3URI",
                   help="input channel, e.g. train=s3://b/imagenet/train (the job reads the 'train' channel); repeat")
    g.add_argument("--input-mode", choices=["File", "FastFile"], default="File",
                   help="File copies channels to the volume first; FastFile streams from S3 (default: %(default)s)")
    g.add_argument("--shards-mode", choices=SHARDS_MODES, default="FastFile",
                   help=f"with data=shards data.shards=s3://...: the job reads the shards from a '{SHARDS_CHANNEL}' "
                        f"channel at {SHARDS_LOCAL_PATH} in FastFile mode (streamed on demand) or File mode "
                        "(copied to the volume before training), or 'download' (no channel: the training code "
                        "downloads whole shards to data.shard_cache) (default: %(default)s)")
    g.add_argument("--checkpoint-s3", default=None,
                   help=f"S3 URI synced with {CHECKPOINT_LOCAL_PATH} (run directory, checkpoints); reuse it to resume "
                        "in a new job (default: the SDK's per-job s3://<bucket>/<base>/<job>/checkpoints)")
    g.add_argument("--tensorboard-s3", default=None, help="S3 URI for TensorBoard events (default: the SDK's)")
    g.add_argument("--tensorboard-local-path", default=TENSORBOARD_LOCAL_PATH, help="(default: %(default)s)")
    g.add_argument("--output-s3", default=None, help="S3 URI for model.tar.gz (default: s3://<bucket>/<base-job-name>)")
    g.add_argument("--bucket", default=None, help="bucket for the staged code and the defaults above "
                                                   "(default: the SDK's sagemaker-<region>-<account>)")
    g = p.add_argument_group("time and cost")
    g.add_argument("--max-run", default="24h",
                   help="stop the job after this long, e.g. 3600, 90m, 24h (default: %(default)s)")
    g.add_argument("--spot", action="store_true", help="managed spot training (needs --max-wait >= --max-run)")
    g.add_argument("--max-wait", default=None, help="spot only: total time including waiting for capacity")
    g = p.add_argument_group("job")
    g.add_argument("--role", default=None, help="IAM execution role ARN (required unless --dry-run)")
    g.add_argument("--region", default=None, help="AWS region (default: the AWS config's)")
    g.add_argument("--base-job-name", default="vitp", help="job name prefix; the SDK appends a timestamp")
    g.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="job environment variable; repeat")
    g.add_argument("--repo", type=Path, default=None, help="vitp checkout to stage from (default: this one)")
    g.add_argument("--wheel", type=Path, default=None, help="use this vitp wheel instead of building one")
    g.add_argument("--wait", action="store_true", help="stream the job's logs until it ends")
    g.add_argument("--dry-run", action="store_true",
                   help="print the CreateTrainingJob request (JSON) the SDK builds; needs no credentials or network")
    return p


def spec_from_args(a: argparse.Namespace) -> JobSpec:
    """Validate the parsed command line; every problem is a one-line ``ValueError``."""
    for flag, n in (("--instance-count", a.instance_count), ("--volume-size-gb", a.volume_size_gb),
                    ("--processes-per-host", a.processes_per_host)):
        if n is not None and n < 1:
            raise ValueError(f"{flag} must be >= 1, got {n}")
    max_run = parse_duration(a.max_run, "--max-run")
    max_wait = parse_duration(a.max_wait, "--max-wait") if a.max_wait is not None else None
    if a.spot and (max_wait is None or max_wait < max_run):
        raise ValueError(f"--spot needs --max-wait >= --max-run ({max_run} s): it bounds the waiting for spot "
                         "capacity plus the run (e.g. --max-run 24h --max-wait 36h)")
    if max_wait is not None and not a.spot:
        raise ValueError("--max-wait applies to managed spot training only: add --spot or drop --max-wait")
    if not a.role and not a.dry_run:
        raise ValueError("--role is required: the IAM execution role ARN the job runs as "
                         "(e.g. arn:aws:iam::111122223333:role/SageMakerRole); --dry-run works without one")
    if not JOB_NAME_BASE.fullmatch(a.base_job_name) or len(a.base_job_name) > MAX_JOB_NAME_BASE:
        raise ValueError(f"--base-job-name {a.base_job_name!r}: 1-{MAX_JOB_NAME_BASE} letters, digits and hyphens, "
                         "starting and ending with a letter or digit")
    for flag, uri in (("--checkpoint-s3", a.checkpoint_s3), ("--tensorboard-s3", a.tensorboard_s3),
                      ("--output-s3", a.output_s3)):
        if uri is not None:
            check_s3(uri, flag)
    channels, hps = parse_channels(a.channel), parse_overrides(a.overrides)
    shards = shard_channel(a.overrides, hps, channels, a.shards_mode)
    return JobSpec(
        instance_type=check_instance_type(a.instance_type), instance_count=a.instance_count,
        volume_size_gb=a.volume_size_gb, processes_per_host=a.processes_per_host, image_uri=a.image_uri,
        framework_version=a.framework_version, region=a.region, role=a.role, base_job_name=a.base_job_name,
        bucket=a.bucket, input_mode=a.input_mode, channels=channels, shards=shards,
        hyperparameters=hps, environment=_job_env(a),
        checkpoint_s3=a.checkpoint_s3, tensorboard_s3=a.tensorboard_s3,
        tensorboard_local_path=a.tensorboard_local_path, output_s3=a.output_s3, spot=a.spot,
        max_run_s=max_run, max_wait_s=max_wait, wait=a.wait, dry_run=a.dry_run)


def shard_channel(overrides: List[str], hps: Dict[str, str], channels: Dict[str, str],
                  mode: str) -> Optional[Dict[str, str]]:
    """The ``shards`` channel of a job whose overrides read a packed data set from S3
    (``data=shards data.shards=s3://BUCKET/PREFIX``), or ``None``.

    With ``mode`` ``FastFile`` or ``File`` the job gets the channel (the prefix, ``S3Prefix``,
    ``FullyReplicated``: every instance sees all shards) and ``hps["data.shards"]`` becomes
    :data:`SHARDS_LOCAL_PATH`, where SageMaker mounts (FastFile) or copies (File) the prefix, so the
    job reads the shards as local files. With ``download`` nothing changes: the training code
    downloads whole shards from S3 to ``data.shard_cache`` (:mod:`vitp.data.shards`).

    Returns ``{"uri": "s3://BUCKET/PREFIX/", "mode": mode}`` (the URI ends with ``/``: an S3 prefix
    without it also matches ``PREFIX2/...``). Raises ``ValueError`` when ``data.shards`` is not an
    S3 URI of the right shape, or a ``--channel shards`` is given too."""
    from vitp.cli.overrides import compose_checked

    data = compose_checked(overrides).data
    uri = str(data.shards or "")
    if data.name == "shards" and uri and "://" not in uri and not uri.startswith("/opt/ml/"):
        print(f"{PROG}: warning: data.shards={uri} is a path, read as is inside the job: unless the job's image or a "
              f"file system mounts it there, upload the pack (aws s3 sync {uri} s3://BUCKET/PREFIX) and give "
              f"data.shards=s3://BUCKET/PREFIX", file=sys.stderr)
    if data.name != "shards" or not uri.startswith("s3://") or mode == "download":
        return None
    check_s3(uri, "data.shards")
    if SHARDS_CHANNEL in channels:
        raise ValueError(f"--channel {SHARDS_CHANNEL}: the '{SHARDS_CHANNEL}' channel is made from data.shards={uri}; "
                         f"drop the --channel, or use --shards-mode download")
    hps["data.shards"] = SHARDS_LOCAL_PATH
    return {"uri": uri.rstrip("/") + "/", "mode": mode}


def _job_env(a: argparse.Namespace) -> Dict[str, str]:
    env = parse_env(a.env)
    if a.tensorboard_local_path != TENSORBOARD_LOCAL_PATH:
        # the in-job side writes events where this variable says (vitp.cli.sagemaker)
        env.setdefault("VITP_SM_TENSORBOARD_DIR", a.tensorboard_local_path)
    return env


# ---------------------------------------------------------------- source staging

def default_repo() -> Optional[Path]:
    """The checkout this module runs from (an editable install), or ``None`` for an installed wheel."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "scripts").is_dir() else None


def _copy_sources(repo: Path, dst: Path) -> None:
    """Copy what git would see (tracked and untracked, not ignored) so stale ``build/`` or
    ``*.egg-info`` folders in the checkout cannot leak into the wheel."""
    try:
        listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "-co", "--exclude-standard"],
                                capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        listed = []
    if not any(listed):  # not a git checkout: copy the tree minus build products
        shutil.copytree(repo, dst, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "outputs", "runs"))
        return
    for rel in filter(None, listed):
        src = repo / rel
        if src.is_file():  # deleted but still tracked files are skipped
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


def build_wheel(repo: Path, out_dir: Path) -> Path:
    """``pip wheel --no-deps --no-build-isolation --no-index`` of ``repo``; returns the wheel's path.

    Offline: no build isolation means the running environment's setuptools builds it (about 2 s here).
    """
    with tempfile.TemporaryDirectory(prefix="vitp-wheel-") as tmp:
        src = Path(tmp) / "src"
        _copy_sources(repo, src)
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
               "-w", str(Path(tmp) / "dist"), str(src)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list((Path(tmp) / "dist").glob("vitp-*.whl"))
        if r.returncode != 0 or len(wheels) != 1:
            tail = (r.stderr.strip().splitlines() or ["no wheel written"])[-1]
            raise ValueError(f"building the vitp wheel from {repo} failed (pip exit {r.returncode}): {tail} "
                             "(it builds without isolation, so this environment needs setuptools>=68; "
                             "or pass --wheel)")
        out_dir.mkdir(parents=True, exist_ok=True)
        return Path(shutil.move(str(wheels[0]), str(out_dir / wheels[0].name)))


def stage_source(repo: Path, dest: Path, wheel: Optional[Path] = None, wheel_in_requirements: bool = True) -> Path:
    """Fill ``dest`` (the job's ``source_dir``) and return the wheel's path there.

    ``dest`` receives ``sagemaker_entry.py`` and ``requirements.txt`` copied from
    :data:`STAGED_FROM` in ``repo``, and a vitp wheel (``wheel`` copied, else built from ``repo``).
    With ``wheel_in_requirements`` the wheel is appended to ``requirements.txt`` as ``./<wheel>``
    (the SDK installs the requirements from inside the code folder), unless a line already names
    vitp (the repo's file pins ``vitp==<version>`` with ``--find-links .``, so the staged wheel is
    what pip installs).

    Raises ``ValueError`` when the requirements pin a vitp version other than the wheel's.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for name, rel in STAGED_FROM.items():
        src = repo / rel
        if not src.is_file():
            raise FileNotFoundError(f"{src} not found: the job's {name} is copied from {rel} of a vitp checkout "
                                    "(run from one, or pass --repo)")
        shutil.copy2(src, dest / name)
    if wheel is not None:
        if not wheel.is_file() or not wheel.name.startswith("vitp-") or wheel.suffix != ".whl":
            raise FileNotFoundError(f"--wheel {wheel}: not a vitp-*.whl file")
        staged = Path(shutil.copy2(wheel, dest / wheel.name))
    else:
        staged = build_wheel(repo, dest)
    req = dest / REQUIREMENTS
    text = req.read_text()
    pin = re.search(r"^\s*vitp==(\S+)", text, re.M)
    if pin and not staged.name.startswith(f"vitp-{pin.group(1)}-"):
        raise ValueError(f"{STAGED_FROM[REQUIREMENTS]} pins vitp=={pin.group(1)} but the staged wheel is "
                         f"{staged.name}: make the pin match pyproject's version")
    names_vitp = pin or re.search(r"^[^#]*vitp-[^\s]*\.whl", text, re.M)
    if wheel_in_requirements and not names_vitp:
        req.write_text(text + ("" if text.endswith("\n") or not text else "\n") + f"./{staged.name}\n")
    return staged


# ---------------------------------------------------------------- the SDK

def load_sdk() -> SimpleNamespace:
    """The SDK v3 names used here, imported on first use; a clear error when the extra is missing."""
    try:
        from importlib.metadata import version

        import boto3
        from sagemaker.core import image_uris, instance_types_gpu_info
        from sagemaker.core.helper.session_helper import Session
        from sagemaker.core.shapes import Channel, DataSource, S3DataSource
        from sagemaker.core.training.configs import (CheckpointConfig, Compute, InputData, OutputDataConfig,
                                                     SourceCode, StoppingCondition, TensorBoardOutputConfig)
        from sagemaker.train.distributed import Torchrun
        from sagemaker.train.model_trainer import ModelTrainer
    except ImportError as e:
        raise ValueError(f"the SageMaker Python SDK v3 is missing ({e}); install it with: {INSTALL_HINT}") from None
    return SimpleNamespace(
        boto3=boto3, image_uris=image_uris, Session=Session, CheckpointConfig=CheckpointConfig, Compute=Compute,
        InputData=InputData, Channel=Channel, DataSource=DataSource, S3DataSource=S3DataSource,
        OutputDataConfig=OutputDataConfig, SourceCode=SourceCode,
        StoppingCondition=StoppingCondition, TensorBoardOutputConfig=TensorBoardOutputConfig, Torchrun=Torchrun,
        ModelTrainer=ModelTrainer, version=version("sagemaker"), gpu_info=instance_types_gpu_info.retrieve)


def warn_unlisted_instance_type(name: str) -> bool:
    """Warn (stderr) when ``name`` is missing from botocore's list of training instance types; the
    service is the judge (botocore may predate a new type), so this is not an error. True if listed."""
    import difflib

    import botocore
    from botocore.loaders import create_loader
    from botocore.model import ServiceModel

    # the model files only: a botocore session would read the AWS config (and fail on a bad profile)
    model = ServiceModel(create_loader().load_service_model("sagemaker", "service-2"))
    resource = model.operation_model("CreateTrainingJob").input_shape.members["ResourceConfig"]
    known = resource.members["InstanceType"].enum
    if not known or name in known:
        return True
    close = difflib.get_close_matches(name, known, n=3)
    print(f"{PROG}: warning: {name} is not among botocore {botocore.__version__}'s training instance types"
          + (f" (close: {', '.join(close)})" if close else "") + "; SageMaker will reject it if it does not exist",
          file=sys.stderr)
    return False


def gpus_per_instance(sdk: SimpleNamespace, instance_type: str, region: str) -> Optional[int]:
    """GPUs of ``instance_type`` from the SDK's table (``sagemaker.core.instance_types_gpu_info``:
    0 for a type it lists without GPUs, ``None`` for one it does not list)."""
    table = sdk.gpu_info(region) or sdk.gpu_info("us-east-1")
    if instance_type in table:
        return int(table[instance_type].get("Count", 0))
    return None


def check_job_config(overrides: List[str], spec: JobSpec, gpus: Optional[int]):
    """Check the job's config as its ``vitp-train`` will, before any request is built: the
    overrides composed on the closed schema and :func:`vitp.config.validate_config` with the layout
    for the job's world size (``--instance-count`` x processes per host: ``--processes-per-host``,
    else the SDK driver's default, one per GPU (``gpus``), or 1 on an instance without GPUs), unless
    ``parallel.auto`` (the planner picks the layout in the job). Warns (stderr) when the config reads
    ``data.root`` but no ``train`` channel is given (the job sets ``data.root`` from it). Returns the
    :class:`vitp.config.Layout` checked (its ``tp * cp * pp * dp`` is the job's world size), or
    ``None`` when the job decides it (``parallel.auto``, or the GPU count of an unlisted instance type).

    Raises ``ValueError`` (one line) naming the key and the valid values."""
    from vitp.cli.overrides import compose_checked
    from vitp.config import validate_config

    cfg = compose_checked(overrides)
    data = cfg.data
    if data.name in ("image_folder", "video_folder") and data.root is None and not data.files \
            and "train" not in spec.channels:
        print(f"{PROG}: warning: data.name={data.name} reads data.root, which the job sets from its 'train' "
              f"channel, and none is given: add --channel train=s3://BUCKET/PREFIX (or set data.root to a folder "
              f"inside the image)", file=sys.stderr)
    per_host = spec.processes_per_host or (None if gpus is None else max(gpus, 1))
    if cfg.parallel.auto:
        return None
    if per_host is None:
        print(f"{PROG}: note: the SDK's table does not list the GPUs of {spec.instance_type}, so the layout is "
              f"checked in the job; pass --processes-per-host N to check it here", file=sys.stderr)
        return None
    world = spec.instance_count * per_host
    try:
        return validate_config(cfg, world, "cuda" if gpus else "cpu")
    except ValueError as e:
        how = "--processes-per-host" if spec.processes_per_host else f"one per GPU of {spec.instance_type}"
        raise ValueError(f"{e} (the job runs {world} processes: --instance-count {spec.instance_count} x "
                         f"{per_host} per instance, {how})") from None


def resolve_image(sdk: SimpleNamespace, spec: JobSpec, region: str) -> str:
    """``--image-uri``, else the SDK's PyTorch training DLC for the region and instance type
    (GPU or CPU build chosen by the SDK from the instance type)."""
    if spec.image_uri:
        return spec.image_uri
    return sdk.image_uris.retrieve(framework=DLC_FRAMEWORK, region=region, version=spec.framework_version,
                                   instance_type=spec.instance_type, image_scope="training")


def make_trainer(sdk: SimpleNamespace, spec: JobSpec, source_dir: Path, session, image: str):
    """The ``ModelTrainer`` for ``spec``, running ``sagemaker_entry.py`` from ``source_dir``."""
    trainer = sdk.ModelTrainer(
        sagemaker_session=session, role=spec.role, base_job_name=spec.base_job_name, training_image=image,
        source_code=sdk.SourceCode(source_dir=str(source_dir), entry_script=ENTRY_SCRIPT, requirements=REQUIREMENTS),
        compute=sdk.Compute(instance_type=spec.instance_type, instance_count=spec.instance_count,
                            volume_size_in_gb=spec.volume_size_gb, enable_managed_spot_training=spec.spot),
        # torchrun on every host; processes per host default to the GPU count (SDK driver)
        distributed=sdk.Torchrun(process_count_per_node=spec.processes_per_host),
        stopping_condition=sdk.StoppingCondition(max_runtime_in_seconds=spec.max_run_s,
                                                 max_wait_time_in_seconds=spec.max_wait_s),
        # always on: the in-job run directory lives under the checkpoint path, so it is synced and resumable
        checkpoint_config=sdk.CheckpointConfig(s3_uri=spec.checkpoint_s3, local_path=CHECKPOINT_LOCAL_PATH),
        output_data_config=sdk.OutputDataConfig(s3_output_path=spec.output_s3) if spec.output_s3 else None,
        training_input_mode=spec.input_mode, environment=dict(spec.environment),
        hyperparameters=dict(spec.hyperparameters))
    return trainer.with_tensorboard_output_config(sdk.TensorBoardOutputConfig(
        s3_output_path=spec.tensorboard_s3, local_path=spec.tensorboard_local_path))


def run_trainer(sdk: SimpleNamespace, spec: JobSpec, source_dir: Path, boto_session, image: str) -> dict:
    """Build the trainer and call ``train``; returns ``{"request": ..., "response": ...}`` of the
    CreateTrainingJob call as botocore sent and parsed it (event hooks on ``boto_session``)."""
    seen: dict = {}

    def before(params, **_):  # returning None lets the call go ahead
        seen["request"] = json.loads(params["body"])

    def after(parsed, **_):
        seen["response"] = parsed

    # hooks must be on the boto session before the SDK creates its clients from it
    boto_session.events.register("before-call.sagemaker.CreateTrainingJob", before)
    boto_session.events.register("after-call.sagemaker.CreateTrainingJob", after)
    session = sdk.Session(boto_session=boto_session, default_bucket=spec.bucket)
    trainer = make_trainer(sdk, spec, source_dir, session, image)
    channels = input_channels(sdk, spec)
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for our JSON
        trainer.train(input_data_config=channels or None, wait=spec.wait, logs=spec.wait)
    if "request" not in seen:
        raise RuntimeError("the SDK returned without calling CreateTrainingJob")
    return seen


def input_channels(sdk: SimpleNamespace, spec: JobSpec) -> list:
    """The job's data channels: each ``--channel`` (an ``S3Prefix``, ``FullyReplicated`` data
    source without a channel InputMode, so ``--input-mode`` applies: the SDK would set File on a
    channel given as a bare URI) and the shards channel with its own InputMode (:func:`shard_channel`)."""
    def source(uri: str):
        return sdk.S3DataSource(s3_data_type="S3Prefix", s3_uri=uri, s3_data_distribution_type="FullyReplicated")

    out = [sdk.InputData(channel_name=k, data_source=source(v)) for k, v in spec.channels.items()]
    if spec.shards:
        out.append(sdk.Channel(channel_name=SHARDS_CHANNEL, data_source=sdk.DataSource(
            s3_data_source=source(spec.shards["uri"])), input_mode=spec.shards["mode"]))
    return out


@contextlib.contextmanager
def _offline_aws(region: str):
    """moto's in-memory AWS with none of the user's AWS settings (profiles, endpoints, keys)."""
    try:
        from moto import mock_aws
    except ImportError as e:
        raise ValueError(f"--dry-run needs moto ({e}); install it with: {INSTALL_HINT}") from None
    with mock.patch.dict(os.environ):
        for key in [k for k in os.environ if k.startswith("AWS_")]:
            del os.environ[key]
        os.environ.update(AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull,
                          AWS_DEFAULT_REGION=region, AWS_EC2_METADATA_DISABLED="true",
                          SAGEMAKER_VALIDATE_ROLE="false")  # moto has no iam:SimulatePrincipalPolicy
        with mock_aws():
            yield


def _read_prefix(s3, uri: str) -> Dict[str, bytes]:
    """Objects under an ``s3://bucket/prefix`` (moto's store), keyed by path below the prefix."""
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    prefix = prefix.rstrip("/") + "/"
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for obj in page.get("Contents", []):
            out[obj["Key"][len(prefix):]] = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


def dry_run(sdk: SimpleNamespace, spec: JobSpec, source_dir: Path, region: str, image: str,
            gpus: Optional[int] = None, layout=None) -> dict:
    """The request the SDK sends, captured while it runs against moto, plus what it uploaded for
    the ``code`` channel (file sizes) and the ``sm_drivers`` channel (the launch configuration),
    and what runs on each instance (:func:`instances_summary`; ``gpus`` per instance and the
    ``layout`` :func:`check_job_config` checked)."""
    spec = dataclasses.replace(spec, role=spec.role or DRY_RUN_ROLE, wait=False)
    with _offline_aws(region):
        boto_session = sdk.boto3.Session(region_name=region)
        request = run_trainer(sdk, spec, source_dir, boto_session, image)["request"]
        s3 = boto_session.client("s3")
        uploads = {c["ChannelName"]: _read_prefix(s3, c["DataSource"]["S3DataSource"]["S3Uri"])
                   for c in request.get("InputDataConfig", []) if c["ChannelName"] in SDK_CHANNELS}
    code, drivers = uploads.get("code", {}), uploads.get("sm_drivers", {})
    script = [line.strip() for line in drivers.get("sm_train.sh", b"").decode().splitlines() if line.strip()]
    start = next((i for i, line in enumerate(script) if line.startswith("cd ")), 0)
    return {
        "CreateTrainingJob": request,
        "code_channel": {"files": {k: len(v) for k, v in sorted(code.items())},
                         REQUIREMENTS: code.get(REQUIREMENTS, b"").decode().splitlines()},
        "sm_drivers_channel": {"sourcecode.json": json.loads(drivers.get("sourcecode.json", b"{}")),
                               "distributed.json": json.loads(drivers.get("distributed.json", b"{}")),
                               "sm_train.sh (from cd on)": script[start:]},
        "instances": instances_summary(spec, request, json.loads(drivers.get("distributed.json", b"{}")), gpus,
                                       layout),
        "dry_run": f"captured from SageMaker SDK {sdk.version} running against moto (no AWS calls made); "
                   f"account 123456789012, the default bucket name and role {DRY_RUN_ROLE} (when --role "
                   "is not given) are placeholders",
    }


def host_commands(spec: JobSpec, request: dict, distributed: dict, gpus: Optional[int]) -> Dict[str, List[str]]:
    """``{"algo-1": [torchrun, ...], ...}``: the command the SDK's torchrun driver
    (``torchrun_driver.create_commands``) builds on each instance, run here with the environment
    the SDK's in-job ``environment.py`` gives that host (``SM_HOSTS`` sorted, ``SM_MASTER_ADDR`` /
    ``SM_MASTER_PORT``, ``SM_CURRENT_HOST_RANK``; ``SM_NUM_GPUS`` = ``gpus``, the driver's default
    process count). Hosts are named ``algo-1..N``, as SageMaker names them."""
    saved = list(sys.path)
    try:  # the drivers import their helpers as a top-level "common" package from their own folder
        from sagemaker.train.container_drivers.distributed_drivers import torchrun_driver as driver
        from sagemaker.train.container_drivers.scripts import environment as in_job
    finally:
        sys.path[:] = saved
    hosts = [f"algo-{i + 1}" for i in range(spec.instance_count)]
    hps = in_job.deserialize_hyperparameters(request.get("HyperParameters", {}))
    image_torch = tuple(int(x) for x in re.findall(r"\d+", spec.framework_version)[:2])  # the image's, not ours
    out = {}
    for host in hosts:
        env = {"SM_ENTRY_SCRIPT": ENTRY_SCRIPT, "SM_DISTRIBUTED_CONFIG": json.dumps(distributed),
               "SM_HPS": json.dumps(hps), "SM_HOST_COUNT": str(len(hosts)), "SM_MASTER_ADDR": in_job.SM_MASTER_ADDR,
               "SM_MASTER_PORT": str(in_job.SM_MASTER_PORT), "SM_CURRENT_HOST_RANK": str(sorted(hosts).index(host)),
               "SM_NUM_GPUS": str(gpus or 0)}
        with mock.patch.dict(os.environ, env), mock.patch.object(driver, "pytorch_version", lambda: image_torch):
            out[host] = driver.create_commands()
    return out


def checkpoint_note(spec: JobSpec, request: dict) -> str:
    """How the job's checkpoints are stored and found again, for one instance or several."""
    config = request.get("CheckpointConfig", {})
    uri, local, n = config.get("S3Uri"), config.get("LocalPath", CHECKPOINT_LOCAL_PATH), spec.instance_count
    restart = (f"A restarted job (spot capacity back, or a new job with --checkpoint-s3 {uri}) starts with what is "
               f"under that URI")
    if n == 1:
        text = f"{local} is synced to {uri}; the run directory is {local}/run. {restart} and resumes the run."
    else:
        text = (f"Each of the {n} instances has its own {local} (its own disk, not shared), and SageMaker syncs every "
                f"host's folder to the same {uri}. The run directory is {local}/run on every host: rank 0 (on algo-1) "
                f"writes the run's log, metrics and Hydra config there, and each host writes its own ranks' checkpoint "
                f"files into its own folder. {restart} on every host: each host gets the union of all hosts' uploads "
                f"and the run resumes from the newest checkpoint complete in it.")
    if not spec.checkpoint_s3:
        text += (" The URI is the SDK's default for this job name: a new job gets another one and starts afresh "
                 "(pass --checkpoint-s3 to continue a run in a new job).")
    return text


def instances_summary(spec: JobSpec, request: dict, distributed: dict, gpus: Optional[int], layout) -> dict:
    """What runs where: hosts, processes per host, the world size and the ``layout`` checked for it
    (:func:`check_job_config`; else why the job decides it), each host's torchrun command
    (:func:`host_commands`; the entry's arguments, the same on every host, once), where rank 0's
    outputs land, and how checkpoints work (:func:`checkpoint_note`)."""
    per_host = spec.processes_per_host or (None if gpus is None else max(gpus, 1))
    commands = host_commands(spec, request, distributed, gpus)
    cut = commands["algo-1"].index(ENTRY_SCRIPT) + 1
    launch = {host: shlex.join(cmd[:cut]) for host, cmd in commands.items()}
    if per_host is None:  # the driver counts the GPUs in the job; the SDK's table does not know them
        launch = {h: c.replace("--nproc_per_node=1 ", f"--nproc_per_node=<GPUs of {spec.instance_type}> ")
                  for h, c in launch.items()}
    how = ("--processes-per-host" if spec.processes_per_host else f"one per GPU of {spec.instance_type}" if gpus
           else "1 (no GPU)" if gpus == 0 else "the GPUs counted in the job")
    return {
        "hosts": list(commands), "processes_per_host": per_host, "processes_per_host_from": how,
        "world_size": None if per_host is None else spec.instance_count * per_host,
        "layout": (f"tp={layout.tp} cp={layout.cp} pp={layout.pp} dp={layout.dp}, checked for the world size"
                   if layout else "chosen in the job: " + ("its GPU count is not known here" if per_host is None
                                                           else "parallel=auto plans it for the world size")),
        "torchrun": launch, "entry_arguments": shlex.join(commands["algo-1"][cut:]),
        "outputs": "rank 0 runs on algo-1 (node rank 0): final weights and eval.json (model dir), TensorBoard events "
                   "and output data are written there only; SageMaker puts every host's model dir into one "
                   "model.tar.gz",
        "checkpoints": checkpoint_note(spec, request),
    }


def submit(sdk: SimpleNamespace, spec: JobSpec, source_dir: Path, region: str, image: str) -> dict:
    """Create the training job (with the user's AWS credentials); returns where to find it."""
    boto_session = sdk.boto3.Session(region_name=region)
    seen = run_trainer(sdk, spec, source_dir, boto_session, image)
    req, resp = seen["request"], seen.get("response") or {}
    return {"TrainingJobName": req["TrainingJobName"], "TrainingJobArn": resp.get("TrainingJobArn"),
            "Region": region, "TrainingImage": req["AlgorithmSpecification"]["TrainingImage"],
            "CheckpointS3Uri": req.get("CheckpointConfig", {}).get("S3Uri"),
            "TensorBoardS3OutputPath": req.get("TensorBoardOutputConfig", {}).get("S3OutputPath"),
            "OutputS3Path": req["OutputDataConfig"]["S3OutputPath"]}


# ---------------------------------------------------------------- entry point

def _region(sdk: SimpleNamespace, spec: JobSpec) -> str:
    """``--region``, else the AWS config's (read locally); a dry run falls back to us-east-1."""
    from botocore.exceptions import BotoCoreError

    try:
        region = spec.region or sdk.boto3.Session().region_name
    except BotoCoreError as e:  # e.g. AWS_PROFILE names a missing profile
        if not spec.dry_run:
            raise ValueError(f"reading the AWS configuration: {e}") from None
        region = None
    if region:
        return region
    if spec.dry_run:
        return "us-east-1"
    raise ValueError("no AWS region: pass --region or set one (AWS_DEFAULT_REGION, or region in ~/.aws/config)")


def run(argv: Optional[List[str]] = None) -> dict:
    """Parse, check the config for the job's world size (:func:`check_job_config`), stage the
    source folder, then submit (or print the request with ``--dry-run``)."""
    a = build_parser().parse_args(argv)
    spec = spec_from_args(a)
    repo = a.repo or default_repo()
    if repo is None:
        raise ValueError("not running from a vitp checkout: pass --repo PATH (the job's code is staged from it)")
    sdk = load_sdk()
    region = _region(sdk, spec)
    warn_unlisted_instance_type(spec.instance_type)
    gpus = gpus_per_instance(sdk, spec.instance_type, region)
    layout = check_job_config(a.overrides, spec, gpus)
    image = resolve_image(sdk, spec, region)  # fails early on an unknown region or version
    with tempfile.TemporaryDirectory(prefix="vitp-sm-source-") as tmp:
        source_dir = Path(tmp) / "source"
        stage_source(Path(repo), source_dir, a.wheel)
        if spec.dry_run:
            out = dry_run(sdk, spec, source_dir, region, image, gpus, layout)
        else:
            out = submit(sdk, spec, source_dir, region, image)
    print(json.dumps(out, indent=2))
    return out


def main(argv: Optional[List[str]] = None) -> None:
    """Console entry point; bad input exits with a one-line message (status 2)."""
    run_cli(PROG, run, argv)


if __name__ == "__main__":
    main()
