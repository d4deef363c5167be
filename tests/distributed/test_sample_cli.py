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
import torch
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


def _quiet(p) -> None:
    """Nothing on a normal launch's console looks like an error (DeepSpeed's op probe printed
    ``/usr/bin/ld: cannot find -laio`` and ``collect2: error`` under torchrun)."""
    lines = [x for x in (p.stdout + p.stderr).splitlines() if "error" in x.lower()]
    assert not lines, lines


@pytest.fixture(scope="module")
def cp_run(tmp_path_factory):
    """A 2-step smoke run trained at cp=2 on 2 ranks (its config says parallel.cp=2)."""
    base = tmp_path_factory.mktemp("cp_run")
    p = _torchrun(["-m", "vitp.train", *RUN, f"hydra.run.dir={base / 'run'}"], base)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    _quiet(p)
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
    two = _torchrun(["--no-python", str(BIN / "vitp-sample"), str(cp_run), "cli.classes=[3,7]", "cli.num=3",
                     f"cli.out={tmp_path / 'two.png'}", *SAMPLING, *layout], tmp_path)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    _quiet(two)
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


# ----------------------------------------------------------------------------- Wan (vitp.eval.wan_sample)
# A 4-step wan_smoke run from the tiny pipeline folder (VAE included), trained and sampled in
# pytest's own process; two torchrun launches (dp2, cp2 Ulysses) sample it again.
WAN_PROMPTS = ["a synthetic clip of class 2", "class 1, moving slowly"]  # captions of the run's store
WAN_SAMPLING = ["sampler.steps=4", "sampler.cfg_scale=5"]


def _wan_train_and_sample(rank, base, folder):
    """A ``wan_smoke`` run of ``folder`` and ``vitp-sample RUN`` of it, in a forked 1-rank group
    (no process group left in pytest's process)."""
    from pathlib import Path

    from vitp.cli.sample import run as sample
    from vitp.config import compose
    from vitp.train import train

    base = Path(base)
    train(compose(["experiment=wan_smoke", f"trainer.init_from={folder}", f"data.text_embeddings={base / 'captions'}"]),
          base / "run")
    sample([str(base / "run"), *sum([["--prompt", p] for p in WAN_PROMPTS], []), "--num", "2",
            "--out", str(base / "one"), *WAN_SAMPLING])


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory):
    """``(run dir, one-process sample folder)``: the run trained and ``vitp-sample RUN`` run in one
    forked process."""
    from tests.helpers import make_tiny_wan, run_ranks

    base = tmp_path_factory.mktemp("wan_sample")
    folder = make_tiny_wan().write_pipeline(base / "tiny", sharded=True)
    run_ranks(1, _wan_train_and_sample, str(base), str(folder))
    return base / "run", base / "one"


def _wan_reference(run):
    """diffusers' ``WanPipeline`` of the run's ``RUN/diffusers`` on the same inputs, built here: the
    store's embeddings of the prompts and of the empty prompt zero-padded to 512, each sample's noise
    from its own seed ``sample_seed(0, i)``. ``(latents, frames uint8)``."""
    from diffusers import WanPipeline
    from omegaconf import OmegaConf

    from vitp.objectives import sample_seed
    from vitp.objectives.wan_sampling import pad_prompt_embeds
    from vitp.text import TextEmbeddings

    store = TextEmbeddings(OmegaConf.load(run / ".hydra" / "config.yaml").data.text_embeddings)
    emb, mask = store.get(store.ids_of(["", *WAN_PROMPTS]))
    emb = pad_prompt_embeds(emb.float(), mask)
    rows = emb[1:].repeat_interleave(2, dim=0)  # two samples per prompt, a grid row each
    noise = torch.stack([torch.randn((4, 3, 8, 8), generator=torch.Generator().manual_seed(sample_seed(0, i)))
                         for i in range(4)])
    pipe = WanPipeline.from_pretrained(str(run / "diffusers"), text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompt_embeds=rows, negative_prompt_embeds=emb[:1].expand_as(rows), latents=noise, height=64,
                width=64, num_frames=9, num_inference_steps=4, guidance_scale=5.0)
    latents = pipe(**call, output_type="latent").frames
    frames = torch.as_tensor(pipe(**call, output_type="np").frames)
    return latents, (frames * 255).round().to(torch.uint8)


def _rel_max(a, b) -> float:
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max())


def _levels(a, b) -> int:
    """The largest difference of two uint8 frame arrays, in 8-bit levels."""
    return int((a.int() - b.int()).abs().max())


def test_wan_sample_one_process_is_wan_pipeline(wan_run):
    from safetensors import safe_open
    from safetensors.torch import load_file

    run, one = wan_run
    got = load_file(str(one / "latents.safetensors"))
    latents, frames = _wan_reference(run)
    assert got["latents"].shape == (4, 4, 3, 8, 8) and got["frames"].shape == (4, 9, 64, 64, 3)
    assert _rel_max(got["latents"], latents) <= 1e-4
    assert _levels(got["frames"], frames) <= 1
    assert (got["latents"][0] - got["latents"][1]).abs().max() > 0.1  # per-index seeds: samples differ
    with safe_open(str(one / "latents.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["prompts"]) == WAN_PROMPTS
    assert (one / "grid.gif").is_file()
    assert (one / "prompts.txt").read_text().startswith("1 a synthetic clip of class 2")


@pytest.mark.parametrize("layout", [["parallel.cp=1"], ["parallel.cp=2"]], ids=["dp2", "cp2_ulysses"])
def test_wan_sample_under_torchrun_is_the_one_process_sample(wan_run, tmp_path, layout):
    from safetensors.torch import load_file

    run, one = wan_run
    two = _torchrun(["-m", "vitp.cli.sample", str(run), f"cli.prompt={json.dumps(WAN_PROMPTS)}", "cli.num=2",
                     f"cli.out={tmp_path / 'two'}", *WAN_SAMPLING, *layout], tmp_path)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert two.stdout.count("wrote ") == 1  # rank 0 alone prints
    a, b = load_file(str(one / "latents.safetensors")), load_file(str(tmp_path / "two" / "latents.safetensors"))
    assert torch.equal(a["noise"], b["noise"])
    assert _rel_max(b["latents"], a["latents"]) <= 1e-4
    assert _levels(b["frames"], a["frames"]) <= 1
