"""docs/checkpoints.md's snippet that loads an export's blocks into a stock timm
``VisionTransformer``, run as written on exports of several block kinds; the loaded timm block
computes the generator's block with the adaLN modulation at shift = scale = 0, gate = 1."""
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import compose_cfg
from vitp.checkpoint import save_export
from vitp.models import Generator

REPO = Path(__file__).resolve().parents[3]


def snippet() -> str:
    """The one fenced ``python`` block of docs/checkpoints.md."""
    (code,) = re.findall(r"^```python\n(.*?)^```", (REPO / "docs" / "checkpoints.md").read_text(), re.M | re.S)
    return code


@pytest.mark.parametrize("over", [
    [],
    ["model.mlp=swiglu", "model.qk_norm=true", "model.layer_scale_init=0.1", "model.qkv_bias=false"],
    ["model.text_dim=12"],  # text-conditional: cross-attention is exported under gen., the timm parts load
])
def test_the_documented_snippet_loads_exported_blocks_into_timm(over, tmp_path, monkeypatch):
    cfg = compose_cfg(["experiment=smoke", "model.depth=2", *over])
    gen = Generator.from_config(cfg.model, seed=0).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in gen.blocks.named_parameters():
            if "adaLN" not in name:
                p.add_(0.1 * torch.randn_like(p))  # every tensor away from its init, biases and norms too
    save_export(tmp_path / "w.safetensors", gen.state_dict(), cfg)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(snippet(), "docs/checkpoints.md", "exec"), scope)
    vit = scope["vit"].eval()

    D = cfg.model.width
    x, c = torch.randn(2, 5, D), torch.randn(2, D)
    text = (torch.randn(2, 3, D), torch.ones(2, 3, dtype=torch.bool)) if cfg.model.text_dim else ()
    for g, t in zip(gen.blocks, vit.blocks):
        if text:
            with torch.no_grad():  # timm's block has no cross-attention: compare without it
                g.cross_attn.proj.weight.zero_()
                g.cross_attn.proj.bias.zero_()
        lin = g.adaLN_modulation[-1]
        with torch.no_grad():  # shift1, scale1, gate1, shift2, scale2, gate2 = 0, 0, 1, 0, 0, 1
            lin.weight.zero_()
            lin.bias.copy_(torch.tensor([0.0, 0, 1, 0, 0, 1]).repeat_interleave(D))
            torch.testing.assert_close(t(x), g(x, c, *text), rtol=1e-4, atol=1e-4)  # qk-norm eps: 1e-6 vs 1e-5
