"""Checkpoints: exact resume, faults during a save, SIGTERM, export/import across layouts, timm."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import TP2PP2, run_ranks, run_ranks_until_killed, train_rank, train_rank_killed
from vitp import checkpoint as ckpt
from vitp.config import Layout

SINGLE = ["experiment=smoke", "trainer.max_steps=8", "trainer.checkpoint_every=3", "trainer.keep_checkpoints=2",
          "model.proj_drop=0.1", "model.drop_path=0.1", "trainer.log_every=3"]  # the stop at 4 cuts the window 4-6


def _metrics(run: Path):
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _same_steps(a, b, norm_rel=0.0):
    """Per-step loss, grad norm and lr bit-identical (the grad norm within ``norm_rel`` relative)."""
    assert [x["step"] for x in a] == [x["step"] for x in b]
    for x, y in zip(a, b):
        assert (x["loss"], x["lr"]) == (y["loss"], y["lr"]), (x, y)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=norm_rel, abs=0), (x, y)


def _runs(rank, tmp):
    full = train_rank(rank, SINGLE, f"{tmp}/full")
    first = train_rank(rank, [*SINGLE, "trainer.exit_at_step=4"], f"{tmp}/resumed")
    second = train_rank(rank, SINGLE, f"{tmp}/resumed")
    fork = train_rank(rank, [*SINGLE, f"trainer.resume={tmp}/full/checkpoints/step_0000006"], f"{tmp}/fork")
    before = _files(Path(tmp) / "full")
    with pytest.raises(ValueError, match=r"step_0000008 is at step 8, past trainer.max_steps=4: set "
                                         r"trainer.max_steps=8 or more to continue it, or .*\(vitp-export"):
        train_rank(rank, [*SINGLE, "trainer.max_steps=4"], f"{tmp}/full")  # would label step-8 weights step 4
    assert _files(Path(tmp) / "full") == before
    return full, first, second, fork, _resume_older_tag(rank, tmp), _resume_legacy(rank, tmp)


LEGACY = Path(__file__).parents[1] / "fixtures" / "legacy_run"  # written by vitp before sharded checkpoints


def _resume_legacy(rank, tmp):
    """The step-2 checkpoint of the earlier format (DeepSpeed's files, full tensors written by rank 0;
    a 4-step run of experiment=smoke with a checkpoint every 2 steps) resumed to step 4: its
    metrics rows, and the latest checkpoint's format."""
    run = Path(tmp) / "legacy"
    shutil.copytree(LEGACY, run)
    train_rank(rank, ["experiment=smoke", "trainer.max_steps=4", "trainer.checkpoint_every=2"], str(run))
    return _metrics(run), json.loads((run / "checkpoints" / "step_0000004" / ckpt.META).read_text()).get("format")


def _resume_older_tag(rank, tmp):
    """A copy of the full run (checkpoints 6 and 8) resumed from step 6 with keep_checkpoints=1,
    stopped at 7, then resumed again (trainer.resume=auto): ``(tags and latest after the stop, the
    second resume's losses)``."""
    run = Path(tmp) / "older"
    shutil.copytree(Path(tmp) / "full", run)
    keep1 = [*SINGLE, "trainer.keep_checkpoints=1"]
    train_rank(rank, [*keep1, f"trainer.resume={run}/checkpoints/step_0000006", "trainer.exit_at_step=7"], str(run))
    moved = sorted(str(d.relative_to(run / "checkpoints" / ckpt.ABANDONED).parent) + "/" + d.name
                   for d in (run / "checkpoints" / ckpt.ABANDONED).glob("*/step_*") if (d / ckpt.META).is_file())
    after_stop = ckpt.published_tags(run / "checkpoints"), (run / "checkpoints" / "latest").read_text(), moved
    return after_stop, train_rank(rank, keep1, str(run))["losses"]


def _files(run: Path) -> dict:
    """Every file of a run dir (bar its lock) and its bytes."""
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".vitp.lock"}


