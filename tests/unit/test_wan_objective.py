"""Wan's objective and sampling against diffusers: the loss of vitp's WanModel equals the loss of
diffusers' WanTransformer3DModel on the same x_t, timestep and target; vitp's sampler with vitp's
WanModel gives WanPipeline's final latents (UniPC and Euler schedulers, CFG, Wan 2.2's two
experts) and frames; injected faults make these comparisons fail; the caption padding is the
pipeline's; the training noise draw has the distribution it claims. Tiny random models
(scripts/make_tiny_wan.py), CPU, a few seconds each."""
from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.helpers import make_tiny_wan
from vitp.models import from_pretrained
from vitp.objectives import wan_flow, wan_sampling
from vitp.objectives.wan_flow import (WanFlowLoss, bell_weights, draw_sigmas, make_wan_pair, shift_sigma, sigma_cdf,
                                      wan_loss)
from vitp.objectives.wan_sampling import decode_latents, load_scheduler, pad_prompt_embeds, sample_wan

REPO = Path(__file__).resolve().parents[2]
SHIFT = 3.0  # the tiny folder's scheduler flow_shift
LATENT = (2, 4, 3, 8, 8)  # (B, C, T, H, W): decodes to 9 frames of 64 x 64
CALL = dict(height=64, width=64, num_frames=9)
LOSS_RTOL, SAMPLE_TOL = 1e-5, 1e-4
MEASURED = {}  # max errors, printed at the end of the module (pytest -s)


def _script():
    return make_tiny_wan()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny pipeline folder (UniPC, shift 3, VAE), diffusers' WanPipeline loaded from it, vitp's
    WanModel of its transformer; and a second expert (Wan 2.2) as both."""
    from diffusers import WanPipeline, WanTransformer3DModel
    from diffusers.utils import is_accelerate_available

    script, root = _script(), tmp_path_factory.mktemp("wanobj")
    folder = script.write_pipeline(root / "pipe", seed=0)
    expert_2 = script.write_transformer(script.tiny_transformer(seed=7), root / "expert_2")
    with pytest.MonkeyPatch.context() as mp:
        if not is_accelerate_available():  # as tests/unit/test_wan_model.py: fp32 keeps nothing to keep
            mp.setattr(WanTransformer3DModel, "_keep_in_fp32_modules", None)
        pipe = WanPipeline.from_pretrained(str(folder), text_encoder=None, tokenizer=None)
        ref_2 = WanTransformer3DModel.from_pretrained(str(expert_2))
    pipe.set_progress_bar_config(disable=True)
    return SimpleNamespace(folder=folder, pipe=pipe, ref_2=ref_2, model=from_pretrained(folder).eval(),
                           model_2=from_pretrained(expert_2).eval())


def _embeds(seed, batch=2, text_dim=32):
    """Prompt and negative prompt embeddings as WanPipeline passes them: (B, 512, text_dim), zero-padded."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(2, batch, 24, text_dim, generator=g)
    return (pad_prompt_embeds(raw[0], torch.tensor([9, 24][:batch])),
            pad_prompt_embeds(raw[1], torch.tensor([3, 1][:batch])))


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# ------------------------------------------------------------------------------------------------ the loss
def _reference_loss(dit, x, eps, s, text):
    """The flow-matching loss written out for diffusers' model (DiffSynth-Studio / finetrainers form)."""
    ss = s.view(-1, 1, 1, 1, 1)
    x_t, target = (1 - ss) * x + ss * eps, eps - x
    pred = dit(hidden_states=x_t, timestep=s * 1000, encoder_hidden_states=text, return_dict=False)[0]
    return F.mse_loss(pred.float(), target.float())


def _loss_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x, eps = torch.randn(LATENT, generator=g), torch.randn(LATENT, generator=g)
    s = WanFlowLoss(SHIFT).draw_sigmas(LATENT[0], g)
    return x, eps, s, _embeds(seed)[0]


