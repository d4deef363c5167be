"""The SageMaker entry's mapping (vitp/cli/sagemaker.py): hyperparameters in the forms SageMaker's
toolkit delivers them -> Hydra overrides, the job's paths from its environment, failure reasons.
The toolkit's own functions (``sagemaker_training.mapping``) produce ``SM_HPS`` and the argv here;
tests/distributed/test_sagemaker_toolkit.py runs whole jobs through the toolkit."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import compose_cfg
from vitp.cli.sagemaker import (
    channel_keys,
    check_overrides,
    failure_reason,
    hydra_override,
    job_hyperparameters,
    job_paths,
    sagemaker_overrides,
    write_failure,
)

mapping = pytest.importorskip("sagemaker_training.mapping")
REPO = Path(__file__).resolve().parents[2]


def _parsed(override: str):
    """What Hydra's own override parser reads from ``override``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    o = OverridesParser.create().parse_overrides([override])[0]
    assert not o.is_sweep_override(), override
    return o.key_or_group, o.value()


def _toolkit_forms(hyperparameters_json: dict, base: Path) -> tuple:
    """``(env, argv)`` the toolkit gives the entry script for this ``hyperparameters.json``: values
    decoded as ``environment.read_hyperparameters`` does (``json.loads``, else the string itself),
    ``sagemaker_*`` keys removed (``mapping.split_by_criteria``), ``SM_HPS`` from
    ``mapping.to_env_vars``, argv from ``mapping.to_cmd_args``."""
    def decode(v):
        try:
            return json.loads(v)
        except ValueError:
            return v

    decoded = {k: decode(v) for k, v in hyperparameters_json.items()}
    hps = mapping.split_by_criteria(decoded, prefix="sagemaker_").excluded  # the toolkit keeps its own keys
    env = {"SAGEMAKER_BASE_DIR": str(base), **mapping.to_env_vars({"hps": hps})}
    return env, mapping.to_cmd_args(hps)


# What a user passes to the SDK; the SDK writes each value JSON-encoded into hyperparameters.json.
USER_HPS = {"experiment": "smoke", "model": "tiny", "trainer": {"max_steps": 1, "eval_every": 0},
            "optim.betas": [0.9, 0.99], "trainer.progress": True, "data.cache_dir": "out,dir",
            "model.layer_scale_init": 1e-5, "seed": 3}
EXPECTED = ["experiment=smoke", "model=tiny", "trainer.max_steps=1", "trainer.eval_every=0", "optim.betas=[0.9,0.99]",
            "trainer.progress=true", "data.cache_dir='out,dir'", "model.layer_scale_init=1e-05", "seed=3"]


@pytest.mark.parametrize("form", ["SM_HPS", "argv"])
def test_hyperparameters_arrive_as_the_intended_overrides(tmp_path, form):
    """JSON-encoded strings, a nested object, a list, a boolean, a string with a comma and group
    choices become the intended overrides (checked with Hydra's parser) from SM_HPS and from the
    argv alike; the composed config holds the values."""
    env, argv = _toolkit_forms({k: json.dumps(v) for k, v in USER_HPS.items()}, tmp_path)
    if form == "argv":  # a driver that passes only the command line
        env.pop("SM_HPS")
    over = sagemaker_overrides(env, argv)
    user = [o for o in over if o.split("=")[0] in {e.split("=")[0] for e in EXPECTED}]
    assert sorted(user) == sorted(EXPECTED)
    assert _parsed("data.cache_dir='out,dir'") == ("data.cache_dir", "out,dir")
    assert _parsed("optim.betas=[0.9,0.99]") == ("optim.betas", [0.9, 0.99])
    check_overrides(over)
    cfg = compose_cfg([o for o in over if not o.startswith("hydra.")])
    assert (cfg.model.width, cfg.trainer.max_steps, cfg.trainer.eval_every, cfg.seed) == (32, 1, 0, 3)
    assert list(cfg.optim.betas) == [0.9, 0.99] and cfg.trainer.progress is True
    assert cfg.data.cache_dir == "out,dir" and cfg.model.layer_scale_init == 1e-5


