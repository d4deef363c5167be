"""Sharded modules equal their unsharded references (CPU gloo): the generator in every config,
timm ViTs, pipeline layers, the full state dict, SGD steps, and the head-wise qkv layout.

Multi-process results come from the session's 2-rank and 4-rank groups (``conftest.py``,
checks in ``tp_workers.py``).
"""
from __future__ import annotations

import pytest
import torch

from vitp.parallel import ParallelState, StepShape, shard_tensor, tensor_parallelize
from vitp.parallel.layers import unshard_parts

from .tp_workers import SHAPES, TP4_PARITY


def _check(r, key):
    tol = 1e-10 if r["dtype"] == "torch.float64" else 2e-5
    msg = f"{key}: {r}"
    assert r["same_names"] and not r["missing"], msg
    assert all(n.endswith("k_norm.bias") for n in r["zero_grads"]), msg  # every other gradient is non-trivial
    assert r["weights"] == 0.0, msg
    assert r["out"] < tol and r["loss"] < tol and r["grad"] < tol, msg


PARITY_KEYS = [f"{m}/sp={sp}" for sp in (False, True) for m in
               ["gen/default", "gen/no_qkv_bias", "gen/qk_norm", "gen/swiglu", "gen/layer_scale", "gen/odd_tokens",
                "gen/video_full", "gen/video_factorized", "gen/text", "gen/text_qk_norm_odd", "vit/plain",
                "vit/packed"]]


@pytest.mark.parametrize("key", PARITY_KEYS)
def test_tp2_matches_reference(tp2, key):
    for rank_res in tp2:
        _check(rank_res[key], key)


@pytest.mark.parametrize("key", [f"{m}/sp={sp}" for sp in (False, True)
                                 for m in [*(f"gen/{n}" for n in TP4_PARITY), "vit/plain"]])
def test_tp4_matches_reference(tp4, key):
    for rank_res in tp4:
        _check(rank_res[key], key)


@pytest.mark.parametrize("key", [f"shapes/{t}x{h}x{w}/sp={sp}" for sp in (False, True) for t, h, w in SHAPES])
def test_tp2_follows_non_square_shapes_that_change_between_calls(tp2, key):
    """Factorized video at 6x10 (N = 45: SP pads), then 10x6, then 4x4, through one sharded model."""
    for rank_res in tp2:
        _check(rank_res[key], key)


def test_pipeline_layers_with_sequence_parallel(tp2):
    for r in tp2:
        _check(r["pipe/sp=True"], "pipe")
        assert r["pipe_state"]["tp_size"] == 2 and r["pipe_state"]["sequence_parallel"]
    assert [r["pipe_state"]["tp_rank"] for r in tp2] == [0, 1]


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


# ----------------------------------------------------------------------------- single process

def test_headwise_shard_layout():
    H, hd, D, tp = 4, 8, 32, 2
    w = torch.randn(3 * H * hd, D)
    parts = [shard_tensor(w, 0, 3, tp, r) for r in range(tp)]
    for r in range(tp):
        heads = slice(r * H // tp, (r + 1) * H // tp)
        assert torch.equal(parts[r], w.view(3, H, hd, D)[:, heads].reshape(-1, D))
    assert torch.equal(unshard_parts(parts, 0, 3), w)


def test_tp1_is_a_no_op(cfgs):
    from vitp.models import Generator, parallelize_generator

    model = Generator(seed=0, **cfgs["default"])
    attn = model.blocks[0].attn
    report = parallelize_generator(model, ParallelState(sequence_parallel=True))
    assert report.params == {} and report.collectives(StepShape(2, 16, 32, 4, tp=1)) == []
    assert tensor_parallelize(model, ParallelState(sequence_parallel=True)) is model
    assert model.blocks[0].attn is attn and not ParallelState(sequence_parallel=True).sequence_parallel


# --- context parallelism (cp_workers.py): fp64 parity of the generator at tp x cp --------------

from .cp_workers import CP2_LAYOUTS, CP4_LAYOUTS, MODELS, cp_key  # noqa: E402


@pytest.mark.parametrize("key", [cp_key(m, *lay) for lay in CP2_LAYOUTS for m in MODELS])
def test_cp2_matches_reference(tp2, key):
    for rank_res in tp2:
        _check(rank_res[key], key)


@pytest.mark.parametrize("key", [cp_key(m, *lay) for lay in CP4_LAYOUTS for m in MODELS])
def test_cp4_and_tp2_cp2_match_reference(tp4, key):
    for rank_res in tp4:
        _check(rank_res[key], key)
