"""pytest configuration: environment for CPU runs, markers, and fixtures shared by the test tree."""
from __future__ import annotations

import os
import tempfile

import pytest

from tests.helpers import TP2PP2, compiled_cases, compose_cfg, reference_cases, reference_rank, run_ranks, train_rank

# trainer.compile=blocks runs share one inductor cache (vitp.models.compiled.CACHE_ENV), kept across
# sessions (inductor keys it by graph, inputs and torch version): equal block graphs compile once;
# set before the ranks' fork server starts
os.environ.setdefault("VITP_COMPILE_CACHE", os.path.join(tempfile.gettempdir(), f"vitp_compile_tests_{os.getuid()}"))


# a test that starts torch.distributed in the pytest process sets MASTER_PORT (init_distributed picks
# a free one and its store keeps listening there); a later subprocess inheriting it would try to
# listen on that same port. RANK / LOCAL_RANK stay: the group lives on in this process.
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT")
_LAUNCH_ENV = {k: os.environ.get(k) for k in _LAUNCH_VARS}


@pytest.fixture(autouse=True)
def _launch_env_restored():
    """After each test, the rendezvous variables are as they were when the session began."""
    yield
    for k, v in _LAUNCH_ENV.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "distributed" in item.path.parts:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


@pytest.fixture
def smoke_cfg():
    return compose_cfg(["experiment=smoke"])


@pytest.fixture(scope="session")
def tp2pp2_run(tmp_path_factory):
    """One uninterrupted :data:`TP2PP2` run: ``(run_dir, per-rank results)``."""
    run = tmp_path_factory.mktemp("tp2pp2") / "run"
    return run, run_ranks(4, train_rank, TP2PP2, str(run))


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory):
    """The recorded cases (``tests/fixtures/reference``) run again: ``{name: (run_dir, rank 0 result)}``,
    from the default init and from the perturbed export, and the perturbed ones with
    ``trainer.compile=blocks`` (``compiled_*``), one process group per world size."""
    base = tmp_path_factory.mktemp("reference")
    out = {}
    for world in (1, 2, 4):
        cases = {**reference_cases("default")[world], **reference_cases("perturbed")[world], **compiled_cases()[world]}
        res = run_ranks(world, reference_rank, cases, str(base))[0]
        out.update({name: (base / name, r) for name, r in res.items()})
    return out
