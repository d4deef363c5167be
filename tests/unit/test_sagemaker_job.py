"""``vitp-sagemaker-job``: argument checks, source staging, and the request the SageMaker SDK v3 builds.

Argument and staging tests need no SDK. The request tests run the real SDK against moto's mocked
AWS (``pip install -e ".[sagemaker]"``); they are skipped when either is missing. The SDK import
(~2-3 s) happens once, in the module-scoped ``sdk`` fixture; the vitp wheel is built once, in
``staged``.
"""
from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.helpers import compose_cfg
from vitp.cli import sagemaker_job as job

REPO = Path(__file__).resolve().parents[2]
ROLE = "arn:aws:iam::123456789012:role/SageMakerRole"
HYDRA = ["experiment=img256", "trainer.max_steps=1000", "model.depth=28", "data.resolution=[64,32]"]
SHARDS = ["data=shards", "data.shards=s3://data-bucket/packs/digits", "data.num_classes=10"]


def _fails(argv, capsys) -> str:
    """Run the CLI expecting bad input: exit status 2 and one ``prog: error:`` line; returns it."""
    with pytest.raises(SystemExit) as e:
        job.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{job.PROG}: error: "), err
    return err[0]


@pytest.mark.parametrize("argv, message", [
    (["--channel", "train"], "--channel 'train' is not KEY=VALUE"),
    (["--channel", "train=/data/imagenet"], "is not an S3 URI"),
    (["--channel", "train=s3://b1/x", "--channel", "train=s3://b1/y"], "'train' is given twice"),
    (["--channel", "code=s3://bucket/x"], "channels the SDK adds itself"),
    (["--spot"], "--spot needs --max-wait >= --max-run (86400 s)"),
    (["--spot", "--max-run", "24h", "--max-wait", "2h"], "--spot needs --max-wait >= --max-run"),
    (["--max-wait", "48h"], "--max-wait applies to managed spot training only"),
    (["--max-run", "soon"], "--max-run 'soon'"),
    (["--instance-type", "p4d.24xlarge"], "not a SageMaker instance type of the form ml.<family>.<size>"),
    (["--instance-type", "ml.p4d.24xl"], "not a SageMaker instance type"),
    (["--instance-count", "0"], "--instance-count must be >= 1"),
    (["--env", "1BAD=x"], "--env 1BAD: a variable name"),
    (["--base-job-name", "vitp_run"], "--base-job-name 'vitp_run'"),
    (["--checkpoint-s3", "bucket/ckpt"], "--checkpoint-s3: 'bucket/ckpt' is not an S3 URI"),
    (["trainer.max_steps"], "override 'trainer.max_steps' is not KEY=VALUE"),
    (["data.resolution=[1,2"], "cannot parse 'data.resolution=[1,2'"),
    (["trainer.max_step=10"], "unknown config key trainer.max_step (did you mean trainer.max_steps?)"),
    (["experiment=img265"], "Could not find 'experiment/img265' Available options in 'experiment': digits_text img1024 img256"),
    (["trainer.global_batch_size=0"], "trainer.global_batch_size=0: must be an integer >= 1"),
    (["model.mlp=relu"], "Error merging override model.mlp=relu; Invalid value 'relu', expected one of [gelu, swiglu]"),
    (["seed=1,2"], "override 'seed=1,2': a training job takes one value per key"),
    (["--channel", "shards=s3://bk1/x", *SHARDS], "--channel shards: the 'shards' channel is made from "
                                                 "data.shards=s3://data-bucket/packs/digits; drop the --channel, "
                                                 "or use --shards-mode download"),
    (["data=shards", "data.shards=s3://Data_Bucket/p", "data.num_classes=10"],
     "data.shards: 's3://Data_Bucket/p' is not an S3 URI like s3://my-bucket/prefix"),
])
def test_bad_input_fails_with_one_clear_line(argv, message, capsys):
    assert message in _fails(["--dry-run", *argv], capsys)


def test_no_role_needs_dry_run(capsys):
    assert "--role is required" in _fails(["--channel", "train=s3://b1/x"], capsys)


