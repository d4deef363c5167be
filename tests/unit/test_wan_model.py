"""vitp's Wan transformer against diffusers' ``WanTransformer3DModel``: the same output from the
same weights (read from a sharded pipeline folder), faults that this comparison catches, the
exact round trip of the weights back to a folder diffusers loads, and the options and folders
that are refused. Tiny random models (scripts/make_tiny_wan.py), CPU, a few seconds in all."""
from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import make_tiny_wan
from vitp.models import WanModel, from_pretrained
from vitp.models import wan as wan_module
from vitp.models.wan_keys import INDEX, save_pretrained, to_diffusers_state

SHAPES = [(2, 8, 8), (3, 8, 12)]  # latent (T, H, W): square, and non-square with an odd frame count
RTOL = 1e-5


def _script():
    return make_tiny_wan()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The diffusers reference and a sharded pipeline folder holding its weights."""
    script = _script()
    ref = script.tiny_transformer(seed=0)
    pipe = script.write_pipeline(tmp_path_factory.mktemp("wan") / "pipe", sharded=True, vae=False, transformer=ref)
    return SimpleNamespace(script=script, ref=ref, pipe=pipe, model=from_pretrained(pipe))


def _inputs(shape, seed=0, batch=2, channels=4, text_dim=32, text_len=7):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, channels, *shape, generator=g)
    t = torch.rand(batch, generator=g) * 1000  # diffusers' scale
    return x, t, torch.randn(batch, text_len, text_dim, generator=g)


@torch.no_grad()
def _rel_err(model, ref, shape):
    """``|vitp - diffusers| / |diffusers|`` (Frobenius norms) of one forward, and both outputs."""
    args = _inputs(shape)
    out, want = model(*args), ref(*args, return_dict=False)[0]
    return ((out - want).norm() / want.norm()).item(), out, want


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_diffusers(tiny, shape):
    assert (tiny.pipe / "transformer" / INDEX).is_file()
    assert len(list((tiny.pipe / "transformer").glob("diffusion_pytorch_model-*.safetensors"))) > 1
    model = tiny.model
    assert not model.training
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.parameters())
    err, out, want = _rel_err(model, tiny.ref, shape)
    assert out.shape == want.shape == (2, 4, *shape)
    torch.testing.assert_close(out, want, rtol=RTOL, atol=1e-6)
    assert err <= RTOL


def test_forward_without_cross_attn_norm_matches_diffusers(tiny, tmp_path):
    ref = tiny.script.tiny_transformer(seed=1, cross_attn_norm=False)
    model = from_pretrained(tiny.script.write_transformer(ref, tmp_path / "t"))  # a transformer folder, one file
    assert isinstance(model.blocks[0].norm2, nn.Identity)
    err, out, want = _rel_err(model, ref, SHAPES[1])
    torch.testing.assert_close(out, want, rtol=RTOL, atol=1e-6)
    assert err <= RTOL


def test_bf16_cast_computes_as_diffusers_bf16(tiny):
    """``WanModel.cast(bf16)`` keeps diffusers' fp32 modules in fp32; the reference is cast the way
    diffusers' ``from_pretrained(torch_dtype=bf16)`` casts (``_keep_in_fp32_modules``)."""
    ref = tiny.script.tiny_transformer(seed=0)
    for name, p in ref.named_parameters():
        p.data = p.data.to(torch.float32 if any(k in name for k in ref._keep_in_fp32_modules) else torch.bfloat16)
    model = from_pretrained(tiny.pipe).cast(torch.bfloat16)
    assert sum(p.dtype == torch.float32 for p in model.parameters()) == \
        sum(p.dtype == torch.float32 for p in ref.parameters())
    x, t, text = _inputs(SHAPES[1])
    with torch.no_grad():
        out, want = model(x.bfloat16(), t, text.bfloat16()), ref(x.bfloat16(), t, text.bfloat16(), return_dict=False)[0]
    assert out.dtype == want.dtype == torch.bfloat16
    # bf16 itself is ~5e-3 from fp32 here; the two bf16 models agree far closer (bit-exact on CPU)
    assert ((out.float() - want.float()).norm() / want.float().norm()).item() <= 1e-3


class _PerHeadRMSNorm(nn.Module):
    """Fault: RMSNorm of each head on its own (a ``qk_norm="rms_norm"`` misreading) with the
    across-heads norm's weight."""

    def __init__(self, norm: nn.RMSNorm, heads: int):
        super().__init__()
        self.norm, self.heads = norm, heads

    def forward(self, x):
        hd = x.shape[-1] // self.heads
        y = F.rms_norm(x.unflatten(-1, (self.heads, hd)), (hd,), eps=self.norm.eps).flatten(-2)
        return y * self.norm.weight


