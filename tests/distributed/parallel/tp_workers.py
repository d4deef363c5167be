"""Rank-side checks of tensor / sequence parallelism (vitp.parallel, vitp.models.parallelize_generator).

The test modules of this folder share two process groups (``conftest.py``): :func:`worker_tp2`
(2 ranks) and :func:`worker_tp4` (4 ranks) run the focused checks below in turn and return plain
numbers / flags to the parent, which asserts on them test by test. Every check builds the full
model from one seed, runs the reference on an unsharded deepcopy, shards a copy and compares
outputs, losses, every gradient (sharded ones gathered back to timm's layout) and weights.
"""
from __future__ import annotations

import copy
import dataclasses

import torch
import torch.nn as nn
from timm.layers import Attention

B = 2

VIDEO = ["data=synthetic", "data.channels=3", "data.num_classes=4", "data.num_frames=6", "data.resolution=6",
         "model.tubelet_size=2"]


CP_VIDEO = ["data=synthetic", "data.channels=3", "data.num_classes=4", "data.num_frames=8", "data.resolution=4",
            "model.tubelet_size=2"]


def model_cfgs() -> dict:
    """``{variant: model config as a plain dict}``, composed in the parent (Hydra) and sent to the ranks."""
    from omegaconf import OmegaConf

    from tests.helpers import compose_cfg

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
        # context parallelism: grid (4, 2, 2), N = 16 splits over cp = 2 and 4, frames too
        "cp_video_full": CP_VIDEO,
        "cp_video_factorized": [*CP_VIDEO, "model.attention=factorized", "model.qk_norm=true"],
        # text conditioning: caption tokens of 12 channels, cross-attention in every block
        "text": ["model.text_dim=12"],
        "text_qk_norm_odd": ["model.text_dim=12", "model.qk_norm=true", "data.resolution=6"],  # N = 9
        "cp_video_text": [*CP_VIDEO, "model.attention=factorized", "model.text_dim=12"],
    }
    return {k: OmegaConf.to_container(compose_cfg(base + v).model, resolve=True) for k, v in variants.items()}


# ----------------------------------------------------------------------------- shared helpers

def perturb(model: nn.Module, seed: int = 1) -> None:
    """adaLN-Zero starts as the identity; random weights make every gradient non-trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def block_kwargs(cfg: dict, **override) -> dict:
    """Keyword arguments of the first generator ``Block`` of a model config (drop-path rate 0)."""
    from vitp.models import Block, layer_specs

    cls, kw = layer_specs(**cfg)[1]
    assert cls is Block
    return dict(kw, **override)


def build(kind, cfg):
    """(full float64 model, inputs, loss weight), identical on every rank."""
    g = torch.Generator().manual_seed(2)
    if kind == "vit":
        from timm.layers import SwiGLUPacked
        from timm.models.vision_transformer import VisionTransformer

        torch.manual_seed(0)
        packed = dict(mlp_layer=SwiGLUPacked, act_layer=nn.SiLU, qk_norm=True, init_values=0.1)
        extra = packed if cfg == "packed" else {}
        model = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=2, num_heads=4, class_token=True,
                                  reg_tokens=2, num_classes=10, **extra).double()
        inputs = (torch.randn(B, 3, 16, 16, generator=g, dtype=torch.float64),)
    else:
        from vitp.models import Generator

        # the generator casts its float32 timestep sinusoid to the weights' dtype itself
        model = Generator(seed=0, **cfg).double()
        from vitp.config import parse_resolution

        (H, W), C = parse_resolution(cfg["image_size"]), cfg["in_channels"]
        inputs = (torch.randn(B, C, cfg["num_frames"], H, W, generator=g, dtype=torch.float64),
                  torch.rand(B, generator=g), *conditioning(cfg, g))
    perturb(model)
    with torch.no_grad():
        out = model(*inputs)
    w = torch.randn(out.shape, generator=g, dtype=out.dtype)
    return model, inputs, w


def conditioning(cfg, g, L=5):
    """Class labels ``(y,)``, or caption embeddings ``(y (B, L, text_dim), mask (B, L))`` with
    padding (sample 0 holds 3 valid tokens, the others all ``L``)."""
    if not cfg.get("text_dim"):
        return (torch.randint(0, cfg["num_classes"] + 1, (B,), generator=g),)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, 3:] = False
    return torch.randn(B, L, cfg["text_dim"], generator=g, dtype=torch.float64), mask


def parallelize(kind, model, state, seq_len=None):
    """The generator's plan for ``gen``, the generic timm plan for ``vit``."""
    from vitp.models import parallelize_generator
    from vitp.parallel import tensor_parallelize

    (tensor_parallelize if kind == "vit" else parallelize_generator)(model, state, seq_len=seq_len)
    return model


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / (b.abs().max() + 1e-30))


