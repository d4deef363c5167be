"""Tensor / sequence parallelism (vitp.parallel) against unsharded references, on CPU gloo.

Each multi-process check runs once per session (two spawns: 2 ranks and 4 ranks); every worker
builds the full model from one seed, runs the reference on an unsharded deepcopy, shards a copy
and compares outputs, losses, every gradient (sharded ones gathered back to timm's layout) and
weights. The parent asserts on the returned numbers so each variant reports separately.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from omegaconf import OmegaConf
from timm.layers import Attention, Mlp, SwiGLU

from conftest import compose_cfg, run_ranks
from vitp.parallel import (
    ParallelState,
    TPAttention,
    TPMlp,
    shard_tensor,
    tensor_parallelize,
    validate_tp,
)
from vitp.parallel.layers import unshard_parts

B = 2


VIDEO = ["data=synthetic", "data.channels=3", "data.num_classes=4", "data.num_frames=6", "data.resolution=6",
         "model.tubelet_size=2"]


def _model_cfgs():
    base = ["experiment=smoke", "model.num_heads=4"]
    variants = {
        "default": [],
        "no_qkv_bias": ["model.qkv_bias=false"],
        "qk_norm": ["model.qk_norm=true"],
        "swiglu": ["model.mlp=swiglu", "model.mlp_ratio=3"],
        "layer_scale": ["model.layer_scale_init=0.1"],
        "odd_tokens": ["data.resolution=6", "model.qk_norm=true", "model.layer_scale_init=0.1"],  # N = 9
        # video: grid (gt, gh, gw) = (3, 3, 3), N = 27 (padded to 28 under SP, so a shard boundary
        # falls inside a frame); depth 2 = one spatial + one temporal block when factorized
        "video_full": VIDEO,
        "video_factorized": [*VIDEO, "model.attention=factorized", "model.qk_norm=true"],
    }
    return {k: OmegaConf.to_container(compose_cfg(base + v).model, resolve=True) for k, v in variants.items()}


# ----------------------------------------------------------------------------- worker helpers

def _perturb(model: nn.Module, seed: int = 1) -> None:
    """adaLN-Zero starts as the identity; random weights make every gradient non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _double(model: nn.Module) -> nn.Module:
    """float64 copy-free cast. ``TimestepEmbedder`` feeds a float32 sinusoid to its MLP, so cast
    that input to the weights' dtype (test-only adapter; the model itself runs in fp32/bf16)."""
    from vitp.models.generator import TimestepEmbedder

    model.double()
    for m in model.modules():
        if isinstance(m, TimestepEmbedder):
            m.mlp.register_forward_pre_hook(lambda mod, a: (a[0].to(mod.fc1.weight.dtype),))
    return model


def _build(kind, cfg):
    """(full model, inputs, loss weight, dtype) identical on every rank."""
    if kind == "vit":
        from timm.layers import SwiGLUPacked
        from timm.models.vision_transformer import VisionTransformer

        torch.manual_seed(0)
        packed = dict(mlp_layer=SwiGLUPacked, act_layer=nn.SiLU, qk_norm=True, init_values=0.1)
        extra = packed if cfg == "packed" else {}
        model = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, class_token=True,
                                  reg_tokens=2, num_classes=10, **extra).double()
        g = torch.Generator().manual_seed(2)
        inputs = (torch.randn(B, 3, 16, 16, generator=g, dtype=torch.float64),)
    else:
        from vitp.models import Generator

        model = _double(Generator(cfg, seed=0))
        g = torch.Generator().manual_seed(2)
        R, C = cfg["image_size"], cfg["in_channels"]
        inputs = (torch.randn(B, C, cfg["num_frames"], R, R, generator=g, dtype=torch.float64),
                  torch.rand(B, generator=g),
                  torch.randint(0, cfg["num_classes"] + 1, (B,), generator=g))
    _perturb(model)
    with torch.no_grad():
        out = model(*inputs)
    w = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return model, inputs, w


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / (b.abs().max() + 1e-30))


def _fwd_bwd(model, inputs, w):
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    loss = (out * w).sum()
    loss.backward()
    return out.detach(), loss.detach()


