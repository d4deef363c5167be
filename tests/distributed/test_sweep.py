"""``vitp-sweep train`` end to end: two smoke trainings (one process each), the table equal to
their eval.json files, a re-run that keeps them, and ``collect`` labelling them by config diff."""
import csv
import json
import os

import pytest
from omegaconf import OmegaConf

from tests.helpers import PERTURBED
from vitp.cli.sweep import main

COMMON = ["experiment=smoke", "trainer.max_steps=2", "eval.classifier_epochs=1", "eval.num_samples=20", "eval.t_grid=2",
          f"trainer.init_from={PERTURBED}"]


def test_train_sweep_then_collect(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "sweep"
    main(["train", "--out", str(out), *COMMON, "objective.P_mean=-0.8,0"])
    rows = list(csv.DictReader((out / "comparison.csv").open()))
    assert [r["objective.P_mean"] for r in rows] == ["-0.8", "0"]
    assert [r["run"] for r in rows] == ["000_P_mean_-0.8", "001_P_mean_0"]
    for r in rows:
        run = out / r["run"]
        ev = json.loads((run / "eval.json").read_text())
        for col in ("sample_accuracy", "fd_digits", "fd_digits_ratio", "heldout_loss"):
            assert float(r[col]) == ev[col]
        assert 0 < float(r["wall_s"]) < 600
        cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
        assert cfg.seed == 0 and cfg.eval.enabled and cfg.objective.P_mean == float(r["objective.P_mean"])
    assert rows[0]["heldout_loss"] != rows[1]["heldout_loss"]  # the recipes trained differently
    assert (out / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/*") if p.is_file()}
    main(["train", "--out", str(out), *COMMON, "objective.P_mean=-0.8,0"])  # finished runs are kept, not retrained
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/*") if p.is_file()} == stamps
    assert list(csv.DictReader((out / "comparison.csv").open())) == rows
    with pytest.raises(SystemExit) as e:  # another sweep into the same --out replaced the table
        main(["train", "--out", str(out), *COMMON, "objective.P_mean=0.5"])
    assert e.value.code == 2 and list(csv.DictReader((out / "comparison.csv").open())) == rows
    paths = main(["collect", str(out / "001_P_mean_0"), str(out / "000_P_mean_-0.8"), "--out", str(tmp_path / "c")])
    assert paths is None  # main returns nothing; the files are the result
    got = list(csv.DictReader((tmp_path / "c" / "comparison.csv").open()))
    # labelled by the config's value (0.0) where the sweep shows the command line's (0); sorted by it
    assert [(float(r["objective.P_mean"]), r["fd_digits"]) for r in got] == [
        (float(r["objective.P_mean"]), r["fd_digits"]) for r in rows]
    assert {os.path.basename(r["run"]) for r in got} == {r["run"] for r in rows}


def test_a_failed_training_still_gives_the_table_of_the_others(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "sweep"
    with pytest.raises(SystemExit) as e:
        main(["train", "--out", str(out), *COMMON[:-1],
              f"trainer.init_from={PERTURBED},{tmp_path / 'missing.safetensors'}"])
    assert e.value.code == 1
    assert "vitp-sweep: 1 of 2 runs failed: 001_init_from_" in capsys.readouterr().err
    (row,) = csv.DictReader((out / "comparison.csv").open())
    assert row["run"].startswith("000_init_from_") and float(row["sample_accuracy"]) >= 0