def test_resume_is_exact_single_process(tmp_path):
    """8 steps == 4 steps (exit_at_step, checkpoint, exit) + resume for 4, with dropout and drop-path;
    keep_checkpoints after a resume from an older tag than the newest."""
    full, first, second, fork, (after_stop, last), (legacy, fmt) = run_ranks(1, _runs, str(tmp_path))[0]
    # a checkpoint of the earlier format resumes exactly (read path kept) and continues in the new one
    # recorded on another machine: the grad norm's float32 reductions may be vectorized otherwise
    # there (6e-8 relative seen on this one); the losses and the lr stay bit-identical
    _same_steps(legacy, _metrics(LEGACY), norm_rel=1e-6)
    assert fmt == "vitp.sharded/1"
    assert fork["losses"] == full["losses"][6:]  # trainer.resume=<path> into another run dir
    # resumed from step 6 while step 8 existed: once step 7 is published, step 8 (the abandoned
    # attempt's) moves whole into abandoned/<time>/ and 6 goes (keep=1); 7 stays the latest, and the
    # next resume continues from it
    tags, latest, moved = after_stop
    assert (tags, latest) == (["step_0000007"], "step_0000007")
    assert len(moved) == 1 and moved[0].endswith("/step_0000008"), moved
    assert last == full["losses"][7:]
    assert first["stopped_at"] == 4 and len(first["losses"]) == 4 and len(second["losses"]) == 4
    assert first["losses"] + second["losses"] == full["losses"]
    assert first["grad_norms"] + second["grad_norms"] == full["grad_norms"]
    _same_steps(_metrics(tmp_path / "full"), _metrics(tmp_path / "resumed"))  # steps 1, 3, 6 (mean of 4-6), 8
    assert [r["step"] for r in _metrics(tmp_path / "resumed")] == [1, 3, 6, 8]
    a, b = load_file(tmp_path / "full" / "model_ema.safetensors"), load_file(tmp_path / "resumed" / "model_ema.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)  # EMA state resumed too
    # keep_checkpoints=2: only the two newest complete checkpoints remain
    assert ckpt.published_tags(tmp_path / "resumed" / "checkpoints") == ["step_0000006", "step_0000008"]
    assert (tmp_path / "resumed" / "checkpoints" / "latest").read_text() == "step_0000008"


def test_kill_during_save_resumes_from_the_previous_checkpoint(tp2pp2_run, tmp_path):
    """tp=2 x pp=2: rank 3 truncates a file and dies by SIGKILL while saving step 4 (forked ranks;
    the survivors, waiting in a barrier for it, killed as under a real crash); the restart (through
    the deepspeed launcher) resumes from step 2 and equals the uninterrupted run."""
    ref_dir, ref = tp2pp2_run
    run, over = tmp_path / "run", [*TP2PP2, "eval.enabled=false"]  # the steps are compared, not the evaluation
    run_ranks_until_killed(4, train_rank_killed, "3:4", over, str(run), kill_rank=3)
    assert (run / "checkpoints" / "latest").read_text() == "step_0000002"
    assert (run / "checkpoints" / "step_0000004.partial").is_dir()
    assert ckpt.published_tags(run / "checkpoints") == ["step_0000002"]

    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    p = subprocess.run([str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "4", "--master_port",
                        str(31500 + os.getpid() % 1000), "--module", "vitp.train", *over, f"hydra.run.dir={run}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "resumed from" in out and "step_0000002" in out and "step_0000004.partial" in out
    _same_steps(_metrics(run), _metrics(ref_dir))
    assert [x["step"] for x in _metrics(run)] == [1, 2, 3, 4]
    assert ckpt.published_tags(run / "checkpoints") == ["step_0000002", "step_0000004"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]  # the failed attempt's 3 and 4 are purged


def _import_runs(rank, export, tmp):
    over = ["experiment=smoke", "model.depth=3", "trainer.max_steps=0", f"trainer.init_from={export}",
            "eval.enabled=true", "eval.classifier_epochs=1", "eval.num_samples=20", "eval.t_grid=2"]
    world = int(os.environ["WORLD_SIZE"])
    return train_rank(rank, over + [f"parallel.pp={world}"], f"{tmp}/pp{world}")


def test_export_import_round_trips_across_layouts(tp2pp2_run, tmp_path):
    """Export the tp=2 x pp=2 run, load it at (1, 1) and (1, 2): same held-out loss; the
    re-exported tensors are bit-identical."""
    ref_dir, _ = tp2pp2_run
    export = tmp_path / "w.safetensors"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([str(Path(sys.executable).parent / "vitp-export"), str(ref_dir), "-o", str(export)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(export.with_suffix(".json").read_text())["model"]["depth"] == 3
    exported = load_file(export)
    assert "blocks.0.attn.qkv.weight" in exported and "gen.embed.x_embedder.proj.weight" in exported
    from vitp.cli.export import main as export_main

    with pytest.raises(SystemExit, match="2"):  # never overwrites without --force
        export_main([str(ref_dir), "-o", str(export)])
    want = json.loads((ref_dir / "eval.json").read_text())["heldout_loss"]
    run_ranks(1, _import_runs, str(export), str(tmp_path))
    run_ranks(2, _import_runs, str(export), str(tmp_path))
    for world in (1, 2):
        run = tmp_path / f"pp{world}"
        got = json.loads((run / "eval.json").read_text())["heldout_loss"]
        assert f"{got:.6g}" == f"{want:.6g}"
        again = load_file(run / "model_ema.safetensors")
        assert again.keys() == exported.keys()
        assert all(torch.equal(again[k], exported[k]) for k in exported)


def test_stock_timm_vit_loads_exported_blocks_strictly(tp2pp2_run):
    import timm

    ref_dir, _ = tp2pp2_run
    exported = load_file(ref_dir / "model_ema.safetensors")
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=8, patch_size=2, in_chans=1,
                            embed_dim=32, depth=3, num_heads=2, mlp_ratio=2.0, num_classes=0)
    blocks = {k[len("blocks."):]: v for k, v in exported.items() if k.startswith("blocks.")}
    vit.blocks.load_state_dict(blocks, strict=True)
    torch.testing.assert_close(vit.blocks[1].attn.qkv.weight, exported["blocks.1.attn.qkv.weight"], rtol=0, atol=0)


def test_init_from_timm_loads_blocks_and_reports(tmp_path):
    import timm

    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=8, patch_size=2, in_chans=1,
                            embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
    torch.save({"model": vit.state_dict()}, tmp_path / "vit.pth")
    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    p = subprocess.run([sys.executable, "-m", "vitp.train", "experiment=smoke", "trainer.max_steps=0",
                        f"trainer.init_from_timm={tmp_path / 'vit.pth'}", f"hydra.run.dir={run}"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout + p.stderr
    assert "loaded 16 tensors" in out and "unexpected, ignored" in out
    got = load_file(run / "model.safetensors")
    sd = vit.state_dict()
    for k in ("blocks.1.attn.qkv.weight", "blocks.0.mlp.fc2.bias", "blocks.1.attn.proj.weight"):
        assert torch.equal(got[k], sd[k])
    # a wider ViT: the error names the key and both shapes
    wide = timm.create_model("vit_tiny_patch16_224", pretrained=False, embed_dim=64, depth=2, num_heads=2)
    save_file(wide.state_dict(), str(tmp_path / "wide.safetensors"))
    p = subprocess.run([sys.executable, "-m", "vitp.train", "experiment=smoke", "trainer.max_steps=0",
                        f"trainer.init_from_timm={tmp_path / 'wide.safetensors'}", f"hydra.run.dir={tmp_path / 'r2'}"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert "blocks.0.attn.qkv.weight has shape (192, 64) but the model expects (96, 32)" in p.stdout + p.stderr
    assert not (tmp_path / "r2" / ".hydra").exists()  # a refused launch writes no config


# --- bad input ----------------------------------------------------------------------------------
def _copy_tag(tp2pp2_run, tmp_path) -> Path:
    ref_dir, _ = tp2pp2_run
    dst = tmp_path / "checkpoints" / "step_0000004"
    shutil.copytree(ref_dir / "checkpoints" / "step_0000004", dst)
    return dst


def test_truncated_or_missing_checkpoint_files_are_named(tp2pp2_run, tmp_path):
    tag = _copy_tag(tp2pp2_run, tmp_path)
    assert ckpt.verify_checkpoint(tag)["step"] == 4
    victim = sorted(tag.glob("__*_0.distcp"))[-1]  # a rank's pieces (DCP data file)
    with open(victim, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match=f"{victim}.*truncated"):
        ckpt.verify_checkpoint(tag)
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=f"{victim} is missing"):
        ckpt.verify_checkpoint(tag)
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        ckpt.find_checkpoint(str(tmp_path / "nope"), tmp_path)
    (tmp_path / "checkpoints" / "latest").write_text("garbage")
    with pytest.raises(ValueError, match="not a vitp checkpoint tag"):
        ckpt.find_checkpoint("auto", tmp_path / "checkpoints")


def test_corrupt_file_fails_without_unpickling_code(tp2pp2_run, tmp_path):
    """A pickle that would run code, as a checkpoint's DCP metadata or a timm file, is refused;
    the checkpoint's own metadata and RNG files load through the restricted loaders."""
    import pickle

    from vitp.checkpoint.sharded import METADATA, read_metadata

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    tag = _copy_tag(tp2pp2_run, tmp_path)
    assert read_metadata(tag).state_dict_metadata  # the real metadata passes the allow-list
    for f in tag.glob("rng_rank*.pt"):
        torch.load(f, weights_only=True)
    (tag / METADATA).write_bytes(pickle.dumps({"state_dict_metadata": Evil()}))
    with pytest.raises(ValueError, match=f"checkpoint file {tag / METADATA} is corrupt or not a checkpoint's metadata"):
        read_metadata(tag)
    path = tmp_path / "vit.pth"
    with open(path, "wb") as f:
        pickle.dump({"module": Evil()}, f)
    with pytest.raises(ValueError, match="could not be read safely"):
        ckpt.load_timm_state(path)
    assert not marker.exists()


def test_resuming_another_layout_or_model_explains_the_fix(tp2pp2_run, tmp_path):
    from vitp.config import compose

    tag = _copy_tag(tp2pp2_run, tmp_path)
    meta = ckpt.verify_checkpoint(tag)
    cfg = compose([*TP2PP2])
    assert ckpt.check_resumable(meta, tag, cfg, Layout(2, 2, 1, "fp32")) is False  # the same layout
    assert ckpt.check_resumable(meta, tag, cfg, Layout(1, 2, 2, "fp32")) is True  # resharded (vitp.checkpoint.reshard)
    with pytest.raises(ValueError, match=r"precision: 'fp32' in the checkpoint vs 'bf16' now; tp: 2 in the checkpoint "
                                         r"vs 1 now.*vitp-export .*trainer.init_from"):
        ckpt.check_resumable(meta, tag, cfg, Layout(1, 2, 2, "bf16"))
    old = {k: v for k, v in meta.items() if k != "engine"}  # written before the layout-independent optimizer state
    with pytest.raises(ValueError, match=r"written at another layout \(tp: 2 in the checkpoint vs 1 now; dp: 1 in the checkpoint vs 2 now\) "
                                         r"by a vitp .*resume it at its own layout, or export the weights"):
        ckpt.check_resumable(old, tag, cfg, Layout(1, 2, 2, "fp32"))
    with pytest.raises(ValueError, match=r"model.width: 32 in the file vs 64 now|model.width: 32 in the checkpoint"):
        ckpt.check_resumable(meta, tag, compose([*TP2PP2, "model.width=64"]), Layout(2, 2, 1, "fp32"))
    # the run directory is left as it was
    assert ckpt.verify_checkpoint(tag) == meta


def test_weights_file_errors_name_the_file(tp2pp2_run, tmp_path):
    ref_dir, _ = tp2pp2_run
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes((ref_dir / "model_ema.safetensors").read_bytes()[:1000])
    with pytest.raises(ValueError, match=f"{bad} is corrupt, truncated"):
        ckpt.read_export(bad)
    # a run's own damaged final weights: the advice names the export of its latest checkpoint to a new file
    run = tmp_path / "run"
    shutil.copytree(ref_dir, run)
    (run / "model_ema.safetensors").write_bytes(bad.read_bytes())
    with pytest.raises(ValueError, match=re.escape(f"write the weights again from the run's latest checkpoint to a new "
                                                   f"file, vitp-export {run / 'checkpoints'} -o NEW.safetensors")):
        ckpt.read_export(run / "model_ema.safetensors")
    foreign = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(foreign))
    with pytest.raises(ValueError, match="not written by vitp"):
        ckpt.read_export(foreign)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    p = subprocess.run([sys.executable, "-m", "vitp.train", "experiment=smoke", "model.width=64", "trainer.max_steps=0",
                        f"trainer.init_from={ref_dir / 'model_ema.safetensors'}", f"hydra.run.dir={tmp_path / 'r'}"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "model.width: 32 in the file vs 64 now" in p.stdout + p.stderr, p.stderr[-2000:]


def _bf16_runs(rank, tmp):
    over = ["experiment=smoke", "trainer.max_steps=6", "trainer.precision=bf16"]
    full = train_rank(rank, over, f"{tmp}/full")
    first = train_rank(rank, [*over, "trainer.exit_at_step=3"], f"{tmp}/resumed")
    return full, first, train_rank(rank, over, f"{tmp}/resumed")


def test_bf16_resume_is_exact(tmp_path):
    """bf16 (what precision=auto picks on GPUs) with ZeRO-1: the bf16 weights, fp32 master weights
    and moments of DeepSpeed's bf16 optimizer, saved and loaded as pieces, resume bit-exactly."""
    full, first, second = run_ranks(1, _bf16_runs, str(tmp_path))[0]
    assert first["losses"] + second["losses"] == full["losses"]
    _same_steps(_metrics(tmp_path / "full"), _metrics(tmp_path / "resumed"))