def _compare(ref, model, state, inputs, w, rename=None):
    """Reference vs TP: forward, loss, weights and gradients (gathered to full layout)."""
    from vitp.parallel import full_weight

    out_r, loss_r = _fwd_bwd(ref, inputs, w)
    out_t, loss_t = _fwd_bwd(model, inputs, w)
    ref_params = dict(ref.named_parameters())
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    errs, weights, missing = {}, 0.0, []
    names = []
    for name, p in model.named_parameters():
        key = rename(name) if rename else name
        names.append(key)
        if key not in ref_params or p.grad is None:
            missing.append(key)
            continue
        r = ref_params[key]
        weights = max(weights, _rel(full_weight(p, state), r.detach()))
        # relative to the tensor's own gradient scale, floored at 1e-3 of the model's (k_norm's
        # bias has an exactly-zero true gradient: softmax ignores a per-query constant)
        g = full_weight(p, state, p.grad).double()
        errs[key] = float((g - r.grad.double()).abs().max()) / max(float(r.grad.abs().max()), 1e-3 * scale)
    worst = max(errs, key=errs.get)
    return {"out": _rel(out_t, out_r), "loss": _rel(loss_t, loss_r), "grad": errs[worst], "worst": worst,
            "weights": weights, "missing": missing, "same_names": sorted(names) == sorted(ref_params),
            "dtype": str(out_r.dtype),
            "zero_grads": [n for n, p in ref.named_parameters() if float(p.grad.abs().max()) < 1e-6 * scale]}


