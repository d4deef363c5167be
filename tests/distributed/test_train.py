"""End-to-end training: single process, 2-process data parallel parity, launchers, CLIs."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import PERTURBED, run_ranks
from vitp.parallel.distributed import strip_launcher_args


def _train_rank(rank, overrides, run_dir):
    from tests.helpers import compose_cfg
    from vitp.train import train

    res = train(compose_cfg(overrides), run_dir)
    return {k: res[k] for k in ("losses", "grad_norms")}


def test_strip_local_rank_forms():
    os.environ.pop("LOCAL_RANK", None)
    argv = ["vitp-train", "--local_rank=3", "trainer.max_steps=2", "--local-rank", "3", "seed=1"]
    assert strip_launcher_args(argv) == ["vitp-train", "trainer.max_steps=2", "seed=1"]
    assert os.environ.pop("LOCAL_RANK") == "3"


# from the perturbed export (non-zero adaLN gates), so attention and MLP shape the parity checks
OVER = ["experiment=smoke", "trainer.max_steps=5", f"trainer.init_from={PERTURBED}"]


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    """The smoke run (global batch 8) as 1 process x 2 micro-batches and as 2 dp ranks x 1."""
    base = tmp_path_factory.mktemp("dp")
    single = run_ranks(1, _train_rank, OVER, str(base / "single"))[0]
    dp2 = run_ranks(2, _train_rank, OVER, str(base / "dp2"))
    return base, single, dp2


def test_data_parallel_matches_single_process(dp_runs):
    base, single, dp2 = dp_runs
    assert len(single["losses"]) == 5
    for r in dp2:
        assert r["losses"] == pytest.approx(single["losses"], rel=1e-5)
        assert r["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5)
    # clipping was active (grad_clip = 1.0), so the parity covers the clipped update
    assert max(single["grad_norms"]) > 1.0
    a, b = load_file(base / "single" / "model.safetensors"), load_file(base / "dp2" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)  # Adam: near-zero grads amplify 1e-7 noise


# tp=2 + SP (dp=1) and tp=2 x pp=2 are in test_reference.py, tp=2 + SP also through torchrun below
@pytest.mark.parametrize("world,over", [
    (4, ["parallel.tp=2", "parallel.sequence_parallel=true"]),  # tp=2 x dp=2
])
def test_tensor_parallel_training_matches_single_process(dp_runs, tmp_path, world, over):
    """Per-step loss, DeepSpeed's clipped-update grad norm and final weights equal the 1-process run."""
    base, single, _ = dp_runs
    res = run_ranks(world, _train_rank, [*OVER, *over], str(tmp_path / "tp"))
    for r in res:
        assert r["losses"] == pytest.approx(single["losses"], rel=1e-5)
        assert r["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-5)
    a, b = load_file(base / "single" / "model.safetensors"), load_file(tmp_path / "tp" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-5)  # Adam: near-zero grads amplify 1e-7 noise


def test_bf16_training_tracks_fp32(dp_runs, tmp_path):
    """precision=bf16 (what ``auto`` picks on CUDA) runs the same path with bf16 weights."""
    _, single, _ = dp_runs
    res = run_ranks(1, _train_rank, [*OVER, "trainer.precision=bf16"],
                    str(tmp_path / "bf16"))[0]
    assert res["losses"] == pytest.approx(single["losses"], rel=0.05)
    assert res["losses"] != single["losses"]  # really ran in bf16
    assert (tmp_path / "bf16" / "model_ema.safetensors").is_file()


def _never_then_auto(rank, over, run_dir):
    with pytest.raises(ValueError, match="already holds a run.*trainer.resume=auto"):
        _train_rank(rank, [*over, "trainer.resume=never"], run_dir)
    return _train_rank(rank, over, run_dir)["losses"]


def test_rerun_into_a_finished_run_directory(dp_runs):
    """resume=never refuses a used run dir; resume=auto (default) finds it finished: no new step."""
    base, _, _ = dp_runs
    assert run_ranks(1, _never_then_auto, OVER, str(base / "single"))[0] == []
    assert [json.loads(x)["step"] for x in (base / "single" / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4, 5]


def test_run_directory_contents(dp_runs):
    base, single, _ = dp_runs
    run = base / "dp2"  # written by rank 0 only, one folder for both ranks
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5]
    for key in ("loss", "grad_norm", "lr", "samples_per_s"):
        assert all(isinstance(r[key], float) for r in lines)
    assert [r["loss"] for r in lines] == pytest.approx(single["losses"], rel=1e-5)
    assert any(k.startswith("loss_t/") for k in lines[0])
    lrs = [r["lr"] for r in lines]  # linear warmup from lr / 2 (no step at lr = 0), then cosine decay
    assert lrs[0] == pytest.approx(0.5e-3) and lrs[1] > lrs[0] and max(lrs) <= 1e-3 and lrs[4] < max(lrs)
    assert list((run / "tb").glob("events.out.tfevents.*"))
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000005"
    assert (run / "model_ema.safetensors").is_file()


def test_nan_loss_stops_with_a_clear_error(tmp_path):
    with pytest.raises(AssertionError, match="FloatingPointError: loss is (nan|inf) at step .*lower optim.lr"):
        run_ranks(1, _train_rank, ["experiment=smoke", "optim.lr=1e30", "optim.grad_clip=0.0",
                                   "trainer.max_steps=8"], str(tmp_path / "nan"))


def _cli(args, cwd, env_extra=None, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", NO_ALBUMENTATIONS_UPDATE="1")
    env.update(env_extra or {})
    bindir = Path(sys.executable).parent
    return subprocess.run([str(bindir / args[0]), *args[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_torchrun_with_tensor_and_sequence_parallelism(tmp_path, dp_runs):
    """``torchrun --nproc_per_node 2 -m vitp.train parallel.tp=2 parallel.sequence_parallel=true``, into
    ``hydra.run.dir=runs/${now:%H-%M-%S-%f}``: both ranks use the folder rank 0 resolved."""
    from vitp import checkpoint as ckpt

    _, single, _ = dp_runs
    p = _cli(["torchrun", "--nproc_per_node", "2", "--master_port", str(30500 + os.getpid() % 1000), "-m",
              "vitp.train", *OVER, "parallel.tp=2", "trainer.checkpoint_every=2",
              "parallel.sequence_parallel=true", "hydra.run.dir=${paths.output_root}/${now:%H-%M-%S-%f}",
              f"paths.output_root={tmp_path / 'runs'}"], tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()  # one folder, though each rank's clock gave another name
    tags = ckpt.published_tags(run / "checkpoints")
    assert tags[-2:] == ["step_0000004", "step_0000005"]
    for tag in tags:
        ckpt.verify_checkpoint(run / "checkpoints" / tag)  # both ranks' files are there
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in lines] == pytest.approx(single["losses"], rel=1e-5)
    assert [r["grad_norm"] for r in lines] == pytest.approx(single["grad_norms"], rel=1e-5)


def test_sample_and_eval_clis(tmp_path, capsys):
    run = tmp_path / "run"
    p = _cli(["vitp-train", "experiment=smoke", "eval.enabled=true", "eval.classifier_epochs=2",
              "trainer.checkpoint_every=2", f"hydra.run.dir={run}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    ev = json.loads((run / "eval.json").read_text())
    for key in ("heldout_loss", "sample_accuracy", "fd_digits", "fd_digits_real", "judge_accuracy_real_heldout"):
        assert isinstance(ev[key], float)
    assert len(ev["heldout_loss_per_t"]) == 10
    p = _cli(["vitp-sample", str(run), "--classes", "3", "7", "--num", "4", "sampler.steps=3", "sampler.cfg_scale=2.0"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    from PIL import Image

    img = Image.open(run / "samples" / "sample_step0000004_c3+7_n4_heun3_cfg2_seed0.png")  # named by its settings
    assert img.size == (4 * 64 + 5 * 2, 2 * 64 + 3 * 2)  # 2 rows x 4 columns of 64 px tiles
    from vitp.cli.eval import main as eval_main
    from vitp.cli.sample import main as sample_main

    eval_main([str(run), "sampler.steps=2"])  # its own file: the training's eval.json is kept
    assert json.loads((run / "eval_sampler.steps=2.json").read_text())["sampler"]["steps"] == 2
    assert json.loads((run / "eval.json").read_text()) == ev
    with pytest.raises(SystemExit) as e:
        sample_main([str(tmp_path / "missing")])
    assert e.value.code == 2 and "does not exist" in capsys.readouterr().err
    # a checkpoint given as the run: refused naming the command that evaluates it, which records its step
    tag = run / "checkpoints" / "step_0000002"
    with pytest.raises(SystemExit) as e:
        eval_main([str(tag)])
    assert e.value.code == 2 and (f"{tag} is a checkpoint of the run {run}: vitp-eval takes the run directory; "
                                  f"evaluate this checkpoint with vitp-eval {run} --weights checkpoints/step_0000002"
                                  ) in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # never read: it was evaluated the run's own weights, silently
        eval_main([str(run), f"trainer.init_from={tag}/model_ema"])
    assert e.value.code == 2 and f"to score other weights give vitp-eval {run} --weights PATH" in capsys.readouterr().err
    from vitp.cli.eval import run as vitp_eval

    at2, last, final = (vitp_eval([str(run), *w, "sampler.steps=2", "eval.t_grid=1"]) for w in (
        ["--weights", "checkpoints/step_0000002"], ["--weights", "checkpoints"], []))  # checkpoints: the latest
    assert (at2["step"], last["step"], final["step"]) == (2, 4, 4)
    # named by the checkpoint's tag (it was eval_model_ema_<digest>.json, read as the final EMA), the file recorded
    assert at2["weights"] == str(run / "checkpoints" / "step_0000002" / "model_ema.safetensors")
    assert [json.loads(p.read_text())["weights"] for p in run.glob("eval_*_step_0000002_*.json")] == [at2["weights"]]
    assert final["weights"] == str(run / "model_ema.safetensors") and not list(run.glob("eval_model_ema*"))
    assert last["heldout_loss"] == pytest.approx(final["heldout_loss"], rel=1e-6)
    assert abs(at2["heldout_loss"] / final["heldout_loss"] - 1) > 1e-4  # other weights


def test_image_folder_training_on_real_photos(tmp_path):
    """Two classes of scikit-image photos, 16 px crops: trains and writes the usual files."""
    from PIL import Image
    from skimage import data as skd

    for cls, names in {"animals": ["chelsea", "cat"], "objects": ["coffee", "rocket", "astronaut"]}.items():
        (tmp_path / "photos" / cls).mkdir(parents=True)
        for n in names:
            Image.fromarray(getattr(skd, n)()).save(tmp_path / "photos" / cls / f"{n}.png")
    run = tmp_path / "run"
    over = ["experiment=smoke", "data=image_folder", f"data.root={tmp_path / 'photos'}", "data.resolution=16",
            "data.num_classes=2", "data.holdout_fraction=0.3", "data.num_workers=0", "model.patch_size=4",
            "trainer.max_steps=3"]
    res = run_ranks(1, _train_rank, over, str(run))[0]
    assert len(res["losses"]) == 3 and all(v == v for v in res["losses"])
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
