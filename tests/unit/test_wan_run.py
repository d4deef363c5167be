"""A ``model.family=wan`` run config (:mod:`vitp.models.wan_run`) before any process group: its
sizes come from the folder's ``config.json``; a missing or damaged folder, an option vitp's Wan
lacks (image-to-video), an impossible layout, what vitp-train does not do for Wan and bad input
to vitp-sample / vitp-eval are refused, each message naming the key and the fix. Wan's collate gives the pairs of Wan's objective. Tiny folders from
``scripts/make_tiny_wan.py``; no training here (tests/distributed/parallel/test_wan_parallel.py)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import make_tiny_wan
from vitp.config import compose, validate_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny pipeline folder (no VAE)."""
    return make_tiny_wan().write_pipeline(tmp_path_factory.mktemp("wan_run") / "tiny", vae=False)


def _cfg(folder, *extra):
    return compose(["experiment=wan_smoke", f"trainer.init_from={folder}", *extra])


def _config_variant(tiny: Path, tmp: Path, **changes) -> Path:
    """A copy of the tiny pipeline whose transformer config.json has ``changes``."""
    out = shutil.copytree(tiny, tmp / "variant")
    conf = out / "transformer" / "config.json"
    conf.write_text(json.dumps({**json.loads(conf.read_text()), **changes}))
    return out


def test_sizes_come_from_the_folder(tiny):
    cfg = _cfg(tiny)  # the sizes are the folder's (set by hand: refused, test below)
    layout = validate_config(cfg, 1)
    m = cfg.model
    assert (m.width, m.depth, m.num_heads, m.mlp_ratio, m.patch_size, m.tubelet_size) == (32, 2, 2, 2.0, 2, 1)
    assert (m.in_channels, m.text_dim, m.text_len, m.image_size, m.num_frames) == (4, 32, 512, 8, 3)
    assert layout.tp == 1 and cfg.data.latent_channels == 4


def test_transformer_subfolder_and_shift_from_the_pipeline(tiny, tmp_path):
    from vitp.models.wan_run import wan_loss, wan_source

    cfg = _cfg(tiny / "transformer")
    validate_config(cfg, 1)
    path, _ = wan_source(cfg)
    assert path == (tiny / "transformer").resolve() and wan_loss(cfg, path).shift == 3.0  # the scheduler's flow_shift
    assert wan_loss(_cfg(tiny, "objective.shift=5"), path).shift == 5.0
    alone = shutil.copytree(tiny / "transformer", tmp_path / "alone")  # no pipeline, no scheduler
    with pytest.raises(ValueError, match=r"no pipeline scheduler/scheduler_config.json .*set objective.shift"):
        validate_config(_cfg(alone), 1)
    validate_config(_cfg(alone, "objective.shift=3"), 1)


@pytest.mark.parametrize("init, error, match", [
    (None, ValueError, r"model.family=wan needs trainer.init_from=FOLDER.*make_tiny_wan"),
    ("/nonexistent/wan", FileNotFoundError, r"trainer.init_from=/nonexistent/wan: Wan folder .* does not exist.*"
                                            r"vitp never downloads \(a run whose base folder moved: add "
                                            r"trainer.init_from=NEW_PLACE to vitp-train --resume RUN, and for a "
                                            r"LoRA run to vitp-sample RUN or vitp-eval RUN\)"),
])
def test_missing_folder_is_refused(init, error, match):
    over = [] if init is None else [f"trainer.init_from={init}"]
    with pytest.raises(error, match=match):
        validate_config(compose(["experiment=wan_smoke", *over]), 1)


@pytest.mark.parametrize("changes, match", [
    ({"added_kv_proj_dim": 64}, r"added_kv_proj_dim=64 \(image key/value projections of image-to-video Wan\) is not "
                                r"implemented"),
    ({"image_dim": 1280}, r"image_dim=1280 is an image-to-video Wan"),
    ({"qk_norm": "rms_norm"}, r"qk_norm='rms_norm'"),
])
def test_unsupported_options_are_refused(tiny, tmp_path, changes, match):
    with pytest.raises(ValueError, match=r"trainer.init_from=.*" + match):
        validate_config(_cfg(_config_variant(tiny, tmp_path, **changes)), 1)


def test_a_pipeline_without_its_transformer_config_is_named(tiny, tmp_path):
    folder = shutil.copytree(tiny, tmp_path / "noconf")
    (folder / "transformer" / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"transformer/config.json does not exist: the pipeline folder .* has "
                                                r"a transformer/ folder without its config.json; copy the whole"):
        validate_config(_cfg(folder), 1)
    shutil.rmtree(folder / "transformer")
    with pytest.raises(FileNotFoundError, match=r"the pipeline folder .* has no transformer/ folder; copy the whole"):
        validate_config(_cfg(folder), 1)


