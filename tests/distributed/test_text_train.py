"""Text-conditional training (captions -> vitp-encode-captions -> cross-attention) against the
single-process run, in every layout, from perturbed weights where every path matters.

One module-scoped set-up builds a tiny local T5 encoder (random weights, byte tokenizer: nothing
downloaded), encodes the digits' template captions with ``vitp-encode-captions`` and writes a
perturbed text-conditional export; the 1-process reference and the 4-rank layouts (one spawn,
cases in turn) train from it. The same spawn then runs ``vitp-eval`` of the reference run with FID
and CLIP score (random-weight networks of scripts/make_random_eval_weights.py, 8 samples) as
4 data-parallel replicas, against one process's.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.record_reference import write_perturbed
from tests.helpers import run_ranks

TEMPLATES = '["a handwritten {class_word}","the digit {class}","{class}"]'
TEXT = ["data.captions=templates", f"data.caption_templates={TEMPLATES}", "model.text_dim=32"]
SMOKE = ["experiment=smoke", "trainer.max_steps=4", "model.num_heads=4", "objective.label_drop=0.25", *TEXT]
# vitp-eval with FID and CLIP score of 8 samples (the held-out captions) against 4 training digits, small counts
EVAL = ["eval.classifier_epochs=1", "eval.num_samples=4", "eval.prompt_samples=1", "eval.t_grid=2", "eval.fid.num=8",
        "eval.fid.block=8", "eval.fid.real_num=4", "eval.fid.batch_size=4", "eval.clip.batch_size=3"]


def _encode(enc, out, overrides):
    cmd = [str(Path(sys.executable).parent / "vitp-encode-captions"), "--encoder", str(enc), "--out", str(out),
           "--max-length", "24", *overrides]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.fixture(scope="module")
def text_setup(tmp_path_factory):
    from vitp.text.tiny import make_tiny_encoder

    root = tmp_path_factory.mktemp("text")
    enc = make_tiny_encoder(root / "encoder")
    out = _encode(enc, root / "emb", TEXT[:2])
    assert "train with: data.text_embeddings=" in out
    over = [*SMOKE, f"data.text_embeddings={root / 'emb'}", f"data.text_encoder={enc}"]
    write_perturbed(root / "perturbed.safetensors", over)
    over.append(f"trainer.init_from={root / 'perturbed.safetensors'}")
    return root, over


@pytest.fixture(scope="module")
def eval_weights(tmp_path_factory):
    """The overrides of ``OUT/inception.pth`` and ``OUT/clip`` (scripts/make_random_eval_weights.py)."""
    from tests.helpers import eval_weights_script

    mod = eval_weights_script()
    out = tmp_path_factory.mktemp("evalw")
    return [f"eval.fid.weights={mod.random_inception(out / 'inception.pth')}",
            f"eval.clip.model={mod.random_clip(out / 'clip')}"]


def _eval_argv(root, weights, name):
    """``vitp-eval`` of the reference run with :data:`EVAL`, FID's real statistics in a file of its
    own (first: it names the results and samples files, whose names keep 150 characters of the overrides)."""
    return [str(root / "ref"), f"eval.fid.real_stats={root / f'fid_real_{name}.safetensors'}", *EVAL, *weights]


def _train(rank, overrides, run_dir):
    from vitp.config import compose
    from vitp.train import train

    res = train(compose(overrides), run_dir)
    return {k: res[k] for k in ("losses", "grad_norms")}


def _cases(rank, cases, base):
    return {name: _train(rank, over, f"{base}/{name}") for name, over in cases.items()}


def _cases_then_eval(rank, cases, base, eval_argv):
    """:func:`_cases`, then ``vitp-eval eval_argv`` on the same ranks in the layout it chooses
    under a launcher (last: it closes the process group)."""
    from vitp.cli.eval import run

    trained = _cases(rank, cases, base)
    return {"train": trained, "eval": run(eval_argv)}


def _one(overrides, run_dir):
    """One training run in a fresh process (a run in pytest's own process would leave its process
    group and MASTER_PORT behind for every later test)."""
    return run_ranks(1, _train, overrides, str(run_dir))[0]


@pytest.fixture(scope="module")
def reference(text_setup):
    root, over = text_setup
    return _one(over, root / "ref")


LAYOUTS = {  # 4 ranks each
    "tp2_dp2": ["parallel.tp=2"],
    "tp2sp_dp2": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2_dp2": ["parallel.pp=2", "parallel.activation_checkpoint_interval=1"],
    "tp2_pp2": ["parallel.tp=2", "parallel.pp=2"],
    "tp2_cp2": ["parallel.tp=2", "parallel.cp=2", "model.num_heads=4"],
}


@pytest.fixture(scope="module")
def layouts(text_setup, reference, eval_weights):
    """Every rank's ``{"train": {layout: losses}, "eval": vitp-eval's results}``."""
    root, over = text_setup
    cases = {name: [*over, *extra] for name, extra in LAYOUTS.items()}
    return run_ranks(4, _cases_then_eval, cases, str(root / "layouts"), _eval_argv(root, eval_weights, "dp4"),
                     timeout=900)


def test_reference_trains_and_every_path_matters(reference):
    assert len(reference["losses"]) == 4
    assert max(reference["grad_norms"]) > 0.5  # clipping at 1.0 is reached: perturbed weights


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(reference, layouts, name):
    for rank_res in layouts:
        r = rank_res["train"][name]
        assert r["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
        assert r["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5), name


def test_caption_drop_changes_the_loss(text_setup, reference):
    """The CFG caption drop is part of the keyed batch: a run without it trains on other inputs."""
    root, over = text_setup
    res = _one([*over, "objective.label_drop=0.0"], root / "nodrop")
    assert res["losses"][0] != pytest.approx(reference["losses"][0], rel=1e-6)


def test_resume_mid_run_equals_the_uninterrupted_run(text_setup, reference):
    """Stopped after step 2 and resumed: the caption drop and noise of steps 3-4 are the same draws."""
    root, over = text_setup
    run = root / "resume"
    first = _one([*over, "trainer.exit_at_step=2"], run)
    second = _one(over, run)
    assert first["losses"] + second["losses"] == pytest.approx(reference["losses"], rel=1e-6)


def test_sample_with_prompts_from_the_store_and_from_the_encoder(text_setup, reference, capsys):
    """A prompt the store holds and one it does not (encoded with the run's local encoder): one
    captioned row each; a class request to a text model is refused in one line."""
    from PIL import Image

    from vitp.cli.sample import main

    import json

    from safetensors import safe_open

    root, _ = text_setup
    with safe_open(str(root / "ref" / "model_ema.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["conditioning"] == "text"
    recorded = json.loads(meta["text_encoder"])
    assert recorded["encoder"]["hidden_size"] == 32 and len(recorded["encoder"]["config_sha256"]) == 64
    assert recorded["embeddings"] == str((root / "emb").resolve()) and recorded["max_length"] == 24
    out = root / "prompts.png"
    main([str(root / "ref"), "--prompt", "the digit 7", "--prompt", "the number 7", "--num", "2",
          "--out", str(out), "sampler.steps=2"])
    assert "2 prompts x 2 samples" in capsys.readouterr().out
    w, h = Image.open(out).size
    assert w > h  # the caption band to the left of the 2 x 2 grid
    with pytest.raises(SystemExit) as e:
        main([str(root / "ref"), "--classes", "3"])
    assert e.value.code == 2
    assert "text-conditional: give --prompt" in capsys.readouterr().err


def test_eval_measures_prompt_accuracy_per_phrasing(text_setup, reference):
    """vitp-eval on a text run: held-out loss with the captions, and the judge's accuracy of
    samples for every (template, digit) prompt, seen and unseen phrasings apart."""
    from vitp.cli.eval import run

    root, _ = text_setup
    res = run([str(root / "ref"), "eval.classifier_epochs=1", "eval.num_samples=20", "eval.prompt_samples=1",
               "eval.unseen_prompt_templates=[\"the number {class}\"]"])
    assert res["heldout_loss"] > 0
    assert {"prompt_accuracy_seen", "prompt_accuracy_unseen", "prompt_accuracy/the digit {class}",
            "prompt_accuracy/the number {class}"} <= set(res)
    assert 0.0 <= res["prompt_accuracy_seen"] <= 1.0


def test_eval_on_4_ranks_gives_the_one_process_fid_and_clip_score(text_setup, layouts, eval_weights):
    """vitp-eval of the caption run as 4 replicas (the layouts' group): each samples and scores its
    rows of the FID samples against their captions; the ``.npz`` is one process's byte for byte,
    the CLIP score and FID equal its to 1e-6. A missing CLIP folder is refused before any sample."""
    from vitp.cli.eval import run

    root, _ = text_setup
    got = layouts[0]["eval"]
    before = sorted((root / "ref").glob("*.npz"))
    wrong = [a if not a.startswith("eval.clip.model=") else f"eval.clip.model={root / 'no_clip'}"
             for a in _eval_argv(root, eval_weights, "wrong")]
    with pytest.raises(FileNotFoundError, match=f"eval.clip.model={root / 'no_clip'}: no such folder"):
        run(wrong)
    assert sorted((root / "ref").glob("*.npz")) == before and not list((root / "ref").glob("*.parts"))
    one = run(_eval_argv(root, eval_weights, "one"))
    assert got["clip_num_samples"] == one["clip_num_samples"] == 8 and got["fid_num_samples"] == 8
    assert Path(got["fid_npz"]) != Path(one["fid_npz"])
    assert Path(got["fid_npz"]).read_bytes() == Path(one["fid_npz"]).read_bytes()  # the same samples
    assert got["clip_score"] == pytest.approx(one["clip_score"], rel=1e-6) and got["clip_score"] > 0
    assert got["fid"] == pytest.approx(one["fid"], rel=1e-6)
    assert got["heldout_loss"] == pytest.approx(one["heldout_loss"], rel=1e-6)
