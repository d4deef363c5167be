"""The comparison table and plot of vitp-sweep (vitp/eval/compare.py), from hand-written eval.json files."""
import csv
import json

import pytest

from vitp.eval.compare import (config_diff, log_wall_seconds, make_row, markdown, read_eval, sort_rows,
                               write_comparison)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _eval(acc, fd, ratio, loss, **extra):
    return {"step": 4, "heldout_loss": loss, "sample_accuracy": acc, "fd_digits": fd, "fd_digits_real": fd / ratio,
            "fd_digits_ratio": ratio, "num_samples": 10, "sampler": {"steps": 2}, **extra}


def test_rows_keep_the_eval_json_values_and_sort_numerically(tmp_path):
    results = {"10": _eval(0.995, 12.5, 1.5, 0.61), "2": _eval(0.9, 80.0, 9.5, 0.7), "1.5": _eval(1.0, 30.0, 3.5, 0.6)}
    rows = [make_row({"sampler.steps": k}, r, f"run{k}", 1.25) for k, r in results.items()]
    paths = write_comparison(rows, ["sampler.steps"], tmp_path, "t")
    got = list(csv.DictReader(paths["csv"].open()))
    assert [r["sampler.steps"] for r in got] == ["1.5", "2", "10"]  # 10 after 2: numbers, not text
    for r in got:
        ev = results[r["sampler.steps"]]
        for col in ("sample_accuracy", "fd_digits", "fd_digits_ratio", "heldout_loss"):
            assert float(r[col]) == ev[col]  # full precision, equal to eval.json
        assert float(r["wall_s"]) == 1.25 and r["run"] == f"run{r['sampler.steps']}"
    assert "temporal_diff_ratio" not in got[0]  # no row has it
    md = paths["md"].read_text()
    assert "| sampler.steps | sample accuracy (judge) | FD-digits | FD-digits / real |" in md
    assert "| 10 | 0.9950 | 12.5 | 1.5 | 0.61 | 1.25 | run10 |" in md
    assert md.rstrip().endswith("FD-digits ratio <= 2.0): run10.")  # the one row in the target
    wan = make_row({"sampler.steps": "4"}, {"heldout_loss": 1.9, "temporal_diff_ratio": 1.0}, "../wan_run", None)
    assert markdown(rows + [wan], ["sampler.steps"], "t").rstrip().endswith(  # no digits numbers: not in the target
        "FD-digits ratio <= 2.0): run10. No sample accuracy / FD-digits ratio numbers, not judged: ../wan_run.")
    assert paths["png"].read_bytes()[:8] == PNG_MAGIC
    assert [r["run"] for r in sort_rows(rows, ["sampler.steps"], "-sample_accuracy")] == ["run1.5", "run10", "run2"]
    with pytest.raises(ValueError, match="unknown column; use one of sampler.steps, sample_accuracy"):
        sort_rows(rows, ["sampler.steps"], "accuracy")


def test_video_rows_and_a_plot_without_judge_metrics(tmp_path):
    rows = [make_row({"model.attention": a}, {"heldout_loss": v, "temporal_diff_ratio": r}, a, None)
            for a, v, r in (("full", 0.8, 2.0), ("factorized", 0.9, 1.2))]
    paths = write_comparison(rows, ["model.attention"], tmp_path, "video")
    got = list(csv.DictReader(paths["csv"].open()))
    assert list(got[0]) == ["model.attention", "heldout_loss", "temporal_diff_ratio", "run"]
    assert [float(r["temporal_diff_ratio"]) for r in got] == [1.2, 2.0]  # sorted by label: factorized < full
    md = markdown(rows, ["model.attention"], "v")
    assert md.rstrip().endswith("Target (temporal diff / real in [0.8, 1.3]): factorized.")
    bare = make_row({"model.attention": "none"}, {"heldout_loss": 0.7}, "none", None)
    assert markdown([bare], ["model.attention"], "v").rstrip().endswith(
        "[0.8, 1.3]): no row. No temporal diff / real numbers, not judged: none.")
    assert paths["png"].read_bytes()[:8] == PNG_MAGIC


def test_config_diff_labels_and_inputs(tmp_path):
    a = {"seed": 0, "model.depth": 4, "sampler.cfg_interval": [0, 1], "paths.output_root": "x"}
    b = {"seed": 0, "model.depth": 6, "sampler.cfg_interval": [0.1, 1], "paths.output_root": "y"}
    assert config_diff([a, b, a]) == [{"model.depth": "4", "sampler.cfg_interval": "[0,1]"},
                                      {"model.depth": "6", "sampler.cfg_interval": "[0.1,1]"},
                                      {"model.depth": "4", "sampler.cfg_interval": "[0,1]"}]
    assert config_diff([a]) == [{}]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_eval(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match=r"eval.json not found: evaluate the run first \(vitp-eval "):
        read_eval(tmp_path)
    (tmp_path / "train.log").write_text("[2026-12-01 06:39:02,997][vitp][INFO] - run dir\nno stamp\n"
                                        "[2026-12-01 06:40:14,604][vitp][INFO] - done\n")
    assert log_wall_seconds(tmp_path) == pytest.approx(71.607)
    assert log_wall_seconds(tmp_path / "none") is None
    with pytest.raises(ValueError, match="nothing to compare"):
        write_comparison([], [], tmp_path, "t")
    (tmp_path / "eval.json").write_text(json.dumps(_eval(1.0, 1.0, 1.0, 1.0)))
    assert read_eval(tmp_path)["fd_digits"] == 1.0


def test_eval_weights_are_found_in_the_run_then_from_here(tmp_path, monkeypatch):
    """``vitp-eval run1 --weights run3/export/x.safetensors`` looked inside run1 only (a new user's
    trial): a path that is not in the run but exists from the current folder is that file."""
    from vitp.cli.eval import given_weights

    run, other = tmp_path / "run1", tmp_path / "run3" / "export"
    (run / "export").mkdir(parents=True)
    other.mkdir(parents=True)
    (run / "export" / "a.safetensors").write_bytes(b"")
    (other / "x.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path)
    assert given_weights(run, "export/a.safetensors") == "export/a.safetensors"  # the run's own, as before
    assert given_weights(run, "run3/export/x.safetensors") == str(other / "x.safetensors")
    assert given_weights(run, "missing.safetensors") == "missing.safetensors"  # refused later, naming run1/missing