def test_a_run_folder_whose_base_moved_names_the_dangling_link(tiny, tmp_path):
    """A run's diffusers folder links the base's components; the base moved, the link is named (not
    a missing scheduler_config.json with a fix that vitp-sample refuses)."""
    base = shutil.copytree(tiny, tmp_path / "base")
    run = tmp_path / "run_diffusers"
    shutil.copytree(base / "transformer", run / "transformer")
    shutil.copy(base / "model_index.json", run / "model_index.json")
    (run / "scheduler").symlink_to(base / "scheduler")
    validate_config(_cfg(run), 1)
    base.rename(tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match=r"run_diffusers/scheduler links to .*base/scheduler, which does not "
                                                r"exist \(the base pipeline folder moved or was deleted\); .*ln -sfn"):
        validate_config(_cfg(run), 1)


def test_corrupt_config_is_refused(tiny, tmp_path):
    folder = shutil.copytree(tiny, tmp_path / "bad")
    (folder / "transformer" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"trainer.init_from=.*config.json is not valid JSON .*copy the folder again"):
        validate_config(_cfg(folder), 1)


@pytest.mark.parametrize("extra, match", [
    (["trainer.compile=blocks"], r"trainer.compile=blocks .*set trainer.compile=off"),
    (["model.attn_drop=0.1"], r"model.attn_drop=0.1: Wan has no dropout"),
    (["parallel.partial_sync=0.5"], r"parallel.partial_sync=0.5: .*set parallel.partial_sync=1"),
    # the tiny folder has no vae/: FID / FVD / CLIP score read decoded pixels (vitp.eval.wan_eval)
    (["eval.fid.num=100"], r"eval.fid.num=100 on a Wan run scores decoded pixels, but the pipeline .* has no vae/; "
                           r"give a pipeline folder with its vae/ .*or set eval.fid.num=0"),
    (["eval.fvd.num=100"], r"eval.fvd.num=100 on a Wan run .* has no vae/.*set eval.fvd.num=0"),
])
def test_what_vitp_train_does_not_do_for_wan_is_refused(tiny, extra, match):
    with pytest.raises(ValueError, match=match):
        validate_config(_cfg(tiny, *extra), 1)


def test_impossible_layouts_name_the_folder_sizes(tiny):
    with pytest.raises(ValueError, match=r"parallel.tp=4 does not divide num_attention_heads=2 of the Wan folder "
                                         r"trainer.init_from=.*; valid tp degrees for this model: \[1, 2\]"):
        validate_config(_cfg(tiny, "parallel.tp=4"), 4)
    with pytest.raises(ValueError, match=r"parallel.tp=3 does not divide num_attention_heads=2"):  # not "torchrun 3"
        validate_config(_cfg(tiny, "parallel.tp=3"), 1)
    with pytest.raises(ValueError, match=r"cp_mode=ulysses splits model.num_heads=2 over tp x cp = 4 ranks.*"
                                         r"parallel.cp_mode=ring"):
        validate_config(_cfg(tiny, "parallel.tp=2", "parallel.cp=2"), 4)
    with pytest.raises(ValueError, match=r"num_layers=2 of the Wan folder trainer.init_from=.* < parallel.pp=4: .*"
                                         r"use parallel.pp <= 2"):
        validate_config(_cfg(tiny, "parallel.pp=4"), 4)
    assert validate_config(_cfg(tiny, "parallel.tp=2", "parallel.cp=2", "parallel.cp_mode=ring",
                                "parallel.pp=2"), 8).dp == 1


@pytest.mark.parametrize("key, match", [
    ("model.depth=7", r"model.depth=7: a Wan model's sizes come from its folder's config.json \(num_layers: "
                      r"model.depth=2 for trainer.init_from=.*\); drop model.depth"),
    ("model.num_heads=8", r"model.num_heads=8: .*num_attention_heads: model.num_heads=2"),
    ("model.text_len=256", r"model.text_len=256: .*model.text_len=512"),
    ("model.patch_size=4", r"model.patch_size=4: .*model.patch_size=2"),
    ("model.mlp=swiglu", r"model.mlp=swiglu: .*a GELU FFN: model.mlp=gelu"),
])
def test_model_sizes_set_by_hand_are_refused_not_overwritten(tiny, key, match):
    """A size set on the command line would be replaced by the folder's silently; the folder's own
    values (a resumed run's recorded config) are accepted."""
    with pytest.raises(ValueError, match=match):
        validate_config(_cfg(tiny, key), 1)
    assert validate_config(_cfg(tiny, "model.depth=2", "model.text_len=512"), 1).dp == 1


def test_a_damaged_vae_is_refused_before_training(tmp_path):
    """The VAE decodes the first sample grid; damaged, it failed there, after the steps before it."""
    folder = make_tiny_wan().write_pipeline(tmp_path / "pipe")
    vae = folder / "vae" / "diffusion_pytorch_model.safetensors"
    data = vae.read_bytes()
    validate_config(_cfg(folder), 1)
    vae.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"vae/diffusion_pytorch_model.safetensors is not a readable safetensors file "
                                         r"\(.*\): it is empty, truncated or damaged .*copy the pipeline's vae/ again"):
        validate_config(_cfg(folder), 1)
    vae.unlink()
    with pytest.raises(FileNotFoundError, match=r"vae/diffusion_pytorch_model.safetensors does not exist"):
        validate_config(_cfg(folder), 1)
    (folder / "vae" / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"vae/config.json holds a JSON list, not an object .*VAE options"):
        validate_config(_cfg(folder), 1)


