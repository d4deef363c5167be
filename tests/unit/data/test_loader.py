"""Batch schedule and collate: determinism, dp disjointness, split invariance."""
import pytest
import torch

from tests.helpers import compose_cfg
from vitp.data import build_datasets
from vitp.data.loader import BatchSchedule, train_loader


@pytest.fixture(scope="module")
def setup():
    cfg = compose_cfg(["experiment=smoke"])
    train_ds, _ = build_datasets(cfg.data, cfg.seed)
    return cfg, train_ds


def _batches(cfg, ds, G, mb, dp, rank, steps=3, seed=0):
    sched = BatchSchedule(len(ds), G, mb, dp, seed)
    return list(train_loader(ds, sched, cfg.objective, 10, start_step=0, stop_step=steps, dp_rank=rank))


def test_same_seed_identical_batches(setup):
    cfg, ds = setup
    a, b = _batches(cfg, ds, 8, 4, 1, 0), _batches(cfg, ds, 8, 4, 1, 0)
    assert len(a) == 6
    for (ia, ta), (ib, tb) in zip(a, b):
        for u, v in zip(ia + ta, ib + tb):
            assert torch.equal(u, v)
    c = _batches(cfg, ds, 8, 4, 1, 0, seed=1)
    assert not torch.equal(a[0][0][0], c[0][0][0])


def test_dp_ranks_differ_and_union_equals_single_process(setup):
    cfg, ds = setup
    single = _batches(cfg, ds, 8, 4, 1, 0)
    r0, r1 = _batches(cfg, ds, 8, 4, 2, 0), _batches(cfg, ds, 8, 4, 2, 1)
    assert len(r0) == len(r1) == 3
    for step in range(3):
        # rank r of a 2-way dp run holds micro-batch r of the 1-process run: same samples, same noise
        for rank_batches, micro in ((r0, 0), (r1, 1)):
            (z, t, y), (x, z2, t2) = rank_batches[step]
            (zs, ts, ys), (xs, _, _) = single[2 * step + micro]
            assert torch.equal(z, zs) and torch.equal(t, ts) and torch.equal(y, ys) and torch.equal(x, xs)
        assert not torch.equal(r0[step][1][0], r1[step][1][0])


def test_micro_batch_split_invariance(setup):
    cfg, ds = setup
    a = _batches(cfg, ds, 8, 4, 1, 0, steps=2)  # 2 micro-batches of 4
    b = _batches(cfg, ds, 8, 2, 1, 0, steps=2)  # 4 micro-batches of 2
    za = torch.cat([m[0][0] for m in a])
    zb = torch.cat([m[0][0] for m in b])
    assert torch.equal(za, zb)


def test_label_drop_rate_and_t_distribution(setup):
    cfg, ds = setup
    sched = BatchSchedule(len(ds), 256, 256, 1, 0)
    (z, t, y_in), (x, _, _) = next(iter(train_loader(ds, sched, cfg.objective, 10, start_step=0, stop_step=1, dp_rank=0)))
    drop = (y_in == 10).float().mean().item()
    assert 0.04 < drop < 0.17  # label_drop = 0.1
    logit = torch.log(t / (1 - t))
    assert abs(logit.mean().item() - cfg.objective.P_mean) < 0.15 and abs(logit.std().item() - cfg.objective.P_std) < 0.15
    assert x.shape == (256, 1, 1, 8, 8) and x.min() >= -1 and x.max() <= 1


def test_batch_divisibility_error():
    with pytest.raises(ValueError, match="multiple of trainer.micro_batch_size"):
        BatchSchedule(100, 10, 4, 1, 0)


def test_more_workers_than_cpus_are_cut_to_the_cpus_without_torchs_warning(setup, monkeypatch):
    """data=image_folder's 4 workers on a 2-core machine printed torch's "suggested max number of
    worker" warning: the loader starts one worker per CPU at most (no worker is started here)."""
    import os
    import warnings

    from vitp.data.loader import usable_workers

    cfg, ds = setup
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert usable_workers(0) == 0 and usable_workers(2) == 2 and usable_workers(4) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's UserWarning would fail the test
        loader = train_loader(ds, BatchSchedule(len(ds), 8, 4, 1, 0), cfg.objective, 10, start_step=0, stop_step=1,
                              dp_rank=0, num_workers=4)
        loader.check_worker_number_rationality()  # what torch runs when the workers start
    assert loader.num_workers == 2