def test_overrides_become_hyperparameters_the_job_reads_as_hydra_does():
    """Values the in-job toolkit decodes to Hydra's reading travel as typed; Hydra's quoted strings
    and lists of bare strings travel as the JSON of Hydra's reading, which the toolkit decodes to
    the same value (``vitp-sagemaker-job data.root='a b'`` gives the job ``a b``, not ``'a b'``)."""
    over = ["experiment=img256", "trainer.max_steps=1000", "data.root='a=b, c'", "data.files=[x.mp4,'y,z.mp4']",
            "trainer.resume='true'", "trainer.init_from=null", "optim.betas=[0.9,0.99]", "trainer.precision=bf16"]
    hps = job.parse_overrides(over)
    assert hps == {"experiment": "img256", "trainer.max_steps": "1000", "data.root": '"a=b, c"',
                   "data.files": '["x.mp4", "y,z.mp4"]', "trainer.resume": '"true"', "trainer.init_from": "null",
                   "optim.betas": "[0.9,0.99]", "trainer.precision": "bf16"}
    from vitp.cli.sagemaker import sagemaker_overrides

    in_job = {k: job._toolkit_reads(v) for k, v in hps.items()}  # what SM_HPS holds in the job
    got = sagemaker_overrides({"SM_HPS": json.dumps(in_job)})[:len(over)]
    cfg = compose_cfg([o for o in got if not o.startswith("hydra.")])
    want = compose_cfg(over)  # vitp-train's reading of the same command line
    for key in ("data.root", "data.files", "trainer.resume", "trainer.init_from", "optim.betas", "trainer.max_steps"):
        assert OmegaConf.select(cfg, key) == OmegaConf.select(want, key), key
    assert cfg.data.root == "a=b, c" and list(cfg.data.files) == ["x.mp4", "y,z.mp4"] and cfg.trainer.resume == "true"


def test_durations():
    assert [job.parse_duration(t, "x") for t in ("3600", "90m", "24h", "2d", "45s")] == [3600, 5400, 86400,
                                                                                       172800, 45]


# ---------------------------------------------------------------- staging

