"""``vitp-sample`` and ``vitp-eval`` under torchrun: two replicas of the whole generator by default
(it fits one device), or the run's training layout (or another) given as overrides, each rank
reading its shard, give the one-process grid and held-out loss; the
flags' override form (``cli.num=8``) survives torchrun's parser; an impossible layout is refused.

One tiny context-parallel run (``parallel.cp=2`` on 2 ranks) is trained once for the module.
Wan: three tiny runs (Wan 2.1's layout, Wan 2.2 A14B's low-noise expert, Wan 2.2 TI2V-5B) trained
and sampled in one forked process equal diffusers' ``WanPipeline`` (latents 1e-4, frames within one
level; TI2V's first loss diffusers' model's with per-token timesteps), and one torchrun launch per
layout (dp2, cp2) samples all three as one process does. Faults seen to fail them: switching
experts after the first step (latents 6e-2 apart), the first latent frame's tokens at timestep 0 in
TI2V's per-token timesteps (0.16), the same expert built twice under torchrun (0.76), the
timestep embedded one step off (TI2V first loss 1.7955 vs 1.7988).
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
EVAL = ["eval.classifier_epochs=1", "eval.num_samples=20", "eval.t_grid=2"]
# FID (vitp.eval.fid) of 32 samples in 2 blocks against 8 training digits, random-weight Inception
FID = ["eval.fid.num=32", "eval.fid.block=16", "eval.fid.real_num=8", "eval.fid.batch_size=16"]


@pytest.fixture(scope="module")
def fid_weights(tmp_path_factory):
    """A random-weight Inception-V3 file (scripts/make_random_eval_weights.py)."""
    from tests.helpers import eval_weights_script

    mod = eval_weights_script()
    return mod.random_inception(tmp_path_factory.mktemp("fidw") / "inception.pth")


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
def cp_run(tmp_path_factory, fid_weights):
    """A 2-step smoke run trained at cp=2 on 2 ranks (its config says parallel.cp=2), with FID after
    step 1 (``eval.fid.every=1``) and in the final evaluation; the end's ``eval.json`` / ``eval.npz`` are moved to
    ``<base>/train_eval.*``, so every evaluation below is its own."""
    base = tmp_path_factory.mktemp("cp_run")
    p = _torchrun(["-m", "vitp.train", *RUN, "eval.enabled=true", *EVAL, *FID, "eval.fid.every=1",
                   f"eval.fid.weights={fid_weights}", f"hydra.run.dir={base / 'run'}"], base)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    _quiet(p)
    for suffix in (".json", ".npz"):
        (base / "run" / f"eval{suffix}").rename(base / f"train_eval{suffix}")
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
def one_process_eval(cp_run, fid_weights, tmp_path_factory):
    """``vitp-eval`` of the cp=2 run by one process, with FID: its ``eval.json`` and the ``.npz`` of
    its FID samples (moved out of the run)."""
    tmp = tmp_path_factory.mktemp("one_eval")
    one = _cli(["vitp-eval", str(cp_run), *EVAL, *FID, f"eval.fid.weights={fid_weights}",
                f"eval.fid.real_stats={tmp / 'real.safetensors'}"], tmp)
    assert one.returncode == 0, one.stderr[-3000:]
    ref = json.loads((cp_run / "eval.json").read_text())
    (cp_run / "eval.json").unlink()
    (cp_run / "eval.npz").rename(tmp / "one.npz")
    ref["fid_npz"] = tmp / "one.npz"
    return ref


@pytest.mark.parametrize("layout", [[], ["parallel.cp=2"], ["parallel.cp=1", "parallel.tp=2",
                                                            "parallel.sequence_parallel=true"]],
                         ids=["default-dp2", "trained-cp2", "tp2sp"])
def test_sample_under_torchrun_writes_the_one_process_grid(cp_run, one_process, tmp_path, layout):
    """No layout given: two replicas of the whole generator (it fits one device), said in one line;
    a given layout (the run's cp=2, tp=2 with sp) shards the generator. Every one writes one process's grid."""
    one_stdout, one_png, a = one_process
    two = _torchrun(["--no-python", str(BIN / "vitp-sample"), str(cp_run), "cli.classes=[3,7]", "cli.num=3",
                     f"cli.out={tmp_path / 'two.png'}", *SAMPLING, *layout], tmp_path)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    _quiet(two)
    said = [x for x in two.stderr.splitlines() if "layout for sampling" in x]
    assert len(said) == 1  # rank 0 alone says it, chosen or given
    if layout:
        assert said[0].endswith(f"(given: {' '.join(layout)})")
    else:
        assert said[0].startswith("vitp-sample: layout for sampling: dp=2 (a replica of the whole model fits one "
                                  "device")
    b = _pixels(tmp_path / "two.png")
    assert a.shape == b.shape == (2 * 64 + 3 * 2, 3 * 64 + 4 * 2, 3)  # 2 rows x 3 columns of 64 px tiles
    assert np.abs(a - b).max() <= 1
    tiles = [a[2 + 66 * r:66 * (r + 1), 2 + 66 * c:66 * (c + 1)] for r in range(2) for c in range(3)]
    assert min(np.abs(tiles[i] - tiles[j]).max() for i in range(6) for j in range(i)) > 4  # six different samples
    # rank 0 alone prints, the line one process prints
    assert two.stdout.count("wrote ") == 1 and one_stdout.replace(str(one_png), str(tmp_path / "two.png")) == two.stdout


@pytest.mark.parametrize("layout", [[], ["parallel.cp=2"]], ids=["default-dp2", "trained-cp2"])
def test_eval_under_torchrun_gives_the_one_process_heldout_loss(cp_run, one_process_eval, fid_weights, tmp_path,
                                                                layout):
    """Also FID in the default layout (dp2): each replica samples and extracts its share; the ``.npz``
    is one process's. No rank's resident-memory peak exceeds 1.15x the median rank's."""
    ref, fid = one_process_eval, not layout
    (cp_run / "eval.json").unlink(missing_ok=True)  # the file read below is this launch's
    extra = [*FID, f"eval.fid.weights={fid_weights}", f"eval.fid.real_stats={tmp_path / 'real.safetensors'}"] if fid \
        else ["eval.fid.num=0"]  # the run's own config asks for FID
    two = _torchrun(["--no-python", str(BIN / "vitp-eval"), str(cp_run), *EVAL, *layout, *extra], tmp_path)  # console script
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    got = json.loads((cp_run / "eval.json").read_text())
    assert json.loads(two.stdout) == got  # one JSON document: rank 0 alone prints
    assert got["heldout_loss"] == pytest.approx(ref["heldout_loss"], rel=1e-6)
    assert list(got["heldout_loss_per_t"].values()) == pytest.approx(list(ref["heldout_loss_per_t"].values()),
                                                                     rel=1e-6)
    assert got["sample_accuracy"] == ref["sample_accuracy"] and got["step"] == ref["step"] == 2
    assert ("vitp-eval: layout for evaluation: dp=2 " in two.stderr) == (not layout)
    assert ("vitp-eval: layout for evaluation: tp=1 cp=2 (ulysses) pp=1 dp=1 (given: parallel.cp=2)" in two.stderr
            ) == bool(layout)
    if fid:
        npz = cp_run / "eval.npz"
        assert npz.read_bytes() == ref["fid_npz"].read_bytes()  # the same samples, byte for byte
        assert got["fid"] == pytest.approx(ref["fid"], rel=1e-6) and got["fid"] > 0
        assert got["fid_num_samples"] == 32 and got["fid_real_items"] == 8
        npz.unlink()
    peaks = got["peak_rss_mib"]  # every rank's VmHWM: rank 0 alone writes files and takes the distance
    print(f"\nvitp-eval {layout or 'dp2 + FID'}: peak RSS per rank {peaks} MiB")
    assert len(peaks) == 2 and min(peaks) > 100 and max(peaks) <= 1.15 * float(np.median(peaks)), peaks


def test_fid_during_training_in_the_cp2_layout_equals_one_process_eval(cp_run, one_process_eval):
    """``eval.fid.every=1`` in the 2-step cp=2 training: FID after step 1 and at the end in
    ``eval.jsonl`` and TensorBoard (``eval/fid``), step 1's samples removed once scored; the end's
    samples (drawn in the cp=2 training layout) are one-process ``vitp-eval``'s byte for byte, and
    its FID the same (1e-6)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    base = cp_run.parent
    rows = [json.loads(x) for x in (cp_run / "eval.jsonl").read_text().splitlines()]
    fids = {r["step"]: r["fid"] for r in rows if "fid" in r}
    final = json.loads((base / "train_eval.json").read_text())
    assert sorted(fids) == [1, 2] and fids[2] == final["fid"] and fids[1] > 0 and fids[1] != fids[2]
    assert not list((cp_run / "fid").glob("*.npz*"))
    acc = EventAccumulator(str(cp_run / "tb"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("eval/fid")] == [(1, pytest.approx(fids[1])),
                                                                    (2, pytest.approx(fids[2]))]
    assert (base / "train_eval.npz").read_bytes() == one_process_eval["fid_npz"].read_bytes()
    assert final["fid"] == pytest.approx(one_process_eval["fid"], rel=1e-6)


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
# 4-step wan_smoke runs trained and sampled in one forked process: from the tiny pipeline folder
# (Wan 2.1 layout, VAE included), from the tiny Wan 2.2 A14B folder's low-noise expert
# (model.expert=low, 2 steps: the run's RUN/diffusers holds the trained transformer_2/ and links the
# source's transformer/) and from the tiny TI2V-5B folder (48 channels, expand_timesteps, 2 steps).
# One torchrun launch per layout (dp2, cp2 Ulysses) samples all three again (wan_sample_many).
WAN_PROMPTS = ["a synthetic clip of class 2", "class 1, moving slowly"]  # captions of the run's store
WAN_SAMPLING = ["sampler.steps=4", "sampler.cfg_scale=5"]
WAN_RUNS = {  # run name -> (make_tiny_wan options, extra training overrides, extra sampling overrides)
    "run": ({}, [], []),
    "a14b_low": ({"two_experts": True}, ["model.expert=low", "trainer.max_steps=2"], ["sampler.cfg_scale_2=2"]),
    "ti2v": ({"ti2v": True}, ["trainer.max_steps=2"], []),
}


def _wan_train_and_sample(rank, base):
    """The :data:`WAN_RUNS` (``wan_smoke`` of each tiny folder) and ``vitp-sample RUN`` of each, in a
    forked 1-rank group (no process group left in pytest's process)."""
    from pathlib import Path

    from tests.helpers import make_tiny_wan
    from vitp.cli.sample import run as sample
    from vitp.config import compose
    from vitp.train import train

    base, script = Path(base), make_tiny_wan()
    for name, (options, extra, sampling) in WAN_RUNS.items():
        folder = script.write_pipeline(base / f"tiny_{name}", sharded=True, **options)
        train(compose(["experiment=wan_smoke", f"trainer.init_from={folder}",
                       f"data.text_embeddings={base / 'captions'}", *extra]), base / name)
        sample([str(base / name), *sum([["--prompt", p] for p in WAN_PROMPTS], []), "--num", "2",
                "--out", str(base / f"one_{name}"), *WAN_SAMPLING, *sampling])


@pytest.fixture(scope="module")
def wan_runs(tmp_path_factory):
    """The folder holding each :data:`WAN_RUNS` run ``<name>`` and its one-process sample ``one_<name>``."""
    from tests.helpers import run_ranks

    base = tmp_path_factory.mktemp("wan_sample")
    run_ranks(1, _wan_train_and_sample, str(base))
    return base


def _wan_reference(run, **call):
    """diffusers' ``WanPipeline`` of the run's ``RUN/diffusers`` on the same inputs, built here: the
    store's embeddings of the prompts and of the empty prompt zero-padded to 512, each sample's noise
    from its own seed ``sample_seed(0, i)`` (the latent size of the run's VAE: 8 x 8 latents, 9
    frames). ``call``: more pipeline arguments (``guidance_scale_2``). ``(latents, frames uint8)``."""
    from diffusers import WanPipeline
    from omegaconf import OmegaConf

    from vitp.objectives import sample_seed
    from vitp.objectives.wan_sampling import pad_prompt_embeds
    from vitp.text import TextEmbeddings

    store = TextEmbeddings(OmegaConf.load(run / ".hydra" / "config.yaml").data.text_embeddings)
    emb, mask = store.get(store.ids_of(["", *WAN_PROMPTS]))
    emb = pad_prompt_embeds(emb.float(), mask)
    rows = emb[1:].repeat_interleave(2, dim=0)  # two samples per prompt, a grid row each
    pipe = WanPipeline.from_pretrained(str(run / "diffusers"), text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    channels, size = pipe.vae.config.z_dim, 8 * pipe.vae_scale_factor_spatial
    noise = torch.stack([torch.randn((channels, 3, 8, 8), generator=torch.Generator().manual_seed(sample_seed(0, i)))
                         for i in range(4)])
    call = dict(prompt_embeds=rows, negative_prompt_embeds=emb[:1].expand_as(rows), latents=noise, height=size,
                width=size, num_frames=9, num_inference_steps=4, guidance_scale=5.0, **call)
    latents = pipe(**call, output_type="latent").frames
    frames = torch.as_tensor(pipe(**call, output_type="np").frames)
    return latents, (frames * 255).round().to(torch.uint8)


def _rel_max(a, b) -> float:
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max())


def _levels(a, b) -> int:
    """The largest difference of two uint8 frame arrays, in 8-bit levels."""
    return int((a.int() - b.int()).abs().max())


WAN_MEASURED = {}  # printed with pytest -s at the end of the module


def test_wan_sample_one_process_is_wan_pipeline(wan_runs):
    from safetensors import safe_open
    from safetensors.torch import load_file

    run, one = wan_runs / "run", wan_runs / "one_run"
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


def test_wan22_a14b_run_samples_with_both_experts_as_wan_pipeline(wan_runs):
    """The run fine-tuned transformer_2 (the low-noise expert) on noise levels [0, 0.8] only; its
    RUN/diffusers holds it and links the source's transformer/; vitp-sample of the run gives the
    latents of WanPipeline loaded from that folder (both experts, boundary 0.8, guidance 5 then 2)."""
    from omegaconf import OmegaConf
    from safetensors import safe_open
    from safetensors.torch import load_file

    run, one = wan_runs / "a14b_low", wan_runs / "one_a14b_low"
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    assert cfg.model.expert == "low" and list(cfg.objective.sigma_range) == [0.0, 0.8]
    folder = run / "diffusers"
    assert (folder / "transformer").is_symlink() and not (folder / "transformer_2").is_symlink()
    assert (folder / "transformer").resolve() == (wan_runs / "tiny_a14b_low" / "transformer").resolve()
    got = load_file(str(one / "latents.safetensors"))
    latents, frames = _wan_reference(run, guidance_scale_2=2.0)
    WAN_MEASURED["a14b latents rel max"] = _rel_max(got["latents"], latents)
    WAN_MEASURED["a14b frame levels"] = _levels(got["frames"], frames)
    assert _rel_max(got["latents"], latents) <= 1e-4 and _levels(got["frames"], frames) <= 1
    same_scale, _ = _wan_reference(run)  # guidance_scale_2 = guidance_scale
    assert _rel_max(same_scale, latents) > 1e-2  # the low-noise expert's guidance matters
    with safe_open(str(one / "latents.safetensors"), "pt") as f:
        settings = json.loads(f.metadata()["settings"])
    assert settings["experts"] == ["transformer", "transformer_2"] and settings["boundary_ratio"] == 0.8
    assert settings["guidance_scale_2"] == 2.0


def _first_loss_with_diffusers(run) -> float:
    """Step 1's loss of the run computed with diffusers' ``WanTransformer3DModel`` of its folder on
    the batches the trainer's loader gives step 1, the timestep per token ``(B, N)`` as
    ``WanPipeline`` gives it with ``expand_timesteps`` (text-to-video: each sample's on every token)."""
    from diffusers import WanTransformer3DModel
    from omegaconf import OmegaConf

    from vitp.cli.overrides import typed_config
    from vitp.config import validate_config
    from vitp.data import build_datasets
    from vitp.data.loader import BatchSchedule, WanCollate, train_loader
    from vitp.data.text import conditioned, conditioning
    from vitp.models.wan_run import wan_loss, wan_source

    cfg = typed_config(OmegaConf.load(run / ".hydra" / "config.yaml"))
    validate_config(cfg, 1)
    cond = conditioning(cfg)
    data, _ = conditioned(cond, *build_datasets(cfg.data, cfg.seed))
    tr = cfg.trainer
    schedule = BatchSchedule(len(data), tr.global_batch_size, tr.micro_batch_size, 1, cfg.seed)
    path, _ = wan_source(cfg)
    collate = WanCollate(wan_loss(cfg, path), cond, cfg.objective.label_drop, 512)
    model = WanTransformer3DModel.from_pretrained(str(path)).float().eval()
    losses = []
    for (x_t, timestep, text), (x, eps, s) in train_loader(data, schedule, cfg.objective, cond, start_step=0,
                                                            stop_step=1, dp_rank=0, collate=collate):
        assert x_t.shape[1:] == (48, 3, 8, 8)
        torch.testing.assert_close(timestep, 1000 * s)  # diffusers' timestep scale
        per_token = timestep[:, None] * torch.ones(3 * 4 * 4)  # (B, N): N = T (H / 2) (W / 2) tokens
        with torch.no_grad():
            out = model(x_t, per_token, text, return_dict=False)[0]
        losses.append(((out - (eps - x)) ** 2).mean())
    return float(torch.stack(losses).mean())


def test_wan22_ti2v_text_to_video_trains_and_samples_as_diffusers(wan_runs):
    """TI2V-5B's layout: the first step's loss is diffusers' model's with per-token timesteps on the
    same batch; vitp-sample of the run gives WanPipeline's latents (expand_timesteps, the 48-channel
    Wan 2.2 VAE decoding 16x)."""
    from safetensors.torch import load_file

    run, one = wan_runs / "ti2v", wan_runs / "one_ti2v"
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    want = _first_loss_with_diffusers(run)
    WAN_MEASURED["ti2v first loss rel"] = abs(losses[0] - want) / want
    assert len(losses) == 2 and losses[0] == pytest.approx(want, rel=1e-5)
    got = load_file(str(one / "latents.safetensors"))
    latents, frames = _wan_reference(run)
    assert got["latents"].shape == (4, 48, 3, 8, 8) and got["frames"].shape == (4, 9, 128, 128, 3)
    WAN_MEASURED["ti2v latents rel max"] = _rel_max(got["latents"], latents)
    WAN_MEASURED["ti2v frame levels"] = _levels(got["frames"], frames)
    assert _rel_max(got["latents"], latents) <= 1e-4 and _levels(got["frames"], frames) <= 1


@pytest.mark.parametrize("layout", [[], ["parallel.cp=2"]], ids=["dp2_chosen", "cp2_ulysses"])
def test_wan_sample_under_torchrun_is_the_one_process_sample(wan_runs, tmp_path, layout):
    """One launch samples the three runs (Wan 2.1, A14B's two experts, TI2V) in the layout given,
    or without a layout key in the one vitp-sample chooses (two whole-model replicas: they fit)."""
    from safetensors.torch import load_file

    argvs = [[str(wan_runs / name), f"cli.prompt={json.dumps(WAN_PROMPTS)}", "cli.num=2",
              f"cli.out={tmp_path / name}", *WAN_SAMPLING, *sampling, *layout]
             for name, (_, _, sampling) in WAN_RUNS.items()]
    two = _torchrun(["-m", "tests.distributed.wan_sample_many", json.dumps(argvs)], Path(__file__).parents[2])
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert two.stdout.count("wrote ") == len(WAN_RUNS)  # rank 0 alone prints
    chosen = "vitp-sample: layout for sampling: dp=2 (a replica of the whole model fits one device"
    assert (two.stderr + two.stdout).count(chosen) == (0 if layout else len(WAN_RUNS)), two.stderr[-2000:]
    given = f"vitp-sample: layout for sampling: tp=1 cp=2 (ulysses) pp=1 dp=1 (given: {' '.join(layout)})"
    assert (two.stderr + two.stdout).count(given) == (len(WAN_RUNS) if layout else 0), two.stderr[-2000:]
    for name in WAN_RUNS:
        a = load_file(str(wan_runs / f"one_{name}" / "latents.safetensors"))
        b = load_file(str(tmp_path / name / "latents.safetensors"))
        assert torch.equal(a["noise"], b["noise"]), name
        WAN_MEASURED[f"{name} {layout[0] if layout else 'dp2 chosen'} latents rel max"] = _rel_max(b["latents"],
                                                                                                  a["latents"])
        assert _rel_max(b["latents"], a["latents"]) <= 1e-4, name
        assert _levels(b["frames"], a["frames"]) <= 1, name


def test_report_wan_measured():
    print("\n" + "\n".join(f"{k}: {v:.3g}" for k, v in WAN_MEASURED.items()))