@torch.no_grad()
def test_loss_matches_diffusers_model(tiny):
    x, eps, s, text = _loss_inputs()
    want = _reference_loss(tiny.pipe.transformer, x, eps, s, text)
    got = wan_loss(tiny.model, x, eps, s, text)
    inputs, targets = make_wan_pair(x, eps, s, text)
    loss_fn = WanFlowLoss.from_pipeline(tiny.folder)
    via_pair = loss_fn(tiny.model(*inputs), targets)
    MEASURED["loss rel err"] = abs(got.item() - want.item()) / want.item()
    assert got.dtype == torch.float32 and want.item() > 0.1
    assert math.isclose(got.item(), want.item(), rel_tol=LOSS_RTOL)
    assert torch.equal(via_pair, got)
    rec_s, rec_loss = loss_fn.pop_records()
    assert torch.equal(rec_s, s) and math.isclose(rec_loss.mean().item(), got.item(), rel_tol=1e-6)
    # the bell weighting multiplies each sample's MSE by its weight
    per = torch.stack([_reference_loss(tiny.pipe.transformer, *(v[i:i + 1] for v in (x, eps, s, text)))
                       for i in range(LATENT[0])])
    bell = wan_loss(tiny.model, x, eps, s, text, weighting="bell", shift=SHIFT)
    assert math.isclose(bell.item(), (per * bell_weights(s, SHIFT)).mean().item(), rel_tol=LOSS_RTOL)


LOSS_FAULTS = {
    "timestep_in_sigma_units": lambda mp: mp.setattr(wan_flow, "NUM_TRAIN_TIMESTEPS", 1),
    "target_x_minus_eps": lambda mp: mp.setattr(wan_flow, "velocity_target", lambda x, eps: x.float() - eps.float()),
}


@pytest.mark.parametrize("fault", sorted(LOSS_FAULTS))
@torch.no_grad()
def test_loss_parity_catches_a_fault(tiny, monkeypatch, fault):
    x, eps, s, text = _loss_inputs()
    want = _reference_loss(tiny.pipe.transformer, x, eps, s, text).item()
    LOSS_FAULTS[fault](monkeypatch)
    err = abs(wan_loss(tiny.model, x, eps, s, text).item() - want) / want
    MEASURED[f"loss fault {fault}"] = err
    assert err > 100 * LOSS_RTOL


# -------------------------------------------------------------------------------------------- sampling
def _noise(seed=1):
    return torch.randn(LATENT, generator=torch.Generator().manual_seed(seed))


def _pipeline_latents(tiny, scheduler, cfg=5.0, output_type="latent", **kw):
    from diffusers import FlowMatchEulerDiscreteScheduler

    pos, neg = _embeds(2)
    pipe = tiny.pipe
    saved = pipe.scheduler
    if scheduler == "euler":  # built by hand, as diffusers' Wan docs do: FlowMatchEulerDiscreteScheduler(shift=...)
        pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=SHIFT)
    try:
        return pipe(prompt_embeds=pos, negative_prompt_embeds=neg, latents=_noise(), num_inference_steps=4,
                    guidance_scale=cfg, output_type=output_type, **CALL, **kw).frames
    finally:
        pipe.scheduler = saved


def _vitp_latents(tiny, scheduler, cfg=5.0, flow_shift=None, **kw):
    pos, neg = _embeds(2)
    return sample_wan(tiny.model, load_scheduler(tiny.folder, scheduler, flow_shift), _noise(), pos, neg,
                      num_inference_steps=4, guidance_scale=cfg, **kw)


@pytest.mark.parametrize("scheduler", ["unipc", "euler"])
def test_sampling_matches_wan_pipeline(tiny, scheduler):
    want = _pipeline_latents(tiny, scheduler)
    got = _vitp_latents(tiny, scheduler)
    err = (got - want).abs().max().item()
    MEASURED[f"latents {scheduler} max abs err"] = err
    assert got.shape == want.shape == LATENT and got.dtype == torch.float32
    assert not torch.allclose(got, _noise(), atol=0.1)  # it moved
    torch.testing.assert_close(got, want, rtol=SAMPLE_TOL, atol=SAMPLE_TOL)


