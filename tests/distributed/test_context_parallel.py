"""Context parallelism (``parallel.cp``) in every layout against the single-process run: loss,
grad norm (clipping active) and final weights, from perturbed weights (non-zero adaLN gates), for
an image model and a video model with full and factorized attention, in both cp modes.

One process trains the references; each layout then trains its cases in one process group.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures.record_reference import write_perturbed
from tests.helpers import reference_rank, run_ranks

BASE = ["experiment=smoke", "model.num_heads=4", "optim.grad_clip=0.2", "data.synthetic_size=32"]
# image: 8x8 digits at patch 2 = 16 tokens; video: 8 frames of 4x4 at tubelets (2, 2, 2) = grid (4, 2, 2)
IMAGE = [*BASE]
VIDEO = [*BASE, "data=synthetic", "data.channels=3", "data.num_classes=4", "data.num_frames=8", "data.resolution=4",
         "model.tubelet_size=2"]
MODELS = {"img": IMAGE, "vfull": [*VIDEO, "model.attention=full"],
          "vfact": [*VIDEO, "model.attention=factorized", "model.qk_norm=true"]}
# buckets whose token counts (16, 8, 24) all split over cp=2
BUCKETS = ["trainer.max_steps=6", "data.buckets=[{resolution:8,batch_size:8},{resolution:4x8,batch_size:4,weight:2},"
           "{resolution:[8,12],batch_size:8}]"]

# experiment=video_long (32k tokens at cp 2 x dp 4 on 8 GPUs) at CPU size: grid (2, 4, 4), cp=2 x dp=2
# over 4 ranks, with every phase: a sample grid, the held-out loss and a checkpoint after each step,
# and the final evaluation
VIDEO_LONG_CPU = ["experiment=video_long", "data=synthetic", "data.channels=3", "data.num_classes=4",
                  "data.num_frames=4", "data.resolution=16", "data.synthetic_size=16", "data.num_workers=0",
                  "model.patch_size=4", "model.width=32", "model.depth=2", "model.num_heads=4", "parallel.tp=1",
                  "parallel.sequence_parallel=false", "trainer.max_steps=2", "trainer.global_batch_size=4",
                  "trainer.micro_batch_size=2", "trainer.precision=fp32", "trainer.device=cpu", "trainer.progress=false",
                  "trainer.sample_every=1", "trainer.eval_every=1", "trainer.checkpoint_every=1", "eval.enabled=true",
                  "eval.num_samples=3", "sampler.steps=2", "sampler.grid_classes=2", "sampler.samples_per_class=1",
                  "parallel.cp=2", "eval.t_grid=2"]

# (world, layout overrides, [(model, cp_mode)]): together every model in both modes, and
# tp=2 x cp=2 x pp=2 on 8 ranks
LAYOUTS = {
    "cp2": (2, ["parallel.cp=2"], [("img", "ulysses"), ("vfull", "ulysses"), ("vfact", "ulysses"), ("img", "ring"),
                                   ("vfull", "ring"), ("vfact", "ring"), ("bkt", "ulysses")]),
    "cp4": (4, ["parallel.cp=4"], [("vfull", "ulysses"), ("vfact", "ring"), ("img", "ring")]),
    "tp2cp2": (4, ["parallel.tp=2", "parallel.cp=2"], [("vfull", "ulysses"), ("img", "ring")]),
    "tp2cp2sp": (4, ["parallel.tp=2", "parallel.cp=2", "parallel.sequence_parallel=true"],
                 [("vfact", "ulysses"), ("vfull", "ring"), ("img", "ulysses")]),
    "cp2pp2": (4, ["parallel.cp=2", "parallel.pp=2"], [("img", "ulysses"), ("vfact", "ring")]),
    "cp2dp2": (4, ["parallel.cp=2"], [("img", "ring"), ("vfull", "ulysses")]),
    "tp2cp2pp2": (8, ["parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.sequence_parallel=true"],
                  [("vfact", "ulysses"), ("vfull", "ring")]),
}


def _models(tmp):
    """``{name: overrides}`` with a perturbed init written for each model (and the bucketed image run)."""
    out = {}
    for name, over in MODELS.items():
        write_perturbed(tmp / f"{name}.safetensors", over)
        out[name] = [*over, f"trainer.init_from={tmp / f'{name}.safetensors'}"]
    out["bkt"] = [*out["img"], *BUCKETS]
    return out


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    """``{case: (run_dir, rank-0 result)}`` of the references (``ref/<model>``), a cp=2 run
    stopped at step 2 and resumed, and every layout's cases (``<layout>/<model>-<mode>``)."""
    tmp = tmp_path_factory.mktemp("cp")
    models = _models(tmp)
    refs = {f"ref-{m}": over for m, over in models.items()}
    out = {}
    res = run_ranks(1, reference_rank, refs, str(tmp))[0]
    out.update({k: (tmp / k, v) for k, v in res.items()})
    by_world = {}
    for lname, (world, layout, cases) in LAYOUTS.items():
        for m, mode in cases:
            by_world.setdefault(world, {})[f"{lname}-{m}-{mode}"] = [*models[m], *layout, f"parallel.cp_mode={mode}"]
    by_world[2]["resume-vfact"] = [*models["vfact"], "parallel.cp=2", "trainer.exit_at_step=2"]
    # trainer.compile=blocks: factorized video (spatial and temporal block graphs) at cp=2
    by_world[2]["compiled-vfact-ulysses"] = [*models["vfact"], "parallel.cp=2", "trainer.compile=blocks"]
    by_world[4]["video_long"] = VIDEO_LONG_CPU
    for mode in ("ulysses", "ring"):  # what a GPU runs: bf16 weights, fp32 ring accumulation
        by_world[2][f"bf16-{mode}"] = [*models["vfull"], "parallel.cp=2", f"parallel.cp_mode={mode}",
                                       "trainer.precision=bf16"]
    for world, cases in sorted(by_world.items()):
        res = run_ranks(world, reference_rank, cases, str(tmp), timeout=900)[0]
        out.update({k: (tmp / k, v) for k, v in res.items()})
    # the cp=2 run's exported weights start a cp=1 run and a cp=2 run alike
    export = [*MODELS["vfull"], f"trainer.init_from={tmp / 'cp2-vfull-ulysses' / 'model.safetensors'}"]
    # ... and the cp=2 run's step-2 checkpoint resumes at cp=1 (one process) with its whole state
    resume = {"ckpt_cp2_at_cp1": [*models["vfact"], f"trainer.resume={tmp / 'resume-vfact' / 'checkpoints' / 'step_0000002'}"]}
    for world, case in ((1, "from_cp2_at_cp1"), (2, "from_cp2_at_cp2")):
        over = export + (["parallel.cp=2", "parallel.cp_mode=ring"] if world == 2 else [])
        res = run_ranks(world, reference_rank, {case: over, **(resume if world == 1 else {})}, str(tmp))[0]
        out.update({k: (tmp / k, v) for k, v in res.items()})
    return out


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


