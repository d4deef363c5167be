"""vitp.parallel.checkpoint_activations: the recompute draws the same TP-stream dropout masks
(torch's own checkpoint restores only the default generators: its gradients differ here)."""
import pytest
import torch

from vitp.parallel import checkpoint_activations, get_rng_tracker
from vitp.parallel.random import TP_RNG


@pytest.fixture(autouse=True)
def _keep_tracker():
    """The process-wide tracker as the other tests left it."""
    tracker = get_rng_tracker()
    seeds, states = dict(tracker.seeds), tracker.get_states()
    yield
    tracker.seeds, tracker.states = seeds, states


def _block(x, w):
    with get_rng_tracker().fork(TP_RNG):  # dropout on a sharded activation: the TP stream
        h = torch.nn.functional.dropout(x @ w, p=0.5, training=True)
    return torch.nn.functional.dropout(h.tanh(), p=0.5, training=True)  # the default stream


def _grads(fn):
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(TP_RNG, 1234)
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    out = fn(_block, x, w)
    out.square().sum().backward()
    return out.detach(), x.grad, w.grad


def test_checkpointed_forward_and_gradients_equal_the_plain_ones():
    plain = _grads(lambda f, *a: f(*a))
    ckpt = _grads(checkpoint_activations)
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert (plain[0] == 0).any()  # dropout did drop


def test_the_tp_stream_is_left_where_the_forward_left_it():
    _grads(checkpoint_activations)
    after_ckpt = get_rng_tracker().get_states()
    _grads(lambda f, *a: f(*a))
    after_plain = get_rng_tracker().get_states()
    assert all(torch.equal(after_ckpt[k][d], after_plain[k][d]) for k in after_plain for d in after_plain[k])
