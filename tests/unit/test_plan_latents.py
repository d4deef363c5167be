"""The planner in latent space (vitp/plan/latents.py): tokens per sample and shapes of a latent
config by hand, the VAE decoder's parameters against the built model and its decode memory
against a real decode, vitp-plan's output, the latent recipes, and a latent run's planned memory
against a measured training step (the generator sees only the latent shape)."""
from __future__ import annotations

import json

import pytest

from tests.helpers import PLAN_MODELS, compose_cfg, plan_case
from vitp.latents.vae import build_random, small_configs
from vitp.plan import ModelShape, get_profile, latent_plan, phase_costs_of, plan, with_vae_geometry
from vitp.plan.latents import decode_peak_bytes
from vitp.utils import to_dict

# a latent run of model S: 3 x 16 x 16 pixels, a VAE of 4 channels and spatial compression 2 ->
# 4 x 8 x 8 latents; its pixel twin: a pixel run of that latent shape
LATENT_S = ["data.latent_channels=4", "data.vae_compression=[1,2]"]
TWIN_S = ["data.channels=4", "data.resolution=8"]
# the small VAEs at sizes they code: (overrides of a config with data.vae set, VAE input shape of one sample)
VAE_CASES = {"kl": (["data.resolution=16"], (1, 4, 8, 8)),
             "wan": (["data.resolution=32", "data.num_frames=9", "model.tubelet_size=1"], (1, 4, 3, 4, 4)),
             "hunyuan": (["data.resolution=32", "data.num_frames=9", "model.tubelet_size=1"], (1, 4, 3, 4, 4))}


@pytest.fixture(scope="module")
def vaes(tmp_path_factory):
    """``{name: folder}`` of the small random VAEs (:func:`vitp.latents.vae.small_configs`)."""
    root = tmp_path_factory.mktemp("vaes")
    return {name: str(build_random(root / name, cls, cfg)) for name, (cls, cfg) in small_configs().items()}


def _vae_cfg(name, folder):
    over = ["experiment=smoke", "data=synthetic", "data.channels=3", "data.num_classes=4", "model.patch_size=2",
            f"data.vae={folder}", *VAE_CASES[name][0]]
    return with_vae_geometry(compose_cfg(over))


@pytest.mark.parametrize("exp,latent,pixels,grid", [
    ("latent_img1024", (16, 1, 128, 128), (3, 1, 1024, 1024), (1, 64, 64)),
    ("latent_video_wan", (16, 21, 60, 104), (3, 81, 480, 832), (21, 30, 52))])