def test_decoded_frames_match_wan_pipeline_within_one_level(tiny):
    want = _pipeline_latents(tiny, "unipc", output_type="np")
    got = decode_latents(tiny.pipe.vae, _vitp_latents(tiny, "unipc"))
    assert isinstance(got, np.ndarray) and got.shape == want.shape == (2, 9, 64, 64, 3)
    inside = ((want > 0.02) & (want < 0.98)).mean()  # most values not clipped: the check sees the decoder
    levels = np.abs(got - want).max() * 255
    MEASURED["frames max diff (8-bit levels)"] = levels
    assert inside > 0.5 and levels <= 1.0


@pytest.mark.parametrize("mid_level", [True, False])
def test_fid_and_fvd_read_the_pipelines_8_bit_frames(tiny, mid_level):
    """What FID and FVD read of a Wan sample (vitp.eval.wan_eval.wan_quality_metrics: to_frames with
    mid_level, then guided-diffusion's truncating quantisation of vitp.eval.fid.to_uint8 /
    vitp.eval.fvd.to_clips) is WanPipeline's 8-bit output (numpy_to_pil: round(frames * 255)) of the
    same latents, every value; frames at L / 127.5 - 1 (mid_level=False, the grids' form) lose a level
    on a quarter of the 256 levels (6 % of these values), which this check catches."""
    from diffusers.image_processor import VaeImageProcessor

    from vitp.eval.fid import to_uint8
    from vitp.eval.fvd import to_clips
    from vitp.eval.wan_eval import to_frames

    lat = _vitp_latents(tiny, "unipc")
    frames = decode_latents(tiny.pipe.vae, lat)  # (B, F, H, W, 3) in [0, 1], the pipeline's decode (test above)
    want = np.stack([np.stack([np.asarray(im) for im in VaeImageProcessor.numpy_to_pil(v)]) for v in frames])
    x = to_frames(tiny.folder, lat, mid_level=mid_level)
    clips, images = to_clips(x).numpy(), to_uint8(x).numpy()
    assert clips.shape == want.shape == (2, 9, 64, 64, 3) and len(np.unique(want)) > 200
    wrong = (clips != want).mean()
    MEASURED[f"8-bit values differing from WanPipeline's (mid_level={mid_level})"] = wrong
    if mid_level:
        assert np.array_equal(clips, want) and np.array_equal(images, want[:, 0])
    else:  # the fault
        assert wrong > 0.02


