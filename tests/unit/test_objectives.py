"""Flow-matching target, loss and samplers on hand-checked values."""
import math

import pytest
import torch

from vitp.objectives import FlowMatchingLoss, guided, make_pair, sample, velocity


def test_pair_and_loss_hand_checked():
    x = torch.tensor([0.5, -1.0]).view(1, 2, 1, 1, 1)
    eps = torch.tensor([1.0, 2.0]).view(1, 2, 1, 1, 1)
    t = torch.tensor([0.25])
    (z, t_in, y_in), (x_t, z_t, t_t) = make_pair(x, torch.tensor([3]), eps, t, torch.tensor([10]), noise_scale=2.0)
    # z = t x + (1 - t) s eps = 0.25*[0.5,-1] + 0.75*2*[1,2]
    assert torch.allclose(z.flatten(), torch.tensor([0.125 + 1.5, -0.25 + 3.0]))
    assert torch.equal(z, z_t) and torch.equal(x, x_t) and y_in.item() == 10 and t_in is t
    # v target = x - s eps = [0.5-2, -1-4]; a prediction x_pred = 0 gives v_pred = -z / 0.75
    loss_fn = FlowMatchingLoss(t_eps=0.05)
    v = velocity(x, z, t, 0.05).flatten()
    assert torch.allclose(v, torch.tensor([-1.5, -5.0]))
    v_pred = -z.flatten() / 0.75
    expected = ((v_pred - v) ** 2).mean()
    assert math.isclose(loss_fn(torch.zeros_like(x), (x_t, z_t, t_t)).item(), expected.item(), rel_tol=1e-6)
    t_rec, l_rec = loss_fn.pop_records()
    assert t_rec.tolist() == [0.25] and math.isclose(l_rec.item(), expected.item(), rel_tol=1e-6)
    assert loss_fn.pop_records()[0].numel() == 0


def test_perfect_prediction_has_zero_loss_and_t_eps_clips():
    x, eps = torch.randn(4, 1, 1, 2, 2), torch.randn(4, 1, 1, 2, 2)
    t = torch.tensor([0.1, 0.5, 0.97, 0.999])
    _, targets = make_pair(x, torch.zeros(4), eps, t, torch.zeros(4, dtype=torch.long), 1.0)
    assert FlowMatchingLoss(0.05)(x, targets).item() < 1e-10
    # near t=1 the division uses t_eps, not 1 - t
    v = velocity(torch.ones(1, 1), torch.zeros(1, 1), torch.tensor([0.999]), 0.05)
    assert torch.allclose(v, torch.tensor([[20.0]]))


class _Oracle(torch.nn.Module):
    """Predicts the single data point ``x*``; the exact flow then ends at ``x*``."""

    def __init__(self, target):
        super().__init__()
        self.target = torch.nn.Parameter(target, requires_grad=False)

    def forward(self, z, t, y):
        return self.target.expand_as(z)


@pytest.mark.parametrize("method", ["euler", "heun"])
def test_samplers_reach_the_data_point(method):
    target = torch.tensor([0.3, -0.7]).view(1, 2, 1, 1, 1)
    out = sample(_Oracle(target), torch.zeros(3, dtype=torch.long), (2, 1, 1, 1), num_classes=10, steps=8,
                 method=method, t_eps=1e-3, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(out, target.expand(3, -1, -1, -1, -1), atol=1e-5)


class _ClassMean(torch.nn.Module):
    """x_pred = +1 for class 0, -1 for the null class: checks the CFG combination."""

    def __init__(self):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(()), requires_grad=False)

    def forward(self, z, t, y):
        return torch.where(y.view(-1, 1, 1, 1, 1) == 0, 1.0, -1.0).expand_as(z).clone()


