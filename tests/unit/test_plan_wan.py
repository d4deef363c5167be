"""The planner's Wan parameter counts (:mod:`vitp.plan.wan`) equal diffusers' ``WanTransformer3DModel``
built on the meta device, for every published config, and per layer."""
from __future__ import annotations

import pytest
import torch

from vitp.plan.wan import WAN_PRESETS, wan_params


def _diffusers_count(config):
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
    blocks = sum(p.numel() for p in model.blocks.parameters())
    return sum(p.numel() for p in model.parameters()), blocks, len(model.blocks)


@pytest.mark.parametrize("name", sorted(WAN_PRESETS))
def test_parameter_count_equals_diffusers(name):
    total, blocks, depth = _diffusers_count(WAN_PRESETS[name])
    got = wan_params(name)
    assert got["total"] == total
    assert got["blocks"] == blocks and got["block"] * depth == blocks
    assert got["embed"] + got["blocks"] + got["final"] == got["total"]


def test_published_sizes():
    """The names' sizes: 1.3B, 14B (per A14B expert) and 5B, within 10 %."""
    for name, size in (("wan2.1-t2v-1.3b", 1.3e9), ("wan2.1-t2v-14b", 14e9), ("wan2.2-ti2v-5b", 5e9),
                       ("wan2.2-t2v-a14b", 14e9)):
        assert wan_params(name)["total"] == pytest.approx(size, rel=0.1)


def test_unknown_preset_and_refused_option_are_named():
    with pytest.raises(KeyError, match="wan2.1-t2v-1.3b"):
        wan_params("wan3")
    with pytest.raises(ValueError, match="image_dim"):
        wan_params({**WAN_PRESETS["wan2.1-t2v-14b"], "image_dim": 1280, "added_kv_proj_dim": 5120})


# --- the planner (vitp-plan) on Wan: model.preset / a folder's config.json, Wan's own layers ---

PRESET_RUNS = {"wan2.1-t2v-1.3b": ["experiment=wan21_1p3b_480p"], "wan2.1-t2v-14b": ["experiment=wan21_14b_720p"],
               "wan2.2-ti2v-5b": ["experiment=wan21_1p3b_480p", "model.preset=wan2.2-ti2v-5b",
                                  "data.latent_channels=48", "data.vae_compression=[4,16]", "data.resolution=[704,1280]"]}


def _planned_model(over):
    from tests.helpers import compose_cfg
    from vitp.config import validate_config
    from vitp.utils import to_dict

    cfg = compose_cfg(over)
    validate_config(cfg)
    return cfg, to_dict(cfg.model)


@pytest.mark.parametrize("name", sorted(PRESET_RUNS))
def test_planner_counts_the_real_configs_as_diffusers(name):
    from vitp.plan import layer_params

    _, model = _planned_model(PRESET_RUNS[name])
    counted = [sum(layer.values()) for layer in layer_params(model)]
    total, blocks, depth = _diffusers_count(WAN_PRESETS[name])
    assert sum(counted) == total and sum(counted[1:-1]) == blocks and len(counted) == depth + 2


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="model.preset=wan9: unknown Wan preset; known: wan2.1-t2v-1.3b"):
        _planned_model(["experiment=wan21_1p3b_480p", "model.preset=wan9"])


