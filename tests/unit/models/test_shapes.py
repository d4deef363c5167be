"""Non-square sizes and shapes that change between calls: grids, sin-cos positions, unpatchify,
factorized attention, and the errors that name the valid sizes."""
import pytest
import torch

from tests.helpers import compose_cfg
from vitp.models import Generator, input_grid, set_grid, sincos_3d_pos_embed, token_grid


def _video_cfg(*over):
    return compose_cfg(["experiment=smoke", "data=synthetic", "data.channels=3", "data.num_classes=4",
                        "data.num_frames=4", "data.resolution=6x10", "model.tubelet_size=2", *over]).model


def test_grid_of_every_resolution_form():
    assert token_grid(8, 1, 2, 1) == (1, 4, 4)
    assert token_grid([8, 12], 1, 2, 1) == token_grid("8x12", 1, 2, 1) == (1, 4, 6)
    assert input_grid((2, 3, 4, 6, 10), 2, 2) == (2, 3, 5)
    with pytest.raises(ValueError, match=r"does not tile.*6x10 or 8x12 pixels"):
        input_grid((2, 3, 4, 7, 11), 2, 2)


def test_positions_name_the_same_place_in_every_grid():
    """Row ``h * gw + w`` of the table holds position ``(h, w)`` whatever the grid: a 3x5 grid and
    a 5x3 grid agree where they overlap (swapping h and w breaks this), and the table of one frame
    repeats across frames up to the temporal term."""
    a = sincos_3d_pos_embed(1, 3, 5, 16)
    b = sincos_3d_pos_embed(1, 5, 3, 16)
    for h in range(3):
        for w in range(3):
            assert torch.equal(a[h * 5 + w], b[h * 3 + w]), (h, w)
    assert not torch.equal(a[1], a[5])  # (0, 1) and (1, 0) differ
    v = sincos_3d_pos_embed(2, 3, 5, 16)
    assert torch.allclose(v[15:] - v[:15], (v[15] - v[0]).expand(15, 16), atol=1e-6)


@pytest.mark.parametrize("attention", ["full", "factorized"])
def test_one_model_follows_its_input_size(attention):
    """A model built at 6x10 (4 frames) run at 10x6, 8 frames, then 6x10 again equals models built
    at each size (same weights: positions are a function of the grid, not parameters)."""
    cfg = _video_cfg(f"model.attention={attention}")
    gen = Generator.from_config(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in gen.parameters():  # adaLN-Zero would hide the blocks
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    for T, H, W in [(4, 6, 10), (4, 10, 6), (8, 6, 10), (4, 6, 10)]:
        z = torch.randn(2, 3, T, H, W, generator=g)
        t, y = torch.rand(2, generator=g), torch.tensor([0, 4])
        fresh = Generator.from_config(dict(cfg, image_size=[H, W], num_frames=T))
        fresh.load_state_dict(gen.state_dict())
        out = gen(z, t, y)
        assert out.shape == z.shape and gen.embed.grid == (T // 2, H // 2, W // 2)
        torch.testing.assert_close(out, fresh(z, t, y), rtol=0, atol=0)


def test_unpatchify_keeps_rows_and_columns():
    """With the final layer as a pass-through of the patch pixels, the output is the input: rows stay
    rows on a non-square grid."""
    gen = Generator.from_config(_video_cfg(), seed=0)
    z = torch.randn(1, 3, 4, 6, 10)
    tokens = z.reshape(1, 3, 2, 2, 3, 2, 5, 2).permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(1, 30, 24)
    fin = gen.final
    fin.norm_final = torch.nn.Identity()  # adaLN weights are zero: modulate is the identity too
    x = fin.linear.weight.new_zeros(1, 30, fin.linear.in_features)
    x[..., :24] = tokens
    with torch.no_grad():
        fin.linear.weight.copy_(torch.eye(24, fin.linear.in_features))
    torch.testing.assert_close(fin(x, torch.zeros(1, fin.linear.in_features)), z)


def test_embed_refuses_an_input_of_another_grid_than_the_set_one():
    gen = Generator.from_config(_video_cfg(), seed=0)
    z = torch.randn(1, 3, 4, 10, 6)
    with pytest.raises(ValueError, match=r"call vitp.models.set_grid"):
        gen.embed(z, torch.rand(1), torch.tensor([1]))
    set_grid(gen, (2, 5, 3))
    assert gen.final.grid == (2, 5, 3) and gen.embed(z, torch.rand(1), torch.tensor([1]))[0].shape == (1, 30, 32)