def test_a_listed_vae_without_its_folder_is_refused_as_a_missing_transformer_2_is(tmp_path, capsys):
    """A user's trial: a pipeline whose model_index.json lists vae without its vae/ trained with no
    word (evaluation in latent space), and its RUN/diffusers listed a VAE WanPipeline could not
    load. Refused now, from the pipeline or its transformer folder; ``"vae": [null, null]`` trains."""
    from vitp.cli.sample import main

    folder = make_tiny_wan().write_pipeline(tmp_path / "pipe")
    shutil.rmtree(folder / "vae")
    want = (rf"{folder / 'vae' / 'config.json'} does not exist, but {folder / 'model_index.json'} lists vae .*copy "
            r"the pipeline's vae/ again, or set \"vae\": \[null, null\] in it")
    for init in (folder, folder / "transformer"):
        with pytest.raises(FileNotFoundError, match=want):
            validate_config(_cfg(init), 1)
    with pytest.raises(SystemExit) as e:
        main([str(folder), "--prompt", "x", "--out", str(tmp_path / "out")])
    assert e.value.code == 2 and "lists vae" in capsys.readouterr().err and not (tmp_path / "out").exists()
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, "vae": [None, None]}))
    validate_config(_cfg(folder), 1)


def test_channels_of_other_data_are_refused(tiny):
    with pytest.raises(ValueError, match=r"the data give 16 input channels .* takes in_channels=4"):
        validate_config(_cfg(tiny, "data=shards", "data.shards=/x", "data.latent_channels=16"), 1)
    # set by hand, model.in_channels is named, not the data keys the user did not touch
    with pytest.raises(ValueError, match=r"model.in_channels=8: a Wan model takes its folder's in_channels=4 .*"
                                         r"drop model.in_channels"):
        validate_config(_cfg(tiny, "model.in_channels=8"), 1)


def test_grids_and_evaluation_are_accepted_and_a_lone_transformer_warns(tiny, tmp_path, caplog):
    """Sample grids and the held-out evaluation run for Wan (vitp.eval.wan_eval); a transformer
    folder without its pipeline trains without grids, saying so once at the check."""
    import logging

    validate_config(_cfg(tiny, "trainer.sample_every=2", "trainer.eval_every=2", "eval.enabled=true"), 1)
    alone = shutil.copytree(tiny / "transformer", tmp_path / "alone")
    with caplog.at_level(logging.WARNING, logger="vitp"):
        validate_config(_cfg(alone, "objective.shift=3"), 1)
    assert "has no pipeline scheduler/: no sample grids and no sampled video statistics" in caplog.text
    with pytest.raises(ValueError, match=r"eval.fid.num=8 on a Wan run scores decoded pixels, but trainer.init_from="
                                         r".*alone is a transformer folder without its pipeline .*set eval.fid.num=0"):
        validate_config(_cfg(alone, "objective.shift=3", "eval.fid.num=8"), 1)


NO_CHECKPOINT = ("it has no checkpoint yet ({run}/checkpoints/latest is missing), so vitp-export has nothing to "
                 "write: let it train to its first checkpoint (trainer.checkpoint_every=3), or resume it with "
                 "vitp-train --resume {run}; then vitp-export {run} --format diffusers{merge} -o OUT, and {then}")


def _unfinished_run(tiny, tmp_path, *extra):
    """A Wan run folder with its recorded config (``trainer.checkpoint_every=3``) and no checkpoint."""
    from omegaconf import OmegaConf

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(_cfg(tiny, "trainer.checkpoint_every=3", *extra)))
    return run


def _checkpointed(run):
    """``run`` with a ``checkpoints/latest`` (what the advice looks at; the checkpoint is not read)."""
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "latest").write_text("step_0000003")
    return run


