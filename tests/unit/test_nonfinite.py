"""vitp.train.nonfinite: where a non-finite loss first appeared, and the exit status it gets."""
import math

import pytest
import torch

from vitp.cli import EXIT_BAD_INPUT, EXIT_NON_FINITE, run_cli
from vitp.train.nonfinite import StepBatches, holds_nonfinite, nonfinite_loss_error

NAN = float("nan")


def _batch(bad=False):
    x = torch.zeros(2, 3, 4, 4)
    if bad:
        x[1, 2, 3, 3] = float("inf")
    return (x, torch.tensor([0.1, 0.2]), torch.tensor([1, 2])), (x.clone(), x, torch.tensor([0.1, 0.2]))


def test_step_batches_keeps_what_the_current_step_read():
    it = StepBatches(iter(range(5)))
    assert [next(it), next(it)] == [0, 1] and it.read == [0, 1]
    it.new_step()
    assert next(it) == 2 and it.read == [2]


def test_nonfinite_values_are_found_in_nested_batches():
    assert not holds_nonfinite([_batch(), _batch()])
    assert holds_nonfinite([_batch(), _batch(bad=True)])


def _message(batches=(), prev=0.5, first=False, clip=1.0, precision="fp32"):
    return str(nonfinite_loss_error(NAN, 7, batches=list(batches), prev_grad_norm=prev, first_step=first,
                                    grad_clip=clip, precision=precision))


def test_the_message_names_the_place_and_its_fix():
    assert _message([_batch(bad=True)]) == ("loss is nan at step 7: the input batch of that step already holds "
                                            "NaN/Inf, so the data do: check data.root / the dataset (its files and "
                                            "transforms)")
    assert _message([_batch()]) == ("loss is nan at step 7: the forward pass made it from a finite input batch: "
                                    "lower optim.lr or keep optim.grad_clip > 0")
    assert _message(clip=0.0, precision="bf16").endswith(
        "lower optim.lr or set optim.grad_clip > 0 (it is 0: no clipping), or use trainer.precision=fp32")
    assert _message(prev=math.inf) == ("loss is nan at step 7: the gradients of step 6 were already non-finite (grad "
                                       "norm inf) though its loss was finite: keep optim.grad_clip > 0 and lower "
                                       "optim.lr")
    assert "the first step of this run: if the weights it started from hold NaN/Inf, fix trainer.init_from" in \
        _message(prev=NAN, first=True)


def test_a_resumed_checkpoint_is_named_until_the_run_writes_its_own(tmp_path):
    """A new user's report: a checkpoint with bytes overwritten (size unchanged) resumed at step 45
    and the loss turned NaN at step 47, blamed on the lr alone (the checkpoint was named only at an
    attempt's first step). Until the attempt writes a checkpoint of its own, the message names the
    one it resumed from and the one before it to resume from; the lr advice stays."""
    from vitp.train.nonfinite import nonfinite_grad_error, resumed_checkpoint_note

    ckpts = tmp_path / "run" / "checkpoints"
    for tag in ("step_0000040", "step_0000045", "step_0000050"):
        (ckpts / tag).mkdir(parents=True)
        (ckpts / tag / "vitp_meta.json").write_text("{}")
    (ckpts / "step_0000042").mkdir()  # incomplete (no vitp_meta.json): not one to resume from
    cmd = f"vitp-train --resume {tmp_path / 'run'}"
    note = resumed_checkpoint_note(ckpts / "step_0000045", False, cmd)
    assert note == (f"no checkpoint since this run resumed from {ckpts / 'step_0000045'}: if that one is damaged, "
                    f"resume from the one before with {cmd} trainer.resume={ckpts / 'step_0000040'}")
    assert str(nonfinite_loss_error(NAN, 47, batches=[_batch()], prev_grad_norm=0.5, first_step=False, grad_clip=1.0,
                                    precision="fp32", resumed=note)) == (
        f"loss is nan at step 47: the forward pass made it from a finite input batch ({note}): lower optim.lr or keep "
        "optim.grad_clip > 0")
    assert f"though its loss was finite ({note}): keep optim.grad_clip > 0 and lower optim.lr" in str(
        nonfinite_loss_error(NAN, 47, batches=[], prev_grad_norm=math.inf, first_step=False, grad_clip=1.0,
                             precision="fp32", resumed=note))
    assert f"(the run diverges; {note}): lower optim.lr" in str(
        nonfinite_grad_error(math.inf, 0.5, 47, grad_clip=1.0, precision="fp32", resumed=note))
    assert resumed_checkpoint_note(ckpts / "step_0000040", False, cmd) == (
        f"no checkpoint since this run resumed from {ckpts / 'step_0000040'}: if that one is damaged, no earlier "
        f"checkpoint is in {ckpts}")
    assert resumed_checkpoint_note(ckpts / "step_0000045", True, cmd) == ""  # it wrote one since: not named
    assert resumed_checkpoint_note(None, False, cmd) == ""  # a fresh start


def test_gradients_that_went_bad_a_step_earlier_win_over_a_bad_batch():
    assert "gradients of step 6" in _message([_batch(bad=True)], prev=NAN)
    assert "input batch" in _message([_batch(bad=True)], prev=NAN, first=True)


def _raise(error):
    raise error


@pytest.mark.parametrize("error,status", [(FloatingPointError("loss is nan at step 3: ..."), 3),
                                          (ValueError("model.depth=0; use ..."), 2)])
def test_a_nonfinite_loss_has_its_own_exit_status(capsys, error, status):
    assert (EXIT_NON_FINITE, EXIT_BAD_INPUT) == (3, 2)
    with pytest.raises(SystemExit) as e:
        run_cli("vitp-train", _raise, error)
    assert e.value.code == status
    assert capsys.readouterr().err == f"vitp-train: error: {error}\n"


def test_a_refusal_after_hydra_starts_is_one_line_on_stderr_and_in_the_log_file(capsys, tmp_path):
    """vitp-train passes its logger (Hydra's console handler writes to stdout): the refusal still
    goes to stderr, once, and to the run's train.log, not to stdout as a log record."""
    import logging
    import sys

    log = logging.getLogger("vitp.test_refusal")
    console, file = logging.StreamHandler(sys.stdout), logging.FileHandler(tmp_path / "train.log", delay=True)
    for h in (console, file):
        log.addHandler(h)
    try:
        with pytest.raises(SystemExit) as e:
            run_cli("vitp-train", _raise, ValueError("run dir RUN is in use by another vitp-train"), log=log)
    finally:
        for h in (console, file):
            log.removeHandler(h)
            h.close()
    out = capsys.readouterr()
    line = "vitp-train: error: run dir RUN is in use by another vitp-train"
    assert e.value.code == 2 and out.out == "" and out.err == line + "\n"
    assert (tmp_path / "train.log").read_text() == line + "\n"