@pytest.mark.parametrize("scheduler", ["unipc", "euler"])
def test_bf16_sampling_matches_wan_pipeline_bf16(tiny, scheduler):
    """bf16 weights (fp32 kept where diffusers keeps it): latents go into the denoiser in bf16 each
    step and the scheduler steps on what it is given, as in the pipeline."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel

    ref = WanTransformer3DModel.from_config(tiny.pipe.transformer.config)
    ref.load_state_dict(tiny.pipe.transformer.state_dict())
    for name, p in ref.named_parameters():  # as from_pretrained(torch_dtype=bf16) with _keep_in_fp32_modules
        p.data = p.data.to(torch.float32 if any(k in name for k in ref._keep_in_fp32_modules) else torch.bfloat16)
    sched = FlowMatchEulerDiscreteScheduler(shift=SHIFT) if scheduler == "euler" else tiny.pipe.scheduler
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=tiny.pipe.vae, scheduler=sched, transformer=ref)
    pipe.set_progress_bar_config(disable=True)
    pos, neg = _embeds(2)
    want = pipe(prompt_embeds=pos, negative_prompt_embeds=neg, latents=_noise(), num_inference_steps=4,
                output_type="latent", **CALL).frames
    model = from_pretrained(tiny.folder).cast(torch.bfloat16).eval()
    got = sample_wan(model, load_scheduler(tiny.folder, scheduler), _noise(), pos, neg, num_inference_steps=4)
    MEASURED[f"latents bf16 {scheduler} max abs err"] = (got.float() - want.float()).abs().max().item()
    assert got.dtype == want.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=SAMPLE_TOL, atol=SAMPLE_TOL)


def _two_expert_pipeline(tiny):
    from diffusers import WanPipeline

    p = tiny.pipe
    return WanPipeline(tokenizer=None, text_encoder=None, vae=p.vae, scheduler=p.scheduler, transformer=p.transformer,
                       transformer_2=tiny.ref_2, boundary_ratio=0.8)


class _Counting(nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model, self.timesteps = model, []

    def forward(self, x, t, text):
        self.timesteps.append(float(t[0]))
        return self.model(x, t, text)


def test_two_experts_match_wan_pipeline(tiny):
    """Wan 2.2: timesteps 999, 900 (>= 800) on the high-noise expert, 750, 500 on the low-noise one,
    each with its own guidance scale."""
    pipe = _two_expert_pipeline(tiny)
    pipe.set_progress_bar_config(disable=True)
    pos, neg = _embeds(2)
    want = pipe(prompt_embeds=pos, negative_prompt_embeds=neg, latents=_noise(), num_inference_steps=4,
                guidance_scale=5.0, guidance_scale_2=2.0, output_type="latent", **CALL).frames
    high, low = _Counting(tiny.model), _Counting(tiny.model_2)
    got = sample_wan(high, load_scheduler(tiny.folder), _noise(), pos, neg, num_inference_steps=4,
                     guidance_scale=5.0, denoiser_2=low, boundary_ratio=0.8, guidance_scale_2=2.0)
    MEASURED["latents two experts max abs err"] = (got - want).abs().max().item()
    assert high.timesteps == [999.0] * 2 + [900.0] * 2 and low.timesteps == [750.0] * 2 + [500.0] * 2
    torch.testing.assert_close(got, want, rtol=SAMPLE_TOL, atol=SAMPLE_TOL)
    same_scale = sample_wan(high, load_scheduler(tiny.folder), _noise(), pos, neg, num_inference_steps=4,
                            guidance_scale=5.0, denoiser_2=low, boundary_ratio=0.8)
    assert _rel(same_scale, want) > 1e-2  # guidance_scale_2 matters


def _wrong_branch(cond, uncond, scale):  # fault: guidance pushes towards the negative prompt
    return cond + scale * (uncond - cond)


SAMPLE_FAULTS = {
    "flow_shift_5_not_3": dict(flow_shift=5.0),
    "cfg_on_the_wrong_branch": dict(patch=("cfg_combine", _wrong_branch)),
    "scheduler_euler_not_unipc": dict(scheduler="euler"),
}


@pytest.mark.parametrize("fault", sorted(SAMPLE_FAULTS))
def test_sampling_parity_catches_a_fault(tiny, monkeypatch, fault):
    want = _pipeline_latents(tiny, "unipc")
    opts = dict(SAMPLE_FAULTS[fault])
    if "patch" in opts:
        monkeypatch.setattr(wan_sampling, *opts.pop("patch"))
    got = _vitp_latents(tiny, opts.pop("scheduler", "unipc"), **opts)
    err = (got - want).abs().max().item()
    MEASURED[f"latents fault {fault} max abs err"] = err
    assert err > 100 * SAMPLE_TOL
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, want, rtol=SAMPLE_TOL, atol=SAMPLE_TOL)


def test_swapped_experts_are_caught(tiny):
    pipe = _two_expert_pipeline(tiny)
    pipe.set_progress_bar_config(disable=True)
    pos, neg = _embeds(2)
    want = pipe(prompt_embeds=pos, negative_prompt_embeds=neg, latents=_noise(), num_inference_steps=4,
                output_type="latent", **CALL).frames
    got = sample_wan(tiny.model_2, load_scheduler(tiny.folder), _noise(), pos, neg, num_inference_steps=4,
                     denoiser_2=tiny.model, boundary_ratio=0.8)
    MEASURED["latents fault experts swapped max abs err"] = (got - want).abs().max().item()
    assert (got - want).abs().max().item() > 100 * SAMPLE_TOL


def test_sampler_refusals(tiny):
    pos, neg = _embeds(2)
    sched = load_scheduler(tiny.folder)
    with pytest.raises(ValueError, match="negative_prompt_embeds"):
        sample_wan(tiny.model, sched, _noise(), pos, None, guidance_scale=5.0)
    with pytest.raises(ValueError, match="boundary_ratio and denoiser_2"):
        sample_wan(tiny.model, sched, _noise(), pos, neg, boundary_ratio=0.8)
    with pytest.raises(ValueError, match="guidance_scale_2"):
        sample_wan(tiny.model, sched, _noise(), pos, neg, guidance_scale_2=3.0)
    with pytest.raises(ValueError, match="same B"):
        sample_wan(tiny.model, sched, _noise(), pos[:1], neg[:1])
    # no guidance: no negative embeddings needed, one pass per step
    counting = _Counting(tiny.model)
    sample_wan(counting, sched, _noise(), pos, None, num_inference_steps=3, guidance_scale=1.0)
    assert len(counting.timesteps) == 3


def test_sampler_refuses_bad_options_and_latents(tiny):
    pos, neg = _embeds(2)
    sched = load_scheduler(tiny.folder)
    for ratio in (0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match=re.escape(f"boundary_ratio={ratio} must lie in (0, 1)")):
            sample_wan(tiny.model, sched, _noise(), pos, neg, denoiser_2=tiny.model_2, boundary_ratio=ratio)
    for steps in (0, -3, 2.5):
        with pytest.raises(ValueError, match=re.escape(f"num_inference_steps={steps!r} must be an integer >= 1")):
            sample_wan(tiny.model, sched, _noise(), pos, neg, num_inference_steps=steps)
    with pytest.raises(TypeError, match=r"scheduler str is not a diffusers scheduler.*load_scheduler\(folder\)"):
        sample_wan(tiny.model, "unipc", _noise(), pos, neg)
    with pytest.raises(ValueError, match=re.escape("latents (2, 16, 3, 8, 8) have 16 channels, the denoiser takes 4")):
        sample_wan(tiny.model, sched, _noise().repeat(1, 4, 1, 1, 1), pos, neg)
    with pytest.raises(ValueError, match=re.escape("negative_prompt_embeds (2, 512, 16) must have the shape of "
                                                   "prompt_embeds (2, 512, 32)")):
        sample_wan(tiny.model, sched, _noise(), pos, neg[..., :16])


def test_noise_levels_outside_zero_one_are_refused():
    x, eps = torch.zeros(2, 4, 1, 2, 2), torch.ones(2, 4, 1, 2, 2)
    for bad in ([1500.0, 0.5], [0.5, -200.0], [float("nan"), 0.5]):
        with pytest.raises(ValueError, match=r"noise levels s \[.*\] lie outside \[0, 1\].*timestep / 1000"):
            make_wan_pair(x, eps, torch.tensor(bad))
    (x_t, timestep), _ = make_wan_pair(x, eps, torch.tensor([0.0, 1.0]))
    assert timestep.tolist() == [0.0, 1000.0]


def test_scheduler_config_that_is_not_json_or_lacks_the_shift(tmp_path, caplog):
    import logging

    path = tmp_path / "scheduler" / "scheduler_config.json"
    path.parent.mkdir()
    path.write_text('{"_class_name": "UniPCMultistepScheduler", ')
    for call in (lambda: load_scheduler(tmp_path), lambda: WanFlowLoss.from_pipeline(tmp_path)):
        with pytest.raises(ValueError, match=re.escape(str(path)) + " is not valid JSON.*copy"):
            call()
    path.write_text('"UniPCMultistepScheduler"')
    with pytest.raises(ValueError, match=re.escape(str(path)) + " holds a JSON str, not an object"):
        WanFlowLoss.from_pipeline(tmp_path)
    path.write_text('{"_class_name": "UniPCMultistepScheduler", "use_flow_sigmas": true, '
                    '"prediction_type": "flow_prediction"}')
    with caplog.at_level(logging.WARNING, logger="vitp.objectives.wan_flow"):
        assert WanFlowLoss.from_pipeline(tmp_path).shift == 1.0
        assert load_scheduler(tmp_path).config.flow_shift == 1.0
    assert "has no flow_shift: using shift 1.0" in caplog.text


# ------------------------------------------------------------------------------------------- schedulers
def test_load_scheduler_kinds_and_shift(tiny, tmp_path):
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    saved = load_scheduler(tiny.folder)
    assert isinstance(saved, UniPCMultistepScheduler) and saved.config.flow_shift == SHIFT
    assert saved.config.use_flow_sigmas and saved.config.prediction_type == "flow_prediction"
    euler = load_scheduler(tiny.folder, "euler", flow_shift=5.0)
    assert isinstance(euler, FlowMatchEulerDiscreteScheduler) and euler.config.shift == 5.0
    assert "flow_shift" not in euler.config  # no stale UniPC option
    euler.save_pretrained(str(tmp_path / "scheduler"))  # a folder saved with Euler converts back to UniPC
    back = load_scheduler(tmp_path, "unipc")
    assert isinstance(back, UniPCMultistepScheduler) and back.config.flow_shift == 5.0
    assert WanFlowLoss.from_pipeline(tmp_path).shift == 5.0 and WanFlowLoss.from_pipeline(tiny.folder).shift == SHIFT
    with pytest.raises(ValueError, match="kind"):
        load_scheduler(tiny.folder, "ddim")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere")):
        load_scheduler(tmp_path / "nowhere")
    DDIMScheduler().save_pretrained(str(tmp_path / "ddim" / "scheduler"))
    with pytest.raises(ValueError, match="DDIMScheduler"):
        load_scheduler(tmp_path / "ddim")
    UniPCMultistepScheduler().save_pretrained(str(tmp_path / "plain" / "scheduler"))
    with pytest.raises(ValueError, match="use_flow_sigmas"):
        load_scheduler(tmp_path / "plain")


# ------------------------------------------------------------------------------------- caption padding
class _Tokenizer:
    """Stands in for umT5's tokenizer: one token per word plus </s>, padded to max_length."""

    def __call__(self, prompt, padding, max_length, truncation, add_special_tokens, return_attention_mask,
                 return_tensors):
        n = torch.tensor([min(len(p.split()) + 1, max_length) for p in prompt])
        mask = (torch.arange(max_length)[None] < n[:, None]).long()
        return SimpleNamespace(input_ids=mask * (1 + torch.arange(max_length)), attention_mask=mask)