def test_vitp_eval_refuses_bad_wan_input_naming_the_fix(tiny, tmp_path, capsys):
    """``vitp-eval`` of a Wan run without its final diffusers folder names ``vitp-export`` of its
    latest checkpoint, or, without a checkpoint yet (vitp-export would refuse it), how to get one;
    a weights file instead of a folder names the folder to give."""
    from vitp.cli.eval import main

    run = _unfinished_run(tiny, tmp_path)
    (run / "ema.safetensors").write_bytes(b"x")
    lora = _unfinished_run(tiny, tmp_path / "lora", "trainer.lora.enabled=true")
    later = _checkpointed(_unfinished_run(tiny, tmp_path / "later"))
    then = f"vitp-eval {run} --weights OUT"
    for argv, message in [
            ([str(run)], f"{run / 'diffusers'} holds no diffusers Wan weights (config.json): a run that has not "
                         "finished has none; " + NO_CHECKPOINT.format(run=run, merge="", then=then)),
            ([str(lora)], f"{lora} is a LoRA run without its final adapters {lora / 'lora'} (the run has not "
                          "finished): " + NO_CHECKPOINT.format(run=lora, merge=" --merge",
                                                               then=f"vitp-eval {lora} --weights OUT")),
            ([str(later)], f"a run that has not finished has none; write one from its latest checkpoint with "
                           f"vitp-export {later} --format diffusers -o OUT, then vitp-eval {later} --weights OUT"),
            ([str(run), "--weights", "ema.safetensors"], "--weights ema.safetensors: a Wan run is "
                                                               "evaluated from a diffusers folder, not a file"),
            # a full fine-tune is scored from its own weights: the key was overwritten silently
            ([str(run), f"trainer.init_from={tiny}"], f"trainer.init_from: vitp-eval does not read it here, it "
                                                      f"scores {run}'s own weights"),
            ([str(lora), f"trainer.init_from={tiny}"], f"{lora} is a LoRA run without its final adapters"),  # its base
            ([str(lora), "--weights", str(tiny), f"trainer.init_from={tiny}"], "vitp-eval does not read it here")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, err


def test_vitp_eval_refuses_weights_of_another_model(tiny, tmp_path, capsys):
    """``vitp-eval RUN --weights FOLDER`` of a Wan model of other sizes is refused naming them (its
    scores would be filed as the run's)."""
    from omegaconf import OmegaConf

    from vitp.cli.eval import main

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    cfg = _cfg(tiny)
    validate_config(cfg, 1)  # the recorded config holds the folder's sizes
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    script = make_tiny_wan()
    other = script.write_pipeline(tmp_path / "deeper", vae=False, transformer=script.tiny_transformer(num_layers=3))
    with pytest.raises(SystemExit) as e:
        main([str(run), "--weights", str(other)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and (f"--weights {other} holds a Wan model of other sizes than this run's (num_layers 3 "
                                  f"vs the run's 2); vitp-eval {run} scores weights of the run's model") in err, err


def test_vitp_export_of_a_run_without_a_checkpoint_says_so(tiny, tmp_path, capsys):
    """The command the advice above gives for a run with no checkpoint yet failed as "holds no vitp
    checkpoint (expected a run directory ...)" of a run directory; now it says what is missing."""
    from vitp.cli.export import main

    run = _unfinished_run(tiny, tmp_path)
    with pytest.raises(SystemExit) as e:
        main([str(run), "--format", "diffusers", "-o", str(tmp_path / "out")])
    assert e.value.code == 2 and capsys.readouterr().err == (
        f"vitp-export: error: {run} is a run with no checkpoint yet (no {run / 'checkpoints' / 'latest'}): let it "
        f"train to its first checkpoint (trainer.checkpoint_every) or its end, or resume it with vitp-train --resume "
        f"{run}\n")
    assert not (tmp_path / "out").exists()


def test_vitp_sample_refuses_bad_wan_input_naming_the_fix(tiny, tmp_path, capsys):
    """``vitp-sample`` of a Wan run (vitp.eval.wan_sample): an unfinished run (no RUN/diffusers),
    class labels, a transformer folder without its pipeline, --scheduler on another run."""
    from vitp.cli.sample import main

    run = _unfinished_run(tiny, tmp_path)
    copy = _checkpointed(_unfinished_run(tiny, tmp_path / "copy"))
    lora = _checkpointed(_unfinished_run(tiny, tmp_path / "lora", "trainer.lora.enabled=true"))
    for argv, message in [
            ([str(lora), "--prompt", "x"], f"{lora} is a LoRA run without its final adapters {lora / 'lora'} (the "
                                           "run has not finished): write the base with its adapters merged from its "
                                           f"latest checkpoint with vitp-export {lora} --format diffusers --merge -o "
                                           f"OUT, then vitp-sample OUT"),
            ([str(run), "--prompt", "x"], f"has no final diffusers folder {run / 'diffusers'} (the run has not "
                                          "finished): " + NO_CHECKPOINT.format(run=run, merge="",
                                                                               then="vitp-sample OUT --prompt ...")),
            ([str(copy), "--prompt", "x"], f"(the run has not finished): write one from its latest checkpoint with "
                                           f"vitp-export {copy} --format diffusers -o OUT, then vitp-sample OUT"),
            ([str(tiny), "--classes", "1"], "this model is text-conditional: give --prompt"),
            ([str(shutil.copytree(tiny / "transformer", tmp_path / "alone")), "--prompt", "x"],
             "has no pipeline scheduler/scheduler_config.json to take the flow shift from"),
            ([str(tiny), "--prompt", "x", "--flow-shift", "0"], "--flow-shift 0.0: use a positive shift"),
            ([str(tmp_path), "--scheduler", "euler"], "--scheduler and --flow-shift are for Wan runs")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, err
    # a finished run on a read-only mount (root ignores modes: os.access is patched): refused before sampling
    import os

    shutil.copytree(tiny, copy / "diffusers")
    access = os.access
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("os.access", lambda p, mode: copy not in (Path(p), *Path(p).parents) and access(p, mode))
        mp.setattr("vitp.eval.wan_sample.pipeline_of", lambda cfg: pytest.fail("went on to sample"))
        with pytest.raises(SystemExit) as e:
            main([str(copy), "--prompt", "x"])
    assert e.value.code == 2 and capsys.readouterr().err == (
        f"vitp-sample: error: {copy} is not writable by this user: vitp-sample writes into {copy} by default; give "
        "--out PATH outside it, or vitp-sample a copy of that folder\n")


def test_vitp_sample_of_wan_refuses_an_out_among_model_files_a_file_name_or_a_foreign_folder(tiny, tmp_path, capsys,
                                                                                               monkeypatch):
    """A user's trial: ``vitp-sample RUN --out RUN/diffusers`` wrote grid.gif, latents.safetensors and
    prompts.txt into the run's model folder (``--out W/transformer --force``: into a weights folder),
    and ``--out x/out.gif`` made a folder named out.gif. Refused before sampling now (the model
    folders even with --force, naming the default output); a folder holding other files needs --force."""
    from vitp.cli.sample import main

    run = _unfinished_run(tiny, tmp_path)
    shutil.copytree(tiny, run / "diffusers")
    weights = shutil.copytree(tiny, tmp_path / "weights")
    default = f"e.g. {run / 'samples'}/sample_wan_p1-"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with monkeypatch.context() as mp:
        mp.setattr("vitp.eval.wan_sample.wan_denoisers", lambda *a: pytest.fail("went on to sample"))
        for out, force, message in [
                (run / "diffusers", True, f"--out {run / 'diffusers'} is the run's {run / 'diffusers'}: vitp-sample "
                                          f"would write among the run's files, --force or not; give --out a new name, "
                                          + default),
                (run, True, f"--out {run} is the run folder: vitp-sample would write among the run's files"),
                (weights / "transformer", True, f"--out {weights / 'transformer'} is the model folder "
                                                f"{weights / 'transformer'}: vitp-sample would write among its weights"),
                (weights / "new", True, f"lies inside the model folder {weights}: vitp-sample would write among its "
                                        "weights"),
                (tmp_path / "x" / "out.gif", False, f"--out {tmp_path / 'x' / 'out.gif'}: a Wan sample is a folder "
                                                    "(latents.safetensors, grid.gif, prompts.txt), not a .gif file; "
                                                    f"give --out a folder name, e.g. {tmp_path / 'x' / 'out'}"),
                (tmp_path / "other", False, f"{tmp_path / 'other'} exists and holds other files than a vitp-sample "
                                            "output; choose another --out, or pass --force to write into it")]:
            with pytest.raises(SystemExit) as e:
                main([str(run), "--prompt", "x", "--out", str(out), *(["--force"] if force else [])])
            err = capsys.readouterr().err
            assert e.value.code == 2 and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists() and sorted(p.name for p in (run / "diffusers").iterdir()) == sorted(
        p.name for p in tiny.iterdir())
    main([str(run), "--prompt", "x", "--num", "1", "sampler.steps=1", "--out", str(tmp_path / "other"), "--force"])
    assert (tmp_path / "other" / "latents.safetensors").is_file() and (tmp_path / "other" / "notes.txt").is_file()


def test_a_wan_runs_checkpoint_given_to_vitp_sample_or_eval_names_the_export(tiny, tmp_path, capsys):
    """A user's trial: ``vitp-sample RUN/checkpoints/step_N`` of a Wan run built vitp's own generator
    and failed in ``load_state_dict`` (missing keys, size mismatches); ``vitp-eval`` of it failed
    on a missing ``.hydra/config.yaml``. Both now name the ``vitp-export`` that writes the
    checkpoint as a diffusers folder (``--merge`` for a LoRA run's adapters), then the command."""
    from vitp.cli.eval import main as eval_main
    from vitp.cli.sample import main as sample_main

    full = _checkpointed(_unfinished_run(tiny, tmp_path / "full"))
    lora = _checkpointed(_unfinished_run(tiny, tmp_path / "lora", "trainer.lora.enabled=true"))
    for run, merge, final in ((full, "", "weights"), (lora, " --merge", "adapters")):
        tag = run / "checkpoints" / "step_0000003"
        tag.mkdir()
        for main, prog, source in ((sample_main, "vitp-sample", tag), (sample_main, "vitp-sample", tag.parent),
                                   (eval_main, "vitp-eval", tag)):
            with pytest.raises(SystemExit) as e:
                main([str(source), *(["--prompt", "x"] if prog == "vitp-sample" else [])])
            err = capsys.readouterr().err
            export = f"vitp-export {source} --format diffusers{merge} -o OUT, then"
            want = (f"{source} is a checkpoint of the Wan run {run}: vitp-sample reads diffusers folders; write one "
                    f"with {export} vitp-sample OUT (the run's final {final}: vitp-sample {run})"
                    if prog == "vitp-sample" else
                    f"{source} is a checkpoint of the run {run}: vitp-eval takes the run directory; write this "
                    f"checkpoint as a diffusers folder with {export} vitp-eval {run} --weights OUT")
            assert e.value.code == 2 and want in err, err


def test_a_wan_runs_checkpoint_as_vitp_eval_weights_names_the_final_folder_and_the_export(tiny, tmp_path, capsys):
    """A user's trial: ``vitp-eval RUN --weights RUN/checkpoints/step_N`` of a finished Wan run said
    ``step_N/model_ema.safetensors holds no diffusers Wan weights``: a file that does not exist, a
    run called unfinished, and for a LoRA run an export vitp-export refuses (it needs ``--merge``)."""
    from vitp.cli.eval import main

    full = _checkpointed(_unfinished_run(tiny, tmp_path / "full"))
    (full / "diffusers" / "transformer").mkdir(parents=True)  # finished: its trained transformer folder
    shutil.copy(tiny / "transformer" / "config.json", full / "diffusers" / "transformer")
    lora = _checkpointed(_unfinished_run(tiny, tmp_path / "lora", "trainer.lora.enabled=true"))
    (lora / "lora").mkdir()
    bare = _checkpointed(_unfinished_run(tiny, tmp_path / "bare"))  # no final weights yet
    for run, final in ((full, f"vitp-eval {full} --weights {full / 'diffusers' / 'transformer'} (its final EMA "
                              "weights), or "),
                       (lora, f"vitp-eval {lora} (no --weights: the base with its final adapters), or "),
                       (bare, "")):
        tag = run / "checkpoints" / "step_0000003"
        tag.mkdir()
        (tag / "vitp_meta.json").write_text("{}")
        merge = " --merge" if run == lora else ""
        for given, path in (("checkpoints/step_0000003", tag), (str(tag), tag)):
            with pytest.raises(SystemExit) as e:
                main([str(run), "--weights", given])
            err = capsys.readouterr().err
            want = (f"--weights {given} is a checkpoint of the Wan run {run}, and a Wan run's --weights is a "
                    f"diffusers transformer folder: " + (f"evaluate the finished run with {final}" if final else "")
                    + f"write this checkpoint as one with vitp-export {path} --format diffusers{merge} -o OUT, "
                    f"then vitp-eval {run} --weights OUT")
            assert e.value.code == 2 and want in err and "model_ema" not in err, err
        (run / "other").mkdir()  # another folder without a config.json: the run is not called unfinished
        with pytest.raises(SystemExit):
            main([str(run), "--weights", "other"])
        err = capsys.readouterr().err
        assert (f"{run / 'other'} holds no diffusers Wan weights (config.json): a Wan run's --weights is a diffusers "
                f"transformer folder; write {'the base with its adapters merged' if merge else 'one'} from its "
                f"latest checkpoint with vitp-export {run} --format diffusers{merge} -o OUT") in err, err


@pytest.mark.parametrize("lora", [False, True])
def test_resuming_a_wan_run_with_another_model_names_the_diffusers_export(tiny, tmp_path, lora):
    """A user's trial: ``vitp-train --resume WANRUN trainer.init_from=OTHER`` was told to export with
    ``--weights raw`` (refused by vitp-export for a Wan run) and start from ``<export>.safetensors``
    (a Wan run starts from a diffusers folder); now the export that works (``--merge`` for LoRA)."""
    from vitp.checkpoint import check_resumable
    from vitp.config import Layout

    cfg = _cfg(tiny, *(["trainer.lora.enabled=true"] if lora else []))
    validate_config(cfg, 1)
    layout = Layout(1, 1, 1, "fp32")
    meta = {"tp": 1, "pp": 1, "dp": 1, "precision": "fp32", "zero_stage": cfg.parallel.zero_stage,
            "engine_zero_stage": layout.engine_zero_stage(cfg.parallel.zero_stage), "engine": {},
            "model": {**dict(cfg.model), "depth": cfg.model.depth + 1}, "lora": {"base": {}} if lora else None}
    tag = tmp_path / "checkpoints" / "step_0000004"
    with pytest.raises(ValueError) as e:
        check_resumable(meta, tag, cfg, layout)
    merge = " --merge" if lora else ""
    assert (f"export the weights (vitp-export {tag} --format diffusers{merge} --weights raw -o OUT) and start a new "
            "run dir with trainer.init_from=OUT (weights only") in str(e.value), str(e.value)
    assert ".safetensors" not in str(e.value)


def test_wan_collate_gives_wan_pairs_padded_to_512_tokens():
    from vitp.data.loader import WanCollate
    from vitp.objectives.wan_flow import WanFlowLoss

    class Cond:  # two captions: id 0 the empty caption (1 token), id 1 three tokens
        null_id = 0
        emb = torch.randn(2, 6, 8)

        def __call__(self, ids):
            return self.emb[ids], torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]])[ids]

    loss = WanFlowLoss(3.0)
    items = [(torch.rand(4, 3, 8, 8), 1, seed) for seed in range(6)]
    (x_t, timestep, text), (x, eps, s) = WanCollate(loss, Cond(), label_drop=0.5)(items)
    again = WanCollate(loss, Cond(), label_drop=0.5)(items[2:3])  # each sample's draw is its own
    torch.testing.assert_close(again[1][1][0], eps[2], rtol=0, atol=0)
    ss = s.view(-1, 1, 1, 1, 1)
    torch.testing.assert_close(x_t, (1 - ss) * x + ss * eps)
    torch.testing.assert_close(timestep, 1000 * s)
    assert text.shape == (6, 512, 8) and (text[:, 3:] == 0).all()
    kept = [i for i in range(6) if (text[i, 1:3] != 0).any()]  # caption kept: 3 tokens; dropped: the empty one
    assert 0 < len(kept) < 6  # label_drop=0.5 drops some of six
    for i in range(6):
        want = Cond.emb[1, :3] if i in kept else torch.cat([Cond.emb[0, :1], torch.zeros(2, 8)])
        torch.testing.assert_close(text[i, :3], want)


def test_wan_objective_keys_are_named_when_they_have_no_effect(tiny):
    from vitp.models.wan_run import unused_wan_keys

    assert unused_wan_keys(compose(["experiment=smoke", "objective.shift=3", "objective.sigma_range=[0,0.5]"])) == [
        "objective.shift", "objective.sigma_range"]
    assert unused_wan_keys(compose(["experiment=smoke"])) == []
    assert unused_wan_keys(_cfg(tiny, "objective.shift=3")) == []


def test_the_pipeline_around_a_trained_transformer_links_only_its_components(tiny, tmp_path):
    """``RUN/diffusers`` and ``vitp-export --format diffusers`` link the components
    ``model_index.json`` names (vae, scheduler, ...), not other folders of the source: a
    ``samples/`` folder linked there would let a later ``vitp-sample`` of the export write into
    the source model's folder."""
    from vitp.train.wan import link_pipeline

    src = tmp_path / "src"
    shutil.copytree(tiny, src, symlinks=True)
    (src / "samples" / "old").mkdir(parents=True)
    out = tmp_path / "out"
    link_pipeline(out, src / "transformer")
    index = json.loads((src / "model_index.json").read_text())
    named = {k for k, v in index.items() if not k.startswith("_") and isinstance(v, list)}
    linked = {p.name for p in out.iterdir() if p.is_symlink()}
    assert linked == {p.name for p in src.iterdir() if p.is_dir() and p.name in named} - {"transformer"}
    assert "scheduler" in linked and not (out / "samples").exists()
    assert (out / "scheduler").resolve() == (src / "scheduler").resolve()


def test_two_models_transformer_folders_sampled_directly_get_their_own_output_folders(tiny, tmp_path):
    """A user's trial: ``vitp-sample /tmp/a/transformer`` and ``/tmp/b/transformer`` (two models)
    both wrote to ``./outputs/transformer/samples``, the second refused for the first's sample
    (``--force`` would have overwritten it). Each folder now has its own: parent name, name, hash."""
    from vitp.cli.sample import SAMPLE_KEYS
    from vitp.eval.wan_sample import wan_sample_config

    folders = [shutil.copytree(tiny, tmp_path / name / "pipe") for name in ("a", "b")]
    bases = [wan_sample_config(f / "transformer", [], 1, SAMPLE_KEYS)[2] for f in folders]
    assert bases[0] != bases[1] and all(b.parent == Path("outputs") for b in bases), bases
    assert all(re.fullmatch(r"pipe-transformer-[0-9a-f]{8}", b.name) for b in bases), bases
    pipes = [wan_sample_config(f, [], 1, SAMPLE_KEYS)[2] for f in folders]  # same name, other places
    assert pipes[0] != pipes[1] and all(re.fullmatch(r"pipe-[0-9a-f]{8}", b.name) for b in pipes), pipes


# ------------------------------------------------------------------------------ Wan 2.2 A14B's experts
@pytest.fixture(scope="module")
def a14b(tmp_path_factory):
    """The tiny two-expert pipeline folder (Wan 2.2 A14B's layout, boundary_ratio 0.8, no VAE)."""
    return make_tiny_wan().write_pipeline(tmp_path_factory.mktemp("wan_a14b") / "a14b", vae=False, two_experts=True)


@pytest.mark.parametrize("init, extra, path, sigma_range", [
    ("", [], "transformer", [0.8, 1.0]),  # a pipeline folder: its transformer/, the high-noise expert
    ("", ["model.expert=low"], "transformer_2", [0.0, 0.8]),
    ("/transformer_2", [], "transformer_2", [0.0, 0.8]),  # the folder names the expert
    ("/transformer", ["model.expert=high", "objective.sigma_range=[0.9,0.95]"], "transformer", [0.9, 0.95]),
])
def test_an_expert_trains_on_its_own_noise_range(a14b, init, extra, path, sigma_range):
    from vitp.models.wan_run import wan_expert, wan_loss, wan_source

    cfg = _cfg(f"{a14b}{init}", *extra)
    validate_config(cfg, 1)
    source, _ = wan_source(cfg)
    assert source == (a14b / path).resolve() and list(cfg.objective.sigma_range) == sigma_range
    assert wan_expert(cfg, source) == ("low" if path == "transformer_2" else "high", 0.8)
    s = wan_loss(cfg, source).draw_sigmas(4096, torch.Generator().manual_seed(0))
    assert sigma_range[0] <= s.min() and s.max() <= sigma_range[1]  # t = 1000 s on the expert's side of 800
    assert s.max() - s.min() > 0.9 * (sigma_range[1] - sigma_range[0])


def test_the_expert_trained_by_default_is_said_at_start_up(a14b, tiny, caplog):
    """A user's trial: an A14B pipeline folder without ``model.expert`` trained the high-noise expert
    (sigma_range [0.8, 1]) silently; one INFO line now says so and names the key for the other,
    unless the user chose (``model.expert``, or the expert's own folder)."""
    import logging

    from vitp.train.trainer import log_defaults

    for init, extra, said in [(str(a14b), [], True), (str(a14b), ["model.expert=high"], False),
                              (str(a14b), ["model.expert=low"], False), (f"{a14b}/transformer", [], False),
                              (str(tiny), [], False)]:
        cfg = _cfg(init, *extra)
        validate_config(cfg, 1)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="vitp"):
            log_defaults(cfg)
        want = (f"trainer.init_from={a14b} is Wan 2.2 A14B's two-expert pipeline: training its high-noise expert "
                "transformer/ (noise levels [0.8, 1.0]), the default; set model.expert=low to train transformer_2/ "
                "instead")
        assert [r.getMessage() for r in caplog.records] == ([want] if said else []), (init, extra, caplog.text)


