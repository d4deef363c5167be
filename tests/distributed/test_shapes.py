"""Non-square training and shapes that change between steps, in every layout, against one process
(from the perturbed export: non-zero adaLN gates, so attention and MLP shape the numbers)."""
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import PERTURBED, run_ranks, train_rank

# digits resized to 10x10 and center-cropped to 6x10: a 3x5 grid, N = 15 tokens (SP pads to 16)
NON_SQUARE = ["experiment=smoke", "trainer.max_steps=3", f"trainer.init_from={PERTURBED}", "data.resolution=6x10"]


@pytest.fixture(scope="module")
def non_square_single(tmp_path_factory):
    run = tmp_path_factory.mktemp("ns") / "single"
    return run, run_ranks(1, train_rank, NON_SQUARE, str(run))[0]


def _same_run(ref, res, ref_dir, run_dir):
    assert res["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert res["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    a, b = load_file(ref_dir / "model.safetensors"), load_file(run_dir / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)


def test_non_square_tp2_sp_matches_one_process(non_square_single, tmp_path):
    ref_dir, ref = non_square_single
    res = run_ranks(2, train_rank, [*NON_SQUARE, "parallel.tp=2", "parallel.sequence_parallel=true"],
                    str(tmp_path / "tp2sp"))
    assert max(ref["grad_norms"]) > 1.0  # clipping active
    _same_run(ref, res[0], ref_dir, tmp_path / "tp2sp")


def test_sample_cli_at_another_size(non_square_single, capsys):
    """``vitp-sample --resolution HxW`` samples a 6x10 run at 10x6 (portrait tiles); a size that
    does not tile into patches fails naming the nearest valid sizes."""
    from PIL import Image

    from vitp.cli.sample import main as sample_main

    run, _ = non_square_single
    out = run / "portrait.png"
    sample_main([str(run), "--classes", "3", "--num", "2", "--steps", "2", "--resolution", "10x6", "--out", str(out)])
    assert Image.open(out).size == (2 * 60 + 3 * 2, 100 + 2 * 2)  # 10x6 tiles upscaled x10, 2 px padding
    with pytest.raises(SystemExit) as e:
        sample_main([str(run), "--resolution", "10x7", "--out", str(run / "bad.png")])
    assert e.value.code == 2 and "nearest valid sizes: 10x6, 10x8" in capsys.readouterr().err
