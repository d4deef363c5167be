"""The two process groups shared by this folder's test modules: all tp=2 checks run in one
2-rank spawn and all tp=4 checks in one 4-rank spawn, once per session (process start-up is the
cost); the tests assert on the returned numbers so each variant reports separately."""
from __future__ import annotations

import pytest

from tests.helpers import run_ranks

from .tp_workers import model_cfgs, worker_tp2, worker_tp4


@pytest.fixture(scope="session")
def cfgs():
    return model_cfgs()


@pytest.fixture(scope="session")
def tp2(cfgs):
    return run_ranks(2, worker_tp2, cfgs)


@pytest.fixture(scope="session")
def tp4(cfgs):
    return run_ranks(4, worker_tp4, cfgs)