def test_expert_mistakes_are_refused_naming_the_fix(a14b, tiny):
    for init, extra, message in [
            (f"{a14b}/transformer", ["model.expert=low"],
             f"model.expert=low (transformer_2/) but trainer.init_from={a14b}/transformer is the high-noise expert "
             f"transformer/: give trainer.init_from={a14b} (the pipeline folder) with model.expert=low"),
            (str(a14b), ["model.expert=low", "objective.sigma_range=[0.5,0.9]"],
             "objective.sigma_range=[0.5, 0.9] reaches outside the low-noise expert's noise levels [0.0, 0.8] "
             "(boundary_ratio 0.8: WanPipeline runs transformer_2/ only there)"),
            (str(tiny), ["model.expert=high"],
             "model.expert=high: the folder is not one of Wan 2.2 A14B's two experts"),
            (f"{tiny}/transformer", ["model.expert=low"],
             "model.expert=low: the folder is not one of Wan 2.2 A14B's two experts")]:
        with pytest.raises(ValueError) as e:
            validate_config(_cfg(init, *extra), 1)
        assert message in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="model.expert=low names a Wan config: set model=wan"):
        validate_config(compose(["experiment=smoke", "model.expert=low"]), 1)


def test_vitp_sample_refuses_wan22_mistakes_naming_the_fix(a14b, tiny, tmp_path, capsys):
    """Guidance for a second expert the folder lacks, an image-to-video pipeline, a run whose
    fine-tuned expert is missing from (or only linked into) its RUN/diffusers."""
    from omegaconf import OmegaConf

    from vitp.cli.sample import main

    i2v = shutil.copytree(tiny, tmp_path / "i2v")
    index = json.loads((i2v / "model_index.json").read_text())
    (i2v / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanImageToVideoPipeline"}))
    run = tmp_path / "run"  # a "finished" run of the low-noise expert whose RUN/diffusers links it from the source
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(_cfg(a14b, "model.expert=low")))
    (run / "diffusers").mkdir()
    for part in ("model_index.json", "scheduler", "transformer", "transformer_2"):
        (run / "diffusers" / part).symlink_to(a14b / part)
    for argv, message in [
            ([str(tiny), "--prompt", "x", "sampler.cfg_scale_2=2"],
             "sampler.cfg_scale_2=2.0 is the guidance of Wan 2.2 A14B's low-noise expert, but"),
            ([str(i2v), "--prompt", "x"], "WanImageToVideoPipeline conditions on an image or video (the "
                                          "image-conditioned first frame of Wan 2.2 TI2V / I2V), which vitp does not "
                                          "support"),
            ([str(run), "--prompt", "x"], f"{run / 'diffusers' / 'transformer_2'} is a link to the source's "
                                          "transformer_2/, not the run's fine-tuned expert")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err, err


def test_vitp_sample_of_a_lora_run_on_one_a14b_expert_adapts_that_expert_alone(a14b, tmp_path, monkeypatch):
    """A LoRA run of Wan 2.2 A14B's low-noise expert (``model.expert=low``): ``vitp-sample RUN``
    samples the base pipeline with ``RUN/lora`` merged into ``transformer_2`` alone, the samples of
    its ``vitp-export --format diffusers --merge`` folder (bit for bit) and not the base's."""
    from safetensors.torch import load_file

    from vitp.cli.export import run as export
    from vitp.cli.sample import run as sample
    from vitp.cli.train import main as train

    run = tmp_path / "lora"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["vitp-train", "experiment=wan_smoke", f"trainer.init_from={a14b}", "model.expert=low",
                                     "trainer.max_steps=1", "trainer.lora.enabled=true", "trainer.lora.b_init_std=0.05",
                                     "eval.enabled=false", f"hydra.run.dir={run}"])
    train()
    merged = export([str(run), "--format", "diffusers", "--merge", "-o", str(tmp_path / "merged")])
    assert merged.name == "transformer_2" and (tmp_path / "merged" / "transformer").is_symlink()
    latents = {}
    for name, source in (("lora", run), ("merged", tmp_path / "merged"), ("base", a14b)):
        sample([str(source), "--prompt", "a cat", "--num", "1", "sampler.steps=2", "--out", str(tmp_path / "s" / name)])
        latents[name] = load_file(str(tmp_path / "s" / name / "latents.safetensors"))["latents"]
    assert torch.equal(latents["lora"], latents["merged"])
    assert float((latents["lora"] - latents["base"]).abs().max()) > 1e-3 * float(latents["base"].abs().max())
