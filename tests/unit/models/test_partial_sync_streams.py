"""The single-process reference of partial synchronization (vitp.models.partial_sync_streams), float64:

- at ``p = 1`` the ``tp`` streams are one model: it equals the plain generator (outputs and
  every gradient), so its per-rank sharding is a correct tensor-parallel decomposition;
- at ``p < 1`` one block equals an independent implementation of the rule that masks heads and
  hidden units of the full weights instead of slicing them;
- the validation of ``p``, the scale rule and the layout guard of ``p < 1`` weight files.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from tests.helpers import compose_cfg
from vitp.models import Generator
from vitp.models.layers import modulate
from vitp.models.partial_sync_streams import PartialSyncGenerator, block_streams
from vitp.parallel.partial_sync import private_scale, synced_channels

VIDEO = ["data=synthetic", "data.channels=3", "data.num_classes=4", "data.num_frames=6", "data.resolution=6",
         "model.tubelet_size=2"]
VARIANTS = {
    "default": [],
    "swiglu_qknorm": ["model.mlp=swiglu", "model.mlp_ratio=3", "model.qk_norm=true"],
    "layer_scale_nobias": ["model.layer_scale_init=0.1", "model.qkv_bias=false"],
    "video_factorized": [*VIDEO, "model.attention=factorized"],
}


def _model(over, seed=1):
    cfg = OmegaConf.to_container(compose_cfg(["experiment=smoke", "model.num_heads=4", *over]).model, resolve=True)
    gen = Generator(seed=0, **cfg).double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # adaLN-Zero starts as the identity: random weights make every gradient count
        for p in gen.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    C, T, H = cfg["in_channels"], cfg["num_frames"], cfg["image_size"]
    H = int(str(H).split("x")[0])
    inputs = (torch.randn(2, C, T, H, H, generator=g, dtype=torch.float64), torch.rand(2, generator=g),
              torch.randint(0, cfg["num_classes"] + 1, (2,), generator=g))
    return gen, inputs


def _fwd_bwd(model, inputs, w):
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    (out * w).sum().backward()
    return out.detach()


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_p1_streams_equal_the_generator(name, tp):
    gen, inputs = _model(VARIANTS[name])
    w = torch.randn(gen(*inputs).shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    out_full = _fwd_bwd(gen, inputs, w)
    grads_full = {n: p.grad.clone() for n, p in gen.named_parameters()}
    emu = PartialSyncGenerator(gen, tp=tp, p=1.0)
    out_emu = _fwd_bwd(emu, inputs, w)
    assert float(out_full.abs().max()) > 0.1
    assert torch.allclose(out_emu, out_full, rtol=0, atol=1e-12 * float(out_full.abs().max()))
    for n, p in gen.named_parameters():
        scale = float(grads_full[n].abs().max())
        assert float((p.grad - grads_full[n]).abs().max()) <= 1e-10 * max(scale, 1e-3), n


def _masked_block(blk, xs, c, p, scale):
    """One block at tp = len(xs) by masking the full weights (no slicing, no shard_tensor)."""
    tp, D = len(xs), blk.attn.proj.out_features
    H, hd = blk.attn.num_heads, blk.attn.head_dim
    hidden = blk.mlp.fc2.in_features
    shift1, scale1, gate1, shift2, scale2, gate2 = blk.adaLN_modulation(c).chunk(6, dim=-1)

    def rule(parts, k, bias):
        total = sum(parts)
        out = []
        for o in parts:
            keep = torch.cat([total[..., :k], scale * o[..., k:]], -1)
            out.append(keep + bias)
        return out

    def attn_partial(x, r):  # full attention, then only rank r's heads enter proj
        h = modulate(blk.norm1(x), shift1, scale1)
        B, N, _ = h.shape
        q, k_, v = F.linear(h, blk.attn.qkv.weight, blk.attn.qkv.bias).reshape(B, N, 3, H, hd).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(blk.attn.q_norm(q), blk.attn.k_norm(k_), v, scale=blk.attn.scale)
        mask = torch.zeros(H, dtype=o.dtype)
        mask[r * H // tp:(r + 1) * H // tp] = 1
        o = (o * mask[None, :, None, None]).transpose(1, 2).reshape(B, N, D)
        return F.linear(o, blk.attn.proj.weight)

    def mlp_partial(x, r):
        h = modulate(blk.norm2(x), shift2, scale2)
        mask = torch.zeros(hidden, dtype=h.dtype)
        mask[r * hidden // tp:(r + 1) * hidden // tp] = 1
        return F.linear(blk.mlp.act(F.linear(h, blk.mlp.fc1.weight, blk.mlp.fc1.bias)) * mask, blk.mlp.fc2.weight)

    k = synced_channels(D, p)
    ys = rule([attn_partial(x, r) for r, x in enumerate(xs)], k, blk.attn.proj.bias)
    xs = [x + gate1.unsqueeze(1) * y for x, y in zip(xs, ys)]
    ys = rule([mlp_partial(x, r) for r, x in enumerate(xs)], k, blk.mlp.fc2.bias)
    return [x + gate2.unsqueeze(1) * y for x, y in zip(xs, ys)]


@pytest.mark.parametrize("p,tp,rule", [(0.5, 2, "sqrt_tp"), (0.25, 2, "none"), (0.5, 4, "sqrt_tp"),
                                       (0.0, 2, "sqrt_tp")])
def test_block_rule_against_masked_reference(p, tp, rule):
    gen, inputs = _model([])
    blk = gen.blocks[0]
    g = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 16, 32, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(tp)]
    c = torch.randn(2, 32, generator=g, dtype=torch.float64)
    scale = private_scale(tp, rule)
    got = block_streams(blk, xs, c, p, scale)
    want = _masked_block(blk, xs, c, p, scale)
    k = synced_channels(32, p)
    for a, b in zip(got, want):
        assert float((a - b).detach().abs().max()) < 1e-12 * float(b.detach().abs().max())
    if 0 < k:  # the synchronized channels agree across ranks, the private ones do not
        assert float((got[0][..., :k] - got[1][..., :k]).detach().abs().max()) > 0.1  # inputs differ per rank
    # gradients of both implementations with respect to every stream
    w = [torch.randn(y.shape, generator=g, dtype=y.dtype) for y in got]
    ga = torch.autograd.grad(sum((y * wi).sum() for y, wi in zip(got, w)), xs)
    gb = torch.autograd.grad(sum((y * wi).sum() for y, wi in zip(want, w)), xs)
    for a, b in zip(ga, gb):
        assert float((a - b).abs().max()) < 1e-12 * float(b.abs().max())


def test_partial_sync_changes_the_function_and_equal_streams_stay_synced():
    gen, inputs = _model([])
    with torch.no_grad():
        full = gen(*inputs)
        half = PartialSyncGenerator(gen, tp=2, p=0.5)(*inputs)
    assert float((half - full).abs().max()) > 1e-3 * float(full.abs().max())
    # identical inputs: the synchronized channels of both streams stay identical through a block
    x = torch.randn(2, 16, 32, dtype=torch.float64)
    c = torch.randn(2, 32, dtype=torch.float64)
    with torch.no_grad():
        ys = block_streams(gen.blocks[0], [x, x], c, 0.5, math.sqrt(2))
    assert float((ys[0][..., :16] - ys[1][..., :16]).abs().max()) < 1e-6 * float(ys[0].abs().max())
    assert float((ys[0][..., 16:] - ys[1][..., 16:]).abs().max()) > 1e-3


def test_synced_channels_and_validation():
    assert synced_channels(128, 0.5) == 64 and synced_channels(128, 0.25) == 32 and synced_channels(96, 1.0) == 96
    assert private_scale(4, "sqrt_tp") == 2.0 and private_scale(4, "none") == 1.0
    with pytest.raises(ValueError, match=r"partial_sync=1.5 must be in \[0, 1\]"):
        synced_channels(8, 1.5)
    with pytest.raises(ValueError, match="partial_sync_scale='init'"):
        private_scale(2, "init")
    gen, _ = _model([])
    with pytest.raises(ValueError, match="tp=3 does not divide num_heads=4"):
        PartialSyncGenerator(gen, tp=3, p=0.5)


def test_config_key_validation():
    from vitp.config import validate_config

    with pytest.raises(ValueError, match=r"parallel.partial_sync=1.5: must be a number in \[0, 1\] \(1 = exact TP\)"):
        validate_config(compose_cfg(["experiment=smoke", "parallel.partial_sync=1.5"]))
    with pytest.raises(ValueError, match="parallel.partial_sync_scale=x: must be 'sqrt_tp' | 'none'"):
        validate_config(compose_cfg(["experiment=smoke", "parallel.partial_sync_scale=x"]))


def test_weights_of_a_p_below_1_run_load_only_at_their_layout():
    from vitp.checkpoint.export import check_partial_sync_layout, generator_from_state, partial_sync_of

    ps = partial_sync_of({"tp": 2, "partial_sync": 0.5})
    check_partial_sync_layout(ps, 2, 0.5, "f.safetensors")  # same layout: fine
    check_partial_sync_layout(partial_sync_of(None), 4, 1.0, "f")  # exact TP loads anywhere
    with pytest.raises(ValueError, match=r"f.safetensors was trained with parallel.partial_sync=0.5 at "
                                         r"parallel.tp=2.*now tp=4"):
        check_partial_sync_layout(ps, 4, 0.5, "f.safetensors")
    with pytest.raises(ValueError, match="now tp=2, partial_sync=1.0"):
        check_partial_sync_layout(ps, 2, 1.0, "f.safetensors")
    gen, inputs = _model([])
    cfg = compose_cfg(["experiment=smoke", "model.num_heads=4"]).model
    state = {k: v.float() for k, v in gen.state_dict().items()}
    model = generator_from_state(cfg, state, "cpu", ps)
    assert isinstance(model, PartialSyncGenerator) and model.tp == 2 and model.p == 0.5 and not model.training
    assert isinstance(generator_from_state(cfg, state, "cpu", partial_sync_of(None)), Generator)
