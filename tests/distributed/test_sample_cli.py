"""``vitp-sample`` and ``vitp-eval`` under torchrun: the generator in the run's training layout (or
an overridden one), each rank reading its shard, gives the one-process grid and held-out loss; the
flags' override form (``cli.num=8``) survives torchrun's parser; an impossible layout is refused.

One tiny context-parallel run (``parallel.cp=2`` on 2 ranks) is trained once for the module.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import PERTURBED
from vitp.utils import free_port

BIN = Path(sys.executable).parent
# from the perturbed export (non-zero adaLN gates): samples that differ from tile to tile
RUN = ["experiment=smoke", "trainer.max_steps=2", "parallel.cp=2", f"trainer.init_from={PERTURBED}"]
SAMPLING = ["sampler.steps=3"]
EVAL = ["eval.classifier_epochs=1", "eval.num_samples=20"]


def _cli(args, cwd, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", NO_ALBUMENTATIONS_UPDATE="1")
    return subprocess.run([str(BIN / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _torchrun(args, cwd):
    return _cli(["torchrun", "--nproc_per_node", "2", "--master_port", str(free_port()), *args], cwd)


@pytest.fixture(scope="module")
def cp_run(tmp_path_factory):
    """A 2-step smoke run trained at cp=2 on 2 ranks (its config says parallel.cp=2)."""
    base = tmp_path_factory.mktemp("cp_run")
    p = _torchrun(["-m", "vitp.train", *RUN, f"hydra.run.dir={base / 'run'}"], base)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return base / "run"


def _pixels(path):
    return np.asarray(Image.open(path)).astype(int)


@pytest.fixture(scope="module")
def one_process(cp_run, tmp_path_factory):
    """``vitp-sample`` of the cp=2 run by one process (the reference of every layout):
    ``(stdout, grid file, pixels)``."""
    tmp = tmp_path_factory.mktemp("one")
    one = _cli(["vitp-sample", str(cp_run), "--classes", "3", "7", "--num", "3", "--out", str(tmp / "one.png"),
                *SAMPLING], tmp)
    assert one.returncode == 0, one.stderr[-3000:]
    return one.stdout, tmp / "one.png", _pixels(tmp / "one.png")


@pytest.fixture(scope="module")
def one_process_eval(cp_run, tmp_path_factory):
    """``vitp-eval`` of the cp=2 run by one process: its ``eval.json``."""
    tmp = tmp_path_factory.mktemp("one_eval")
    one = _cli(["vitp-eval", str(cp_run), *EVAL], tmp)
    assert one.returncode == 0, one.stderr[-3000:]
    ref = json.loads((cp_run / "eval.json").read_text())
    (cp_run / "eval.json").unlink()
    return ref


@pytest.mark.parametrize("layout", [[], ["parallel.cp=1"], ["parallel.cp=1", "parallel.tp=2",
                                                            "parallel.sequence_parallel=true"]],
                         ids=["trained-cp2", "dp2", "tp2sp"])
def test_sample_under_torchrun_writes_the_one_process_grid(cp_run, one_process, tmp_path, layout):
    one_stdout, one_png, a = one_process
    two = _torchrun(["-m", "vitp.cli.sample", str(cp_run), "cli.classes=[3,7]", "cli.num=3",
                     f"cli.out={tmp_path / 'two.png'}", *SAMPLING, *layout], tmp_path)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    b = _pixels(tmp_path / "two.png")
    assert a.shape == b.shape == (2 * 64 + 3 * 2, 3 * 64 + 4 * 2, 3)  # 2 rows x 3 columns of 64 px tiles
    assert np.abs(a - b).max() <= 1
    tiles = [a[2 + 66 * r:66 * (r + 1), 2 + 66 * c:66 * (c + 1)] for r in range(2) for c in range(3)]
    assert min(np.abs(tiles[i] - tiles[j]).max() for i in range(6) for j in range(i)) > 4  # six different samples
    # rank 0 alone prints, the line one process prints
    assert two.stdout.count("wrote ") == 1 and one_stdout.replace(str(one_png), str(tmp_path / "two.png")) == two.stdout


@pytest.mark.parametrize("layout", [[], ["parallel.cp=1"]], ids=["trained-cp2", "dp2"])
def test_eval_under_torchrun_gives_the_one_process_heldout_loss(cp_run, one_process_eval, tmp_path, layout):
    ref = one_process_eval
    (cp_run / "eval.json").unlink(missing_ok=True)  # the file read below is this launch's
    two = _torchrun(["--no-python", str(BIN / "vitp-eval"), str(cp_run), *EVAL, *layout], tmp_path)  # console script
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    got = json.loads((cp_run / "eval.json").read_text())
    assert json.loads(two.stdout) == got  # one JSON document: rank 0 alone prints
    assert got["heldout_loss"] == pytest.approx(ref["heldout_loss"], rel=1e-6)
    assert list(got["heldout_loss_per_t"].values()) == pytest.approx(list(ref["heldout_loss_per_t"].values()),
                                                                     rel=1e-6)
    assert got["sample_accuracy"] == ref["sample_accuracy"] and got["step"] == ref["step"] == 2


def test_flags_under_a_launcher(cp_run, tmp_path, capsys):
    """``--num`` never reaches vitp under torchrun (its parser takes it for ``--numa-binding``):
    ``cli.num=8`` is the spelling that does; vitp's own parsers take no abbreviation."""
    from vitp.cli.eval import main as eval_main
    from vitp.cli.sample import main as sample_main

    p = _torchrun(["-m", "vitp.cli.sample", str(cp_run), "--num", "8", "--out", str(tmp_path / "x.png")], tmp_path)
    assert p.returncode != 0 and "ambiguous option: --num could match --numa-binding" in p.stderr
    assert not (tmp_path / "x.png").exists()
    sample_main([str(cp_run), "--local_rank=0", "cli.classes=3", "cli.num=1", f"cli.out={tmp_path / 'y.png'}",
                 "sampler.steps=1"])  # the deepspeed launcher's --local_rank is taken out
    assert _pixels(tmp_path / "y.png").shape == (64, 64, 3)  # one tile, no border
    for main, argv, message in [
            (sample_main, [str(cp_run), "--nu", "8"], "unrecognized arguments: --nu 8"),
            (eval_main, [str(cp_run), "--weight", "x"], "unrecognized arguments: --weight x"),
            (sample_main, [str(cp_run), "cli.nmu=8"], "cli.nmu=8: vitp-sample has no flag --nmu; flags as overrides"),
            (sample_main, [str(cp_run), "cli.num=two"], "cli.num=two: cli.num takes an integer"),
            (sample_main, [str(cp_run), "--num", "2", "cli.num=2"], "--num and cli.num= both given")]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_layout_impossible_for_the_world_is_refused(cp_run, tmp_path, capsys):
    from vitp.cli.sample import main as sample_main

    p = _torchrun(["-m", "vitp.cli.sample", str(cp_run), "parallel.tp=2", f"cli.out={tmp_path / 'x.png'}"], tmp_path)
    assert p.returncode != 0 and not (tmp_path / "x.png").exists()
    assert ("vitp-sample: error: vitp-sample on 2 processes cannot run the layout parallel.tp=2 x parallel.cp=2 x "
            "parallel.pp=1") in p.stderr
    assert "parallel.tp=1 parallel.cp=2 parallel.pp=1" in p.stderr  # the valid layouts, as overrides
    with pytest.raises(SystemExit) as e:  # one process runs the whole model: a layout key must fit it
        sample_main([str(cp_run), "parallel.pp=2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "vitp-sample on 1 process cannot run the layout" in err
    assert "parallel.tp=1 parallel.cp=1 parallel.pp=1" in err
