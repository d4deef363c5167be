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