TINY = {"width": 64, "depth": 2, "num_heads": 4, "mlp_ratio": 2.5, "patch_size": 2, "tubelet_size": 1,
        "in_channels": 4, "text_dim": 32, "text_len": 7, "image_size": [8, 4], "num_frames": 3, "family": "wan",
        "mlp": "gelu", "attention": "full", "qk_norm": True}  # N = 3 x 4 x 2 = 24 tokens, F = 160


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_wan_block_saved_activations_match_autograd(precision):
    """One WanBlock at tp = 1: the planner's saved bytes are what autograd keeps (mod, ctx and the
    rotary tables counted once per stage, :func:`vitp.plan.memory.stage_tensor_bytes`)."""
    from tests.unit.test_plan import _saved_bytes
    from vitp.models.wan import WanBlock, rotary_freqs
    from vitp.plan import LayoutSpec, ModelShape
    from vitp.plan.memory import layer_saved_bytes, stage_tensor_bytes

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    shape = ModelShape.from_config(TINY)
    blk = WanBlock(64, 160, 4).to(dtype)
    for norm in (blk.norm1, blk.norm2, blk.norm3):
        norm.float()
    blk.scale_shift_table.data = blk.scale_shift_table.data.float()  # as WanModel.cast keeps them
    B, N, L = 2, shape.tokens, 7
    x = torch.randn(B, N, 64, dtype=dtype, requires_grad=True)
    mod, ctx = (torch.randn(B, *s, dtype=dtype, requires_grad=True) for s in ((6, 64), (L, 64)))
    cos, sin = rotary_freqs(shape.grid, 16)
    measured = _saved_bytes(lambda: blk(x, mod, ctx, cos, sin), list(blk.parameters()))
    lay = LayoutSpec(1, 1, 1, False, 0, B, 1, precision=precision)
    ctx_and_rope = B * L * 64 * ACT[precision] + 2 * N * 8 * 4  # what of the stage tensors a block saves
    assert measured == B * layer_saved_bytes(shape, 1, lay) + ctx_and_rope
    assert stage_tensor_bytes(shape, lay) == B * (7 + L) * 64 * ACT[precision] + 2 * N * 8 * 4


ACT = {"fp32": 4, "bf16": 2}


def test_wan_flops_by_hand():
    """Tiny Wan: D 64, F 160, N 24, L 7, Dc 32, 16 values per token; adaLN-single (time_proj once)."""
    from vitp.plan import model_flops_per_step

    D, F, N, L, Dc, P = 64, 160, 24, 7, 32, 16
    block = 2 * N * (4 * D * D + 2 * D * F) + 2 * N * 2 * D * D + 2 * L * 2 * D * D + 4 * N * N * D + 4 * N * L * D
    embed = 2 * N * D * P + 2 * (256 * D + D * D) + 2 * L * (Dc * D + D * D) + 2 * D * 6 * D
    final = 2 * N * D * P
    assert model_flops_per_step(TINY, 4) == pytest.approx(3 * 4 * (2 * block + embed + final), rel=1e-12)


@pytest.mark.slow  # the planner's whole table at 8 GPUs: the full suite's, not the fast tier's
@pytest.mark.parametrize("exp,gpus,fewer", [("wan21_1p3b_480p", 1, None), ("wan21_14b_720p", 8, 4)])
def test_recipes_fit_every_phase_on_their_gpus_and_not_on_fewer(exp, gpus, fewer):
    """The recipe's own layout is the fastest that fits the step and every phase on its GPU count;
    on the next smaller count (4 for the 14B; the 1.3B names 1) no layout fits at all."""
    from vitp.plan import get_profile, layout_of, phase_costs_of, plan

    cfg, model = _planned_model([f"experiment={exp}"])
    prof = get_profile("h100", 80)

    def fitting(n):
        return [p for p in plan(cfg, n, prof) if p.fits and all(
            c.memory_bytes <= p.limit_bytes for c in phase_costs_of(cfg, p, model, prof))]

    best = fitting(gpus)[0]
    assert best.layout.as_dict().items() >= {k: v for k, v in layout_of(cfg, gpus, "cuda").as_dict().items()
                                             if k in ("tp", "cp", "pp", "dp", "sp", "ac", "micro")}.items()
    if fewer:
        assert not any(p.fits for p in plan(cfg, fewer, prof))
        assert best.layout.ac and plan(cfg, gpus, prof)[0].layout.cp > 1  # the step-only first row takes cp


# --- LoRA (trainer.lora): adapter counts equal peft's on diffusers' model, the state arithmetic ---