def test_cfg_scale_and_interval():
    noise = torch.zeros(1, 1, 1, 1, 1)
    kw = dict(num_classes=10, steps=1, method="euler", noise=noise, t_eps=0.05)
    y = torch.zeros(1, dtype=torch.long)
    # one Euler step at t=0 with z=0: v_c = 1, v_u = -1 -> v = -1 + w*2
    assert sample(_ClassMean(), y, (1, 1, 1, 1), cfg_scale=1.0, **kw).item() == pytest.approx(1.0)
    assert sample(_ClassMean(), y, (1, 1, 1, 1), cfg_scale=0.5, **kw).item() == pytest.approx(0.0)
    # outside the guidance interval the scale is ignored
    assert sample(_ClassMean(), y, (1, 1, 1, 1), cfg_scale=0.5, cfg_interval=(0.5, 1.0), **kw).item() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="sampler.method"):
        sample(_ClassMean(), y, (1, 1, 1, 1), method="rk4", num_classes=10)


class _Recorder(_ClassMean):
    """:class:`_ClassMean` that records, per call, its t values and whether the null class was asked."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, z, t, y):
        self.calls.append((round(float(t[0]), 6), bool((y == 10).any())))
        return super().forward(z, t, y)


@pytest.mark.parametrize("method", ["euler", "heun"])
def test_guidance_interval_boundaries_follow_jit(method):
    """Guided where lo < t < hi (and t = 0 when lo = 0), decided on the exact grid k / steps: with
    20 steps and [0.1, 1] (JiT's ImageNet setting) t = 0.1 lies on the grid and is not guided, though
    float32 rounds it up to 0.10000000149."""
    rec = _Recorder()
    y = torch.zeros(2, dtype=torch.long)
    sample(rec, y, (1, 1, 1, 1), num_classes=10, steps=20, method=method, cfg_scale=2.0,
           cfg_interval=(0.1, 1.0), noise=torch.zeros(2, 1, 1, 1, 1))
    evaluated = {t for t, _ in rec.calls}
    assert 0.1 in evaluated and max(evaluated) == pytest.approx(0.95)  # t = 1 is never evaluated
    assert {t for t, g in rec.calls if g} == {t for t in evaluated if t > 0.1 + 1e-6}
    assert len(rec.calls) == (20 if method == "euler" else 39)
    rec.calls.clear()
    sample(rec, y, (1, 1, 1, 1), num_classes=10, steps=10, method=method, cfg_scale=2.0,
           cfg_interval=(0.0, 0.5), noise=torch.zeros(2, 1, 1, 1, 1))
    assert {t for t, g in rec.calls if g} == {0.0, 0.1, 0.2, 0.3, 0.4}  # t = 0 in, hi = 0.5 out
    assert guided(0.0, (0.0, 1.0)) and not guided(0.0, (0.1, 1.0)) and not guided(1.0, (0.0, 1.0))
    assert guided(0.3, [0.3 - 1e-9, 0.3 + 1e-9]) and not guided(0.3, (0.3, 0.3))


def test_t_uniform_mixture_keeps_other_draws_and_reaches_clean_t():
    from types import SimpleNamespace

    from vitp.objectives.flow import draw_sample_noise

    base = SimpleNamespace(P_mean=-0.8, P_std=0.8, label_drop=0.1, t_uniform=0.0)
    mixed = SimpleNamespace(**{**vars(base), "t_uniform": 0.25})
    ts_base, ts_mixed = [], []
    for seed in range(4000):
        eb, tb, yb = draw_sample_noise((3,), seed, base, 10, 1)
        em, tm, ym = draw_sample_noise((3,), seed, mixed, 10, 1)
        assert torch.equal(eb, em) and yb == ym  # the noise and label drop do not move
        assert tm == tb or 0 <= tm < 1
        ts_base.append(tb)
        ts_mixed.append(tm)
    tb, tm = torch.tensor(ts_base), torch.tensor(ts_mixed)
    changed = (tb != tm).float().mean().item()
    assert 0.21 < changed < 0.29  # about a quarter redrawn
    # the logit-normal (-0.8, 0.8) almost never reaches t > 0.9; a quarter uniform gives ~2.5 %
    assert (tb > 0.9).float().mean().item() < 0.002
    assert 0.015 < (tm > 0.9).float().mean().item() < 0.035