def test_sm_hps_wins_over_the_lossy_argv(tmp_path):
    """The toolkit writes an object into argv as ``k=v,...`` text and ``None`` as ``''``; SM_HPS keeps
    them, so inside a job SM_HPS is read and the argv ignored."""
    env, argv = _toolkit_forms({"trainer": json.dumps({"max_steps": 2}), "trainer.init_from": "null",
                                "sagemaker_program": json.dumps("sagemaker_entry.py")}, tmp_path)
    assert argv == ["--trainer", "max_steps=2", "--trainer.init_from", ""]
    assert job_hyperparameters(env, argv) == {"trainer": {"max_steps": 2}, "trainer.init_from": None}
    assert job_hyperparameters({}, ["--trainer", "max_steps=2", "--trainer.init_from", ""]) == \
        {"trainer": {"max_steps": 2}, "trainer.init_from": None}
    assert job_hyperparameters({}, ["--a", "['x', 'y,z']", "--b", "True", "--c=[1, 2]", "--d", "out,dir"]) == \
        {"a": ["x", "y,z"], "b": True, "c": [1, 2], "d": "out,dir"}
    assert job_hyperparameters({"SM_HPS": '{"sagemaker_program": "e.py", "seed": 1}'}) == {"seed": 1}


@pytest.mark.parametrize("form", ["SM_HPS", "argv"])
def test_strings_with_equals_signs_and_spaces_arrive_as_strings(tmp_path, form):
    """A string hyperparameter holding ``=`` or spaces (``--paths.output_root 'run=a b'``) is that
    string, not a ``k=v`` object, from the argv as from SM_HPS; so are Hydra's own string keys and a
    string key given ``true``; a section key still reads ``k=v,k2=v2`` as the toolkit's object."""
    user = {"paths.output_root": "run=a b", "hydra.run.dir": str(tmp_path / "x=1, y"), "trainer.resume": "true",
            "data": "image_folder", "data.root": "a=b,c=d", "trainer": {"max_steps": 2}}
    env, argv = _toolkit_forms({k: json.dumps(v) for k, v in user.items()}, tmp_path)
    assert "--paths.output_root" in argv and "run=a b" in argv and "max_steps=2" in argv
    if form == "argv":
        env.pop("SM_HPS")
    assert job_hyperparameters(env, argv) == user
    over = sagemaker_overrides(env, argv)
    assert _parsed(next(o for o in over if o.startswith("paths."))) == ("paths.output_root", "run=a b")
    run_dir = next(o for o in over if o.startswith("hydra.run.dir"))
    assert _parsed(run_dir) == ("hydra.run.dir", str(tmp_path / "x=1, y"))
    check_overrides(over)
    cfg = compose_cfg([o for o in over if not o.startswith("hydra.")])
    assert (cfg.paths.output_root, cfg.data.root, cfg.trainer.resume, cfg.trainer.max_steps) == (
        "run=a b", "a=b,c=d", "true", 2)


@pytest.mark.parametrize("text", ["out,dir", "a'b", "x\\", "a\\'b", "true", "1e3", "null", " padded ", "café",
                                  "[1, 2]", "{a: 1}", "a=b", "", "${paths.output_root}/x", "line\nbreak", '"q"'])
def test_any_string_reaches_hydra_intact(text):
    key, value = _parsed(hydra_override("data.cache_dir", text))
    assert (key, value) == ("data.cache_dir", text)


def test_values_are_quoted_only_where_hydra_needs_it():
    assert hydra_override("experiment", "smoke") == "experiment=smoke"  # a group choice stays a choice
    assert hydra_override("hydra.run.dir", "/ckpt/run-1_a.b") == "hydra.run.dir=/ckpt/run-1_a.b"
    assert hydra_override("hydra.run.dir", "/ckpt/a,b") == "hydra.run.dir='/ckpt/a,b'"
    assert hydra_override("trainer.resume", "true") == "trainer.resume='true'"  # a string, not a bool
    assert hydra_override("trainer.init_from", None) == "trainer.init_from=null"
    assert hydra_override("sampler.cfg_interval", [0, 1.0]) == "sampler.cfg_interval=[0,1.0]"
    assert hydra_override("data.files", ["a,b.mp4", "c.mp4"]) == "data.files=['a,b.mp4',c.mp4]"
    assert _parsed(hydra_override("optim.lr", float("inf")))[1] == float("inf")


