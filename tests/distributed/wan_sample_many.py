"""``vitp-sample`` of several Wan sources in one torchrun launch (``python -m
tests.distributed.wan_sample_many '[[argv...], [argv...]]'``): each argv list is run by
:func:`vitp.cli.sample.main` in turn on every rank, as ``torchrun -m vitp.cli.sample ARGV`` runs it,
sharing the launch's process group (its close, :func:`vitp.eval.launch.finish`, is deferred to the
end: a group cannot be started again under the same torchrun store). One launch per layout then
covers Wan 2.1, Wan 2.2 A14B's two experts and TI2V (tests/distributed/test_sample_cli.py)."""
from __future__ import annotations

import json
import sys

import vitp.eval.launch as launch
from vitp.cli.sample import main


def run_all(argvs) -> None:
    finish, launch.finish = launch.finish, lambda: None
    try:
        for argv in argvs:
            main(list(argv))
    finally:
        launch.finish = finish
        finish()


if __name__ == "__main__":
    run_all(json.loads(sys.argv[1]))
