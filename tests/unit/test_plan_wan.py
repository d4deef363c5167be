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