def _per_head_norms(monkeypatch, model):
    for blk in model.blocks:
        for name in ("q_norm", "k_norm"):
            monkeypatch.setattr(blk.attn, name, _PerHeadRMSNorm(getattr(blk.attn, name), blk.attn.num_heads))


def _rotate_half(x, cos, sin):  # fault: rotary over (j, j + hd/2) pairs (GPT-NeoX layout), not (2j, 2j + 1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


_ROPE_DIMS, _SINUSOID = wan_module.rope_dims, wan_module.timestep_sinusoid
FAULTS = {
    "per_head_qk_norm": _per_head_norms,
    "rope_split_t_w_swapped": lambda mp, m: mp.setattr(wan_module, "rope_dims",
                                                       lambda hd: tuple(reversed(_ROPE_DIMS(hd)))),
    "rope_rotate_half": lambda mp, m: mp.setattr(wan_module, "apply_rotary", _rotate_half),
    "timestep_sin_cos_unflipped": lambda mp, m: mp.setattr(
        wan_module, "timestep_sinusoid", lambda t, d: _SINUSOID(t, d).roll(d // 2, -1)),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_parity_check_catches_a_fault(tiny, monkeypatch, fault):
    """Each fault moves the output by far more than the parity tolerance, so the parity test would fail."""
    model = from_pretrained(tiny.pipe)  # fresh: no rotary tables cached
    FAULTS[fault](monkeypatch, model)
    err, out, want = _rel_err(model, tiny.ref, SHAPES[1])
    assert err > 100 * RTOL, f"{fault}: relative error {err:.2e}"
    with pytest.raises(AssertionError):
        torch.testing.assert_close(out, want, rtol=RTOL, atol=1e-6)


def _diffusers_load(folder, monkeypatch):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_pretrained(str(folder), output_loading_info=True)


def test_export_loads_in_diffusers_bit_identical(tiny, tmp_path, monkeypatch):
    model, source = tiny.model, tiny.ref.state_dict()
    exported = to_diffusers_state(model.state_dict(), model.config)
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[k], source[k]) for k in source)
    loaded, info = _diffusers_load(save_pretrained(model, tmp_path / "export"), monkeypatch)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert all(torch.equal(v, source[k]) for k, v in loaded.state_dict().items())
    back = from_pretrained(tmp_path / "export").state_dict()
    assert all(torch.equal(v, back[k]) for k, v in model.state_dict().items())


def _edited_copy(tiny, tmp_path, **changes):
    folder = shutil.copytree(tiny.pipe / "transformer", tmp_path / "t")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **changes}))
    return folder


@pytest.mark.parametrize("key,value", [("image_dim", 1280), ("added_kv_proj_dim", 5120), ("qk_norm", "rms_norm"),
                                       ("expand_timesteps", True), ("window_sizes", [1, 1])])
def test_unsupported_options_are_refused_naming_the_key(tiny, tmp_path, key, value):
    with pytest.raises(ValueError, match=key):
        from_pretrained(_edited_copy(tiny, tmp_path, **{key: value}))
    with pytest.raises(ValueError, match=key):
        WanModel(dict(tiny.script.TINY, **{key: value}))