def test_recipe_tokens_per_sample_by_hand(exp, latent, pixels, grid):
    """tokens = latent_frames / tubelet x (h / p) x (w / p) of the latent shape, and the pixel shape it decodes to."""
    cfg = compose_cfg([f"experiment={exp}", "data.num_classes=10"])
    m = cfg.model
    c, t, h, w = latent
    assert (m.in_channels, m.num_frames, list(m.image_size)) == (c, t, [h, w])
    assert cfg.data.vae is None and cfg.data.latent_channels == 16
    by_hand = (t // m.tubelet_size) * (h // m.patch_size) * (w // m.patch_size)
    assert by_hand == grid[0] * grid[1] * grid[2]
    lp = latent_plan(cfg)
    assert (lp.latent_shape, lp.pixel_shape, lp.tokens) == (latent, pixels, by_hand)
    assert ModelShape.from_config(m).tokens == by_hand
    assert lp.decoder_params is None and lp.decode_bytes == 0 and "data.vae is not set" in lp.unknown


@pytest.mark.parametrize("exp", ["latent_img1024", "latent_video_wan"])
def test_latent_recipes_fit_every_phase_on_8_h100(exp):
    """vitp-plan's first row of each latent recipe fits 8 x H100 (80 GiB) and matches the recipe's layout."""
    from vitp.config import validate_config

    cfg = compose_cfg([f"experiment={exp}", "data.num_classes=10"])
    layout = validate_config(cfg, world_size=8, device_type="cuda")
    best = plan(cfg, 8, get_profile("h100", 80))[0]
    assert best.fits and (best.layout.tp, best.layout.cp, best.layout.pp, best.layout.dp) == (
        layout.tp, layout.cp, layout.pp, layout.dp)
    assert best.layout.micro == cfg.trainer.micro_batch_size
    for c in phase_costs_of(cfg, best, to_dict(cfg.model), get_profile("h100", 80)):
        assert c.memory_bytes <= best.limit_bytes, c


@pytest.mark.parametrize("name", sorted(VAE_CASES))
def test_decoder_parameters_and_decode_memory(vaes, name):
    """The plan's decoder count is the built decoder's ``numel`` sum; its decode activations (the meta
    device's simulation) are the live bytes of a real CPU decode of one sample, to the byte."""
    import diffusers

    cls, vae_cfg = small_configs()[name]
    cfg = _vae_cfg(name, vaes[name])
    lp = latent_plan(cfg)
    built = getattr(diffusers, cls).from_pretrained(vaes[name], local_files_only=True)
    assert lp.vae_class == cls and lp.decoder_params == sum(p.numel() for p in built.decoder.parameters())
    assert lp.encoder_params == sum(p.numel() for p in built.encoder.parameters())
    assert lp.decoder_bytes == 4 * lp.decoder_params
    shape = VAE_CASES[name][1]
    assert lp.latent_shape == (tuple(shape[1:]) if len(shape) == 5 else (shape[1], 1, *shape[2:]))
    measured = decode_peak_bytes(cls, vae_cfg, shape, device="cpu")
    assert lp.decode_activation_bytes == measured > 0
    assert lp.decode_bytes == lp.decoder_bytes + measured


def test_vitp_plan_prints_and_counts_the_vae(vaes, capsys):
    """vitp-plan: the latent line, the decoder line, JSON ``latents``; the sample grid and final
    samples (not the held-out loss) grow by the decode bytes; an unreadable folder is "unknown"."""
    from vitp.cli.plan import run

    over = ["experiment=smoke", "data=synthetic", "data.channels=3", "data.num_classes=4", "data.resolution=16"]
    args = ["--gpus", "1", "--device", "h100", "--top", "1", "--ac", "0", "--micro", "4"]
    with_vae = run([*args, *over, f"data.vae={vaes['kl']}"])  # latent_channels / compression read from the VAE
    text = capsys.readouterr().out
    lp = latent_plan(_vae_cfg("kl", vaes["kl"]))
    assert "latents: 4 x 1 x 8 x 8 (C' x T' x h x w) per sample, decoded to 3 x 1 x 16 x 16 pixels" in text
    assert f"VAE decoder (AutoencoderKL, {vaes['kl']}): {lp.decoder_params:,} parameters" in text
    without = run([*args, *over, "data.latent_channels=4", "data.vae_compression=[1,2]"])
    assert "VAE decoder: unknown (data.vae is not set" in capsys.readouterr().out
    grown = [a["memory_bytes"] - b["memory_bytes"] for a, b in zip(with_vae[0]["phases"], without[0]["phases"])]
    assert grown == [lp.decode_bytes, 0, lp.decode_bytes]
    run([*args, "--json", *over, f"data.vae={vaes['kl']}"])
    out = json.loads(capsys.readouterr().out)["latents"]
    assert out["tokens"] == 16 and out["decoder_params"] == lp.decoder_params
    assert out["decode_activation_bytes"] == lp.decode_activation_bytes and out["unknown"] is None
    run([*args, "--json", *over, *LATENT_S, "data.vae=/nonexistent/vae"])
    out = json.loads(capsys.readouterr().out)["latents"]
    assert out["decoder_params"] is None and out["decode_bytes_counted"] == 0
    assert out["unknown"].startswith("data.vae=/nonexistent/vae is not readable here")
    pixel = run([*args, "--json", *over])  # pixel space: no latents
    assert json.loads(capsys.readouterr().out)["latents"] is None and pixel


def test_vae_geometry_must_agree_with_the_recipe(vaes):
    with pytest.raises(ValueError, match=r"data.latent_channels=4 data.vae_compression=\[1,2\]"):
        with_vae_geometry(compose_cfg(["experiment=smoke", f"data.vae={vaes['kl']}", "data.latent_channels=8",
                                       "data.resolution=16", "data.channels=3"]))


def test_latent_run_is_its_pixel_twin_to_the_planner():
    """The model config of a latent run equals that of a pixel run of the latent shape: same
    parameters, tokens and per-stage memory."""
    from vitp.plan import LayoutSpec, layer_params, stage_memory

    lat, twin = compose_cfg([*PLAN_MODELS["S"], *LATENT_S]), compose_cfg([*PLAN_MODELS["S"], *TWIN_S])
    assert ModelShape.from_config(lat.model) == ModelShape.from_config(twin.model)
    assert ModelShape.from_config(lat.model).tokens == 16 and latent_plan(lat).tokens == 16
    assert layer_params(lat.model) == layer_params(twin.model)
    lay = LayoutSpec(1, 1, 1, False, 0, 2, 4)
    assert stage_memory(to_dict(lat.model), lay) == stage_memory(to_dict(twin.model), lay)


def test_latent_run_memory_matches_a_measured_step(tmp_path):
    """A latent run of model S (1 rank, 4 micro-batches of 2): the plan's parameters are exact and
    its weights, gradients, optimizer, EMA and activations within 10 % of a real training step of
    the latent run (synthetic data of the latent shape: ``data=synthetic`` with latent fields)."""
    from tests.distributed.plan_measure import measure_rank
    from tests.helpers import run_ranks
    from vitp.plan import layout_of, stage_memory

    lat = compose_cfg([*plan_case("S", 1, 1, 1), *LATENT_S])
    pred = stage_memory(lat.model, layout_of(lat, 1))[0]
    (m,) = run_ranks(1, measure_rank, {"L": [*plan_case("S", 1, 1, 1), *LATENT_S]}, str(tmp_path), timeout=600)
    m = m["L"]
    assert m["params"] == pred.params
    for key, p in (("weights", pred.weights), ("grads", pred.grads), ("optimizer", pred.optimizer),
                   ("ema", pred.ema), ("activations", pred.activations + pred.recompute + pred.pipe_buffers)):
        assert abs(p / m[key] - 1) <= 0.10, (key, m[key], p)
    print(f"\nlatent S: params {m['params']}, activations measured {m['activations']} predicted "
          f"{pred.activations + pred.recompute + pred.pipe_buffers:.0f}")