def fwd_bwd(model, inputs, w):
    model.zero_grad(set_to_none=True)
    out = model(*inputs)
    loss = (out * w).sum()
    loss.backward()
    return out.detach(), loss.detach()


def compare(ref, model, state, inputs, w, rename=None, after_backward=None):
    """Reference vs TP: forward, loss, weights and gradients (gathered to full layout);
    ``after_backward(model)`` runs after the parallel model's backward (e.g. a cp reduction)."""
    from vitp.parallel import full_weight

    out_r, loss_r = fwd_bwd(ref, inputs, w)
    out_t, loss_t = fwd_bwd(model, inputs, w)
    if after_backward is not None:
        after_backward(model)
    ref_params = dict(ref.named_parameters())
    scale = max(float(p.grad.abs().max()) for p in ref.parameters())
    errs, weights, missing, names = {}, 0.0, [], []
    for name, p in model.named_parameters():
        key = rename(name) if rename else name
        names.append(key)
        if key not in ref_params or p.grad is None:
            missing.append(key)
            continue
        r = ref_params[key]
        weights = max(weights, rel(full_weight(p, state), r.detach()))
        # relative to the tensor's own gradient scale, floored at 1e-3 of the model's (k_norm's
        # bias has an exactly-zero true gradient: softmax ignores a per-query constant)
        g = full_weight(p, state, p.grad).double()
        errs[key] = float((g - r.grad.double()).abs().max()) / max(float(r.grad.abs().max()), 1e-3 * scale)
    worst = max(errs, key=errs.get)
    return {"out": rel(out_t, out_r), "loss": rel(loss_t, loss_r), "grad": errs[worst], "worst": worst,
            "weights": weights, "missing": missing, "same_names": sorted(names) == sorted(ref_params),
            "dtype": str(out_r.dtype),
            "zero_grads": [n for n, p in ref.named_parameters() if float(p.grad.abs().max()) < 1e-6 * scale]}


def gather_objects(obj):
    import torch.distributed as tdist

    out = [None] * tdist.get_world_size()
    tdist.all_gather_object(out, obj)
    return out


def parity(kind, cfg, state, seq_len=None):
    model, inputs, w = build(kind, cfg)
    ref = copy.deepcopy(model)
    parallelize(kind, model, state, seq_len=seq_len)
    return compare(ref, model, state, inputs, w)


# (T, H, W) in turn through one sharded model: grids 3x3x5 (N = 45, padded under SP), 2x5x3, 2x2x2
SHAPES = [(6, 6, 10), (4, 10, 6), (4, 4, 4)]


def shape_change_parity(cfg, states):
    """One sharded model fed inputs of several non-square sizes in turn (the grid, positions, SP
    padding and factorized groups follow each input): every call equals the reference."""
    from vitp.models import Generator

    res = {}
    for sp, state in states.items():
        model = Generator(seed=0, **cfg).double()
        perturb(model)
        ref = copy.deepcopy(model)
        parallelize("gen", model, state)
        g = torch.Generator().manual_seed(3)
        for T, H, W in SHAPES:
            x = torch.randn(B, cfg["in_channels"], T, H, W, generator=g, dtype=torch.float64)
            inputs = (x, torch.rand(B, generator=g), torch.randint(0, cfg["num_classes"] + 1, (B,), generator=g))
            w = torch.randn(x.shape, generator=g, dtype=x.dtype)
            res[f"shapes/{T}x{H}x{W}/sp={sp}"] = compare(ref, model, state, inputs, w)
    return res


