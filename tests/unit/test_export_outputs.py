"""Where vitp-export and vitp-train write, on two tiny Wan runs (2 steps, one process, seconds): an
output on the run's base or over the run's own files is refused before anything is written (a
diffusers export to ``-o BASE --force`` deleted the base's shards, then failed); a diffusers LoRA to
a ``.safetensors`` name is that file; every file of a run and of its exports has the mode a plain
``open()`` gives (safetensors wrote 0600); a run's ``RUN/diffusers`` sampled directly gets an output
folder of its own."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.helpers import make_tiny_wan

UMASK = 0o027  # not the usual 022: a mode fixed at 0644 would show


def _train(run: Path, init: Path, tmp: Path, *extra: str) -> Path:
    from vitp.config import compose
    from vitp.train import train

    train(compose(["experiment=wan_smoke", f"trainer.init_from={init}", "trainer.max_steps=2", "eval.enabled=false",
                   f"data.text_embeddings={tmp / 'captions'}", *extra]), run)
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A full fine-tune of the pipeline ``base`` and a LoRA run of ``base/transformer``, trained and
    exported under :data:`UMASK` (restored after)."""
    from vitp.cli.export import run as export

    tmp = tmp_path_factory.mktemp("outputs")
    mask = os.umask(UMASK)
    try:
        base = make_tiny_wan().write_pipeline(tmp / "base", sharded=True, vae=False)
        full = _train(tmp / "run", base, tmp)
        lora = _train(tmp / "lora_run", base / "transformer", tmp, "trainer.lora.enabled=true", "trainer.lora.rank=4")
        exports = {"diffusers": export([str(full), "--format", "diffusers", "-o", str(tmp / "full_export")]),
                   "merged": export([str(lora), "--format", "diffusers", "--merge", "-o", str(tmp / "merged")]),
                   "lora_folder": export([str(lora), "--format", "lora", "-o", str(tmp / "lora_folder")]),
                   "lora_file": export([str(lora), "--format", "lora", "-o", str(tmp / "lora_as_file.safetensors")]),
                   "comfyui": export([str(lora), "--format", "lora", "--lora-format", "comfyui", "-o", str(tmp / "c")])}
    finally:
        os.umask(mask)
    return SimpleNamespace(tmp=tmp, base=base, full=full, lora=lora, exports=exports)