def _gather_objects(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _parity(kind, cfg, state, seq_len=None):
    model, inputs, w = _build(kind, cfg)
    ref = copy.deepcopy(model)
    tensor_parallelize(model, state, seq_len=seq_len)
    return _compare(ref, model, state, inputs, w)


def _init(rank):
    import os

    from vitp.dist import init_distributed

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    init_distributed(torch.device("cpu"))


# ----------------------------------------------------------------------------- 2-rank worker

def _worker_tp2(rank, cfgs):
    import dataclasses

    from vitp.parallel import (
        ColumnParallelLinear,
        CommRecorder,
        full_state_dict,
        full_weight,
        load_full_state_dict,
        get_rng_tracker,
        make_state,
        model_parallel_seed,
        sequence_parallel_enter,
        sequence_parallel_exit,
    )

    _init(rank)
    res = {}
    try:
        make_state(tp=4)
    except ValueError as e:
        res["bad_layout"] = str(e)
    base = make_state(tp=2, pp=1, dp=1)
    states = {sp: dataclasses.replace(base, sequence_parallel=sp) for sp in (False, True)}

    # 1. parity of every variant, SP off and on
    for sp, state in states.items():
        for name, cfg in cfgs.items():
            res[f"gen/{name}/sp={sp}"] = _parity("gen", cfg, state)
        res[f"vit/plain/sp={sp}"] = _parity("vit", None, state)
        res[f"vit/packed/sp={sp}"] = _parity("vit", "packed", state)

    # 2. pipeline layers (EmbedPipe/BlockPipe/FinalPipe) with the grid's own groups, SP on
    from deepspeed.runtime.pipe.module import PipelineModule

    from vitp.models import Generator
    from vitp.objectives import FlowMatchingLoss
    from vitp.parallel import from_grid
    from vitp.pipeline import build_pipeline, to_generator_state

    cfg = cfgs["odd_tokens"]
    pipe = build_pipeline(cfg, FlowMatchingLoss(0.05), seed=0, tp=2)
    assert isinstance(pipe, PipelineModule)
    _perturb(_double(pipe))
    gen = _double(Generator(cfg))
    gen.load_state_dict(to_generator_state(pipe.state_dict(), cfg["depth"]))
    _, inputs, w = _build("gen", cfg)
    pstate = from_grid(pipe._grid, sequence_parallel=True)
    res["pipe_state"] = dataclasses.asdict(dataclasses.replace(pstate, tp_group=None))
    tensor_parallelize(pipe, pstate)
    to_gen = {k: v for k, v in zip([n for n, _ in pipe.named_parameters()],
                                   to_generator_state({n: 0 for n, _ in pipe.named_parameters()}, cfg["depth"]))}

    class _Wrap(nn.Module):  # the pipeline module takes one tuple
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *inputs):
            return self.m(inputs)

    res["pipe/sp=True"] = _compare(gen, _Wrap(pipe), pstate, inputs, w, rename=lambda n: to_gen[n[2:]])

    # 3. parameter attributes read by DeepSpeed's grad norm
    model, _, _ = _build("gen", cfgs["qk_norm"])
    tensor_parallelize(model, states[True])
    blk = model.blocks[0]
    attrs = lambda p: {k: getattr(p, k, None) for k in  # noqa: E731
                       ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel",
                        "tp_partial_grad")}
    res["attrs"] = {n: attrs(p) for n, p in blk.named_parameters()}
    res["attrs"]["y_embedder"] = attrs(model.embed.y_embedder.weight)
    ref, _, _ = _build("gen", cfgs["qk_norm"])
    full = full_state_dict(model, states[True])  # timm layout, full tensors
    load_full_state_dict(model, full, states[True])
    res["export"] = {"keys": sorted(full) == sorted(ref.state_dict()),
                     "values": max(_rel(v, ref.state_dict()[k]) for k, v in full.items()),
                     "reload": max(_rel(full_weight(p, states[True]), ref.state_dict()[n])
                                   for n, p in model.named_parameters())}
    try:
        copy.deepcopy(model)
    except TypeError as e:
        res["export"]["deepcopy"] = str(e)

    # 4. replicated parameters stay bit-identical after SGD steps (qk-norm + LayerScale + SP)
    model, inputs, w = _build("gen", cfgs["odd_tokens"])
    ref = copy.deepcopy(model)
    tensor_parallelize(model, states[True])
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for _ in range(3):
            _fwd_bwd(m, inputs, w)
            opt.step()
    rep = torch.cat([p.detach().flatten() for p in model.parameters() if not getattr(p, "tensor_model_parallel", 0)])
    res["replicated_bits"] = _gather_objects(rep.numpy().tobytes())
    ref_params = dict(ref.named_parameters())
    res["after_steps"] = max(_rel(full_weight(p, states[True]), ref_params[n].detach())
                             for n, p in model.named_parameters())

    # 5. a contiguous split of timm's fused qkv is wrong; the head-wise split is right
    torch.manual_seed(3)
    attn = Attention(32, num_heads=4, qkv_bias=True).double()
    x = torch.randn(B, 5, 32, dtype=torch.float64)
    want = attn(x)
    good = TPAttention.from_timm(copy.deepcopy(attn), states[False])
    bad = TPAttention.from_timm(copy.deepcopy(attn), states[False])
    bad.qkv = ColumnParallelLinear.from_linear(attn.qkv, states[False])  # contiguous rows
    mask = torch.rand(B, 4, 5, 5) > 0.3  # per-head boolean mask: cut to the local heads
    mask |= torch.eye(5, dtype=torch.bool)
    res["qkv_split"] = {"headwise": _rel(good(x), want), "contiguous": _rel(bad(x), want),
                        "per_head_mask": _rel(good(x, attn_mask=mask), attn(x, attn_mask=mask))}

    # 6. RNG: forked (TP) stream differs across TP ranks, default stream identical; attention
    #    dropout draws from the forked stream only in training; replicated dropout identical.
    seeds = model_parallel_seed(123, states[False])
    draws = {"default": torch.rand(6).tolist()}
    with get_rng_tracker().fork():
        draws["tp"] = torch.rand(6).tolist()
    res["rng_draws"] = _gather_objects(draws)
    res["rng_seeds"] = seeds
    attn_d = TPAttention.from_timm(Attention(32, num_heads=4, attn_drop=0.5).double(), states[False])
    before, tp_before = torch.get_rng_state(), get_rng_tracker().get_states()
    attn_d.train()
    y_train = attn_d(x)
    rng = {"default_untouched": bool(torch.equal(before, torch.get_rng_state())),
           "tp_advanced": not torch.equal(tp_before["tensor-parallel-rng"]["cpu"],
                                          get_rng_tracker().get_states()["tensor-parallel-rng"]["cpu"])}
    attn_d.eval()
    tp_eval = get_rng_tracker().get_states()["tensor-parallel-rng"]["cpu"]
    y_eval1, y_eval2 = attn_d(x), attn_d(x)
    rng["eval_deterministic"] = bool(torch.equal(y_eval1, y_eval2))
    rng["eval_no_rng"] = bool(torch.equal(tp_eval, get_rng_tracker().get_states()["tensor-parallel-rng"]["cpu"]))
    rng["train_differs"] = _rel(y_train, y_eval1) > 1e-3
    drop_cfg = dict(cfgs["default"], attn_drop=0.3, proj_drop=0.3, drop_path=0.3)
    for sp, state in states.items():
        model, inputs, _ = _build("gen", drop_cfg)
        tensor_parallelize(model, state)
        model.train()
        out = model(*inputs)
        rng[f"replicated_out_sp={sp}"] = out.detach().numpy().tobytes()
    res["rng"] = rng
    res["rng_outs"] = _gather_objects({k: v for k, v in rng.items() if k.startswith("replicated_out")})

    # 7. communication of one block and micro-batch vs theory (SP off / on)
    from vitp.models import Block

    D, N = 32, 16
    comm = {}
    for sp, state in states.items():
        torch.manual_seed(4)
        blk = Block(dict(cfgs["default"]))
        _perturb(blk)
        tensor_parallelize(blk, state, seq_len=N)
        x = torch.randn(B, N, D, requires_grad=True)
        c = torch.randn(B, D, requires_grad=True)
        xin = sequence_parallel_enter(x, state)
        with CommRecorder() as rec:
            y = blk(xin, c)
            (sequence_parallel_exit(y, state, N) ** 2).sum().backward()
        comm[sp] = {"summary": rec.summary(), "wire": rec.wire_bytes(tag="tp")}
    res["comm"] = comm
    # a factorized (spatial / temporal) block communicates exactly as a full block: one all-gather
    # and one reduce-scatter around attention (their transposes in backward), N = 27 -> 28
    vcfg, nv = cfgs["video_factorized"], 27
    res["comm_video"] = {}
    for kind in ("full", "spatial", "temporal"):
        torch.manual_seed(4)
        blk = Block(vcfg, attention=kind)
        _perturb(blk)
        tensor_parallelize(blk, states[True], seq_len=nv)
        x = torch.randn(B, nv, D, requires_grad=True)
        c = torch.randn(B, D, requires_grad=True)
        with CommRecorder() as rec:
            y = blk(sequence_parallel_enter(x, states[True]), c)
            (sequence_parallel_exit(y, states[True], nv) ** 2).sum().backward()
        res["comm_video"][kind] = rec.summary()
    res["comm_elem"] = {"BND": B * N * D * 4, "B6D": B * 6 * D * 4, "D": D * 4}
    return res