def test_folders_that_cannot_be_loaded_are_refused_naming_the_path(tiny, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        from_pretrained(missing)
    pipe = shutil.copytree(tiny.pipe, tmp_path / "pipe")
    shutil.rmtree(pipe / "transformer")
    with pytest.raises(FileNotFoundError, match=re.escape(str(pipe / "transformer"))):
        from_pretrained(pipe)
    index = json.loads((pipe / "model_index.json").read_text())
    (pipe / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanImageToVideoPipeline"}))
    with pytest.raises(ValueError, match="WanImageToVideoPipeline conditions on an image"):
        from_pretrained(pipe)
    with pytest.raises(ValueError, match="FluxTransformer2DModel"):
        from_pretrained(_edited_copy(tiny, tmp_path, _class_name="FluxTransformer2DModel"))


def test_weights_that_do_not_match_the_config_are_refused(tiny, tmp_path):
    folder = _edited_copy(tiny, tmp_path, num_layers=3)
    with pytest.raises(ValueError, match=r"missing \['blocks\.2\."):
        from_pretrained(folder)
    (folder / INDEX).unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        from_pretrained(folder)


def _per_token(t, tokens, first_frame=0):
    """Per-token timesteps ``(B, N)`` as WanPipeline's expand_timesteps builds them: ``t`` on every
    token, the first ``first_frame`` tokens at 0 (TI2V's image-conditioned first frame)."""
    ts = t[:, None].expand(t.shape[0], tokens).clone()
    ts[:, :first_frame] = 0
    return ts


@pytest.mark.parametrize("first_frame", [0, 16], ids=["text_to_video", "first_frame_at_0"])
def test_per_token_timesteps_match_diffusers(tiny, monkeypatch, first_frame):
    """Wan 2.2 TI2V's (B, N) timesteps: all equal (text-to-video) and with the first latent frame's 16
    tokens at 0; equal to diffusers' per-token path. Ignoring the per-token timesteps (the first
    token's for all) fails the second."""
    x, t, text = _inputs(SHAPES[0])
    ts = _per_token(t, 2 * 4 * 4, first_frame)
    with pytest.raises(ValueError, match=r"timestep \(2, 31\): give one timestep per sample \(2,\) or one per "
                                         r"token \(2, 32\)"):
        tiny.model(x, ts[:, :31], text)
    with torch.no_grad():
        want = tiny.ref(x, ts, text, return_dict=False)[0]
        out = tiny.model(x, ts, text)
        torch.testing.assert_close(out, want, rtol=RTOL, atol=1e-6)
        if first_frame:
            assert ((out - tiny.model(x, t, text)).norm() / want.norm()).item() > 1e-2  # they matter
            monkeypatch.setattr(wan_module, "per_sample_timestep", lambda ts, b, n: ts[:, 0])  # fault: ignored
            err = ((tiny.model(x, ts, text) - want).norm() / want.norm()).item()
            assert err > 100 * RTOL, err


def test_make_tiny_wan_writes_a_pipeline_folder_vitp_loads(tiny, tmp_path, capsys):
    tiny.script.main([str(tmp_path / "pipe"), "--no-vae", "--seed", "3"])
    files = json.loads(capsys.readouterr().out)["files"]
    assert {"model_index.json", "scheduler/scheduler_config.json", "transformer/config.json",
            "transformer/diffusion_pytorch_model.safetensors"} <= set(files)
    model = from_pretrained(tmp_path / "pipe")
    assert model.config.num_layers == 2 and model.config.width == 32
    tiny.script.main([str(tmp_path / "a14b"), "--no-vae", "--two-experts"])  # Wan 2.2 A14B's layout
    files = json.loads(capsys.readouterr().out)["files"]
    assert "transformer_2/config.json" in files
    assert json.loads((tmp_path / "a14b" / "model_index.json").read_text())["boundary_ratio"] == 0.8
    low = from_pretrained(tmp_path / "a14b", subfolder="transformer_2")
    assert not torch.equal(low.blocks[0].mlp.fc1.weight, from_pretrained(tmp_path / "a14b").blocks[0].mlp.fc1.weight)
    with pytest.raises(SystemExit):  # one layout or the other
        tiny.script.main([str(tmp_path / "x"), "--two-experts", "--ti2v"])


# ---------------------------------------------------------------------------------- user mistakes
def test_transformer_folder_with_another_subfolder_is_refused(tiny):
    """Asking a transformer folder for transformer_2 would silently load the given folder."""
    with pytest.raises(ValueError, match=r"transformer folder .*subfolder='transformer_2'.*pass the pipeline folder"):
        from_pretrained(tiny.pipe / "transformer", subfolder="transformer_2")
    assert from_pretrained(tiny.pipe / "transformer", subfolder=None).config.num_layers == 2  # None: the folder
    with pytest.raises(FileNotFoundError, match="subfolder=None takes a transformer folder"):
        from_pretrained(tiny.pipe, subfolder=None)
    with pytest.raises(TypeError, match="subfolder=2 must be a folder name"):
        from_pretrained(tiny.pipe, subfolder=2)


def test_pipelines_vitp_cannot_sample_are_refused_naming_the_fix(tiny, tmp_path):
    """An image-to-video pipeline (also through its transformer/ folder), a transformer_2 without
    boundary_ratio, a boundary_ratio without transformer_2, a listed transformer_2 that is missing."""
    from vitp.models.wan_config import read_pipeline

    pipe = shutil.copytree(tiny.pipe, tmp_path / "pipe")
    index = json.loads((pipe / "model_index.json").read_text())
    assert read_pipeline(pipe).experts == ("transformer",) and not read_pipeline(pipe).expand_timesteps
    two = {"transformer_2": ["diffusers", "WanTransformer3DModel"]}
    for changes, error, message in [
            ({"_class_name": "WanImageToVideoPipeline"}, ValueError,
             "WanImageToVideoPipeline conditions on an image or video (the image-conditioned first frame"),
            ({**two, "boundary_ratio": None}, ValueError,
             "lists transformer_2 (Wan 2.2 A14B's low-noise expert) but boundary_ratio=None; the pipeline switches "
             "experts at boundary_ratio * num_train_timesteps: set \"boundary_ratio\": 0.875"),
            ({"boundary_ratio": 0.9}, ValueError, "has boundary_ratio=0.9 but no transformer_2"),
            ({**two, "boundary_ratio": 0.9}, FileNotFoundError,
             f"{pipe / 'transformer_2' / 'config.json'} does not exist, but {pipe / 'model_index.json'} lists")]:
        (pipe / "model_index.json").write_text(json.dumps({**index, **changes}))
        with pytest.raises(error, match=re.escape(message)):
            from_pretrained(pipe)
    (pipe / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanImageToVideoPipeline"}))
    with pytest.raises(ValueError, match="WanImageToVideoPipeline conditions on an image"):
        from_pretrained(pipe / "transformer")


@pytest.mark.parametrize("key", ["num_layers", "text_dim", "patch_size", "ffn_dim"])
def test_config_missing_a_size_key_is_refused_naming_key_and_file(tiny, tmp_path, key):
    folder = _edited_copy(tiny, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg[key]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=re.escape(str(folder / "config.json")) + rf": missing \['{key}'\]"):
        from_pretrained(folder)


@pytest.mark.parametrize("key,value,want", [("num_layers", "two", "an integer"), ("num_attention_heads", 2.5, "an integer"),
                                            ("patch_size", 2, "a list of three integers"),
                                            ("cross_attn_norm", "yes", "true or false")])
def test_config_values_of_the_wrong_type_are_refused(tiny, tmp_path, key, value, want):
    folder = _edited_copy(tiny, tmp_path, **{key: value})
    with pytest.raises(ValueError, match=re.escape(f"config.json: {key}={value!r} must be {want}")):
        from_pretrained(folder)
    with pytest.raises(ValueError, match=re.escape(f"{key}={value!r} must be {want}")):
        WanModel(dict(tiny.script.TINY, **{key: value}))


def test_config_that_is_not_an_object_is_refused(tiny, tmp_path):
    folder = _edited_copy(tiny, tmp_path)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=re.escape(str(folder / "config.json")) + " holds a JSON list, not an object"):
        from_pretrained(folder)


@pytest.mark.parametrize("damage", ["empty", "truncated", "random"])
def test_damaged_safetensors_are_refused_naming_the_file(tiny, tmp_path, damage):
    folder = _edited_copy(tiny, tmp_path)
    shard = sorted(folder.glob("diffusion_pytorch_model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes({"empty": b"", "truncated": data[: len(data) // 2], "random": bytes(range(256)) * 8}[damage])
    with pytest.raises(ValueError, match=re.escape(str(shard)) + " is not a readable safetensors file.*copy it again"):
        from_pretrained(folder)


def test_weights_of_another_shape_than_the_config_are_refused(tiny, tmp_path):
    folder = _edited_copy(tiny, tmp_path, text_dim=64)
    with pytest.raises(ValueError, match=re.escape(f"{folder}: weight condition_embedder.text_embedder.linear_1.weight "
                                                   "has shape (32, 32) but") + r".* implies \(32, 64\)"):
        from_pretrained(folder)


def test_save_pretrained_refuses_a_diffusers_model_and_a_file(tiny, tmp_path):
    with pytest.raises(TypeError, match="takes a vitp WanModel.*WanTransformer3DModel.*model.save_pretrained"):
        save_pretrained(tiny.ref, tmp_path / "out")
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match=re.escape(str(tmp_path / "file")) + " is an existing file"):
        save_pretrained(tiny.model, tmp_path / "file")


def test_cast_takes_floating_dtypes_and_their_names(tiny):
    model = from_pretrained(tiny.pipe).cast("bfloat16")
    assert model.embed.x_embedder.proj.weight.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"torch.int8 is not a floating dtype"):
        model.cast(torch.int8)
    with pytest.raises(ValueError, match=r"'bfloat' is not a floating dtype name"):
        model.cast("bfloat")


def test_latents_of_another_shape_are_refused_before_the_conv(tiny):
    x, t, text = _inputs(SHAPES[0])
    with pytest.raises(ValueError, match=re.escape("hidden_states (2, 4, 8, 8) must be latents (B, 4, T, H, W)")):
        tiny.model(x[:, :, 0], t, text)
    with pytest.raises(ValueError, match=re.escape("hidden_states (2, 16, 2, 8, 8) must be latents (B, 4, T, H, W)")):
        tiny.model(x.repeat(1, 4, 1, 1, 1), t, text)


def test_tiling_error_names_one_value_when_both_are_equal(tiny):
    x, t, text = _inputs((3, 8, 9))
    with pytest.raises(ValueError, match=r"valid sizes near it: frames 3, 8x8 or 8x10 pixels"):
        tiny.model(x, t, text)
