"""A non-finite loss stops training with a message naming where the NaN/Inf first appeared (the
step's input batch, the forward pass, the gradients of the step before) and the fix for that place
(vitp.train.nonfinite). One spawned rank trains the smoke model once per case."""
import pytest

from tests.helpers import run_ranks


def _final_linear(trainer):
    from vitp.models import FinalLayer

    return next(m for m in trainer.engine.module.modules() if isinstance(m, FinalLayer)).linear


def _poison_batch(trainer):
    """NaN in the input of step 2's first micro-batch (2 micro-batches per step)."""
    def poisoned(it):
        for k, mb in enumerate(it):
            if k == 2:
                mb[0][0].view(-1)[0] = float("nan")  # z_t of the first stage's input
            yield mb

    trainer.step_batches.it = poisoned(trainer.step_batches.it)


def _poison_weight(trainer):  # the forward pass gives NaN from a finite batch
    import torch

    with torch.no_grad():
        _final_linear(trainer).weight[0, 0] = float("nan")


def _huge_bias(trainer):  # finite weights whose forward overflows fp32
    import torch

    with torch.no_grad():
        _final_linear(trainer).bias.fill_(1e30)


def _poison_gradient(trainer):
    """NaN gradients of the final layer in step 1's first backward (its loss stays finite)."""
    calls = []

    def hook(g):
        calls.append(1)
        return g * float("nan") if len(calls) == 1 else g

    _final_linear(trainer).weight.register_hook(hook)


CASES = {"batch": _poison_batch, "weight": _poison_weight, "forward": _huge_bias, "gradient": _poison_gradient}


def _nonfinite_rank(rank, base):
    from tests.helpers import compose_cfg
    from vitp.train.trainer import Trainer

    out = {}
    for name, poison in CASES.items():
        trainer = Trainer(compose_cfg(["experiment=smoke", "trainer.max_steps=3"]), f"{base}/{name}")
        poison(trainer)
        try:
            trainer.fit()
            out[name] = None
        except FloatingPointError as e:
            out[name] = str(e)
    return out


@pytest.fixture(scope="module")
def messages(tmp_path_factory):
    return run_ranks(1, _nonfinite_rank, str(tmp_path_factory.mktemp("nonfinite")))[0]


def test_nan_in_the_batch_blames_the_data(messages):
    assert messages["batch"] == ("loss is nan at step 2: the input batch of that step already holds NaN/Inf, so the "
                                 "data do: check data.root / the dataset (its files and transforms)")


FORWARD = ("at step 1: the forward pass made it from a finite input batch (the first step of this run: if the weights "
           "it started from hold NaN/Inf, fix trainer.init_from, trainer.init_from_timm or the resumed checkpoint): "
           "lower optim.lr or keep optim.grad_clip > 0")


def test_nan_in_a_weight_blames_the_forward_pass(messages):
    assert messages["weight"] == "loss is nan " + FORWARD


def test_an_overflowing_forward_blames_the_forward_pass(messages):
    assert messages["forward"] == "loss is inf " + FORWARD


def test_nan_gradients_stop_the_step_they_appear_in(messages):
    """A finite loss with a non-finite grad norm stops at that step (a diverging run at
    optim.lr=1e6 trained 30 steps to a loss of 1e28 and exported its weights)."""
    head, tail = messages["gradient"].split(" though its loss (")
    assert head == "grad norm is nan at step 1", messages["gradient"]
    assert float(tail.split(")")[0]) > 0 and tail.endswith(
        ") is finite: the backward pass overflowed (the run diverges): lower optim.lr and keep optim.grad_clip > 0")
