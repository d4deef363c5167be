"""The generator: shapes, adaLN-Zero identity, per-layer seeding, learning on a fixed batch."""
import pytest
import torch

from tests.helpers import compose_cfg
from vitp.models import Generator, TubeletEmbed, sincos_3d_pos_embed
from vitp.objectives import FlowMatchingLoss, make_pair


def _cfg(*over):
    return compose_cfg(["experiment=smoke", *over]).model


@pytest.mark.parametrize("over", [[], ["model.mlp=swiglu", "model.qk_norm=true", "model.qkv_bias=false"],
                                  ["model.layer_scale_init=0.1"]])
def test_shapes_and_timm_submodules(over):
    from timm.layers import Attention

    gen = Generator.from_config(_cfg(*over), seed=0)
    z = torch.randn(3, 1, 1, 8, 8)
    out = gen(z, torch.rand(3), torch.tensor([0, 5, 10]))
    assert out.shape == z.shape
    assert all(isinstance(b.attn, Attention) for b in gen.blocks)
    assert len(gen.blocks) == 2 and gen.embed.grid == (1, 4, 4)


def test_adaln_zero_output_is_zero_at_init():
    gen = Generator.from_config(_cfg(), seed=0)
    out = gen(torch.randn(2, 1, 1, 8, 8), torch.rand(2), torch.tensor([1, 2]))
    assert torch.count_nonzero(out) == 0  # zero-initialised final layer


def test_same_seed_same_weights_and_seed_per_layer():
    a, b, c = Generator.from_config(_cfg(), seed=3), Generator.from_config(_cfg(), seed=3), Generator.from_config(_cfg(), seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.attn.qkv.weight"], sc["blocks.0.attn.qkv.weight"])
    # layer i is seeded with seed + i: block 0 of seed 4 equals block 1 of seed 3
    assert torch.equal(sc["blocks.0.attn.qkv.weight"], sa["blocks.1.attn.qkv.weight"])


def test_tubelet_token_order_and_pos_embed():
    emb = TubeletEmbed(3, 8, patch_size=2, tubelet_size=2)
    tokens = emb(torch.randn(1, 3, 4, 6, 6))
    assert tokens.shape == (1, 2 * 3 * 3, 8)
    pe = sincos_3d_pos_embed(2, 3, 3, 8)
    assert pe.shape == (18, 8) and len({tuple(r.tolist()) for r in pe}) == 18  # all positions distinct


def test_training_steps_decrease_loss_on_a_fixed_batch():
    torch.manual_seed(0)
    gen = Generator.from_config(_cfg(), seed=0)
    x = torch.rand(16, 1, 1, 8, 8) * 2 - 1
    inputs, targets = make_pair(x, torch.zeros(16), torch.randn_like(x), torch.rand(16) * 0.8 + 0.1,
                                torch.arange(16) % 10, 1.0)
    loss_fn = FlowMatchingLoss(0.05)
    opt = torch.optim.AdamW(gen.parameters(), lr=1e-3)
    losses = []
    for _ in range(30):
        loss = loss_fn(gen(*inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses


def test_forward_makes_no_tensor_on_another_device():
    """Every constant the model builds in forward (timestep frequencies, positions) follows the
    input's device: the whole forward runs on the meta device (on CUDA a CPU constant crashed)."""
    with torch.device("meta"):
        gen = Generator.from_config(_cfg("model.mlp=swiglu"), seed=None)
        z, t, y = torch.randn(2, 1, 1, 8, 8), torch.rand(2), torch.tensor([1, 2])
    assert gen(z, t, y).device.type == "meta"


@pytest.mark.gpu
def test_training_steps_on_cuda(tmp_path):
    """bf16 (precision auto) on one GPU with NCCL: finite losses, the smoke model's first loss."""
    import json

    from tests.helpers import run_ranks, train_rank

    res = run_ranks(1, train_rank, ["experiment=smoke", "trainer.max_steps=3", "trainer.device=cuda",
                                    "trainer.precision=auto"], str(tmp_path / "run"))[0]
    assert all(v == v for v in res["losses"]) and len(res["losses"]) == 3
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_0000003" / "vitp_meta.json").read_text())
    assert meta["precision"] == "bf16"