# ----------------------------------------------------------------------------- 4-rank worker

def _worker_tp4(rank, cfgs):
    import dataclasses

    from vitp.parallel import get_rng_tracker, make_state, model_parallel_seed

    _init(rank)
    res = {}
    base = make_state(tp=4)
    for sp in (False, True):
        state = dataclasses.replace(base, sequence_parallel=sp)
        res[f"gen/odd_tokens/sp={sp}"] = _parity("gen", cfgs["odd_tokens"], state)  # N = 9 -> 12 at tp=4
        res[f"gen/default/sp={sp}"] = _parity("gen", cfgs["default"], state)
        res[f"gen/video_factorized/sp={sp}"] = _parity("gen", cfgs["video_factorized"], state)  # N = 27 -> 28
        res[f"vit/plain/sp={sp}"] = _parity("vit", None, state)  # N = 19 -> 20
    # tp=2 x dp=2: default stream shared by a TP group only, TP stream unique everywhere
    st = make_state(tp=2, dp=2)
    model_parallel_seed(7, st)
    draws = {"tp_rank": st.tp_rank, "dp_rank": st.dp_rank, "default": torch.rand(4).tolist()}
    with get_rng_tracker().fork():
        draws["tp"] = torch.rand(4).tolist()
    res["rng"] = _gather_objects(draws)
    return res


# ----------------------------------------------------------------------------- fixtures / tests

@pytest.fixture(scope="module")
def cfgs():
    return _model_cfgs()


@pytest.fixture(scope="module")
def tp2(cfgs):
    return run_ranks(2, _worker_tp2, cfgs)


@pytest.fixture(scope="module")
def tp4(cfgs):
    return run_ranks(4, _worker_tp4, cfgs)


def _check(r, key):
    tol = 1e-10 if r["dtype"] == "torch.float64" else 2e-5
    msg = f"{key}: {r}"
    assert r["same_names"] and not r["missing"], msg
    assert all(n.endswith("k_norm.bias") for n in r["zero_grads"]), msg  # every other gradient is non-trivial
    assert r["weights"] == 0.0, msg
    assert r["out"] < tol and r["loss"] < tol and r["grad"] < tol, msg