LORA_TARGETS = [["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"],
                ["attn1.to_q", "attn2.to_v", "proj_out"], ["attn.qkv", "cross_attn.kv", "mlp.fc2"]]


@pytest.mark.parametrize("targets", LORA_TARGETS, ids=["diffusers-names", "partial-pieces", "vitp-names"])
def test_lora_adapter_count_equals_peft_on_diffusers(targets):
    """The planner's adapter parameters equal the ``lora_`` parameters peft injects into diffusers'
    ``WanTransformer3DModel`` (meta device) with the same targets and rank; vitp names select
    every piece of a fused linear (``attn.qkv`` = to_q, to_k, to_v of attn1); peft's suffix rule
    makes ``mlp.fc2`` also match the timestep embedder's ``t_embedder.mlp.fc2`` (diffusers'
    ``time_embedder.linear_2``)."""
    from peft import LoraConfig, inject_adapter_in_model
    from diffusers import WanTransformer3DModel
    from vitp.plan.lora import lora_params
    from vitp.plan.wan import wan_config_of_model

    peft_targets = {"attn.qkv": ["attn1.to_q", "attn1.to_k", "attn1.to_v"], "cross_attn.kv": ["attn2.to_k", "attn2.to_v"],
                    "mlp.fc2": ["ffn.net.2", "time_embedder.linear_2"]}
    with torch.device("meta"):
        model = WanTransformer3DModel(**wan_config_of_model(TINY))
    names = [d for t in targets for d in peft_targets.get(t, [t])]
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=names), model)
    want = sum(p.numel() for k, p in model.named_parameters() if "lora_" in k)
    assert want > 0 and lora_params(TINY, targets, 4) == want


def test_lora_plan_state_arithmetic():
    """LoRA against full fine-tuning in one layout (bf16, ZeRO-1 over dp 2): the base keeps only
    its bf16 weights; the adapters get bf16 weights and grads, fp32 master + AdamW moments and fp32
    EMA split over dp; activations gain the r-dim intermediates of every targeted linear."""
    from vitp.plan import LayoutSpec, MemoryOptions, stage_memory
    from vitp.plan.lora import LoraPlan

    lay = LayoutSpec(tp=1, cp=1, pp=1, dp=2, sp=False, ac=0, micro=2, accum=1, precision="bf16", device="cuda")
    full = stage_memory(TINY, lay)[0]
    lora = stage_memory(TINY, lay, MemoryOptions(lora=LoraPlan(4, ("attn.qkv", "blocks.0.mlp.fc2", "blocks.1.mlp.fc2"))))[0]
    D, F, N, r = 64, 160, 24, 4
    Pa = 2 * (3 * r * D + 3 * D * r + r * F + D * r)  # 2 blocks: qkv's 3 pieces, fc2
    P = full.params
    assert lora.adapter_params == Pa == 4864 and lora.params == P
    assert lora.weights == 2 * P + 2 * Pa and lora.grads == 2 * Pa and full.grads == 2 * P
    assert lora.optimizer == 12 * Pa / 2 and full.optimizer == 12 * P / 2
    assert lora.ema == 4 * Pa / 2 and full.ema == 4 * P / 2
    assert lora.activations - full.activations == 2 * 2 * N * (3 * r + r) * 2  # micro 2, 2 blocks, bf16
    assert lora.ckpt_write == Pa * (2 / 2 + (4 + 8 + 4) / 2)  # bf16 weights over dp, fp32 EMA + moments + master fragments


