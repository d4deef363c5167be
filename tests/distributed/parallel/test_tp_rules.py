"""Rules around the sharded modules (CPU gloo): layout and size validation, the parameter
attributes DeepSpeed's grad norm reads, RNG streams, and communication volume vs theory.

Multi-process results come from the session's 2-rank and 4-rank groups (``conftest.py``,
checks in ``tp_workers.py``).
"""
from __future__ import annotations

import pytest
import torch.nn as nn
from timm.layers import Attention, Mlp, SwiGLU

from tests.helpers import compose_cfg
from vitp.config import validate_layout
from vitp.parallel import ParallelState, TPAttention, TPMlp, tensor_parallelize, validate_tp


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
    mod = a["adaLN_modulation.1.weight"]  # column-parallel, output gathered
    assert mod["tensor_model_parallel"] and mod["partition_dim"] == 0 and mod["partition_stride"] == 1
    assert a["adaLN_modulation.1.bias"]["tensor_model_parallel"]
    assert a["y_embedder"] == dict.fromkeys(a["y_embedder"])  # complete: c's gradient is summed where it leaves Embed


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
    cond = {"count": 1, "bytes": e["B6D"]}  # the sharded adaLN modulation vector (B, 6D)
    assert off["summary"] == {("all_reduce", "fwd", "tp"): two, ("all_reduce", "bwd", "tp"): two,
                              ("all_gather", "fwd", "cond"): cond}
    s = on["summary"]
    for kind, direction in (("all_gather", "fwd"), ("reduce_scatter", "fwd"), ("reduce_scatter", "bwd")):
        assert s.pop((kind, direction, "tp")) == two, (kind, direction)
    # backward: the transposes of the two reduce-scatters, and the column-parallel inputs
    # gathered again instead of saved (Megatron-LM; Korthikanti et al. 2022 §4.2.2)
    assert s.pop(("all_gather", "bwd", "tp")) == {"count": 4, "bytes": 4 * e["BND"]}
    assert s.pop(("all_gather", "fwd", "cond")) == cond
    assert s.pop(("reduce_scatter", "bwd", "cond")) == cond  # each rank's tokens give a partial sum
    assert s.pop(("all_reduce", "bwd", "param_grad")) == {"count": 2, "bytes": 2 * e["D"]}  # proj/fc2 bias
    assert s.pop(("all_gather", "fwd", "sp_boundary")) == {"count": 1, "bytes": e["BND"]}  # exit
    assert s.pop(("all_gather", "bwd", "sp_boundary")) == {"count": 1, "bytes": e["BND"]}  # enter's backward
    assert not s, s
    assert on["wire"] == off["wire"] * 5 // 4  # ring volume of TP, plus the re-gathers (2 of 8 all-gather halves)


def test_factorized_attention_comm_equals_full(tp2):
    full = tp2[0]["comm_video"]["full"]
    for direction in ("fwd", "bwd"):  # attention + MLP (backward: + 2 re-gathers of their inputs)
        assert full[("all_gather", direction, "tp")]["count"] == (2 if direction == "fwd" else 4)
        assert full[("reduce_scatter", direction, "tp")]["count"] == 2
    for kind in ("spatial", "temporal"):
        assert tp2[0]["comm_video"][kind] == full, kind


# ----------------------------------------------------------------------------- single process

BASE = ["experiment=smoke", "model.num_heads=4"]  # the "default" variant of tp_workers.model_cfgs


def test_validate_layout_messages():
    assert validate_layout(compose_cfg([*BASE, "parallel.tp=4"]), 4).tp == 4
    with pytest.raises(ValueError, match=r"model.num_heads=4; valid tp degrees for this model: \[1, 2, 4\]"):
        validate_layout(compose_cfg([*BASE, "parallel.tp=3"]), 3)
    with pytest.raises(ValueError, match=r"MLP hidden units.*=42.*valid tp degrees.*\[1, 2\]"):
        # hidden int(64 * 2/3) = 42
        validate_layout(compose_cfg([*BASE, "model.mlp=swiglu", "model.mlp_ratio=2.0", "parallel.tp=4"]), 4)


def test_validate_tp_module_messages():
    with pytest.raises(ValueError, match=r"num_heads=6.*\[1, 2, 3, 6\]"):
        validate_tp(nn.Sequential(Attention(48, num_heads=6), Mlp(48, 96)), 4)


def test_unsupported_timm_options_raise():
    from vitp.models import Block, parallelize_generator

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
    with pytest.raises(ValueError, match="no generator Block"):
        parallelize_generator(nn.Linear(2, 2), st)
    with pytest.raises(ValueError, match="seq_len"):  # a block-only stage under SP needs N
        parallelize_generator(Block(32, 4, mlp_ratio=2.0, mlp="gelu", qkv_bias=True, qk_norm=False),
                              ParallelState(tp_size=2, sequence_parallel=True))