CASES = [f"{lname}-{m}-{mode}" for lname, (_, _, cases) in LAYOUTS.items() for m, mode in cases]


@pytest.mark.parametrize("case", CASES)
def test_context_parallel_matches_single_process(cp_runs, case):
    model = case.split("-")[1]
    ref_dir, ref = cp_runs[f"ref-{model}"]
    run_dir, res = cp_runs[case]
    assert max(ref["grad_norms"]) > 0.2  # clipping active
    assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert res["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    a, b = load_file(ref_dir / "model.safetensors"), load_file(run_dir / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)
    assert [x["loss"] for x in _metrics(run_dir)] == pytest.approx(ref["losses"], rel=1e-5)


def test_compiled_blocks_match_eager_with_cp(cp_runs):
    """``trainer.compile=blocks`` at cp=2 (Ulysses all-to-alls between compiled regions) against
    one eager process: per-step loss and grad norm within 1e-5 relative."""
    _, ref = cp_runs["ref-vfact"]
    _, res = cp_runs["compiled-vfact-ulysses"]
    assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert res["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)


def test_bucketed_run_visits_every_bucket_with_cp(cp_runs):
    buckets = {x["bucket"] for x in _metrics(cp_runs["cp2-bkt-ulysses"][0])}
    assert buckets == {0, 1, 2}


def test_context_parallel_resume_is_exact(cp_runs):
    """cp=2: stopped after step 2 (checkpoint), resumed to step 4 == the uninterrupted cp=2 run."""
    full = _metrics(cp_runs["cp2-vfact-ulysses"][0])
    resumed = _metrics(cp_runs["resume-vfact"][0])
    assert [x["step"] for x in resumed] == [1, 2, 3, 4]
    assert [x["loss"] for x in resumed] == [x["loss"] for x in full]
    assert [x["grad_norm"] for x in resumed] == [x["grad_norm"] for x in full]


def test_a_cp2_checkpoint_resumes_at_cp1(cp_runs):
    """The cp=2 run's step-2 checkpoint (weights, EMA, moments split as cp=2 wrote them) resumed by
    one process: steps 3-4 equal the uninterrupted one-process run's."""
    ref = cp_runs["ref-vfact"][1]
    res = cp_runs["ckpt_cp2_at_cp1"][1]
    assert len(res["losses"]) == 2
    assert res["losses"] == pytest.approx(ref["losses"][2:], rel=1e-5)
    assert res["grad_norms"] == pytest.approx(ref["grad_norms"][2:], rel=1e-5)


def test_export_of_a_cp_run_starts_any_layout(cp_runs):
    """The weights a cp=2 run exports start a cp=1 and a cp=2 (ring) run that train alike."""
    a, b = cp_runs["from_cp2_at_cp1"][1], cp_runs["from_cp2_at_cp2"][1]
    assert b["losses"] == pytest.approx(a["losses"], rel=1e-5)
    assert b["grad_norms"] == pytest.approx(a["grad_norms"], rel=1e-5)
    assert a["losses"][0] < cp_runs["ref-vfull"][1]["losses"][0]  # trained weights, not the initial ones


def test_video_long_recipe_runs_at_cpu_size(cp_runs):
    run_dir, res = cp_runs["video_long"]
    assert len(res["losses"]) == 2 and all(math.isfinite(x) for x in res["losses"])
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert (cfg.parallel.cp, cfg.parallel.tp, cfg.model.attention) == (2, 1, "full")
    assert [x["step"] for x in _metrics(run_dir)] == [1, 2]
    # every phase ran in the training layout: grids, held-out loss, checkpoints, the final evaluation
    assert sorted(p.name for p in (run_dir / "samples").glob("step_*.png")) == ["step_0000001.png", "step_0000002.png"]
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 1, 2] and all(math.isfinite(e["heldout_loss"]) for e in evals)
    final = json.loads((run_dir / "eval.json").read_text())
    assert final["num_samples"] == 3 and math.isfinite(final["temporal_diff"]) and final["temporal_diff_real"] > 0
    assert (run_dir / "checkpoints" / "step_0000002").is_dir()


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_bf16_context_parallel_tracks_fp32(cp_runs, mode):
    ref = cp_runs["ref-vfull"][1]
    res = cp_runs[f"bf16-{mode}"][1]
    assert res["losses"] == pytest.approx(ref["losses"], rel=0.05)
    assert res["losses"] != ref["losses"]  # really ran in bf16
