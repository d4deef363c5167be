"""The planner's rows and numbers stay what they were: every predicted number (per-stage memory
terms, communication, step time parts, tokens/s, MFU, fits, the phases) of a few configs and
device counts equals ``tests/fixtures/plan_golden.json`` (recorded by the planner before its
speed-up, issue 54 item 2; exact, or within 1e-12 relative for floats), in the same order.

Regenerate only when a prediction is meant to change:
``PYTHONPATH=. python tests/unit/test_plan_golden.py`` (then review the diff).
"""
from __future__ import annotations

import contextlib
import io
import json
import math
from dataclasses import asdict
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "plan_golden.json"
DIT33B = ["experiment=img256", "model.width=6144", "model.depth=48", "model.num_heads=48"]

# name -> (overrides, world, device, micro options, ac options, adaln sharded, full detail)
CASES = {
    "img256_8_h100": (["experiment=img256"], 8, "h100", [1, 32, 128], [0, 1], True, True),
    "img256_8_h100_all": (["experiment=img256"], 8, "h100", None, [0, 1], True, False),
    "img256_8_adaln_replicated": (["experiment=img256"], 8, "h100", [32], [0, 2], False, True),
    "video512_8_a100": (["experiment=video512"], 8, "a100", [2], [0, 1], True, True),
    "video_long_16_h100": (["experiment=video_long"], 16, "h100", [1], [0, 1], True, True),
    "latent_img1024_8_h200": (["experiment=latent_img1024"], 8, "h200", [8], [1], True, True),
    "wan13_8_h100": (["experiment=wan21_1p3b_480p"], 8, "h100", [1, 2], [0, 1], True, True),
    "wan14_lora_8_h200": (["experiment=wan21_14b_720p_lora"], 8, "h200", [1], [1], True, True),
    "dit33b_64_h100": (DIT33B, 64, "h100", [1], [1], True, True),
}
# CLI text (header, table, phases, parallel plan of a TP row) of these commands
TEXT_CASES = {
    "img256_text": ["--gpus", "8", "--device", "h100", "--micro", "32", "--top", "0", "experiment=img256"],
    "wan_lora_text": ["--gpus", "8", "--device", "h200", "--micro", "1", "--top", "12", "experiment=wan21_14b_720p_lora"],
}


def _prediction(p, cfg, model: dict, prof, full: bool) -> dict:
    """Every number of a :class:`vitp.plan.Prediction` (``full``), or its key and rank numbers."""
    from vitp.plan import phase_costs_of

    row = {"layout": p.layout.as_dict(), "fits": p.fits, "step_s": p.time["step_s"], "peak": p.peak.total}
    if full:
        row.update(memory=[asdict(m) for m in p.memory], comm=[asdict(c) for c in p.comm], time=dict(p.time),
                   tokens_per_s=p.tokens_per_s, mfu=p.mfu, limit_bytes=p.limit_bytes, mem_bw=p.mem_bw,
                   checkpoint=p.checkpoint, phases=[asdict(c) for c in phase_costs_of(cfg, p, model, prof)])
    return row


def record_case(name: str) -> list:
    """The rows of case ``name`` as the planner predicts them now."""
    from vitp.cli.overrides import compose_checked
    from vitp.plan import MemoryOptions, get_profile, plan, with_vae_geometry
    from vitp.plan.lora import lora_plan_of
    from vitp.utils import to_dict

    over, world, device, micro, ac, sharded, full = CASES[name]
    cfg = with_vae_geometry(compose_checked(over))
    prof = get_profile(device, None, procs=world)
    opts = MemoryOptions(adaln_sharded=sharded, lora=lora_plan_of(cfg))
    model = to_dict(cfg.model)
    return [_prediction(p, cfg, model, prof, full) for p in plan(cfg, world, prof, opts, ac, micro)]


def record_text(name: str) -> str:
    """stdout of ``vitp-plan`` for text case ``name`` (with ``--show-plan`` at its first TP row)."""
    from vitp.cli.plan import run

    argv = TEXT_CASES[name]
    with contextlib.redirect_stdout(io.StringIO()):
        rows = run([*argv, "--json"])
    first_tp = next((i for i, r in enumerate(rows, 1) if r["tp"] > 1), 1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        run([*argv, "--show-plan", str(first_tp)])
    return out.getvalue()


def _same(got, want, where: str = "") -> None:
    """``got == want`` (floats within 1e-12 relative), naming the first difference."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), f"{where}: keys {sorted(got)} != {sorted(want)}"
        for k in want:
            _same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: {len(got)} items, want {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert math.isclose(got, want, rel_tol=1e-12, abs_tol=0.0), f"{where}: {got!r} != {want!r}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.fixture(scope="module")
def golden():
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize("name", list(CASES))
def test_rows_and_numbers_equal_the_recorded_planner(golden, name):
    _same(json.loads(json.dumps(record_case(name))), golden["cases"][name], name)


@pytest.mark.parametrize("name", list(TEXT_CASES))
def test_cli_text_equals_the_recorded_planner(golden, name):
    assert record_text(name) == golden["text"][name]


if __name__ == "__main__":
    data = {"cases": {n: record_case(n) for n in CASES}, "text": {n: record_text(n) for n in TEXT_CASES}}
    FIXTURE.write_text(json.dumps(data, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {FIXTURE}: {', '.join(f'{n} {len(r)} rows' for n, r in data['cases'].items())}")