def test_nested_objects_become_dotted_keys(tmp_path):
    env = {"SAGEMAKER_BASE_DIR": str(tmp_path),
           "SM_HPS": json.dumps({"trainer": {"max_steps": 1, "nested": {"deep": [1]}}, "parallel": {"tp": 2}})}
    assert sagemaker_overrides(env)[:3] == ["trainer.max_steps=1", "trainer.nested.deep=[1]", "parallel.tp=2"]
    with pytest.raises(ValueError, match=r"hyperparameter trainer is an empty object; give its keys"):
        sagemaker_overrides({"SM_HPS": '{"trainer": {}}'})


def test_paths_come_from_the_job_environment(tmp_path):
    """Run dir under the checkpoint LocalPath, TensorBoard under its LocalPath, the rest from SM_*
    variables, defaults under SAGEMAKER_BASE_DIR; nothing under a literal /opt/ml."""
    base = tmp_path / "ml"
    env = {"SAGEMAKER_BASE_DIR": str(base), "SM_HPS": "{}"}
    over = dict(o.split("=", 1) for o in sagemaker_overrides(env))
    assert over == {"hydra.run.dir": f"{base}/checkpoints/run", "trainer.tensorboard_dir": f"{base}/output/tensorboard",
                    "trainer.export_dir": f"{base}/model", "trainer.output_data_dir": f"{base}/output/data",
                    "trainer.progress": "false"}
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "checkpointconfig.json").write_text('{"LocalPath": "/ckpt", "S3Uri": "s3://b/c"}')
    (base / "input" / "config" / "tensorboardoutputconfig.json").write_text('{"LocalPath": "/tb", "S3OutputPath": "x"}')
    env.update(SM_MODEL_DIR="/m", SM_OUTPUT_DATA_DIR="/o/data", SM_OUTPUT_DIR="/o", SM_CHANNEL_TRAIN="/d/train",
               SM_CHANNEL_VALIDATION="/d/val", SM_CHANNEL_OTHER="/d/other")
    paths = job_paths(env)
    assert (paths.checkpoints, paths.tensorboard, paths.output) == ("/ckpt", "/tb", "/o")
    over = sagemaker_overrides({**env, "SM_HPS": '{"data": "image_folder"}'})
    assert over == ["data=image_folder", "hydra.run.dir=/ckpt/run", "trainer.tensorboard_dir=/tb",
                    "trainer.export_dir=/m", "trainer.output_data_dir=/o/data", "trainer.progress=false",
                    "data.root=/d/train", "data.heldout_root=/d/val"]
    # the bundled digits (the default) read no folder: the channels are not turned into data.root
    assert not [o for o in sagemaker_overrides(env) if o.startswith("data.")]
    mine = sagemaker_overrides({**env, "SM_HPS": '{"hydra.run.dir": "/mine", "data": {"root": "/r"}}'})
    assert "hydra.run.dir=/mine" in mine and "data.root=/r" in mine and "hydra.run.dir=/ckpt/run" not in mine
    (base / "input" / "config" / "checkpointconfig.json").write_text("[oops")
    with pytest.raises(ValueError, match="checkpointconfig.json is not a JSON object"):
        job_paths(env)


def test_a_restarted_job_whose_channels_are_mounted_elsewhere_resumes(tmp_path, monkeypatch):
    """The data channels' mount points are the job's: a restarted job (another base dir) fills
    data.root / data.heldout_root with other paths, and the run dir's record is not the job's
    config then in those keys (a relaunch check refused it). A data.root the user gave is compared."""
    from vitp.train.rundir import LAUNCHER_KEYS_ENV, check_relaunch
    from vitp.train.trainer import write_run_config

    def job(base, hps='{"data": "image_folder", "data.num_classes": 1}'):
        env = {"SAGEMAKER_BASE_DIR": str(base), "SM_HPS": hps, "SM_CHANNEL_TRAIN": f"{base}/train",
               "SM_CHANNEL_VALIDATION": f"{base}/val"}
        over = sagemaker_overrides(env)
        return compose_cfg([o for o in over if not o.startswith("hydra.")]), channel_keys(over, env)

    first, keys = job(tmp_path / "job1")
    assert keys == ["data.root", "data.heldout_root"]
    assert job(tmp_path / "job1", '{"data": "image_folder", "data.root": "/r"}')[1] == ["data.heldout_root"]
    assert job(tmp_path / "job1", "{}")[1] == []  # the digits read no folder
    run = tmp_path / "run"
    write_run_config(run, first, None)
    again, _ = job(tmp_path / "job2")
    with pytest.raises(ValueError, match=r"data.heldout_root: .* before vs .*job2/val' now; data.root: "):
        check_relaunch(run, again, run / "checkpoints" / "step_0000004")
    monkeypatch.setenv(LAUNCHER_KEYS_ENV, ",".join(keys))
    check_relaunch(run, again, run / "checkpoints" / "step_0000004")