class _Encoder(nn.Module):
    """Stands in for umT5's encoder: non-zero outputs at every position, padding included."""

    def __init__(self, dim=32):
        super().__init__()
        self.emb = nn.Embedding(1024, dim)

    def forward(self, ids, mask):
        return SimpleNamespace(last_hidden_state=self.emb(ids) + 1.0)


def test_padding_equals_wan_pipeline_zero_padding():
    from diffusers import WanPipeline

    torch.manual_seed(0)
    tok, enc = _Tokenizer(), _Encoder()
    fake = SimpleNamespace(tokenizer=tok, text_encoder=enc, _execution_device=torch.device("cpu"))
    prompts = ["a cat", "a dog running on a beach at sunset", ""]
    with torch.no_grad():
        want = WanPipeline._get_t5_prompt_embeds(fake, prompts, max_sequence_length=512, dtype=torch.float32)
        t = tok(prompts, "max_length", 512, True, True, True, "pt")
        full = enc(t.input_ids, t.attention_mask).last_hidden_state
    assert want.shape == (3, 512, 32)
    assert torch.equal(pad_prompt_embeds(full, t.attention_mask), want)
    assert torch.equal(pad_prompt_embeds(full[:, :20], t.attention_mask.sum(1)), want)  # lengths, fewer tokens
    long = pad_prompt_embeds(torch.ones(1, 600, 4), torch.tensor([600]))  # cut to 512, as truncation=True
    assert long.shape == (1, 512, 4) and bool((long == 1).all())
    with pytest.raises(ValueError, match=r"\[0, 20\]"):
        pad_prompt_embeds(full[:, :20], torch.tensor([3, 21, 1]))
    with pytest.raises(ValueError, match="mask"):
        pad_prompt_embeds(full, torch.tensor([3, 1]))


