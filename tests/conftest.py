"""pytest configuration: environment for CPU runs, markers, and fixtures shared by the test tree."""
from __future__ import annotations

import os
import sys
import tempfile

import pytest

from tests.helpers import (TP2PP2, compiled_cases, compose_cfg, lora_cases, reference_cases, reference_rank, run_ranks,
                           train_rank)

# PYTHONDONTWRITEBYTECODE (set on some machines) made every fresh interpreter the suite starts (about
# 270: the CLIs, launchers' ranks, scripts) compile vitp's own source again, about 0.4 s each; the
# suite lets Python keep its bytecode (__pycache__/, ignored by git), as it does by default
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# trainer.compile=blocks runs share one inductor cache (vitp.models.compiled.CACHE_ENV), kept across
# sessions (inductor keys it by graph, inputs and torch version): equal block graphs compile once;
# set before the ranks' fork server starts
os.environ.setdefault("VITP_COMPILE_CACHE", os.path.join(tempfile.gettempdir(), f"vitp_compile_tests_{os.getuid()}"))


# a test that starts torch.distributed in the pytest process sets MASTER_PORT (init_distributed picks
# a free one and its store keeps listening there); a later subprocess inheriting it would try to
# listen on that same port. RANK / LOCAL_RANK stay: the group lives on in this process.
_LAUNCH_VARS = ("MASTER_ADDR", "MASTER_PORT")
_LAUNCH_ENV = {k: os.environ.get(k) for k in _LAUNCH_VARS}


def _drop_handlers_on_closed_streams() -> None:
    import logging

    for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for h in list(getattr(lg, "handlers", [])):
            if getattr(getattr(h, "stream", None), "closed", False):
                lg.removeHandler(h)


@pytest.fixture(autouse=True)
def _no_log_handler_on_a_closed_stream():
    """An in-process run (Hydra's job logging, a toolkit's logger) leaves handlers writing to the
    stderr its test captured; once that is closed, a later test's record on the same worker
    printed a logging error with its traceback into that test's stderr (which depends on the
    work units' order). Such handlers are dropped before and after each test."""
    _drop_handlers_on_closed_streams()
    yield
    _drop_handlers_on_closed_streams()


@pytest.fixture(autouse=True)
def _skip_warnings_said_afresh():
    """A skipped file is warned about once per process (vitp.data.base.SKIPS_SAID); each test starts
    as a fresh process would, so that one test's skip warning does not silence another's."""
    base = sys.modules.get("vitp.data.base")  # not imported here: a test may check what an import pulls in
    if base is not None:
        base.SKIPS_SAID.clear()
    yield


@pytest.fixture(autouse=True)
def _launch_env_restored():
    """After each test, the rendezvous variables are as they were when the session began."""
    yield
    for k, v in _LAUNCH_ENV.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


# Work units of pytest-xdist (pytest_xdist_make_scheduler below): a file's tests run on one worker, so its
# module fixtures (the spawned process groups) are built once; files sharing session fixtures
# (the reference runs, a folder's conftest groups) form one unit.
_SHARED = {
    "tests/distributed/test_pipeline.py": "reference_runs", "tests/distributed/test_checkpoint.py": "reference_runs",
    "tests/distributed/test_reference.py": "reference_runs", "tests/distributed/test_lora_generator.py": "reference_runs",
    "tests/distributed/parallel": "parallel_groups", "tests/unit/text": "text_encoder",
}
# CPU seconds each unit took in a run of the suite (``pytest -p tests.cpu_time``, 2026-12-06;
# docs/testing.md); units start longest first so that no long one is left for the end. Units not
# listed count by folder.
_COST = {
    "tests/distributed/test_sample_cli.py": 230, "parallel_groups": 191, "reference_runs": 167,
    "tests/unit/test_scripts.py": 152, "tests/distributed/test_sagemaker_toolkit.py": 145,
    "tests/distributed/test_multinode.py": 129, "tests/distributed/test_context_parallel.py": 105,
    "tests/distributed/test_plan_validation.py": 83, "tests/distributed/test_sampling_parity.py": 67,
    "tests/distributed/test_text_train.py": 52, "tests/unit/test_config.py": 49,
    "tests/distributed/test_reshard.py": 49, "tests/distributed/test_launchers.py": 45,
    "tests/distributed/test_train.py": 38, "tests/distributed/test_video_train.py": 35,
    "tests/unit/test_wan_quality.py": 34, "tests/distributed/test_latents_train.py": 34,
    "tests/distributed/test_rundir.py": 34, "tests/distributed/test_text_data.py": 32,
    "tests/unit/test_rundir.py": 27, "tests/unit/test_fvd.py": 25, "tests/distributed/test_sweep.py": 24,
    "tests/unit/test_latents.py": 24, "tests/distributed/test_partial_sync_run.py": 22,
    "tests/distributed/test_shapes.py": 22,
}


def unit_of(nodeid: str) -> str:
    """The work unit of a test: its file, or the ``_SHARED`` name of the folder or file it is in."""
    path = nodeid.split("::", 1)[0]
    for prefix, name in _SHARED.items():
        if path == prefix or path.startswith(prefix + "/"):
            return name
    return path


def _unit(item) -> str:
    return unit_of(item.path.relative_to(item.config.rootpath).as_posix())


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with our work units as the scopes: each unit's tests go to one
    worker, in one batch, units in the collection order (longest first). Not ``--dist loadgroup``
    with ``xdist_group`` marks: pytest-xdist 3.8 groups by a suffix it writes into
    ``item._nodeid``, which pytest 9.2 no longer reads (nodeids come from ``item._id``), so every
    test became its own scope and a file's module fixtures were built on both workers."""
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

    return UnitScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "distributed" in item.path.parts:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    units = {id(item): _unit(item) for item in items}
    order = {id(item): i for i, item in enumerate(items)}

    def key(item):
        unit = units[id(item)]
        return -_COST.get(unit, 10 if "distributed" in item.path.parts else 1), unit, order[id(item)]

    items.sort(key=key)


def pytest_configure(config):
    """An xdist worker computes on one thread (and so do its subprocesses): two workers on a
    2-core machine, each spinning up threads for both cores, run many times slower."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


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
    from the default init and from the perturbed export, the perturbed ones with
    ``trainer.compile=blocks`` (``compiled_*``) and the generator's LoRA runs (``lora_*``,
    :func:`tests.helpers.lora_cases`), one process group per world size."""
    base = tmp_path_factory.mktemp("reference")
    out = {}
    for world in (1, 2, 4):
        cases = {**reference_cases("default")[world], **reference_cases("perturbed")[world], **compiled_cases()[world],
                 **lora_cases(str(base))[world]}
        res = run_ranks(world, reference_rank, cases, str(base))[0]
        out.update({name: (base / name, r) for name, r in res.items()})
    return out