def _files(folder: Path) -> dict:
    """``{relative path: sha256}`` of every file under ``folder`` (links not followed)."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


def _refused(argv, capsys) -> str:
    from vitp.cli.export import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


def test_an_export_onto_the_base_or_over_the_run_is_refused_before_writing(runs, capsys):
    base, full, lora, tmp = runs.base, runs.full, runs.lora, runs.tmp
    before = {f: _files(f) for f in (base, full, lora)}
    cases = [  # (run, extra flags, -o, what the one line says)
        (full, ["--format", "diffusers"], base, f"-o {base} is the run's base trainer.init_from={base}: the export "
                                                "would overwrite the weights the run started from; give -o another"),
        (full, ["--format", "diffusers"], base / "transformer", f"lies inside the run's base trainer.init_from={base}"),
        (full, ["--format", "diffusers"], tmp, f"-o {tmp} holds the run's base trainer.init_from={base}"),
        (full, ["--format", "diffusers"], full, f"-o {full} is the run folder: the export would overwrite the run's "
                                                f"files; give -o a new name, e.g. under {full / 'export'}"),
        (full, ["--format", "diffusers"], full / "diffusers", f"is the run's {full / 'diffusers'}"),
        (full, ["--format", "diffusers"], full / "checkpoints" / "x", f"lies inside the run's {full / 'checkpoints'}"),
        (lora, ["--format", "diffusers", "--merge"], base, f"holds the run's base trainer.init_from={base / 'transformer'}"),
        (lora, ["--format", "diffusers", "--merge"], base / "transformer", "is the run's base"),
        (lora, ["--format", "lora"], base / "x.safetensors", f"lies inside the run's base trainer.init_from="
                                                             f"{base / 'transformer'} ({base})"),
        (lora, ["--format", "lora", "--lora-format", "comfyui"], base / "c", "lies inside the run's base"),
        (lora, ["--format", "lora"], lora / "lora", f"is the run's {lora / 'lora'}"),
    ]
    for run, flags, out, message in cases:
        err = _refused([str(run), *flags, "-o", str(out), "--force"], capsys)
        assert message in err, (out, err)
    assert {f: _files(f) for f in (base, full, lora)} == before  # nothing written, nothing removed
    assert not (tmp / "transformer").exists() and not (tmp / "model_index.json").exists()


def test_an_export_through_a_link_into_the_base_is_refused(runs, capsys):
    """An earlier export's folder whose trained-expert folder links into the base (as the other
    expert of an A14B pipeline is linked): the export would write through the link."""
    out = runs.tmp / "linked"
    out.mkdir()
    (out / "transformer").symlink_to(runs.base / "transformer", target_is_directory=True)
    err = _refused([str(runs.full), "--format", "diffusers", "-o", str(out), "--force"], capsys)
    assert f"-o {out} (through {out / 'transformer'}) lies inside the run's base trainer.init_from={runs.base}" in err


def test_the_final_weights_of_vitp_train_may_not_land_on_its_base(runs, tmp_path):
    """``trainer.init_from`` an earlier run's ``RUN/diffusers`` with that run folder (a resume) or
    ``trainer.export_dir`` its run folder: the end of the run would overwrite the base."""
    from vitp.config import compose
    from vitp.train import check_config

    init = runs.full / "diffusers"
    for extra, run_dir, where in (([], runs.full, "hydra.run.dir"),
                                  ([f"trainer.export_dir={runs.full}"], tmp_path / "new", "trainer.export_dir")):
        cfg = compose(["experiment=wan_smoke", f"trainer.init_from={init}", *extra])
        with pytest.raises(ValueError, match=rf"trainer.init_from={init}: the run writes its final weights to {init} "
                                             rf"\({where}=.*\), the same path, and would overwrite the model it starts "
                                             rf"from; start from a copy of it, or choose another {where}"):
            check_config(cfg, run_dir=run_dir)
    assert not (tmp_path / "new").exists()
    check_config(compose(["experiment=wan_smoke", f"trainer.init_from={init}"]), run_dir=tmp_path / "new")


def test_a_generator_export_onto_its_base_file_is_refused(tmp_path):
    """The generator's base is a file (or a sharded export's index): an export of that name would
    replace it; a file beside it is fine."""
    from vitp.checkpoint.outputs import check_export_out
    from vitp.config import compose

    base = tmp_path / "base.safetensors"
    for init in (base, Path(f"{base}.index.json")):
        cfg = compose(["experiment=smoke", f"trainer.init_from={init}"])
        with pytest.raises(ValueError, match=rf"-o {base} is the run's base trainer.init_from={init}"):
            check_export_out(base, [base], cfg, None)
        check_export_out(tmp_path / "other.safetensors", [tmp_path / "other.safetensors"], cfg, None)


def test_a_diffusers_lora_to_a_safetensors_name_is_that_file(runs):
    """``--format lora -o X.safetensors`` writes the file X.safetensors (diffusers' loader takes a
    file path), not a folder of that name; any other name is the folder diffusers' save_lora_weights
    writes, holding pytorch_lora_weights.safetensors; both hold the same adapters."""
    from vitp.models import lora_files as lf
    from vitp.models.wan_keys import read_config

    folder, file = runs.exports["lora_folder"], runs.exports["lora_file"]
    assert folder == runs.tmp / "lora_folder" / lf.WEIGHT_NAME and folder.is_file()
    assert file == runs.tmp / "lora_as_file.safetensors" and file.is_file()
    wan = read_config(runs.base / "transformer")
    shapes = lf.wan_state_shapes(wan)
    (a, ca), (b, cb) = (lf.read_lora_file(p, shapes, wan) for p in (folder, file))
    assert ca == cb and sorted(a) == sorted(b) and all((a[k] == b[k]).all() for k in a)


def test_every_file_of_a_run_and_of_its_exports_has_the_usual_mode(runs):
    """Under umask 027 every file is 0640 (0666 & ~umask, as open() makes it), also the safetensors
    files (RUN/diffusers, RUN/lora, the exports), which safetensors creates 0600."""
    want = 0o666 & ~UMASK
    roots = [runs.full, runs.lora, *(p.parent if p.name == "transformer" else p for p in runs.exports.values())]
    files = [f for r in roots for f in ([r] if r.is_file() else r.rglob("*")) if f.is_file() and not f.is_symlink()]
    assert {f.suffix for f in files} >= {".safetensors", ".json"} and runs.tmp / "c.safetensors" in files
    assert any("diffusers/transformer" in str(f) for f in files) and (runs.lora / "lora" / "lora.safetensors") in files
    bad = {str(f): oct(f.stat().st_mode & 0o777) for f in files if f.stat().st_mode & 0o777 != want}
    assert not bad, bad


def test_two_runs_diffusers_folders_sampled_directly_get_their_own_output_folders(runs, tmp_path):
    """``vitp-sample RUN/diffusers``: the default output is ``./outputs/<run name>-diffusers-<hash>``,
    one per run (both were ``./outputs/diffusers``); a pipeline folder outside a run: its name and hash."""
    from vitp.cli.sample import SAMPLE_KEYS
    from vitp.eval.wan_sample import wan_sample_config

    other = shutil.copytree(runs.full, tmp_path / "run", symlinks=True)  # same names inside, another run
    bases = [wan_sample_config(r / "diffusers", [], 1, SAMPLE_KEYS)[2] for r in (runs.full, other)]
    assert bases[0] != bases[1] and all(b.parent == Path("outputs") for b in bases)
    assert [b.name.rsplit("-", 1)[0] for b in bases] == ["run-diffusers"] * 2
    base = wan_sample_config(runs.base, [], 1, SAMPLE_KEYS)[2]
    assert base.parent == Path("outputs") and re.fullmatch(r"base-[0-9a-f]{8}", base.name), base


def test_vitp_sample_of_a_lora_run_on_another_base_names_the_key_the_user_set(runs, capsys):
    """A user's trial: ``vitp-sample LORA_RUN trainer.init_from=OTHER`` was refused (right) as
    ``error: trainer.lora.init_from: ...``, a key vitp-sample sets itself (the run's adapters)."""
    from vitp.cli.eval import main as eval_main
    from vitp.cli.sample import main

    other = make_tiny_wan().write_pipeline(runs.tmp / "other_base", vae=False, seed=3)
    with pytest.raises(SystemExit) as e:
        main([str(runs.lora), "--prompt", "x", f"trainer.init_from={other}/transformer"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"vitp-sample: error: trainer.init_from={other}/transformer: "), err
    assert "trainer.lora.init_from" not in err and str(runs.lora / "lora") in err, err
    with pytest.raises(SystemExit) as e:  # vitp-eval reads the run's adapters the same way
        eval_main([str(runs.lora), f"trainer.init_from={other}/transformer", "eval.fid.num=0", "eval.fvd.num=0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"vitp-eval: error: trainer.init_from={other}/transformer: "), err


@pytest.mark.parametrize("fmt", [["--format", "diffusers"], ["--format", "diffusers", "--merge"], []])
def test_lora_format_without_format_lora_is_refused(tmp_path, capsys, fmt):
    """A user's trial: ``vitp-export RUN --format diffusers --lora-format comfyui`` wrote a diffusers
    folder, ignoring --lora-format; it is refused before the source is read."""
    from vitp.cli.export import main

    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "run"), *fmt, "--lora-format", "comfyui", "-o", str(tmp_path / "out")])
    err = capsys.readouterr().err
    what = fmt[1] if fmt else "vitp"
    assert e.value.code == 2 and (f"vitp-export: error: --lora-format comfyui is the file format of --format lora (a "
                                  f"LoRA run's adapters), not of --format {what}: pass --format lora, or drop "
                                  "--lora-format\n") in err, err
    assert not (tmp_path / "out").exists()


def test_a_wan_lora_run_exported_without_a_format_names_the_lora_formats(runs, capsys):
    """It advised --format diffusers, which a LoRA run then refused: two tries to the right advice."""
    from vitp.cli.export import main

    with pytest.raises(SystemExit) as e:
        main([str(runs.lora), "-o", str(runs.tmp / "y.safetensors")])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert (f"{runs.lora} is a Wan LoRA run: export its adapters with --format lora -o OUT [--lora-format comfyui], "
            "or the base with them merged with --format diffusers --merge -o OUT") in err, err
    assert not (runs.tmp / "y.safetensors").exists()


def test_a_full_wan_run_is_advised_only_the_export_that_works_in_one_line(runs, capsys):
    """A full (non-LoRA) Wan fine-tune: --format lora advised "--format vitp or diffusers", --format
    vitp then advised diffusers, --format diffusers --merge advised vitp or diffusers again, each
    after argparse's usage block. Now one line naming only --format diffusers (and dropping --merge)."""
    run, out = runs.full, runs.tmp / "advice.safetensors"
    cases = [(["--format", "lora"], f"vitp-export: error: {run} is not a LoRA run (trainer.lora.enabled=false): it "
              "has no adapters; export it with --format diffusers -o OUT\n"),
             (["--format", "diffusers", "--merge"], f"vitp-export: error: {run} is not a LoRA run "
              "(trainer.lora.enabled=false): --merge merges a LoRA run's adapters; drop --merge and export it with "
              "--format diffusers -o OUT\n"),
             (["--format", "vitp"], f"vitp-export: error: {run} is a Wan run (model.family=wan): export it with "
              "--format diffusers -o OUT\n")]
    for flags, line in cases:
        assert _refused([str(run), *flags, "-o", str(out)], capsys) == line
    assert not out.exists()
    from vitp.cli.export import not_lora_advice

    assert not_lora_advice(Path("r"), wan=False, merge=True).endswith(  # the generator: its vitp export
        "drop --merge and export it with no --format (the vitp export)")


def test_a_read_only_run_is_refused_before_its_export_folder_is_made(runs, capsys, monkeypatch):
    """``vitp-export RUN`` of a run on a read-only file system ended in ``OSError: [Errno 30]``
    making ``RUN/export``; now one line naming -o. (os.access patched: root ignores modes.)"""
    import errno

    from vitp.cli import run_cli

    monkeypatch.setattr("os.access", lambda path, mode: Path(path) != runs.full)
    monkeypatch.setattr("os.statvfs", lambda path: SimpleNamespace(f_flag=os.ST_RDONLY))
    err = _refused([str(runs.full), "--format", "diffusers"], capsys)
    assert err.startswith(f"vitp-export: error: cannot write {runs.full / 'export'}/") and err.endswith(
        f": {runs.full} is on a read-only file system; pass -o PATH to write the export elsewhere\n"), err
    assert not (runs.full / "export").exists()
    for code, fix in ((errno.EROFS, "a read-only file system: write elsewhere"),  # any CLI: one line, not a traceback
                      (errno.ENOSPC, "the disk is full: free space there or write elsewhere")):
        with pytest.raises(SystemExit) as e:
            run_cli("vitp-sample", _raise, OSError(code, os.strerror(code), "/x/samples"))
        assert e.value.code == 2 and capsys.readouterr().err.startswith(
            f"vitp-sample: error: [Errno {code}] {os.strerror(code)}: '/x/samples' ({fix}")
    with pytest.raises(OSError, match="Input/output error"):  # other OSErrors may be bugs: their traceback stays
        run_cli("vitp-sample", _raise, OSError(errno.EIO, os.strerror(errno.EIO), "/x"))


def _raise(error):
    raise error