# ------------------------------------------------------------------------------------ the noise draw
def _ks(sample, cdf):
    """Kolmogorov-Smirnov distance of ``sample`` to a CDF."""
    x = sample.double().sort().values
    f = cdf(x)
    n = x.numel()
    return max((torch.arange(1, n + 1) / n - f).max().item(), (f - torch.arange(n) / n).max().item())


@pytest.mark.parametrize("sampling", ["uniform", "logit_normal"])
def test_shifted_sigma_draw_statistics(sampling):
    """20000 draws at a fixed seed: in [0, 1], KS distance to the analytic CDF of the shifted
    distribution below 1.2 %, mean as integrated; logit(s) = logit(u) + log(shift)."""
    n, opts = 20000, dict(sampling=sampling, shift=SHIFT)
    s = draw_sigmas(n, torch.Generator().manual_seed(0), **opts)
    assert s.dtype == torch.float32 and s.shape == (n,) and 0 <= s.min() and s.max() <= 1
    s = s.double()
    assert _ks(s, lambda y: sigma_cdf(y, **opts)) < 0.012
    q = (torch.arange(200000, dtype=torch.float64) + 0.5) / 200000  # E[s] = int_0^1 F^-1(q) dq
    mean = wan_flow.sigma_icdf(q, **opts).mean().item()
    assert abs(s.mean().item() - mean) < 0.01
    if sampling == "uniform":  # shift 3 moves the mean from 1/2 to 3/2 - 3 ln(3)/4 = 0.676
        assert abs(mean - (SHIFT / (SHIFT - 1) - SHIFT * math.log(SHIFT) / (SHIFT - 1) ** 2)) < 1e-6
    else:  # logit-normal N(0, 1) shifted: logit(s) ~ N(log 3, 1)
        logit = torch.logit(s.clamp(1e-12, 1 - 1e-12))
        assert abs(logit.mean().item() - math.log(SHIFT)) < 0.03 and abs(logit.std().item() - 1) < 0.03
    rng = draw_sigmas(n, torch.Generator().manual_seed(0), sigma_range=(0.9, 1.0), **opts).double()
    assert 0.9 <= rng.min() and rng.max() <= 1.0
    lo = sigma_cdf(torch.tensor(0.9, dtype=torch.float64), **opts)
    assert _ks(rng, lambda y: (sigma_cdf(y, **opts) - lo) / (1 - lo)) < 0.012


