"""The layout ``vitp-sample`` / ``vitp-eval`` pick under a launcher (:func:`vitp.eval.launch.choose_layout`):
data-parallel replicas of the whole generator when one fits a device (the planner's
:func:`vitp.plan.replica_bytes`), the run's layout otherwise or when a layout key is given. No process
is started."""
from __future__ import annotations

import torch
from omegaconf import OmegaConf

from vitp.config import compose
from vitp.eval.launch import choose_layout, inference_layout, replica_fits
from vitp.models import Generator
from vitp.plan import replica_bytes
from vitp.utils import to_dict

CPU = torch.device("cpu")
RUN = ["parallel.cp=2", "model.width=96", "model.depth=4", "model.num_heads=4"]  # a run trained at cp=2


def _layout(cfg):
    return cfg.parallel.tp, cfg.parallel.cp, cfg.parallel.pp, cfg.parallel.sequence_parallel


def test_replicas_when_the_model_fits(capsys):
    cfg = compose(RUN + ["parallel.tp=2", "parallel.sequence_parallel=true"])
    got = choose_layout(cfg, ["sampler.steps=3", "cli.num=2"], 4, CPU, "vitp-sample")
    assert _layout(got) == (1, 1, 1, False) and _layout(cfg) == (2, 2, 1, True)  # a copy
    lay = inference_layout(got, 4)
    assert (lay.tp, lay.cp, lay.pp, lay.dp) == (1, 1, 1, 4)
    err = capsys.readouterr().err
    assert err.startswith("vitp-sample: layout for sampling: dp=4 (a replica of the whole model fits one device: ")
    assert err.count("\n") == 1 and "set parallel.tp/cp/pp=N to choose another" in err
    choose_layout(cfg, [], 2, CPU, "vitp-eval")
    assert capsys.readouterr().err.startswith("vitp-eval: layout for evaluation: dp=2 ")


def test_a_given_layout_key_keeps_the_runs_layout_with_it(capsys):
    cfg = compose(RUN)
    for given in (["parallel.cp=2"], ["parallel.tp=2"], ["parallel.cp_mode=ring"], ["parallel.sequence_parallel=true"]):
        got = choose_layout(cfg, ["sampler.steps=3", *given], 2, CPU)
        assert _layout(got) == _layout(cfg) == (1, 2, 1, False)
        # said as the chosen one is: a user sees which layout ran (a new user could not tell)
        assert capsys.readouterr().err == (f"vitp-sample: layout for sampling: tp=1 cp=2 (ulysses) pp=1 dp=1 "
                                           f"(given: {given[0]})\n")
    tp2 = compose(RUN + ["parallel.cp=1", "parallel.tp=2", "parallel.sequence_parallel=true"])
    choose_layout(tp2, ["parallel.tp=2"], 4, CPU, "vitp-eval")
    assert capsys.readouterr().err == ("vitp-eval: layout for evaluation: tp=2 cp=1 pp=1 dp=2 with sequence parallel "
                                       "(given: parallel.tp=2)\n")


def test_a_model_too_large_for_one_device_keeps_the_runs_layout(capsys):
    need = replica_bytes(compose(RUN), to_dict(compose(RUN).model))
    cfg = compose(RUN + [f"parallel.auto_memory_gib={need / 2 / 2 ** 30}"])
    fits, need2, limit = replica_fits(cfg, 2, CPU)
    assert not fits and need2 == need and limit == need / 2
    got = choose_layout(cfg, [], 2, CPU)
    assert _layout(got) == (1, 2, 1, False)
    err = capsys.readouterr().err
    assert "layout for sampling: tp=1 cp=2 pp=1 dp=1, the run's (a replica of the whole model does not fit" in err


def test_replica_bytes_counts_the_fp32_weights_and_the_largest_forward():
    cfg = compose(RUN + ["sampler.batch_size=1", "trainer.micro_batch_size=1"])
    params = sum(p.numel() for p in Generator.from_config(cfg.model).parameters())
    one = replica_bytes(cfg, to_dict(cfg.model))
    assert 4 * params < one < 4 * params * 1.1  # the weights dominate one sample's forward
    per_sample = replica_bytes(OmegaConf.merge(cfg, {"sampler": {"batch_size": 2}}), to_dict(cfg.model)) - one
    assert per_sample > 0
    guided = OmegaConf.merge(cfg, {"sampler": {"batch_size": 2, "cfg_scale": 2.0}})  # both passes in one forward
    assert replica_bytes(guided, to_dict(cfg.model)) - one == 3 * per_sample
    held_out = OmegaConf.merge(cfg, {"trainer": {"micro_batch_size": 4}})  # vitp-eval's held-out batch
    assert replica_bytes(held_out, to_dict(cfg.model)) - one == 3 * per_sample
