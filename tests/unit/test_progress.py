"""Progress output outside a terminal (``vitp-train ... 2>&1 | cat``, a log file): each state once,
one line each, no carriage returns; a terminal keeps tqdm's bar (:mod:`vitp.progress`)."""
from __future__ import annotations

import io
import json
import logging

from tqdm import tqdm

import vitp.progress as progress
from tests.helpers import SMOKE4, compose_cfg


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_tqdm_and_anything_else_lines():
    assert isinstance(progress.progress_bar(3, "x", file=_Terminal()), tqdm)
    assert isinstance(progress.progress_bar(3, "x", file=io.StringIO()), progress.LineProgress)


def test_lines_come_at_the_first_update_every_interval_and_at_close_each_once(monkeypatch, capsys):
    """A clock under the test's control: lines at the first update (t=1), at the first update 30 s
    after it (t=31) and at close; a write prints once, with no redraw of the bar; closing twice or
    after the last line showed the final count writes nothing more."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    out = io.StringIO()
    bar = progress.progress_bar(10, "train", file=out)
    for t, n in ((1, 1), (10, 2), (31, 3), (40, 4), (45, 10)):
        now[0] = float(t)
        bar.set_postfix(loss=f"{n / 10:.4f}", gnorm=n, refresh=False)
        bar.update(n - bar.n)
        if n == 2:
            bar.write("step 2: held-out loss 1.5000")
    now[0] = 50.0
    bar.close()
    bar.close()
    assert out.getvalue().splitlines() == [
        "train:  10% 1/10 [00:01<00:09,  1.00it/s, gnorm=1, loss=0.1000]",
        "train:  30% 3/10 [00:31<01:12, 10.33s/it, gnorm=3, loss=0.3000]",
        "train: 100% 10/10 [00:50<00:00,  5.00s/it, gnorm=10, loss=1.0000]"]
    assert capsys.readouterr().out == "step 2: held-out loss 1.5000\n"  # tqdm.write's stream: stdout

    now[0] = 0.0
    done = progress.LineProgress(4, "sampling", "step", file=out, interval_s=0)
    out.truncate(0), out.seek(0)
    done.update(4)
    done.close()  # the last update showed 4/4 already
    assert out.getvalue() == "sampling: 100% 4/4 [00:00<?, ?step/s]\n"
    quiet = io.StringIO()
    with progress.LineProgress(4, "x", file=quiet, disable=True) as off:
        off.update(4)
    assert quiet.getvalue() == ""


def test_a_run_piped_to_a_file_prints_each_progress_line_once(tmp_path, capfd, caplog):
    """A new user's trial: ``vitp-train ... 2>&1 | cat`` showed every tqdm redraw (carriage returns),
    the final 100 % line twice and log records glued to the bar's line. Outside a terminal (pytest's
    capture) a 4-step run prints its training progress in two lines (the first step, the end) and
    the final sample grid's sampling in two, each once, each a line of its own."""
    from vitp.train import train

    caplog.set_level(logging.INFO, logger="vitp")
    train(compose_cfg([*SMOKE4, "trainer.progress=true", "trainer.eval_every=2"]), tmp_path / "run")
    err = capfd.readouterr().err
    assert "\r" not in err
    bars = [line.split(" [")[0] for line in err.splitlines() if line.startswith(("train:", "sampling:"))]
    assert bars == ["train:  25% 1/4", "train: 100% 4/4", "sampling:  50% 1/2", "sampling: 100% 2/2"], err
    from vitp.data import build_datasets

    held = len(build_datasets(compose_cfg(SMOKE4).data, 0)[1])  # the planner's line counts the real held-out set
    logged = [r.getMessage() for r in caplog.records]
    # the held-out loss lines are log records (a trial user found them on the console, not in train.log)
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert len(evals) == 2 and [f"step {e['step']}: held-out loss {e['heldout_loss']:.4f}" for e in evals] == [
        m for m in logged if ": held-out loss " in m and m.startswith("step ")], logged
    assert sum("(planner): sample grid " in m and f"; held-out loss ({held} items) " in m for m in logged) == 1, logged