def test_draw_is_per_sample_deterministic_and_refusals():
    loss = WanFlowLoss(SHIFT, sampling="logit_normal")
    eps, s = loss.draw_sample_noise((4, 3, 8, 8), seed=11)
    eps2, s2 = loss.draw_sample_noise((4, 3, 8, 8), seed=11)
    assert torch.equal(eps, eps2) and s == s2 and 0 < s < 1
    assert loss.draw_sample_noise((4, 3, 8, 8), seed=12)[1] != s
    for bad in (dict(sampling="mode"), dict(weighting="snr"), dict(sigma_range=(0.5, 0.5)), dict(logit_std=0.0)):
        with pytest.raises(ValueError):
            WanFlowLoss(SHIFT, **bad)
    with pytest.raises(ValueError, match="shift"):
        WanFlowLoss(0.0)
    with pytest.raises(ValueError, match="one shape"):
        wan_flow.flow_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2))


def test_bell_weights_are_diffsynth_studio_weights():
    """On the 1000 training levels the weights are ``y - min y`` scaled to sum 1000 (mean 1), ``y(t)
    = exp(-2 ((t - 500) / 1000)^2)``: the largest at t = 500, zero at s = 1."""
    for shift in (1.0, SHIFT, 5.0):
        levels = shift_sigma(1 - torch.arange(1000, dtype=torch.float64) / 1000, shift)
        y = torch.exp(-2 * ((1000 * levels - 500) / 1000) ** 2)
        want = (y - y.min()) * 1000 / (y - y.min()).sum()
        torch.testing.assert_close(bell_weights(levels, shift).double(), want, rtol=1e-6, atol=1e-6)
    w = bell_weights(torch.tensor([1.0, 0.5, 0.2]), SHIFT)
    assert w[0].item() == 0 and w[1] > w[2] > 0
    torch.testing.assert_close(wan_flow.loss_weights(torch.rand(5), "none", SHIFT), torch.ones(5))


