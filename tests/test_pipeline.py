"""Pipeline stages and hybrid tp x pp x dp layouts against the single-process run."""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_ranks
from vitp.pipeline import stage_blocks

SMOKE = ["experiment=smoke", "trainer.max_steps=4", "model.depth=3"]


def _train_rank(rank, overrides, run_dir):
    from vitp.config import compose
    from vitp.train import train

    res = train(compose(overrides), run_dir)
    return {k: res[k] for k in ("losses", "grad_norms")}


@pytest.mark.parametrize("depth,pp", [(d, p) for d in range(1, 13) for p in range(1, 9) if d >= p])
def test_partition_every_stage_has_a_block_and_is_balanced(depth, pp):
    counts = stage_blocks(depth, pp)
    assert sum(counts) == depth and min(counts) >= 1 and max(counts) - min(counts) <= 1


def test_depth_below_pp_is_rejected():
    with pytest.raises(ValueError, match=r"model.depth=2 < parallel.pp=3.*parallel.pp <= 2"):
        stage_blocks(2, 3)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("ref") / "run"
    return run, run_ranks(1, _train_rank, SMOKE, str(run))[0]


def _check(reference, run_dir, results):
    ref_dir, ref = reference
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    assert max(ref["grad_norms"]) > 1.0  # clipping active
    a, b = load_file(ref_dir / "model.safetensors"), load_file(run_dir / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["loss"] for x in lines] == pytest.approx(ref["losses"], rel=1e-5)


@pytest.mark.parametrize("tp,pp,dp,extra", [
    (1, 2, 1, []),
    (2, 2, 1, []),
    (2, 2, 1, ["parallel.sequence_parallel=true", "parallel.activation_checkpoint_interval=1"]),
    (1, 2, 2, ["parallel.activation_checkpoint_interval=1"]),
    (2, 2, 2, ["parallel.sequence_parallel=true"]),
])
def test_layout_matches_single_process(reference, tmp_path, tp, pp, dp, extra):
    run = tmp_path / "run"
    over = [*SMOKE, f"parallel.tp={tp}", f"parallel.pp={pp}", *extra]
    _check(reference, run, run_ranks(tp * pp * dp, _train_rank, over, str(run)))
    stages = json.loads((run / "stages.json").read_text())
    assert sorted({s["stage"] for s in stages}) == list(range(pp))
