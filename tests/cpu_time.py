"""pytest plugin: the CPU seconds each test costs, with every process it starts.

``pytest -p tests.cpu_time`` writes ``cpu_times.jsonl`` (or ``$VITP_CPU_TIMES``): one line per
test, ``{"test", "cpu_s", "wall_s"}``. The CPU time is that of the pytest process (an xdist
worker) and of every process below it: the live ones read from ``/proc`` and the exited ones
through their parents' ``cutime`` / ``cstime`` (the ranks' fork server reaps its ranks). Unlike
``--durations``, it does not grow when the other worker loads the cores, so it ranks where the
suite's work goes (docs/testing.md). Linux only.
"""
from __future__ import annotations

import json
import os
import time

import pytest

_TICK = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:
        return []


def _tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid``, its reaped children and every live descendant."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += sum(int(x) for x in fields[11:15]) / _TICK  # utime, stime, cutime, cstime
        todo.extend(_children(p))
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _tree_cpu(os.getpid()), time.perf_counter()
    yield
    row = {"test": item.nodeid, "cpu_s": round(_tree_cpu(os.getpid()) - cpu, 2),
           "wall_s": round(time.perf_counter() - wall, 2)}
    with open(os.environ.get("VITP_CPU_TIMES", "cpu_times.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