@pytest.mark.parametrize("hps, message", [
    ('{"trainer": {"max_step": 1}}', r"unknown config key trainer.max_step \(did you mean trainer.max_steps\?\)"),
    ('{"trainer.max_steps": "six"}', r"trainer.max_steps=six; Value 'six' of type 'str' could not be converted to Int"),
    ('{"experiment": "nope"}', r"Could not find 'experiment/nope' Available options in 'experiment': digits_text img1024"),
    ('{"model.mlp": "relu"}', r"Invalid value 'relu', expected one of \[gelu, swiglu\]"),
    ('{"trainer max_steps": 1}', r"hyperparameter 'trainer max_steps' is not a config key Hydra can parse"),
    ('{oops', r"SM_HPS is not valid JSON"),
    ('[1, 2]', r"SM_HPS is a JSON list, not an object of hyperparameters"),
])
def test_bad_hyperparameters_are_clear_errors(tmp_path, hps, message):
    with pytest.raises(ValueError, match=message):
        check_overrides(sagemaker_overrides({"SAGEMAKER_BASE_DIR": str(tmp_path), "SM_HPS": hps}))


def test_bad_argv_is_a_clear_error():
    with pytest.raises(ValueError, match="hyperparameter --seed has no value"):
        job_hyperparameters({}, ["--seed"])
    with pytest.raises(ValueError, match="argument 'stray' is not a --key"):
        job_hyperparameters({}, ["stray"])


def test_failure_reason_names_the_problem_first(tmp_path):
    """vitp-train's one-line errors (a SystemExit raised while handling them) and unexpected errors
    (with their traceback) become the failure file; the first rank to write it keeps it."""
    from vitp.cli import run_cli

    def bad_layout():
        raise ValueError("parallel.tp=3 x parallel.pp=1 does not divide world_size=2; valid (tp, pp): [(1, 1)]")

    with pytest.raises(SystemExit) as info:
        run_cli("vitp-train", bad_layout)
    lines = failure_reason(info.value).splitlines()
    assert lines[0] == "vitp-train: error: parallel.tp=3 x parallel.pp=1 does not divide world_size=2; valid " \
                       "(tp, pp): [(1, 1)]"
    assert re.match(r"\(rank 0 of 1 on .*; the job's log has the details\)", lines[1]) and len(lines) == 2

    try:
        raise RuntimeError("gloo connection closed\nby peer")
    except RuntimeError as e:
        text = failure_reason(e)
    assert text.splitlines()[0] == "RuntimeError: gloo connection closed by peer"
    assert "Traceback (most recent call last)" in text and "test_failure_reason_names_the_problem_first" in text

    assert write_failure(str(tmp_path / "output"), "first\n") is True
    assert write_failure(str(tmp_path / "output"), "second\n") is False
    assert (tmp_path / "output" / "failure").read_text() == "first\n"


def test_entry_script_and_requirements_follow_the_staging_contract():
    """The launcher stages scripts/sagemaker_entry.py, scripts/sagemaker_requirements.txt as
    requirements.txt and the vitp wheel of this version in one folder (no setup.py there)."""
    version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    lines = [x for x in (REPO / "scripts" / "sagemaker_requirements.txt").read_text().splitlines()
             if x and not x.startswith("#")]
    assert lines == ["--find-links .", f"vitp=={version}"]
    assert "from vitp.cli.sagemaker import main" in (REPO / "scripts" / "sagemaker_entry.py").read_text()