PARITY_KEYS = [f"{m}/sp={sp}" for sp in (False, True) for m in
               ["gen/default", "gen/no_qkv_bias", "gen/qk_norm", "gen/swiglu", "gen/layer_scale", "gen/odd_tokens",
                "gen/video_full", "gen/video_factorized", "vit/plain", "vit/packed"]]


@pytest.mark.parametrize("key", PARITY_KEYS)
def test_tp2_matches_reference(tp2, key):
    for rank_res in tp2:
        _check(rank_res[key], key)


@pytest.mark.parametrize("key", [f"{m}/sp={sp}" for sp in (False, True)
                                 for m in ["gen/odd_tokens", "gen/default", "gen/video_factorized", "vit/plain"]])
def test_tp4_matches_reference(tp4, key):
    for rank_res in tp4:
        _check(rank_res[key], key)


def test_pipeline_layers_with_sequence_parallel(tp2):
    for r in tp2:
        _check(r["pipe/sp=True"], "pipe")
        assert r["pipe_state"]["tp_size"] == 2 and r["pipe_state"]["sequence_parallel"]
    assert [r["pipe_state"]["tp_rank"] for r in tp2] == [0, 1]


def test_make_state_rejects_wrong_layout(tp2):
    msg = tp2[0]["bad_layout"]
    assert "does not match the world size 2" in msg and "tp=2 pp=1 dp=1" in msg


def test_parameter_attributes_for_grad_norm(tp2):
    a = tp2[0]["attrs"]
    assert a["attn.qkv.weight"]["tensor_model_parallel"] and a["attn.qkv.weight"]["partition_dim"] == 0
    assert a["attn.qkv.weight"]["partition_stride"] == 3 and a["attn.qkv.bias"]["partition_stride"] == 3
    assert a["attn.proj.weight"]["partition_dim"] == 1 and a["mlp.fc2.weight"]["tensor_model_parallel"]
    assert a["mlp.fc1.weight"]["partition_dim"] == 0 and a["mlp.fc1.bias"]["tensor_model_parallel"]
    for name in ("attn.proj.bias", "mlp.fc2.bias"):  # replicated, partial under SP
        assert a[name]["tensor_model_parallel"] is None and a[name]["sequence_parallel"], name
    for name in ("attn.q_norm.weight", "attn.k_norm.bias"):
        assert a[name]["tp_partial_grad"] and a[name]["tensor_model_parallel"] is None, name
    for name in ("adaLN_modulation.1.weight", "y_embedder"):  # complete through CopyToTPRegion
        assert a[name] == dict.fromkeys(a[name]), name


def test_full_state_dict_round_trip(tp2):
    for r in tp2:
        e = r["export"]
        assert e["keys"] and e["values"] == 0.0 and e["reload"] == 0.0, e
        assert "deepcopy the full model before" in e["deepcopy"]


def test_replicated_params_bit_identical_after_steps(tp2):
    assert tp2[0]["replicated_bits"][0] == tp2[0]["replicated_bits"][1]
    assert tp2[0]["after_steps"] < 1e-4


def test_contiguous_qkv_split_is_wrong(tp2):
    for r in tp2:
        assert r["qkv_split"]["headwise"] < 1e-12 and r["qkv_split"]["per_head_mask"] < 1e-12
        assert r["qkv_split"]["contiguous"] > 1e-2


def test_rng_rules(tp2, tp4):
    d0, d1 = tp2[0]["rng_draws"]
    assert d0["default"] == d1["default"] and d0["tp"] != d1["tp"]
    assert d0["tp"] != d0["default"]
    for r in tp2:
        assert r["rng"]["default_untouched"] and r["rng"]["tp_advanced"], r["rng"]
        assert r["rng"]["eval_deterministic"] and r["rng"]["eval_no_rng"] and r["rng"]["train_differs"]
    outs = tp2[0]["rng_outs"]
    for key in outs[0]:  # dropout/drop-path on replicated activations: same on every TP rank
        assert outs[0][key] == outs[1][key], key
    draws = tp4[0]["rng"]
    for a in draws:
        for b in draws:
            if a is b:
                continue
            assert a["tp"] != b["tp"]
            assert (a["default"] == b["default"]) == (a["dp_rank"] == b["dp_rank"])


