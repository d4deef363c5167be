"""The planner's facts kept on disk (vitp.plan.facts): a model planned before is planned again
without importing torch, timm or DeepSpeed, and the output is the same, byte for byte; stale,
corrupt or unwritable files only cost the speed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMG256 = ["--gpus", "8", "--device", "h100", "--micro", "1,32", "experiment=img256"]
WAN = ["--gpus", "8", "--device", "h100", "--micro", "1", "--ac", "1", "experiment=wan21_1p3b_480p"]

# runs vitp-plan in this process and reports which heavy packages it imported
PROBE = """
import contextlib, io, json, sys
from vitp.cli.plan import run
out = io.StringIO()
with contextlib.redirect_stdout(out):
    run(sys.argv[1:])
print(json.dumps({"stdout": out.getvalue(), "imported": [m for m in ("torch", "timm", "deepspeed") if m in sys.modules]}))
"""


def _plan(argv, cache: Path) -> dict:
    env = {**os.environ, "VITP_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    p = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=REPO, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("argv, first, imports", [(IMG256, [], []), (WAN, ["torch", "timm"], ["torch", "timm"])],
                         ids=["img256", "wan"])
def test_a_planned_model_is_planned_again_without_deepspeed_and_prints_the_same(tmp_path, argv, first, imports):
    """A vitp generator is planned without torch, the first time (its facts by arithmetic,
    vitp.plan.arith) and again; a Wan model's first plan builds its meta layers (torch, timm),
    and planned again it imports torch and timm (its styles live beside its torch layers,
    vitp.models.parallelize_wan) but not DeepSpeed."""
    cold = _plan(argv, tmp_path)
    assert cold["imported"] == first, f"a first plan imported {cold['imported']}"
    assert list((tmp_path / "plan").glob("*/*.json")), "no facts file written"
    warm = _plan(argv, tmp_path)
    assert warm["imported"] == imports, f"a planned model imported {warm['imported']}"
    assert warm["stdout"] == cold["stdout"]
    assert "valid layouts" in warm["stdout"] and " yes" in warm["stdout"]


@pytest.mark.parametrize("experiment", ["img256", "video512", "wan21_1p3b_480p"])
def test_stage_reports_read_back_equal_the_described_plan(experiment, facts):
    """Every stage report the planner reads (modes tp / sp / partial, with and without cp) and the
    whole model's parameter roles, written to disk and read back, give the plan's own collectives."""
    from vitp.cli.overrides import compose_checked
    from vitp.parallel import StepShape
    from vitp.plan.shapes import ModelShape, _frozen, _plan_report, stage_layer_ranges

    F = facts
    model = compose_checked([f"experiment={experiment}"]).model
    frozen, shape = _frozen(model), ModelShape.from_config(model)
    keys = [(mode, first, end, tp, cp) for mode in ("tp", "sp", "partial") for tp, cp in ((2, 1), (2, 2), (1, 2))
            for first, end in [(0, None), *stage_layer_ranges(shape.depth, 2)] if tp > 1 or mode == "tp"]
    for mode, first, end, tp, cp in keys:
        F.facts_of(frozen).get(f"k/{mode}/{first}/{end}/{tp}/{cp}",
                               lambda: F.encode_report(_plan_report(frozen, first, end, mode, tp, cp), True))
    F.reset()
    back = F.facts_of(frozen)
    for mode, first, end, tp, cp in keys:
        want = _plan_report(frozen, first, end, mode, tp, cp)
        got = F.decode_report(back, back.entries[f"k/{mode}/{first}/{end}/{tp}/{cp}"])
        assert (got.params, got.partial_grad_elements, got.axes) == (want.params, want.partial_grad_elements, want.axes)
        for micro, sp, ac, cp_mode in ((1, False, 0, "ulysses"), (3, True, 1, "ring")):
            step = StepShape(micro=micro, tokens=shape.tokens, width=shape.width, act_bytes=2, tp=4 if tp > 1 else 1,
                             sequence_parallel=sp and tp > 1, partial_sync=0.5 if mode == "partial" else 1.0,
                             pixels=shape.pixels, redo=1 + ac, pp=2, cp=4 if cp > 1 else 1, cp_mode=cp_mode,
                             text_tokens=shape.text_tokens)
            assert got.collectives(step) == want.collectives(step), (mode, first, end, tp, cp, step)


@pytest.fixture
def facts(tmp_path, monkeypatch):
    from vitp.plan import facts as F

    monkeypatch.setenv("VITP_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("VITP_PLAN_CACHE", raising=False)
    F.reset()
    yield F
    F.reset()


def _computed(F, frozen, value):
    calls = []

    def compute():
        calls.append(1)
        return value

    got = F.facts_of(frozen).get("entry", compute)
    F.flush()
    return got, len(calls)


def test_facts_are_read_back_and_stale_or_corrupt_files_are_computed_again(facts, tmp_path, monkeypatch):
    F, frozen = facts, (("width", 8),)
    assert _computed(F, frozen, [1, 2]) == ([1, 2], 1)
    path = F.facts_of(frozen).path
    assert json.loads(path.read_text())["digest"] == F.code_digest()
    F.reset()
    assert _computed(F, frozen, [9]) == ([1, 2], 0)  # read back, not computed

    data = json.loads(path.read_text())
    data["digest"] = "another vitp"
    path.write_text(json.dumps(data))
    F.reset()
    assert _computed(F, frozen, [3]) == ([3], 1)  # another version's facts are not used

    data = json.loads(path.read_text())
    data["entries"]["entry"] = [33]  # edited by hand: the checksum no longer matches
    path.write_text(json.dumps(data))
    F.reset()
    assert _computed(F, frozen, [3]) == ([3], 1)

    path.write_text('{"digest": ')  # cut short
    F.reset()
    assert _computed(F, frozen, [4]) == ([4], 1)
    F.reset()
    assert _computed(F, frozen, [5]) == ([4], 0)  # and the file is whole again

    # an entry that does not decode (a hand-edited file) is computed again
    F.reset()
    assert F.facts_of(frozen).get("entry", lambda: [6], lambda v: {6: "six"}[v[0]]) == "six"  # [4] does not decode

    # facts computed while vitp's source changed are not written under either digest
    F.reset()
    fresh = F.code_digest
    monkeypatch.setattr(F, "code_digest", lambda fresh_=False, **kw: "edited" if kw.get("fresh") else fresh())
    F.facts_of(frozen).get("late", lambda: [7])
    F.flush()
    assert "late" not in json.loads(path.read_text())["entries"]


def test_processes_sharing_a_file_merge_their_entries(facts):
    F, frozen = facts, (("width", 9),)
    first, second = F.ModelFacts(frozen), F.ModelFacts(frozen)  # two processes, both started before either wrote
    first.get("a", lambda: "from first")
    second.get("b", lambda: "from second")
    first.flush()
    second.flush()
    F.reset()
    back = F.facts_of(frozen)
    assert back.entries == {"a": "from first", "b": "from second"}


def test_unwritable_or_disabled_cache_still_plans(facts, tmp_path, monkeypatch):
    F = facts
    (tmp_path / "plan").write_text("a file where the folder should be")
    assert _computed(F, (("w", 1),), [7]) == ([7], 1)  # flush fails quietly
    monkeypatch.setenv("VITP_CACHE_DIR", str(tmp_path / "off"))
    monkeypatch.setenv("VITP_PLAN_CACHE", "0")
    F.reset()
    assert _computed(F, (("w", 2),), [8]) == ([8], 1)
    assert not (tmp_path / "off").exists()


@pytest.mark.parametrize("plan", ["GENERATOR_PLAN", "WAN_PLAN", "TIMM_PLAN"])
def test_styles_round_trip_as_data(plan):
    """Every style of vitp's plans rebuilds from its record with every field equal (but those only
    apply() reads); a field the planner could not rebuild is refused, not silently reset."""
    from dataclasses import dataclass, field, fields

    import vitp.models
    import vitp.parallel.plan
    from vitp.parallel.styles import ParallelStyle
    from vitp.plan.facts import style_of, style_record

    rows = getattr(vitp.parallel.plan if plan == "TIMM_PLAN" else vitp.models, plan).rows
    for row in rows:
        rebuilt = style_of(style_record(row.style))
        assert type(rebuilt) is type(row.style)
        for f in fields(row.style):
            if not f.metadata.get("apply_only"):
                assert getattr(rebuilt, f.name) == getattr(row.style, f.name), (row.pattern, f.name)

    @dataclass(frozen=True)
    class Odd(ParallelStyle):
        fn: object = field(default=print)

    with pytest.raises(TypeError, match=r"Odd.fn=.*apply_only"):
        style_record(Odd())
