"""Pipeline stages and hybrid tp x pp x dp layouts against the single-process run."""
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures.record_reference import write_perturbed
from tests.helpers import PERTURBED, TP2PP2, run_ranks, train_rank
from vitp.pipeline import stage_blocks

# from the perturbed export (non-zero adaLN gates): attention and MLP shape every loss
SMOKE = ["experiment=smoke", "trainer.max_steps=4", f"trainer.init_from={PERTURBED}"]


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
def reference(reference_runs):
    """The 1-process run from the perturbed export (pinned to its recording in test_reference.py)."""
    return reference_runs["perturbed_tp1pp1"]


def _check(reference, run_dir, results):
    ref_dir, ref = reference
    for r in results:
        assert r["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert r["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    assert max(ref["grad_norms"]) > 1.0  # clipping active
    a, b = load_file(ref_dir / "model.safetensors"), load_file(run_dir / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:  # Adam turns 1e-7 sum-order noise of near-zero gradients into ~1e-6 updates
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["loss"] for x in lines] == pytest.approx(ref["losses"], rel=1e-5)


# (2, 1, 1) + SP and (2, 2, 1) are in test_reference.py, (2, 1, 2) and (1, 1, 2) in test_train.py,
# tp=2 x pp=2 with dropout in test_checkpoint.py.
@pytest.mark.parametrize("tp,pp,dp,extra", [
    (1, 2, 1, []),
    (1, 2, 2, ["parallel.activation_checkpoint_interval=1"]),
    (2, 2, 2, ["parallel.sequence_parallel=true", "parallel.activation_checkpoint_interval=1"]),
])
def test_layout_matches_single_process(reference, tmp_path, tp, pp, dp, extra):
    run = tmp_path / "run"
    over = [*SMOKE, f"parallel.tp={tp}", f"parallel.pp={pp}", *extra]
    _check(reference, run, run_ranks(tp * pp * dp, _train_rank, over, str(run)))
    stages = json.loads((run / "stages.json").read_text())
    assert sorted({s["stage"] for s in stages}) == list(range(pp))


def _train_two(rank, over_a, over_b, run_dir):
    return _train_rank(rank, over_a, run_dir + "/a"), _train_rank(rank, over_b, run_dir + "/b")


def test_grad_norm_independent_of_micro_batch_split(tmp_path):
    """The same global batch of 8 as 2 micro-batches of 4 or 4 micro-batches of 2 (pp=2 x dp=1)."""
    base = [*SMOKE, "parallel.pp=2", "trainer.global_batch_size=8"]
    (a, b), _ = run_ranks(2, _train_two, [*base, "trainer.micro_batch_size=4"],
                          [*base, "trainer.micro_batch_size=2"], str(tmp_path))
    assert a["grad_norms"] == pytest.approx(b["grad_norms"], rel=1e-5)
    assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)


def test_activation_checkpointing_with_dropout_is_exact(tp2pp2_run, tmp_path):
    """tp=2 x pp=2 with attention/projection dropout and drop-path: recomputation replays the
    default and the TP RNG streams, so every step equals the run without checkpointing."""
    _, plain = tp2pp2_run
    ckpt = run_ranks(4, train_rank, [*TP2PP2, "parallel.activation_checkpoint_interval=1", "eval.enabled=false"],
                     str(tmp_path / "run"))
    for a, b in zip(ckpt, plain):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
        assert a["grad_norms"] == pytest.approx(b["grad_norms"], rel=1e-6)


def test_zero0_fp32_is_rejected_with_the_fix():
    from vitp.config import compose, validate_layout

    cfg = compose(["parallel.pp=2", "parallel.zero_stage=0", "trainer.precision=fp32"])
    with pytest.raises(ValueError, match="parallel.zero_stage=1"):
        validate_layout(cfg, world_size=2)
    cfg.trainer.precision = "bf16"
    assert validate_layout(cfg, world_size=2).pp == 2


VIDEO = ["experiment=smoke", "trainer.max_steps=4", "model.depth=4", "data=synthetic", "data.channels=3",
         "data.num_classes=4", "data.num_frames=6", "data.resolution=6", "data.synthetic_size=32",
         "model.tubelet_size=2", "optim.grad_clip=0.2"]  # grid (3, 3, 3), N = 27


def test_video_tp2_pp2_sp_matches_single_process(tmp_path):
    """Video model, factorized (spatial, temporal | spatial, temporal blocks over two stages) and
    full attention, N = 27 tokens padded to 28 under SP, at tp=2 x pp=2 + SP against 1 process,
    from perturbed weights (non-zero adaLN gates)."""
    write_perturbed(tmp_path / "init.safetensors", VIDEO)
    init = f"trainer.init_from={tmp_path / 'init.safetensors'}"
    modes = ([*VIDEO, init, "model.attention=factorized"], [*VIDEO, init, "model.attention=full"])
    refs = run_ranks(1, _train_two, *modes, str(tmp_path / "ref"))[0]
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"]
    runs = run_ranks(4, _train_two, *[[*m, *layout] for m in modes], str(tmp_path / "run"))
    for i, sub in enumerate("ab"):
        ref = refs[i]
        assert max(ref["grad_norms"]) > 0.2  # clipping active
        for r in runs:
            assert r[i]["losses"] == pytest.approx(ref["losses"], rel=1e-5)
            assert r[i]["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
        a = load_file(tmp_path / "ref" / sub / "model.safetensors")
        b = load_file(tmp_path / "run" / sub / "model.safetensors")
        assert a.keys() == b.keys() and "blocks.1.attn.qkv.weight" in a  # timm key names
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)
    stages = json.loads((tmp_path / "run" / "a" / "stages.json").read_text())
    assert sorted({s["stage"] for s in stages}) == [0, 1]
