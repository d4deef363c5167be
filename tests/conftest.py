"""Shared test helpers: config composition and multi-process runs (gloo, CPU)."""
from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

import multiprocessing as mp  # noqa: E402
import socket  # noqa: E402
import traceback  # noqa: E402

import pytest  # noqa: E402

from vitp.config import compose as compose_cfg  # noqa: E402,F401


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, fn, args, queue):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, fn(rank, *args), None))
    except BaseException:  # report to the parent instead of hanging it
        queue.put((rank, None, traceback.format_exc()))


def run_ranks(world: int, fn, *args, timeout: float = 300):
    """Run ``fn(rank, *args)`` in ``world`` fresh processes forming one gloo group; returns the
    results ordered by rank. ``fn`` must be importable (module level)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, res, err = queue.get(timeout=timeout)
            if err:
                raise AssertionError(f"rank {rank} failed:\n{err}")
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]


@pytest.fixture
def smoke_cfg():
    return compose_cfg(["experiment=smoke"])