def test_comm_matches_theory(tp2):
    e = tp2[0]["comm_elem"]
    off, on = tp2[0]["comm"][False], tp2[0]["comm"][True]
    two = {"count": 2, "bytes": 2 * e["BND"]}
    assert off["summary"] == {("all_reduce", "fwd", "tp"): two, ("all_reduce", "bwd", "tp"): two}
    s = on["summary"]
    for kind in ("all_gather", "reduce_scatter"):
        for direction in ("fwd", "bwd"):
            assert s.pop((kind, direction, "tp")) == two, (kind, direction)
    assert s.pop(("all_reduce", "bwd", "cond")) == {"count": 1, "bytes": e["B6D"]}  # adaLN output grad
    assert s.pop(("all_reduce", "bwd", "param_grad")) == {"count": 2, "bytes": 2 * e["D"]}  # proj/fc2 bias
    assert s.pop(("all_gather", "fwd", "sp_boundary")) == {"count": 1, "bytes": e["BND"]}  # exit
    assert s.pop(("all_gather", "bwd", "sp_boundary")) == {"count": 1, "bytes": e["BND"]}  # enter's backward
    assert not s, s
    assert on["wire"] == off["wire"]  # same per-rank volume (ring algorithms)


def test_factorized_attention_comm_equals_full(tp2):
    full = tp2[0]["comm_video"]["full"]
    for direction in ("fwd", "bwd"):  # attention + MLP
        assert full[("all_gather", direction, "tp")]["count"] == 2
        assert full[("reduce_scatter", direction, "tp")]["count"] == 2
    for kind in ("spatial", "temporal"):
        assert tp2[0]["comm_video"][kind] == full, kind


# ----------------------------------------------------------------------------- single process

def test_headwise_shard_layout():
    H, hd, D, tp = 4, 8, 32, 2
    w = torch.randn(3 * H * hd, D)
    parts = [shard_tensor(w, 0, 3, tp, r) for r in range(tp)]
    for r in range(tp):
        heads = slice(r * H // tp, (r + 1) * H // tp)
        assert torch.equal(parts[r], w.view(3, H, hd, D)[:, heads].reshape(-1, D))
    assert torch.equal(unshard_parts(parts, 0, 3), w)


def test_validate_tp_messages(cfgs):
    validate_tp(cfgs["default"], 4)
    with pytest.raises(ValueError, match=r"model.num_heads=4; valid tp degrees for this model: \[1, 2, 4\]"):
        validate_tp(cfgs["default"], 3)
    with pytest.raises(ValueError, match=r"MLP hidden units.*=42.*valid tp degrees.*\[1, 2\]"):
        validate_tp(dict(cfgs["default"], mlp="swiglu", mlp_ratio=2.0), 4)  # hidden int(64 * 2/3) = 42
    with pytest.raises(ValueError, match=r"num_heads=6.*\[1, 2, 3, 6\]"):
        validate_tp(nn.Sequential(Attention(48, num_heads=6), Mlp(48, 96)), 4)


def test_unsupported_timm_options_raise():
    st = ParallelState(tp_size=2, tp_rank=0)
    norm = nn.LayerNorm
    with pytest.raises(ValueError, match="scale_norm"):
        TPAttention.from_timm(Attention(32, num_heads=4, scale_norm=True, norm_layer=norm), st)
    with pytest.raises(ValueError, match="gated"):
        TPAttention.from_timm(Attention(32, num_heads=4, gated=True), st)
    with pytest.raises(ValueError, match="num_heads=3"):
        TPAttention.from_timm(Attention(33, num_heads=3), st)
    with pytest.raises(ValueError, match="scale_mlp_norm"):
        TPMlp.from_timm(Mlp(32, 64, norm_layer=norm), st)
    with pytest.raises(ValueError, match="hidden units=21"):
        TPMlp.from_timm(SwiGLU(32, 21), st)
    with pytest.raises(ValueError, match="no block"):
        tensor_parallelize(nn.Linear(2, 2), st)
    with pytest.raises(ValueError, match="seq_len"):
        from vitp.models import Block

        tensor_parallelize(Block(dict(width=32, num_heads=4, mlp_ratio=2.0, mlp="gelu", qkv_bias=True,
                                      qk_norm=False)), ParallelState(tp_size=2, sequence_parallel=True))


def test_tp1_is_a_no_op(cfgs):
    from vitp.models import Generator

    model = Generator(cfgs["default"], seed=0)
    attn = model.blocks[0].attn
    assert tensor_parallelize(model, ParallelState(sequence_parallel=True)) is model
    assert model.blocks[0].attn is attn and not ParallelState(sequence_parallel=True).sequence_parallel
