"""The partial-synchronization autograd rule (vitp.parallel.partial_sync) on one process, float64,
with the collective replaced by two identical ranks (an all-reduce doubles its input): which
channels are summed, where the private scale applies, that backward applies the same map, and that
the layers wire it in (row-parallel output, column inputs without a collective)."""
import math

import pytest
import torch

from vitp.parallel import comm
from vitp.parallel import partial_sync as ps


@pytest.fixture
def two_identical_ranks(monkeypatch):
    """``group_size`` 2 and an all-reduce over two ranks holding the same tensor; records calls."""
    calls = []

    def all_reduce(x, group, *, direction="none", tag="tp"):
        calls.append((tuple(x.shape), direction, tag))
        return x.contiguous() * 2

    monkeypatch.setattr(comm, "group_size", lambda group: 2)
    monkeypatch.setattr(comm, "all_reduce", all_reduce)
    return calls


@pytest.mark.parametrize("k,scale", [(3, math.sqrt(2)), (0, 1.0), (8, 1.0), (5, 2.0)])
def test_forward_and_backward_apply_the_same_map(two_identical_ranks, k, scale):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    y = ps.partial_reduce_from_tp_region(x, None, k, scale)
    want = torch.cat([2 * x[..., :k], scale * x[..., k:]], -1)
    assert torch.equal(y, want)
    w = torch.randn(y.shape, generator=g, dtype=torch.float64)
    (gx,) = torch.autograd.grad((y * w).sum(), x)
    assert torch.equal(gx, torch.cat([2 * w[..., :k], scale * w[..., k:]], -1))
    n = 0 if k == 0 else 1
    assert two_identical_ranks == [((2, 4, k), "fwd", "tp")] * n + [((2, 4, k), "bwd", "tp")] * n


def test_mean_over_tp(two_identical_ranks):
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    y = ps.mean_over_tp(x, None)
    assert torch.equal(y, x * 2 / 2)
    (gx,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(gx, torch.full_like(x, 0.5))  # each rank takes 1/tp of the (identical) gradient
    assert two_identical_ranks == [((3, 5), "fwd", "head")]


def test_layers_are_wired(two_identical_ranks):
    from vitp.parallel import ParallelState, RowParallelLinear

    lin = torch.nn.Linear(8, 8).double()
    state = ParallelState(tp_size=2, tp_rank=0, partial_sync=0.5)
    row = RowParallelLinear.from_linear(lin, state, partial_sync=ps.partial_sync_of(8, state))  # input features 0..3
    assert row.partial_sync.k == 4 and row.partial_sync.scale == pytest.approx(math.sqrt(2))
    assert row.bias.tp_partial_grad and not row.partial_sync.sequence_parallel
    x = torch.randn(2, 3, 4, dtype=torch.float64)
    o = torch.nn.functional.linear(x, lin.weight[:, :4])
    want = torch.cat([2 * o[..., :4], math.sqrt(2) * o[..., 4:]], -1) + lin.bias
    assert torch.allclose(row(x), want, rtol=0, atol=1e-14)
