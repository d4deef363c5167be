"""FID and CLIP score of a Wan run during training (``eval.fid.every``, :func:`vitp.eval.wan_eval.wan_quality_metrics`):
one process, a tiny pipeline with its VAE (scripts/make_tiny_wan.py) and random-weight feature
networks (scripts/make_random_eval_weights.py); ``vitp-eval`` of the exported weights in other
blocks draws the same samples; the real side's cached statistics are refused once the VAE that
decoded them changes. Split over ranks, with FVD:
tests/distributed/parallel/test_wan_parallel.py; WanPipeline's 8-bit frames: tests/unit/test_wan_objective.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.helpers import eval_weights_script, make_tiny_wan


def test_wan_training_scores_fid_and_clip_every_step_and_the_cache_follows_the_vae(tmp_path):
    from safetensors.torch import load_file, save_file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vitp.cli.eval import run as vitp_eval
    from vitp.config import compose
    from vitp.eval.fid import npz_images
    from vitp.train import train

    folder = make_tiny_wan().write_pipeline(tmp_path / "pipe", sharded=True)
    nets = eval_weights_script()
    fid = ["eval.fid.num=4", "eval.fid.block=4", "eval.fid.real_num=4",
           f"eval.fid.weights={nets.random_inception(tmp_path / 'inception.pth')}",
           f"eval.clip.model={nets.random_clip(tmp_path / 'clip')}"]
    run = tmp_path / "run"
    # CFG 20: a caption moves pixels by several 8-bit levels, so a sample paired with the wrong one shows
    train(compose(["experiment=wan_smoke", f"trainer.init_from={folder / 'transformer'}", "trainer.max_steps=2",
                   f"data.text_embeddings={tmp_path / 'captions'}", "eval.fid.every=1", "sampler.cfg_scale=20",
                   *fid]), run)
    lines = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    scored = [x for x in lines if "fid" in x]
    final = json.loads((run / "eval.json").read_text())
    assert [x["step"] for x in scored] == [1, 2] and final["step"] == 2 and scored[1]["fid"] == final["fid"], lines
    assert final["fid"] != scored[0]["fid"] and final["fid_num_samples"] == 4 and final["fid_real_items"] == 4
    assert 0 < final["clip_score"] <= 100 and final["clip_num_samples"] == 4
    assert npz_images(run / "eval.npz").shape == (4, 64, 64, 3) and not list((run / "fid").glob("*.npz"))
    _samples_are_wan_pipelines_of_their_captions(run, folder, [0, 3])
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("eval/fid")] == [1, 2] and "eval/clip_score" in acc.Tags()["scalars"]
    # vitp-eval of the exported EMA weights in blocks of 2: the same samples (sample i from the noise of
    # (eval.fid.seed, i) in any block), reading the cached real statistics
    again = vitp_eval([str(run), "eval.fid.block=2"])
    with np.load(run / "eval.npz") as a, np.load(again["fid_npz"]) as b:
        assert np.array_equal(a["arr_0"], b["arr_0"]) and np.array_equal(a["arr_1"], b["arr_1"])
    assert again["fid"] == pytest.approx(final["fid"], rel=1e-9)
    base = vitp_eval([str(run), "--weights", str(folder)])  # the untrained base: no step of the run's
    assert base["step"] is None and base["weights"] == str(folder.resolve()) and base["fid"] != final["fid"]
    # the weights changed in place (as more training would): the same command with --force draws again
    for f in (run / "diffusers" / "transformer").glob("*.safetensors"):
        save_file({k: v * 1.05 for k, v in load_file(str(f)).items()}, str(f), metadata={"format": "pt"})
    redrawn = vitp_eval([str(run), "eval.fid.block=2", "--force"])
    assert redrawn["fid_npz"] == again["fid_npz"] and redrawn["fid"] != again["fid"]
    cache = run / "fid_real_train4.safetensors"
    before = cache.read_bytes()
    vae = folder / "vae" / "diffusion_pytorch_model.safetensors"
    save_file({k: v * 1.01 for k, v in load_file(str(vae)).items()}, str(vae))  # the VAE changed in place
    with pytest.raises(ValueError, match=r"fid_real_train4.safetensors holds the FID real statistics of other VAE "
                                         r"weights than this evaluation's; delete it"):
        vitp_eval([str(run), "eval.fid.num=4"])
    assert cache.read_bytes() == before
    with np.load(run / "eval.npz") as z:  # the held-out captions, cycled
        assert len(set(z["arr_1"].tolist())) > 1


def _samples_are_wan_pipelines_of_their_captions(run, folder, items):
    """FID sample ``i`` of ``eval.npz`` is diffusers' ``WanPipeline`` (the run's exported transformer,
    the folder's VAE and scheduler) on the caption ``arr_1[i]`` recorded for it, the empty caption as
    the negative prompt and the noise of ``(eval.fid.seed, i)``: its first frame in 8-bit levels,
    within one level (the pipeline's own decode, not vitp's)."""
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel

    from vitp.config import parse_resolution
    from vitp.eval.sampling import sample_noise
    from vitp.eval.wan_eval import load_wan_for_eval, padded_text

    cfg, _, _, _, _, cond = load_wan_for_eval(run, None, [], sharded=False)
    pipe = WanPipeline.from_pretrained(str(folder), tokenizer=None, text_encoder=None, local_files_only=True,
                                       transformer=WanTransformer3DModel.from_pretrained(
                                           str(run / "diffusers" / "transformer"), local_files_only=True))
    pipe.set_progress_bar_config(disable=True)
    m = cfg.model
    h, w = parse_resolution(m.image_size)
    neg = padded_text(cond, torch.tensor([cond.null_id]), m.text_len)
    with np.load(run / "eval.npz") as z:
        images, captions = z["arr_0"], z["arr_1"]
    assert len(set(captions[items].tolist())) == len(items)  # different captions: a mix-up would show
    for i in items:
        noise = sample_noise(int(cfg.eval.fid.seed), range(i, i + 1), (int(m.in_channels), int(m.num_frames), h, w))
        frames = pipe(prompt_embeds=padded_text(cond, torch.tensor([int(captions[i])]), m.text_len),
                      negative_prompt_embeds=neg, latents=noise, num_inference_steps=int(cfg.sampler.steps),
                      guidance_scale=float(cfg.sampler.cfg_scale), output_type="np").frames
        want = np.round(np.asarray(frames)[0, 0] * 255)
        swapped = captions[items[1] if i == items[0] else items[0]]
        other = pipe(prompt_embeds=padded_text(cond, torch.tensor([int(swapped)]), m.text_len),
                     negative_prompt_embeds=neg, latents=noise, num_inference_steps=int(cfg.sampler.steps),
                     guidance_scale=float(cfg.sampler.cfg_scale), output_type="np").frames
        assert np.abs(np.round(np.asarray(other)[0, 0] * 255) - want).max() > 1, i  # the caption shows
        assert want.shape == images[i].shape and np.abs(images[i].astype(np.float64) - want).max() <= 1, i
