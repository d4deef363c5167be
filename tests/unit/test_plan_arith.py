"""The planner's facts of vitp's generator by arithmetic (vitp.plan.arith) equal those read off its
meta-device layers and DeepSpeed's partition: parameter names and counts per layer, every stage
report (roles, partial-gradient elements, collective groups) in every mode and tp / cp degree, and
the stage partition; and a first plan (no facts on disk) imports no torch and prints what the
meta-device facts print."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASE = dict(attention="full", attn_drop=0.0, depth=5, drop_path=0.0, expert=None, family="vit", image_size=[16, 8],
            in_channels=4, layer_scale_init=None, mlp="gelu", mlp_ratio=4.0, num_classes=3, num_frames=4, num_heads=2,
            patch_size=2, preset=None, proj_drop=0.0, qk_norm=False, qkv_bias=True, text_dim=0, text_len=0,
            tubelet_size=2, width=8)
# together they set every option that changes a parameter, a plan row or a group's sizes
CONFIGS = {
    "base": {},
    "swiglu_qknorm_layerscale": dict(mlp="swiglu", qk_norm=True, layer_scale_init=1e-4, mlp_ratio=2.5, width=24,
                                     num_heads=3),
    "factorized_text": dict(attention="factorized", text_dim=12, text_len=7, qk_norm=True, drop_path=0.1),
    "text_no_qkv_bias_layerscale": dict(text_dim=6, text_len=3, qkv_bias=False, layer_scale_init=0.1, mlp="swiglu",
                                        depth=6, num_classes=1),
    "image_square": dict(image_size=32, num_frames=1, tubelet_size=1, in_channels=3, patch_size=4, depth=3, width=16,
                         num_heads=4, num_classes=10, attention="factorized"),
}


def _ranges(depth):
    from vitp.plan.shapes import stage_layer_ranges

    return [(0, None)] + [r for pp in (2, 3) if pp <= depth for r in stage_layer_ranges(depth, pp)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_facts_by_arithmetic_equal_the_meta_layers(name, monkeypatch):
    from vitp.plan import arith
    from vitp.plan.facts import encode_report
    from vitp.plan.shapes import _frozen, _meta_model, _plan_report

    monkeypatch.delenv("VITP_PLAN_FACTS", raising=False)
    model = dict(BASE, **CONFIGS[name])
    frozen = _frozen(model)
    assert arith.covers(dict(frozen))
    want = [[(n, p.numel()) for n, p in layer.named_parameters()] for layer in _meta_model(frozen)[0]]
    assert arith.layer_params(dict(frozen)) == want
    checked = 0
    for mode in ("tp", "sp", "partial"):
        for tp, cp in ((1, 1), (2, 1), (1, 2), (2, 2)):
            for first, end in _ranges(model["depth"]):
                whole = first == 0 and end is None
                meta = json.loads(json.dumps(encode_report(_plan_report(frozen, first, end, mode, tp, cp), whole)))
                got = json.loads(json.dumps(arith.report_record(dict(frozen), first, end, mode, tp, cp, whole)))
                assert got == meta, (mode, tp, cp, first, end)
                checked += bool(meta["groups"])
    assert checked >= 30  # the reports compared hold collectives, not only empty ones


def test_stage_partition_equals_deepspeeds():
    from deepspeed.runtime.utils import partition_balanced

    from vitp.pipeline import stage_blocks
    from vitp.plan import arith

    cases = [(d, pp) for d in range(1, 21) for pp in range(1, d + 1)]  # DeepSpeed's own DP is slow beyond
    cases += [(48, pp) for pp in (2, 3, 5, 7, 8, 16, 24, 47, 48)] + [(64, 6), (61, 9), (33, 32)]
    for depth, pp in cases:
        w = [0] + [1] * depth + [0]
        assert arith.partition_balanced(w, pp) == list(partition_balanced(w, pp)), (depth, pp)
    for depth, pp in ((48, 5), (7, 3), (30, 4), (12, 8)):
        assert arith.stage_blocks(depth, pp) == stage_blocks(depth, pp)
    # uneven weights: the ties break as DeepSpeed breaks them
    for w, parts in (([3, 1, 4, 1, 5, 9, 2, 6], 3), ([1, 1, 2], 5), ([0, 2, 2, 0, 7, 1], 2)):
        assert arith.partition_balanced(w, parts) == list(partition_balanced(w, parts))
    with pytest.raises(ValueError, match="parallel.pp <= 3"):
        arith.stage_blocks(3, 4)


PROBE = """
import contextlib, io, json, sys
from vitp.cli.plan import run
out = io.StringIO()
with contextlib.redirect_stdout(out):
    run(sys.argv[1:])
print(json.dumps({"stdout": out.getvalue(), "imported": [m for m in ("torch", "timm", "deepspeed") if m in sys.modules]}))
"""


def test_a_first_plan_imports_no_torch_and_prints_what_the_meta_layers_print(tmp_path):
    """A text-conditional factorized video model planned on a machine that never planned it."""
    argv = ["--gpus", "8", "--device", "h100", "--micro", "1,4", "experiment=video256", "model.text_dim=64",
            "model.text_len=16", "model.layer_scale_init=0.1", "model.mlp=swiglu"]
    out = {}
    for facts in ("arith", "meta"):
        env = {**os.environ, "VITP_CACHE_DIR": str(tmp_path / facts), "OMP_NUM_THREADS": "1",
               "VITP_PLAN_FACTS": facts, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        p = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=REPO, env=env, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-3000:]
        out[facts] = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["arith"]["imported"] == [] and "torch" in out["meta"]["imported"]
    assert "valid layouts" in out["arith"]["stdout"] and " yes" in out["arith"]["stdout"]
    assert out["arith"]["stdout"] == out["meta"]["stdout"]