def init(rank):
    import os

    from vitp.parallel import distributed as dist

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    dist.init_distributed(torch.device("cpu"))
    assert dist.rank() == rank


# ----------------------------------------------------------------------------- tp=2 checks

def tp2_states():
    """``({sequence_parallel: state}, wrong-layout message)`` of a 2-rank world at tp=2."""
    from vitp.parallel import make_state

    try:
        make_state(tp=4)
        bad = None
    except ValueError as e:
        bad = str(e)
    base = make_state(tp=2, pp=1, dp=1)
    return {sp: dataclasses.replace(base, sequence_parallel=sp) for sp in (False, True)}, bad


def module_parity(cfgs, states):
    """Every generator variant and two timm ViTs, SP off and on."""
    res = {}
    for sp, state in states.items():
        for name, cfg in cfgs.items():
            res[f"gen/{name}/sp={sp}"] = parity("gen", cfg, state)
        res[f"vit/plain/sp={sp}"] = parity("vit", None, state)
        res[f"vit/packed/sp={sp}"] = parity("vit", "packed", state)
    return res


class PipeCall(nn.Module):
    """A ``PipelineModule`` takes one tuple; this takes the generator's arguments."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, *inputs):
        return self.m(inputs)


def pipeline_layers_sp(cfg):
    """Pipeline layers (EmbedPipe/BlockPipe/FinalPipe) on the grid's own groups, SP on."""
    from deepspeed.runtime.pipe.module import PipelineModule

    from vitp.models import Generator, generator_key, parallelize_generator, pipeline_to_generator
    from vitp.objectives import FlowMatchingLoss
    from vitp.deepspeed_adapter import pipeline_grid
    from vitp.parallel import from_grid
    from vitp.pipeline import build_pipeline

    pipe = build_pipeline(cfg, FlowMatchingLoss(0.05), seed=0, tp=2)
    assert isinstance(pipe, PipelineModule)
    perturb(pipe.double())
    gen = Generator(**cfg).double()
    gen.load_state_dict(pipeline_to_generator(pipe.state_dict(), cfg["depth"]))
    _, inputs, w = build("gen", cfg)
    pstate = from_grid(pipeline_grid(pipe), sequence_parallel=True)
    res = {"pipe_state": dataclasses.asdict(dataclasses.replace(pstate, tp_group=None))}
    parallelize_generator(pipe, pstate)
    res["pipe/sp=True"] = compare(gen, PipeCall(pipe), pstate, inputs, w,
                                  rename=lambda n: generator_key(n[2:], cfg["depth"]))
    return res


def grad_norm_attributes(cfg, state):
    """Parameter attributes read by DeepSpeed's grad norm, after the generator's SP plan."""
    from vitp.models import parallelize_generator

    model, _, _ = build("gen", cfg)
    parallelize_generator(model, state)
    keys = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "tp_partial_grad")

    def attrs(p):
        return {k: getattr(p, k, None) for k in keys}

    res = {n: attrs(p) for n, p in model.blocks[0].named_parameters()}
    res["y_embedder"] = attrs(model.embed.y_embedder.weight)
    return {"attrs": res}


def state_dict_round_trip(cfg, state):
    """full_state_dict -> load_full_state_dict of a sharded model, and its refusal to deepcopy."""
    from vitp.models import parallelize_generator
    from vitp.parallel import full_state_dict, full_weight, load_full_state_dict

    model, _, _ = build("gen", cfg)
    parallelize_generator(model, state)
    ref = build("gen", cfg)[0].state_dict()
    full = full_state_dict(model, state)  # timm layout, full tensors
    load_full_state_dict(model, full, state)
    res = {"keys": sorted(full) == sorted(ref),
           "values": max(rel(v, ref[k]) for k, v in full.items()),
           "reload": max(rel(full_weight(p, state), ref[n]) for n, p in model.named_parameters())}
    try:
        copy.deepcopy(model)
    except TypeError as e:
        res["deepcopy"] = str(e)
    return {"export": res}