def test_lora_recipe_fits_on_2_and_8_gpus_not_on_1():
    """``experiment=wan21_14b_720p_lora``: its layout (tp 1 x cp 2) fits the step and every phase
    on 8 and on 2 x H100 80 GB, where it is the fastest that fits; on 1 nothing fits; it needs
    less memory than full fine-tuning in the same layout by the state the frozen base drops."""
    from vitp.plan import MemoryOptions, get_profile, layout_of, phase_costs_of, plan, predict
    from vitp.plan.lora import lora_plan_of

    cfg, model = _planned_model(["experiment=wan21_14b_720p_lora"])
    prof, opts = get_profile("h100", 80), MemoryOptions(lora=lora_plan_of(cfg))
    for gpus in (8, 2):
        p = predict(model, layout_of(cfg, gpus, "cuda"), prof, opts)
        assert (p.layout.tp, p.layout.cp, p.layout.dp) == (1, 2, gpus // 2) and p.fits
        assert all(c.memory_bytes <= p.limit_bytes for c in phase_costs_of(cfg, p, model, prof))
    best = plan(cfg, 2, prof, opts)[0]
    assert (best.layout.tp, best.layout.cp, best.fits) == (1, 2, True)
    assert not any(p.fits for p in plan(cfg, 1, prof, opts))
    full = predict(model, p.layout, prof, MemoryOptions())  # the 2-GPU layout, full fine-tuning
    Pa, P = p.peak.adapter_params, p.peak.params
    assert 150e6 < Pa < 160e6
    dropped = (P - Pa) * (2 + 12 / 2 + 4 / 2) - 2 * Pa  # grads, master + moments and EMA over dp x cp = 2
    assert full.peak.total - p.peak.total == pytest.approx(dropped - (p.peak.activations - full.peak.activations)
                                                           - (p.peak.recompute - full.peak.recompute)
                                                           - (p.peak.workspace - full.peak.workspace), rel=1e-9)


def test_fid_and_fvd_phases_count_the_pipeline_vae_and_decoded_frames(tmp_path, monkeypatch):
    """With ``eval.fid.num`` / ``eval.fvd.num`` a Wan run's FID and FVD phases add the decode of the
    pipeline's ``vae/`` (what the samples are decoded with, :func:`vitp.plan.latents.decode_memory_bytes`;
    a folder without ``vae/`` counts none), and FVD runs I3D over the decoded clip: 5 latent frames
    decode to ``4 (5 - 1) + 1 = 17`` frames, not 5 repeated to 10."""
    from tests.helpers import make_tiny_wan
    from vitp.config import compose, validate_config
    from vitp.plan import LayoutSpec, get_profile
    from vitp.plan import phases
    from vitp.plan.latents import decode_memory_bytes
    from vitp.utils import to_dict

    script, prof = make_tiny_wan(), get_profile("cpu")
    lay = LayoutSpec(tp=1, pp=1, dp=1, sp=False, ac=0, micro=2, accum=1, device="cpu")

    def phase_costs(cfg):
        out = phases.phase_costs(cfg, to_dict(cfg.model), lay, prof, 0.0, decode_bytes=decode_memory_bytes(cfg))
        return {c.name: c for c in out}

    got = {}
    for vae in (True, False):
        folder = script.write_pipeline(tmp_path / f"vae{vae}", vae=vae)
        cfg = compose(["experiment=wan_smoke", f"trainer.init_from={folder}", "data.num_frames=5"]
                      + (["eval.fid.num=8", "eval.fvd.num=8"] if vae else []))
        validate_config(cfg)  # without vae/ training refuses eval.fvd.num: planned here all the same
        cfg.eval.fvd.num = 8
        got[vae] = (cfg, decode_memory_bytes(cfg), phase_costs(cfg))
    (cfg, decode, with_vae), (_, none, without) = got[True], got[False]
    assert decode > 0 and none == 0 and "FID" in with_vae
    assert with_vae["FVD"].memory_bytes - without["FVD"].memory_bytes == pytest.approx(decode, rel=1e-9)
    full, per_frame = with_vae["FVD"].seconds, phases.I3D_FLOPS_PER_FRAME
    monkeypatch.setattr(phases, "I3D_FLOPS_PER_FRAME", 0.0)
    i3d_s = full - phase_costs(cfg)["FVD"].seconds
    assert i3d_s == pytest.approx(8 * 17 * per_frame / phases._fp32_flops(prof), rel=1e-9)