@pytest.fixture(scope="module")
def fake_repo(tmp_path_factory) -> Path:
    """A copy of this checkout plus placeholder job scripts (they exist only here) and a stale,
    git-ignored ``build/`` module that must not reach the wheel."""
    root = tmp_path_factory.mktemp("repo") / "vitp"
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard"],
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (REPO / rel).is_file():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, root / rel)
    (root / "build/lib/vitp").mkdir(parents=True)
    (root / "build/lib/vitp/stale_module.py").write_text("raise SystemExit('stale')\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


@pytest.fixture(scope="module")
def staged(fake_repo, tmp_path_factory):
    """``stage_source`` once, building the wheel: ``(source_dir, wheel)``."""
    dest = tmp_path_factory.mktemp("staged") / "source"
    return dest, job.stage_source(fake_repo, dest)


def test_stage_source_holds_entry_requirements_and_wheel(staged, fake_repo):
    dest, wheel = staged
    assert sorted(p.name for p in dest.iterdir()) == sorted(["sagemaker_entry.py", "requirements.txt", wheel.name])
    assert (dest / "sagemaker_entry.py").read_text() == (fake_repo / "scripts/sagemaker_entry.py").read_text()
    # the repo's requirements verbatim: they pin the staged wheel's version, found with --find-links .
    text = (dest / "requirements.txt").read_text()
    assert text == (fake_repo / "scripts/sagemaker_requirements.txt").read_text()
    assert "--find-links ." in text.splitlines() and wheel.name.startswith("vitp-0.1.0-")
    names = zipfile.ZipFile(wheel).namelist()
    confs = sorted(str(p.relative_to(fake_repo / "conf")) for p in (fake_repo / "conf").rglob("*.yaml"))
    assert confs and sorted(n[len("vitp/conf/"):] for n in names if n.endswith(".yaml")) == confs
    assert "vitp/cli/sagemaker_job.py" in names and not any("stale_module" in n for n in names)


def test_stage_source_reuses_a_given_wheel_and_names_it_once(staged, fake_repo, tmp_path):
    _, wheel = staged
    dest = tmp_path / "again"
    job.stage_source(fake_repo, dest, wheel=wheel)
    lines = (dest / "requirements.txt").read_text().splitlines()
    job.stage_source(fake_repo, dest, wheel=wheel)  # requirements copied afresh: still one wheel line
    assert (dest / "requirements.txt").read_text().splitlines() == lines and lines[-1] == "vitp==0.1.0"


def test_stage_source_appends_the_wheel_when_requirements_do_not_name_vitp(staged, fake_repo, tmp_path):
    _, wheel = staged
    repo = tmp_path / "repo"
    shutil.copytree(fake_repo / "scripts", repo / "scripts")
    (repo / "scripts/sagemaker_requirements.txt").write_text("timm==1.0.31\nhydra-core==1.3.8")
    dest = tmp_path / "staged"
    job.stage_source(repo, dest, wheel=wheel)
    assert (dest / "requirements.txt").read_text().splitlines() == ["timm==1.0.31", "hydra-core==1.3.8",
                                                                    f"./{wheel.name}"]
    (repo / "scripts/sagemaker_requirements.txt").write_text("--find-links .\nvitp==9.9\n")
    with pytest.raises(ValueError, match="pins vitp==9.9 but the staged wheel is vitp-0.1.0-"):
        job.stage_source(repo, dest, wheel=wheel)


def test_stage_source_without_job_scripts_says_where_they_come_from(tmp_path):
    with pytest.raises(FileNotFoundError, match="copied from scripts/sagemaker_entry.py of a vitp checkout"):
        job.stage_source(tmp_path, tmp_path / "out")


def test_missing_sdk_names_the_extra(monkeypatch, fake_repo, capsys):
    for name in ["sagemaker", *(m for m in sys.modules if m.startswith("sagemaker."))]:
        monkeypatch.setitem(sys.modules, name, None)  # imports fail as if it were not installed
    line = _fails(["--dry-run", "--repo", str(fake_repo)], capsys)
    assert 'pip install -e ".[sagemaker]"' in line


# ---------------------------------------------------------------- the SDK's request (SDK + moto)

@pytest.fixture(scope="module")
def sdk():
    pytest.importorskip("sagemaker.train", reason="SageMaker SDK v3 not installed (pip install -e '.[sagemaker]')")
    pytest.importorskip("moto", reason="moto not installed (pip install -e '.[sagemaker]')")
    return job.load_sdk()


@pytest.fixture
def no_network(monkeypatch):
    """Every socket connection attempt is recorded and refused."""
    attempts = []

    def refuse(self, address):
        attempts.append(address)
        raise OSError("network is off in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    return attempts


def _dry_run(argv, capsys) -> dict:
    job.main(["--dry-run", *argv])
    return json.loads(capsys.readouterr().out)


def test_dry_run_prints_the_request_the_sdk_sends(sdk, staged, fake_repo, no_network, monkeypatch, capsys):
    # the user's AWS settings must not leak in (no profile lookup, no real keys)
    monkeypatch.setenv("AWS_PROFILE", "does-not-exist")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAREALLOOKINGKEY")
    out = _dry_run(["--repo", str(fake_repo), "--wheel", str(staged[1]), "--region", "us-west-2",
                    "--instance-type", "ml.p5.48xlarge", "--instance-count", "2",
                    "--channel", "train=s3://data-bucket/imagenet/train",
                    "--channel", "validation=s3://data-bucket/val",
                    "--checkpoint-s3", "s3://my-bucket/vitp/run1/checkpoints",
                    "--tensorboard-s3", "s3://my-bucket/vitp/run1/tensorboard",
                    "--spot", "--max-run", "24h", "--max-wait", "36h", "--env", "NCCL_DEBUG=INFO",
                    "--env", "FI_PROVIDER=efa", "--base-job-name", "vitp-img256", *HYDRA], capsys)
    req = out["CreateTrainingJob"]
    assert req["TrainingJobName"].startswith("vitp-img256-")
    assert req["AlgorithmSpecification"]["TrainingImage"] == \
        "763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch:2.14-cu133-amzn2023-sagemaker"
    assert "sm_drivers/sm_train.sh" in " ".join(req["AlgorithmSpecification"]["ContainerArguments"])
    assert req["RoleArn"] == job.DRY_RUN_ROLE
    assert req["ResourceConfig"] == {"InstanceType": "ml.p5.48xlarge", "InstanceCount": 2, "VolumeSizeInGB": 100}
    channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in req["InputDataConfig"]}
    assert channels["train"] == "s3://data-bucket/imagenet/train" and channels["validation"] == "s3://data-bucket/val"
    # the staged source folder is uploaded as the "code" channel (the job's submit directory)
    assert channels["code"].endswith(f"/vitp-img256/{req['TrainingJobName']}/input/code")
    assert sorted(out["code_channel"]["files"]) == sorted(["sagemaker_entry.py", "requirements.txt",
                                                           staged[1].name])
    assert req["CheckpointConfig"] == {"S3Uri": "s3://my-bucket/vitp/run1/checkpoints",
                                       "LocalPath": "/opt/ml/checkpoints"}
    assert req["TensorBoardOutputConfig"] == {"S3OutputPath": "s3://my-bucket/vitp/run1/tensorboard",
                                              "LocalPath": "/opt/ml/output/tensorboard"}
    assert req["EnableManagedSpotTraining"] is True
    assert req["StoppingCondition"] == {"MaxRuntimeInSeconds": 86400, "MaxWaitTimeInSeconds": 129600}
    assert req["HyperParameters"] == {"experiment": "img256", "trainer.max_steps": "1000", "model.depth": "28",
                                      "data.resolution": "[64,32]"}
    assert req["Environment"] == {"NCCL_DEBUG": "INFO", "FI_PROVIDER": "efa"}
    # entry script and torchrun distribution travel in the SDK's sm_drivers channel, not as hyperparameters
    drivers = out["sm_drivers_channel"]
    assert drivers["sourcecode.json"]["entry_script"] == "sagemaker_entry.py"
    assert drivers["sourcecode.json"]["requirements"] == "requirements.txt"
    assert drivers["distributed.json"] == {"process_count_per_node": None, "smp": None}
    assert any(line.endswith("distributed_drivers/torchrun_driver.py") for line in drivers["sm_train.sh (from cd on)"])
    # what runs on each instance: the SDK driver's torchrun command per host, one rendezvous on algo-1
    inst = out["instances"]
    assert inst["hosts"] == ["algo-1", "algo-2"] and inst["processes_per_host"] == 8 and inst["world_size"] == 16
    assert inst["processes_per_host_from"] == "one per GPU of ml.p5.48xlarge"
    assert inst["layout"] == "tp=1 cp=1 pp=1 dp=16, checked for the world size"
    assert inst["torchrun"] == {f"algo-{i + 1}": "torchrun --nnodes=2 --nproc_per_node=8 --master_addr=algo-1 "
                                f"--master_port=7777 --node_rank={i} sagemaker_entry.py" for i in range(2)}
    assert inst["entry_arguments"] == ("--experiment img256 --trainer.max_steps 1000 --model.depth 28 "
                                       "--data.resolution '[64, 32]'")
    note = inst["checkpoints"]
    assert note.startswith("Each of the 2 instances has its own /opt/ml/checkpoints (its own disk, not shared), and "
                           "SageMaker syncs every host's folder to the same s3://my-bucket/vitp/run1/checkpoints.")
    assert "each host gets the union of all hosts' uploads" in note and "SDK's default" not in note
    assert no_network == []


def test_dry_run_options_image_processes_input_mode(sdk, staged, fake_repo, no_network, capsys):
    out = _dry_run(["--repo", str(fake_repo), "--wheel", str(staged[1]), "--region", "eu-west-1",
                    "--image-uri", "111122223333.dkr.ecr.eu-west-1.amazonaws.com/vitp:latest",
                    "--instance-type", "ml.g5.12xlarge", "--processes-per-host", "4", "--input-mode", "FastFile",
                    "--tensorboard-local-path", "/opt/ml/output/tb", "--role", ROLE,
                    "--output-s3", "s3://my-bucket/vitp/models", "--bucket", "my-staging-bucket",
                    "--channel", "train=s3://data-bucket/train",
                    "trainer.micro_batch_size=16"], capsys)  # the digits batch of 64 over 4 processes
    req = out["CreateTrainingJob"]
    train = next(c for c in req["InputDataConfig"] if c["ChannelName"] == "train")
    assert "InputMode" not in train  # the job's FastFile applies (the SDK sets File on a bare-URI channel)
    assert req["AlgorithmSpecification"]["TrainingImage"] == "111122223333.dkr.ecr.eu-west-1.amazonaws.com/vitp:latest"
    assert req["AlgorithmSpecification"]["TrainingInputMode"] == "FastFile"
    assert out["sm_drivers_channel"]["distributed.json"]["process_count_per_node"] == 4
    assert req["RoleArn"] == ROLE and req["OutputDataConfig"]["S3OutputPath"] == "s3://my-bucket/vitp/models"
    assert req["EnableManagedSpotTraining"] is False and "MaxWaitTimeInSeconds" not in req["StoppingCondition"]
    assert req["TensorBoardOutputConfig"]["LocalPath"] == "/opt/ml/output/tb"
    assert req["Environment"] == {"VITP_SM_TENSORBOARD_DIR": "/opt/ml/output/tb"}  # the in-job side follows it
    code = next(c for c in req["InputDataConfig"] if c["ChannelName"] == "code")
    assert code["DataSource"]["S3DataSource"]["S3Uri"].startswith("s3://my-staging-bucket/vitp/")
    assert req["CheckpointConfig"]["S3Uri"].startswith(f"s3://my-staging-bucket/vitp/{req['TrainingJobName']}/")
    inst = out["instances"]
    assert inst["torchrun"] == {"algo-1": "torchrun --nnodes=1 --nproc_per_node=4 sagemaker_entry.py"}
    assert inst["world_size"] == 4 and inst["layout"] == "tp=1 cp=1 pp=1 dp=4, checked for the world size"
    note = inst["checkpoints"]
    assert note.startswith(f"/opt/ml/checkpoints is synced to {req['CheckpointConfig']['S3Uri']}; the run directory")
    assert note.endswith("a new job gets another one and starts afresh (pass --checkpoint-s3 to continue a run in a "
                         "new job).")
    assert no_network == []


def test_unlisted_instance_type_warns_with_close_names(sdk, capsys):
    assert job.warn_unlisted_instance_type("ml.p5.48xlarge")
    assert not job.warn_unlisted_instance_type("ml.p4d.48xlarge")
    err = capsys.readouterr().err
    assert "ml.p4d.48xlarge is not among botocore" in err and "ml.p4d.24xlarge" in err


def test_unknown_framework_version_fails_with_the_sdk_message(sdk, fake_repo, capsys):
    line = _fails(["--dry-run", "--repo", str(fake_repo), "--region", "us-east-1", "--framework-version", "2.99",
                   "trainer.micro_batch_size=8"], capsys)  # the digits batch of 64 over a p4d's 8 GPUs
    assert "2.99" in line and "2.14" in line  # the SDK lists the versions it knows


def test_submit_round_trip_under_moto(sdk, staged, fake_repo, capsys):
    """The real submit path (no --dry-run) against moto: what describe_training_job returns is what we asked."""
    with job._offline_aws("us-east-1"):
        job.main(["--repo", str(fake_repo), "--wheel", str(staged[1]), "--role", ROLE, "--region", "us-east-1",
                  "--instance-type", "ml.p4d.24xlarge", "--instance-count", "4",
                  "--channel", "train=s3://data-bucket/train", "--checkpoint-s3", "s3://my-bucket/ckpt",
                  "--tensorboard-s3", "s3://my-bucket/tb", "--spot", "--max-run", "2h", "--max-wait", "3h",
                  "--env", "NCCL_DEBUG=INFO", *HYDRA])
        summary = json.loads(capsys.readouterr().out)
        boto = sdk.boto3.Session(region_name="us-east-1")
        d = boto.client("sagemaker").describe_training_job(TrainingJobName=summary["TrainingJobName"])
        code = next(c for c in d["InputDataConfig"] if c["ChannelName"] == "code")["DataSource"]["S3DataSource"]
        bucket, _, prefix = code["S3Uri"][len("s3://"):].partition("/")
        keys = [o["Key"] for o in boto.client("s3").list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    assert d["TrainingJobArn"] == summary["TrainingJobArn"] and d["RoleArn"] == ROLE
    assert d["AlgorithmSpecification"]["TrainingImage"] == summary["TrainingImage"]
    assert d["ResourceConfig"] == {"InstanceType": "ml.p4d.24xlarge", "InstanceCount": 4, "VolumeSizeInGB": 100}
    assert d["HyperParameters"] == dict(h.split("=", 1) for h in HYDRA)
    assert d["EnableManagedSpotTraining"] is True
    assert d["StoppingCondition"] == {"MaxRuntimeInSeconds": 7200, "MaxWaitTimeInSeconds": 10800}
    assert d["CheckpointConfig"] == {"S3Uri": "s3://my-bucket/ckpt", "LocalPath": "/opt/ml/checkpoints"}
    assert d["TensorBoardOutputConfig"]["S3OutputPath"] == "s3://my-bucket/tb"
    assert "Environment" not in d  # moto 5.2 does not store it (the dry-run test checks the request's)
    assert [c["ChannelName"] for c in d["InputDataConfig"]] == ["train", "code", "sm_drivers"]
    assert sorted(k.rsplit("/", 1)[1] for k in keys) == sorted(["sagemaker_entry.py", "requirements.txt",
                                                               staged[1].name])


@pytest.mark.parametrize("argv, gpus, nproc, layout", [
    (["--instance-type", "ml.p6-b200.48xlarge"], None, "<GPUs of ml.p6-b200.48xlarge>",
     "chosen in the job: its GPU count is not known here"),
    (["--instance-type", "ml.p5.48xlarge", "parallel=auto"], 8, "8",
     "chosen in the job: parallel=auto plans it for the world size"),
])
def test_instances_summary_for_eleven_hosts(argv, gpus, nproc, layout, sdk):
    """Hosts algo-1..algo-11; the SDK driver ranks them in sorted order (algo-10 is node 1), with
    the rendezvous on algo-1; a layout the job decides is said so, and an unknown GPU count is not
    shown as 1 process."""
    a = job.build_parser().parse_args(["--dry-run", "--instance-count", "11", *argv])
    spec = job.spec_from_args(a)
    request = {"HyperParameters": spec.hyperparameters,
               "CheckpointConfig": {"S3Uri": "s3://b1/ckpt", "LocalPath": "/opt/ml/checkpoints"}}
    inst = job.instances_summary(spec, request, {"process_count_per_node": None, "smp": None}, gpus, None)
    assert inst["hosts"] == [f"algo-{i}" for i in range(1, 12)] and inst["layout"] == layout
    ranks = {h: int(c.split("--node_rank=")[1].split()[0]) for h, c in inst["torchrun"].items()}
    assert ranks == {h: i for i, h in enumerate(sorted(inst["hosts"]))} and ranks["algo-10"] == 1
    assert all(f"--nnodes=11 --nproc_per_node={nproc} --master_addr=algo-1 --master_port=7777 " in c
               for c in inst["torchrun"].values())
    assert inst["world_size"] == (None if gpus is None else 88)


@pytest.fixture
def nothing_built(monkeypatch):
    """Staging the source or building a trainer (the request) fails the test."""
    def built(*_a, **_k):
        raise AssertionError("a request was built for a config that cannot run")

    monkeypatch.setattr(job, "stage_source", built)
    monkeypatch.setattr(job, "make_trainer", built)


@pytest.mark.parametrize("argv, message", [
    (["--instance-count", "1", "parallel.tp=3"], "parallel.tp=3 x parallel.pp=1 does not divide world_size=8; valid (tp, pp) for 8 processes: "
                        "[(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2)]; with parallel.cp=2: [(1, 1), "
                        "(1, 2), (1, 4), (2, 1), (2, 2)]; with parallel.cp=4: [(1, 1), (1, 2)] (the job runs 8 "
                        "processes: --instance-count 1 x 8 per instance, one per GPU of ml.p4d.24xlarge)"),
    (["--instance-count", "3"], "trainer.global_batch_size=1024 must be a multiple of trainer.micro_batch_size (32) x "
                                "dp (24); 1024 samples do not split over dp=24 data-parallel ranks: set trainer.global_batch_size=768 "
                                "(another batch size changes the training), or choose a layout whose dp divides 1024 "
                                "(the job runs 24 processes"),
    (["--processes-per-host", "3"], "trainer.global_batch_size=1024 must be a multiple of trainer.micro_batch_size "
                                    "(32) x dp (3)"),
])
def test_dry_run_checks_the_layout_for_the_jobs_world_size_before_a_request(argv, message, sdk, nothing_built,
                                                                             fake_repo, capsys):
    """validate_config with the job's world size (instances x processes per instance: the flag, or
    one per GPU of the instance type from the SDK's table): a layout that cannot run exits 2 in one
    line, before the source is staged or a request built."""
    line = _fails(["--dry-run", "--repo", str(fake_repo), "--region", "us-east-1", "--channel",
                   "train=s3://data-bucket/imagenet", *argv[:2], "experiment=img256", "data.num_classes=1000",
                   *argv[2:]], capsys)
    assert message in line, line


def test_a_recipe_that_reads_data_root_without_a_train_channel_warns(sdk):
    """img256 reads data.root, which the job sets from its 'train' channel: without one, a warning
    names the flag; with one, or for a recipe with its own data (the digits default), none."""
    import contextlib
    import io

    def check(*argv):
        a = job.build_parser().parse_args(["--dry-run", *argv])
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            layout = job.check_job_config(a.overrides, job.spec_from_args(a), job.gpus_per_instance(
                sdk, a.instance_type, "us-east-1"))
        return layout and layout.tp * layout.cp * layout.pp * layout.dp, err.getvalue()

    world, err = check("experiment=img256")
    assert world == 8 and err.count("\n") == 1 and "warning: data.name=image_folder reads data.root" in err
    assert "--channel train=s3://BUCKET/PREFIX" in err
    assert check("experiment=img256", "--channel", "train=s3://data-bucket/imagenet") == (8, "")
    assert check("experiment=img256", "data.root=/opt/data") == (8, "")
    world, err = check("--instance-type", "ml.p6-b200.48xlarge")  # not in the SDK's table: checked in the job
    assert world is None and "does not list the GPUs of ml.p6-b200.48xlarge" in err and "--processes-per-host" in err
    assert check("--instance-type", "ml.g5.2xlarge") == (1, "")  # one GPU: one process
    assert check("--instance-count", "2", "--processes-per-host", "2", "trainer.micro_batch_size=16") == (4, "")
    assert check("parallel=auto", "--instance-count", "2") == (None, "")  # the planner picks the layout in the job


def test_dry_run_shards_from_s3_become_a_fastfile_channel(sdk, staged, fake_repo, no_network, capsys):
    """data=shards data.shards=s3://...: a 'shards' channel (the prefix, FullyReplicated) with
    InputMode FastFile while the job's other channels keep File; the job reads the mount's path."""
    out = _dry_run(["--repo", str(fake_repo), "--wheel", str(staged[1]), "--region", "us-east-1",
                    "--instance-type", "ml.g5.2xlarge", "--channel", "validation=s3://data-bucket/val",
                    *SHARDS, "trainer.max_steps=3"], capsys)
    req = out["CreateTrainingJob"]
    assert req["AlgorithmSpecification"]["TrainingInputMode"] == "File"
    channels = {c["ChannelName"]: c for c in req["InputDataConfig"]}
    assert list(channels) == ["validation", "shards", "code", "sm_drivers"]
    prefix = {"S3DataType": "S3Prefix", "S3Uri": "s3://data-bucket/packs/digits/",
              "S3DataDistributionType": "FullyReplicated"}
    assert channels["shards"] == {"ChannelName": "shards", "InputMode": "FastFile",
                                  "DataSource": {"S3DataSource": prefix}}
    assert "InputMode" not in channels["validation"] and channels["code"]["InputMode"] == "File"
    assert req["HyperParameters"] == {"data": "shards", "data.shards": "/opt/ml/input/data/shards",
                                      "data.num_classes": "10", "trainer.max_steps": "3"}
    assert job.SHARDS_LOCAL_PATH == "/opt/ml/input/data/shards"  # SageMaker's /opt/ml/input/data/<channel>
    assert no_network == []


@pytest.mark.parametrize("over, mode, want, hp", [
    (SHARDS, "File", {"uri": "s3://data-bucket/packs/digits/", "mode": "File"}, "/opt/ml/input/data/shards"),
    (SHARDS[:1] + ["data.shards=s3://data-bucket/packs/digits/"] + SHARDS[2:], "FastFile",
     {"uri": "s3://data-bucket/packs/digits/", "mode": "FastFile"}, "/opt/ml/input/data/shards"),
    (SHARDS, "download", None, "s3://data-bucket/packs/digits"),  # the training code downloads the shards
    (["data=shards", "data.shards=/fsx/packs/digits", "data.num_classes=10"], "FastFile", None, "/fsx/packs/digits"),
    (["data.shards=s3://data-bucket/packs/digits"], "FastFile", None, "s3://data-bucket/packs/digits"),  # digits
])
def test_shard_channel_by_mode(over, mode, want, hp, capsys):
    hps = job.parse_overrides(over)
    assert job.shard_channel(over, hps, {}, mode) == want
    assert hps["data.shards"] == hp
    warned = "data.shards=/fsx/packs/digits is a path, read as is inside the job" in capsys.readouterr().err
    assert warned == hp.startswith("/fsx")  # a local pack path would not exist in the job unless mounted there