def replicated_after_steps(cfg, state):
    """Replicated parameters stay bit-identical after SGD steps (qk-norm + LayerScale + SP)."""
    from vitp.models import parallelize_generator
    from vitp.parallel import full_weight

    model, inputs, w = build("gen", cfg)
    ref = copy.deepcopy(model)
    parallelize_generator(model, state)
    for m in (model, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for _ in range(3):
            fwd_bwd(m, inputs, w)
            opt.step()
    rep = torch.cat([p.detach().flatten() for p in model.parameters() if not getattr(p, "tensor_model_parallel", 0)])
    ref_params = dict(ref.named_parameters())
    return {"replicated_bits": gather_objects(rep.numpy().tobytes()),
            "after_steps": max(rel(full_weight(p, state), ref_params[n].detach())
                               for n, p in model.named_parameters())}


def qkv_split(state):
    """A contiguous split of timm's fused qkv is wrong; the head-wise split is right."""
    from vitp.parallel import ColumnParallelLinear, TPAttention

    torch.manual_seed(3)
    attn = Attention(32, num_heads=4, qkv_bias=True).double()
    x = torch.randn(B, 5, 32, dtype=torch.float64)
    want = attn(x)
    good = TPAttention.from_timm(copy.deepcopy(attn), state)
    bad = TPAttention.from_timm(copy.deepcopy(attn), state)
    bad.qkv = ColumnParallelLinear.from_linear(attn.qkv, state)  # contiguous rows
    mask = torch.rand(B, 4, 5, 5) > 0.3  # per-head boolean mask: cut to the local heads
    mask |= torch.eye(5, dtype=torch.bool)
    return {"qkv_split": {"headwise": rel(good(x), want), "contiguous": rel(bad(x), want),
                          "per_head_mask": rel(good(x, attn_mask=mask), attn(x, attn_mask=mask))}}


def rng_streams(state):
    """Seed both streams; the forked (TP) draw differs across TP ranks, the default one does not."""
    from vitp.parallel import get_rng_tracker, model_parallel_seed

    seeds = model_parallel_seed(123, state)
    draws = {"default": torch.rand(6).tolist()}
    with get_rng_tracker().fork():
        draws["tp"] = torch.rand(6).tolist()
    return {"rng_draws": gather_objects(draws), "rng_seeds": seeds}


def attention_dropout_rng(state):
    """Attention dropout draws from the forked stream only, and only in training."""
    from vitp.parallel import TPAttention, get_rng_tracker

    def tp_state():
        return get_rng_tracker().get_states()["tensor-parallel-rng"]["cpu"]

    x = torch.randn(B, 5, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    attn_d = TPAttention.from_timm(Attention(32, num_heads=4, attn_drop=0.5).double(), state)
    before, tp_before = torch.get_rng_state(), tp_state()
    attn_d.train()
    y_train = attn_d(x)
    rng = {"default_untouched": bool(torch.equal(before, torch.get_rng_state())),
           "tp_advanced": not torch.equal(tp_before, tp_state())}
    attn_d.eval()
    tp_eval = tp_state()
    y_eval1, y_eval2 = attn_d(x), attn_d(x)
    rng["eval_deterministic"] = bool(torch.equal(y_eval1, y_eval2))
    rng["eval_no_rng"] = bool(torch.equal(tp_eval, tp_state()))
    rng["train_differs"] = rel(y_train, y_eval1) > 1e-3
    return rng


def replicated_dropout(cfg, states):
    """Dropout / drop-path outputs of the generator in training (compared across TP ranks)."""
    from vitp.models import parallelize_generator

    drop_cfg = dict(cfg, attn_drop=0.3, proj_drop=0.3, drop_path=0.3)
    outs = {}
    for sp, state in states.items():
        model, inputs, _ = build("gen", drop_cfg)
        parallelize_generator(model, state)
        model.train()
        outs[f"replicated_out_sp={sp}"] = model(*inputs).detach().numpy().tobytes()
    return outs


def block_comm(blk, state, n, d=32):
    """Collectives of one block's forward + backward on one micro-batch, SP region opened and closed."""
    from vitp.parallel import CommRecorder, sequence_parallel_enter, sequence_parallel_exit

    x = torch.randn(B, n, d, requires_grad=True)
    c = torch.randn(B, d, requires_grad=True)
    with CommRecorder() as rec:
        y = blk(sequence_parallel_enter(x, state), c)
        (sequence_parallel_exit(y, state, n) ** 2).sum().backward()
    return rec


def comm_vs_theory(cfg, states):
    """Communication of one block and micro-batch, SP off / on (compared with theory in the parent)."""
    from vitp.models import Block, parallelize_generator

    D, N = 32, 16
    comm = {}
    for sp, state in states.items():
        torch.manual_seed(4)
        blk = Block(**block_kwargs(cfg))
        perturb(blk)
        parallelize_generator(blk, state, seq_len=N)
        rec = block_comm(blk, state, N, D)
        comm[sp] = {"summary": rec.summary(), "wire": rec.wire_bytes(tag="tp")}
    return {"comm": comm, "comm_elem": {"BND": B * N * D * 4, "B6D": B * 6 * D * 4, "D": D * 4}}


def factorized_comm(cfg, state):
    """A factorized (spatial / temporal) block communicates exactly as a full block: one all-gather
    and one reduce-scatter around attention (their transposes in backward), N = 27 -> 28."""
    from vitp.models import Block, parallelize_generator

    nv, out = 27, {}
    for kind in ("full", "spatial", "temporal"):
        torch.manual_seed(4)
        blk = Block(**block_kwargs(cfg, attention=kind))
        perturb(blk)
        parallelize_generator(blk, state, seq_len=nv)
        out[kind] = block_comm(blk, state, nv).summary()
    return {"comm_video": out}


def worker_tp2(rank, cfgs):
    """Every tp=2 check, in one 2-rank group."""
    init(rank)
    states, bad = tp2_states()
    res = {"bad_layout": bad}
    res.update(module_parity(cfgs, states))
    res.update(pipeline_layers_sp(cfgs["odd_tokens"]))
    res.update(grad_norm_attributes(cfgs["qk_norm"], states[True]))
    res.update(state_dict_round_trip(cfgs["qk_norm"], states[True]))
    res.update(replicated_after_steps(cfgs["odd_tokens"], states[True]))
    res.update(qkv_split(states[False]))
    res.update(rng_streams(states[False]))
    rng = attention_dropout_rng(states[False])
    outs = replicated_dropout(cfgs["default"], states)
    res["rng"] = {**rng, **outs}
    res["rng_outs"] = gather_objects(outs)
    res.update(comm_vs_theory(cfgs["default"], states))
    res.update(factorized_comm(cfgs["video_factorized"], states[True]))
    res.update(shape_change_parity(cfgs["video_factorized"], states))
    from .cp_workers import CP2_LAYOUTS, cp_parity

    res.update(cp_parity(cfgs, CP2_LAYOUTS))
    return res


# ----------------------------------------------------------------------------- tp=4 checks

TP4_PARITY = ("odd_tokens", "default", "video_factorized")  # N = 9 -> 12, 16, 27 -> 28 at tp=4


def tp4_parity(cfgs):
    """Generator variants with uneven shards and a timm ViT (N = 19 -> 20) at tp=4, SP off and on."""
    from vitp.parallel import make_state

    base, res = make_state(tp=4), {}
    for sp in (False, True):
        state = dataclasses.replace(base, sequence_parallel=sp)
        for name in TP4_PARITY:
            res[f"gen/{name}/sp={sp}"] = parity("gen", cfgs[name], state)
        res[f"vit/plain/sp={sp}"] = parity("vit", None, state)
    return res


def rng_tp2_dp2():
    """tp=2 x dp=2: the default stream is shared by a TP group only, the TP stream is unique everywhere."""
    from vitp.parallel import get_rng_tracker, make_state, model_parallel_seed

    st = make_state(tp=2, dp=2)
    model_parallel_seed(7, st)
    draws = {"tp_rank": st.tp_rank, "dp_rank": st.dp_rank, "default": torch.rand(4).tolist()}
    with get_rng_tracker().fork():
        draws["tp"] = torch.rand(4).tolist()
    return {"rng": gather_objects(draws)}


def worker_tp4(rank, cfgs):
    """Every tp=4 check, in one 4-rank group."""
    init(rank)
    res = tp4_parity(cfgs)
    res.update(rng_tp2_dp2())
    from .cp_workers import CP4_LAYOUTS, cp_parity

    res.update(cp_parity(cfgs, CP4_LAYOUTS))
    return res