def test_perfect_velocity_has_zero_loss():
    x, eps = torch.randn(3, 2, 1, 2, 2), torch.randn(3, 2, 1, 2, 2)
    s = torch.tensor([0.0, 0.4, 1.0])
    (x_t, timestep, text), targets = make_wan_pair(x, eps, s, torch.zeros(3, 5, 8))
    torch.testing.assert_close(x_t[0], x[0])
    torch.testing.assert_close(x_t[2], eps[2])
    assert timestep.tolist() == pytest.approx([0.0, 400.0, 1000.0])
    assert WanFlowLoss(SHIFT)(eps - x, targets).item() == 0.0


def test_report_measured_errors():
    """Prints the errors measured above (run with -s); runs last in this module."""
    for k, v in MEASURED.items():
        print(f"{k}: {v:.3e}")


def test_finetuning_doc_example_runs(tmp_path, monkeypatch):
    """docs/finetuning.md: ``python scripts/make_tiny_wan.py /tmp/wan_tiny --sharded``, then its Python
    block as written (paths moved under ``tmp_path``): four steps of fine-tuning change the weights,
    sampling returns finite latents, and the written folder loads in diffusers with no key warnings."""
    import re

    doc = (REPO / "docs" / "finetuning.md").read_text()
    assert "python scripts/make_tiny_wan.py /tmp/wan_tiny --sharded" in doc
    folder = tmp_path / "wan_tiny"
    _script().main([str(folder), "--sharded"])
    code = re.search(r"^```python\n(.*?)^```", doc, re.M | re.S).group(1)
    code = code.replace("/tmp/wan_tiny", str(folder))
    scope: dict = {}
    exec(compile(code, "docs/finetuning.md", "exec"), scope)
    before = from_pretrained(folder).state_dict()
    after = scope["model"].state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert torch.isfinite(scope["latents"]).all() and scope["latents"].shape == (1, 4, 3, 8, 8)
    from diffusers import WanTransformer3DModel

    _, info = WanTransformer3DModel.from_pretrained(str(folder) + "_finetuned", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))


def test_a_stop_request_ends_wan_sampling_within_one_step(tiny):
    """Ctrl-C during a Wan run's final samples (vitp.eval.wan_eval.wan_samples inside
    ``stoppable``) stops after the step it is in, as the message says, not after the whole batch
    of sampling loops."""
    from omegaconf import OmegaConf

    from vitp.eval.progress import EvaluationStopped, stoppable
    from vitp.eval.wan_eval import wan_samples

    class Counting(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model, self.calls = model, 0

        def forward(self, *args, **kwargs):
            self.calls += 1
            return self.model(*args, **kwargs)

    pos, neg = _embeds(2)
    cfg = OmegaConf.create({"sampler": {"steps": 4, "cfg_scale": 5.0, "batch_size": 8},
                            "model": {"in_channels": LATENT[1], "num_frames": LATENT[2], "image_size": list(LATENT[3:])}})
    counting = Counting(tiny.model)

    def draw():
        return wan_samples(counting, load_scheduler(tiny.folder), cfg, 2, lambda idx: pos[idx.start:idx.stop],
                           neg[:1], seed=0)

    assert draw().shape == (2, *LATENT[1:])
    whole, counting.calls = counting.calls, 0
    with stoppable(lambda: True), pytest.raises(EvaluationStopped):
        draw()
    assert whole % 4 == 0 and counting.calls == whole // 4  # the forwards of one step of four
