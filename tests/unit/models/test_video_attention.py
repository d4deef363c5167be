"""Video attention modes: full vs factorized (Latte variant 1) space/time attention."""
import pytest
import torch

from tests.helpers import compose_cfg
from hydra.errors import ConfigCompositionException

from vitp.config import validate_model
from vitp.models import Block, Generator, TokenGroups, layer_specs
from vitp.utils import to_dict

VIDEO = ["experiment=smoke", "data=synthetic", "data.channels=3", "data.num_classes=4", "data.num_frames=6",
         "data.resolution=6", "model.tubelet_size=2", "model.num_heads=2"]  # grid (3, 3, 3), N = 27


def _cfg(*over):
    return compose_cfg([*VIDEO, *over]).model


def _block(cfg, attention):
    """A block of the model config ``cfg`` with the given attention kind (drop-path 0)."""
    return Block(**dict(layer_specs(**to_dict(cfg))[1][1], attention=attention, drop_path=0.0))


def _perturb(model, seed=1):
    """adaLN-Zero starts as the identity: random weights make every block do something."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _inputs(cfg, B=2, seed=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, cfg.in_channels, cfg.num_frames, cfg.image_size, cfg.image_size, generator=g)
    return x, torch.rand(B, generator=g), torch.randint(0, cfg.num_classes + 1, (B,), generator=g)


def test_layer_kinds_alternate_and_config_is_validated():
    specs = layer_specs(**to_dict(_cfg("model.attention=factorized", "model.depth=4")))
    assert [kw["attention"] for _, kw in specs[1:-1]] == ["spatial", "temporal", "spatial", "temporal"]
    assert {kw["attention"] for _, kw in layer_specs(**to_dict(_cfg()))[1:-1]} == {"full"}
    with pytest.raises(ConfigCompositionException) as e:
        _cfg("model.attention=spacetime")
    assert "expected one of [full, factorized]" in str(e.value.__cause__)
    cfg = _cfg("model.attention=factorized")
    cfg.num_frames = 0
    with pytest.raises(ValueError, match=r"model.num_frames=0: must be an integer >= 1; it follows data.num_frames"):
        validate_model(cfg)


@pytest.mark.parametrize("name", ["video_s", "video_l"])
def test_shipped_video_configs_compose(name):
    cfg = compose_cfg([f"model={name}", "data=synthetic", "data.num_frames=8", "data.resolution=32"]).model
    validate_model(cfg)
    assert cfg.attention == "factorized" and cfg.tubelet_size == 2


def test_token_groups_round_trip_and_layout():
    x = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).reshape(2, 12, 1)  # grid (3, 2, 2)
    for kind in TokenGroups.KINDS:
        g = TokenGroups(kind, (3, 2, 2))
        assert torch.equal(g.ungroup(g.group(x)), x)
    sp, tm = TokenGroups("spatial", (3, 2, 2)).group(x), TokenGroups("temporal", (3, 2, 2)).group(x)
    assert sp.shape == (6, 4, 1) and sp[1, :, 0].tolist() == [4, 5, 6, 7]  # sample 0, frame 1
    assert tm.shape == (8, 3, 1) and tm[1, :, 0].tolist() == [1, 5, 9]  # sample 0, position 1, every frame
    with pytest.raises(ValueError, match="got 11 tokens"):
        TokenGroups("spatial", (3, 2, 2)).group(x[:, :11])


def test_factorized_and_full_share_weights_but_differ():
    full, fact = Generator.from_config(_cfg(), seed=0), Generator.from_config(_cfg("model.attention=factorized"), seed=0)
    sf, sa = full.state_dict(), fact.state_dict()
    assert list(sf) == list(sa) and "blocks.1.attn.qkv.weight" in sa
    assert all(torch.equal(sf[k], sa[k]) for k in sf)  # same init: per-layer seeding is unchanged
    _perturb(fact)
    full.load_state_dict(fact.state_dict(), strict=True)
    inputs = _inputs(_cfg())
    with torch.no_grad():
        a, b = full(*inputs), fact(*inputs)
    assert a.shape == b.shape == inputs[0].shape
    assert (a - b).abs().max() > 1e-2 * a.abs().max()


def test_single_frame_video_model_equals_image_model():
    image = compose_cfg(["experiment=smoke"]).model
    video = compose_cfg(["experiment=smoke", "data=synthetic", "data.channels=1", "data.num_classes=10",
                         "data.num_frames=1", "data.resolution=8", "model.attention=full"]).model
    a, b = _perturb(Generator.from_config(image, seed=0)), _perturb(Generator.from_config(video, seed=0))
    inputs = _inputs(image)
    assert torch.equal(a(*inputs), b(*inputs))
    # T = 1: a spatial block is a full block; a temporal block attends to its own token only
    cfg = compose_cfg(["experiment=smoke", "model.attention=factorized"]).model
    torch.manual_seed(0)
    blk = _perturb(_block(cfg, "full"))
    spatial, temporal = _block(cfg, "spatial"), _block(cfg, "temporal")
    spatial.load_state_dict(blk.state_dict())
    temporal.load_state_dict(blk.state_dict())
    x, c = torch.randn(2, 16, cfg.width), torch.randn(2, cfg.width)
    assert torch.equal(spatial(x, c), blk(x, c))
    D, attn = cfg.width, temporal.attn
    v = attn.qkv(x)[..., 2 * D:]
    torch.testing.assert_close(attn(x, token_groups=temporal.token_groups), attn.proj(v), rtol=1e-5, atol=1e-6)


def _blocks(kind):
    cfg = _cfg("model.attention=factorized")
    torch.manual_seed(0)
    ref = _perturb(_block(cfg, "full")).double()
    blk = _block(cfg, kind).double()
    blk.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 27, cfg.width, generator=g, dtype=torch.float64)
    c = torch.randn(2, cfg.width, generator=g, dtype=torch.float64)
    return ref, blk, x, c


@pytest.mark.parametrize("kind", ["spatial", "temporal"])
def test_factorized_block_is_a_full_block_per_group(kind):
    """Regrouped block == full block run on each group as its own sequence (adaLN/MLP token-wise)."""
    ref, blk, x, c = _blocks(kind)
    g = blk.token_groups
    per_group = ref(g.group(x), c.repeat_interleave(g.group(x).shape[0] // x.shape[0], 0))
    torch.testing.assert_close(blk(x, c), g.ungroup(per_group), rtol=1e-12, atol=1e-12)


def test_temporal_block_depends_only_on_its_position_and_spatial_on_its_frame():
    d = torch.randn(2, 32, dtype=torch.float64)  # not a constant shift: LayerNorm would remove that
    _, temporal, x, c = _blocks("temporal")
    y = temporal(x, c).view(2, 3, 9, -1)  # (B, gt, gh*gw, D)
    x2 = x.clone().view(2, 3, 9, -1)
    x2[:, :, 4] += d[:, None]  # spatial position 4, every frame
    y2 = temporal(x2.view(2, 27, -1), c).view(2, 3, 9, -1)
    others = [s for s in range(9) if s != 4]
    assert torch.equal(y2[:, :, others], y[:, :, others])
    assert (y2[:, :, 4] - y[:, :, 4]).abs().amax(-1).min() > 1e-9

    _, spatial, x, c = _blocks("spatial")
    y = spatial(x, c).view(2, 3, 9, -1)
    x2 = x.clone().view(2, 3, 9, -1)
    x2[:, 1, 4] += d  # frame 1, one position
    y2 = spatial(x2.view(2, 27, -1), c).view(2, 3, 9, -1)
    assert torch.equal(y2[:, [0, 2]], y[:, [0, 2]])
    assert (y2[:, 1] - y[:, 1]).abs().amax(-1).min() > 1e-9  # every token of frame 1 sees the change

    full, _, x, c = _blocks("temporal")
    x2 = x.clone().view(2, 3, 9, -1)
    x2[:, 1, 4] += d
    assert (full(x2.view(2, 27, -1), c) - full(x, c)).abs().amax(-1).min() > 1e-9  # full: everything sees it
